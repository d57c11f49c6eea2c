"""Write a Megatron-Core `torch_dist` checkpoint from any TensorSource, in megatron-core 0.16's layout (which 0.19+
reads too; 0.16 cannot read 0.19's): `common.pt` + `metadata.json` + DCP files, written from one process (convert)
or from every rank at once, each writing the chunks it owns (the trainer).

Each global tensor is stored in the chunks Megatron itself writes at the given TP size: one per layer and TP shard
(fc1 as separate gate and up chunks), so a reader at that TP reads exactly its bytes. A chunk is read from the
source only when DCP's writer asks for it; DCP keeps the last written chunk of each key referenced until its file
is closed, so memory stays near one chunk per key. Vocabulary padding rows are zeros.
"""

from __future__ import annotations

import argparse
import io
import json
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from qlm_core.checkpoint.formats.megatron.legacy import (
    CHECKPOINT_VERSION,
    iteration_dir_name,
    without_crc32,
    write_latest,
)
from qlm_core.checkpoint.formats.megatron.torch_dist import (
    COMMON_FILE,
    DIST_CONFIG,
    DIST_CONFIG_FILE,
    extra_state_keys,
    homogeneous,
    primary_key,
    te_spec_norm_key,
)
from qlm_core.models.layout import ModelLayout, TensorLayout, TensorSource, read_range

Progress = Callable[[int, int, str], None]
# What Megatron-LM records as `content_metadata` for a model saved without a distributed optimizer.
CONTENT_METADATA = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}


class Chunk:
    """One stored chunk: rows/columns [start, stop) of `tensor` (at `index` along the key's stacked axes: (layer,),
    (layer, expert), (expert,) or ()), the part TP rank `tp_rank` holds (for a routed expert: its expert-TP
    rank, the experts being split over layout.etp)."""

    def __init__(self, tensor: TensorLayout, index: tuple[int, ...], start: int, stop: int, tp_rank: int):
        self.tensor, self.index, self.start, self.stop, self.tp_rank = tensor, index, start, stop, tp_rank

    def write_item(self, key: str, global_shape: tuple[int, ...], dtype: torch.dtype) -> WriteItem:
        offsets = [0] * len(self.tensor.shape)
        sizes = list(self.tensor.shape)
        offsets[self.tensor.axis], sizes[self.tensor.axis] = self.start, self.stop - self.start
        offsets, sizes = [*self.index, *offsets], [*(1 for _ in self.index), *sizes]
        chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
        data = TensorWriteData(chunk=chunk, properties=TensorProperties(dtype=dtype), size=torch.Size(global_shape))
        return WriteItem(index=MetadataIndex(key, offsets), type=WriteItemType.SHARD, tensor_data=data)


def plan_chunks(layout: ModelLayout) -> dict[str, tuple[tuple[int, ...], list[Chunk]]]:
    """torch_dist key -> (global shape, chunks), as Megatron writes them at layout.tp (routed experts: layout.etp)."""
    keys: dict[str, tuple[tuple[int, ...], list[Chunk]]] = {}
    spec, stacked = layout.spec, homogeneous(layout.spec)
    experts = (spec.moe.num_experts,) if spec.moe is not None else ()
    for tensor in layout.global_tensors:
        key, index = primary_key(tensor.name, spec, stacked)
        axes = experts if not stacked or key.startswith("mtp.") else (spec.num_layers, *experts)  # per-layer keys
        shape = (*axes[: len(index)], *tensor.shape)
        alias = te_spec_norm_key(tensor.name, spec, stacked)
        for name in (key, alias) if alias not in (None, key) else (key,):
            chunks = keys.setdefault(name, (shape, []))[1]
            split = layout.split_size(tensor)
            for rank in range(1 if tensor.split == "replicated" else split):
                for start, stop in tensor.tp_ranges(split, rank):
                    chunks.append(Chunk(tensor, index, start, stop, rank))
    return keys


def _extra_state_bytes() -> io.BytesIO:
    """A local-spec linear's `_extra_state` as Megatron stores a ShardedObject: torch.save([data]), data None."""
    buffer = io.BytesIO()
    torch.save([None], buffer)
    return buffer


@dataclass
class DistPart:
    """What one rank writes under one key prefix: "" for the weights (Megatron's keys), OPTIMIZER_PREFIX + view for
    an optimizer view stored like them; `owns` picks this rank's chunks (all of them in one process)."""

    prefix: str
    source: TensorSource
    dtype: torch.dtype
    owns: Callable[[Chunk], bool] = lambda chunk: True


