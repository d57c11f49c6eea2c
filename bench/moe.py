"""Throughput of qlm's routed experts (models/moe.py SequentialExperts, kernels/grouped_mlp.py), forward + backward,
each against a baseline measured in the same run:

  1. the grouped GEMM (torch._grouped_mm, one call for every expert) against the per-expert loop (grouped=False),
     one process, the same sorted rows and weights;
  2. expert parallelism over two CPU processes (gloo): EP2 (each holds half the experts and dispatches its tokens by
     all-to-all) against EP1 (each holds every expert and runs its own tokens), the same tokens on each rank.

    python bench/moe.py                            # Qwen3-MoE-like small: hidden 512, 32 experts of 192, top 8
    python bench/moe.py --tokens 2048 --steps 10

The shape keeps Qwen3-30B-A3B's ratios (expert FFN / hidden 768 / 2048, top 8 of 128 scaled to 8 of 32) at a size
this CPU runs in seconds. Steps of the contenders alternate, so that machine drift affects both alike. Prints tokens/s
of each and their ratio; nothing is asserted (CPU timings vary).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from qlm_core.kernels.grouped_mlp import grouped_mm_fits, grouped_swiglu_mlp
from qlm_core.models.moe import SequentialExperts
from qlm_core.models.moe_spec import MoeSpec
from qlm_core.parallel.expert_dispatch import ExpertParallel


def routed(args, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """tokens [T, h], probabilities and expert indices [T, k] of a uniform random router."""
    tokens = torch.randn(args.tokens, args.hidden, generator=generator)
    scores = torch.rand(args.tokens, args.experts, generator=generator)
    top, indices = torch.topk(scores, args.topk, dim=-1)
    return tokens, torch.softmax(top, -1), indices


def init_experts(experts: SequentialExperts, seed: int):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.02)


def timed_alternating(steps: dict, count: int, warmup: int) -> dict[str, float]:
    seconds = {name: 0.0 for name in steps}
    for index in range(warmup + count):
        for name, run_step in steps.items():
            start = time.perf_counter()
            run_step()
            if index >= warmup:
                seconds[name] += time.perf_counter() - start
    return seconds


def grouped_vs_loop(args) -> None:
    generator = torch.Generator().manual_seed(0)
    tokens, _, indices = routed(args, generator)
    flat = indices.reshape(-1)
    order = torch.argsort(flat, stable=True)
    rows = tokens[order // args.topk].requires_grad_()
    counts = torch.bincount(flat, minlength=args.experts).tolist()
    fc1 = [(torch.randn(2 * args.ffn, args.hidden, generator=generator) * 0.02).requires_grad_()
           for _ in range(args.experts)]
    fc2 = [(torch.randn(args.hidden, args.ffn, generator=generator) * 0.02).requires_grad_()
           for _ in range(args.experts)]
    if not grouped_mm_fits(torch.float32, args.hidden, args.ffn):
        print(f"torch._grouped_mm cannot run hidden {args.hidden} / ffn {args.ffn} here: nothing to compare")
        return

    def step(grouped: bool):
        def run():
            out = grouped_swiglu_mlp(rows, counts, fc1, fc2, grouped=grouped)
            out.square().mean().backward()
        return run

    seconds = timed_alternating({"grouped": step(True), "loop": step(False)}, args.steps, args.warmup)
    processed = args.tokens * args.steps
    print(f"1. routed experts, one process: {args.tokens} tokens x top {args.topk} = {args.tokens * args.topk} rows "
          f"over {args.experts} experts of {args.ffn} (hidden {args.hidden}), fp32, forward + backward")
    print(f"  per-expert loop      {processed / seconds['loop']:10.0f} tokens/s")
    print(f"  grouped GEMM         {processed / seconds['grouped']:10.0f} tokens/s")
    print(f"  ratio grouped / loop = {seconds['loop'] / seconds['grouped']:.2f}")


def _ep_rank(rank: int, args, init_file: str, results):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    moe = MoeSpec(args.experts, args.topk, args.ffn)
    ep1 = SequentialExperts(args.hidden, moe, 1, torch.float32)
    ep2 = SequentialExperts(args.hidden, moe, 1, torch.float32, ExpertParallel(2, 1, dist.group.WORLD))
    init_experts(ep1, 0)
    init_experts(ep2, 1 + rank)
    tokens, probs, indices = routed(args, torch.Generator().manual_seed(100 + rank))
    tokens.requires_grad_()

    def step(experts):
        def run():
            out = experts(tokens, probs, indices, None)
            out.square().mean().backward()
            dist.barrier()  # a step ends when both ranks are done: tokens/s of the pair
        return run

    seconds = timed_alternating({"ep1": step(ep1), "ep2": step(ep2)}, args.steps, args.warmup)
    results[rank] = seconds
    dist.destroy_process_group()


def ep2_vs_ep1(args) -> None:
    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_ep_rank, args=(args, os.path.join(tmp, "init"), results), nprocs=2, join=True)
        seconds = {name: max(results[r][name] for r in range(2)) for name in ("ep1", "ep2")}
    processed = 2 * args.tokens * args.steps
    print(f"2. two gloo processes, one thread each, {args.tokens} tokens per rank, forward + backward")
    print(f"  EP1 (every expert on each rank)           {processed / seconds['ep1']:10.0f} tokens/s")
    print(f"  EP2 (half the experts, all-to-all)        {processed / seconds['ep2']:10.0f} tokens/s")
    print(f"  ratio EP2 / EP1 = {seconds['ep1'] / seconds['ep2']:.2f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--ffn", type=int, default=192)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args()
    grouped_vs_loop(args)
    ep2_vs_ep1(args)


if __name__ == "__main__":
    main()
