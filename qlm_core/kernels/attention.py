"""Core attention: softmax(q k^T * scale) v with causal masking and grouped-query heads.

Tensors are [batch, heads, seq, head_dim]; k and v carry num_query_groups heads. The torch SDPA path picks the
flash / memory-efficient kernel the device offers; flash-attn is used on CUDA when installed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:  # optional CUDA kernel; never required
    from flash_attn import flash_attn_func as _flash_attn_func
except Exception:  # noqa: BLE001 - any import failure means "not available"
    _flash_attn_func = None


def _window_mask(seq_len: int, window: int, device) -> torch.Tensor:
    """Boolean mask, True = attend: causal and at most `window` tokens back (Mistral's sliding window)."""
    i = torch.arange(seq_len, device=device)
    dist = i[:, None] - i[None, :]
    return (dist >= 0) & (dist < window)


def core_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    seq_len = q.shape[2]
    windowed = sliding_window is not None and seq_len > sliding_window
    if _flash_attn_func is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        window = (sliding_window - 1, 0) if windowed else (-1, -1)
        out = _flash_attn_func(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            softmax_scale=softmax_scale, causal=causal, window_size=window,
        )
        return out.transpose(1, 2)
    gqa = q.shape[1] != k.shape[1]
    if windowed:
        mask = _window_mask(seq_len, sliding_window, q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=softmax_scale, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=softmax_scale, enable_gqa=gqa)
