"""Everything `qlm train` checks and resolves before any process starts: the recipe's layout for the world it will
run on, the model's numbers and the data files."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from qlm_core.checkpoint.sources.open import CHECKPOINTS_DIR
from qlm_core.config import ModelConfig, Recipe, compiles
from qlm_core.errors import QlmError
from qlm_core.models.layout import ModelLayout, recipe_layout
from qlm_core.models.spec import ModelSpec
from qlm_core.parallel.state import ParallelSizes, resolve_sizes
from qlm_core.train.checkpointing import describe_resume, resume_iteration
from qlm_core.train.data import check_cache_dir, check_data_files
from qlm_core.train.run_dir import RunLock, claim_run_dir
from qlm_core.train.sources import recipe_head, resolve_model
from qlm_core.train.validate import (
    validate_compile_cache,
    validate_layout,
    validate_moe,
    validate_preference_model,
    validate_recipe,
    validate_reward_model,
    validate_rl,
    validate_rl_model,
)


def total_steps(recipe: Recipe) -> int:
    """The optimizer steps a recipe asks for: train.train_iters, else train.train_samples in global batches."""
    train = recipe.train
    if train.train_iters > 0:
        return train.train_iters
    if train.train_samples > 0:
        return math.ceil(train.train_samples / train.global_batch_size)
    raise QlmError("neither train.train_iters nor train.train_samples is set", "set one of them")


@dataclass(frozen=True)
class RunStart:
    """How `qlm train` starts in its run directory, decided once from the command line and the recipe, and obeyed
    by the launcher and by every rank:
      resume   continue from the directory's checkpoint (checkpoint.resume, or --resume / --no-resume)
      force    start over: an earlier run is moved aside (RUN.replaced-TIME, nothing deleted) by whoever claims
      dry_run  plan and print: nothing is started and the directory is not claimed
    The directory is claimed (checked, created, locked: run_dir.claim_run_dir) by node 0's launcher, whose lock the
    workers it starts inherit, or, when no qlm launcher started the ranks (srun, a user's torchrun), by rank 0. The
    earlier run is moved aside once, by that claimer (for_ranks)."""

    run_dir: Path
    resume: bool
    force: bool = False
    dry_run: bool = False

    @classmethod
    def of(cls, recipe: Recipe, *, force: bool = False, dry_run: bool = False) -> RunStart:
        return cls(Path(recipe.train.output), recipe.checkpoint.resume, force, dry_run)

    def launcher_claims(self, node_rank: int) -> bool:
        """Whether this launcher claims the directory before it starts the workers: node 0's, unless a dry run."""
        return not self.dry_run and node_rank == 0

    def claim(self, notice: Callable[[str], None] | None = None) -> RunLock:
        """Check, create and lock the directory; with `force`, move an earlier run aside."""
        return claim_run_dir(self.run_dir, self.resume, self.force, *([notice] if notice else []))

    def for_ranks(self, launcher_claimed: bool) -> RunStart:
        """What the ranks obey: under a qlm launcher (which claimed the directory, or left it to node 0's) they move
        nothing aside again; ranks started otherwise claim it on rank 0, --force included."""
        return replace(self, force=self.force and not launcher_claimed)


@dataclass
class RunPlan:
    spec: ModelSpec
    sizes: ParallelSizes
    layout: ModelLayout
    steps: int
    model_description: str
    resume: str | None = None  # "resuming from iteration N (layout tp.. pp.. dp..)" when the run continues one
    warnings: list[str] = field(default_factory=list)  # one line each, shown before the run starts


def local_dp(parallel) -> int:
    """The data-parallel size a launch without --nproc-per-node starts when parallel.dp is left out: 1, or under
    expert parallelism the fewest data-parallel ranks whose pipeline stage (dp·cp·tp ranks) holds ep·etp ranks (EP
    is carved out of the data-parallel ranks, as in Megatron)."""
    if parallel.dp is not None:
        return parallel.dp
    experts = parallel.ep * (parallel.tp if parallel.etp is None else parallel.etp)
    return experts // math.gcd(experts, parallel.cp * parallel.tp)


def local_dp_note(recipe: Recipe, nproc_per_node: int | None) -> str | None:
    """The line that says which dp a launch picked for expert parallelism (None: nothing was picked)."""
    p = recipe.parallel
    dp = local_dp(p)
    if nproc_per_node is not None or p.dp is not None or dp == 1:
        return None
    etp = p.tp if p.etp is None else p.etp
    return (f"parallel.dp is not set: starting dp = {dp} data-parallel ranks, the fewest whose dp*cp*tp ranks hold "
            f"ep {p.ep} x etp {etp} (expert parallelism is carved out of the data-parallel ranks); set parallel.dp "
            "to choose")


def world_size(recipe: Recipe, nproc_per_node: int | None, nnodes: int) -> tuple[int, int]:
    """(processes per node, world): --nproc-per-node, else the recipe's tp*pp*cp*dp spread over the nodes (dp:
    local_dp when the recipe leaves it out)."""
    p = recipe.parallel
    wanted = p.tp * p.pp * p.cp * local_dp(p)
    if nproc_per_node is None and wanted % nnodes:
        raise QlmError(f"tp*pp*cp*dp = {wanted} processes do not spread evenly over {nnodes} nodes",
                       "pass --nproc-per-node, or change the layout or --nnodes")
    per_node = nproc_per_node or wanted // nnodes
    return per_node, per_node * nnodes


def run_warnings(recipe: Recipe, steps: int, spec: ModelSpec | None = None) -> list[str]:
    """Settings that are valid but probably not meant: one line each (not errors)."""
    found = []
    if spec is not None and recipe.data.seq_length > spec.max_position_embeddings:
        what = "the loaded model was never trained on positions past it" if recipe.model.load else \
            "an export's config.json will say the shorter context"
        found.append(f"warning: data.seq_length = {recipe.data.seq_length} is longer than the model's "
                     f"max_position_embeddings = {spec.max_position_embeddings}: {what} (RoPE extrapolates past "
                     "the trained context poorly; transformers' MPT cannot run past max_seq_len at all); lower "
                     "data.seq_length, or use a model whose context covers it")
    warmup = recipe.schedule.warmup_iters
    if warmup >= steps:
        found.append(f"warning: schedule.warmup_iters = {warmup} >= the run's {steps} steps: the learning rate "
                     f"never reaches optim.lr = {recipe.optim.lr:g}")
    if recipe.checkpoint.load_iteration is not None and not recipe.checkpoint.resume:
        found.append(f"warning: checkpoint.load_iteration = {recipe.checkpoint.load_iteration} is not used: "
                     "checkpoint.resume is off (pass --resume to continue from it)")
    return found


def plan_run(recipe: Recipe, world: int, check_files: bool = True, start_over: bool = False) -> RunPlan:
    """`check_files` False (a dry run on another machine): missing data is not an error, and a missing model.load
    is one only when the recipe names no model.spec (else a warning, and the spec's numbers, said as such).
    `start_over` (--force): the run directory's checkpoints are not resumed."""
    p, t = recipe.parallel, recipe.train
    validate_recipe(recipe)  # before any file it names is opened: a recipe mistake is named as itself
    sizes = resolve_sizes(world, p.tp, p.pp, p.cp, p.dp, p.ep, p.etp)
    model = recipe.model
    if check_files:
        check_data_files(recipe.data)
    warnings = []
    if model.load and not Path(model.load).exists():
        if check_files or model.spec == ModelConfig().spec:
            raise QlmError(f"model.load {model.load} does not exist",
                           "point it at an HF model, a Megatron checkpoint or a qlm run directory, or leave it empty "
                           "for a random init of model.spec")
        # a dry run on another machine (README: the 7B recipe's memory on a laptop): the numbers of the model.spec
        # the recipe names, said as such (not "random init")
        warnings.append(f"warning: model.load {model.load} does not exist here: this dry run takes the model's "
                        f"numbers from model.spec {model.spec} (a real run stops at this)")
        source = resolve_model(replace(model, load=""), recipe.moe, head=recipe_head(recipe))
        source = replace(source, description=f"{model.spec} from model.spec (model.load {model.load} not found)")
    else:
        source = resolve_model(model, recipe.moe, head=recipe_head(recipe))
    if recipe.data.kind == "preference":
        validate_preference_model(source.spec)
    if recipe.data.kind == "reward":
        validate_reward_model(source.spec)
    if recipe.data.kind == "rl":  # the prompts per data-parallel rank, and every reward function imported
        from qlm_core.train.rollout_batches import recipe_rewards

        validate_rl(recipe, sizes.dp)
        validate_rl_model(source.spec, recipe.rl.temperature)
        recipe_rewards(recipe)
    layout = recipe_layout(source.spec, p)
    validate_layout(source.spec, p, sizes, recipe.data.seq_length, t.micro_batch_size, t.global_batch_size)
    validate_moe(source.spec, recipe.moe, p, recipe.lora.rank)  # as every rank's Engine will, before they start
    source.spec.check_positions(recipe.data.seq_length)
    steps = total_steps(recipe)
    if compiles(recipe.train, steps, recipe.data.kind == "rl"):
        validate_compile_cache()
    check_cache_dir(recipe.data.cache_dir, Path(t.output))
    resume = None
    if recipe.checkpoint.resume and not start_over:
        root = Path(t.output) / CHECKPOINTS_DIR
        iteration = resume_iteration(root, recipe.checkpoint.load_iteration)
        if iteration is not None:
            resume = describe_resume(root, iteration)
    return RunPlan(source.spec, sizes, layout, steps, source.description, resume,
                   warnings + run_warnings(recipe, steps, source.spec))
