"""torchrun worker for tests/test_context_parallel.py: context-parallel attention against full attention.

Run as: torchrun --standalone --nproc-per-node 4 cp_worker.py OUTDIR. Every rank builds the same seeded full q/k/v,
computes full causal (+ same-document, + sliding-window) attention in float64 with autograd, runs the CP version on
its own slice with cp = 2 (groups {0, 2} and {1, 3}) and cp = 4, and writes the max abs differences of out/dq/dk/dv
to OUTDIR/rank{R}.json.
"""

import itertools
import json
import sys
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from qlm_core.kernels.pieces import Documents
from qlm_core.parallel.context_parallel import context_parallel_attention, gather_from_cp, split_for_cp

B, S, D = 2, 32, 8
SCALE = D**-0.5
# Document lengths per row: boundaries fall inside chunks and documents span several chunks.
DOCS = [[5, 11, 3, 13], [20, 1, 11]]
KINDS = {"plain": (False, None), "packed": (True, None), "window": (False, 6), "packed-window": (True, 7)}


def segment_ids() -> torch.Tensor:
    return torch.stack([torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row)) for row in DOCS])


def reference(q, k, v, segments, window):
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    back = torch.arange(S)[:, None] - torch.arange(S)[None, :]
    allowed = ((back >= 0) & (back < (window or S)))[None, None]
    if segments is not None:
        allowed = allowed & (segments[:, :, None] == segments[:, None, :])[:, None]
    scores = (q @ k.transpose(-1, -2) * SCALE).masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, -1) @ v


def check(name, group, comm, hq, hk, kind):
    packed, window = KINDS[kind]
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    gen = torch.Generator().manual_seed(100 * hq + 10 * hk + list(KINDS).index(kind))
    q, k, v = (torch.randn(B, h, S, D, generator=gen) for h in (hq, hk, hk))
    grad = torch.randn(B, hq, S, D, generator=gen)
    segments = segment_ids() if packed else None

    full = [t.double().requires_grad_() for t in (q, k, v)]
    ref_out = reference(*full, segments, window)
    ref_out.backward(grad.double())

    local = [split_for_cp(t, cp, rank, 2).requires_grad_() for t in (q, k, v)]
    out = context_parallel_attention(
        *local, group=group, comm_type=comm, scale=SCALE, window=window,
        documents=None if segments is None else Documents.from_segment_ids(segments),
    )
    out.backward(split_for_cp(grad, cp, rank, 2))

    def diff(got, want):
        return (got.double() - split_for_cp(want, cp, rank, 2)).abs().max().item()

    return {"out": diff(out, ref_out), **{n: diff(t.grad, f.grad) for n, t, f in zip(("dq", "dk", "dv"), local, full)}}


def check_gather(group):
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    x = torch.randn(3, S, 5, generator=torch.Generator().manual_seed(7))
    local = split_for_cp(x, cp, rank, 1).requires_grad_()
    full = gather_from_cp(local, group, 1)
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(8))
    full.backward(g)
    grad_diff = (local.grad - split_for_cp(g, cp, rank, 1)).abs().max().item()
    return {"value": (full - x).abs().max().item(), "grad": grad_diff}


def check_a2a_errors(group):
    """The head constraints of a2a raise ValueError (before any communication)."""
    cp = dist.get_world_size(group)
    raised = []
    for hq, hk in ((cp // 2, cp // 2), (3 * cp, 3)):  # hq % cp != 0; hk neither divides nor is divisible by cp
        q, k = torch.randn(1, hq, 4, D), torch.randn(1, hk, 4, D)
        try:
            context_parallel_attention(q, k, k, group=group, comm_type="a2a", scale=1.0)
            raised.append(False)
        except ValueError as error:
            raised.append("a2a context parallelism needs" in str(error))
    return all(raised)


def main():
    out_dir = Path(sys.argv[1])
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    world_rank = dist.get_rank()
    # Every rank must create every group, in the same order.
    pair_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    groups = {2: pair_groups[world_rank % 2], 4: dist.group.WORLD}
    results = {"checks": {}, "gather": {}, "a2a_errors": {}}
    try:
        for cp, group in groups.items():
            for comm, (hq, hk), kind in itertools.product(("p2p", "allgather", "a2a"), ((4, 2), (4, 4), (4, 1)), KINDS):
                name = f"cp{cp}-{comm}-hq{hq}-hk{hk}-{kind}"
                results["checks"][name] = check(name, group, comm, hq, hk, kind)
            results["gather"][f"cp{cp}"] = check_gather(group)
            results["a2a_errors"][f"cp{cp}"] = check_a2a_errors(group)
    except Exception:  # noqa: BLE001 - report, then still tear down cleanly
        results["error"] = traceback.format_exc()
    (out_dir / f"rank{world_rank}.json").write_text(json.dumps(results, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
