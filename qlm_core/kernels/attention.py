"""Core attention kernels: softmax(q k^T * scale) v, causal or fully visible, with grouped-query heads.

Tensors are [batch, heads, seq, head_dim]; k and v carry num_query_groups heads. No kernel here but a decoding step's
(one query a row, masked_attention) takes a mask: documents, sliding windows and context-parallel blocks are cut into
mask-free pieces (kernels/pieces.py, kernels/piecewise.py); ALiBi's tiles hand their bias by distance as an additive
mask (kernels/alibi.py). flash-attn is used on CUDA when installed; else torch's own fused kernels.
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F

from qlm_core.kernels.sinks import sink_probabilities

try:  # optional CUDA kernel; never required
    from flash_attn import flash_attn_func as _flash_attn_func
except Exception:  # noqa: BLE001 - any import failure means "not available"
    _flash_attn_func = None


def flash_attn_runs(q: torch.Tensor) -> bool:
    """Whether core_attention runs flash-attn on these queries (CUDA, fp16/bf16, flash-attn installed)."""
    return _flash_attn_func is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)


def core_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True, softmax_scale: float | None = None,
    alibi_slopes: torch.Tensor | None = None, softcap: float | None = None,
) -> torch.Tensor:
    """Plain (unpacked, unwindowed) attention over whole rows: one fused kernel call, no log-sum-exp kept by qlm.
    `alibi_slopes` [hq] (fp32): ALiBi's, `softcap`: Gemma 2's, through flash-attn's own (callers check
    flash_attn_runs first)."""
    if flash_attn_runs(q):
        extra = {} if alibi_slopes is None else {"alibi_slopes": alibi_slopes.float()}
        extra.update({} if softcap is None else {"softcap": softcap})
        out = _flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                               softmax_scale=softmax_scale, causal=causal, **extra)
        return out.transpose(1, 2)
    assert alibi_slopes is None and softcap is None, "ALiBi and soft-capping without flash-attn run piecewise"
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=softmax_scale,
                                          enable_gqa=q.shape[1] != k.shape[1])


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor,
                     scale: float, sinks: torch.Tensor | None = None,
                     slopes: torch.Tensor | None = None, softcap: float | None = None) -> torch.Tensor:
    """Decoding: q [b, hq, 1, d] against every key key_mask [b, 1, 1, sk] allows (the mask is one row per sequence,
    never s x s). With one query a row, a group's query heads are laid along the query dimension against their
    shared kv head ([b, groups, hq/groups, d]): no GQA, which CUDA's masked kernels lack (they would repeat K/V per
    head). CUDA: one fused kernel call; CPU: the scores are only [b, hq, sk], and two batched matmuls with the scores
    and softmax in fp32 (as the fused kernels keep them) beat the CPU's masked SDPA ~3x. `sinks` [hq]: a learned
    logit per head in each softmax (kernels/sinks.py; the matmul path on CUDA too, which SDPA lacks). `slopes` [hq]:
    ALiBi's bias slope * (j - i), the query being the last key; `softcap`: Gemma 2's cap · tanh(scores / cap) (the
    matmul path too)."""
    b, hq, _, d = q.shape
    groups = k.shape[1]
    grouped = q.reshape(b, groups, hq // groups, d)
    if q.is_cuda and sinks is None and slopes is None and softcap is None:
        out = F.scaled_dot_product_attention(grouped, k, v, attn_mask=key_mask, scale=scale)
    else:
        scores = torch.matmul(grouped.float(), k.float().transpose(-1, -2)).mul_(scale)
        if softcap is not None:
            scores = scores.div_(softcap).tanh_().mul_(softcap)
        if slopes is not None:
            distance = torch.arange(1 - k.shape[2], 1, device=q.device, dtype=torch.float32)
            scores += slopes.float().view(1, groups, hq // groups, 1) * distance
        scores = scores.masked_fill_(~key_mask, float("-inf"))
        probs = (scores.softmax(dim=-1) if sinks is None
                 else sink_probabilities(scores, sinks.view(1, groups, hq // groups, 1)))
        out = torch.matmul(probs.to(v.dtype), v)
    return out.reshape(b, hq, 1, v.shape[-1])


# ---- attention with log-sum-exp --------------------------------------------------------------------------------------
# Document-aware, windowed and context-parallel attention compute pieces of the attention matrix (kernels/pieces.py)
# and merge the partial outputs by their log-sum-exp (lse), so they need kernels that return lse and a backward that
# takes the *merged* out and lse. No mask is ever built: a piece is either fully visible or causal. Conventions:
#   q [b, hq, sq, d]; k, v [b, hk, sk, d] (query head i uses kv head i // (hq // hk)); out [b, hq, sq, d];
#   lse [b, hq, sq], natural log of sum_j exp(scale * q.k_j), float32 (float64 for float64 inputs);
#   causal: needs sq == sk (a square, where top-left and bottom-right alignment agree).

_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_CPU_FLASH_BWD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def attention_forward_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, causal: bool, bias: torch.Tensor | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`bias`: [1 or b, hq, sq, sk] fp32 added to the scaled scores (a small tile's ALiBi: kernels/alibi.py).
    `softcap`: Gemma 2's cap · tanh(scores / cap) before any bias and mask: flash-attn's own on CUDA, else the
    plain math over this (small: a tile's) piece, which no fused CPU kernel computes."""
    _check_shapes(q, k, causal)
    if softcap is not None and not _flash_softcaps(q, k, bias):
        return _math_forward(q, k, v, scale, causal, bias, softcap)
    if q.shape[2] == 0 or k.shape[2] == 0:  # the CPU op dies with SIGFPE on an empty sequence
        return _math_forward(q, k, v, scale, causal, bias)
    if softcap is not None:
        return _cuda_forward(q, k, v, scale, causal, None, softcap)
    if q.is_cuda:
        return _cuda_forward(q, k, v, scale, causal, bias)
    if q.device.type == "cpu" and _CPU_FLASH is not None:
        return _cpu_forward(q, k, v, scale, causal, bias)
    return _math_forward(q, k, v, scale, causal, bias)


