"""Write an HF model's weights (safetensors shards and their index) from any TensorSource, one shard at a time."""

from __future__ import annotations

from pathlib import Path

import torch

from qlm_core.checkpoint.formats.hf.checkpoint import plan_hf_shards, shard_file_names, write_hf_index, write_hf_shard
from qlm_core.checkpoint.io.progress import Progress
from qlm_core.models.hf_experts import HFFiles
from qlm_core.models.layout import ModelLayout, TensorSource


def write_hf(out: Path, layout: ModelLayout, source: TensorSource, dtype: torch.dtype, max_shard_bytes: int,
             progress: Progress):
    tensor_files = HFFiles(layout)  # gpt-oss's experts packed, as its files hold them
    sizes = {name: torch.Size(shape).numel() * dtype.itemsize for name, shape in tensor_files.shapes.items()}
    shards = plan_hf_shards(sizes, max_shard_bytes)
    files = shard_file_names(len(shards))
    weight_map = {}
    for i, (names, file) in enumerate(zip(shards, files, strict=True)):
        progress(i, len(shards), file)
        tensors = {name: tensor_files.assemble(name, source, dtype) for name in names}
        write_hf_shard(out / file, tensors)
        weight_map.update({name: file for name in names})
        del tensors
    progress(len(shards), len(shards), "done")
    if len(shards) > 1:
        write_hf_index(out, weight_map, sum(sizes.values()))
