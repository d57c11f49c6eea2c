"""The training loop of `qlm train`: one process per rank (launched by torchrun), from recipe to checkpoints.

RUN/config.toml   the resolved recipe
RUN/metrics.jsonl one object per step (keys: metrics.StepMetrics)
RUN/eval.jsonl    validation losses
RUN/checkpoints/  Megatron-layout checkpoints (checkpointing.py)
RUN/loss.png      the loss curve, RUN/summary.json the final figures (totals of this invocation over its wall time)
RUN/wandb/        Weights & Biases files when logging.wandb_project is set (wandb_log.py)

SIGTERM / SIGINT (train.exit_signal_handler) and train.exit_duration_minutes stop the run at a step boundary every
rank agrees on, with a checkpoint (signals.py); `summary["stopped"]` then says why, where and with which exit code.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from qlm_core.checkpoint.formats.hf.checkpoint import copy_side_files
from qlm_core.checkpoint.formats.megatron.legacy import HF_SIDE_DIR, iteration_dir_name
from qlm_core.checkpoint.formats.megatron.lora_args import lora_args
from qlm_core.checkpoint.sources.open import CHECKPOINTS_DIR, run_checkpoint_dir
from qlm_core.config import (
    Recipe,
    compile_text,
    compiles,
    recipe_to_toml,
    rows_per_sample,
)
from qlm_core.disk import write_text_atomic
from qlm_core.dtypes import DTYPES
from qlm_core.errors import QlmError
from qlm_core.hardware import GPUS, configure_cuda_allocator, empty_device_cache, local_gpu, measure_cpu_peak_tflops
from qlm_core.models.flops import flops_per_sequence
from qlm_core.models.parameters import num_parameters
from qlm_core.parallel.state import Grid, default_device, destroy_distributed, init_distributed, resolve_sizes
from qlm_core.train.async_checkpoint import CheckpointSaver
from qlm_core.train.batches import BatchSource, DatasetBatches
from qlm_core.train.checkpointing import (
    TrainState,
    has_checkpoint,
    load_checkpoint,
    resume_iteration,
)
from qlm_core.train.data import build_run_data, check_cache_dir
from qlm_core.train.engine import Engine
from qlm_core.train.load_pin import pinned_error, pinned_iteration, record_pin
from qlm_core.train.metrics import MetricsWriter, StepMetrics, device_memory_gb, peak_memory_gb, plot_loss, strict_json
from qlm_core.train.objectives.recipe import recipe_objective
from qlm_core.train.plan import RunStart, total_steps
from qlm_core.train.run_dir import os_error
from qlm_core.train.schedule import learning_rate
from qlm_core.train.signals import StopControl, StopReason
from qlm_core.train.sources import recipe_head, resolve_model
from qlm_core.train.validate import validate_compile_cache, validate_recipe, validate_rl
from qlm_core.train.wandb_log import WandbLogger, check_wandb


@dataclass
class Event:
    kind: str  # start | step | eval | checkpoint | end
    data: dict


def cpp_compiler() -> str | None:
    """The C++ compiler torch inductor would build CPU kernels with ($CXX, else g++, c++, clang++), or None."""
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and (found := shutil.which(name)):
            return found
    return None


def peak_tflops(recipe: Recipe) -> tuple[float, str]:
    if recipe.logging.peak_tflops > 0:
        return recipe.logging.peak_tflops, "recipe"
    if (gpu := local_gpu()) is not None:
        return gpu.peak_tflops, f"{gpu.name} bf16 peak"
    if torch.cuda.is_available():
        return GPUS["a100-80g"].peak_tflops, f"unknown GPU {torch.cuda.get_device_name()}: A100 bf16 peak assumed"
    return measure_cpu_peak_tflops(), "measured CPU fp32 matmul"


def write_hf_side_dir(root: Path, spec, tokenizer_dir: Path | None):
    """config.json and tokenizer files beside the checkpoints, so `qlm convert mcore2hf` exports a complete model.
    Every start and resume rewrites them: each file is made in a temporary sibling directory and renamed over its
    old copy, so a crash never leaves a truncated hf/config.json (every checkpoint of the run reads it)."""
    from qlm_core.checkpoint.formats.hf.tokens import add_special_tokens  # eos ids + generation_config.json

    side = root / HF_SIDE_DIR
    staging = root / f".{HF_SIDE_DIR}.tmp-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        staging.mkdir(parents=True)
        if side.is_dir():
            copy_side_files(side, staging)
        if tokenizer_dir is not None:
            copy_side_files(Path(tokenizer_dir), staging)
        try:
            config = add_special_tokens(staging, spec.to_hf_config())
        except QlmError:  # transformers has no such model (a sigmoid router): the checkpoints' args describe it
            config = None
            (staging / "config.json").unlink(missing_ok=True)
        if config is not None:
            (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        side.mkdir(exist_ok=True)
        for item in staging.iterdir():
            os.replace(item, side / item.name)
        if config is None:  # one written by an earlier start would describe another model
            (side / "config.json").unlink(missing_ok=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def stop_line(reason: StopReason, step: int, checkpoint: Path | None, new: bool = True) -> str:
    """The one line a stopped run ends with."""
    when = f"at step {step}" if new else f"before step {step + 1}"
    if checkpoint is None:
        return f"{reason.describe()} {when}; no checkpoint yet; re-running the same command starts the run afresh"
    where = f"checkpoint saved to {checkpoint}" if new else f"the checkpoint {checkpoint} is intact"
    return (f"{reason.describe()} {when}; {where}; resume by re-running the same command with --resume "
            "(and without --force)")


class Trainer:
    def __init__(self, recipe: Recipe, run_dir: Path, on_event: Callable[[Event], None] | None = None,
                 start: RunStart | None = None):
        """`start`: how the run starts in its directory (plan.RunStart: resume, --force; rank 0 claims the
        directory, or holds the lock qlm's launcher passed on); default the recipe's checkpoint.resume."""
        self.recipe, self.run_dir = recipe, Path(run_dir)
        self.start = start or RunStart(self.run_dir, recipe.checkpoint.resume)
        self.on_event = on_event or (lambda event: None)
        self.saver: CheckpointSaver | None = None  # made at the first save
        self.eval_figures: dict[str, float] | None = None  # preference runs: the last evaluation's metrics

    def _emit(self, kind: str, **data):
        if self.grid.rank == 0:
            self.on_event(Event(kind, data))

    def _setup(self):
        r = self.recipe
        validate_recipe(r)
        check_wandb(r.logging, self.run_dir)
        configure_cuda_allocator()  # before this rank's first CUDA allocation
        rank, world = init_distributed()
        sizes = resolve_sizes(world, r.parallel.tp, r.parallel.pp, r.parallel.cp, r.parallel.dp, r.parallel.ep,
                              r.parallel.etp)
        self.grid = Grid.build(sizes)
        if r.data.kind == "rl":  # a worker started by srun / torchrun never passed the launcher's check
            validate_rl(r, sizes.dp)
        torch.manual_seed(r.train.seed)
        self.steps = total_steps(r)
        claim_error = None
        if self.grid.rank == 0:
            try:
                self.start.claim()  # the launcher's lock, or this run's
                write_text_atomic(self.run_dir / "config.toml", recipe_to_toml(r))
            except QlmError as exc:
                claim_error = exc
            except OSError as exc:  # config.toml on a full disk: every rank must hear of it, not wait for rank 0
                claim_error = os_error(self.run_dir, exc)
        if dist.is_initialized() and dist.get_world_size() > 1:  # all ranks stop, not only rank 0 (srun, torchrun)
            shared = [claim_error.line() if claim_error is not None else None]
            dist.broadcast_object_list(shared, src=0)
            if shared[0] is not None and claim_error is None:
                raise SystemExit(2)  # rank 0 prints the line
        if claim_error is not None:
            raise claim_error
        self.ckpt_root = self.run_dir / CHECKPOINTS_DIR
        start = resume_iteration(self.ckpt_root, r.checkpoint.load_iteration) if self.start.resume else None
        source = self._resolve_source(resuming=start is not None)
        cache = Path(r.data.cache_dir) if r.data.cache_dir else self.run_dir / "cache"
        check_cache_dir(r.data.cache_dir, self.run_dir)
        valid_samples = r.train.eval_iters * r.train.global_batch_size
        # rank 0 builds (tokenises, caches) first; the others then read the caches
        for turn in ("first", "rest"):
            if (self.grid.rank == 0) == (turn == "first"):
                self.data = build_run_data(r.data, source.tokenizer_dir, cache,
                                           self.steps * r.train.global_batch_size, valid_samples, r.preference,
                                           r.rl, r.reward)
            if dist.is_initialized():
                dist.barrier()
        rows = rows_per_sample(r)
        self.engine = Engine(
            source.spec, r.parallel, self.grid, micro_batch_size=r.train.micro_batch_size * rows,
            global_batch_size=r.train.global_batch_size * rows, seq_length=r.data.seq_length,
            dtype=DTYPES[r.model.dtype], optim=r.optim, source=source.weights, seed=r.train.seed,
            lora=r.lora if r.lora.rank > 0 else None, loss_chunk_tokens=r.train.loss_chunk_tokens, moe=r.moe,
            compile=self._compile_decision(), objective=recipe_objective(r),
            mtp_loss_scaling_factor=r.train.mtp_loss_scaling_factor,
        )
        self.source = source
        self.reference_tables = {}
        if getattr(self.engine.objective, "reference", None) == "precomputed":  # the starting weights: first
            from qlm_core.train.objectives.reference_table import load_or_compute, table_path

            self.reference_tables = load_or_compute(
                self.engine, table_path(r, cache / "datasets", source),
                {"train": self.data.train, "valid": self.data.valid},
                r.train.global_batch_size, r.train.micro_batch_size, self.grid.rank == 0)
        self.batch_source: BatchSource = DatasetBatches(r, self.grid, self.data, self.reference_tables)
        if r.data.kind == "rl":  # the policy's own rollouts, not a dataset's rows
            from qlm_core.train.rollout_batches import RolloutBatches

            self.batch_source = RolloutBatches(r, self.engine, self.data.train, self.data.valid,
                                               self.data.tokenizer_dir, self.run_dir)
        if self.grid.rank == 0:
            write_hf_side_dir(self.ckpt_root, source.spec, self.data.tokenizer_dir)
        self.state = TrainState()
        self.resumed = None  # "resuming from iteration N (layout ...)" for the run header
        if start is not None:
            self.state, self.resumed = load_checkpoint(self.ckpt_root, self.engine, start)
        self.metrics = (MetricsWriter(self.run_dir, r.logging.tensorboard, resumed_from=self.state.iteration)
                        if self.grid.rank == 0 else None)
        # a sample's work: one sequence, or a preference pair's two (the reference forward is not counted)
        self.flops = flops_per_sequence(source.spec, r.data.seq_length, r.data.mean_doc_len,
                                        mtp=self.engine.mtp_depths > 0) * rows_per_sample(r)
        self.sample_tokens = r.data.seq_length * rows_per_sample(r)
        self.peak, self.peak_source = peak_tflops(r)
        self.wandb = (WandbLogger(r.logging, self.run_dir, asdict(r))
                      if self.grid.rank == 0 and r.logging.wandb_project else None)

    def _resolve_source(self, resuming: bool):
        """model.load as this run started from it: a resume reads the iteration recorded at the first start
        (load_pin.py), a fresh start reads the latest and rank 0 records which one that was."""
        r = self.recipe
        pinned = pinned_iteration(self.run_dir, r.model.load) if r.model.load and resuming else None
        try:
            source = resolve_model(r.model, r.moe, iteration=pinned, head=recipe_head(r), seed=r.train.seed)
        except QlmError as exc:
            if pinned is None:
                raise
            raise pinned_error(self.run_dir, r.model.load, pinned, exc) from None
        if self.grid.rank == 0 and r.model.load and pinned is None:
            record_pin(self.run_dir, r.model.load, source.iteration)
        return source

    def _compile_decision(self) -> bool:
        """train.compile, or its default by the run's length; on a CPU inductor needs a C++ compiler: without one
        the default is off (said in the run header) and an explicit true is a one-line error."""
        r = self.recipe
        rl = r.data.kind == "rl"
        decided = compiles(r.train, self.steps, rl)
        self.compile_text = compile_text(r.train, self.steps, rl)
        if decided:
            validate_compile_cache()
        if decided and self.grid.device.type == "cpu" and cpp_compiler() is None:
            if r.train.compile:
                raise QlmError("train.compile = true on a CPU needs a C++ compiler (torch inductor's), and none was "
                               "found", "install g++ (or set CXX), or set train.compile = false")
            self.compile_text = "off (no C++ compiler for torch inductor on this CPU: install g++ or set CXX)"
            return False
        return decided

    def _lr(self, step: int) -> float:
        o, s = self.recipe.optim, self.recipe.schedule
        return learning_rate(step, self.steps, lr=o.lr, min_lr=s.min_lr, warmup=s.warmup_iters,
                             schedule=s.lr_schedule, wsd_decay_fraction=s.wsd_decay_fraction)

    def evaluate(self) -> float | None:
        """The mean validation loss over eval_iters batches (preference runs: also their metrics, in
        self.eval_figures). RL runs have no validation loss: their held-out prompts' rewards are the figures."""
        self.eval_figures = None
        if self.data.valid is None:
            return None
        if self.recipe.data.kind == "rl":
            self.eval_figures = self.batch_source.evaluate(self.state.iteration)
            return None
        losses, figures = [], []
        batches = self.batch_source.batches("valid", 0)
        for _ in range(max(1, min(self.recipe.train.eval_iters,
                                  len(self.data.valid) // self.recipe.train.global_batch_size or 1))):
            losses.append(self.engine.evaluate(next(batches)))
            figures.append(self.engine.objective.figures())
        if figures[0] is not None:
            self.eval_figures = {key: sum(f[key] for f in figures) / len(figures) for key in figures[0]}
        return sum(losses) / len(losses)

    def _save(self):
        extra = {"qlm_recipe": recipe_to_toml(self.recipe)}
        if self.recipe.lora.rank > 0:
            base = Path(self.recipe.model.load).resolve()
            extra.update(lora_args(self.recipe.lora, str(run_checkpoint_dir(base) or base)))
        if self.saver is None:  # checkpoint.async_save: written in the background (waited for at the end)
            self.saver = CheckpointSaver(self.recipe.checkpoint.async_save)
        self.saver.save(self.ckpt_root, self.engine, self.state, self.recipe.checkpoint.keep_last, extra,
                        self.recipe.checkpoint.format)
        self._emit("checkpoint", step=self.state.iteration)

    def run(self) -> dict:
        r = self.recipe
        self.wandb = None
        with StopControl(r.train.exit_signal_handler, r.train.exit_duration_minutes) as self.stop:
            try:
                summary = self._run_dir_faults_named()
            except BaseException:
                if self.wandb is not None:
                    self.wandb.finish(exit_code=1)
                raise
            if self.wandb is not None:
                self.wandb.finish(exit_code=summary.get("stopped", {}).get("exit_code", 0))
        return summary

    def _run_dir_faults_named(self) -> dict:
        """_run, with a write fault inside the run directory (disk full, permissions) as one line naming the file."""
        try:
            return self._run()
        except OSError as exc:
            where = Path(os.fsdecode(exc.filename)).resolve() if exc.filename else None
            if where is not None and self.run_dir.resolve() in (where, *where.parents):
                raise os_error(where, exc) from None
            raise

    def _raise_peak(self, tflops: float, step: int):
        """A step ran faster than the peak: the peak was wrong (a CPU probe under load, a FLOPs count above the
        work done); MFU stays <= 1 by taking the fastest step as the peak from here on, and says so."""
        given = getattr(self, "_peak_given", None) or (self.peak, self.peak_source)
        self._peak_given = given
        self.peak_source = f"{given[1]}; raised from {given[0]:.3g}: step {step} ran at {tflops:.3g} TFLOP/s"
        self.peak = tflops

    def _run(self) -> dict:
        self._setup()
        r, g = self.recipe, self.grid
        self.stop.is_rank0 = g.rank == 0
        device = default_device()
        self._emit("start", layout=g.describe(), model=self.source.description, steps=self.steps,
                   start_step=self.state.iteration, params=num_parameters(self.source.spec),
                   active_params=num_parameters(self.source.spec, active=True), resumed=self.resumed,
                   train_samples=len(self.data.train), peak_tflops=self.peak, peak_source=self.peak_source,
                   truncated=self.data.truncated, compile=self.compile_text)
        batches = self.batch_source.batches("train", self.state.consumed_samples)
        world = g.sizes.world
        self._last_eval = (-1, None)
        last_saved = self.state.iteration if has_checkpoint(self.ckpt_root) else -1
        # this invocation's totals, over the loop's wall time (evaluations and checkpoints included)
        self._totals = {"steps": 0, "samples": 0, "tokens": 0, "label_tokens": 0}
        # a signal during the setup stops the run before its first step
        stopped = self.stop.poll(device, clock=False) if self.state.iteration < self.steps else None
        if stopped is None and r.data.kind == "rl" and self.state.iteration == 0 and r.train.eval_interval:
            self._log_eval()  # the starting policy's held-out reward, which the run's are compared with
        loop_started = time.perf_counter()
        while stopped is None and self.state.iteration < self.steps:
            step = self.state.iteration
            lr = self._lr(step)
            started = time.perf_counter()
            result = self.engine.train_step(next(batches), lr)
            seconds = time.perf_counter() - started
            self.state.consumed_samples = self.batch_source.consumed_after_step(self.state.consumed_samples)
            self.state.iteration += 1
            self.state.skipped_in_row = self.state.skipped_in_row + 1 if result.skipped else 0
            self.state.skipped_total += int(result.skipped)
            tflops = self.flops * r.train.global_batch_size / seconds / world / 1e12
            if tflops > self.peak:
                self._raise_peak(tflops, self.state.iteration)
            for key, value in (("steps", 1), ("samples", r.train.global_batch_size),
                               ("tokens", r.train.global_batch_size * self.sample_tokens),
                               ("label_tokens", result.tokens)):
                self._totals[key] += value
            metrics = StepMetrics(
                step=self.state.iteration, loss=result.loss, grad_norm=result.grad_norm, lr=lr,
                label_tokens=result.tokens, samples=self.state.consumed_samples, step_time_s=seconds,
                s_per_sample=seconds / r.train.global_batch_size,
                tokens_per_s=r.train.global_batch_size * self.sample_tokens / seconds,
                tflops_per_device=tflops, mfu=tflops / self.peak, mem_peak_gb=peak_memory_gb(),
                skipped=result.skipped, moe=result.moe, figures=self._figures(result),
                **device_memory_gb(),
            )
            if self.metrics is not None:
                self.metrics.log_step(metrics)
            if r.train.empty_cache_interval and self.state.iteration % r.train.empty_cache_interval == 0:
                empty_device_cache(device)
            if self.wandb is not None:
                self.wandb.log_step(metrics)
            self._emit("step", metrics=metrics, total=self.steps)
            if self.engine.compiled and self._totals["steps"] == 1:
                first_step_s = seconds  # the first step compiled the layers: its cost, once the second is timed
            elif self.engine.compiled and self._totals["steps"] == 2:
                self._emit("compile", seconds=first_step_s - seconds)
            if self.state.skipped_in_row >= r.train.max_skipped_steps:
                moe_terms = [k for k, v in (result.moe or {}).items()
                             if k in ("moe_aux_loss", "moe_z_loss") and not math.isfinite(v)]
                if moe_terms:  # the router's losses overflowed: their coefficients, not the data or the lr
                    raise QlmError(f"{self.state.skipped_in_row} steps in a row had a non-finite "
                                   f"{' and '.join(moe_terms)} (moe.aux_loss_coeff {r.moe.aux_loss_coeff:g}, "
                                   f"moe.z_loss_coeff {r.moe.z_loss_coeff:g})",
                                   "lower those coefficients (Megatron uses about 1e-3); the last checkpoint is intact")
                raise QlmError(f"{self.state.skipped_in_row} steps in a row had a non-finite loss or gradient",
                               "lower optim.lr or check the data; the last checkpoint is intact")
            if r.train.eval_interval and self.state.iteration % r.train.eval_interval == 0:
                self._log_eval()
            if r.checkpoint.save_interval and self.state.iteration % r.checkpoint.save_interval == 0:
                self._save()
                last_saved = self.state.iteration
            # after this step's eval and save, as an uninterrupted run does them (its RNG state included)
            if self.state.iteration < self.steps and (stopped := self.stop.poll(device)) is not None:
                break  # every rank stops here, after the same step
            if r.train.exit_interval and self.state.iteration % r.train.exit_interval == 0 \
                    and self.state.iteration < self.steps:
                break
        self._totals["wall_s"] = time.perf_counter() - loop_started
        if stopped is None and self._totals["steps"] == 0 and self.state.iteration == self.steps:
            earlier = self._finished_summary()
            if earlier is not None:  # a finished run re-run: nothing to add, and its record stays as it was
                self._emit("end", summary=earlier)
                destroy_distributed()
                return earlier
        final_valid = None
        if stopped is None and self.state.iteration == self.steps:
            final_valid = self._last_eval[1] if self._last_eval[0] == self.state.iteration else self._log_eval()
        if last_saved != self.state.iteration and (stopped is None or self._totals["steps"]):
            self._save()
            last_saved = self.state.iteration
        if self.saver is not None:
            self.saver.close()  # the pending background write in place (its failure raised) before the end
        summary = self._summary(final_valid)
        if self.eval_figures and final_valid is not None:
            summary["valid_preference"] = self.eval_figures  # the last evaluation's metrics (TRL's names)
        if self.eval_figures and r.data.kind == "rl" and self._last_eval[0] == self.state.iteration:
            summary["valid_reward"] = self.eval_figures["reward"]  # the held-out prompts' mean reward
        if stopped is not None:
            summary["stopped"] = self._stopped(stopped, last_saved)
        if self.metrics is not None:
            self.metrics.close()
            write_text_atomic(self.run_dir / "summary.json", strict_json(summary, indent=2) + "\n")
            if r.logging.plot:
                summary["plot"] = str(plot_loss(self.run_dir))
        self._emit("end", summary=summary)
        destroy_distributed()
        return summary

    def _figures(self, result) -> dict[str, float] | None:
        """The step's figures beside the loss: the objective's, and an RL step's rollout metrics first."""
        if not self.batch_source.metrics and not result.figures:
            return None
        return {**self.batch_source.metrics, **(result.figures or {})}

    def _finished_summary(self) -> dict | None:
        """RUN/summary.json of a run that already reached its last step (None: missing, unreadable or earlier)."""
        try:
            summary = json.loads((self.run_dir / "summary.json").read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(summary, dict) or summary.get("steps") != self.steps or "stopped" in summary:
            return None
        return {**summary, "finished_earlier": True}

    def _log_eval(self) -> float | None:
        loss = self.evaluate()
        self._last_eval = (self.state.iteration, loss)
        if loss is not None or self.eval_figures:
            if self.metrics is not None:
                self.metrics.log_eval(self.state.iteration, loss, self.eval_figures)
            if self.wandb is not None:
                self.wandb.log_eval(self.state.iteration, loss, self.eval_figures)
            self._emit("eval", step=self.state.iteration, loss=loss, figures=self.eval_figures)
        return loss

    def _stopped(self, reason: StopReason, last_saved: int) -> dict:
        step = self.state.iteration
        saved = self.ckpt_root / iteration_dir_name(last_saved) if last_saved > 0 else None
        return {"reason": reason.name, "signal": reason.signum or None, "step": step,
                "checkpoint": str(saved) if saved is not None else None,
                "checkpoint_is_new": bool(self._totals["steps"]) and last_saved == step,
                "exit_code": reason.exit_code, "line": stop_line(reason, step, saved,
                                                                  new=bool(self._totals["steps"]))}

    def _summary(self, final_valid: float | None) -> dict:
        """The figures of this invocation: totals over its training loop's wall time (not a mean of per-step
        rates, which hides evaluations, checkpoints and slow steps)."""
        from qlm_core.train.metrics import read_jsonl

        rows = read_jsonl(self.run_dir / "metrics.jsonl") if self.metrics is not None else []
        totals, world = self._totals, self.grid.sizes.world
        wall, samples = totals.get("wall_s", 0.0), totals["samples"]
        nan = float("nan")
        tflops = self.flops * samples / wall / world / 1e12 if wall > 0 and samples else nan
        return {
            "steps": self.state.iteration, "first_loss": rows[0]["loss"] if rows else None,
            "last_loss": rows[-1]["loss"] if rows else None, "valid_loss": final_valid,
            "steps_run": totals["steps"], "train_wall_s": wall, "tokens": totals["tokens"],
            "label_tokens": totals["label_tokens"],
            "s_per_sample": wall / samples if samples else nan,
            "tokens_per_s": totals["tokens"] / wall if wall > 0 and samples else nan,
            "tflops_per_device": tflops, "mfu": tflops / self.peak if math.isfinite(tflops) else nan,
            "peak_tflops": self.peak, "peak_source": self.peak_source,
            "mem_peak_gb": max((r["mem_peak_gb"] for r in rows if r.get("mem_peak_gb") is not None),
                               default=nan),
            "skipped_steps": self.state.skipped_total, "layout": self.grid.describe(),
            "run_dir": str(self.run_dir),
        }
