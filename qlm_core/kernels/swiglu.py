"""SwiGLU on linear_fc1's output [gate; up] (split in halves on the last dimension): silu(gate) * up.

Autograd on the plain expression keeps fc1's output (gate and up are views of it) and silu(gate) besides; like
Megatron's fused bias-SwiGLU, `SwiGLUFunction` keeps only fc1's output and recomputes silu in backward with the ops
autograd would run, so outputs and gradients are bit-identical to the plain expression
(tests/models/test_fused_pointwise.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def swiglu_reference(fc1_out: torch.Tensor) -> torch.Tensor:
    gate, up = fc1_out.chunk(2, dim=-1)
    return F.silu(gate) * up


class SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fc1_out: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(fc1_out)
        return swiglu_reference(fc1_out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (fc1_out,) = ctx.saved_tensors
        gate, up = fc1_out.chunk(2, dim=-1)
        grad_gate = torch.ops.aten.silu_backward(grad * up, gate)
        grad_up = grad * F.silu(gate)
        return torch.cat([grad_gate, grad_up], dim=-1)


def swiglu(fc1_out: torch.Tensor) -> torch.Tensor:
    if torch.is_grad_enabled() and fc1_out.requires_grad:
        return SwiGLUFunction.apply(fc1_out)
    return swiglu_reference(fc1_out)
