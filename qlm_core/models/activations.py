"""Every MLP activation qlm builds, by ModelSpec.activation: the dense MLP, an MoE layer's shared expert and its
routed experts all read it here, and so do the layout (linear_fc1's rows and shard rule), the FLOP and parameter
counts (a new activation, e.g. GeGLU, GELU or ReLU: its kernel and one row of ACTIVATION_KINDS)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from qlm_core.kernels.clamped_swiglu import ALPHA, LIMIT, clamped_swiglu
from qlm_core.kernels.geglu import geglu
from qlm_core.kernels.grouped_mlp import grouped_swiglu_mlp, looped_mlp
from qlm_core.kernels.swiglu import swiglu
from qlm_core.models.families import chosen_kind
from qlm_core.models.spec import ModelSpec

# Megatron-LM's values of the gated unit's clamp and up-half offset when its args leave them out (every activation but
# gpt-oss's has these)
MEGATRON_DEFAULT_VALUES: tuple[tuple[str, Any], ...] = (("activation_func_clamp_value", None),
                                                         ("glu_linear_offset", 0.0))


@dataclass(frozen=True)
class ActivationKind:
    """function: linear_fc1's local output -> linear_fc2's input. gated: linear_fc1 holds [gate; up] (2f rows, each
    TP rank its own [gate_r; up_r]: tensor_layout.FC1), else f rows split by rows. grouped_mlp(rows, counts, fc1s,
    fc2s): the routed experts' whole MLP over rows sorted by expert (kernels/grouped_mlp.py). megatron_args: what
    Megatron-LM's switches say of it (each true or false); megatron_values: its other Megatron-LM args (numbers),
    written and checked on read. saves_output: backward reads its output (ReLU), which is linear_fc2's input too,
    rather than its input (the profile's saved bytes)."""

    function: Callable[[torch.Tensor], torch.Tensor]
    gated: bool
    grouped_mlp: Callable[..., torch.Tensor]
    megatron_args: tuple[tuple[str, Any], ...]
    saves_output: bool = False
    megatron_values: tuple[tuple[str, Any], ...] = MEGATRON_DEFAULT_VALUES

    def fc1_rows(self, ffn_hidden_size: int) -> int:
        return 2 * ffn_hidden_size if self.gated else ffn_hidden_size

    def routed_mlp(self, rows: torch.Tensor, counts, fc1, fc2, fc1_bias=None, fc2_bias=None) -> torch.Tensor:
        """The routed experts' MLP over rows sorted by expert: grouped_mlp, or with biases (gpt-oss's; lists, one
        per expert) the per-expert loop that adds them (2·E small GEMMs a layer: no grouped kernel takes biases
        yet)."""
        if fc1_bias is None and fc2_bias is None:
            return self.grouped_mlp(rows, counts, fc1, fc2, grouped=None if rows.shape[0] else False)
        return looped_mlp(self.function)(rows, counts, fc1, fc2, fc1_bias=fc1_bias, fc2_bias=fc2_bias)

    def runs_grouped_kernel(self, biases: bool) -> bool:
        """Whether routed_mlp (with or without `biases`) runs a grouped kernel, which keeps linear_fc1's input and
        output for backward; the per-expert loop also keeps linear_fc2's input, and pads no rows."""
        return not biases and self.grouped_mlp is grouped_swiglu_mlp

    @property
    def matrices(self) -> int:
        """h x f matrices of one MLP (its parameters and forward FLOPs per token are this x h·f, x 2·h·f)."""
        return 3 if self.gated else 2


MEGATRON_SWITCHES = ("swiglu", "squared_relu", "qlm_geglu", "qlm_relu", "quick_geglu")  # each kind's own switch
# --openai-gelu only picks which GELU a GELU MLP runs (Megatron-LM's legacy models and Megatron-DeepSpeed read it; a
# gated unit's switch wins over it): only the GELU kinds state it


def _switches(on: str | None) -> tuple[tuple[str, bool], ...]:
    """Megatron-LM's activation switches with `on` alone set (None: its default GELU, "openai_gelu": GELU's tanh
    approximation)."""
    gelu = (("openai_gelu", on == "openai_gelu"),) if on in (None, "openai_gelu") else ()
    return tuple((switch, switch == on) for switch in MEGATRON_SWITCHES) + gelu


_GELU_TANH = functools.partial(F.gelu, approximate="tanh")

ACTIVATION_KINDS: dict[str, ActivationKind] = {
    "swiglu": ActivationKind(swiglu, gated=True, grouped_mlp=grouped_swiglu_mlp, megatron_args=_switches("swiglu")),
    # Gemma's gelu(gate, tanh) * up: Megatron-LM has no switch for it (Megatron-Bridge builds it as a gated linear
    # unit with fast_gelu), so qlm's args say qlm_geglu
    "geglu": ActivationKind(geglu, gated=True, grouped_mlp=looped_mlp(geglu), megatron_args=_switches("qlm_geglu")),
    # OPT's plain ReLU MLP: Megatron-LM's args have no switch for it (megatron-core takes activation_func=relu), so
    # qlm's say qlm_relu
    "relu": ActivationKind(F.relu, gated=False, grouped_mlp=looped_mlp(F.relu), megatron_args=_switches("qlm_relu"),
                           saves_output=True),
    # the exact (erf) GELU of OPT-style models with activation_function "gelu": Megatron-LM's default activation
    "gelu": ActivationKind(F.gelu, gated=False, grouped_mlp=looped_mlp(F.gelu), megatron_args=_switches(None)),
    # BLOOM's bloom_gelu: GELU's tanh approximation, Megatron-LM's --openai-gelu
    "gelu_tanh": ActivationKind(_GELU_TANH, gated=False, grouped_mlp=looped_mlp(_GELU_TANH),
                                megatron_args=_switches("openai_gelu")),
    # gpt-oss's clamped SwiGLU (kernels/clamped_swiglu.py): Megatron-LM's --quick-geglu with its clamp and the up
    # half's offset of 1
    "clamped_swiglu": ActivationKind(
        clamped_swiglu, gated=True, grouped_mlp=looped_mlp(clamped_swiglu), megatron_args=_switches("quick_geglu"),
        megatron_values=(("activation_func_clamp_value", LIMIT), ("glu_linear_offset", 1.0),
                         ("qlm_quick_geglu_alpha", ALPHA))),
}


def activation_kind(spec: ModelSpec) -> ActivationKind:
    return chosen_kind(ACTIVATION_KINDS, spec.activation, "activation")
