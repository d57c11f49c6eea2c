"""Everything `qlm train` checks and resolves before any process starts: the recipe's layout for the world it will
run on, the model's numbers, the data files, and the model-state memory per rank."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..checkpoint.layout import ModelLayout
from ..checkpoint.megatron_open import TORCH_DIST, check_format
from ..config import Recipe
from ..errors import QlmError
from ..models.spec import ModelSpec
from ..parallel.state import ParallelSizes, resolve_sizes
from .data import check_data_files
from .engine import validate_layout
from .sources import resolve_model
from .trainer import DTYPES, total_steps


@dataclass
class RunPlan:
    spec: ModelSpec
    sizes: ParallelSizes
    layout: ModelLayout
    steps: int
    model_description: str
    state_bytes: dict[str, float]  # per rank, heaviest pipeline stage: weights, grads, optimizer


def model_state_bytes(layout: ModelLayout, sizes: ParallelSizes, recipe: Recipe) -> dict[str, float]:
    """Exact tensor bytes of the heaviest stage's weights, fp32 gradients and AdamW state (fp32 master +
    2 moments) on one rank, after TP/PP sharding and ZeRO partitioning over data x context ranks."""
    dtype = DTYPES[recipe.model.dtype]
    zero, shards = recipe.parallel.zero_stage, sizes.dp * sizes.cp
    heaviest = 0
    for stage in range(layout.pp):
        numel = sum(
            torch.Size(t.shard_shape(layout.tp)).numel()
            for chunk in range(layout.vpp) for _, t in layout.shard_entries(stage, chunk) if t is not None
        )
        heaviest = max(heaviest, numel)
    weight_bytes = heaviest * (4 if zero == 3 else dtype.itemsize)
    # fp32 masters: the params themselves under ZeRO 3 and for fp32 ZeRO 0; copies (of the owned slice) otherwise
    master_bytes = 0 if zero == 3 or (dtype == torch.float32 and zero == 0) else 4 * heaviest
    return {
        "weights": weight_bytes / (shards if zero == 3 else 1),
        "grads": 4 * heaviest / (shards if zero >= 2 else 1),
        "optimizer": (8 * heaviest + master_bytes) / (shards if zero >= 1 else 1),
    }


def plan_run(recipe: Recipe, world: int, check_files: bool = True) -> RunPlan:
    """`check_files` False (a dry run on another machine): missing data is not an error, and a missing
    model.load falls back to model.spec for the numbers."""
    p, t = recipe.parallel, recipe.train
    if recipe.model.dtype not in DTYPES:
        raise QlmError(f"model.dtype {recipe.model.dtype!r} is not one of {', '.join(DTYPES)}", "set model.dtype")
    check_format(recipe.checkpoint.format)
    if recipe.checkpoint.format == TORCH_DIST and recipe.lora.rank > 0:
        raise QlmError("checkpoint.format torch_dist does not hold LoRA adapters",
                       "use checkpoint.format = \"torch\" for LoRA runs")
    sizes = resolve_sizes(world, p.tp, p.pp, p.cp, p.dp)
    model = recipe.model
    if check_files:
        check_data_files(recipe.data)
    elif model.load and not Path(model.load).exists():
        model = replace(model, load="")
    source = resolve_model(model)
    layout = ModelLayout(source.spec, p.tp, p.pp, p.vpp, p.num_layers_in_first_pipeline_stage,
                         p.num_layers_in_last_pipeline_stage)
    validate_layout(source.spec, p, sizes, recipe.data.seq_length, t.micro_batch_size, t.global_batch_size)
    return RunPlan(source.spec, sizes, layout, total_steps(recipe), source.description,
                   model_state_bytes(layout, sizes, recipe))
