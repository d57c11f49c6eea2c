"""Core attention: softmax(q k^T * scale) v with causal masking and grouped-query heads.

Tensors are [batch, heads, seq, head_dim]; k and v carry num_query_groups heads. The torch SDPA path picks the
flash / memory-efficient kernel the device offers; flash-attn is used on CUDA when installed.
"""

from __future__ import annotations

import functools
import inspect

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


# ---- attention with log-sum-exp --------------------------------------------------------------------------------------
# Context parallelism computes attention block by block and merges the partial outputs by their log-sum-exp (lse), so
# it needs kernels that return lse and a backward that takes the *merged* out and lse. Conventions:
#   q [b, hq, sq, d]; k, v [b, hk, sk, d] (query head i uses kv head i // (hq // hk)); out [b, hq, sq, d];
#   lse [b, hq, sq], natural log of sum_j exp(scale * q.k_j), float32 (float64 for float64 inputs);
#   mask: bool, True = may attend, broadcastable to [b, 1 or hq, sq, sk]; causal: top-left aligned, needs sq == sk.
# A row that may attend to nothing gets out = 0, lse = -inf and zero gradients.

_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_CPU_FLASH_BWD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def attention_forward_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, causal: bool, mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    mask = _fold_causal(q, k, causal, mask)
    causal = causal and mask is None
    if q.shape[2] == 0 or k.shape[2] == 0:  # the CPU op dies with SIGFPE on an empty sequence
        return _math_forward(q, k, v, scale, causal, mask)
    if q.is_cuda:
        return _cuda_forward(q, k, v, scale, causal, mask)
    if q.device.type == "cpu" and _CPU_FLASH is not None:
        return _cpu_forward(q, k, v, scale, causal, mask)
    return _math_forward(q, k, v, scale, causal, mask)


def attention_backward(
    grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    *, scale: float, causal: bool, mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of attention given the final `out` and `lse` of these query rows; those may come from a merge over
    more keys than k/v hold, which makes this the per-block backward of blockwise (ring) attention."""
    mask = _fold_causal(q, k, causal, mask)
    causal = causal and mask is None
    grad_out, out = grad_out.to(q.dtype), out.to(q.dtype)
    # Rows with lse = -inf attend nothing; any finite lse gives them p = exp(-inf - lse) = 0 (-inf would give NaN).
    lse = lse.masked_fill(torch.isneginf(lse), 0.0)
    if q.shape[2] == 0 or k.shape[2] == 0:
        return _math_backward(grad_out, q, k, v, out, lse, scale, causal, mask)
    if q.is_cuda:
        return _cuda_backward(grad_out, q, k, v, out, lse, scale, causal, mask)
    if q.device.type == "cpu" and _CPU_FLASH_BWD is not None:
        return _cpu_backward(grad_out, q, k, v, out, lse, scale, causal, mask)
    return _math_backward(grad_out, q, k, v, out, lse, scale, causal, mask)


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, causal, mask):
        out, lse = attention_forward_with_lse(q, k, v, scale=scale, causal=causal, mask=mask)
        ctx.save_for_backward(q, k, v, out, lse, mask)
        ctx.scale, ctx.causal = scale, causal
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, mask = ctx.saved_tensors
        dq, dk, dv = attention_backward(grad_out, q, k, v, out, lse, scale=ctx.scale, causal=ctx.causal, mask=mask)
        return dq, dk, dv, None, None, None


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, causal: bool, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Differentiable attention over the kernels above (GQA, bool mask, fully masked rows give zeros, not NaN)."""
    return _Attention.apply(q, k, v, scale, causal, mask)


# ---- helpers ---------------------------------------------------------------------------------------------------------


def _fold_causal(q, k, causal, mask):
    """Check shapes; with both causal and a mask, fold the causal triangle into the mask."""
    hq, hk = q.shape[1], k.shape[1]
    if hq % hk:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hk})")
    sq, sk = q.shape[2], k.shape[2]
    if causal and sq != sk:
        raise ValueError(f"causal attention needs equal query and key lengths, got {sq} and {sk}")
    if mask is not None:
        if mask.dtype != torch.bool:
            raise TypeError(f"attention mask must be bool (True = may attend), got {mask.dtype}")
        if causal:
            mask = mask & torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril()
    return mask


