"""Where a run's architecture, weights and tokenizer come from: a preset, an HF model, a Megatron checkpoint
(written by qlm or Megatron-LM, any TP/PP) or a qlm run directory. Weights are handed to the engine as a
TensorSource, so each rank reads only its own shard, streaming, with no conversion step."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from qlm_core.checkpoint.sources.open import open_checkpoint, tokenizer_near
from qlm_core.config import ModelConfig, MoeConfig, Recipe
from qlm_core.data.tokenizer import tokenizer_and_pad
from qlm_core.errors import QlmError
from qlm_core.models.families import HeadName
from qlm_core.models.layout import OUTPUT_LAYER, TensorLayout, TensorSource
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
    routed = replace(spec.moe, **changes)
    if routed.expert_bias and routed.score_function != "sigmoid":  # ERNIE's router is ERNIE's models' own
        raise QlmError("moe.router_expert_bias with softmax scores (Megatron allows the bias with sigmoid routing "
                       "only; ERNIE 4.5's softmax router with a bias comes with its models)",
                       "set moe.router_score_function = \"sigmoid\" or drop moe.router_expert_bias")
    return replace(spec, moe=routed)


def resolve_model(config: ModelConfig, moe: MoeConfig | None = None, iteration: int | None = None,
                  head: HeadName = "lm", seed: int = 0) -> ModelSource:
    """`moe`: the recipe's [moe], whose router choices apply to a model trained from scratch. `iteration`: the
    iteration of a Megatron checkpoint or qlm run in model.load to read (None: its latest). `head`: the head the
    run trains (recipe_head); a language model loaded for a score head gets a new one, drawn with `seed`."""
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
    if head != spec.head:
        spec, weights, what = _with_head(spec, weights, what, head, seed, config, tokenizer)
    return ModelSource(spec, weights, tokenizer, what, iteration_read, weights_dir)


def recipe_head(recipe: Recipe) -> HeadName:
    """The head a recipe trains: a score head for a reward model, else the language model's."""
    return "score" if recipe.data.kind == "reward" else "lm"


def _with_head(spec: ModelSpec, weights: TensorSource | None, what: str, head: HeadName, seed: int,
               config: ModelConfig, tokenizer: Path | None):
    if head == "lm":
        raise QlmError(f"model.load {config.load} is a reward model (a score head), not a language model",
                       'train it with data.kind = "reward", or load a language model')
    pad = tokenizer_and_pad(tokenizer)[1] if tokenizer is not None else None
    spec = spec.as_reward_model().replace(pad_token_id=pad)
    if weights is None:
        return spec, None, what + " with a score head"
    return spec, NewScoreHead(weights, spec.hidden_size, seed), what + " with a new score head (random, std 0.02)"


class NewScoreHead:
    """A language model's weights with a new score head (models/score_head.py) in place of its output layer: drawn
    from N(0, 0.02²) with `seed`, the init transformers gives a *ForSequenceClassification's new `score`."""

    def __init__(self, weights: TensorSource, hidden_size: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        self.weights, self.head = weights, torch.randn(1, hidden_size, generator=generator) * 0.02

    def stored_dtype(self, tensor: TensorLayout) -> torch.dtype:
        return self.head.dtype if tensor.name == OUTPUT_LAYER else self.weights.stored_dtype(tensor)

    def read_into(self, tensor: TensorLayout, start: int, stop: int, out: torch.Tensor) -> None:
        if tensor.name != OUTPUT_LAYER:
            return self.weights.read_into(tensor, start, stop, out)
        out.copy_(self.head[start:stop])
