"""The attention seam: what every attention kind is given each forward (AttentionInputs, worked out once per
micro-batch by attention_inputs, and the KVCache of decoding) and what each kind supplies (AttentionKind: its module,
its tensors in Megatron's and HF's names with their shard rules, its FLOPs). TransformerLayer builds
`attention_kind(spec).module(...)` (attention_kinds.py); a new kind is one module plus one ModelSpec.attention value."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from qlm_core.kernels.alibi import tiles
from qlm_core.kernels.pieces import Documents, Piece, decoding_pieces, self_attention_pieces
from qlm_core.models.runtime import ParallelOptions
from qlm_core.models.spec import ModelSpec
from qlm_core.models.tensor_layout import TensorLayout
from qlm_core.parallel.comm import group_rank, group_size
from qlm_core.parallel.context_parallel import cp_attention_plan, gather_sequence

# (local-spec suffix, global tensor) in Megatron-Core's state_dict order; None: the `_extra_state` after a linear
LayerEntries = list[tuple[str, TensorLayout | None]]


@dataclass(frozen=True)
class AttentionKind:
    """What one attention kind brings to the model, the layout and the FLOP count.

    module(spec, parallel, dtype, layer_index, window) -> the layer's `self_attention` module (`window`: its
        sliding window, None: full attention); its forward takes (x [s, b, h], positions — the position scheme's
        tuple, models/positions.py —, inputs: AttentionInputs, whose for_window(window) it reads) and
        returns [s, b, h], after its output projection
        (the row-parallel linear reduces over TP).
    layer_entries(spec, layer) -> its tensors of layer `layer`: suffixes below `decoder.layers.N.`, global
        TensorLayouts whose Segments name the HF tensors (`model.layers.N.self_attn...`).
    flops_per_token(spec, keys) -> forward FLOPs per token: (its matmuls, the attention over `keys` keys).
    """

    module: Callable[[ModelSpec, ParallelOptions, torch.dtype, int], nn.Module]
    layer_entries: Callable[[ModelSpec, int], LayerEntries]
    flops_per_token: Callable[[ModelSpec, float], tuple[float, float]]


@dataclass
class AttentionInputs:
    """Per-forward facts every attention layer needs besides q, k, v, worked out once per forward."""

    documents: Documents | None = None  # packed documents in global positions (None: one per row)
    cache: KVCache | None = None  # incremental decoding: keys/values of earlier tokens
    # a decoding step of one token a row: the keys it sees [b, 1, 1, keys] (bool; O(keys), one kernel call)
    key_mask: torch.Tensor | None = None
    pieces: list[Piece] | None = None  # what one process computes, when not plain causal attention over each row
    cp_plan: tuple[list[Piece], ...] | None = None  # under context parallelism: what this rank computes
    window: int | None = None  # the sliding window these inputs are for (None: full attention)
    # the same forward's inputs for the other windows its layers have (Gemma's local and global layers)
    others: dict[int | None, AttentionInputs] = field(default_factory=dict)

    def for_window(self, window: int | None) -> AttentionInputs:
        """The inputs of a layer with this sliding window."""
        return self if window == self.window else self.others[window]


@dataclass
class KVCache:
    """Keys and values (after RoPE) of the tokens already decoded, per layer: [b, groups, tokens, head_dim] (multi-
    latent attention: its latent [b, 1, tokens, kv_lora_rank] and rotated key part [b, 1, tokens, rope dims]).

    extend() concatenates, unless reserve() made room: then each layer's keys and values are views of a buffer the
    new tokens are written into, so a decoding step copies only its own token (not the whole cache)."""

    keys: list
    values: list
    buffers: list | None = None  # per layer (keys buffer, values buffer) [b, groups, capacity, head_dim]

    @classmethod
    def empty(cls, num_layers: int) -> KVCache:
        return cls([None] * num_layers, [None] * num_layers)

    @property
    def length(self) -> int:
        return 0 if self.keys[0] is None else self.keys[0].shape[2]

    def reserve(self, tokens: int) -> None:
        """Room for `tokens` more per layer (after at least one extend)."""
        self.buffers = []
        for layer, (k, v) in enumerate(zip(self.keys, self.values, strict=True)):
            # keys and values may differ in size (multi-latent attention caches its latent and rotary key part)
            buffer_k = k.new_empty((*k.shape[:2], k.shape[2] + tokens, k.shape[3]))
            buffer_v = v.new_empty((*v.shape[:2], v.shape[2] + tokens, v.shape[3]))
            buffer_k[:, :, :k.shape[2]], buffer_v[:, :, :v.shape[2]] = k, v
            self.buffers.append((buffer_k, buffer_v))
            self.keys[layer], self.values[layer] = buffer_k[:, :, :k.shape[2]], buffer_v[:, :, :v.shape[2]]

    def select(self, rows: torch.Tensor) -> None:
        """Keep only these rows (index tensor) of every layer: decoding drops the rows that have finished."""
        if self.buffers is None:
            self.keys = [k.index_select(0, rows) for k in self.keys]
            self.values = [v.index_select(0, rows) for v in self.values]
            return
        length = self.length
        self.buffers = [(bk.index_select(0, rows), bv.index_select(0, rows)) for bk, bv in self.buffers]
        self.keys = [bk[:, :, :length] for bk, _ in self.buffers]
        self.values = [bv[:, :, :length] for _, bv in self.buffers]

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        past = 0 if self.keys[layer] is None else self.keys[layer].shape[2]
        if self.buffers is not None and past + k.shape[2] <= self.buffers[layer][0].shape[2]:
            buffer_k, buffer_v = self.buffers[layer]
            buffer_k[:, :, past:past + k.shape[2]], buffer_v[:, :, past:past + v.shape[2]] = k, v
            k, v = buffer_k[:, :, :past + k.shape[2]], buffer_v[:, :, :past + v.shape[2]]
        elif self.keys[layer] is not None:
            k, v = torch.cat((self.keys[layer], k), dim=2), torch.cat((self.values[layer], v), dim=2)
        self.keys[layer], self.values[layer] = k, v
        return k, v


def attention_inputs(*, local_tokens: int, batch: int, windows: tuple[int | None, ...], parallel: ParallelOptions,
                     segment_ids: torch.Tensor | None, cache: KVCache | None,
                     attention_mask: torch.Tensor | None, documents: Documents | None = None,
                     positional: bool = False, tiled: bool | None = None) -> AttentionInputs:
    """Describe the micro-batch's attention once for every layer: its documents (under context parallelism from the
    whole sequence, gathered once; or `documents` as the caller describes them) and the pieces this rank computes,
    for packed rows, a sliding window shorter than the row, decoding with a cache, or context parallelism; for each
    of `windows` (the layers' sliding windows, None: full attention), the first's inputs holding the others'.
    `positional`: a bias by distance (ALiBi): pieces that keep their shift; `tiled` (default `positional`): cut into
    tiles (kernels/alibi.py: ALiBi's biases, Gemma 2's soft-capped math)."""
    tiled = positional if tiled is None else tiled
    cp_group = parallel.cp_group
    cp = group_size(cp_group)
    valid = None
    if cache is not None or attention_mask is not None:
        if cp > 1 or segment_ids is not None or documents is not None:
            raise ValueError("decoding with a cache or an attention_mask takes neither context parallelism nor "
                             "segment_ids nor documents")
        past = 0 if cache is None else cache.length
        if attention_mask is not None and tuple(attention_mask.shape) != (batch, past + local_tokens):
            raise ValueError(f"attention_mask must be [batch, cached + new] = [{batch}, {past + local_tokens}], "
                             f"got {tuple(attention_mask.shape)}")
        valid = (torch.ones(batch, past + local_tokens, dtype=torch.bool) if attention_mask is None
                 else attention_mask.bool())
    elif documents is not None:  # described by the caller (documents that continue a shared prefix)
        if cp > 1 or segment_ids is not None:
            raise ValueError("documents described by the caller take neither context parallelism nor segment_ids")
    elif segment_ids is not None:
        if cp > 1:
            segment_ids = gather_sequence(segment_ids, cp_group, dim=1)
        documents = Documents.from_segment_ids(segment_ids)
    first, *rest = [_window_inputs(window, local_tokens, parallel, documents, cache, valid, positional, tiled)
                    for window in windows]
    first.others = {inputs.window: inputs for inputs in rest}
    return first


def _window_inputs(window: int | None, local_tokens: int, parallel: ParallelOptions, documents: Documents | None,
                   cache: KVCache | None, valid: torch.Tensor | None, positional: bool,
                   tiled: bool) -> AttentionInputs:
    """attention_inputs for the layers of one sliding window."""
    if valid is not None:  # decoding
        past = 0 if cache is None else cache.length
        if local_tokens == 1 and past > 0:  # the query is the row's newest token: it sees every real key
            keys = valid.to(cache.keys[0].device, copy=True)  # made once, on the device, for every layer
            keys[:, past] = True  # itself, always (a padding query's output is never read, but stays finite)
            if window is not None:
                keys[:, :max(past + 1 - window, 0)] = False
            return AttentionInputs(cache=cache, key_mask=keys[:, None, None, :], window=window)
        pieces = decoding_pieces(valid, past, local_tokens, window, positional)
        return AttentionInputs(cache=cache, pieces=tiles(pieces) if tiled else pieces, window=window)
    cp_group = parallel.cp_group
    cp = group_size(cp_group)
    if cp > 1:
        plan = cp_attention_plan(documents, local_tokens * cp, cp, group_rank(cp_group), parallel.cp_comm_type,
                                 window, positional, tiled)
        return AttentionInputs(documents=documents, cp_plan=plan, window=window)
    pieces = None
    if documents is not None or (window is not None and local_tokens > window):
        pieces = self_attention_pieces(documents, local_tokens, window, positional)
        pieces = tiles(pieces) if tiled else pieces
    return AttentionInputs(documents=documents, pieces=pieces, window=window)
