"""GeGLU on linear_fc1's output [gate; up]: gelu(gate, tanh approximation) * up (Gemma's MLP).

Like kernels/swiglu.py, `GeGLUFunction` keeps only fc1's output and recomputes the GELU in backward with the ops
autograd would run, so outputs and gradients equal the plain expression's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def geglu_reference(fc1_out: torch.Tensor) -> torch.Tensor:
    gate, up = fc1_out.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


class GeGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fc1_out: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(fc1_out)
        return geglu_reference(fc1_out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (fc1_out,) = ctx.saved_tensors
        gate, up = fc1_out.chunk(2, dim=-1)
        grad_gate = torch.ops.aten.gelu_backward(grad * up, gate, approximate="tanh")
        grad_up = grad * F.gelu(gate, approximate="tanh")
        return torch.cat([grad_gate, grad_up], dim=-1)


def geglu(fc1_out: torch.Tensor) -> torch.Tensor:
    if torch.is_grad_enabled() and fc1_out.requires_grad:
        return GeGLUFunction.apply(fc1_out)
    return geglu_reference(fc1_out)


def looped_gated_mlp(activation):
    """An MoE layer's routed experts over rows sorted by expert, one expert at a time: fc2[e] @ activation(fc1[e] @
    x) (the activations without a grouped kernel of their own; kernels/grouped_mlp.py has SwiGLU's)."""

    def mlp(x: torch.Tensor, counts, fc1, fc2, grouped: bool | None = None) -> torch.Tensor:
        outputs, start = [], 0
        for count, w1, w2 in zip(counts, fc1, fc2, strict=True):
            rows = x[start:start + int(count)]
            outputs.append(activation(rows @ w1.t()) @ w2.t())
            start += int(count)
        return torch.cat(outputs) if outputs else x.new_zeros(0, fc2[0].shape[0])

    return mlp