def _expand_kv(t: torch.Tensor, groups: int) -> torch.Tensor:
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def _sum_groups(t: torch.Tensor, groups: int) -> torch.Tensor:
    if groups == 1:
        return t
    b, h, s, d = t.shape
    return t.view(b, h // groups, groups, s, d).sum(2)


def _empty_rows(mask: torch.Tensor) -> torch.Tensor:
    """[.., sq] True where a query row may attend to no key."""
    return ~mask.any(-1)


def _mask_empty_rows(out, lse, mask):
    if mask is None:
        return out, lse
    empty = _empty_rows(mask)
    return out.masked_fill(empty[..., None], 0.0), lse.masked_fill(empty, float("-inf"))


def accumulation_dtype(dtype):
    """What softmax statistics and merged outputs are kept in: fp64 for fp64 inputs, else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# ---- CPU: torch's flash kernel ---------------------------------------------------------------------------------------
# It wants equal head counts and an additive float mask of q's dtype (a bool mask is rejected). For a fully masked row
# it returns out = 0 but lse = 0, and its backward gives NaN for lse = -inf: both are fixed up around the call.


def _cpu_bias(mask, dtype):
    return None if mask is None else torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
        ~mask, float("-inf")
    )


def _cpu_forward(q, k, v, scale, causal, mask):
    groups = q.shape[1] // k.shape[1]
    out, lse = _CPU_FLASH(
        q, _expand_kv(k, groups), _expand_kv(v, groups), 0.0, causal, attn_mask=_cpu_bias(mask, q.dtype), scale=scale
    )[:2]
    return _mask_empty_rows(out, lse.to(accumulation_dtype(q.dtype)), mask)


def _cpu_backward(grad_out, q, k, v, out, lse, scale, causal, mask):
    groups = q.shape[1] // k.shape[1]
    dq, dk, dv = _CPU_FLASH_BWD(
        grad_out, q, _expand_kv(k, groups), _expand_kv(v, groups), out, lse.to(accumulation_dtype(q.dtype)), 0.0, causal,
        attn_mask=_cpu_bias(mask, q.dtype), scale=scale,
    )
    return dq, _sum_groups(dk, groups), _sum_groups(dv, groups)


# ---- any device: plain math (float32 or wider) -----------------------------------------------------------------------


def _math_scores(q, k, scale, causal, mask):
    dtype = accumulation_dtype(q.dtype)
    kx = _expand_kv(k, q.shape[1] // k.shape[1])
    s = torch.matmul(q.to(dtype), kx.to(dtype).transpose(-1, -2)) * scale
    if causal:
        mask = torch.ones(s.shape[-2:], dtype=torch.bool, device=q.device).tril()
    return s if mask is None else s.masked_fill(~mask, float("-inf"))


def _math_forward(q, k, v, scale, causal, mask):
    s = _math_scores(q, k, scale, causal, mask)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.masked_fill(torch.isneginf(lse), 0.0)[..., None])
    out = torch.matmul(p, _expand_kv(v, q.shape[1] // k.shape[1]).to(p.dtype))
    return out.to(q.dtype), lse


def _math_backward(grad_out, q, k, v, out, lse, scale, causal, mask):
    groups = q.shape[1] // k.shape[1]
    p = torch.exp(_math_scores(q, k, scale, causal, mask) - lse.to(accumulation_dtype(q.dtype))[..., None])
    g = grad_out.to(p.dtype)
    dv = torch.matmul(p.transpose(-1, -2), g)
    dp = torch.matmul(g, _expand_kv(v, groups).to(p.dtype).transpose(-1, -2))
    ds = p * (dp - (g * out.to(p.dtype)).sum(-1, keepdim=True))
    dq = torch.matmul(ds, _expand_kv(k, groups).to(p.dtype)) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q.to(p.dtype)) * scale
    return dq.to(q.dtype), _sum_groups(dk, groups).to(k.dtype), _sum_groups(dv, groups).to(v.dtype)


# ---- CUDA: flash-attn without a mask, else torch's memory-efficient kernel (untested on the CPU-only dev box) --------


@functools.cache
def _flash_attn_backward_fn():
    """flash-attn's internal backward and the argument names it declares (they changed across 2.x), or None."""
    try:
        from flash_attn.flash_attn_interface import _flash_attn_backward as fn
    except Exception:  # noqa: BLE001
        return None
    return fn, frozenset(inspect.signature(getattr(fn, "_init_fn", fn)).parameters)


def _cuda_forward(q, k, v, scale, causal, mask):
    if _flash_attn_func is not None and mask is None and q.dtype in (torch.float16, torch.bfloat16):
        out, lse, _ = _flash_attn_func(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=scale, causal=causal,
            return_attn_probs=True,
        )
        return out.transpose(1, 2), lse
    groups = q.shape[1] // k.shape[1]
    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, _expand_kv(k, groups), _expand_kv(v, groups), _cuda_bias(mask, q, k), True, 0.0, causal, scale=scale
    )[:2]
    return _mask_empty_rows(out, lse[..., : q.shape[2]], mask)


