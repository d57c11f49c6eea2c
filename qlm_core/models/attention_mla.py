"""Multi-latent attention (DeepSeek-V2/V3): Megatron-Core's MLASelfAttention under its local spec.

q: `linear_q_down_proj` -> `q_layernorm` -> `linear_q_up_proj` (or one `linear_q_proj` without q_lora_rank);
k and v: `linear_kv_down_proj` gives the latent (kv_lora_rank) and one rotary key part (qk_rope_head_dim, shared by
every head); the latent goes through `kv_layernorm` and `linear_kv_up_proj` into each head's no-position key
(qk_nope_head_dim) and value (v_head_dim). Each head's query and key are [no-position part; rotary part]. The rotary
parts are read in DeepSeek's interleaved pairs, as Megatron-Core reads them.

Tensor parallelism, as the local spec shards it: the down projections are column-parallel and their outputs
gathered whole on every TP rank (so the latents and their norms are computed alike on every rank); the up
projections are column-parallel by heads (their input's gradient is summed over TP, as is the shared rotary key's);
linear_proj is row-parallel. Under sequence parallelism the down projections gather the sequence.

The kernels take one head size for q, k and v, so values narrower than keys are padded with zeros to the key size
and the padding dropped from the output (no s x s tensor on any path). Decoding caches the normalised latent and
the rotated key part per token, not the expanded heads.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from qlm_core.errors import QlmError
from qlm_core.kernels.attention import core_attention, masked_attention
from qlm_core.kernels.piecewise import piecewise_attention
from qlm_core.kernels.rope import apply_rope
from qlm_core.models.attention import AttentionInputs, AttentionKind, LayerEntries
from qlm_core.models.norms import norm_kind
from qlm_core.models.runtime import ParallelOptions, outside_compile
from qlm_core.models.spec import ModelSpec
from qlm_core.models.tensor_layout import COLS, REPLICATED, ROWS, Segment, TensorLayout
from qlm_core.parallel.comm import group_size
from qlm_core.parallel.context_parallel import context_parallel_attention
from qlm_core.parallel.tensor import ColumnParallelLinear, RowParallelLinear, copy_to_tp

LATENT_NORM_EPSILON = 1e-6


def softmax_scale(spec: ModelSpec) -> float:
    """1/sqrt(q/k head size), times YaRN's mscale_all_dim factor (DeepSeek's reference; transformers and Megatron-Core
    agree)."""
    factor = getattr(spec.rope_scaling, "softmax_scale_factor", 1.0)
    return factor / math.sqrt(spec.mla.q_head_dim)


class MultiLatentAttention(nn.Module):
    def __init__(self, spec: ModelSpec, parallel: ParallelOptions, dtype, layer_index: int = 0,
                 window: int | None = None):
        super().__init__()
        self.window = window
        mla, tp_group, sp = spec.mla, parallel.tp_group, parallel.sequence_parallel
        tp = group_size(tp_group)
        if spec.num_attention_heads % tp:
            raise ValueError(f"tensor-parallel size {tp} must divide num_attention_heads {spec.num_attention_heads}")
        if spec.position != "rope":
            raise QlmError(f"multi-latent attention takes RoPE positions, not {spec.position!r}",
                           "pair another position scheme with an attention kind that takes it")
        self.spec, self.mla, self.parallel, self.layer_index, self.tp_group = spec, mla, parallel, layer_index, tp_group
        self.local_heads = spec.num_attention_heads // tp
        heads = spec.num_attention_heads
        # registration order = Megatron-Core's MLASelfAttention state_dict order
        self.linear_proj = RowParallelLinear(heads * mla.v_head_dim, spec.hidden_size, tp_group=tp_group,
                                             sequence_parallel=sp, dtype=dtype)
        if mla.q_lora_rank is None:
            self.linear_q_proj = ColumnParallelLinear(spec.hidden_size, heads * mla.q_head_dim, tp_group=tp_group,
                                                      sequence_parallel=sp, dtype=dtype)
        else:
            self.linear_q_down_proj = ColumnParallelLinear(spec.hidden_size, mla.q_lora_rank, tp_group=tp_group,
                                                           sequence_parallel=sp, gather_output=True, dtype=dtype)
            self.linear_q_up_proj = ColumnParallelLinear(mla.q_lora_rank, heads * mla.q_head_dim, tp_group=tp_group,
                                                         dtype=dtype)
        self.linear_kv_down_proj = ColumnParallelLinear(spec.hidden_size, mla.kv_lora_rank + mla.qk_rope_head_dim,
                                                        tp_group=tp_group, sequence_parallel=sp, gather_output=True,
                                                        dtype=dtype)
        self.linear_kv_up_proj = ColumnParallelLinear(mla.kv_lora_rank, heads * (mla.qk_nope_head_dim + mla.v_head_dim),
                                                      tp_group=tp_group, dtype=dtype)
        # on the gathered latents, alike on every TP rank: their gradients are whole on each (not summed); their
        # epsilon is DeepSeek's 1e-6 whatever the layers' (transformers' too)
        norm = norm_kind(spec).module
        self.q_layernorm = None if mla.q_lora_rank is None else norm(mla.q_lora_rank, LATENT_NORM_EPSILON, dtype)
        self.kv_layernorm = norm(mla.kv_lora_rank, LATENT_NORM_EPSILON, dtype)
        self.scale = softmax_scale(spec)

    def _queries(self, x: torch.Tensor, cos, sin) -> torch.Tensor:
        """x [s, b, h] (this rank's sequence shard under SP) -> q [s, b, local heads, q/k head size], rotated."""
        mla = self.mla
        if self.q_layernorm is None:
            q = self.linear_q_proj(x)
        else:
            q = self.linear_q_up_proj(self.q_layernorm(self.linear_q_down_proj(x)))
        q = q.view(*q.shape[:2], self.local_heads, mla.q_head_dim)
        q_nope, q_rope = q.split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        return torch.cat((q_nope, apply_rope(q_rope, cos, sin, interleaved=True)), dim=-1)

    def _latents(self, x: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (the normalised latent [s, b, kv_lora_rank], the rotated shared key part [s, b, 1, qk_rope_head_dim])."""
        mla = self.mla
        latent, k_rope = self.linear_kv_down_proj(x).split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        k_rope = apply_rope(copy_to_tp(k_rope, self.tp_group).unsqueeze(2), cos, sin, interleaved=True)
        return self.kv_layernorm(latent), k_rope

    def _keys_values(self, latent: torch.Tensor, k_rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """latent [..., kv_lora_rank], k_rope [..., 1, rope] -> k [..., local heads, q/k head], v [..., heads, v]."""
        mla = self.mla
        kv = self.linear_kv_up_proj(latent)
        kv = kv.view(*kv.shape[:-1], self.local_heads, mla.qk_nope_head_dim + mla.v_head_dim)
        k_nope, v = kv.split([mla.qk_nope_head_dim, mla.v_head_dim], dim=-1)
        k = torch.cat((k_nope, k_rope.expand(*k_nope.shape[:-1], mla.qk_rope_head_dim)), dim=-1)
        return k, v

    def _core_attention(self, q, k, v, inputs: AttentionInputs) -> torch.Tensor:
        if group_size(self.parallel.cp_group) > 1:
            return context_parallel_attention(
                q, k, v, group=self.parallel.cp_group, comm_type=self.parallel.cp_comm_type, scale=self.scale,
                documents=inputs.documents, window=self.window, plan=inputs.cp_plan,
            )
        if inputs.pieces is not None:
            return piecewise_attention(q, k, v, inputs.pieces, self.scale)
        if inputs.key_mask is not None:
            return masked_attention(q, k, v, inputs.key_mask, self.scale)
        return core_attention(q, k, v, causal=True, softmax_scale=self.scale)

    def _recomputed_attention(self, q, k, v, inputs: AttentionInputs) -> torch.Tensor:
        return checkpoint(self._core_attention, q, k, v, inputs, use_reentrant=False)

    def forward(self, x: torch.Tensor, positions: tuple[torch.Tensor, ...], inputs: AttentionInputs) -> torch.Tensor:
        inputs = inputs.for_window(self.window)
        cos, sin = positions
        q = self._queries(x, cos, sin)
        latent, k_rope = self._latents(x, cos, sin)
        if inputs.cache is not None:  # [b, 1, tokens, size]: the cache keeps the latents, extended by this step's
            cached_latent, cached_rope = inputs.cache.extend(self.layer_index, latent.transpose(0, 1).unsqueeze(1),
                                                             k_rope.permute(1, 2, 0, 3))
            latent, k_rope = cached_latent.squeeze(1).transpose(0, 1), cached_rope.permute(2, 0, 1, 3)
        k, v = self._keys_values(latent, k_rope)
        mla = self.mla
        pad = mla.q_head_dim - mla.v_head_dim
        if pad > 0:  # one head size for the kernels (a value narrower than the key)
            v = F.pad(v, (0, pad))
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads, s, d]
        plain = inputs.pieces is None and inputs.cp_plan is None and group_size(self.parallel.cp_group) == 1
        if self.parallel.recomputes("core_attn"):
            out = outside_compile(self._recomputed_attention, q, k, v, inputs)
        elif plain:
            out = self._core_attention(q, k, v, inputs)
        else:
            out = outside_compile(self._core_attention, q, k, v, inputs)
        if pad > 0:
            out = out[..., :mla.v_head_dim]
        s, b = out.shape[2], out.shape[0]
        return self.linear_proj(out.permute(2, 0, 1, 3).reshape(s, b, -1))


def _rope_rows(base: int, nope: int, rope: int, interleave: bool) -> list[tuple[int, int, int]]:
    """(Megatron row, HF row, count) runs of one head's [no-position; rotary] rows starting at `base`: in order when
    HF holds the rotary rows in pairs, else Megatron's pair row 2i is HF's row i and 2i+1 is HF's row rope/2 + i."""
    if interleave:
        return [(base, base, nope + rope)]
    runs = [(base, base, nope)]
    for i in range(rope // 2):
        runs += [(base + nope + 2 * i, base + nope + i, 1), (base + nope + 2 * i + 1, base + nope + rope // 2 + i, 1)]
    return runs


def _rows(name: str, hf_name: str, shape: tuple[int, ...], split: str,
          runs: list[tuple[int, int, int]]) -> TensorLayout:
    return TensorLayout(name, shape, split, tuple(Segment(row, row + count, hf_name, hf_row)
                                                  for row, hf_row, count in runs if count))


def mla_layer_entries(s: ModelSpec, layer: int) -> LayerEntries:
    """MLASelfAttention's tensors in Megatron-Core's order (local spec), from HF's q_a_proj / q_a_layernorm /
    q_b_proj (or q_proj), kv_a_proj_with_mqa / kv_a_layernorm / kv_b_proj and o_proj; with rope_interleave false
    the rotary rows are reordered into pairs (_rope_rows)."""
    mla, h, heads = s.mla, s.hidden_size, s.num_attention_heads
    hf, name = f"model.layers.{layer}.self_attn.", f"decoder.layers.{layer}.self_attention."
    qd, rope, nope = mla.q_head_dim, mla.qk_rope_head_dim, mla.qk_nope_head_dim
    q_runs = [run for head in range(heads) for run in _rope_rows(head * qd, nope, rope, mla.rope_interleave)]
    out: LayerEntries = [
        ("self_attention.linear_proj.weight", TensorLayout(
            name + "linear_proj.weight", (h, heads * mla.v_head_dim), COLS,
            (Segment(0, heads * mla.v_head_dim, hf + "o_proj.weight"),))),
        ("self_attention.linear_proj._extra_state", None),
    ]
    if mla.q_lora_rank is None:
        out += [("self_attention.linear_q_proj.weight", _rows(name + "linear_q_proj.weight", hf + "q_proj.weight",
                                                              (heads * qd, h), ROWS, q_runs)),
                ("self_attention.linear_q_proj._extra_state", None)]
    else:
        out += [("self_attention.linear_q_down_proj.weight", TensorLayout(
                    name + "linear_q_down_proj.weight", (mla.q_lora_rank, h), ROWS,
                    (Segment(0, mla.q_lora_rank, hf + "q_a_proj.weight"),))),
                ("self_attention.linear_q_down_proj._extra_state", None),
                ("self_attention.linear_q_up_proj.weight", _rows(
                    name + "linear_q_up_proj.weight", hf + "q_b_proj.weight", (heads * qd, mla.q_lora_rank), ROWS,
                    q_runs)),
                ("self_attention.linear_q_up_proj._extra_state", None)]
    kv_rows = mla.kv_lora_rank + rope
    kv_runs = [(0, 0, mla.kv_lora_rank)] + _rope_rows(mla.kv_lora_rank, 0, rope, mla.rope_interleave)
    up_rows = heads * (nope + mla.v_head_dim)
    out += [("self_attention.linear_kv_down_proj.weight", _rows(name + "linear_kv_down_proj.weight",
                                                                hf + "kv_a_proj_with_mqa.weight", (kv_rows, h), ROWS,
                                                                kv_runs)),
            ("self_attention.linear_kv_down_proj._extra_state", None),
            ("self_attention.linear_kv_up_proj.weight", TensorLayout(
                name + "linear_kv_up_proj.weight", (up_rows, mla.kv_lora_rank), ROWS,
                (Segment(0, up_rows, hf + "kv_b_proj.weight"),))),
            ("self_attention.linear_kv_up_proj._extra_state", None)]
    norms = ([("q_layernorm", "q_a_layernorm", mla.q_lora_rank)] if mla.q_lora_rank is not None else []) \
        + [("kv_layernorm", "kv_a_layernorm", mla.kv_lora_rank)]
    for module, hf_module, size in norms:
        for tensor in norm_kind(s).tensors:
            suffix = f"self_attention.{module}.{tensor}"
            out.append((suffix, TensorLayout(f"decoder.layers.{layer}.{suffix}", (size,), REPLICATED,
                                             (Segment(0, size, f"{hf}{hf_module}.{tensor}"),))))
    return out


def mla_flops_per_token(s: ModelSpec, keys: float) -> tuple[float, float]:
    """The projections (down, up, output); QK^T over the q/k head size and AV over the value size, per head."""
    mla, h, heads = s.mla, s.hidden_size, s.num_attention_heads
    q = h * heads * mla.q_head_dim if mla.q_lora_rank is None else \
        h * mla.q_lora_rank + mla.q_lora_rank * heads * mla.q_head_dim
    kv = h * (mla.kv_lora_rank + mla.qk_rope_head_dim) + mla.kv_lora_rank * heads * (mla.qk_nope_head_dim
                                                                                     + mla.v_head_dim)
    proj = heads * mla.v_head_dim * h
    return 2 * (q + kv + proj), 2 * keys * heads * (mla.q_head_dim + mla.v_head_dim)


MLA = AttentionKind(module=MultiLatentAttention, layer_entries=mla_layer_entries, flops_per_token=mla_flops_per_token)
