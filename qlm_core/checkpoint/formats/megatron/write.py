"""Write a Megatron checkpoint of either format from any TensorSource: legacy `torch` rank files (streamed from an
HF source, legacy_stream.py) or `torch_dist` (torch_dist_write.py), with a training run's state beside the weights
when a carrier gives it."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import torch

from qlm_core.checkpoint.formats.hf.checkpoint import HFCheckpoint
from qlm_core.checkpoint.formats.megatron.format import TORCH_DIST
from qlm_core.checkpoint.formats.megatron.legacy import (
    SHARD_FILE,
    iteration_dir_name,
    legacy_shard_ranks,
    shard_dir_name,
    write_latest,
    write_shard_file,
)
from qlm_core.checkpoint.formats.megatron.legacy_stream import STREAMING, StageWriter
from qlm_core.checkpoint.io.progress import Progress
from qlm_core.models.layout import HFTensorSource, ModelLayout, TensorSource, build_shard


def write_mcore_torch(root: Path, layout: ModelLayout, source: TensorSource, dtype: torch.dtype,
                      args: argparse.Namespace, iteration: int | None, progress: Progress,
                      extra_for: Callable[[int, int, int], dict] | None = None):
    """One rank folder per (TP, PP, EP) position Megatron writes (megatron.legacy.legacy_shard_ranks)."""
    iteration_dir = root / iteration_dir_name(iteration)
    ranks = legacy_shard_ranks(layout.tp, layout.ep, layout.etp)
    total = len(ranks) * layout.pp
    streams = STREAMING and isinstance(source, HFTensorSource) and isinstance(source.hf, HFCheckpoint)
    for pp_rank in range(layout.pp):
        stage = StageWriter(source.hf) if streams else None  # the stage's files filled together, at the end
        try:
            for index, (tp_rank, ep_rank) in enumerate(ranks):
                name = shard_dir_name(tp_rank, pp_rank, layout.pp, ep_rank, layout.ep)
                progress(pp_rank * len(ranks) + index, total, name)
                etp_rank = tp_rank % layout.etp
                chunks = [build_shard(layout, tp_rank, pp_rank, c, stage.source if stage else source, dtype,
                                      ep_rank, etp_rank) for c in range(layout.vpp)]
                extra = extra_for(tp_rank, pp_rank, ep_rank) if extra_for is not None else None
                path = iteration_dir / name / SHARD_FILE
                if stage is None:
                    write_shard_file(path, chunks, args, iteration, extra)
                else:
                    stage.add_file(path, write_shard_file(path, chunks, args, iteration, extra, tensor_bytes=False))
                del chunks
            if stage is not None:
                stage.fill()
        finally:
            if stage is not None:
                stage.close()  # the copying threads stopped and the files closed on any error
    progress(total, total, "done")
    write_latest(root, iteration)


def write_megatron(format: str, root: Path, layout: ModelLayout, source: TensorSource, dtype: torch.dtype,
                   args: argparse.Namespace, iteration: int | None, progress: Progress, carrier=None):
    """A Megatron checkpoint in `format`; `carrier`: a training run's state to write beside the weights
    (convert/train_state.TrainStateCarrier: extra_for, common_extra, dist_parts)."""
    if format == TORCH_DIST:
        from qlm_core.checkpoint.formats.megatron.torch_dist_write import write_mcore_torch_dist  # imports DCP

        write_mcore_torch_dist(root, layout, source, dtype, args, iteration, progress,
                               carrier.common_extra() if carrier else None, carrier.dist_parts() if carrier else [])
    else:
        extra_for = carrier.extra_for if carrier else None
        write_mcore_torch(root, layout, source, dtype, args, iteration, progress, extra_for)
