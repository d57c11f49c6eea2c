"""Where a run's architecture, weights and tokenizer come from: a preset, an HF model, a Megatron checkpoint
(written by qlm or Megatron-LM, any TP/PP) or a qlm run directory. Weights are handed to the engine as a
TensorSource, so each rank reads only its own shard, streaming, with no conversion step."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from qlm_core.checkpoint.sources.open import open_checkpoint, tokenizer_near
from qlm_core.config import ModelConfig
from qlm_core.models.layout import TensorSource
from qlm_core.models.spec import ModelSpec, load_model_spec


@dataclass
class ModelSource:
    spec: ModelSpec
    weights: TensorSource | None  # None: random init
    tokenizer_dir: Path | None
    description: str


def resolve_model(config: ModelConfig) -> ModelSource:
    if config.load:
        opened = open_checkpoint(Path(config.load))
        spec, weights, tokenizer, what = opened.spec, opened.weights, opened.tokenizer_dir, opened.description
    else:
        spec, weights, what = load_model_spec(config.spec), None, f"random init of {config.spec}"
        tokenizer = tokenizer_near(Path(config.spec)) if Path(config.spec).exists() else None
    if config.tokenizer:
        tokenizer = Path(config.tokenizer)
    return ModelSource(spec, weights, tokenizer, what)
