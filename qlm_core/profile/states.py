"""Model-state bytes of one rank, exactly as the trainer allocates them (not estimated).

This mirrors what train/engine.py builds for a pipeline stage, tensor by tensor:
  ZeRO 0-2  parallel/grad_buffers.py GradientBuffers + parallel/optimizer.py DistributedOptimizer. The bucket plan
            (and so every bucket's padding to a multiple of dp·64 elements) comes from plan_buckets itself, run on meta
            tensors shaped like the stage's trainable parameters.
            weights    ZeRO 0: each parameter in the compute dtype. ZeRO 1/2: the trainable parameters live in one
                       padded param buffer per dtype; frozen (LoRA base) parameters keep their own storage.
            grads      in `grad_dtype` (parallel.grad_reduce_dtype: 4 bytes an element in fp32, 2 in bf16).
                       ZeRO 0/1: one buffer of every (padded) bucket. ZeRO 2: this rank's shard of each bucket, plus
                       the shared-embedding bucket whole (it is reduced only at the end of the step). The bucket
                       storage ZeRO 2 borrows during backward is a transient (memory.py: comm_buffers), and so is the
                       fp32 copy of the owned gradients that the optimizer makes while it steps with bf16 ones
                       (activations are gone by then).
            optimizer  fp32 master copies (none for fp32 parameters under ZeRO 0: the parameter is the master) and
                       AdamW's exp_avg and exp_avg_sq of the elements this data rank owns.
  ZeRO 3    parallel/fsdp.py (FSDP2): every parameter in fp32, dim 0 chunked over dp·cp with each rank's chunk
            padded to ceil(dim0 / n) rows; fp32 gradients of the trainable ones, padded alike (views into the
            reduce-scatter output, whatever the reduce dtype); AdamW moments of the unpadded local rows. The fp32
            parameters are the masters.
Expert parallelism (layout.ep > 1 or etp != tp): a stage holds the routed experts of EP rank 0 only (E/ep of them,
each split over etp instead of tp), and their gradients are bucketed apart and reduced over the expert-data-parallel
group (`expert_shards` = dp·cp·tp / (ep·etp) ranks): ZeRO 1/2 pad those buckets to edp·64 and shard them over edp,
ZeRO 3 chunks the experts' dim 0 over edp (the dense parameters keep dp·cp).
The routers' expert bias and their token counts are buffers: fp32, whole on every rank, no gradient or optimizer
state.
AdamW's per-parameter `step` scalars (4 bytes each) are not counted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch

from qlm_core.models.layout import LORA_TARGETS, ModelLayout
from qlm_core.parallel.grad_buffers import plan_buckets
from qlm_core.parallel.param_meta import mark

SHARD_ALIGNMENT = 64  # GradientBuffers' default shard_alignment


@dataclass(frozen=True)
class ParamInfo:
    shape: tuple[int, ...]
    trainable: bool
    shared_embedding: bool = False
    expert: bool = False  # a routed expert's weight under expert parallelism (its own buckets, the edp group)
    buffer: bool = False  # a module buffer (the routers' fp32 expert bias): its bytes only, whole under ZeRO 3

    @cached_property
    def numel(self) -> int:  # cached: an MoE stage lists thousands of expert tensors, summed per layout searched
        return math.prod(self.shape)


@dataclass(frozen=True)
class StateBytes:
    weights: int
    grads: int
    optimizer: int
    trainable_numel: int  # this stage's trainable elements on one rank, before ZeRO sharding
    bucket_numel: int  # largest gradient bucket (elements), for the ZeRO 2 transient
    num_buckets: int = 0
    expert_numel: int = 0  # of trainable_numel, the routed experts' under expert parallelism (sharded over edp)

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer

    def owned_numel(self, shards: int, expert_shards: int | None) -> float:
        """Trainable elements this rank's optimizer steps when they are sharded (ZeRO 1-3)."""
        dense = self.trainable_numel - self.expert_numel
        return dense / shards + (self.expert_numel / expert_shards if expert_shards else 0.0)


