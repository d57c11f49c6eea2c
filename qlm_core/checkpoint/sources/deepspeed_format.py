"""The DeepSpeed format: `latest` + `<tag>/mp_rank_00_model_states.pt` (+ ZeRO optimizer partitions) of a
transformers module, its model's config.json beside it or named by --config."""

from __future__ import annotations

from pathlib import Path

import torch

from qlm_core.checkpoint.formats.deepspeed.checkpoint import MODULE, DeepSpeedCheckpoint
from qlm_core.checkpoint.formats.deepspeed.config import copy_hf_side_files, find_hf_config
from qlm_core.checkpoint.formats.deepspeed.write import check_tag, write_deepspeed
from qlm_core.checkpoint.formats.hf.checkpoint import read_config
from qlm_core.checkpoint.formats.packed_experts import PackedExperts
from qlm_core.checkpoint.io.progress import Progress
from qlm_core.checkpoint.sources.format_api import (
    CheckpointFormat,
    OpenedCheckpoint,
    ReadOptions,
    Reopened,
    WriteOptions,
)
from qlm_core.checkpoint.sources.nearby import tokenizer_near
from qlm_core.models.layout import HFTensorSource, ModelLayout, TensorSource, without_absent_mtp
from qlm_core.models.spec import ModelSpec


def sniff(path: Path) -> bool:
    """`latest`, tag folders, or a tag folder's model states (tags without `latest`: the reader asks for --tag)."""
    return ((path / "latest").is_file() or any(path.glob("global_step*"))
            or any(path.glob("*mp_rank_*_model_states.pt")) or any(path.glob("*/*mp_rank_*_model_states.pt")))


def open_deepspeed(ds: str | Path, tag: str | None, config: str | Path | None, allow_bf16_weights: bool = False):
    """A DeepSpeed checkpoint, the ModelSpec of the config.json that describes it, and that config's path.
    `allow_bf16_weights`: read a bf16/fp16 ZeRO 1/2 run without its optimizer files from its module weights."""
    src = DeepSpeedCheckpoint(ds, tag, allow_low_precision=allow_bf16_weights)
    config_path = find_hf_config(src, config)
    spec, _ = without_absent_mtp(ModelSpec.from_hf_config(read_config(config_path)), src.has)
    return src, spec, config_path


def open_ds(path: Path, options: ReadOptions) -> OpenedCheckpoint:
    ckpt, spec, config_path = open_deepspeed(path, options.tag, options.config, options.allow_bf16_weights)
    layout = ModelLayout(spec)
    ckpt.check_layout(layout)
    config_dir = config_path.parent if config_path.is_file() else config_path
    weights = "module weights, no optimizer files" if ckpt.warnings else "fp32 masters"

    def side_files(folder: Path, dtype: torch.dtype, target: str):
        copy_hf_side_files(config_path, folder, dtype if target == "hf" else None)

    source = HFTensorSource(PackedExperts(ckpt, spec))  # fused / packed experts read as per-expert views
    return OpenedCheckpoint(spec, source, tokenizer_near(config_dir) or tokenizer_near(path),
                            f"DeepSpeed checkpoint {path} (ZeRO {ckpt.zero_stage}, {weights})", weights_dir=path,
                            format="deepspeed", root=ckpt.root, layout=layout, dtype=torch.float32,
                            side_files=side_files, reader=ckpt, notes=list(ckpt.notes), warnings=list(ckpt.warnings))


def write(out: Path, layout: ModelLayout, weights: TensorSource, dtype: torch.dtype, options: WriteOptions,
          progress: Progress):
    write_deepspeed(out, layout, weights, dtype, check_tag(options.tag), options.global_steps, options.fp32_master,
                    progress=progress)


def reopen(out: Path, layout: ModelLayout, dtype: torch.dtype, options: WriteOptions) -> list[Reopened]:
    """The module at `dtype` (its logits are compared) and, when written, the fp32 masters."""
    module = PackedExperts(DeepSpeedCheckpoint(out, options.tag, view=MODULE), layout.spec)
    views = [Reopened(layout, HFTensorSource(module), dtype)]
    if options.fp32_master:
        masters = PackedExperts(DeepSpeedCheckpoint(out, options.tag), layout.spec)
        views.append(Reopened(layout, HFTensorSource(masters), torch.float32))
    return views


DEEPSPEED_FORMAT = CheckpointFormat("deepspeed", sniff, open_ds, write, reopen)
