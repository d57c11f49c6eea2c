"""Grouped-query attention (multi-head when groups = heads): Megatron-Core's SelfAttention with a fused, grouped
linear_qkv, optional per-head q/k RMSNorm (Qwen3), RoPE, learned positions or ALiBi, and every kernel path qlm has
(fused, piecewise for packed documents and windows, context parallel, a decoding step's key mask)."""

from __future__ import annotations

import functools
import math

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from qlm_core.errors import QlmError
from qlm_core.kernels.alibi import alibi_slopes, tiles
from qlm_core.kernels.attention import core_attention, flash_attn_runs, masked_attention
from qlm_core.kernels.pieces import Piece, self_attention_pieces
from qlm_core.kernels.piecewise import piecewise_attention
from qlm_core.kernels.rope import apply_rope
from qlm_core.models.attention import AttentionInputs, AttentionKind, LayerEntries
from qlm_core.models.families import FAMILIES
from qlm_core.models.norms import build_norm, norm_kind
from qlm_core.models.runtime import ParallelOptions, outside_compile
from qlm_core.models.spec import ModelSpec
from qlm_core.models.tensor_layout import COLS, REPLICATED, ROWS, Segment, TensorLayout
from qlm_core.parallel.comm import group_rank, group_size
from qlm_core.parallel.context_parallel import context_parallel_attention
from qlm_core.parallel.param_meta import mark
from qlm_core.parallel.tensor import ColumnParallelLinear, RowParallelLinear, gather_last_dim_sum_grad


