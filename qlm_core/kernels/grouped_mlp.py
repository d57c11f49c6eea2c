"""The routed experts' SwiGLU MLPs over tokens sorted by expert: linear_fc1 ([gate; up] rows), silu(gate) * up,
linear_fc2, each expert on its own contiguous run of rows.

`torch._grouped_mm` runs every expert's GEMM in one call (CPU and CUDA, forward and backward) when the strides are
16-byte aligned: hidden and expert sizes a multiple of 16 bytes / element size, and the token count, which this
kernel pads with zero rows (they add nothing to a weight gradient and their outputs are dropped). Otherwise, or
where torch has no grouped GEMM, it loops over the experts (never over tokens). Both paths keep what Megatron's
grouped MLP keeps for backward: the sorted input and linear_fc1's output; the weights are the parameters themselves,
stacked only for the duration of one call.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch.autograd import Function

_ALIGN_BYTES = 16
ROW_PAD = 8  # token rows padded to a multiple of this (16 bytes of bf16; of fp32 it is 32)


@functools.cache
def grouped_mm_fits(dtype: torch.dtype, hidden: int, ffn: int) -> bool:
    """Whether torch._grouped_mm can take experts of this hidden / (per-rank) expert size in `dtype`."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return hasattr(torch, "_grouped_mm") and all(d * itemsize % _ALIGN_BYTES == 0 for d in (hidden, ffn))


def _swiglu(fc1_out: torch.Tensor, ffn: int) -> torch.Tensor:
    return F.silu(fc1_out[:, :ffn]) * fc1_out[:, ffn:]


def _swiglu_backward(grad: torch.Tensor, fc1_out: torch.Tensor, ffn: int) -> torch.Tensor:
    gate, up = fc1_out[:, :ffn], fc1_out[:, ffn:]
    return torch.cat([torch.ops.aten.silu_backward(grad * up, gate), grad * F.silu(gate)], dim=-1)


def _padded(x: torch.Tensor, rows: int) -> torch.Tensor:
    return x if x.shape[0] == rows else torch.cat([x, x.new_zeros(rows - x.shape[0], *x.shape[1:])])


