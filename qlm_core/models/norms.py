"""Every normalisation qlm builds, by ModelSpec.norm: the layers' two norms, the final norm and a q/k norm per head
all come from here (a new norm, e.g. LayerNorm or Gemma's (1 + w) RMSNorm: its kernel and one row of NORM_KINDS)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from qlm_core.kernels.norm import RMSNorm, ZeroCenteredRMSNorm
from qlm_core.models.families import chosen_kind
from qlm_core.models.spec import ModelSpec


@dataclass(frozen=True)
class NormKind:
    """module(size, eps, dtype) -> the norm; `tensors`: its parameters in Megatron's (and HF's) state_dict order,
    each named `<norm>.<tensor>` on both sides; `megatron_name`: Megatron-LM's `--normalization` value; `init`: its
    weight's value in a fresh model (Gemma's (1 + w) RMSNorm: 0); saved_bytes(dtype_bytes, size, device): what it
    keeps for backward per token (the profile)."""

    module: Callable[[int, float, torch.dtype], nn.Module]
    tensors: tuple[str, ...]
    megatron_name: str
    init: float
    saved_bytes: Callable[[int, int, str], float]
    zero_centered: bool = False  # the weight is an offset from 1 (Megatron's apply_layernorm_1p / zero-centred gamma)
    # a LayerNorm without its bias (MPT's): Megatron has none, qlm's args say qlm_layernorm_no_bias
    bias_free: bool = False


def _rms_norm_saved(dtype_bytes: int, size: int, device: str) -> float:
    """kernels/norm.RMSNormFunction keeps its input and the fp32 1/rms."""
    return dtype_bytes * size + 4


def _layer_norm(size: int, eps: float, dtype: torch.dtype) -> nn.Module:
    return nn.LayerNorm(size, eps=eps, dtype=dtype)


def _layer_norm_no_bias(size: int, eps: float, dtype: torch.dtype) -> nn.Module:
    return nn.LayerNorm(size, eps=eps, bias=False, dtype=dtype)


def _layer_norm_saved(dtype_bytes: int, size: int, device: str) -> float:
    """torch's native_layer_norm keeps its input, its mean and its 1/std: those two fp32 on CUDA, in the input's
    dtype on the CPU."""
    return dtype_bytes * size + 2 * (dtype_bytes if device == "cpu" else 4)


NORM_KINDS: dict[str, NormKind] = {
    "rmsnorm": NormKind(RMSNorm, ("weight",), "RMSNorm", 1.0, _rms_norm_saved),
    # Gemma's (1 + w) RMSNorm: it keeps what RMSNorm keeps (its input and the fp32 1/rms)
    "gemma_rmsnorm": NormKind(ZeroCenteredRMSNorm, ("weight",), "RMSNorm", 0.0, _rms_norm_saved, zero_centered=True),
    # LayerNorm with its bias (OPT): torch's own kernel
    "layernorm": NormKind(_layer_norm, ("weight", "bias"), "LayerNorm", 1.0, _layer_norm_saved),
    # ... without its bias (MPT): torch's kernel keeps what it keeps with one
    "layernorm_no_bias": NormKind(_layer_norm_no_bias, ("weight",), "LayerNorm", 1.0, _layer_norm_saved,
                                  bias_free=True),
}


# the names of norm weights (initialised to the norm kind's `init`): Megatron's *layernorm, multi-token prediction's
# enorm / hnorm
NORM_WEIGHT_SUFFIXES = ("layernorm.weight", ".enorm.weight", ".hnorm.weight")


def norm_kind(spec: ModelSpec) -> NormKind:
    return chosen_kind(NORM_KINDS, spec.norm, "norm")


def build_norm(spec: ModelSpec, size: int, dtype: torch.dtype) -> nn.Module:
    """The spec's norm over the last `size` features (hidden_size for a layer's norms, head_dim for q/k norms)."""
    return norm_kind(spec).module(size, spec.norm_epsilon, dtype)
