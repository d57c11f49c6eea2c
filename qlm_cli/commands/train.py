"""`qlm train RECIPE.toml`: check the recipe, start the ranks (torchrun) and show the run."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from qlm_cli.launch import LaunchConfig, relaunch_if_needed, under_launcher
from qlm_cli.render import PlainProgress, console, err_console, kv_table, memory_table
from qlm_core.config import compile_text, load_recipe, recipe_to_toml
from qlm_core.models.spec import parameters_text


def _argv_for_workers(recipe: Path, sets: list[str], output: str, resume: bool | None = None) -> list[str]:
    """The workers' command line (no --force: the launcher has moved the old run aside already)."""
    argv = ["train", str(recipe), "--output", output]
    for text in sets:
        argv += ["--set", text]
    if resume is not None:
        argv.append("--resume" if resume else "--no-resume")
    return argv


def _notice(text: str):
    err_console.print(text, markup=False, highlight=False, soft_wrap=True)


def pair_figures(figures: dict[str, float]) -> tuple[float, float] | None:
    """A preference or reward-model step's (accuracy, margin); None for other objectives."""
    if "rewards/accuracies" in figures:
        return figures["rewards/accuracies"], figures["rewards/margins"]
    if "accuracy" in figures:  # a reward model
        return figures["accuracy"], figures["margin"]
    return None


def objective_figures(figures: dict[str, float] | None) -> str:
    """The step line's figures beside the loss: a preference or reward-model step's accuracy and margin, an RL
    step's reward, KL, clipped share, completion length and train/rollout log-prob difference, a multi-token
    prediction model's MTP loss."""
    if not figures:
        return ""
    if pair := pair_figures(figures):
        return f" acc {pair[0]:.2f} margin {pair[1]:.3f}"
    if "reward" not in figures:
        return f" mtp {figures['mtp_loss']:.3f}" if "mtp_loss" in figures else ""
    text = f" reward {figures['reward']:.3f}"
    if "kl" in figures:
        text += f" kl {figures['kl']:.4f}"
    if "clip_ratio/region_mean" in figures:
        text += f" clip {figures['clip_ratio/region_mean']:.3f}"
    text += f" len {figures['completions/mean_length']:.1f}"
    if "train_rollout_logprob_abs_diff/max" in figures:
        text += f" |Δlogp| {figures['train_rollout_logprob_abs_diff/max']:.1e}"
    return text


