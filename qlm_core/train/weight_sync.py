"""Weight sync for rollouts: the trainer's weights, wherever its layout put them (TP / PP / EP shards, ZeRO-3
parts), as whole tensors on each model replica's leader, from which a rollout model of another layout is built with
the layout module `qlm convert` uses (models/layout.build_shard / fill_shard), in memory: no checkpoint is written or
read.

Each part travels once: the rank that holds it (a dense shard from data- and context-parallel rank 0, a routed
expert's from expert-data-parallel rank 0) sends it to rank 0, bucket by bucket of bounded size, on the trainer's
device; rank 0 puts each global tensor together by its TP split rule (TensorLayout.tp_ranges), as the Megatron
checkpoint reader does from rank files, and broadcasts the bucket to the leaders. Who sends what (names, dtypes,
shapes) is exchanged once and kept."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from qlm_core.models.build import RankCoords, build_rank_model
from qlm_core.models.gpt import GPTModel
from qlm_core.models.layout import ModelLayout, fill_shard
from qlm_core.models.tensor_layout import REPLICATED, TensorLayout
from qlm_core.parallel.comm import group_size
from qlm_core.parallel.sharded_tensors import whole
from qlm_core.train.engine import Engine

BUCKET_BYTES = 256 * 2**20  # the most bytes of whole tensors one broadcast carries


@dataclass(frozen=True)
class Part:
    """One part of a global tensor rank 0 puts together: who sends it (global rank; its chunk and local name there),
    which TP / expert-TP part it is, and its dtype and shape."""

    rank: int
    chunk: int
    local: str
    index: int
    dtype: torch.dtype
    shape: tuple[int, ...]


def device_states(engine: Engine) -> list[dict]:
    """Each chunk's weights where they live (the trainer's device), in the compute dtype (buffers keep theirs, the
    routers' fp32 expert bias): no copy where they already are; ZeRO 3's parameters gathered whole (a collective)."""
    states = []
    for chunk in engine.chunks:
        buffers = {name for name, _ in chunk.named_buffers()}
        state = {}
        for name, value in chunk.state_dict().items():
            if isinstance(value, torch.Tensor):
                value = whole(value).detach()
                value = value if name in buffers else value.to(engine.dtype)
            state[name] = value
        states.append(state)
    return states


def _my_parts(engine: Engine, states: list[dict]) -> list[tuple[str, Part]]:
    """(global tensor name, part) of the shards this rank sends: a dense shard from data- and context-parallel rank
    0, a routed expert's from expert-data-parallel rank 0 (each part once)."""
    if engine.lora is not None and engine.lora.rank > 0:
        raise ValueError("weight sync of a LoRA run: merge the adapters first")
    g, layout = engine.grid, engine.layout
    dense_sender = g.dp_rank == 0 and g.cp_rank == 0
    expert_sender = g.expert_coords["edp"] == 0
    out = []
    for chunk, state in enumerate(states):
        for local, tensor in layout.shard_entries(g.pp_rank, chunk, g.ep_rank):
            if tensor is None or not (expert_sender if tensor.expert else dense_sender):
                continue
            value = state[local]
            out.append((tensor.name, Part(g.ranks[g.rank], chunk, local, g.etp_rank if tensor.expert else g.tp_rank,
                                          value.dtype, tuple(value.shape))))
    return out


def sync_plan(engine: Engine, states: list[dict]) -> dict[str, list[Part]]:
    """Every global tensor's parts, by part index: every rank's own list, exchanged once (one small all-gather of
    names, dtypes and shapes) and kept on the engine."""
    plan = getattr(engine, "_weight_sync_plan", None)
    if plan is not None:
        return plan
    mine = _my_parts(engine, states)
    everyone = [mine]
    if dist.is_initialized() and engine.grid.sizes.world > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    plan = {}
    for contribution in everyone:
        for name, part in contribution or ():
            plan.setdefault(name, {})[part.index] = part
    one_part = {t.name for t in engine.layout.global_tensors
                if t.split == REPLICATED or engine.layout.split_size(t) == 1}  # every TP rank holds it whole
    engine._weight_sync_plan = {name: [parts[i] for i in sorted(parts)][:1 if name in one_part else None]
                                for name, parts in plan.items()}
    return engine._weight_sync_plan


class WholeTensors:
    """Whole global tensors as a TensorSource (build_shard reads any layout's shards from it)."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def stored_dtype(self, tensor: TensorLayout) -> torch.dtype:
        return self.tensors[tensor.name].dtype

    def read_into(self, tensor: TensorLayout, start: int, stop: int, out: torch.Tensor) -> None:
        out.copy_(self.tensors[tensor.name].narrow(tensor.axis, start, stop - start))


def _buckets(layout: ModelLayout, plan: dict[str, list[Part]], limit: int) -> list[list[TensorLayout]]:
    """The global tensors in layout order, in buckets of one dtype and at most `limit` bytes (a larger tensor alone)."""
    buckets, size, dtype = [], 0, None
    for tensor in layout.global_tensors:
        parts = plan[tensor.name]
        nbytes = math.prod(tensor.shape) * parts[0].dtype.itemsize
        if not buckets or parts[0].dtype != dtype or size + nbytes > limit:
            buckets.append([])
            size, dtype = 0, parts[0].dtype
        buckets[-1].append(tensor)
        size += nbytes
    return buckets


def _whole(layout: ModelLayout, tensor: TensorLayout, parts: list[torch.Tensor]) -> torch.Tensor:
    """A global tensor from its TP parts (TensorLayout.tp_ranges), as the Megatron checkpoint reader does."""
    size = layout.split_size(tensor)
    if tensor.split == REPLICATED or size == 1:  # one part: the whole tensor already
        return parts[0]
    shape = list(parts[0].shape)
    shape[tensor.axis] = tensor.shape[tensor.axis]
    full = parts[0].new_empty(shape)
    for rank in range(size):
        offset = 0
        for begin, end in tensor.tp_ranges(size, rank):
            full.narrow(tensor.axis, begin, end - begin).copy_(parts[rank].narrow(tensor.axis, offset, end - begin))
            offset += end - begin
    return full


def gather_weights(engine: Engine, everywhere: bool = False,
                   bucket_bytes: int = BUCKET_BYTES) -> WholeTensors | None:
    """Every global tensor of the trainer's model, whole, on each model replica's leader (tp = pp = cp = 0 of each
    data-parallel rank), or on every rank when `everywhere`; None on the others. A collective: every rank calls it.

    Bucket by bucket, on the trainer's device: each part travels once, point to point, from the rank that holds it
    to rank 0, which puts the bucket's tensors together (TensorLayout.tp_ranges) and broadcasts them, flattened,
    to the leaders. A rank holds its own shards and at most one bucket beside them; a leader the whole model."""
    engine.optimizer.wait_param_gather()  # ZeRO 1/2 with overlap_param_gather: the step's gathers land first
    engine.grid.build_replica_groups()
    states = device_states(engine)
    plan = sync_plan(engine, states)
    g, layout = engine.grid, engine.layout
    multi = dist.is_initialized() and g.sizes.world > 1
    me, root = g.ranks[g.rank], g.ranks[0]
    group = None if everywhere else g.dp_group  # rank 0's data-parallel group: the replica leaders
    receives = everywhere or not multi or (g.tp_rank == 0 and g.pp_rank == 0 and g.cp_rank == 0)
    whole: dict[str, torch.Tensor] = {}
    for bucket in _buckets(layout, plan, bucket_bytes):
        received: dict[str, list[torch.Tensor]] = {}
        ops = []
        for tensor in bucket:
            for part in plan[tensor.name]:
                if part.rank == me and (me == root or not multi):
                    received.setdefault(tensor.name, []).append(states[part.chunk][part.local])
                elif part.rank == me:
                    ops.append(dist.P2POp(dist.isend, states[part.chunk][part.local].contiguous(), root))
                elif me == root:
                    buffer = torch.empty(part.shape, dtype=part.dtype, device=g.device)
                    ops.append(dist.P2POp(dist.irecv, buffer, part.rank))
                    received.setdefault(tensor.name, []).append(buffer)
        for request in dist.batch_isend_irecv(ops) if ops else ():
            request.wait()
        if not receives:
            continue
        if me == root or not multi:
            tensors = {t.name: _whole(layout, t, received[t.name]) for t in bucket}
        else:
            dtype = plan[bucket[0].name][0].dtype
            tensors = {t.name: torch.empty(t.shape, dtype=dtype, device=g.device) for t in bucket}
        if multi and group_size(group if group is not None else dist.group.WORLD) > 1:
            flat = torch.cat([t.reshape(-1) for t in tensors.values()]) if me == root else torch.empty(
                sum(t.numel() for t in tensors.values()), dtype=next(iter(tensors.values())).dtype, device=g.device)
            dist.broadcast(flat, src=root, group=group)
            offset = 0
            for name, t in tensors.items():
                tensors[name] = flat[offset:offset + t.numel()].view(t.shape)
                offset += t.numel()
        whole.update(tensors)
    return WholeTensors(whole) if receives else None


def rollout_layout(engine: Engine) -> ModelLayout:
    """The rollout's layout: the trainer's model whole (TP 1, PP 1)."""
    return ModelLayout(engine.spec, make_vocab_size_divisible_by=engine.layout.make_vocab_size_divisible_by)


def fill_rollout_model(engine: Engine, weights: WholeTensors, model: GPTModel | None = None,
                       dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> GPTModel:
    """`weights` (gather_weights) as one whole model (the rollout layout of a model that fits one device), built by
    the layout module on `device` (default the trainer's), routing as the trainer does (its [moe] options); `model`
    an earlier one to refill in place (no modules built again)."""
    layout = rollout_layout(engine)
    if model is None:
        return build_rank_model(layout, RankCoords(), weights, dtype=dtype or engine.dtype,
                                device=device or engine.grid.device, moe_options=engine.moe).eval()
    fill_shard(layout, 0, 0, 0, weights, model.state_dict(keep_vars=True))
    return model


def rollout_model(engine: Engine, dtype: torch.dtype | None = None,
                  device: torch.device | str | None = None) -> GPTModel:
    """The trainer's current weights as one whole model on every rank (a collective: gather_weights)."""
    return fill_rollout_model(engine, gather_weights(engine, everywhere=True), dtype=dtype, device=device)
