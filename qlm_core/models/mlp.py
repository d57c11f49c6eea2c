"""The dense MLP (a layer's `mlp`, and the MoE layer's shared expert) with the spec's activation (activations.py):
a gated one's linear_fc1 holds [gate_r; up_r] on TP rank r, so a local chunk(2) splits gate from up."""

from __future__ import annotations

import torch
from torch import nn

from qlm_core.models.activations import ACTIVATION_KINDS, ActivationKind
from qlm_core.parallel.tensor import ColumnParallelLinear, RowParallelLinear


class MLP(nn.Module):
    def __init__(self, hidden: int, ffn_hidden_size: int, parallel, dtype,
                 activation: ActivationKind = ACTIVATION_KINDS["swiglu"], bias: bool = False):
        super().__init__()
        self.activation = activation
        tp_group, sequence_parallel = parallel.tp_group, parallel.sequence_parallel
        self.linear_fc1 = ColumnParallelLinear(
            hidden, activation.fc1_rows(ffn_hidden_size), bias=bias, tp_group=tp_group,
            sequence_parallel=sequence_parallel, dtype=dtype,
        )
        self.linear_fc2 = RowParallelLinear(
            ffn_hidden_size, hidden, bias=bias, tp_group=tp_group, sequence_parallel=sequence_parallel, dtype=dtype,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.activation.function(self.linear_fc1(x)))