class RunView:
    """Renders the rank-0 events of a run: a progress bar with the step figures, eval and checkpoint lines."""

    def __init__(self):
        self.progress = None
        self.task = None
        self.plain: PlainProgress | None = None  # without a terminal: plain step lines now and then

    def __call__(self, event):
        render = getattr(self, f"_on_{event.kind}", None)
        if render is not None:  # an event this view does not show
            render(event.data)

    def _on_start(self, data):
        console.print(kv_table("run", {
            "layout": data["layout"], "model": data.get("resumed") or data["model"],
            # a resumed run's weights are its checkpoint's; model.load still gives a reference, LoRA's base
            **({"started from": data["model"]} if data.get("resumed") and not data["model"].startswith(
                "random init") else {}),
            "parameters": parameters_text(data["params"], data.get("active_params")),
            "train samples": data["train_samples"], "steps": f"{data['start_step']} -> {data['steps']}",
            **({"compile": data["compile"]} if data.get("compile") else {}),
            "peak for MFU": f"{data['peak_tflops']:.3g} TFLOP/s ({data['peak_source']})",
        }))
        if data.get("truncated"):
            console.print(f"{data['truncated']} preference records were truncated to fit (preference."
                          "max_length / max_prompt_length / data.seq_length)", markup=False, highlight=False)
        self.total, self.started = data["steps"], time.monotonic()
        if not console.is_terminal:  # nohup, Slurm, | tee: a rich bar would show nothing until the end
            self.plain = PlainProgress(lambda line: console.print(line, markup=False, highlight=False,
                                                                  soft_wrap=True), first=True)
            return
        self.progress = Progress(
            TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[figures]}"),
            TimeRemainingColumn(), console=console, transient=False,
        )
        self.progress.start()
        self.task = self.progress.add_task("train", total=data["steps"], completed=data["start_step"], figures="")

    def _on_step(self, data):
        m = data["metrics"]
        figures = (f"loss {m.loss:.4f} lr {m.lr:.2e} {m.tokens_per_s:,.0f} tok/s {m.s_per_sample:.3f} s/sample "
                   f"{m.tflops_per_device:.3g} TFLOP/s MFU {m.mfu:.3f} mem {m.mem_peak_gb:.2f} GB"
                   + objective_figures(m.figures))
        if self.plain is not None:
            elapsed = time.monotonic() - self.started
            self.plain(f"step {m.step}/{self.total} {figures}{' skipped' if m.skipped else ''} "
                       f"({elapsed:.0f} s elapsed)", m.step, self.total)
            return
        self.progress.update(self.task, completed=m.step, figures=figures + (" [red]skipped[/]" if m.skipped else ""))

    def _on_eval(self, data):
        figures = data.get("figures")
        if data["loss"] is None:  # an RL run: its held-out prompts' rewards
            console.print(f"step {data['step']}: held-out reward {figures['reward']:.3f} (mean completion "
                          f"{figures['completions/mean_length']:.1f} tokens)")
            return
        pair = pair_figures(figures) if figures else None
        extra = f", accuracy {pair[0]:.3f}, margin {pair[1]:.3f}" if pair else ""
        console.print(f"step {data['step']}: validation loss {data['loss']:.4f}{extra}")

    def _on_checkpoint(self, data):
        console.print(f"step {data['step']}: checkpoint saved")

    def _on_compile(self, data):
        console.print(f"compiled the decoder layers in the first step: {data['seconds']:.1f} s")

    def _on_end(self, data):
        if self.progress is not None:
            self.progress.stop()
        summary = data["summary"]
        table = Table(title="summary", title_justify="left", show_header=False)
        for key in ("steps", "first_loss", "last_loss", "valid_loss", "valid_reward", "s_per_sample", "tokens_per_s",
                    "tflops_per_device", "mfu", "mem_peak_gb", "skipped_steps", "run_dir", "plot"):
            if key in summary and summary[key] is not None:
                value = summary[key]
                table.add_row(key, f"{value:.4g}" if isinstance(value, float) else escape(str(value)))
        console.print(table)
        if summary.get("finished_earlier"):
            console.print(f"the run had already finished at step {summary['steps']}: nothing was trained, "
                          "its logs and summary.json are as they were", markup=False, highlight=False)
        if "stopped" in summary:  # a signal or train.exit_duration_minutes: where to resume from
            err_console.print(escape(summary["stopped"]["line"]), highlight=False, soft_wrap=True)


