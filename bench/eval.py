"""Evaluation throughput: requests/s of qlm's lm-eval backend against lm-eval's own `hf` backend on the same model
(a random Qwen2 shape with qlm's demo tokenizer, saved as an HF checkpoint) and the same tasks, in the same run.

    python bench/eval.py                          # hidden 512, 8 layers; qlm_demo_mc + qlm_demo_ppl + qlm_demo_gen
    python bench/eval.py --limit 100 --batch-size 16

Models are built before the clock starts; each backend then runs lm_eval.simple_evaluate on the same requests
(twice, alternating; the faster run of each counts). Prints requests/s of each and the ratio (target >= 1.0).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def build_model(root: Path, hidden: int, layers: int) -> Path:
    import transformers

    from qlm_core.data.demo import build_demo
    from qlm_core.models.presets import PRESETS

    paths = build_demo(root / "demo", num_train=200, num_eval=5, corpus_paragraphs=20)
    spec = PRESETS["qlm-tiny"].replace(hidden_size=hidden, ffn_hidden_size=hidden * 11 // 4, num_layers=layers,
                                       num_attention_heads=hidden // 64, num_query_groups=max(hidden // 256, 1),
                                       kv_channels=64)
    config = {k: v for k, v in spec.to_hf_config("float32").items() if k != "architectures"}
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config))
    model.save_pretrained(root / "hf")
    for file in paths.tokenizer.iterdir():
        (root / "hf" / file.name).write_bytes(file.read_bytes())
    return root / "hf"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--limit", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--tasks", default="qlm_demo_mc,qlm_demo_ppl,qlm_demo_gen")
    args = parser.parse_args()

    import lm_eval
    from lm_eval.models.huggingface import HFLM

    from qlm_core.eval.lm import QlmLM
    from qlm_core.eval.runner import EvalConfig, task_manager

    root = Path(tempfile.mkdtemp(prefix="qlm-bench-eval-"))
    hf_dir = build_model(root, args.hidden, args.layers)
    tasks = args.tasks.split(",")
    manager = task_manager(EvalConfig(checkpoint=str(hf_dir), tasks=tasks, cache_dir=str(root / "tasks")))
    backends = {
        "hf": HFLM(pretrained=str(hf_dir), device="cpu", dtype="float32", batch_size=args.batch_size),
        "qlm": QlmLM(str(hf_dir), batch_size=args.batch_size, dtype="fp32", device="cpu"),
    }
    best, requests = {}, {}
    for _ in range(2):
        for name, model in backends.items():
            start = time.perf_counter()
            results = lm_eval.simple_evaluate(model=model, tasks=tasks, limit=args.limit, task_manager=manager,
                                              log_samples=True)
            seconds = time.perf_counter() - start
            best[name] = min(best.get(name, float("inf")), seconds)
            requests[name] = sum(len(s["resps"]) for samples in results["samples"].values() for s in samples)
    print(f"model: hidden {args.hidden}, {args.layers} layers, fp32, {torch.get_num_threads()} threads; tasks "
          f"{args.tasks}, limit {args.limit}, batch {args.batch_size}; {requests['qlm']} requests")
    for name in backends:
        print(f"  {name:4s} backend  {requests[name] / best[name]:8.1f} requests/s  ({best[name]:.2f} s)")
    print(f"  ratio qlm / hf = {best['hf'] / best['qlm']:.2f}  (target >= 1.0)")


if __name__ == "__main__":
    main()
