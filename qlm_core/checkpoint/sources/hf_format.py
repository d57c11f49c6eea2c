"""The Hugging Face model format: a directory with config.json and safetensors (or .bin) weights."""

from __future__ import annotations

from pathlib import Path

import torch

from qlm_core.checkpoint.formats.deepspeed.config import copy_hf_side_files
from qlm_core.checkpoint.formats.hf.checkpoint import HFCheckpoint, copy_side_files, is_hf_dir
from qlm_core.checkpoint.formats.hf.write import write_hf
from qlm_core.checkpoint.io.progress import Progress
from qlm_core.checkpoint.sources.format_api import (
    CheckpointFormat,
    OpenedCheckpoint,
    ReadOptions,
    Reopened,
    WriteOptions,
)
from qlm_core.checkpoint.sources.nearby import tokenizer_near
from qlm_core.models.layout import HFTensorSource, ModelLayout, TensorSource


def open_hf(path: Path, options: ReadOptions) -> OpenedCheckpoint:
    ckpt = HFCheckpoint(path)
    ckpt.check_model()  # a config.json with fewer layers than the weights would drop some silently

    def side_files(folder: Path, dtype: torch.dtype, target: str):
        if target == "deepspeed":  # a DeepSpeed root takes only the config and tokenizer files
            copy_hf_side_files(ckpt.path, folder, dtype)
        else:
            copy_side_files(ckpt.path, folder)

    return OpenedCheckpoint(ckpt.spec, HFTensorSource(ckpt), tokenizer_near(path), f"HF model {path}",
                            weights_dir=path, format="hf", root=ckpt.path, layout=ModelLayout(ckpt.spec),
                            dtype=ckpt.weights_dtype, hf_path=ckpt.path, side_files=side_files, reader=ckpt,
                            notes=list(ckpt.notes))


def write(out: Path, layout: ModelLayout, weights: TensorSource, dtype: torch.dtype, options: WriteOptions,
          progress: Progress):
    write_hf(out, layout, weights, dtype, options.max_shard_bytes, progress)


def reopen(out: Path, layout: ModelLayout, dtype: torch.dtype, options: WriteOptions) -> list[Reopened]:
    return [Reopened(layout, HFTensorSource(HFCheckpoint(out)), dtype)]


HF_FORMAT = CheckpointFormat("hf", is_hf_dir, open_hf, write, reopen, hf_logits=True)