def stage_params(layout: ModelLayout, pp_rank: int, lora_rank: int = 0, lora_targets=None,
                 mtp_trainable: bool = True) -> list[ParamInfo]:
    """This stage's parameters on one TP rank, in the order the engine lists them (chunks in order, each in
    parameters() order: adapters follow the weights of their linear). `mtp_trainable`: whether the multi-token
    prediction layers train (next-token prediction with a non-zero weight; else they are frozen)."""
    targets = tuple(sorted(lora_targets or LORA_TARGETS)) if lora_rank > 0 else ()
    key = (repr(layout), pp_rank, lora_rank, targets, mtp_trainable)
    if key not in _PARAMS:
        _PARAMS[key] = _stage_params(layout, pp_rank, lora_rank, set(targets), mtp_trainable)
    return _PARAMS[key]


def expert_parallel(layout: ModelLayout) -> bool:
    return layout.spec.moe is not None and (layout.ep > 1 or layout.etp != layout.tp)


def _info(layout: ModelLayout, tensor, trainable: bool, shared: bool = False) -> ParamInfo:
    """A parameter's shard on rank 0 of its split (etp for a routed expert's linear, else tp)."""
    expert = tensor.expert and expert_parallel(layout)
    if tensor.buffer:  # the expert bias, and beside it the router's count of its tokens (not saved), alike
        shape = tensor.shard_shape(layout.split_size(tensor))
        return ParamInfo((2, *shape), False, buffer=True)
    return ParamInfo(tensor.shard_shape(layout.split_size(tensor)), trainable, shared, expert and trainable)


def _layer_params(layout: ModelLayout, layer: int) -> list[ParamInfo]:
    """One layer's parameters on one TP rank (without LoRA), EP rank 0's experts; every layer of a kind (MoE or
    dense) has the same."""
    key = (repr(layout.spec), layout.tp, layout.ep, layout.etp, layout.spec.is_moe_layer(layer))
    if key not in _LAYER_PARAMS:
        _LAYER_PARAMS[key] = [_info(layout, t, True) for suffix, t in layout.layer_entries(layer)
                              if t is not None and layout.local_expert_suffix(suffix, 0) is not None]
    return _LAYER_PARAMS[key]


def _stage_params(layout: ModelLayout, pp_rank: int, lora_rank: int, targets: set[str],
                  mtp_trainable: bool) -> list[ParamInfo]:
    spec = layout.spec
    out: list[ParamInfo] = []
    # the embedding's copy on the last stage (a tied output layer's, or the one multi-token prediction embeds with)
    # takes both stages' gradients: its own bucket (the engine marks them shared_embedding)
    copied = layout.pp > 1 and (spec.tie_word_embeddings or spec.mtp_num_layers > 0)
    shared_names = ("embedding.word_embeddings.weight", "output_layer.weight" if spec.tie_word_embeddings else "")
    if lora_rank == 0 and spec.moe is not None:  # shard_entries' order, its layers' parameters shared by kind
        for chunk in range(layout.vpp):
            first, last = layout.is_first(pp_rank, chunk), layout.is_last(pp_rank, chunk)
            if first or (last and spec.mtp_num_layers):
                out.append(ParamInfo(layout.embedding().shard_shape(layout.tp), True, copied))
            for layer in layout.chunk_layers(pp_rank, chunk):
                out += _layer_params(layout, layer)
            if last:
                out += [ParamInfo(tensor.shard_shape(layout.tp), True) for _, tensor in layout.final_norms()]
                out += _mtp_params(layout, mtp_trainable)
                if not (spec.tie_word_embeddings and first):
                    out.append(ParamInfo(layout.output_layer().shard_shape(layout.tp), True,
                                         copied and spec.tie_word_embeddings))
        return out
    for chunk in range(layout.vpp):
        adapters: dict[str, list] = {}
        if lora_rank > 0:
            for name, tensor in layout.lora_shard_entries(pp_rank, chunk, lora_rank, sorted(targets)):
                adapters.setdefault(name.rsplit(".lora_", 1)[0], []).append(tensor)
        for name, tensor in layout.shard_entries(pp_rank, chunk, ep_rank=0):
            if tensor is None:
                linear = name[: -len("._extra_state")]
                for adapter in adapters.get(linear, []):
                    out.append(ParamInfo(adapter.shard_shape(layout.tp), True))
                continue
            trainable = lora_rank == 0 and (mtp_trainable or not name.startswith("mtp."))
            out.append(_info(layout, tensor, trainable, copied and name in shared_names))
    return out


