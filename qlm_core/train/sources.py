"""Where a run's architecture, weights and tokenizer come from: a preset, an HF model, a Megatron checkpoint
(written by qlm or Megatron-LM, any TP/PP) or a qlm run directory. Weights are handed to the engine as a
TensorSource, so each rank reads only its own shard, streaming, with no conversion step."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..checkpoint.hf import HFCheckpoint, is_hf_dir
from ..checkpoint.layout import HFTensorSource, TensorSource
from ..checkpoint.mcore import HF_SIDE_DIR, LATEST_FILE, MegatronTorchCheckpoint
from ..config import ModelConfig
from ..errors import QlmError
from ..models.spec import ModelSpec, load_model_spec

CHECKPOINTS_DIR = "checkpoints"


@dataclass
class ModelSource:
    spec: ModelSpec
    weights: TensorSource | None  # None: random init
    tokenizer_dir: Path | None
    description: str


def run_checkpoint_dir(path: Path) -> Path | None:
    """The checkpoint root of a qlm run directory, if `path` is one."""
    candidate = Path(path) / CHECKPOINTS_DIR
    return candidate if (candidate / LATEST_FILE).exists() else None


def _tokenizer_near(path: Path) -> Path | None:
    for candidate in (path, path / HF_SIDE_DIR, path.parent / HF_SIDE_DIR):
        if (candidate / "tokenizer_config.json").exists() or (candidate / "tokenizer.json").exists():
            return candidate
    return None


def open_weights(path: Path) -> tuple[ModelSpec, TensorSource, Path | None, str]:
    path = Path(path)
    if not path.exists():
        raise QlmError(f"model.load {path} does not exist", "point at an HF model, a Megatron checkpoint or a run")
    root = run_checkpoint_dir(path)
    if root is not None:
        ckpt = MegatronTorchCheckpoint(root)
        return ckpt.spec, ckpt, _tokenizer_near(root) or _tokenizer_near(path), f"qlm run {path}"
    if (path / LATEST_FILE).exists() or any(p.name.startswith(("iter_", "release")) for p in path.iterdir()):
        ckpt = MegatronTorchCheckpoint(path)
        return ckpt.spec, ckpt, _tokenizer_near(path), f"Megatron checkpoint {path} (tp{ckpt.tp} pp{ckpt.pp})"
    if is_hf_dir(path):
        ckpt = HFCheckpoint(path)
        return ckpt.spec, HFTensorSource(ckpt), _tokenizer_near(path), f"HF model {path}"
    raise QlmError(f"cannot tell what {path} holds", "expected an HF model, a Megatron checkpoint or a qlm run")


def resolve_model(config: ModelConfig, tokenizer_fallback: Path | None = None) -> ModelSource:
    if config.load:
        spec, weights, tokenizer, what = open_weights(Path(config.load))
    else:
        spec, weights, what = load_model_spec(config.spec), None, f"random init of {config.spec}"
        tokenizer = _tokenizer_near(Path(config.spec)) if Path(config.spec).exists() else None
    if config.tokenizer:
        tokenizer = Path(config.tokenizer)
    return ModelSource(spec, weights, tokenizer or tokenizer_fallback, what)
