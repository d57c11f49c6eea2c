"""What one multi-latent attention layer (models/attention_mla.py) saves for backward, for the profile. `x` is an
ActivationInputs (profile/activations.py); per TP rank, with T tokens, T_sp its sequence shard, hl = heads/tp, d the
q/k head size (no-position + rotary), dv the value size, r the rotary size, Q = q_lora_rank, L = kv_lora_rank:

  down projections   their input, the input norm's output e·h·T_sp (one tensor for both); their outputs are
                     gathered whole on every TP rank: the q latent, which its norm keeps (e·Q·T + fp32 1/rms 4·T),
                     and [kv latent; rotary key], which the kv norm keeps whole through its view (e·(L+r)·T + 4·T)
  up projections     their inputs, the normed latents: e·Q·T and e·L·T (their outputs are split into views and
                     concatenated into q and k, so nothing keeps them)
  attention          q and k, new tensors of hl·d per token; v padded to d (a new tensor) when dv < d, else a view
                     that keeps linear_kv_up_proj's output (hl·(d - r + dv)); the kernel's output e·hl·d·T and
                     log-sum-exp 4·hl·T
  linear_proj input  the output's first dv of each head, laid out [s, b, hl·dv]: a copy, e·hl·dv·T, when dv < d;
                     else the kernel's output itself where grouped-query attention's is
Per forward of a stage chunk: RoPE's cos and sin over the rotary part, 2·e·r·T.
"""

from __future__ import annotations


def _sizes(x):
    s = x.spec
    mla = s.mla
    return s.num_attention_heads / x.tp, mla.q_head_dim, mla.v_head_dim, mla.qk_rope_head_dim, mla.q_lora_rank, \
        mla.kv_lora_rank


def _value_bytes(x) -> float:
    """The value tensor the kernel keeps: padded to the key size, or a view of linear_kv_up_proj's output."""
    hl, d, dv, r, _, _ = _sizes(x)
    return x.dtype_bytes * hl * (d if dv < d else d - r + dv) * x.tokens


def _latent_terms(x, input_discarded: bool) -> dict[str, float]:
    e, T, Tsp, h = x.dtype_bytes, x.tokens, x.sp_tokens, x.spec.hidden_size
    hl, d, dv, r, Q, L = _sizes(x)
    keeps_input = not input_discarded
    terms = {"down projections' input": e * h * Tsp if keeps_input else 0.0,
             "kv latent + rotary key (kv norm input)": e * (L + r) * T + 4 * T,
             "kv latent (linear_kv_up_proj input)": e * L * T}
    if Q is not None:
        terms.update({"q latent (q norm input)": e * Q * T + 4 * T, "q latent (linear_q_up_proj input)": e * Q * T})
    return terms


def saved_terms(x, recompute: str, input_discarded: bool) -> dict[str, float]:
    e, T = x.dtype_bytes, x.tokens
    hl, d, dv, r, _, _ = _sizes(x)
    terms = _latent_terms(x, input_discarded)
    terms.update({"q, k": 2 * e * hl * d * T, "v": _value_bytes(x)})
    core_attn = x.recomputes(recompute, "core_attn")
    # the output's first dv of each head: a copy when dv < d; else the kernel's output seen as [s, b, hl·d], a
    # copy only where grouped-query attention's is (attention_gqa_terms.saved_terms)
    proj_is_copy = dv < d or (x.cp_comm_type == "a2a" if x.cp > 1 else x.device == "cuda" and x.micro_batch_size > 1)
    if core_attn or proj_is_copy:
        terms["linear_proj input"] = e * hl * dv * T
    if not core_attn:
        terms.update({"attention output": e * hl * d * T, "log-sum-exp": 4 * hl * T})
    return terms


def op_terms(x) -> dict[str, float]:
    """Under recompute = "op": the first, third and fifth matmuls' outputs (with q's low rank: linear_q_down_proj's
    and linear_kv_down_proj's before their gathers, and linear_proj's partial sums; without: linear_q_proj's and
    linear_kv_up_proj's) and the kernel's outputs."""
    e, T, h = x.dtype_bytes, x.tokens, x.spec.hidden_size
    hl, d, dv, r, Q, L = _sizes(x)
    if Q is not None:
        kept = {"linear_q_down_proj output": e * Q / x.tp * T, "linear_kv_down_proj output": e * (L + r) / x.tp * T,
                "linear_proj output": e * h * T}
    else:
        kept = {"linear_q_proj output": e * hl * d * T,
                "linear_kv_up_proj output": e * hl * (d - r + dv) * T}
    return {**kept, "attention output": e * hl * d * T, "log-sum-exp": 4 * hl * T}


def matmuls(spec) -> int:
    return 5 if spec.mla.q_lora_rank is not None else 4


def recomputed_core(x) -> float:
    hl, d, _, _, _, _ = _sizes(x)
    return x.dtype_bytes * hl * d * x.tokens + 4 * hl * x.tokens


def cp_buffers(x) -> float:
    """The CP kernel's K/V (and dK/dV) transient, over every local head at the padded size d."""
    if x.cp == 1:
        return 0.0
    e, T = x.dtype_bytes, x.tokens
    hl, d, _, _, _, _ = _sizes(x)
    kv, dq = 2 * hl * d * T, 4 * hl * d * T
    if x.cp_comm_type == "p2p":
        return 2 * e * kv + 2 * 4 * kv + dq
    if x.cp_comm_type == "allgather":
        return x.cp * kv * (e + 4) + dq
    return e * 3 * hl * d * T


def position_terms(x) -> dict[str, float]:
    return {"rope cos/sin": 2 * x.dtype_bytes * x.spec.mla.qk_rope_head_dim * x.tokens} if x.rotary else {}


def kv_cache_entries(spec) -> float:
    """A token's entries in one layer's decoding cache: its normed latent and rotated key part."""
    return float(spec.mla.kv_lora_rank + spec.mla.qk_rope_head_dim)