def train(
    recipe: Annotated[Path, typer.Argument(help="The recipe (TOML): [model] [parallel] [data] [train] [optim] "
                                                "[schedule] [checkpoint] [logging] [lora].")],
    set_: Annotated[list[str] | None, typer.Option(
        "--set", help="Override one recipe value: section.key=value (repeatable), e.g. --set parallel.tp=2.")] = None,
    output: Annotated[str | None, typer.Option(
        "--output", help="The run directory (metrics.jsonl, checkpoints/, config.toml); default train.output.")] = None,
    nproc_per_node: Annotated[int | None, typer.Option(
        "--nproc-per-node", min=1, help="Processes on this node (default: tp*pp*cp*dp, or all of them on one "
        "node).")] = None,
    nnodes: Annotated[int, typer.Option("--nnodes", min=1, help="Number of nodes.")] = 1,
    node_rank: Annotated[int, typer.Option("--node-rank", min=0, help="This node's index.")] = 0,
    master_addr: Annotated[str | None, typer.Option("--master-addr", help="Address of node 0.")] = None,
    master_port: Annotated[int, typer.Option("--master-port", help="Rendezvous port on node 0.")] = 29500,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the resolved recipe, the layout and the "
                                          "model-state memory per rank, then exit.")] = False,
    resume: Annotated[bool | None, typer.Option(
        "--resume/--no-resume", help="Continue from the run directory's checkpoint (checkpoint.load_iteration, "
        "else the latest), or start from step 0; overrides checkpoint.resume.")] = None,
    force: Annotated[bool, typer.Option(
        "--force", help="Start over in a run directory that holds an earlier run: its files are moved to "
        "OUTPUT.replaced-TIME (nothing is deleted) before the new run writes anything.")] = False,
):
    """Pretrain, fine-tune (SFT) or LoRA-tune a model. Starts torchrun itself unless already under torchrun/srun."""
    from qlm_core.train.plan import RunStart

    sets = list(set_ or [])
    resolved = load_recipe(recipe, sets)
    if output:
        resolved.train.output = output
    if resume is not None:
        resolved.checkpoint.resume = resume
    start = RunStart.of(resolved, force=force, dry_run=dry_run)
    if under_launcher() and not start.dry_run:  # a rank (srun, a user's torchrun, or qlm's launch below)
        _train_here(resolved, start.for_ranks(launcher_claimed=False))
        return
    per_node, plan = _plan_launch(resolved, nproc_per_node, nnodes, start)
    if start.dry_run:
        _print_dry_run(resolved, plan)
        return
    lock = start.claim(_notice) if start.launcher_claims(node_rank) else None  # its workers inherit the lock
    try:
        if relaunch_if_needed(LaunchConfig(per_node, nnodes, node_rank, master_addr, master_port),
                              _argv_for_workers(recipe, sets, resolved.train.output, resume), "training"):
            return
        _train_here(resolved, start.for_ranks(launcher_claimed=True))
    finally:
        if lock is not None:
            lock.release()


def _plan_launch(resolved, nproc_per_node: int | None, nnodes: int, start):
    """Everything checked before any process starts: wandb, the world size, the plan (and its notices)."""
    from qlm_core.train.plan import local_dp_note, plan_run, world_size
    from qlm_core.train.wandb_log import check_wandb

    check_wandb(resolved.logging, Path(resolved.train.output))
    per_node, world = world_size(resolved, nproc_per_node, nnodes)
    plan = plan_run(resolved, world, check_files=not start.dry_run, start_over=start.force)
    for line in [*filter(None, [local_dp_note(resolved, nproc_per_node)]), *plan.warnings]:
        _notice(line)
    return per_node, plan


def _train_here(resolved, start):
    """This process's share of the run (all of it when alone); a stop by signal exits 128 + its number."""
    from qlm_core.train.trainer import Trainer

    summary = Trainer(resolved, Path(resolved.train.output), on_event=RunView(), start=start).run()
    if summary.get("stopped", {}).get("exit_code"):
        raise typer.Exit(summary["stopped"]["exit_code"])  # 128 + the signal's number (qlm_core/train/signals.py)


def _print_dry_run(resolved, plan):
    from qlm_core.models.parameters import num_parameters
    from qlm_core.profile.memory import planned_memory

    console.print(recipe_to_toml(resolved), markup=False, highlight=False)
    sizes = plan.sizes
    experts = {"experts": f"ep{sizes.ep} x etp{sizes.etp} x edp{sizes.edp} (expert data parallel) per stage"}
    console.print(kv_table("layout", {
        "world": f"{sizes.world} = dp{sizes.dp} x pp{sizes.pp} x cp{sizes.cp} x tp{sizes.tp}",
        **(experts if sizes.expert_parallel else {}),
        "model": plan.resume or plan.model_description,
        "parameters": parameters_text(num_parameters(plan.spec), num_parameters(plan.spec, active=True)),
        "stage layers": list(plan.layout.stage_layer_counts), "padded vocabulary": plan.layout.padded_vocab,
        "steps": plan.steps, "compile": compile_text(resolved.train, plan.steps, resolved.data.kind == "rl"),
    }))
    memory, device = planned_memory(resolved, plan)
    console.print(memory_table(memory, f"memory per rank, heaviest stage, on {device}"))