def attention_backward(
    grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    *, scale: float, causal: bool, bias: torch.Tensor | None = None, softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of attention given the final `out` and `lse` of these query rows; those may come from a merge over
    more keys than k/v hold, which makes this the per-piece backward of blockwise (ring, document) attention.
    `bias`, `softcap`: forward's (the bias has no gradient)."""
    _check_shapes(q, k, causal)
    grad_out, out = grad_out.to(q.dtype), out.to(q.dtype)
    # Rows with lse = -inf attend nothing; any finite lse gives them p = exp(-inf - lse) = 0 (-inf would give NaN).
    lse = lse.masked_fill(torch.isneginf(lse), 0.0)
    if softcap is not None:
        if _flash_softcaps(q, k, bias):
            return _cuda_backward(grad_out, q, k, v, out, lse, scale, causal, None, softcap)
        return _math_backward(grad_out, q, k, v, out, lse, scale, causal, bias, softcap)
    if q.shape[2] == 0 or k.shape[2] == 0:
        return _math_backward(grad_out, q, k, v, out, lse, scale, causal, bias)
    if q.is_cuda:
        return _cuda_backward(grad_out, q, k, v, out, lse, scale, causal, bias)
    if q.device.type == "cpu" and _CPU_FLASH_BWD is not None:
        return _cpu_backward(grad_out, q, k, v, out, lse, scale, causal, bias)
    return _math_backward(grad_out, q, k, v, out, lse, scale, causal, bias)


# ---- helpers ---------------------------------------------------------------------------------------------------------


def _check_shapes(q, k, causal):
    hq, hk = q.shape[1], k.shape[1]
    if hq % hk:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hk})")
    sq, sk = q.shape[2], k.shape[2]
    if causal and sq != sk:
        raise ValueError(f"causal attention needs equal query and key lengths, got {sq} and {sk}")


