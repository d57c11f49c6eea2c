"""Where a checkpoint's tokenizer files are: beside it, or in the `hf/` folder a Megatron checkpoint keeps them in."""

from __future__ import annotations

from pathlib import Path

from qlm_core.checkpoint.formats.megatron.legacy import HF_SIDE_DIR


def tokenizer_near(path: Path) -> Path | None:
    for candidate in (path, path / HF_SIDE_DIR, path.parent / HF_SIDE_DIR):
        if (candidate / "tokenizer_config.json").exists() or (candidate / "tokenizer.json").exists():
            return candidate
    return None
