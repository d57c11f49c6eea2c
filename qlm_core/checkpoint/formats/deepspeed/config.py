"""The HF config a DeepSpeed checkpoint does not store: where to find it, and the config and tokenizer files that
travel with the weights (a DeepSpeed root also holds `latest`, recovery scripts and trainer states, which do not)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from qlm_core.checkpoint.formats.deepspeed.checkpoint import DeepSpeedCheckpoint
from qlm_core.dtypes import set_hf_config_dtype
from qlm_core.errors import QlmError


def find_hf_config(ckpt: DeepSpeedCheckpoint, config: str | Path | None) -> Path:
    """The directory (or config.json) describing the model: --config, else a config.json next to the checkpoint."""
    if config is not None:
        path = Path(config)
        if (path / "config.json").is_file() or (path.is_file() and path.suffix == ".json"):
            return path
        raise QlmError(f"no config.json at {path}", "pass --config an HF model directory or its config.json")
    for candidate in (ckpt.root, ckpt.dir):
        if (candidate / "config.json").is_file():
            return candidate
    raise QlmError(f"{ckpt.root} has no config.json and DeepSpeed checkpoints do not record the model config",
                   "pass --config DIR (the HF model the run started from)")


_SIDE_FILES = ("config.json", "generation_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json",
               "merges.txt", "chat_template.json", "chat_template.jinja")


def copy_hf_side_files(src: Path, dst: Path, dtype: torch.dtype | None = None):
    """Config, generation config and tokenizer files only (a DeepSpeed root also holds `latest`, scripts and trainer
    states); `dtype` also becomes config.json's dtype."""
    dst.mkdir(parents=True, exist_ok=True)
    files = [src] if src.is_file() else [p for p in src.iterdir() if p.is_file()]
    for item in files:
        if src.is_file() or item.name in _SIDE_FILES or item.name.startswith("tokenizer"):
            shutil.copy2(item, dst / ("config.json" if src.is_file() else item.name))
    if dtype is not None:
        config = set_hf_config_dtype(json.loads((dst / "config.json").read_text()), dtype)
        (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
