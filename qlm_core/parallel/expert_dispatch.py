"""Expert parallelism's token dispatch: all-to-all over the ep x etp ranks that hold the experts (Megatron-Core's
alltoall dispatcher), in three steps a rank runs on its own tokens (its sequence shard under SP or CP, its rows
under DP):

1. counts: this rank's (token, choice) pairs sorted by expert; how many go to each local expert of every
   destination is exchanged first (all_to_all_single of E_local counts per destination), so every rank knows the
   uneven split sizes of step 2;
2. tokens: all_to_all_single with those splits (its autograd twin sends the gradients back the same way). A pair
   routed to an expert of ep rank d goes to each of d's etp ranks, each of which holds 1/etp of the expert's
   ffn: the duplicates stand for Megatron's all-gather over the expert-TP group, and their partial outputs are
   summed when the token is re-assembled (its reduce-scatter);
3. the received rows (source-major) are permuted to expert-major order for the grouped GEMM, permuted back, and
   returned by the reverse all-to-all; the caller weights and sums them into its tokens.

Group ranks: torch numbers a group's members by global rank, and the grid (parallel/state.py) makes that order
ep-major, etp-minor, so destination (ep rank d, etp rank j) is group rank d * etp + j.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.autograd import Function
from torch.distributed import ProcessGroup

from qlm_core.parallel.comm import group_size


@dataclass(frozen=True)
class ExpertParallel:
    """The routed experts' split (parallel/state.py's expert axes) and the group its tokens move in."""

    ep: int = 1
    etp: int = 1
    group: ProcessGroup | None = None  # the ep x etp ranks tokens are dispatched among


class _AllToAll(Function):
    """all_to_all_single with uneven splits; backward sends the gradients back with the splits swapped."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, output_splits: list[int], input_splits: list[int], group):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        out = x.new_empty((sum(output_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        output_splits, input_splits = ctx.splits
        return _AllToAll.apply(grad.contiguous(), input_splits, output_splits, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
    """Rows x[sum(input_splits[:j]) : ...] go to group rank j; returns the rows received, in group-rank order."""
    if group_size(group) == 1:
        return x
    return _AllToAll.apply(x, output_splits, input_splits, group)


@dataclass(frozen=True)
class DispatchPlan:
    """Where this rank's sorted pairs go and what it receives (all sizes host-side)."""

    send_positions: torch.Tensor  # index into the expert-sorted pairs of each row sent, in send order
    input_splits: list[int]  # rows sent to each group rank
    output_splits: list[int]  # rows received from each group rank
    to_expert_major: torch.Tensor  # permutation of the received rows into local-expert-major order
    expert_counts: list[int]  # received rows per local expert


def plan_dispatch(expert_counts: torch.Tensor, parallel: ExpertParallel) -> DispatchPlan:
    """`expert_counts` [E] (int64, on the tokens' device): this rank's pairs per global expert, the pairs sorted
    by expert. One small all-to-all of counts; the index tensors are built on the counts' device."""
    ep, etp, local = parallel.ep, parallel.etp, expert_counts.numel() // parallel.ep
    device = expert_counts.device
    per_destination = expert_counts.view(ep, local)
    send_counts = per_destination.repeat_interleave(etp, dim=0).contiguous()  # [ep * etp, local]
    received = send_counts
    if group_size(parallel.group) > 1:
        received = torch.empty_like(send_counts)
        dist.all_to_all_single(received, send_counts, group=parallel.group)
    sources = received.shape[0]
    total = int(expert_counts.sum())
    positions = torch.arange(total, device=device)
    if etp > 1:  # every pair once per etp rank of its destination, destination-major
        destination = torch.repeat_interleave(torch.arange(ep, device=device), per_destination.sum(1))
        keys = torch.cat([destination * etp + j for j in range(etp)])
        positions = positions.repeat(etp)[torch.argsort(keys, stable=True)]
    # received rows are source-major, then local expert; expert-major order sorts them by (expert, source)
    block_key = (torch.arange(local, device=device)[None, :] * sources
                 + torch.arange(sources, device=device)[:, None]).reshape(-1)
    row_key = torch.repeat_interleave(block_key, received.reshape(-1))
    return DispatchPlan(positions, send_counts.sum(1).tolist(), received.sum(1).tolist(),
                        torch.argsort(row_key, stable=True), received.sum(0).tolist())


def inverse_permutation(permutation: torch.Tensor) -> torch.Tensor:
    inverse = torch.empty_like(permutation)
    inverse[permutation] = torch.arange(permutation.numel(), device=permutation.device)
    return inverse
