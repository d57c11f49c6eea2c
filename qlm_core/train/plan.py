"""Everything `qlm train` checks and resolves before any process starts: the recipe's layout for the world it will
run on, the model's numbers and the data files."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..checkpoint.layout import ModelLayout
from ..config import Recipe
from ..errors import QlmError
from ..models.spec import ModelSpec
from ..parallel.state import ParallelSizes, resolve_sizes
from .checks import check_recipe
from .data import check_data_files
from .engine import validate_layout
from .sources import resolve_model
from .trainer import total_steps


@dataclass
class RunPlan:
    spec: ModelSpec
    sizes: ParallelSizes
    layout: ModelLayout
    steps: int
    model_description: str


def planned_memory(recipe: Recipe, plan: RunPlan):
    """The profile's memory estimate of this run per rank (heaviest stage), against this machine's GPU or, without
    one, an 80 GiB device; and the device's description."""
    from ..profile.case import case_from_recipe
    from ..profile.hardware import GPUS
    from ..profile.memory import estimate_memory

    if torch.cuda.is_available():
        capacity = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / 2**30
        device = "this GPU"
    else:
        capacity, device = GPUS["a100-80g"].memory_gib, "an 80 GiB GPU (qlm profile RECIPE --gpu NAME for others)"
    case = case_from_recipe(recipe, plan.sizes.world, spec=plan.spec)
    return estimate_memory(case, capacity_gib=capacity), device


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
