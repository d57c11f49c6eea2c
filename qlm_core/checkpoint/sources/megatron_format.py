"""The Megatron format, legacy `torch` or `torch_dist`: a checkpoint root (latest_checkpointed_iteration.txt and
iteration folders), one iteration's folder, or a qlm run directory (its checkpoints/). A LoRA run's weights are its
base merged with the adapters; the base is the checkpoint itself when it holds the base weights too, else the HF or
Megatron checkpoint its args name."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from qlm_core.checkpoint.formats.deepspeed.config import copy_hf_side_files
from qlm_core.checkpoint.formats.hf.checkpoint import HFCheckpoint, copy_side_files, is_hf_dir, write_hf_config
from qlm_core.checkpoint.formats.megatron.configured import config_dir
from qlm_core.checkpoint.formats.megatron.format import open_megatron
from qlm_core.checkpoint.formats.megatron.legacy import HF_SIDE_DIR, LATEST_FILE
from qlm_core.checkpoint.formats.megatron.open_configured import open_megatron_with
from qlm_core.checkpoint.formats.megatron.write import write_megatron
from qlm_core.checkpoint.io.progress import Progress
from qlm_core.checkpoint.sources.format_api import (
    CheckpointFormat,
    OpenedCheckpoint,
    ReadOptions,
    Reopened,
    WriteOptions,
)
from qlm_core.checkpoint.sources.lora import merged_source
from qlm_core.checkpoint.sources.nearby import tokenizer_near
from qlm_core.errors import QlmError
from qlm_core.models.layout import HFTensorSource, ModelLayout, TensorSource

CHECKPOINTS_DIR = "checkpoints"  # inside a qlm run directory


def run_checkpoint_dir(path: Path) -> Path | None:
    """The checkpoint root of a qlm run directory, if `path` is one."""
    candidate = Path(path) / CHECKPOINTS_DIR
    return candidate if (candidate / LATEST_FILE).exists() else None


def sniff(path: Path) -> bool:
    """A run directory, a root (its `latest` file or iteration folders), or one iteration's folder: `iter_N`, rank
    folders `mp_rank_*` (directories: DeepSpeed's mp_rank files are not) or torch_dist's metadata."""
    if run_checkpoint_dir(path) is not None or re.fullmatch(r"iter_(\d+)", path.name):
        return True
    try:
        children = list(path.iterdir())
    except OSError as exc:
        raise QlmError(f"cannot read {path}: {exc.strerror or exc}", "check its permissions") from None
    if (path / LATEST_FILE).exists() or any(p.name.startswith(("iter_", "release")) for p in children):
        return True
    if any(p.name.startswith("mp_rank_") and p.is_dir() for p in children):
        return True
    return (path / "metadata.json").exists() and (path / ".metadata").exists()


def megatron_weights(src) -> tuple[TensorSource, Path]:
    """A Megatron checkpoint's weights, and where its HF config/tokenizer files are kept (a LoRA run: merged)."""
    if src.lora is None:
        return src, src.root / HF_SIDE_DIR
    if src.holds_base:
        return merged_source(src, src, src.layout, src.lora), src.root / HF_SIDE_DIR
    if not src.lora.base:
        raise QlmError(f"{src.root} holds only LoRA adapters and its args do not name the base (qlm_lora_base)",
                       "set args.qlm_lora_base to the base model's HF or Megatron checkpoint")
    path = Path(src.lora.base)
    if not path.exists() and not path.is_absolute():
        path = src.root / path
    if not path.exists():
        raise QlmError(f"the LoRA base {src.lora.base} does not exist", "put the base checkpoint back at that path")
    if is_hf_dir(path):
        hf = HFCheckpoint(path)
        base, base_spec, side_dir = HFTensorSource(hf), hf.spec, path
    else:
        base = open_megatron_with(path)
        base_spec, side_dir = base.spec, path / HF_SIDE_DIR
    shape = ("num_layers", "hidden_size", "ffn_hidden_size", "num_query_groups", "vocab_size")
    if any(getattr(base_spec, f) != getattr(src.spec, f) for f in shape):
        raise QlmError(f"the LoRA base {path} is not the model the adapters were trained on",
                       "point args.qlm_lora_base at the right base checkpoint")
    return merged_source(base, src, src.layout, src.lora), side_dir


def _located(path: Path, iteration: int | None) -> tuple[Path, int | None, str]:
    """(the checkpoint root or iteration folder to open, the iteration, how to name it)."""
    root = run_checkpoint_dir(path)
    if root is not None:
        return root, iteration, f"qlm run {path}"
    named = re.fullmatch(r"iter_(\d+)", path.name)
    if named:  # one iteration of a Megatron root, e.g. runs/x/checkpoints/iter_0000004
        number = int(named.group(1))
        if iteration is not None and iteration != number:
            raise QlmError(f"{path} is iteration {number}, not {iteration}",
                           "drop --iteration or point at the checkpoint root")
        return path.parent, number, f"Megatron checkpoint {path}"
    return path, iteration, f"Megatron checkpoint {path}"


def open_mcore(path: Path, options: ReadOptions) -> OpenedCheckpoint:
    where, iteration, what = _located(path, options.iteration)
    ckpt = open_megatron_with(where, iteration, options.config)  # args, --config or a Bridge run_config.yaml
    if options.keep_adapters:
        weights, side = ckpt, ckpt.root / HF_SIDE_DIR
    else:
        weights, side = megatron_weights(ckpt)
        if ckpt.lora is not None:
            what += f" (LoRA rank {ckpt.lora.rank} merged)"
    side = config_dir(options.config) or side
    config = options.config

    def side_files(folder: Path, dtype: torch.dtype, target: str):
        """An HF output's config.json (+ tokenizer and generation config): the side folder's at `dtype`; a preset
        --config's from the spec, the tokenizer files still from the checkpoint's side folder. A Megatron output
        gets them only when there are some to carry (a side folder or --config)."""
        if target == "megatron" and config is None and not side.is_dir():
            return
        folder.mkdir(exist_ok=True)
        copy = copy_hf_side_files if target == "deepspeed" else copy_side_files
        if config is not None and config_dir(config) is None:
            if side.is_dir():
                copy(side, folder)
            write_hf_config(folder, None, ckpt.spec, dtype)
        else:
            write_hf_config(folder, side, ckpt.spec, dtype, copy=copy)

    return OpenedCheckpoint(ckpt.spec, weights, tokenizer_near(side) or tokenizer_near(where), what,
                            ckpt.layout.make_vocab_size_divisible_by, ckpt.iteration, Path(ckpt.dir),
                            format="megatron", root=ckpt.root, layout=ckpt.layout, dtype=ckpt.dtype,
                            side_files=side_files, reader=ckpt)


def write(out: Path, layout: ModelLayout, weights: TensorSource, dtype: torch.dtype, options: WriteOptions,
          progress: Progress):
    write_megatron(options.megatron_format, out, layout, weights, dtype, options.args, options.iteration, progress,
                   options.carrier)


def reopen(out: Path, layout: ModelLayout, dtype: torch.dtype, options: WriteOptions) -> list[Reopened]:
    written = open_megatron(out, options.iteration, spec=options.reopen_spec)
    return [Reopened(written.layout, written, dtype)]


MEGATRON_FORMAT = CheckpointFormat("megatron", sniff, open_mcore, write, reopen, side_folder=HF_SIDE_DIR)