def _mtp_params(layout: ModelLayout, trainable: bool) -> list[ParamInfo]:
    """The multi-token prediction layers' parameters on one TP rank, EP rank 0's experts, in state_dict order."""
    out = []
    for depth in range(layout.spec.mtp_num_layers):
        for suffix, tensor in layout.mtp_entries(depth):
            inner = suffix.removeprefix("transformer_layer.")
            if tensor is not None and layout.local_expert_suffix(inner, 0) is not None:
                out.append(_info(layout, tensor, trainable))
    return out


def _meta(info: ParamInfo, dtype: torch.dtype) -> torch.Tensor:
    t = torch.empty(info.shape, dtype=dtype, device="meta")
    if info.shared_embedding:
        return mark(t, shared_embedding=True)
    return mark(t, expert=True) if info.expert else t


def _trainable_metas(params: list[ParamInfo], dtype: torch.dtype) -> list[torch.Tensor]:
    """Meta tensors of the trainable `params`, made once per stage list (which stage_params caches)."""
    key = (id(params), dtype)
    if key not in _METAS or _METAS[key][0] is not params:
        _METAS[key] = (params, [_meta(p, dtype) for p in params if p.trainable])
    return _METAS[key][1]


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> int:
    return max(0, min(a[1], b[1]) - max(a[0], b[0]))


