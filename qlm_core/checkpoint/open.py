"""Open any model checkpoint qlm understands as a TensorSource: an HF directory, a Megatron checkpoint (written
by qlm or Megatron-LM, any TP/PP, torch or torch_dist), a DeepSpeed checkpoint (with its model's config.json
beside it), or a qlm run directory (its latest checkpoint; a LoRA run's adapters merged onto
their base). Every verb that reads weights (train's model.load, eval, profile) goes through here."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import QlmError
from ..models.spec import ModelSpec
from .hf import HFCheckpoint, is_hf_dir
from .layout import HFTensorSource, TensorSource
from .mcore import HF_SIDE_DIR, LATEST_FILE
from .megatron_open import open_megatron

CHECKPOINTS_DIR = "checkpoints"  # inside a qlm run directory


@dataclass
class OpenedCheckpoint:
    spec: ModelSpec
    weights: TensorSource
    tokenizer_dir: Path | None
    description: str
    make_vocab_size_divisible_by: int = 128


def run_checkpoint_dir(path: Path) -> Path | None:
    """The checkpoint root of a qlm run directory, if `path` is one."""
    candidate = Path(path) / CHECKPOINTS_DIR
    return candidate if (candidate / LATEST_FILE).exists() else None


def tokenizer_near(path: Path) -> Path | None:
    for candidate in (path, path / HF_SIDE_DIR, path.parent / HF_SIDE_DIR):
        if (candidate / "tokenizer_config.json").exists() or (candidate / "tokenizer.json").exists():
            return candidate
    return None


def _open_megatron(root: Path, iteration: int | None, what: str) -> OpenedCheckpoint:
    ckpt = open_megatron(root, iteration)  # legacy torch or torch_dist
    weights, side = ckpt, root / HF_SIDE_DIR
    if ckpt.lora is not None:
        from .convert import merged_lora_source

        weights, side = merged_lora_source(ckpt)
        what += f" (LoRA rank {ckpt.lora.rank} merged)"
    return OpenedCheckpoint(ckpt.spec, weights, tokenizer_near(side) or tokenizer_near(root), what,
                            ckpt.layout.make_vocab_size_divisible_by)


def open_checkpoint(path: str | Path, iteration: int | None = None) -> OpenedCheckpoint:
    path = Path(path)
    if not path.exists():
        raise QlmError(f"{path} does not exist", "point at an HF model, a Megatron checkpoint or a qlm run directory")
    root = run_checkpoint_dir(path)
    if root is not None:
        return _open_megatron(root, iteration, f"qlm run {path}")
    if (path / LATEST_FILE).exists() or any(p.name.startswith(("iter_", "release")) for p in path.iterdir()):
        return _open_megatron(path, iteration, f"Megatron checkpoint {path}")
    if is_hf_dir(path):
        ckpt = HFCheckpoint(path)
        return OpenedCheckpoint(ckpt.spec, HFTensorSource(ckpt), tokenizer_near(path), f"HF model {path}")
    if (path / "latest").is_file() or list(path.glob("global_step*")) or list(path.glob("*mp_rank_*_model_states.pt")):
        from .convert_deepspeed import open_deepspeed  # the config.json beside the checkpoint gives the architecture

        ckpt, spec, config_path = open_deepspeed(path, None, None)
        config_dir = config_path.parent if config_path.is_file() else config_path
        return OpenedCheckpoint(spec, HFTensorSource(ckpt), tokenizer_near(config_dir) or tokenizer_near(path),
                                f"DeepSpeed checkpoint {path} (ZeRO {ckpt.zero_stage}, fp32 masters)")
    raise QlmError(f"cannot tell what {path} holds",
                   "expected an HF model, a Megatron or DeepSpeed checkpoint, or a qlm run directory")
