"""Where a run's architecture, weights and tokenizer come from: a preset, an HF model, a Megatron checkpoint
(written by qlm or Megatron-LM, any TP/PP) or a qlm run directory. Weights are handed to the engine as a
TensorSource, so each rank reads only its own shard, streaming, with no conversion step."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from qlm_core.checkpoint.sources.open import open_checkpoint, tokenizer_near
from qlm_core.config import ModelConfig, MoeConfig
from qlm_core.errors import QlmError
from qlm_core.models.layout import TensorSource
from qlm_core.models.presets import load_model_spec
from qlm_core.models.spec import ModelSpec


@dataclass
class ModelSource:
    spec: ModelSpec
    weights: TensorSource | None  # None: random init
    tokenizer_dir: Path | None
    description: str
    iteration: int | None = None  # model.load's Megatron iteration that was read (None: HF, DeepSpeed, random)
    weights_dir: Path | None = None  # the directory the weights were read from (None: random init)


# the numbers and choices that fix every weight's shape: model.spec and model.load must agree on them
SHAPE_FIELDS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                "kv_channels", "vocab_size", "attention", "norm", "activation")


def check_spec_matches_load(config: ModelConfig, loaded: ModelSpec):
    """model.spec set (not the default) beside model.load: the load's own config is what the run uses (as
    transformers' from_pretrained and Megatron's --use-checkpoint-args do), so a spec that names another shape is
    a mistake, not a choice: an error naming both. A spec of the same shape is fine."""
    if not config.spec or config.spec == ModelConfig().spec:
        return
    named = load_model_spec(config.spec)
    differ = [f"{f} {getattr(named, f)} vs {getattr(loaded, f)}" for f in SHAPE_FIELDS
              if getattr(named, f) != getattr(loaded, f)]
    if differ:
        raise QlmError(f"model.spec {config.spec} and model.load {config.load} are different models "
                       f"({', '.join(differ[:3])})", "remove model.spec (the weights' own config is used) or point "
                       "it at the loaded model")


def with_recipe_router(spec: ModelSpec, moe: MoeConfig, loaded: bool) -> ModelSpec:
    """The spec with [moe]'s router choices (router_score_function, router_expert_bias; absent: the model's own).
    A loaded model's router is part of its weights: a different choice is an error there."""
    if spec.moe is None:
        return spec
    wanted = {"score_function": moe.router_score_function, "expert_bias": moe.router_expert_bias}
    changes = {key: value for key, value in wanted.items() if value is not None and getattr(spec.moe, key) != value}
    if not changes:
        return spec
    if loaded:
        key, value = next(iter(changes.items()))
        raise QlmError(f"moe.router_{key} = {value} but model.load's router has {key} = {getattr(spec.moe, key)}",
                       f"drop moe.router_{key} (a loaded model keeps its router)")
    return replace(spec, moe=replace(spec.moe, **changes))


def resolve_model(config: ModelConfig, moe: MoeConfig | None = None, iteration: int | None = None) -> ModelSource:
    """`moe`: the recipe's [moe], whose router choices apply to a model trained from scratch. `iteration`: the
    iteration of a Megatron checkpoint or qlm run in model.load to read (None: its latest)."""
    moe = MoeConfig() if moe is None else moe
    iteration_read, weights_dir = None, None
    if config.load:
        opened = open_checkpoint(Path(config.load), iteration)
        check_spec_matches_load(config, opened.spec)
        spec, weights, tokenizer, what = opened.spec, opened.weights, opened.tokenizer_dir, opened.description
        spec = with_recipe_router(spec, moe, loaded=True)
        iteration_read, weights_dir = opened.iteration, opened.weights_dir
        if iteration is not None:
            what += f" (iteration {iteration}, which this run started from)"
    else:
        spec, weights, what = load_model_spec(config.spec), None, f"random init of {config.spec}"
        spec = with_recipe_router(spec, moe, loaded=False)
        tokenizer = tokenizer_near(Path(config.spec)) if Path(config.spec).exists() else None
    if config.tokenizer:
        tokenizer = Path(config.tokenizer)
    return ModelSource(spec, weights, tokenizer, what, iteration_read, weights_dir)
