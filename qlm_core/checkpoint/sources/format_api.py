"""What every checkpoint format qlm reads and writes supplies (one CheckpointFormat object per format, listed in
registry.py): sniff a directory, open it as a TensorSource with what verbs need beside the weights
(OpenedCheckpoint), write one from any TensorSource, and reopen what was written for verification. The conversion
skeleton (checkpoint/convert/skeleton.py) and open_checkpoint (open.py) use nothing else of a format."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from qlm_core.checkpoint.io.progress import Progress
from qlm_core.models.layout import ModelLayout, TensorSource
from qlm_core.models.spec import ModelSpec


@dataclass(frozen=True)
class ReadOptions:
    iteration: int | None = None  # a Megatron checkpoint's iteration (None: its latest)
    config: str | Path | None = None  # --config: the architecture (Megatron without args, DeepSpeed's config.json)
    tag: str | None = None  # a DeepSpeed tag (None: its `latest`)
    allow_bf16_weights: bool = False  # DeepSpeed: read a bf16/fp16 run without fp32 masters from its module weights
    keep_adapters: bool = False  # a LoRA run's adapters as stored (a reshard), not merged onto their base


SideFiles = Callable[[Path, torch.dtype, str], None]  # (folder, output dtype, target format name)


@dataclass
class OpenedCheckpoint:
    spec: ModelSpec
    weights: TensorSource  # the model's weights (a LoRA run's merged onto its base unless keep_adapters)
    tokenizer_dir: Path | None
    description: str
    make_vocab_size_divisible_by: int = 128
    iteration: int | None = None  # the Megatron iteration read (None: an HF or DeepSpeed model, or `release`)
    weights_dir: Path | None = None  # the directory the weights were read from (a Megatron iteration's own)
    # what a conversion needs beside
    format: str = ""  # the CheckpointFormat's name
    root: Path | None = None  # the directory a conversion's output must not replace
    layout: ModelLayout | None = None  # the layout `weights` are read in
    dtype: torch.dtype | None = None  # a conversion's default output dtype
    hf_path: Path | None = None  # an HF model: its reference logits are transformers' own
    side_files: SideFiles | None = None  # writes config.json and the tokenizer files for an output of a format
    reader: Any = None  # the format's own reader (a Megatron checkpoint: its args, LoRA and training state)
    notes: list[str] = field(default_factory=list)  # what a conversion does not carry over, and why
    warnings: list[str] = field(default_factory=list)  # what the source lacks or holds (warning lines)


@dataclass(frozen=True)
class WriteOptions:
    """What a writer takes beside the layout, the weights and the dtype; each format reads its own fields."""

    megatron_format: str = "torch"  # Megatron: torch | torch_dist
    args: argparse.Namespace | None = None  # Megatron: the args stored with the weights
    iteration: int | None = None  # Megatron: the iteration written (None: release)
    carrier: Any = None  # Megatron: a training run's state written beside the weights (convert/train_state.py)
    reopen_spec: ModelSpec | None = None  # Megatron: the spec to reopen with (None: the written args')
    tag: str = "global_step0"  # DeepSpeed
    global_steps: int = 0  # DeepSpeed
    fp32_master: bool = True  # DeepSpeed: also the fp32 masters (one ZeRO-2 partition)
    max_shard_bytes: int = 5 * 2**30  # HF


@dataclass(frozen=True)
class Reopened:
    """One view of a written checkpoint that verification compares with the source, tensor by tensor, at `dtype`."""

    layout: ModelLayout
    weights: TensorSource
    dtype: torch.dtype


@dataclass(frozen=True)
class CheckpointFormat:
    """name: the format ("hf", "megatron", "deepspeed"). sniff(path): whether `path` holds one. open(path, options):
    the OpenedCheckpoint. write(out, layout, weights, dtype, options, progress): a checkpoint of this format in
    `out`. reopen(out, layout, dtype, options): the views of what write wrote, to verify (the first one's logits are
    compared). side_folder: where its config.json and tokenizer files go inside a written checkpoint ("": its
    root). hf_logits: its reference logits are transformers' (an HF model), not qlm's model."""

    name: str
    sniff: Callable[[Path], bool]
    open: Callable[[Path, ReadOptions], OpenedCheckpoint]
    write: Callable[[Path, ModelLayout, TensorSource, torch.dtype, WriteOptions, Progress], None]
    reopen: Callable[[Path, ModelLayout, torch.dtype, WriteOptions], list[Reopened]]
    side_folder: str = ""
    hf_logits: bool = False
