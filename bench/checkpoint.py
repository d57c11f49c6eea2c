"""`checkpoint.async_save`: the training stall per checkpoint (the time the training thread spends in the save
call: the host snapshot) against the time of a synchronous save of the same model, measured in the same process
(target: ratio <= 0.10). One process, fp32, a model large enough that writing takes seconds.

    python bench/checkpoint.py                     # torch (legacy) and torch_dist, 4 checkpoints each
    python bench/checkpoint.py --format torch --hidden 1024 --layers 12

The first asynchronous save also allocates the host buffers that later saves reuse; it is printed apart. `left to
wait` is what remained of a background write when the next save came (0: the steps between covered it). `steps
during write` is the step time while a write runs against the step time without one (the writer competes for the
same cores; on a GPU the steps run on the device)."""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from qlm_core.config import OptimConfig, ParallelConfig
from qlm_core.models.presets import PRESETS
from qlm_core.parallel.state import Grid
from qlm_core.train.async_checkpoint import CheckpointSaver
from qlm_core.train.checkpointing import TrainState, save_checkpoint
from qlm_core.train.engine import Batch, Engine

SEQ = 16


def build(hidden: int, layers: int, vocab: int) -> Engine:
    heads = hidden // 64
    spec = PRESETS["qlm-tiny"].replace(hidden_size=hidden, ffn_hidden_size=hidden * 8 // 3 // 64 * 64,
                                       num_layers=layers, vocab_size=vocab, num_attention_heads=heads,
                                       num_query_groups=max(1, heads // 4), kv_channels=64)
    return Engine(spec, ParallelConfig(), Grid.single(), micro_batch_size=1, global_batch_size=1, seq_length=SEQ,
                  dtype=torch.float32, optim=OptimConfig(), source=None, seed=0)


def batch(vocab: int) -> Batch:
    tokens = torch.randint(0, vocab, (1, SEQ + 1), generator=torch.Generator().manual_seed(0))
    return Batch(tokens[:, :-1].clone(), tokens[:, 1:].clone(), None, None)


def timed_steps(engine: Engine, data: Batch, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        engine.train_step(data, 1e-4)
        times.append(time.perf_counter() - started)
    return times


def bench_format(engine: Engine, data: Batch, fmt: str, saves: int, steps_between: int, root: Path) -> dict:
    sync_times, iteration = [], 0
    for _ in range(saves):
        timed_steps(engine, data, 1)
        iteration += 1
        started = time.perf_counter()
        save_checkpoint(root / f"sync-{fmt}", engine, TrainState(iteration=iteration), 1, {}, fmt)
        sync_times.append(time.perf_counter() - started)
    quiet_steps = timed_steps(engine, data, steps_between)
    saver = CheckpointSaver(asynchronous=True)
    stalls, waits, busy_steps = [], [], []
    for _ in range(saves):
        iteration += 1
        started = time.perf_counter()
        saver.save(root / f"async-{fmt}", engine, TrainState(iteration=iteration), 1, {}, fmt)
        stalls.append(time.perf_counter() - started)
        busy_steps += timed_steps(engine, data, steps_between)
        started = time.perf_counter()
        saver.wait()
        waits.append(time.perf_counter() - started)
    saver.close()
    size = sum(p.stat().st_size for p in (root / f"async-{fmt}").rglob("*") if p.is_file())
    return {"sync": sync_times, "stalls": stalls, "waits": waits, "bytes": size,
            "quiet_step": statistics.median(quiet_steps), "busy_step": statistics.median(busy_steps)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--format", choices=["torch", "torch_dist", "both"], default="both")
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--saves", type=int, default=4)
    parser.add_argument("--steps-between", type=int, default=6, help="training steps after each asynchronous save")
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args()
    engine, data = build(args.hidden, args.layers, args.vocab), batch(args.vocab)
    params = sum(p.numel() for p in engine.params)
    root = Path(tempfile.mkdtemp(prefix="qlm-bench-ckpt-", dir=args.dir))
    print(f"async_save: {params / 1e6:.1f}M parameters, fp32, one process, {torch.get_num_threads()} threads; "
          f"writing under {root}")
    print(f"{'format':>10} {'ckpt GB':>8} {'sync save':>10} {'stall':>8} {'first stall':>11} {'left to wait':>12} "
          f"{'steps during write':>19} {'stall ratio':>11}")
    try:
        for fmt in ("torch", "torch_dist") if args.format == "both" else (args.format,):
            r = bench_format(engine, data, fmt, args.saves, args.steps_between, root)
            sync, stall = statistics.median(r["sync"]), statistics.median(r["stalls"][1:] or r["stalls"])
            print(f"{fmt:>10} {r['bytes'] / 2**30:>8.2f} {sync:>9.2f}s {stall:>7.3f}s {r['stalls'][0]:>10.3f}s "
                  f"{statistics.median(r['waits']):>11.3f}s {r['busy_step'] / r['quiet_step']:>18.2f}x "
                  f"{stall / sync:>11.3f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print("  target: stall ratio (median stall of the saves after the first / median synchronous save) <= 0.10")


if __name__ == "__main__":
    main()
