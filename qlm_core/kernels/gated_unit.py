"""A gated linear unit on linear_fc1's output [gate; up] (split in halves on the last dimension): act(gate) * up.

Autograd on the plain expression keeps fc1's output (gate and up are views of it) and act(gate) besides; like
Megatron's fused bias-SwiGLU, the Function `gated_unit` makes keeps only fc1's output and recomputes act in backward
with the ops autograd would run, so outputs and gradients are bit-identical to the plain expression
(tests/models/test_fused_pointwise.py). kernels/swiglu.py and kernels/geglu.py are its two instances.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

Activation = Callable[[torch.Tensor], torch.Tensor]


class GatedUnit(NamedTuple):
    reference: Activation  # the plain expression: what `function` computes
    function: type[torch.autograd.Function]  # keeps only fc1's output for backward
    apply: Activation  # `function` where a gradient is wanted, else the plain expression


def gated_unit(activation: Activation, activation_backward: Callable[..., torch.Tensor], name: str) -> GatedUnit:
    """`activation_backward(grad, gate)`: d(activation)/d(gate) applied to `grad`, as autograd computes it."""

    def reference(fc1_out: torch.Tensor) -> torch.Tensor:
        gate, up = fc1_out.chunk(2, dim=-1)
        return activation(gate) * up

    def forward(ctx, fc1_out: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(fc1_out)
        return reference(fc1_out)

    def backward(ctx, grad: torch.Tensor):
        (fc1_out,) = ctx.saved_tensors
        gate, up = fc1_out.chunk(2, dim=-1)
        return torch.cat([activation_backward(grad * up, gate), grad * activation(gate)], dim=-1)

    function = type(name, (torch.autograd.Function,),
                    {"forward": staticmethod(forward), "backward": staticmethod(backward)})

    def apply(fc1_out: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and fc1_out.requires_grad:
            return function.apply(fc1_out)
        return reference(fc1_out)

    return GatedUnit(reference, function, apply)