def _expand_kv(t: torch.Tensor, groups: int) -> torch.Tensor:
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def _sum_groups(t: torch.Tensor, groups: int) -> torch.Tensor:
    if groups == 1:
        return t
    b, h, s, d = t.shape
    return t.view(b, h // groups, groups, s, d).sum(2)


def accumulation_dtype(dtype):
    """What softmax statistics and merged outputs are kept in: fp64 for fp64 inputs, else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# ---- CPU: torch's flash kernel (grouped-query heads natively) -------------------------------------------------------


# The op takes an fp32 additive mask whatever the inputs' dtype, broadcast over the batch, with or without causal.


def _cpu_forward(q, k, v, scale, causal, bias=None):
    out, lse = _CPU_FLASH(q, k, v, 0.0, causal, attn_mask=bias, scale=scale)[:2]
    return out, lse.to(accumulation_dtype(q.dtype))


def _cpu_backward(grad_out, q, k, v, out, lse, scale, causal, bias=None):
    return _CPU_FLASH_BWD(grad_out, q, k, v, out, lse.to(accumulation_dtype(q.dtype)), 0.0, causal, attn_mask=bias,
                          scale=scale)


# ---- any device: plain math (float32 or wider) -----------------------------------------------------------------------


def _math_scores(q, k, scale, causal, bias=None, softcap=None):
    """Scores of a whole (small) piece, and with `softcap` tanh(raw / cap) (its derivative's term): for devices
    without a fused kernel, empty pieces and soft-capped tiles."""
    dtype = accumulation_dtype(q.dtype)
    kx = _expand_kv(k, q.shape[1] // k.shape[1])
    s = torch.matmul(q.to(dtype), kx.to(dtype).transpose(-1, -2)) * scale
    capped = None
    if softcap is not None:
        capped = torch.tanh(s / softcap)
        s = capped * softcap
    if bias is not None:
        s = s + bias.to(dtype)
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return s, capped


def _math_forward(q, k, v, scale, causal, bias=None, softcap=None):
    s, _ = _math_scores(q, k, scale, causal, bias, softcap)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.masked_fill(torch.isneginf(lse), 0.0)[..., None])
    out = torch.matmul(p, _expand_kv(v, q.shape[1] // k.shape[1]).to(p.dtype))
    return out.to(q.dtype), lse


def _math_backward(grad_out, q, k, v, out, lse, scale, causal, bias=None, softcap=None):
    groups = q.shape[1] // k.shape[1]
    s, capped = _math_scores(q, k, scale, causal, bias, softcap)
    p = torch.exp(s - lse.to(accumulation_dtype(q.dtype))[..., None])
    g = grad_out.to(p.dtype)
    dv = torch.matmul(p.transpose(-1, -2), g)
    dp = torch.matmul(g, _expand_kv(v, groups).to(p.dtype).transpose(-1, -2))
    ds = p * (dp - (g * out.to(p.dtype)).sum(-1, keepdim=True))
    if capped is not None:  # d(cap tanh(x / cap)) / dx = 1 - tanh^2
        ds = ds * (1 - capped * capped)
    dq = torch.matmul(ds, _expand_kv(k, groups).to(p.dtype)) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q.to(p.dtype)) * scale
    return dq.to(q.dtype), _sum_groups(dk, groups).to(k.dtype), _sum_groups(dv, groups).to(v.dtype)


# ---- CUDA: flash-attn (grouped-query heads natively), else torch's memory-efficient kernel ---------------------------
# Untested on the CPU-only development machine.


@functools.cache
def flash_attn_internal(name: str):
    """A function of flash-attn's interface module and the argument names it declares (they changed across 2.x),
    or None without flash-attn. Call it with call_declared."""
    try:
        import flash_attn.flash_attn_interface as interface
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return None
    fn = getattr(interface, name, None)
    return None if fn is None else (fn, frozenset(inspect.signature(getattr(fn, "_init_fn", fn)).parameters))


def call_declared(internal, **candidates):
    """Call flash_attn_internal's function with the candidates its signature declares."""
    fn, params = internal
    return fn(**{name: value for name, value in candidates.items() if name in params})


def _uses_flash_attn(q) -> bool:
    return _flash_attn_func is not None and q.dtype in (torch.float16, torch.bfloat16)


# flash-attn 2.6 and later soft-cap (their functions take softcap)
_FLASH_SOFTCAPS = _flash_attn_func is not None and "softcap" in inspect.signature(_flash_attn_func).parameters


def _flash_softcaps(q, k, bias) -> bool:
    """Whether flash-attn soft-caps this piece itself (CUDA, fp16/bf16, no bias, not empty, a flash-attn that takes
    softcap); else the plain math does."""
    return _FLASH_SOFTCAPS and q.is_cuda and _uses_flash_attn(q) and bias is None and q.shape[2] > 0 \
        and k.shape[2] > 0


def _padded_bias(bias, q, heads: int):
    """The memory-efficient kernel's bias: q's dtype, every query head, rows 16-element aligned (a padded buffer's
    view, as SDPA hands it). In bf16 / fp16 ALiBi's values round as transformers' BLOOM rounds its own (an entry's
    weight moves by ~|b| 2^-9 e^b of its row's softmax, at most ~7e-4); fp16 clamps what it cannot hold, so a far
    tile's row stays finite (its weight is 0 either way)."""
    if bias is None:
        return None
    b, _, n, m = bias.shape
    padded = torch.empty(b, heads, n, -(-m // 16) * 16, dtype=q.dtype, device=q.device)
    view = padded[..., :m]
    view.copy_(bias.expand(b, heads, n, m)).clamp_(min=torch.finfo(q.dtype).min / 2)
    return view.expand(q.shape[0], heads, n, m)


def _cuda_forward(q, k, v, scale, causal, bias=None, softcap=None):
    if _uses_flash_attn(q) and bias is None:
        extra = {} if softcap is None else {"softcap": softcap}
        out, lse, _ = _flash_attn_func(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=scale, causal=causal,
            return_attn_probs=True, **extra,
        )
        return out.transpose(1, 2), lse
    # The memory-efficient kernel wants equal head counts: K/V of this piece are repeated per query head.
    groups = q.shape[1] // k.shape[1]
    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, _expand_kv(k, groups), _expand_kv(v, groups), _padded_bias(bias, q, q.shape[1]), True, 0.0, causal,
        scale=scale,
    )[:2]
    return out, lse[..., : q.shape[2]]


def _cuda_backward(grad_out, q, k, v, out, lse, scale, causal, bias=None, softcap=None):
    flash_bwd = flash_attn_internal("_flash_attn_backward")
    if softcap is not None and flash_bwd is None:  # flash-attn's forward without its backward: the plain math
        return _math_backward(grad_out, q, k, v, out, lse, scale, causal, None, softcap)
    if flash_bwd is not None and _uses_flash_attn(q) and bias is None:
        return _flash_attn_backward(flash_bwd, grad_out, q, k, v, out, lse, scale, causal, softcap)
    groups = q.shape[1] // k.shape[1]
    b, h, sq = lse.shape
    # The kernel stores lse padded to a multiple of 32 rows (not on ROCm) and reads it back with that stride.
    width = sq if torch.version.hip else -(-sq // 32) * 32
    lse_padded = lse.new_zeros(b, h, width)
    lse_padded[..., :sq] = lse
    unused = torch.empty((), dtype=torch.long)  # philox seed/offset: read only with dropout
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        grad_out.contiguous(), q, _expand_kv(k, groups), _expand_kv(v, groups), _padded_bias(bias, q, q.shape[1]),
        out, lse_padded, unused, unused, 0.0, [True, True, True, False], causal, scale=scale,
    )
    return dq, _sum_groups(dk, groups), _sum_groups(dv, groups)


# Arguments flash-attn's backward functions have taken across 2.x that qlm leaves at their defaults.
FLASH_BACKWARD_DEFAULTS = dict(dropout_p=0.0, window_size=(-1, -1), window_size_left=-1, window_size_right=-1,
                               softcap=0.0, alibi_slopes=None, deterministic=False, rng_state=None)


def _flash_attn_backward(internal, grad_out, q, k, v, out, lse, scale, causal, softcap=None):
    qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    dq, dk, dv = torch.empty_like(qt), torch.empty_like(kt), torch.empty_like(vt)
    extra = {} if softcap is None else {"softcap": softcap}
    call_declared(internal, dout=grad_out.transpose(1, 2).contiguous(), q=qt, k=kt, v=vt,
                  out=out.transpose(1, 2).contiguous(), softmax_lse=lse.contiguous(), dq=dq, dk=dk, dv=dv,
                  softmax_scale=scale, causal=causal, **{**FLASH_BACKWARD_DEFAULTS, **extra})
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
