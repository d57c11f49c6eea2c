"""Everything `qlm train` checks and resolves before any process starts: the recipe's layout for the world it will
run on, the model's numbers and the data files."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from qlm_core.config import Recipe
from qlm_core.errors import QlmError
from qlm_core.models.layout import ModelLayout
from qlm_core.models.spec import ModelSpec
from qlm_core.parallel.state import ParallelSizes, resolve_sizes
from qlm_core.train.data import check_data_files
from qlm_core.train.sources import resolve_model
from qlm_core.train.trainer import total_steps
from qlm_core.train.validate import validate_layout, validate_recipe


@dataclass
class RunPlan:
    spec: ModelSpec
    sizes: ParallelSizes
    layout: ModelLayout
    steps: int
    model_description: str


def world_size(recipe: Recipe, nproc_per_node: int | None, nnodes: int) -> tuple[int, int]:
    """(processes per node, world): --nproc-per-node, else the recipe's tp*pp*cp*dp spread over the nodes."""
    p = recipe.parallel
    wanted = p.tp * p.pp * p.cp * (p.dp or 1)
    if nproc_per_node is None and wanted % nnodes:
        raise QlmError(f"tp*pp*cp*dp = {wanted} processes do not spread evenly over {nnodes} nodes",
                       "pass --nproc-per-node, or change the layout or --nnodes")
    per_node = nproc_per_node or wanted // nnodes
    return per_node, per_node * nnodes


def plan_run(recipe: Recipe, world: int, check_files: bool = True) -> RunPlan:
    """`check_files` False (a dry run on another machine): missing data is not an error, and a missing
    model.load falls back to model.spec for the numbers."""
    p, t = recipe.parallel, recipe.train
    validate_recipe(recipe)  # before any file it names is opened: a recipe mistake is named as itself
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