class _StreamingSavePlanner(DefaultSavePlanner):
    """A plan made from the layout (not from a state_dict); each chunk is read from its source when written."""

    def __init__(self, layout: ModelLayout, parts: list[DistPart], extra_state: bool, progress: Progress):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.progress = progress
        self.chunks: dict[MetadataIndex, tuple[DistPart, Chunk]] = {}
        self.items: list[WriteItem] = []
        planned = plan_chunks(layout)
        for part in parts:
            for key, (shape, chunks) in planned.items():
                for chunk in filter(part.owns, chunks):
                    item = chunk.write_item(part.prefix + key, shape, chunk.tensor.dtype or part.dtype)
                    self.chunks[item.index] = (part, chunk)
                    self.items.append(item)
        for key in extra_state_keys(layout.spec) if extra_state else ():
            self.items.append(WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO))
        self.written = 0

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False):
        super().set_up_planner({}, storage_meta, is_coordinator)

    def create_local_plan(self) -> SavePlan:
        self.plan = SavePlan(self.items)
        return self.plan

    def resolve_data(self, write_item: WriteItem):
        if write_item.type == WriteItemType.BYTE_IO:
            return _extra_state_bytes()
        part, chunk = self.chunks[write_item.index]
        self.progress(self.written, len(self.chunks), write_item.index.fqn)
        self.written += 1
        data = read_range(part.source, chunk.tensor, chunk.start, chunk.stop, part.dtype)
        return data[(None,) * len(chunk.index)]


def _common_state(args: argparse.Namespace, iteration: int | None, common_extra: dict | None) -> dict:
    return {"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration or 0,
            "content_metadata": dict(CONTENT_METADATA), **(common_extra or {})}


def write_mcore_torch_dist(root: Path, layout: ModelLayout, source: TensorSource, dtype: torch.dtype,
                           args: argparse.Namespace, iteration: int | None, progress: Progress,
                           common_extra: dict | None = None, extra_parts: list[DistPart] = ()):
    """`root`/latest_checkpointed_iteration.txt + `root`/iter_%07d (or release)/ with the DCP files, common.pt
    (args, checkpoint_version, iteration, content_metadata and `common_extra`) and metadata.json (written last,
    as Megatron does: its presence marks a finished save). `extra_parts`: more keys, e.g. optimizer views."""
    iteration_dir = root / iteration_dir_name(iteration)
    iteration_dir.mkdir(parents=True, exist_ok=True)
    planner = _StreamingSavePlanner(layout, [DistPart("", source, dtype), *extra_parts], True, progress)
    writer = FileSystemWriter(str(iteration_dir), single_file_per_rank=True, sync_files=False, thread_count=1)
    with without_crc32(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")  # one process is the intent
        dcp.save({}, storage_writer=writer, planner=planner, no_dist=True)
        torch.save(_common_state(args, iteration, common_extra), iteration_dir / COMMON_FILE)
    progress(len(planner.chunks), len(planner.chunks), "done")
    (iteration_dir / DIST_CONFIG_FILE).write_text(json.dumps(DIST_CONFIG))
    write_latest(root, iteration)


def save_torch_dist_collectively(iteration_dir: Path, layout: ModelLayout, parts: list[DistPart],
                                 args: argparse.Namespace, iteration: int, common_extra: dict,
                                 process_group: dist.ProcessGroup | None = None):
    """Every rank of the default group calls this with the parts (chunks) it owns; global rank 0 also writes the
    layers' `_extra_state` objects, common.pt and, last, metadata.json. No `latest` pointer: the caller moves the
    finished directory into place. `process_group`: the group (of every rank) DCP coordinates over, None for the
    default one (an asynchronous save passes its own, so as not to interleave with the training's collectives)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    planner = _StreamingSavePlanner(layout, parts, rank == 0, lambda *a: None)
    writer = FileSystemWriter(str(iteration_dir), single_file_per_rank=True, sync_files=False, thread_count=1)
    with without_crc32(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")  # a one-process run: the intent
        dcp.save({}, storage_writer=writer, planner=planner, process_group=process_group,
                 no_dist=not dist.is_initialized())
        if rank == 0:
            torch.save(_common_state(args, iteration, common_extra), iteration_dir / COMMON_FILE)
            (iteration_dir / DIST_CONFIG_FILE).write_text(json.dumps(DIST_CONFIG))
