"""Megatron-style tensor parallelism (+ sequence parallelism) over raw collectives.

Activations are [seq, batch, hidden]. With TP size t:
  ColumnParallelLinear  weight [out/t, in]   input replicated (or seq-sharded under SP: all-gathered first)
  RowParallelLinear     weight [out, in/t]   output all-reduced (under SP: reduce-scattered to seq shards)
  VocabParallelEmbedding weight [V/t, h]     rows of the padded vocabulary
With a TP group of None or size 1 every layer is the plain layer and no collective is issued.

The operators are Megatron's f / g pairs (Shoeybi et al. 2019; Korthikanti et al. 2022 for SP):
  copy_to_tp          fwd identity        bwd all-reduce
  reduce_from_tp      fwd all-reduce      bwd identity
  gather_from_sp      fwd all-gather      bwd reduce-scatter
  reduce_scatter_to_sp fwd reduce-scatter bwd all-gather
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd import Function
from torch.distributed import ProcessGroup

from qlm_core.parallel.comm import (
    all_gather_dim0,
    all_gather_last_dim,
    all_reduce,
    group_rank,
    group_size,
    reduce_scatter_dim0,
    reduce_scatter_last_dim,
    split_dim,
)
from qlm_core.parallel.param_meta import mark

# ---- f / g operators ------------------------------------------------------------------------------------------------


def _identity(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    return x


def _sum(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    return all_reduce(x.contiguous(), group)


def _keep_last_dim_slice(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    return split_dim(x, group, -1)


class _Conjugate(Function):
    """`forward_op` on the activations, `backward_op` (its conjugate) on their gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup | None, forward_op, backward_op):
        ctx.group, ctx.backward_op = group, backward_op
        return forward_op(x, group)

    @staticmethod
    def backward(ctx, grad):
        return ctx.backward_op(grad, ctx.group), None, None, None


def _conjugate(x: torch.Tensor, group: ProcessGroup | None, forward_op, backward_op) -> torch.Tensor:
    return x if group_size(group) == 1 else _Conjugate.apply(x, group, forward_op, backward_op)


