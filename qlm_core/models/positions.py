"""Every position scheme qlm builds, by ModelSpec.position: what GPTModel hands each attention layer for the tokens'
positions (RoPE: cos and sin). A new scheme is its class and one row of POSITION_KINDS, and each attention kind that
takes it reads its tuple (grouped-query attention refuses any scheme but RoPE); a scheme with parameters of its own
(learned absolute positions) also brings its layout entries."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from qlm_core.kernels.rope import rope_attention_factor, rope_cos_sin, rope_inv_freq
from qlm_core.models.families import chosen_kind
from qlm_core.models.spec import ModelSpec


class RotaryPositions:
    """RoPE with the spec's base and scaling: each layer gets (cos, sin) [s, b, 1, rotated dims] in the compute
    dtype (YaRN: times its attention factor). With a local base (Gemma 3) the windowed layers rotate by their own
    unscaled base: layer_inputs then gives {window: (cos, sin)}, which each layer reads by its window."""

    def __init__(self, spec: ModelSpec):
        self.inv_freq = rope_inv_freq(spec.rope_dim, spec.rope_theta, spec.rope_scaling)
        self.factor = rope_attention_factor(spec.rope_scaling)
        self.local_inv_freq = None
        self.windows = tuple(dict.fromkeys(spec.windows))
        if spec.local_rope_theta is not None:
            self.local_inv_freq = rope_inv_freq(spec.rope_dim, spec.local_rope_theta)

    def layer_inputs(self, position_ids: torch.Tensor, dtype: torch.dtype):
        self.inv_freq = self.inv_freq.to(position_ids.device)
        full = rope_cos_sin(position_ids, self.inv_freq, dtype, self.factor)
        if self.local_inv_freq is None:
            return full
        self.local_inv_freq = self.local_inv_freq.to(position_ids.device)
        local = rope_cos_sin(position_ids, self.local_inv_freq, dtype)
        return {window: full if window is None else local for window in self.windows}


class LearnedPositions:
    """Learned absolute positions (OPT's, Megatron's learned_absolute): the embedding adds them to the tokens'
    (models/gpt.py LanguageModelEmbedding, which holds the table), so the layers get nothing."""

    def __init__(self, spec: ModelSpec):
        pass

    def layer_inputs(self, position_ids: torch.Tensor, dtype: torch.dtype):
        return None


class AlibiPositions:
    """ALiBi (BLOOM's, MPT's): a bias by distance in each head's scores, which the attention module adds from its
    heads' slopes (kernels/alibi.py); the layers get nothing, and the embedding adds nothing."""

    def __init__(self, spec: ModelSpec):
        pass

    def layer_inputs(self, position_ids: torch.Tensor, dtype: torch.dtype):
        return None


@dataclass(frozen=True)
class PositionKind:
    """scheme(spec) -> an object whose layer_inputs(position_ids [b, s], dtype) is every layer's `positions`;
    megatron_args: what Megatron-LM's args say of it (`--position-embedding-type` and its switches)."""

    scheme: type
    megatron_args: tuple[tuple[str, Any], ...]


POSITION_KINDS: dict[str, PositionKind] = {
    "rope": PositionKind(RotaryPositions, (
        ("position_embedding_type", "rope"), ("add_position_embedding", False),
        ("use_rotary_position_embeddings", True))),
    "learned_absolute": PositionKind(LearnedPositions, (
        ("position_embedding_type", "learned_absolute"), ("add_position_embedding", True),
        ("use_rotary_position_embeddings", False))),
    # Megatron-Core has no ALiBi; Megatron-DeepSpeed (which trained BLOOM) names it so
    "alibi": PositionKind(AlibiPositions, (
        ("position_embedding_type", "alibi"), ("add_position_embedding", False),
        ("use_rotary_position_embeddings", False))),
}


def position_kind(spec: ModelSpec) -> PositionKind:
    return chosen_kind(POSITION_KINDS, spec.position, "position scheme")
