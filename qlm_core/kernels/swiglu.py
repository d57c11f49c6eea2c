"""SwiGLU on linear_fc1's output [gate; up]: silu(gate) * up, a gated unit (kernels/gated_unit.py) whose
`SwiGLUFunction` keeps only fc1's output."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qlm_core.kernels.gated_unit import gated_unit

swiglu_reference, SwiGLUFunction, swiglu = gated_unit(F.silu, torch.ops.aten.silu_backward, "SwiGLUFunction")
