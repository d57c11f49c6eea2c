"""Rotary position embedding, rotate-half convention (the one HF Llama/Qwen2 weights and Megatron-Core both use), with
Llama 3.1's and YaRN's frequency scaling, and the interleaved pair layout of multi-latent attention."""

from __future__ import annotations

import math

import torch


def rope_inv_freq(head_dim: int, theta: float, scaling=None) -> torch.Tensor:
    """Inverse frequencies [head_dim/2], fp32; `scaling` is a models.spec.RopeScaling (Llama 3.1), a YarnScaling or
    None."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    if getattr(scaling, "kind", None) == "linear":  # position interpolation: every frequency divided by the factor
        return inv_freq / scaling.factor
    if hasattr(scaling, "beta_fast"):
        return _yarn_inv_freq(head_dim, theta, scaling)
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_inv_freq(dim: int, theta: float, scaling) -> torch.Tensor:
    """YaRN (arXiv 2309.00071): frequencies above the correction range kept, below it divided by the factor, a
    linear ramp between (the range from beta_fast / beta_slow rotations over the original context). Computed in
    transformers' order of operations, so the frequencies are its bits."""
    def correction_dim(rotations: float) -> float:
        wavelengths = scaling.original_max_position_embeddings / (rotations * 2 * math.pi)
        return dim * math.log(wavelengths) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    kept = 1 - ramp  # 1: extrapolate (the original frequency), 0: interpolate (divided by the factor)
    wavelength = theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    return 1.0 / (scaling.factor * wavelength) * (1 - kept) + 1.0 / wavelength * kept


def rope_attention_factor(scaling) -> float:
    """What cos and sin are multiplied by: YaRN's mscale ratio (its `attention_factor`), else 1."""
    return 1.0 if scaling is None or not hasattr(scaling, "beta_fast") else scaling.cos_sin_factor


def rope_cos_sin(position_ids: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype, factor: float = 1.0):
    """position_ids [b, s] -> cos, sin [s, b, 1, head_dim] in `dtype` (computed in fp32, times `factor`)."""
    freqs = position_ids.to(torch.float32)[..., None] * inv_freq.to(position_ids.device)[None, None, :]
    emb = torch.cat((freqs, freqs), dim=-1).transpose(0, 1)[:, :, None, :]
    if factor == 1.0:
        return emb.cos().to(dtype), emb.sin().to(dtype)
    return (emb.cos() * factor).to(dtype), (emb.sin() * factor).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """x [s, b, heads, head_dim]. `interleaved`: x's rotated pairs are (x0, x1), (x2, x3), ... (DeepSeek's layout,
    which Megatron-Core's multi-latent attention reads); the result is laid out as halves [x0', x2', ...; x1', x3',
    ...], as both Megatron-Core and transformers return it."""
    rotated = cos.shape[-1]
    if rotated < x.shape[-1]:  # partial RoPE: the first dims rotate, the rest pass (GLM's partial_rotary_factor)
        return torch.cat((apply_rope(x[..., :rotated], cos, sin, interleaved), x[..., rotated:]), dim=-1)
    if interleaved:
        x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin
