"""Everything `qlm train` checks and resolves before any process starts: the recipe's layout for the world it will
run on, the model's numbers and the data files."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from ..checkpoint.layout import ModelLayout
from ..config import Recipe
from ..models.spec import ModelSpec
from ..parallel.state import ParallelSizes, resolve_sizes
from .data import check_data_files
from .engine import validate_layout
from .sources import resolve_model
from .checks import check_recipe
from .trainer import total_steps


@dataclass
class RunPlan:
    spec: ModelSpec
    sizes: ParallelSizes
    layout: ModelLayout
    steps: int
    model_description: str


def plan_run(recipe: Recipe, world: int, check_files: bool = True) -> RunPlan:
    """`check_files` False (a dry run on another machine): missing data is not an error, and a missing
    model.load falls back to model.spec for the numbers."""
    p, t = recipe.parallel, recipe.train
    check_recipe(recipe)
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
    return RunPlan(source.spec, sizes, layout, total_steps(recipe), source.description)