def copy_to_tp(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    return _conjugate(x, group, _identity, _sum)


def sum_across(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """The sum of every rank's part, used by every rank: all-reduced forward, and backward too (each rank's part
    gets the gradient that every rank's use of the sum sends back)."""
    return _conjugate(x, group, _sum, _sum)


def reduce_from_tp(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    return _conjugate(x, group, _sum, _identity)


def gather_from_sp(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    return _conjugate(x, group, all_gather_dim0, reduce_scatter_dim0)


def reduce_scatter_to_sp(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    return _conjugate(x, group, reduce_scatter_dim0, all_gather_dim0)


def gather_from_sp_whole_grad(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """fwd all-gather the sequence (dim 0); bwd keep this rank's slice: for a result every TP rank uses alike, so
    that each already holds the whole gradient (a reduce-scatter would count it tp times)."""
    return _conjugate(x, group, all_gather_dim0, _keep_dim0_slice)


def _keep_dim0_slice(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    return split_dim(x, group, 0)


def scatter_to_sp(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """fwd keep this rank's slice of the sequence (dim 0) of a tensor every TP rank holds whole; bwd all-gather."""
    return _conjugate(x, group, _keep_dim0_slice, all_gather_dim0)


def gather_last_dim(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """fwd all-gather the last dim; bwd keep this rank's slice (every rank holds the same full gradient)."""
    return _conjugate(x, group, all_gather_last_dim, _keep_last_dim_slice)


def gather_last_dim_sum_grad(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """fwd all-gather the last dim; bwd reduce-scatter it (ranks use different parts of the gathered tensor)."""
    return _conjugate(x, group, all_gather_last_dim, reduce_scatter_last_dim)


class _SPGatherLinear(Function):
    """all-gather(x) @ W^T, saving only the local sequence shard: backward gathers it again (Megatron does the same
    to keep SP activation memory at 1/t)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, group: ProcessGroup | None):
        ctx.group = group
        ctx.save_for_backward(x, weight)
        return F.linear(all_gather_dim0(x, group), weight)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        total = all_gather_dim0(x, ctx.group)
        grad_input = reduce_scatter_dim0(grad.matmul(weight), ctx.group)
        grad_weight = grad.reshape(-1, grad.shape[-1]).t().matmul(total.reshape(-1, total.shape[-1]))
        return grad_input, grad_weight.to(weight.dtype), None


# ---- layers ---------------------------------------------------------------------------------------------------------


class MegatronLinearState:
    """Megatron-Core linear layers carry an `_extra_state` entry (None) in their state_dict; so do ours, so that a
    rank's state_dict is exactly a Megatron checkpoint shard."""

    def get_extra_state(self):
        return None

    def set_extra_state(self, state):
        pass


def _divide(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(f"{what} ({total}) is not divisible by the tensor-parallel size {parts}")
    return total // parts


class ColumnParallelLinear(MegatronLinearState, nn.Module):
    def __init__(
        self, in_features, out_features, *, bias=False, tp_group: ProcessGroup | None = None,
        sequence_parallel=False, gather_output=False, skip_weight=False, dtype=torch.float32,
    ):
        super().__init__()
        self.tp_group = tp_group
        self.sequence_parallel = sequence_parallel and group_size(tp_group) > 1
        self.gather_output = gather_output
        local_out = _divide(out_features, group_size(tp_group), "output features")
        self.weight = None
        if not skip_weight:
            self.weight = mark(nn.Parameter(torch.empty(local_out, in_features, dtype=dtype)), tp_split=True)
        self.bias = mark(nn.Parameter(torch.zeros(local_out, dtype=dtype)), tp_split=True) if bias else None

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        out = self.local_forward(x, weight)
        return gather_last_dim(out, self.tp_group) if self.gather_output else out

    def local_forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's output columns (before gather_output)."""
        weight = self.weight if weight is None else weight
        if self.sequence_parallel:
            out = _SPGatherLinear.apply(x, weight, self.tp_group)
        else:
            out = F.linear(copy_to_tp(x, self.tp_group), weight)
        return out + self.bias if self.bias is not None else out


class RowParallelLinear(MegatronLinearState, nn.Module):
    def __init__(self, in_features, out_features, *, bias=False, tp_group: ProcessGroup | None = None,
                 sequence_parallel=False, dtype=torch.float32):
        super().__init__()
        self.tp_group = tp_group
        self.sequence_parallel = sequence_parallel and group_size(tp_group) > 1
        local_in = _divide(in_features, group_size(tp_group), "input features")
        self.weight = mark(nn.Parameter(torch.empty(out_features, local_in, dtype=dtype)), tp_split=True)
        self.bias = None
        if bias:
            self.bias = mark(nn.Parameter(torch.zeros(out_features, dtype=dtype)),
                             sequence_parallel=self.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight)
        if self.sequence_parallel:
            out = reduce_scatter_to_sp(out, self.tp_group)
        else:
            out = reduce_from_tp(out, self.tp_group)
        return out + self.bias if self.bias is not None else out


class VocabParallelEmbedding(nn.Module):
    """Input ids [b, s] -> embeddings [s, b, h] (sequence-sharded under SP)."""

    def __init__(self, num_embeddings, embedding_dim, *, tp_group: ProcessGroup | None = None,
                 sequence_parallel=False, dtype=torch.float32):
        super().__init__()
        self.tp_group = tp_group
        self.sequence_parallel = sequence_parallel and group_size(tp_group) > 1
        local = _divide(num_embeddings, group_size(tp_group), "padded vocabulary size")
        self.vocab_start = group_rank(tp_group) * local
        self.weight = mark(nn.Parameter(torch.empty(local, embedding_dim, dtype=dtype)), tp_split=True)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if group_size(self.tp_group) == 1:
            return F.embedding(input_ids, self.weight).transpose(0, 1).contiguous()
        local_ids = input_ids - self.vocab_start
        outside = (local_ids < 0) | (local_ids >= self.weight.shape[0])
        out = F.embedding(local_ids.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside[..., None], 0.0).transpose(0, 1).contiguous()
        if self.sequence_parallel:
            return reduce_scatter_to_sp(out, self.tp_group)
        return reduce_from_tp(out, self.tp_group)


# ---- loss -----------------------------------------------------------------------------------------------------------


class _VocabParallelCrossEntropy(Function):
    """Cross entropy over vocab-sharded logits without gathering them: 3 small all-reduces (max, target logit,
    sum of exp). Columns at or past `vocab_size` are Megatron's padding and are excluded from the softmax."""

    @staticmethod
    def forward(ctx, logits, target, group: ProcessGroup | None, vocab_size: int):
        ctx.input_dtype = logits.dtype
        # Worked on in place (after an fp32 cast when needed), as Megatron does: nothing downstream reads the
        # logits, and the output layer's backward needs its input and weight, not its output.
        logits = logits.float()
        part = logits.shape[-1]
        start = group_rank(group) * part
        if vocab_size < start + part:
            logits[..., max(0, vocab_size - start):] = float("-inf")
        logits_max = all_reduce(logits.max(dim=-1).values, group, op=torch.distributed.ReduceOp.MAX)
        logits.sub_(logits_max[..., None])
        local_target = target - start
        not_here = (local_target < 0) | (local_target >= part)
        local_target = local_target.masked_fill(not_here, 0)
        target_logit = logits.gather(-1, local_target[..., None]).squeeze(-1).masked_fill(not_here, 0.0)
        all_reduce(target_logit, group)
        exp = logits.exp_()
        sum_exp = all_reduce(exp.sum(dim=-1), group)
        loss = torch.log(sum_exp) - target_logit
        exp.div_(sum_exp[..., None])
        ctx.save_for_backward(exp, local_target, not_here)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, not_here = ctx.saved_tensors
        grad = softmax
        onehot = (~not_here).to(grad.dtype)
        grad.scatter_add_(-1, local_target[..., None], -onehot[..., None])
        grad.mul_(grad_loss[..., None])
        return grad.to(ctx.input_dtype), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, tp_group: ProcessGroup | None,
                                 vocab_size: int) -> torch.Tensor:
    """logits [..., V_padded/t] (this rank's vocab slice), target [...] -> per-token loss [...] in fp32."""
    return _VocabParallelCrossEntropy.apply(logits, target, tp_group, vocab_size)