class _GroupedSwiGLU(Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, counts: tuple[int, ...], grouped: bool, *weights: torch.Tensor):
        experts = len(counts)
        fc1, fc2 = weights[:experts], weights[experts:]
        ffn = fc2[0].shape[1]
        ctx.counts, ctx.grouped, ctx.ffn = counts, grouped, ffn
        with torch.no_grad():
            if grouped:
                rows = -(-x.shape[0] // ROW_PAD) * ROW_PAD
                offsets = _offsets(counts, rows, x.device)
                fc1_out = torch._grouped_mm(_padded(x, rows), torch.stack(fc1).transpose(1, 2), offs=offsets)
                out = torch._grouped_mm(_swiglu(fc1_out, ffn), torch.stack(fc2).transpose(1, 2), offs=offsets)
                fc1_out, out = fc1_out[: x.shape[0]], out[: x.shape[0]]
            else:
                fc1_out = torch.cat([F.linear(part, w) for part, w in zip(x.split(counts), fc1, strict=True)])
                act = _swiglu(fc1_out, ffn)
                out = torch.cat([F.linear(part, w) for part, w in zip(act.split(counts), fc2, strict=True)])
        ctx.save_for_backward(x, fc1_out, *weights)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, fc1_out, *weights = ctx.saved_tensors
        counts, ffn = ctx.counts, ctx.ffn
        experts = len(counts)
        fc1, fc2 = weights[:experts], weights[experts:]
        grad = grad.contiguous()
        if ctx.grouped:
            rows = -(-x.shape[0] // ROW_PAD) * ROW_PAD
            offsets = _offsets(counts, rows, x.device)
            grad_p, x_p, fc1_out_p = _padded(grad, rows), _padded(x, rows), _padded(fc1_out, rows)
            act = _swiglu(fc1_out_p, ffn)
            grad_fc2 = torch._grouped_mm(grad_p.t(), act, offs=offsets)
            grad_fc1_out = _swiglu_backward(torch._grouped_mm(grad_p, torch.stack(fc2), offs=offsets), fc1_out_p, ffn)
            grad_fc1 = torch._grouped_mm(grad_fc1_out.t(), x_p, offs=offsets)
            grad_x = torch._grouped_mm(grad_fc1_out, torch.stack(fc1), offs=offsets)[: x.shape[0]]
            # groups without rows (the last one holds the padding rows, when there are any); some GPU kernels leave
            # an empty group's weight gradient unwritten
            padded_last = rows > x.shape[0]
            empty = [e for e, count in enumerate(counts) if count == 0 and not (padded_last and e == experts - 1)]
            if empty:
                grad_fc1[empty] = 0
                grad_fc2[empty] = 0
            grads_w = list(grad_fc1.unbind(0)) + list(grad_fc2.unbind(0))
        else:
            act = _swiglu(fc1_out, ffn)
            grad_parts, act_parts = grad.split(counts), act.split(counts)
            grad_act = torch.cat([g @ w for g, w in zip(grad_parts, fc2, strict=True)])
            grad_fc1_out = _swiglu_backward(grad_act, fc1_out, ffn)
            g1_parts, x_parts = grad_fc1_out.split(counts), x.split(counts)
            grad_x = torch.cat([g @ w for g, w in zip(g1_parts, fc1, strict=True)])
            grads_w = [g.t() @ p for g, p in zip(g1_parts, x_parts, strict=True)]
            grads_w += [g.t() @ a for g, a in zip(grad_parts, act_parts, strict=True)]
        return (grad_x, None, None, *(g.to(w.dtype) for g, w in zip(grads_w, weights, strict=True)))


def _offsets(counts: Sequence[int], rows: int, device) -> torch.Tensor:
    """Cumulative row ends of each expert's group; the padding rows join the last group."""
    ends = torch.tensor(counts, dtype=torch.int64).cumsum(0)
    ends[-1] = rows
    return ends.to(device=device, dtype=torch.int32)


def grouped_swiglu_mlp(x: torch.Tensor, counts: Sequence[int], fc1: Sequence[torch.Tensor],
                       fc2: Sequence[torch.Tensor], grouped: bool | None = None) -> torch.Tensor:
    """x [tokens, h] sorted by expert, `counts[e]` rows for expert e; fc1[e] [2F, h] = [gate; up], fc2[e] [h, F].
    Returns [tokens, h]: fc2[e] @ (silu(gate) * up) of each row's expert. `grouped` None: the grouped GEMM where its
    alignment allows (grouped_mm_fits), else the per-expert loop."""
    if grouped is None:
        grouped = grouped_mm_fits(x.dtype, x.shape[1], fc2[0].shape[1])
    return _GroupedSwiGLU.apply(x.contiguous(), tuple(int(c) for c in counts), grouped, *fc1, *fc2)


def looped_mlp(activation):
    """An MoE layer's routed experts over rows sorted by expert, one expert at a time: fc2[e] @ activation(fc1[e] @
    x + fc1_bias[e]) + fc2_bias[e] (the activations without a grouped kernel of their own, and experts with biases:
    gpt-oss's; a None list, or a None entry, adds no bias)."""

    def mlp(x: torch.Tensor, counts, fc1, fc2, grouped: bool | None = None, fc1_bias=None,
            fc2_bias=None) -> torch.Tensor:
        outputs, start = [], 0
        fc1_bias = fc1_bias or [None] * len(fc1)
        fc2_bias = fc2_bias or [None] * len(fc2)
        for count, w1, w2, b1, b2 in zip(counts, fc1, fc2, fc1_bias, fc2_bias, strict=True):
            rows = x[start:start + int(count)]
            outputs.append(F.linear(activation(F.linear(rows, w1, b1)), w2, b2))
            start += int(count)
        return torch.cat(outputs) if outputs else x.new_zeros(0, fc2[0].shape[0])

    return mlp
