"""GeGLU on linear_fc1's output [gate; up]: gelu(gate, tanh approximation) * up (Gemma's MLP).

A gated unit (kernels/gated_unit.py): `GeGLUFunction` keeps only fc1's output and recomputes the GELU in backward
with the ops autograd would run, so outputs and gradients equal the plain expression's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qlm_core.kernels.gated_unit import gated_unit


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def _gelu_tanh_backward(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten.gelu_backward(grad, x, approximate="tanh")


geglu_reference, GeGLUFunction, geglu = gated_unit(_gelu_tanh, _gelu_tanh_backward, "GeGLUFunction")
