"""Open any model checkpoint qlm understands as a TensorSource: an HF directory, a Megatron checkpoint (written
by qlm or Megatron-LM, any TP/PP, torch or torch_dist), a DeepSpeed checkpoint (with its model's config.json
beside it), or a qlm run directory (its latest checkpoint; a LoRA run's adapters merged onto
their base). Every verb that reads weights (train's model.load, eval, profile) goes through here; the formats are
registry.py's."""

from __future__ import annotations

from pathlib import Path

from qlm_core.checkpoint.sources.format_api import OpenedCheckpoint, ReadOptions
from qlm_core.checkpoint.sources.megatron_format import CHECKPOINTS_DIR, run_checkpoint_dir
from qlm_core.checkpoint.sources.nearby import tokenizer_near
from qlm_core.checkpoint.sources.registry import format_of
from qlm_core.errors import QlmError

__all__ = ["CHECKPOINTS_DIR", "OpenedCheckpoint", "open_checkpoint", "run_checkpoint_dir", "tokenizer_near"]

_WHAT = "point at an HF model, a Megatron or DeepSpeed checkpoint, or a qlm run directory"


def open_checkpoint(path: str | Path, iteration: int | None = None) -> OpenedCheckpoint:
    path = Path(path)
    if not path.exists():
        raise QlmError(f"{path} does not exist", _WHAT)
    if not path.is_dir():
        raise QlmError(f"{path} is not a directory", _WHAT)
    found = format_of(path)
    if iteration is not None and (found is None or found.name != "megatron"):
        raise QlmError(f"--iteration {iteration} needs a Megatron checkpoint or a qlm run, and {path} is neither",
                       "drop --iteration")
    if found is None:
        raise QlmError(f"cannot tell what {path} holds",
                       "expected an HF model, a Megatron or DeepSpeed checkpoint, or a qlm run directory")
    # reading to evaluate, generate or train from needs no fp32 masters: a bf16 DeepSpeed module without them will do
    return found.open(path, ReadOptions(iteration=iteration, allow_bf16_weights=True))