class GroupedQueryAttention(nn.Module):
    def __init__(self, spec: ModelSpec, parallel: ParallelOptions, dtype, layer_index: int = 0,
                 window: int | None = None):
        """`layer_index`: the layer's position in its module (numbered from 0), its slot in a KVCache; `window`:
        its sliding window (None: every earlier key)."""
        super().__init__()
        tp_group, sequence_parallel = parallel.tp_group, parallel.sequence_parallel
        self.parallel = parallel
        self.layer_index = layer_index
        self.window = window
        tp = group_size(tp_group)
        if spec.num_query_groups % tp and tp % spec.num_query_groups:
            raise ValueError(
                f"tensor-parallel size {tp} must divide, or be a multiple of, num_query_groups {spec.num_query_groups}"
            )
        if spec.num_attention_heads % tp:
            raise ValueError(f"tensor-parallel size {tp} must divide num_attention_heads {spec.num_attention_heads}")
        self.spec = spec
        self.tp_group = tp_group
        # Registration order matches Megatron-Core's SelfAttention (core_attention, linear_proj, then linear_qkv).
        self.core_attention = CoreAttentionSinks(spec.num_attention_heads // tp, dtype) if spec.attention_sinks \
            else None
        self.linear_proj = RowParallelLinear(
            spec.num_attention_heads * spec.kv_channels, spec.hidden_size, bias=spec.linear_bias,
            tp_group=tp_group, sequence_parallel=sequence_parallel, dtype=dtype,
        )
        self.linear_qkv = ColumnParallelLinear(
            spec.hidden_size, spec.qkv_rows, bias=spec.qkv_bias,
            tp_group=tp_group, sequence_parallel=sequence_parallel, dtype=dtype,
        )
        # RoPE: q and k rotated by the (cos, sin) it hands each layer; learned positions: added to the embedding;
        # ALiBi: this rank's heads' slopes, added by the kernels
        if spec.position not in ("rope", "learned_absolute", "alibi"):
            raise QlmError(f"grouped-query attention takes RoPE, learned or ALiBi positions, not {spec.position!r}",
                           "pair another position scheme with an attention kind that takes it")
        self._slopes_on: dict[torch.device, torch.Tensor] = {}
        self.slopes = None
        if spec.position == "alibi":
            heads = spec.num_attention_heads // tp
            self.slopes = alibi_slopes(spec.num_attention_heads)[group_rank(tp_group) * heads:][:heads]
        self.q_layernorm = self.k_layernorm = None
        if spec.qk_layernorm:  # on each head; every TP rank holds other heads, so their gradients are summed
            self.q_layernorm = build_norm(spec, spec.kv_channels, dtype)
            self.k_layernorm = build_norm(spec, spec.kv_channels, dtype)
            for tensor in (*self.q_layernorm.parameters(), *self.k_layernorm.parameters()):
                mark(tensor, sequence_parallel=group_size(tp_group) > 1)

    @property
    def slopes(self) -> torch.Tensor | None:
        """ALiBi's slopes of this rank's heads (fp32; None without ALiBi), copied to each device once, not a buffer
        that .to(dtype) would cast."""
        return self._slopes

    @slopes.setter
    def slopes(self, value: torch.Tensor | None) -> None:
        self._slopes = value
        self._slopes_on.clear()

    def _split_qkv(self, mixed: torch.Tensor):
        """mixed [s, b, local qkv rows] -> q [s, b, local heads, d], k and v [s, b, local groups, d]."""
        spec, tp, d = self.spec, group_size(self.tp_group), self.spec.kv_channels
        per_group = spec.heads_per_group
        if spec.num_query_groups >= tp:
            groups = spec.num_query_groups // tp
        else:
            # Fewer query groups than TP ranks: each rank's qkv rows are a contiguous chunk of the grouped layout
            # that does not align with groups. Gather the whole projection, keep this rank's group, and then only
            # this rank's query heads of it (Megatron-Core does the same).
            mixed = gather_last_dim_sum_grad(mixed, self.tp_group)
            ranks_per_group = tp // spec.num_query_groups
            group = group_rank(self.tp_group) // ranks_per_group
            size = mixed.shape[-1] // spec.num_query_groups
            mixed = mixed[..., group * size : (group + 1) * size]
            groups = 1
        s, b = mixed.shape[:2]
        mixed = mixed.view(s, b, groups, (per_group + 2) * d)
        q, k, v = torch.split(mixed, [per_group * d, d, d], dim=-1)
        q = q.reshape(s, b, groups * per_group, d)
        if spec.num_query_groups < tp:
            heads = spec.num_attention_heads // tp
            first = (group_rank(self.tp_group) % (tp // spec.num_query_groups)) * heads
            q = q[:, :, first : first + heads]
        return q, k, v

    def _core_attention(self, q, k, v, inputs: AttentionInputs) -> torch.Tensor:
        scale = self.spec.softmax_scale or 1.0 / math.sqrt(self.spec.kv_channels)  # Gemma: query_pre_attn_scalar
        sinks = None if self.core_attention is None else self.core_attention.softmax_offset
        slopes = None
        if self.slopes is not None:
            slopes = self._slopes_on.get(q.device)
            if slopes is None:
                slopes = self._slopes_on[q.device] = self.slopes.to(q.device)
        softcap = self.spec.attention_softcap
        if group_size(self.parallel.cp_group) > 1:
            return context_parallel_attention(
                q, k, v, group=self.parallel.cp_group, comm_type=self.parallel.cp_comm_type, scale=scale,
                documents=inputs.documents, window=self.window, plan=inputs.cp_plan, sinks=sinks, slopes=slopes,
                softcap=softcap,
            )
        if inputs.pieces is not None:
            return piecewise_attention(q, k, v, inputs.pieces, scale, sinks, slopes, softcap)
        if inputs.key_mask is not None:
            return masked_attention(q, k, v, inputs.key_mask, scale, sinks, slopes, softcap)
        if (slopes is not None or softcap is not None) and sinks is None and flash_attn_runs(q):
            return core_attention(q, k, v, causal=True, softmax_scale=scale, alibi_slopes=slopes, softcap=softcap)
        if sinks is not None or slopes is not None or softcap is not None:
            # the fused kernels keep no log-sum-exp to add the sinks to, and take no ALiBi or soft-capping: one causal
            # piece a row (ALiBi's and the soft-capped math's cut into tiles)
            tiled = slopes is not None or softcap is not None
            return piecewise_attention(q, k, v, _causal_pieces(q.shape[2], slopes is not None, tiled), scale, sinks,
                                       slopes, softcap)
        return core_attention(q, k, v, causal=True, softmax_scale=scale)

    def _recomputed_attention(self, q, k, v, inputs: AttentionInputs) -> torch.Tensor:
        return checkpoint(self._core_attention, q, k, v, inputs, use_reentrant=False)

    def forward(self, x: torch.Tensor, positions: tuple[torch.Tensor, ...], inputs: AttentionInputs) -> torch.Tensor:
        inputs = inputs.for_window(self.window)
        q, k, v = self._split_qkv(self.linear_qkv(x))
        if self.q_layernorm is not None:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        if positions is not None:  # RoPE's (cos, sin); None: learned positions, already in x
            cos, sin = positions
            interleaved = self.spec.rotary_interleaved  # q and k alike: their dot products are GLM's
            q, k = apply_rope(q, cos, sin, interleaved), apply_rope(k, cos, sin, interleaved)
        # [s, b, heads, d] -> [b, heads, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        if inputs.cache is not None:
            k, v = inputs.cache.extend(self.layer_index, k, v)
        plain = inputs.pieces is None and inputs.cp_plan is None and group_size(self.parallel.cp_group) == 1 \
            and self.core_attention is None and self.slopes is None and self.spec.attention_softcap is None
        if self.parallel.recomputes("core_attn"):
            out = outside_compile(self._recomputed_attention, q, k, v, inputs)
        elif plain:
            out = self._core_attention(q, k, v, inputs)
        else:  # packed documents, windows, context parallelism: the pieces are Python data, computed eagerly
            out = outside_compile(self._core_attention, q, k, v, inputs)
        s, b = out.shape[2], out.shape[0]
        return self.linear_proj(out.permute(2, 0, 1, 3).reshape(s, b, -1))


@functools.lru_cache(maxsize=8)
def _causal_pieces(seq_len: int, positional: bool, tiled: bool) -> list[Piece]:
    """One causal piece over each whole row (`positional`: keeping its shift; `tiled`: cut into tiles)."""
    pieces = self_attention_pieces(None, seq_len, None, positional)
    return tiles(pieces) if tiled else pieces


class CoreAttentionSinks(nn.Module):
    """Megatron-Core's core_attention with softmax_type "learnable": the sink logit of each of this rank's heads
    (`softmax_offset`, split over TP with the heads; HF's self_attn.sinks)."""

    def __init__(self, local_heads: int, dtype):
        super().__init__()
        self.softmax_offset = mark(nn.Parameter(torch.zeros(local_heads, dtype=dtype)), tp_split=True)


def gqa_layer_entries(s: ModelSpec, layer: int) -> LayerEntries:
    """linear_proj, the grouped linear_qkv ([q of the group's heads; k; v] per group, from HF's q/k/v_proj) and
    Qwen3's q/k norms, in Megatron-Core's state_dict order."""
    h, d, g, per_group = s.hidden_size, s.kv_channels, s.num_query_groups, s.heads_per_group
    hf, name = f"model.layers.{layer}.", f"decoder.layers.{layer}."
    qd = s.num_attention_heads * d
    out: LayerEntries = [
        *([("self_attention.core_attention.softmax_offset", TensorLayout(
            name + "self_attention.core_attention.softmax_offset", (s.num_attention_heads,), ROWS,
            (Segment(0, s.num_attention_heads, hf + "self_attn.sinks"),)))] if s.attention_sinks else []),
        ("self_attention.linear_proj.weight", TensorLayout(
            name + "self_attention.linear_proj.weight", (h, qd), COLS,
            (Segment(0, qd, hf + "self_attn.o_proj.weight"),))),
        *([("self_attention.linear_proj.bias", TensorLayout(
            name + "self_attention.linear_proj.bias", (h,), REPLICATED,
            (Segment(0, h, hf + "self_attn.o_proj.bias"),)))] if s.linear_bias else []),
        ("self_attention.linear_proj._extra_state", None),
    ]
    files = FAMILIES[s.model_type].qkv_files
    # where q, k and v start in one stacked tensor (MPT's Wqkv: every q, every k, every v)
    stacked = {"q": 0, "k": qd, "v": qd + g * d} if files == "stacked" else {"q": 0, "k": 0, "v": 0}
    for kind in ("weight", "bias") if s.qkv_bias else ("weight",):
        segs, row = [], 0
        if files == "per_head":  # BLOOM's query_key_value: [q; k; v] head by head, Megatron's rows as they are
            segs.append(Segment(0, s.qkv_rows, f"{hf}self_attn.qkv_proj.{kind}"))
        for group in range(0 if files == "per_head" else g):
            for proj, rows, hf_start in (
                ("q", per_group * d, group * per_group * d), ("k", d, group * d), ("v", d, group * d),
            ):
                tensor = f"{hf}self_attn.{'qkv' if files == 'stacked' else proj}_proj.{kind}"
                segs.append(Segment(row, row + rows, tensor, stacked[proj] + hf_start))
                row += rows
        shape = (s.qkv_rows, h) if kind == "weight" else (s.qkv_rows,)
        suffix = f"self_attention.linear_qkv.{kind}"
        out.append((suffix, TensorLayout(name + suffix, shape, ROWS, tuple(segs))))
    out.append(("self_attention.linear_qkv._extra_state", None))
    if s.qk_layernorm:
        for which in ("q", "k"):
            for tensor in norm_kind(s).tensors:
                suffix = f"self_attention.{which}_layernorm.{tensor}"
                out.append((suffix, TensorLayout(name + suffix, (d,), REPLICATED,
                                                 (Segment(0, d, f"{hf}self_attn.{which}_norm.{tensor}"),))))
    return out


def gqa_flops_per_token(s: ModelSpec, keys: float) -> tuple[float, float]:
    """linear_qkv and linear_proj; QK^T and AV over `keys` keys for every query head."""
    return 2 * (s.hidden_size * s.qkv_rows + s.num_attention_heads * s.kv_channels * s.hidden_size), \
        2 * 2 * keys * s.num_attention_heads * s.kv_channels


GQA = AttentionKind(module=GroupedQueryAttention, layer_entries=gqa_layer_entries,
                    flops_per_token=gqa_flops_per_token)
