"""torchrun worker for tests/parallel/test_context_parallel.py: context-parallel attention against full attention.

Run as: torchrun --standalone --nproc-per-node 4 cp_worker.py OUTDIR. Every rank builds the same seeded full q/k/v
(check_inputs), runs the CP version on its own slice with cp = 2 (groups {0, 2} and {1, 3}) and cp = 4, and writes
its slices of out/dq/dk/dv to OUTDIR/rank{R}.pt; the test computes full attention in float64 and compares. The
layout round trip (gather_from_cp) and the a2a head checks are judged here: OUTDIR/rank{R}.json.
"""

import itertools
import json
import sys
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from qlm_core.kernels import alibi
from qlm_core.kernels.pieces import Documents
from qlm_core.parallel.context_parallel import context_parallel_attention, gather_from_cp, split_for_cp

B, S, D = 2, 32, 8
SCALE = D**-0.5
# Document lengths per row: boundaries fall inside chunks and documents span several chunks.
DOCS = [[5, 11, 3, 13], [20, 1, 11]]
KINDS = {"plain": (False, None), "packed": (True, None), "window": (False, 6), "packed-window": (True, 7)}
CP_SIZES, COMM_TYPES, HEADS = (2, 4), ("p2p", "allgather", "a2a"), ((4, 2), (4, 4), (4, 1))


@dataclass(frozen=True)
class CpCheck:
    """Context-parallel attention at `cp` ranks with `comm`, `hq` query and `hk` key/value heads, on a KINDS batch."""

    cp: int
    comm: str
    hq: int
    hk: int
    kind: str
    sinks: bool = False  # gpt-oss's learned sink logit per head (kernels/sinks.py)
    alibi: bool = False  # ALiBi's slopes (kernels/alibi.py), in tiles of ALIBI_TILE

    @property
    def packed(self) -> bool:
        return KINDS[self.kind][0]

    @property
    def window(self) -> int | None:
        return KINDS[self.kind][1]


CHECKS = {f"cp{cp}-{comm}-hq{hq}-hk{hk}-{kind}": CpCheck(cp, comm, hq, hk, kind)
          for cp, comm, (hq, hk), kind in itertools.product(CP_SIZES, COMM_TYPES, HEADS, KINDS)}
CHECKS.update({f"cp{cp}-{comm}-hq4-hk2-packed-window-sinks": CpCheck(cp, comm, 4, 2, "packed-window", sinks=True)
               for cp, comm in itertools.product(CP_SIZES, COMM_TYPES)})
CHECKS.update({f"cp{cp}-{comm}-hq4-hk{hk}-{kind}-alibi": CpCheck(cp, comm, 4, hk, kind, alibi=True)
               for cp, comm, hk, kind in itertools.product(CP_SIZES, COMM_TYPES, (4, 2), ("plain", "packed-window"))})
ALIBI_TILE = 3  # tiles smaller than a chunk (4 tokens at cp 4) and than a document, not dividing them


def slopes(check: CpCheck) -> torch.Tensor | None:
    """ALiBi's slopes of the check's heads, steep enough that the bias moves the result."""
    return alibi.alibi_slopes(check.hq, bias_max=3.0) if check.alibi else None


def segment_ids() -> torch.Tensor:
    return torch.stack([torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row)) for row in DOCS])


def check_inputs(check: CpCheck):
    """The full q, k, v, the incoming gradient of the output and the segment ids (None unless packed)."""
    gen = torch.Generator().manual_seed(100 * check.hq + 10 * check.hk + list(KINDS).index(check.kind))
    q, k, v = (torch.randn(B, h, S, D, generator=gen) for h in (check.hq, check.hk, check.hk))
    grad = torch.randn(B, check.hq, S, D, generator=gen)
    sinks = torch.randn(check.hq, generator=gen) if check.sinks else None
    return q, k, v, grad, segment_ids() if check.packed else None, sinks


def run_check(check: CpCheck, group) -> dict:
    """This rank's slices of the output and of dq, dk, dv, and its rank in the cp group."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    q, k, v, grad, segments, sinks = check_inputs(check)
    local = [split_for_cp(t, cp, rank, 2).requires_grad_() for t in (q, k, v)]
    sinks = None if sinks is None else sinks.requires_grad_()
    alibi.TILE = ALIBI_TILE
    out = context_parallel_attention(
        *local, group=group, comm_type=check.comm, scale=SCALE, window=check.window,
        documents=None if segments is None else Documents.from_segment_ids(segments), sinks=sinks,
        slopes=slopes(check),
    )
    out.backward(split_for_cp(grad, cp, rank, 2))
    grads = {n: t.grad for n, t in zip(("dq", "dk", "dv"), local, strict=True)}
    if sinks is not None:  # this rank's share: its queries' (its heads' under a2a); the ranks' shares sum to the whole
        grads["dsinks"] = sinks.grad
    return {"cp_rank": rank, "out": out.detach(), **grads}


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
    results, checks = {"gather": {}, "a2a_errors": {}}, {}
    try:
        for name, check in CHECKS.items():
            checks[name] = run_check(check, groups[check.cp])
        for cp, group in groups.items():
            results["gather"][f"cp{cp}"] = check_gather(group)
            results["a2a_errors"][f"cp{cp}"] = check_a2a_errors(group)
    except Exception:  # noqa: BLE001 - report, then still tear down cleanly
        results["error"] = traceback.format_exc()
    torch.save(checks, out_dir / f"rank{world_rank}.pt")
    (out_dir / f"rank{world_rank}.json").write_text(json.dumps(results, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
