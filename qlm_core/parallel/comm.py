"""Thin, explicit wrappers over torch.distributed collectives. A group of None means "no parallelism": every
wrapper is then the identity, so single-process code runs the same functions without a process group."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

# torch >= 2.13 renames the flat collectives and warns on the old names; older torch (on GPU clusters) lacks the new.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def group_size(group: ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: ProcessGroup | None) -> int:
    return 0 if group is None else dist.get_rank(group)


def all_reduce(tensor: torch.Tensor, group: ProcessGroup | None, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """In place; returns the tensor."""
    if group_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def all_gather_dim0(tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Concatenate every rank's tensor along dim 0 (rank order)."""
    world = group_size(group)
    if world == 1:
        return tensor
    tensor = tensor.contiguous()
    out = torch.empty((world * tensor.shape[0],) + tuple(tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    _all_gather_flat(out, tensor, group=group)
    return out


def reduce_scatter_dim0(tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Sum across ranks, then keep this rank's 1/world slice of dim 0."""
    world = group_size(group)
    if world == 1:
        return tensor
    tensor = tensor.contiguous()
    out = torch.empty((tensor.shape[0] // world,) + tuple(tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    _reduce_scatter_flat(out, tensor, group=group)
    return out


def all_gather_last_dim(tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    world = group_size(group)
    if world == 1:
        return tensor
    gathered = all_gather_dim0(tensor.movedim(-1, 0), group)
    return gathered.movedim(0, -1).contiguous()


def reduce_scatter_last_dim(tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    world = group_size(group)
    if world == 1:
        return tensor
    return reduce_scatter_dim0(tensor.movedim(-1, 0), group).movedim(0, -1).contiguous()


def split_dim(tensor: torch.Tensor, group: ProcessGroup | None, dim: int) -> torch.Tensor:
    """This rank's contiguous 1/world slice along `dim` (no communication)."""
    world = group_size(group)
    if world == 1:
        return tensor
    return tensor.chunk(world, dim=dim)[group_rank(group)].contiguous()


# ---- launch-and-wait flat collectives (data parallelism) -----------------------------------------------------------
# Each returns the Work to wait on, or None when the group has size 1 (nothing to do). In-place use is allowed:
# the reduce-scatter output and the all-gather input may be this rank's slice of the other tensor.


def start_all_reduce(tensor: torch.Tensor, group: ProcessGroup | None, async_op: bool = True):
    if group_size(group) == 1:
        return None
    return dist.all_reduce(tensor, group=group, async_op=async_op)


def start_reduce_scatter(output: torch.Tensor, input: torch.Tensor, group: ProcessGroup | None,
                         async_op: bool = True):
    if group_size(group) == 1:
        return None
    return _reduce_scatter_flat(output, input, group=group, async_op=async_op)


def start_all_gather(output: torch.Tensor, input: torch.Tensor, group: ProcessGroup | None, async_op: bool = True):
    if group_size(group) == 1:
        return None
    return _all_gather_flat(output, input, group=group, async_op=async_op)


def wait(work) -> None:
    if work is not None:
        work.wait()


def all_to_all_dim0(tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Cut dim 0 into `world` equal parts and send part j to rank j; returns the parts received, in rank order."""
    if group_size(group) == 1:
        return tensor
    tensor = tensor.contiguous()
    out = torch.empty_like(tensor)
    dist.all_to_all_single(out, tensor, group=group)
    return out
