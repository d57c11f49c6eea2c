"""What one grouped-query attention layer (models/attention_gqa.py) saves for backward, for the profile: the
"attention", "linear_proj input", "q/k norm", CP and recompute parts of profile/activations.py's docstring. `x` is an
ActivationInputs (profile/activations.py)."""

from __future__ import annotations


def heads(x) -> tuple[float, float, float]:
    """(query heads, kv heads, linear_qkv output columns in units of d) on one TP rank."""
    s = x.spec
    hq = s.num_attention_heads / x.tp
    if s.num_query_groups >= x.tp:
        return hq, s.num_query_groups / x.tp, (s.num_attention_heads + 2 * s.num_query_groups) / x.tp
    return hq, 1, s.num_attention_heads + 2 * s.num_query_groups  # gathered whole, one group kept


def kv_cache_entries(spec) -> float:
    """A token's entries in one layer's decoding cache (models/attention.KVCache): its key and value per group."""
    return 2.0 * spec.num_query_groups * spec.kv_channels


def q_copied(x) -> bool:
    """Whether q is a copy of linear_qkv's output: reshaping a rank's query heads out of more than one group of
    [q heads; k; v] rows cannot be a view (one group, or one head per group, can)."""
    s = x.spec
    return s.num_query_groups > x.tp and s.heads_per_group > 1


def qk_norm_terms(x) -> dict[str, float]:
    """Qwen3's q/k RMSNorm per head (kernels/norm.RMSNormFunction): each keeps its input and fp32 1/rms. k's input is
    a view of linear_qkv's output (counted with v, or here under CP's all-to-all, which keeps no v view); q's is that
    view too, or its own copy (q_copied)."""
    if not x.spec.qk_layernorm:
        return {}
    e, T, d = x.dtype_bytes, x.tokens, x.spec.kv_channels
    hq, hk, qkv_cols = heads(x)
    terms = {"q/k norm 1/rms (fp32)": 4 * (hq + hk) * T, "q norm input": e * hq * d * T if q_copied(x) else 0.0}
    if x.cp > 1 and x.cp_comm_type == "a2a":
        terms["linear_qkv output (k norm input)"] = e * qkv_cols * d * T
    return terms


def saved_terms(x, recompute: str, input_discarded: bool) -> dict[str, float]:
    """Its saved bytes without per-op recompute: `input_discarded` (recompute of the layernorm module): linear_qkv's
    input, the norm's output, is discarded until backward."""
    e, T, Tsp, h, d = x.dtype_bytes, x.tokens, x.sp_tokens, x.spec.hidden_size, x.spec.kv_channels
    hq, hk, qkv_cols = heads(x)
    keeps_input = x.keeps_input("linear_qkv") and not input_discarded
    terms = {"linear_qkv input": e * h * Tsp if keeps_input else 0.0}
    core_attn = x.recomputes(recompute, "core_attn")
    proj = e * hq * d * T if x.keeps_input("linear_proj") else 0.0
    if x.cp > 1 and x.cp_comm_type == "a2a":
        kv_a2a = hk if hk % x.cp == 0 else x.cp
        terms["q, k, v after all-to-all"] = e * (hq + 2 * kv_a2a) * d * T
        if core_attn:  # the checkpoint keeps the local q, k and v instead
            terms["q, k, v after all-to-all"] = e * (hq + hk + qkv_cols) * d * T
    elif x.rotary:
        terms["q, k after RoPE"] = e * (hq + hk) * d * T
        terms["linear_qkv output (v)"] = e * qkv_cols * d * T
    else:
        terms["linear_qkv output (q, k, v)"] = e * qkv_cols * d * T
    if x.cp > 1:
        proj_is_copy = x.cp_comm_type == "a2a"
    else:
        proj_is_copy = x.device == "cuda" and x.micro_batch_size > 1
    if core_attn:
        terms["linear_proj input"] = e * hq * d * T  # the projection keeps its input; the kernel keeps nothing
    else:
        terms["attention output"] = e * hq * d * T
        terms["log-sum-exp"] = 4 * hq * T
        terms["linear_proj input"] = proj if proj_is_copy else 0.0
    terms.update(qk_norm_terms(x))
    return terms


def op_terms(x) -> dict[str, float]:
    """Under recompute = "op": the first of its two matmuls' output (linear_qkv) and the kernel's outputs."""
    e, T, d = x.dtype_bytes, x.tokens, x.spec.kv_channels
    hq, _, qkv_cols = heads(x)
    return {"linear_qkv output (1st matmul)": e * qkv_cols * d * T, "attention output": e * hq * d * T,
            "log-sum-exp": 4 * hq * T}


def recomputed_core(x) -> float:
    """Bytes the core_attn recompute rebuilds in backward: the kernel's output and log-sum-exp."""
    hq, _, _ = heads(x)
    return x.dtype_bytes * hq * x.spec.kv_channels * x.tokens + 4 * hq * x.tokens


def cp_buffers(x) -> float:
    """K/V (and dK/dV) that the CP kernel holds while one layer's attention backward runs (a transient)."""
    if x.cp == 1:
        return 0.0
    e, T, d = x.dtype_bytes, x.tokens, x.spec.kv_channels
    hq, hk, _ = heads(x)
    kv = 2 * hk * d * T  # elements of one rank's K and V
    dq = 4 * hq * d * T
    if x.cp_comm_type == "p2p":  # the block at hand and the one arriving, their fp32 dK/dV and the one in flight
        return 2 * e * kv + 2 * 4 * kv + dq
    if x.cp_comm_type == "allgather":  # the gathered K/V and their fp32 gradient, whole
        return x.cp * kv * (e + 4) + dq
    return e * (hq + 2 * max(hk, x.cp)) * d * T  # a2a: the re-laid-out q, k, v


def position_terms(x) -> dict[str, float]:
    """Saved once per forward of a stage chunk: RoPE's cos and sin [T, rotated dims], one pair per RoPE base its
    layers use (Gemma 3: the windowed layers' own and the global layers')."""
    bases = 2 if x.spec.local_rope_theta is not None and len(set(x.spec.windows)) > 1 else 1
    return {"rope cos/sin": bases * 2 * x.dtype_bytes * x.spec.rope_dim * x.tokens} if x.rotary else {}
