"""Evaluation throughput: requests/s of qlm's lm-eval backend against lm-eval's own `hf` backend on the same model
(a random Qwen2 shape with qlm's demo tokenizer, saved as an HF checkpoint) and the same tasks, in the same run.

    python bench/eval.py          # hidden 512, 8 layers; qlm_demo_mc, qlm_demo_ppl, qlm_demo_gen, bench_mc_fewshot
    python bench/eval.py --limit 100 --batch-size 16

bench_mc_fewshot is a multiple-choice mix written here (nothing is downloaded): few-shot contexts of about
--fewshot-tokens tokens (solved examples of the demo's list tasks, then the question) and 4 choices of 5-20 tokens,
where sharing each context among its choices pays (qlm_core/eval/prefix_cache.py).

Models are built before the clock starts; each backend then runs lm_eval.simple_evaluate on each task's requests
(twice, alternating; the faster run of each counts). Prints requests/s of each per task, the ratio (target >= 1.5 on
bench_mc_fewshot, >= 1.0 on the others) and whether both backends' metrics are equal.
"""

from __future__ import annotations

import argparse
import json
import os
import random
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


FEWSHOT_TASK = "bench_mc_fewshot"
FEWSHOT_YAML = """task: bench_mc_fewshot
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
target_delimiter: " "
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""
SYMBOLS = "abcdefgh0123456789"


def _example(rng: random.Random) -> tuple[str, list[str], int]:
    """A list question of the demo's kinds with 4 answers of 4-12 symbols (about 5-20 tokens of the demo tokenizer)."""
    items = rng.choices(SYMBOLS, k=rng.randint(4, 12))
    kind = rng.choice(["Reverse", "Sort", "Repeat"])
    answer = {"Reverse": items[::-1], "Sort": sorted(items), "Repeat": items}[kind]
    choices = {" ".join(answer)}
    while len(choices) < 4:
        choices.add(" ".join(rng.choices(SYMBOLS, k=len(items))))
    choices = sorted(choices)
    return f"{kind}: {' '.join(items)}\nAnswer:", choices, choices.index(" ".join(answer))


def write_fewshot_task(out_dir: Path, tokenizer, limit: int, context_tokens: int, seed: int = 0) -> Path:
    """bench_mc_fewshot's data and YAML under out_dir (an lm-eval include path)."""
    rng = random.Random(seed)
    docs = []
    for _ in range(limit):
        shots = []
        while True:  # solved examples while they fit in context_tokens
            question, choices, label = _example(rng)
            if len(tokenizer.encode("\n\n".join(shots + [f"{question} {choices[label]}"]))) > context_tokens:
                break
            shots.append(f"{question} {choices[label]}")
        question, choices, label = _example(rng)
        docs.append({"context": "\n\n".join(shots + [question]), "choices": choices, "label": label})
    out_dir.mkdir(parents=True, exist_ok=True)
    data = out_dir / f"{FEWSHOT_TASK}.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    (out_dir / f"{FEWSHOT_TASK}.yaml").write_text(FEWSHOT_YAML.format(data=data.resolve()))
    return out_dir


def same_metrics(ours: dict, theirs: dict, tolerance: float = 1e-4) -> bool:
    """Every metric of lm-eval's results table equal within `tolerance` (relative)."""
    def numbers(results):
        return {(task, key): value for task, metrics in results["results"].items() for key, value in metrics.items()
                if isinstance(value, (int, float)) and "stderr" not in key}

    a, b = numbers(ours), numbers(theirs)
    return bool(a) and a.keys() == b.keys() and all(abs(a[k] - b[k]) <= tolerance * max(1.0, abs(b[k])) for k in a)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--limit", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--tasks", default=f"qlm_demo_mc,qlm_demo_ppl,qlm_demo_gen,{FEWSHOT_TASK}")
    parser.add_argument("--fewshot-tokens", type=int, default=500, help="context length of bench_mc_fewshot")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each backend per task (the fastest counts)")
    args = parser.parse_args()

    import lm_eval
    from lm_eval.models.huggingface import HFLM

    from qlm_core.eval.lm import QlmLM
    from qlm_core.eval.runner import EvalConfig, task_manager

    root = Path(tempfile.mkdtemp(prefix="qlm-bench-eval-"))
    hf_dir = build_model(root, args.hidden, args.layers)
    tasks = args.tasks.split(",")
    backends = {
        "hf": HFLM(pretrained=str(hf_dir), device="cpu", dtype="float32", batch_size=args.batch_size),
        "qlm": QlmLM(str(hf_dir), batch_size=args.batch_size, dtype="fp32", device="cpu"),
    }
    include = write_fewshot_task(root / "bench-tasks", backends["qlm"].tokenizer, args.limit, args.fewshot_tokens)
    manager = task_manager(EvalConfig(checkpoint=str(hf_dir), tasks=tasks, cache_dir=str(root / "tasks"),
                                      include_path=str(include)))
    print(f"model: hidden {args.hidden}, {args.layers} layers, fp32, {torch.get_num_threads()} threads; "
          f"limit {args.limit}, batch {args.batch_size}, best of {args.repeats}")
    for task in tasks:
        best, requests, results = {}, {}, {}
        for _ in range(args.repeats):
            for name, model in backends.items():
                start = time.perf_counter()
                results[name] = lm_eval.simple_evaluate(model=model, tasks=[task], limit=args.limit,
                                                        task_manager=manager, log_samples=True)
                seconds = time.perf_counter() - start
                best[name] = min(best.get(name, float("inf")), seconds)
                requests[name] = sum(len(s["resps"]) for samples in results[name]["samples"].values()
                                     for s in samples)
        target = 1.5 if task == FEWSHOT_TASK else 1.0
        rates = "  ".join(f"{name} {requests[name] / best[name]:7.1f} req/s ({best[name]:.2f} s)" for name in backends)
        print(f"  {task:18s} {requests['qlm']:4d} requests  {rates}  ratio qlm / hf = {best['hf'] / best['qlm']:.2f} "
              f"(target >= {target})  metrics equal: {same_metrics(results['qlm'], results['hf'])}")

if __name__ == "__main__":
    main()
