"""Open a Megatron checkpoint of either format (legacy `torch` or `torch_dist`) as a TensorSource."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from qlm_core.checkpoint.formats.megatron.legacy import MegatronTorchCheckpoint
from qlm_core.checkpoint.formats.megatron.torch_dist_files import is_torch_dist_dir, resolve_dist_dir
from qlm_core.config import CheckpointFormat, choices
from qlm_core.errors import QlmError
from qlm_core.models.spec import ModelSpec

if TYPE_CHECKING:
    from qlm_core.checkpoint.formats.megatron.torch_dist import TorchDistCheckpoint

TORCH, TORCH_DIST = "torch", "torch_dist"


def megatron_format(path: str | Path, iteration: int | None = None) -> str:
    """`torch` or `torch_dist`: the format of the iteration `path` resolves to."""
    root = Path(path)
    if not root.is_dir():
        raise QlmError(f"{root} is not a directory", "point at a Megatron checkpoint directory")
    iteration_dir, _ = resolve_dist_dir(root, iteration)
    return TORCH_DIST if is_torch_dist_dir(iteration_dir) else TORCH


def open_megatron(path: str | Path, iteration: int | None = None, spec: ModelSpec | None = None,
                  view: str = "model") -> MegatronTorchCheckpoint | TorchDistCheckpoint:
    """The checkpoint at `path` (root with latest_checkpointed_iteration.txt, or an iteration directory) opened for
    streaming reads; both readers offer layout, spec, args, dtype, iteration, tp, pp, lora and extra_state()."""
    if megatron_format(path, iteration) == TORCH_DIST:
        from qlm_core.checkpoint.formats.megatron.torch_dist import TorchDistCheckpoint  # imports DCP: only when needed

        return TorchDistCheckpoint(path, iteration, spec, view)
    return MegatronTorchCheckpoint(path, iteration, spec, view)


def check_format(fmt: str) -> str:
    """The converters' format argument (a recipe's checkpoint.format was checked when the recipe was read)."""
    if fmt not in choices(CheckpointFormat):
        raise QlmError(f"unknown checkpoint format {fmt!r}", f"use one of {', '.join(choices(CheckpointFormat))}")
    return fmt
