"""Every position scheme qlm builds, by ModelSpec.position: what GPTModel hands each attention layer for the tokens'
positions (RoPE: cos and sin; ALiBi would hand its slopes, learned absolute positions nothing, their embedding added
to the token embedding). A new scheme: its class and one row of POSITION_KINDS; the attention kinds read the tuple."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qlm_core.errors import QlmError
from qlm_core.kernels.rope import rope_cos_sin, rope_inv_freq
from qlm_core.models.spec import ModelSpec


class RotaryPositions:
    """RoPE with the spec's base and scaling: each layer gets (cos, sin) [b, s, head_dim] in the compute dtype."""

    def __init__(self, spec: ModelSpec):
        self.inv_freq = rope_inv_freq(spec.kv_channels, spec.rope_theta, spec.rope_scaling)

    def layer_inputs(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        self.inv_freq = self.inv_freq.to(position_ids.device)
        return rope_cos_sin(position_ids, self.inv_freq, dtype)


@dataclass(frozen=True)
class PositionKind:
    """scheme(spec) -> an object whose layer_inputs(position_ids [b, s], dtype) is every layer's `positions`;
    megatron_name: Megatron-LM's `--position-embedding-type`."""

    scheme: type
    megatron_name: str


POSITION_KINDS: dict[str, PositionKind] = {"rope": PositionKind(RotaryPositions, "rope")}


def position_kind(spec: ModelSpec) -> PositionKind:
    kind = POSITION_KINDS.get(spec.position)
    if kind is None:
        raise QlmError(f"position scheme {spec.position!r} is not one qlm builds",
                       f"use one of {', '.join(sorted(POSITION_KINDS))}")
    return kind
