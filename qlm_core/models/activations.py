"""Every MLP activation qlm builds, by ModelSpec.activation: the dense MLP, an MoE layer's shared expert and its
routed experts all read it here, and so do the layout (linear_fc1's rows and shard rule), the FLOP and parameter
counts (a new activation, e.g. GeGLU, GELU or ReLU: its kernel and one row of ACTIVATION_KINDS)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from qlm_core.kernels.geglu import geglu
from qlm_core.kernels.grouped_mlp import grouped_swiglu_mlp, looped_mlp
from qlm_core.kernels.swiglu import swiglu
from qlm_core.models.families import chosen_kind
from qlm_core.models.spec import ModelSpec


@dataclass(frozen=True)
class ActivationKind:
    """function: linear_fc1's local output -> linear_fc2's input. gated: linear_fc1 holds [gate; up] (2f rows, each
    TP rank its own [gate_r; up_r]: tensor_layout.FC1), else f rows split by rows. grouped_mlp(rows, counts, fc1s,
    fc2s): the routed experts' whole MLP over rows sorted by expert (kernels/grouped_mlp.py). megatron_args: what
    Megatron-LM's args say of it. saves_output: backward reads its output (ReLU), which is linear_fc2's input too,
    rather than its input (the profile's saved bytes)."""

    function: Callable[[torch.Tensor], torch.Tensor]
    gated: bool
    grouped_mlp: Callable[..., torch.Tensor]
    megatron_args: tuple[tuple[str, Any], ...]
    saves_output: bool = False

    def fc1_rows(self, ffn_hidden_size: int) -> int:
        return 2 * ffn_hidden_size if self.gated else ffn_hidden_size

    @property
    def matrices(self) -> int:
        """h x f matrices of one MLP (its parameters and forward FLOPs per token are this x h·f, x 2·h·f)."""
        return 3 if self.gated else 2


ACTIVATION_KINDS: dict[str, ActivationKind] = {
    "swiglu": ActivationKind(swiglu, gated=True, grouped_mlp=grouped_swiglu_mlp, megatron_args=(
        ("swiglu", True), ("squared_relu", False), ("qlm_geglu", False), ("qlm_relu", False))),
    # Gemma's gelu(gate, tanh) * up: Megatron-LM has no switch for it (Megatron-Bridge builds it as a gated linear
    # unit with fast_gelu), so qlm's args say qlm_geglu
    "geglu": ActivationKind(geglu, gated=True, grouped_mlp=looped_mlp(geglu), megatron_args=(
        ("swiglu", False), ("squared_relu", False), ("qlm_geglu", True), ("qlm_relu", False))),
    # OPT's plain ReLU MLP: Megatron-LM's args have no switch for it (megatron-core takes activation_func=relu), so
    # qlm's say qlm_relu
    "relu": ActivationKind(F.relu, gated=False, grouped_mlp=looped_mlp(F.relu), megatron_args=(
        ("swiglu", False), ("squared_relu", False), ("qlm_geglu", False), ("qlm_relu", True)), saves_output=True),
    # the exact (erf) GELU of OPT-style models with activation_function "gelu": Megatron-LM's default activation
    "gelu": ActivationKind(F.gelu, gated=False, grouped_mlp=looped_mlp(F.gelu), megatron_args=(
        ("swiglu", False), ("squared_relu", False), ("qlm_geglu", False), ("qlm_relu", False))),
}


def activation_kind(spec: ModelSpec) -> ActivationKind:
    return chosen_kind(ACTIVATION_KINDS, spec.activation, "activation")
