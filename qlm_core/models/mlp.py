"""The dense SwiGLU MLP (a layer's `mlp`, and the MoE layer's shared expert): linear_fc1 holds [gate_r; up_r] on
TP rank r, so a local chunk(2) splits gate from up."""

from __future__ import annotations

import torch
from torch import nn

from qlm_core.kernels.swiglu import swiglu
from qlm_core.parallel.tensor import ColumnParallelLinear, RowParallelLinear


class MLP(nn.Module):
    def __init__(self, hidden: int, ffn_hidden_size: int, parallel, dtype):
        super().__init__()
        tp_group, sequence_parallel = parallel.tp_group, parallel.sequence_parallel
        self.linear_fc1 = ColumnParallelLinear(
            hidden, 2 * ffn_hidden_size, tp_group=tp_group, sequence_parallel=sequence_parallel, dtype=dtype,
        )
        self.linear_fc2 = RowParallelLinear(
            ffn_hidden_size, hidden, tp_group=tp_group, sequence_parallel=sequence_parallel, dtype=dtype,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(swiglu(self.linear_fc1(x)))