def zero_state_bytes(params: list[ParamInfo], dtype: torch.dtype, zero_stage: int, shards: int,
                     bucket_size_mb: float | None, dp_rank: int, grad_dtype: torch.dtype = torch.float32,
                     expert_shards: int | None = None, expert_rank: int = 0) -> StateBytes:
    """ZeRO 0-2 bytes of data rank `dp_rank` of `shards` (data x context ranks); `expert_shards` (expert
    parallelism): the edp ranks the expert buckets are reduced and sharded over, `expert_rank` this rank's."""
    size = torch.empty((), dtype=dtype).element_size()
    g = grad_dtype.itemsize
    trainable = [p for p in params if p.trainable]
    frozen_bytes = sum(p.numel for p in params if not p.trainable and not p.buffer) * size \
        + sum(4 * p.numel for p in params if p.buffer)
    if not trainable:
        return StateBytes(frozen_bytes, 0, 0, 0, 0, 0)
    bucket_numel = None if bucket_size_mb is None else max(1, int(bucket_size_mb * 2**20) // 4)
    pad = shards * SHARD_ALIGNMENT if zero_stage else 1
    expert_pad = None if expert_shards is None else (expert_shards * SHARD_ALIGNMENT if zero_stage else 1)
    buckets = plan_buckets(_trainable_metas(params, dtype), bucket_numel, pad, expert_pad)

    def group(b) -> tuple[int, int]:  # (shards, this rank's index) of the bucket's reduction
        return (expert_shards, expert_rank) if b.expert else (shards, dp_rank)
    padded = sum(b.numel for b in buckets)
    numel = sum(p.numel for p in trainable)
    if zero_stage == 0:
        weights = frozen_bytes + numel * size
        grads = g * padded
        owned = numel
        masters = 0 if dtype == torch.float32 else 4 * numel
    else:
        weights = frozen_bytes + padded * size
        if zero_stage == 1:
            grads = g * padded
        else:
            grads = g * sum(b.numel if b.deferred else b.numel // group(b)[0] for b in buckets)
        owned = sum(_overlap(span, b.shard_range(group(b)[1], group(b)[0])) for b in buckets
                    for span in b.param_ranges)
        masters = 4 * owned  # ZeRO 1/2 always keep fp32 copies of the owned slices, whatever the param dtype
    regular = [b.numel for b in buckets if not b.deferred] or [0]
    return StateBytes(weights, grads, masters + 8 * owned, numel, max(regular), len(regular),
                      sum(p.numel for p in trainable if p.expert))


def _fsdp_rows(dim0: int, shards: int, rank: int) -> tuple[int, int]:
    """(padded rows, real rows) of FSDP2's dim-0 chunk on `rank` (torch.chunk sizes)."""
    chunk = -(-dim0 // shards)
    return chunk, max(0, min(chunk, dim0 - rank * chunk))


def fsdp_state_bytes(params: list[ParamInfo], shards: int, dp_rank: int,
                     expert_shards: int | None = None, expert_rank: int = 0) -> StateBytes:
    """FSDP2's bytes; under expert parallelism the experts are chunked over their `expert_shards` (edp) ranks."""
    weights = grads = moments = 0
    for p in params:
        if p.buffer:  # FSDP2 shards parameters only
            weights += 4 * p.numel
            continue
        dim0 = p.shape[0] if p.shape else 1
        row = p.numel // dim0 if dim0 else 0
        n, rank = (expert_shards, expert_rank) if p.expert and expert_shards else (shards, dp_rank)
        padded, real = _fsdp_rows(dim0, n, rank)
        weights += 4 * padded * row
        if p.trainable:
            grads += 4 * padded * row
            moments += 8 * real * row
    numel = sum(p.numel for p in params if p.trainable)
    return StateBytes(weights, grads, moments, numel, 0, 0, sum(p.numel for p in params if p.trainable and p.expert))


def model_state_bytes(layout: ModelLayout, pp_rank: int, *, dtype: torch.dtype, zero_stage: int, shards: int,
                      bucket_size_mb: float | None = 40.0, lora_rank: int = 0, lora_targets=None,
                      dp_rank: int | None = None, grad_dtype: torch.dtype = torch.float32,
                      expert_shards: int | None = None, expert_rank: int | None = None,
                      mtp_trainable: bool = True) -> StateBytes:
    """Exact model-state bytes of stage `pp_rank` on data x context rank `dp_rank` (default 0, the largest: padding
    sits at the end of every bucket / parameter chunk, so the first rank owns the most real elements).
    `grad_dtype`: ZeRO 0-2's gradient buffers (parallel.grad_reduce_dtype); ZeRO 3 keeps fp32 gradients.
    `expert_shards`: the edp size under expert parallelism (default: edp = shards·tp / (ep·etp) when the layout
    has EP, else None); `expert_rank` this rank's edp rank (default 0)."""
    targets = tuple(sorted(lora_targets or LORA_TARGETS))
    if expert_shards is None and expert_parallel(layout):
        expert_shards = shards * layout.tp // (layout.ep * layout.etp)
    key = (repr(layout), pp_rank, dtype, zero_stage, shards, bucket_size_mb, lora_rank, targets, dp_rank or 0,
           grad_dtype, expert_shards, expert_rank or 0, mtp_trainable)
    if key not in _CACHE:  # the layout search asks for the same stage many times
        params = stage_params(layout, pp_rank, lora_rank, targets, mtp_trainable)
        if zero_stage == 3:
            _CACHE[key] = fsdp_state_bytes(params, shards, dp_rank or 0, expert_shards, expert_rank or 0)
        else:
            _CACHE[key] = zero_state_bytes(params, dtype, zero_stage, shards, bucket_size_mb, dp_rank or 0,
                                           grad_dtype, expert_shards, expert_rank or 0)
    return _CACHE[key]


_CACHE: dict[tuple, StateBytes] = {}
_PARAMS: dict[tuple, list[ParamInfo]] = {}
_LAYER_PARAMS: dict[tuple, list[ParamInfo]] = {}
_METAS: dict[tuple, tuple[list[ParamInfo], list[torch.Tensor]]] = {}
