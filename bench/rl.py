"""RL throughput: qlm's GRPO step against TRL's GRPOTrainer on the same tiny model, prompts and sampling, in one run;
and qlm's weight sync against a plain in-memory copy of the same bytes.

    python bench/rl.py                 # hidden 256, 4 layers; 16 prompts x 8 completions a step, 12 new tokens
    python bench/rl.py --steps 6 --hidden 512 --layers 8

Both train the same random Qwen2-shaped HF model (qlm's demo tokenizer) on the demo's RL prompts (chat template,
exact-answer reward), at temperature 1, DAPO's loss, beta 0, fp32, one optimizer step per rollout batch, on this
CPU with the same threads. qlm runs `qlm train`'s Trainer; TRL runs GRPOTrainer (transformers' generate). The first
step of each is a warm-up and not counted. Prints, per side: rollout tokens/s (completion tokens sampled per second
of generation), whole-step samples/s (completions per second of the step: sync + rollout + training), where the
step's time goes, and the ratios of each side's best round (target >= 2 for both; the sides alternate which runs
first, as this machine's speed wanders between runs); then the weight sync's seconds against torch's copy of the
same tensors (target <= 1.5x).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from eval import build_model  # noqa: E402  (bench/eval.py: a random Qwen2 shape with the demo tokenizer)

RECIPE = """
[model]
spec = "{model}"
load = "{model}"
dtype = "fp32"
[data]
kind = "rl"
train = ["{prompts}"]
valid_fraction = 0.0
seq_length = {seq_length}
cache_dir = "{cache}"
[rl]
num_generations = {generations}
max_completion_length = {new_tokens}
temperature = 1.0
loss_type = "dapo"
[train]
micro_batch_size = {batch}
global_batch_size = {batch}
train_iters = {steps}
eval_interval = 0
[optim]
lr = 1e-5
weight_decay = 0.0
[schedule]
lr_schedule = "constant"
[logging]
tensorboard = false
plot = false
"""


def run_qlm(root: Path, model: Path, prompts: Path, args, name: str = "qlm-run") -> dict:
    from qlm_core.config import load_recipe
    from qlm_core.train.trainer import Trainer

    recipe_path = root / "qlm.toml"
    recipe_path.write_text(RECIPE.format(model=model, prompts=prompts, cache=root / "cache",
                                         generations=args.generations, new_tokens=args.new_tokens,
                                         batch=args.prompts * args.generations, steps=args.steps,
                                         seq_length=20 + args.new_tokens))  # the demo's prompts: under 20 tokens
    Trainer(load_recipe(recipe_path), root / name).run()
    rows = [json.loads(line) for line in (root / name / "metrics.jsonl").read_text().splitlines()][1:]
    step = sum(r["step_time_s"] for r in rows)
    sync = sum(r["time/weight_sync_s"] for r in rows)
    rollout = sum(r["time/rollout_s"] for r in rows)
    tokens = sum(r["completions/mean_length"] * args.prompts * args.generations for r in rows)
    return {"steps": len(rows), "step_s": step, "sync_s": sync, "rollout_s": rollout, "train_s": step - sync - rollout,
            "tokens": tokens, "reward": statistics.mean(r["reward"] for r in rows)}


def exact_answer(prompts, completions, answer, **kwargs):
    return [1.0 if c[0]["content"].strip() == a.strip() else 0.0 for c, a in zip(completions, answer, strict=True)]


def run_trl(root: Path, model: Path, prompts: Path, args, name: str = "trl-run") -> dict:
    import datasets
    import transformers
    from trl import GRPOConfig, GRPOTrainer

    records = [json.loads(line) for line in prompts.read_text().splitlines()]
    dataset = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}],
                                           "answer": r["answer"]} for r in records])
    batch = args.prompts * args.generations
    config = GRPOConfig(output_dir=str(root / name), per_device_train_batch_size=batch,
                        gradient_accumulation_steps=1, num_generations=args.generations,
                        max_completion_length=args.new_tokens, temperature=1.0, loss_type="dapo", beta=0.0,
                        learning_rate=1e-5, weight_decay=0.0, lr_scheduler_type="constant", max_steps=args.steps,
                        logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, bf16=False,
                        disable_dropout=True, seed=0, num_iterations=1)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model)
    trainer = GRPOTrainer(model=str(model), reward_funcs=[exact_answer], args=config, train_dataset=dataset,
                          processing_class=tokenizer)
    generation, steps, tokens = [], [], []
    inner = trainer._generate_single_turn

    def timed(*a, **k):
        started = time.perf_counter()
        out = inner(*a, **k)
        generation.append(time.perf_counter() - started)
        completion_ids = out[0]  # TRL 1.16: (completion_ids, logprobs or None)
        tokens.append(sum(len(ids) for ids in completion_ids))
        return out

    trainer._generate_single_turn = timed

    class StepClock(transformers.TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.started = time.perf_counter()

        def on_step_end(self, *a, **k):
            steps.append(time.perf_counter() - self.started)

    trainer.add_callback(StepClock())
    trainer.train()
    step, rollout = sum(steps[1:]), sum(generation[1:])
    return {"steps": len(steps) - 1, "step_s": step, "sync_s": 0.0, "rollout_s": rollout, "train_s": step - rollout,
            "tokens": sum(tokens[1:]), "reward": float("nan")}


def sync_ratio(model: Path, repeats: int = 5) -> tuple[float, float]:
    """Seconds of qlm's weight sync at a step after the first (the trainer's shards -> whole tensors -> the rollout
    model, refilled) against copying the same tensors in memory (each into a new tensor of its shape)."""
    from qlm_core.config import ModelConfig, OptimConfig, ParallelConfig
    from qlm_core.parallel.state import Grid
    from qlm_core.train.engine import Engine
    from qlm_core.train.sources import resolve_model
    from qlm_core.train.weight_sync import WeightSync, sync_rollout_model

    source = resolve_model(ModelConfig(spec=str(model), load=str(model), dtype="fp32"))
    engine = Engine(source.spec, ParallelConfig(), Grid.single(), micro_batch_size=1, global_batch_size=1,
                    seq_length=32, dtype=torch.float32, optim=OptimConfig(), source=source.weights)
    tensors = {k: v.detach() for k, v in engine.chunks[0].state_dict().items() if isinstance(v, torch.Tensor)}
    synced, copied = [], []
    sync = WeightSync(engine)  # kept by the run, as train/rollout_batches.py does: who sends what is planned once
    model = sync_rollout_model(sync, None, builds=True)  # the first step builds it; the others refill it
    for _ in range(repeats):
        started = time.perf_counter()
        sync_rollout_model(sync, model, builds=True)
        synced.append(time.perf_counter() - started)
        started = time.perf_counter()
        copy = {k: torch.empty_like(v) for k, v in tensors.items()}
        for k, v in tensors.items():
            copy[k].copy_(v)
        copied.append(time.perf_counter() - started)
    return min(synced), min(copied)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=12)
    parser.add_argument("--steps", type=int, default=4, help="steps of each (the first is a warm-up)")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each side, alternating which goes first")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)))
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = build_model(root, args.hidden, args.layers)
        from qlm_core.data.demo import build_demo

        prompts = build_demo(root / "demo", num_train=200, num_eval=5, corpus_paragraphs=20).rl
        runs = {"qlm": [], "trl": []}
        for round_ in range(args.rounds):  # alternating which side goes first: a busy spell hits both alike
            order = ("qlm", "trl") if round_ % 2 == 0 else ("trl", "qlm")
            for side in order:
                run = run_qlm if side == "qlm" else run_trl
                runs[side].append(run(root, model, prompts, args, f"{side}-run-{round_}"))
        sync_s, copy_s = sync_ratio(model)
    batch = args.prompts * args.generations
    print(f"model hidden {args.hidden}, {args.layers} layers; {args.prompts} prompts x {args.generations} "
          f"completions a step, <= {args.new_tokens} new tokens; {runs['qlm'][0]['steps']} timed steps each, "
          f"{args.rounds} rounds; {torch.get_num_threads()} threads")
    print(f"{'':10} {'rollout tok/s':>14} {'samples/s':>10} {'sync s':>8} {'rollout s':>10} {'train s':>8}")
    for round_ in range(args.rounds):
        for side in ("qlm", "trl"):
            r = runs[side][round_]
            print(f"{side} {round_ + 1:<6} {r['tokens'] / r['rollout_s']:14.1f} "
                  f"{batch * r['steps'] / r['step_s']:10.2f} {r['sync_s'] / r['steps']:8.3f} "
                  f"{r['rollout_s'] / r['steps']:10.3f} {r['train_s'] / r['steps']:8.3f}")
    # each side's best round (this machine's speed wanders by ~20% between runs)
    rollout = {side: max(r["tokens"] / r["rollout_s"] for r in rs) for side, rs in runs.items()}
    step = {side: max(r["steps"] / r["step_s"] for r in rs) for side, rs in runs.items()}
    print(f"qlm / trl, each side's best round: rollout tokens/s {rollout['qlm'] / rollout['trl']:.2f}x, "
          f"whole-step samples/s {step['qlm'] / step['trl']:.2f}x (target >= 2)")
    print(f"weight sync {sync_s * 1e3:.1f} ms vs an in-memory copy of the same tensors {copy_s * 1e3:.1f} ms: "
          f"{sync_s / copy_s:.2f}x (target <= 1.5)")


if __name__ == "__main__":
    main()