def _cuda_backward(grad_out, q, k, v, out, lse, scale, causal, mask):
    flash_bwd = _flash_attn_backward_fn()
    if flash_bwd is not None and mask is None and q.dtype in (torch.float16, torch.bfloat16):
        return _flash_attn_backward(*flash_bwd, grad_out, q, k, v, out, lse, scale, causal)
    groups = q.shape[1] // k.shape[1]
    b, h, sq = lse.shape
    # The kernel stores lse padded to a multiple of 32 rows (not on ROCm) and reads it back with that stride.
    width = sq if torch.version.hip else -(-sq // 32) * 32
    lse_padded = lse.new_zeros(b, h, width)
    lse_padded[..., :sq] = lse
    unused = torch.empty((), dtype=torch.long)  # philox seed/offset: read only with dropout
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        grad_out.contiguous(), q, _expand_kv(k, groups), _expand_kv(v, groups), _cuda_bias(mask, q, k), out,
        lse_padded, unused, unused, 0.0, [True, True, True, False], causal, scale=scale,
    )
    return dq, _sum_groups(dk, groups), _sum_groups(dv, groups)


def _cuda_bias(mask, q, k):
    """Additive bias for the memory-efficient kernel: finite (a fully -inf row may give NaN there; such rows are
    zeroed afterwards), with the last dim padded to 16 elements in memory as the kernel requires."""
    if mask is None:
        return None
    sk = k.shape[2]
    shape = tuple(mask.shape[:-1])
    bias = torch.zeros(shape + (sk + (-sk) % 16,), dtype=q.dtype, device=q.device)[..., :sk]
    bias.masked_fill_(~mask, torch.finfo(q.dtype).min)
    return bias.expand(q.shape[0], q.shape[1], q.shape[2], sk)


def _flash_attn_backward(fn, params, grad_out, q, k, v, out, lse, scale, causal):
    qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    dq, dk, dv = torch.empty_like(qt), torch.empty_like(kt), torch.empty_like(vt)
    candidates = dict(
        dout=grad_out.transpose(1, 2).contiguous(), q=qt, k=kt, v=vt, out=out.transpose(1, 2).contiguous(),
        softmax_lse=lse.contiguous(), dq=dq, dk=dk, dv=dv, dropout_p=0.0, softmax_scale=scale, causal=causal,
        window_size=(-1, -1), window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None,
        deterministic=False, rng_state=None,
    )
    fn(**{name: value for name, value in candidates.items() if name in params})
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
