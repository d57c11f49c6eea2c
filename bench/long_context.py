"""Long context on CPU: packed sequences (8 documents) against the same tokens unpacked, and the loss with and without
chunking, each measured in a fresh process (peak RSS is a process-wide high-water mark).

    python bench/long_context.py                       # seq 4k, 16k, 32k; one process and a CP2 launch; the loss
    python bench/long_context.py --seqs 4096 --no-cp   # quicker

Attention: a qlm-tiny-shaped model (4 layers, hidden 128, 4 heads / 2 groups, fp32), one forward + backward of one
sequence after a warm-up step. Peak RSS is the step's high-water mark above the RSS just before it (the model and the
batch are already built), so it is what the step itself needs. Targets: packed / unpacked peak <= 1.25 and time <= 1.0
at 16k and 32k (attention confined to documents is sum(len^2) work, not s^2).
Loss: the loss head alone (embedding, final norm, output projection + vocab cross entropy; no layers) on one
sequence of 16k tokens at vocabulary 32k and 152k, train.loss_chunk_tokens 2048 against 0 (off), after a warm-up step
on a quarter of the sequence; peak and time ratios are chunked / unchunked. Target: chunked peak <= 1/4 of unchunked
at vocabulary 152k.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

DOCS = 8
LOSS_SEQ, LOSS_CHUNK = 16384, 2048


def _rss_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak():
    """Linux: writing 5 to clear_refs resets the peak RSS (VmHWM) to the current RSS."""
    Path("/proc/self/clear_refs").write_text("5")


def _document_lengths(seq: int, generator: torch.Generator) -> list[int]:
    weights = torch.rand(DOCS, generator=generator) + 0.5
    lengths = (weights / weights.sum() * seq).long().tolist()
    lengths[-1] += seq - sum(lengths)
    return lengths


def attention_worker(args) -> dict:
    import torch.distributed as dist

    from qlm_core.models.gpt import GPTModel, ParallelOptions
    from qlm_core.models.presets import PRESETS
    from qlm_core.parallel.context_parallel import split_for_cp

    torch.manual_seed(0)
    spec = dataclasses.replace(PRESETS["qlm-tiny"], max_position_embeddings=args.seq)
    group, rank = None, 0
    if args.cp > 1:
        dist.init_process_group("gloo")
        group, rank = dist.group.WORLD, dist.get_rank()
    model = GPTModel(spec, parallel=ParallelOptions(cp_group=group, cp_comm_type=args.cp_comm_type))
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, spec.vocab_size, (1, args.seq + 1), generator=generator)
    ids, labels = ids[:, :-1], ids[:, 1:]
    positions = segments = None
    if args.packed:
        lengths = _document_lengths(args.seq, generator)
        segments = torch.repeat_interleave(torch.arange(DOCS), torch.tensor(lengths))[None]
        positions = torch.cat([torch.arange(n) for n in lengths])[None]
    else:
        positions = torch.arange(args.seq)[None]

    def local(t):
        return None if t is None else split_for_cp(t, args.cp, rank, 1).contiguous()

    ids, labels, positions, segments = (local(t) for t in (ids, labels, positions, segments))

    def step():
        model.zero_grad(set_to_none=True)
        model(ids, positions, segment_ids=segments, labels=labels).mean().backward()

    step()  # warm-up (allocator, kernels)
    model.zero_grad(set_to_none=True)
    before = _rss_bytes("VmRSS")
    _reset_peak()
    start = time.perf_counter()
    step()
    seconds = time.perf_counter() - start
    peak = _rss_bytes("VmHWM") - before
    if args.cp > 1:
        both = torch.tensor([seconds, float(peak)], dtype=torch.float64)
        dist.all_reduce(both, op=dist.ReduceOp.MAX)
        seconds, peak = both.tolist()
        dist.destroy_process_group()
    return {"seconds": seconds, "peak_bytes": peak, "rank": rank}


def loss_worker(args) -> dict:
    from qlm_core.models.gpt import GPTModel
    from qlm_core.models.presets import PRESETS

    torch.manual_seed(0)
    spec = dataclasses.replace(PRESETS["qlm-tiny"], vocab_size=args.vocab, max_position_embeddings=args.seq)
    model = GPTModel(spec, num_layers=0, loss_chunk_tokens=args.chunk)
    ids = torch.randint(0, spec.vocab_size, (1, args.seq + 1), generator=torch.Generator().manual_seed(1))
    # warm-up (allocator, kernels) on a quarter of the sequence, still in chunks when chunked: a full-size one would
    # double the unchunked 152k case's time and have its ~9 GiB allocated twice in one process
    warm = args.seq // 4 + 1
    model(ids[:, :warm - 1], labels=ids[:, 1:warm]).mean().backward()
    model.zero_grad(set_to_none=True)
    before = _rss_bytes("VmRSS")
    _reset_peak()
    start = time.perf_counter()
    loss = model(ids[:, :-1], labels=ids[:, 1:]).mean()
    loss.backward()
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "peak_bytes": _rss_bytes("VmHWM") - before, "loss": loss.item(), "rank": 0}


def run_worker(*worker_args: str, cp: int = 1) -> dict:
    script = [str(Path(__file__).resolve()), "--worker", *worker_args]
    if cp > 1:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(cp), *script,
                   "--cp", str(cp)]
    else:
        command = [sys.executable, *script]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // cp))}
    proc = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not results:
        raise SystemExit(f"worker {' '.join(worker_args)} failed:\n{proc.stderr[-3000:]}")
    return results[0]


def gib(n: float) -> str:
    return f"{n / 2**30:7.3f} GiB"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[4096, 16384, 32768])
    parser.add_argument("--no-cp", action="store_true", help="skip the CP2 launch")
    parser.add_argument("--no-loss", action="store_true", help="skip the loss measurement")
    parser.add_argument("--cp-comm-type", default="p2p")
    parser.add_argument("--json", type=Path, default=Path("runs/bench/long_context.json"), help="where the figures go")
    parser.add_argument("--worker", choices=["attention", "loss"])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--packed", action="store_true")
    parser.add_argument("--cp", type=int, default=1)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--chunk", type=int, default=LOSS_CHUNK)
    args = parser.parse_args()
    if args.worker == "attention":
        result = attention_worker(args)
        if result["rank"] == 0:  # the figures are already the maximum over ranks
            print(json.dumps(result))
        return
    if args.worker == "loss":
        print(json.dumps(loss_worker(args)))
        return

    summary = {"attention": [], "loss": []}
    print(f"attention: qlm-tiny shape, fp32, one forward+backward of one sequence; packed = {DOCS} documents")
    print(f"{'layout':8} {'seq':>6} {'unpacked':>22} {'packed':>22}   peak ratio  time ratio")
    for cp in [1] + ([] if args.no_cp else [2]):
        for seq in args.seqs:
            extra = ["--seq", str(seq), "--cp-comm-type", args.cp_comm_type]
            plain = run_worker("attention", *extra, cp=cp)
            packed = run_worker("attention", *extra, "--packed", cp=cp)
            peak_ratio = packed["peak_bytes"] / plain["peak_bytes"]
            time_ratio = packed["seconds"] / plain["seconds"]
            layout = "1 proc" if cp == 1 else f"cp{cp} {args.cp_comm_type}"
            print(f"{layout:8} {seq:>6} {gib(plain['peak_bytes'])} {plain['seconds']:6.2f} s "
                  f"{gib(packed['peak_bytes'])} {packed['seconds']:6.2f} s   {peak_ratio:10.2f}  {time_ratio:10.2f}")
            summary["attention"].append(dict(cp=cp, seq=seq, unpacked=plain, packed=packed, peak_ratio=peak_ratio,
                                             time_ratio=time_ratio))
    print("  targets at 16k and 32k: peak ratio <= 1.25, time ratio <= 1.0")
    if not args.no_loss:
        print(f"\nloss head: seq {LOSS_SEQ}, fp32, chunk {LOSS_CHUNK} tokens against unchunked")
        for vocab in (32000, 152064):
            extra = ["--seq", str(LOSS_SEQ), "--vocab", str(vocab)]
            chunked = run_worker("loss", *extra, "--chunk", str(LOSS_CHUNK))
            whole = run_worker("loss", *extra, "--chunk", "0")
            ratio = chunked["peak_bytes"] / whole["peak_bytes"]
            time_ratio = chunked["seconds"] / whole["seconds"]
            print(f"  vocab {vocab:>6}: unchunked {gib(whole['peak_bytes'])} {whole['seconds']:6.2f} s, chunked "
                  f"{gib(chunked['peak_bytes'])} {chunked['seconds']:6.2f} s, peak ratio {ratio:.3f}, time ratio "
                  f"{time_ratio:.2f} (losses {whole['loss']:.6f} / {chunked['loss']:.6f})")
            summary["loss"].append(dict(vocab=vocab, chunked=chunked, unchunked=whole, peak_ratio=ratio,
                                        time_ratio=time_ratio))
        print("  target at vocab 152064: peak ratio <= 0.25")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    partial = args.json.with_name(args.json.name + ".tmp")
    partial.write_text(json.dumps(summary, indent=1))
    partial.replace(args.json)  # never a half-written result
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
