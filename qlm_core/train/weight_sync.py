"""Weight sync for rollouts: the trainer's weights, wherever its layout put them (TP / PP / CP / EP shards, ZeRO 1-3),
on each model replica's leader as the TP parts of every global tensor (WeightSync), from which the rollout model of
another layout is built or refilled by the layout module `qlm convert` uses (models/layout.build_shard / fill_shard,
reading the parts with layout.read_from_parts, as the Megatron checkpoint reader does from rank files), in memory:
no checkpoint is written or read."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from qlm_core.models.build import RankCoords, build_rank_model
from qlm_core.models.gpt import GPTModel
from qlm_core.models.layout import ModelLayout, read_from_parts, read_shard_into
from qlm_core.models.tensor_layout import REPLICATED, TensorLayout
from qlm_core.parallel.sharded_tensors import whole
from qlm_core.train.engine import Engine

BUCKET_BYTES = 256 * 2**20  # the most bytes of parts one broadcast carries


@dataclass(frozen=True)
class Part:
    """One part of a global tensor: who sends it (global rank; its chunk and local name there), which TP /
    expert-TP part it is, and its dtype and shape."""

    rank: int
    chunk: int
    local: str
    index: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class TrainerStates:
    """Each chunk's weights as the sync sends them: where they live (no copy), in the compute dtype (buffers keep
    theirs, the routers' fp32 expert bias). A ZeRO 3 parameter is gathered whole only when value() asks for it, a
    collective over its FSDP group, so that a rank never holds more than one bucket of them whole. The parameters
    themselves are kept (keep_vars), so one TrainerStates serves every sync of a run."""

    def __init__(self, engine: Engine):
        self.dtype = engine.dtype
        self.raw = [{name: value for name, value in chunk.state_dict(keep_vars=True).items()
                     if isinstance(value, torch.Tensor)} for chunk in engine.chunks]
        self.buffers = [{name for name, _ in chunk.named_buffers()} for chunk in engine.chunks]

    def sharded(self, chunk: int, local: str) -> bool:
        return hasattr(self.raw[chunk][local], "full_tensor")

    def dtype_of(self, chunk: int, local: str) -> torch.dtype:
        return self.raw[chunk][local].dtype if local in self.buffers[chunk] else self.dtype

    def shape_of(self, chunk: int, local: str) -> tuple[int, ...]:
        return tuple(self.raw[chunk][local].shape)  # a DTensor's is the whole tensor's

    def value(self, chunk: int, local: str) -> torch.Tensor:
        value = whole(self.raw[chunk][local]).detach()
        return value if local in self.buffers[chunk] else value.to(self.dtype)


class SyncedWeights:
    """Global tensors as a TensorSource, from their TP parts at the trainer's layout `layout` (its vocabulary
    padding may differ from the reader's; layout.read_from_parts): what gather() hands the rollout model's
    build_shard / fill_shard."""

    def __init__(self, layout: ModelLayout, parts: dict[str, list[torch.Tensor]]):
        self.tensors = {tensor.name: tensor for tensor in layout.global_tensors}
        self.parts = parts

    def stored_dtype(self, tensor: TensorLayout) -> torch.dtype:
        return self.parts[tensor.name][0].dtype

    def read_into(self, tensor: TensorLayout, start: int, stop: int, out: torch.Tensor) -> None:
        parts = self.parts[tensor.name]
        read_from_parts(self.tensors[tensor.name], len(parts), parts.__getitem__, start, stop, out)


class WeightSync:
    """The trainer's weights, whatever its layout (TP / PP / CP / EP shards, ZeRO 1-3), on each model replica's
    leader (tp = pp = cp = 0 of each data-parallel rank) or on every rank, bucket by bucket on the trainer's device:
    each part travels once, point to point, from the rank that holds it (a dense shard from data- and
    context-parallel rank 0, a routed expert's from expert-data-parallel rank 0) to rank 0, which broadcasts the
    bucket's parts, flattened, to the receivers. Who sends what (names, dtypes, shapes) is exchanged at the first
    gather and kept. A rank holds its own shards and at most one bucket beside them; a receiver every part."""

    def __init__(self, engine: Engine, bucket_bytes: int = BUCKET_BYTES):
        if engine.lora is not None and engine.lora.rank > 0:
            raise ValueError("weight sync of a LoRA run: merge the adapters first")
        self.engine, self.bucket_bytes = engine, bucket_bytes
        self.plan: dict[str, list[Part]] | None = None  # each global tensor's parts, by part index
        self.states: TrainerStates | None = None  # made at the first gather, kept
        self.refill: Refill | None = None  # the rollout model sync_rollout_model refills, and its plan

    def _my_parts(self, states: TrainerStates, senders_only: bool = True) -> list[tuple[str, Part]]:
        """(global tensor name, part) of the shards this rank sends (`senders_only` False: of every shard it holds,
        a copy of which another data-parallel rank may send)."""
        g, layout = self.engine.grid, self.engine.layout
        dense_sender = g.dp_rank == 0 and g.cp_rank == 0
        expert_sender = g.expert_coords["edp"] == 0
        out = []
        for chunk in range(len(states.raw)):
            for local, tensor in layout.shard_entries(g.pp_rank, chunk, g.ep_rank):
                if tensor is None or (senders_only and not (expert_sender if tensor.expert else dense_sender)):
                    continue
                out.append((tensor.name, Part(g.ranks[g.rank], chunk, local,
                                              g.etp_rank if tensor.expert else g.tp_rank,
                                              states.dtype_of(chunk, local), states.shape_of(chunk, local))))
        return out

    def _make_plan(self, states: TrainerStates) -> dict[str, list[Part]]:
        self.held = {(name, part.index) for name, part in self._my_parts(states, senders_only=False)}
        mine = self._my_parts(states)
        everyone = [mine]
        if dist.is_initialized() and self.engine.grid.sizes.world > 1:
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, mine)
        by_index: dict[str, dict[int, Part]] = {}
        for contribution in everyone:
            for name, part in contribution or ():
                by_index.setdefault(name, {})[part.index] = part
        layout = self.engine.layout
        one_part = {t.name for t in layout.global_tensors
                    if t.split == REPLICATED or layout.split_size(t) == 1}  # every TP rank holds it whole
        return {name: [parts[i] for i in sorted(parts)][:1 if name in one_part else None]
                for name, parts in by_index.items()}

    def _buckets(self) -> list[list[str]]:
        """The global tensors' names in layout order, in buckets of one dtype and at most bucket_bytes of parts
        (a larger tensor alone)."""
        buckets, size, dtype = [], 0, None
        for tensor in self.engine.layout.global_tensors:
            parts = self.plan[tensor.name]
            nbytes = sum(part.nbytes for part in parts)
            if not buckets or parts[0].dtype != dtype or size + nbytes > self.bucket_bytes:
                buckets.append([])
                size, dtype = 0, parts[0].dtype
            buckets[-1].append(tensor.name)
            size += nbytes
        return buckets

    def gather(self, everywhere: bool = False,
               fill: Callable[[SyncedWeights], None] | None = None) -> SyncedWeights | None:
        """Every global tensor's parts on the replica leaders (every rank when `everywhere`); None on the others.
        `fill`: called on the receivers with each bucket's tensors as they arrive, none of which are kept (gather
        then returns None everywhere). A collective: every rank calls it."""
        engine, g = self.engine, self.engine.grid
        engine.optimizer.wait_param_gather()  # ZeRO 1/2 with overlap_param_gather: the step's gathers land first
        g.build_replica_groups()
        if self.states is None:
            self.states = TrainerStates(engine)
        states = self.states
        if self.plan is None:
            self.plan = self._make_plan(states)
        multi = dist.is_initialized() and g.sizes.world > 1
        if not multi:
            weights = SyncedWeights(engine.layout, {name: [states.value(p.chunk, p.local) for p in parts]
                                                    for name, parts in self.plan.items()})
            if fill is None:
                return weights
            fill(weights)
            return None
        me, root = g.ranks[g.rank], g.ranks[0]
        group = None if everywhere else g.dp_group  # rank 0's data-parallel group: the replica leaders
        receivers = dist.get_world_size() if everywhere else g.sizes.dp
        receives = everywhere or (g.tp_rank == 0 and g.pp_rank == 0 and g.cp_rank == 0)
        held: dict[str, list[torch.Tensor]] = {}
        for bucket in self._buckets():
            parts = [(name, part) for name in bucket for part in self.plan[name]]
            ops, received = [], []
            for name, part in parts:
                value = None
                if part.rank == me or ((name, part.index) in self.held and states.sharded(part.chunk, part.local)):
                    value = states.value(part.chunk, part.local)  # ZeRO 3: every holder joins the gather
                if part.rank == me == root:
                    received.append(value)
                elif part.rank == me:
                    ops.append(dist.P2POp(dist.isend, value.contiguous(), root))
                elif me == root:
                    received.append(torch.empty(part.shape, dtype=part.dtype, device=g.device))
                    ops.append(dist.P2POp(dist.irecv, received[-1], part.rank))
            for request in dist.batch_isend_irecv(ops) if ops else ():
                request.wait()
            if not receives:
                continue
            if receivers > 1:  # rank 0's parts, flattened, to the other receivers
                flat = (torch.cat([t.reshape(-1) for t in received]) if me == root else
                        torch.empty(sum(math.prod(part.shape) for _, part in parts), dtype=parts[0][1].dtype,
                                    device=g.device))
                dist.broadcast(flat, src=root, group=group)
                received = list(torch.split(flat, [math.prod(part.shape) for _, part in parts]))
                received = [t.view(part.shape) for t, (_, part) in zip(received, parts, strict=True)]
            arrived: dict[str, list[torch.Tensor]] = {}
            for (name, _), tensor in zip(parts, received, strict=True):
                arrived.setdefault(name, []).append(tensor)
            if fill is not None:
                fill(SyncedWeights(engine.layout, arrived))
            else:
                held.update(arrived)
        return SyncedWeights(engine.layout, held) if receives and fill is None else None


def gather_weights(engine: Engine, everywhere: bool = False, bucket_bytes: int = BUCKET_BYTES) -> SyncedWeights | None:
    """WeightSync(engine).gather(everywhere): once (a run that syncs every step keeps its WeightSync)."""
    return WeightSync(engine, bucket_bytes).gather(everywhere)


def rollout_layout(engine: Engine) -> ModelLayout:
    """The rollout's layout: the trainer's model whole (TP 1, PP 1)."""
    return ModelLayout(engine.spec, make_vocab_size_divisible_by=engine.layout.make_vocab_size_divisible_by)


def fill_rollout_model(engine: Engine, weights: SyncedWeights, model: GPTModel | None = None,
                       dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> GPTModel:
    """`weights` (gather_weights) as one whole model (the rollout layout of a model that fits one device), built by
    the layout module on `device` (default the trainer's), routing as the trainer does (its [moe] options); `model`
    an earlier one to refill in place (no modules built again)."""
    layout = rollout_layout(engine)
    if model is None:
        return build_rank_model(layout, RankCoords(), weights, dtype=dtype or engine.dtype,
                                device=device or engine.grid.device, moe_options=engine.moe).eval()
    Refill(layout, model)(weights)
    return model


class Refill:
    """fill_shard of one rollout model at the rollout layout, bucket by bucket: every tensor that arrives whole (one
    part of the rollout's shape and dtype, no vocabulary padding: its values are the global tensor's as they are) is
    copied in one foreach call; the rest (TP parts to put together, padding to zero) goes through the layout module.
    Which is which depends on the bucket's names, shapes and dtypes only: worked out at a bucket's first fill, kept."""

    def __init__(self, layout: ModelLayout, model: GPTModel):
        self.layout, self.model = layout, model
        self.state = model.state_dict(keep_vars=True)
        self.plans: dict[tuple[str, ...], tuple[list[torch.Tensor], list[str], dict[str, TensorLayout]]] = {}

    def _plan(self, weights: SyncedWeights):
        whole_out, whole_names, rest = [], [], {}
        for name, tensor in self.layout.shard_entries(0, 0, 0):
            if tensor is None or tensor.name not in weights.parts:  # a bucket brings some of the tensors
                continue
            parts, out = weights.parts[tensor.name], self.state[name]
            if (len(parts) == 1 and parts[0].shape == out.shape == torch.Size(tensor.shape)
                    and parts[0].dtype == out.dtype and tensor.real_extent == tensor.shape[tensor.axis]):
                whole_out.append(out)
                whole_names.append(tensor.name)
            else:
                rest[name] = tensor
        return whole_out, whole_names, rest

    @torch.no_grad()
    def __call__(self, weights: SyncedWeights) -> None:
        key = tuple(weights.parts)
        if key not in self.plans:
            self.plans[key] = self._plan(weights)
        whole_out, whole_names, rest = self.plans[key]
        if whole_out:
            torch._foreach_copy_(whole_out, [weights.parts[name][0] for name in whole_names])
        for name, tensor in rest.items():
            read_shard_into(tensor, 1, 0, weights, self.state[name])


def rollout_shell(engine: Engine, dtype: torch.dtype | None = None,
                  device: torch.device | str | None = None) -> GPTModel:
    """The rollout layout's model on `device` (default the trainer's), its weights not filled yet (refill() or
    WeightSync.gather(fill=...) fill them): built there, so that the model is never held twice."""
    layout = rollout_layout(engine)
    with torch.device(device or engine.grid.device):
        model = GPTModel(layout.spec, padded_vocab=layout.padded_vocab, dtype=dtype or engine.dtype,
                         moe_options=engine.moe)
    return model.eval()


def sync_rollout_model(sync: WeightSync, model: GPTModel | None, builds: bool) -> GPTModel | None:
    """The run's sync (a collective: every rank calls it): on the ranks that `builds` (replica leaders), `model` — or,
    the first time, a new rollout_shell — refilled bucket by bucket as the buckets arrive; None elsewhere."""
    if not builds:
        sync.gather(fill=lambda bucket: None)
        return None
    model = model if model is not None else rollout_shell(sync.engine)
    if sync.refill is None or sync.refill.model is not model:
        sync.refill = Refill(rollout_layout(sync.engine), model)
    sync.gather(fill=sync.refill)
    return model


def rollout_model(engine: Engine, dtype: torch.dtype | None = None,
                  device: torch.device | str | None = None) -> GPTModel:
    """The trainer's current weights as one whole model on every rank (a collective: gather_weights)."""
    return fill_rollout_model(engine, gather_weights(engine, everywhere=True), dtype=dtype, device=device)
