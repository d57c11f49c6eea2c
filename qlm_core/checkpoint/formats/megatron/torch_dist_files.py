"""Recognising a torch_dist (DCP) checkpoint directory, without importing torch.distributed.checkpoint (which brings
torch._dynamo, seconds of start-up that every process reading only legacy checkpoints would pay)."""

from __future__ import annotations

import re
from pathlib import Path

from qlm_core.checkpoint.formats.megatron.legacy import resolve_iteration_dir

DIST_CONFIG_FILE = "metadata.json"
DCP_METADATA_FILE = ".metadata"


def is_torch_dist_dir(iteration_dir: Path) -> bool:
    return (iteration_dir / DIST_CONFIG_FILE).exists() or (iteration_dir / DCP_METADATA_FILE).exists()


def resolve_dist_dir(root: Path, iteration: int | None = None) -> tuple[Path, int | None]:
    """The iteration directory and its iteration (None for `release`); `root` may also be that directory itself."""
    if iteration is None and is_torch_dist_dir(root):
        match = re.fullmatch(r"iter_(\d+)", root.name)
        return root, int(match.group(1)) if match else None
    return resolve_iteration_dir(root, iteration)
