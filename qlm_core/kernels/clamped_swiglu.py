"""gpt-oss's clamped SwiGLU on linear_fc1's output [gate; up]: gate clamped above at `limit`, up clamped to
[-limit, limit], then gate · sigmoid(alpha · gate) · (up + 1) (Megatron-Core: quick_gelu as a gated linear unit with
glu_linear_offset 1 and activation_func_clamp_value `limit`).

`ClampedSwiGLUFunction` keeps only fc1's output, as the gated units of kernels/gated_unit.py do, and runs in backward
the ops autograd would run on the plain expression, so outputs and gradients equal that expression's (a clamped
entry passes no gradient: torch's clamp passes it where min <= x <= max).
"""

from __future__ import annotations

import torch

ALPHA = 1.702  # gpt-oss's swiglu_alpha: sigmoid(1.702 x) · x is the "quick" GELU
LIMIT = 7.0  # gpt-oss's swiglu_limit


def clamped_swiglu_reference(fc1_out: torch.Tensor) -> torch.Tensor:
    gate, up = fc1_out.chunk(2, dim=-1)
    gate, up = gate.clamp(max=LIMIT), up.clamp(min=-LIMIT, max=LIMIT)
    return gate * torch.sigmoid(gate * ALPHA) * (up + 1)


class ClampedSwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fc1_out: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(fc1_out)
        return clamped_swiglu_reference(fc1_out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (fc1_out,) = ctx.saved_tensors
        raw_gate, raw_up = fc1_out.chunk(2, dim=-1)
        gate, up = raw_gate.clamp(max=LIMIT), raw_up.clamp(min=-LIMIT, max=LIMIT)
        sig = torch.sigmoid(gate * ALPHA)
        glu = gate * sig
        grad_glu = grad * (up + 1)
        grad_gate = grad_glu * sig + torch.ops.aten.sigmoid_backward(grad_glu * gate, sig) * ALPHA
        grad_gate = grad_gate.masked_fill(~(raw_gate <= LIMIT), 0)  # NaN too, as torch's clamp
        grad_up = (grad * glu).masked_fill(~((raw_up >= -LIMIT) & (raw_up <= LIMIT)), 0)
        return torch.cat([grad_gate, grad_up], dim=-1)


def clamped_swiglu(fc1_out: torch.Tensor) -> torch.Tensor:
    if torch.is_grad_enabled() and fc1_out.requires_grad:
        return ClampedSwiGLUFunction.apply(fc1_out)
    return clamped_swiglu_reference(fc1_out)
