"""`qlm eval CKPT --tasks ...`: lm-evaluation-harness on any checkpoint qlm reads, no export step."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from qlm_cli.choices import EvalBackend, WeightDtype
from qlm_cli.launch import LaunchConfig, relaunch_if_needed
from qlm_cli.render import console


def eval_command(
    checkpoint: Annotated[str, typer.Argument(help="An HF model, a Megatron checkpoint (torch or torch_dist, any "
                                                   "TP/PP; its root or one iter_N directory), a DeepSpeed checkpoint "
                                                   "or a qlm run directory (its latest checkpoint, or --iteration; "
                                                   "LoRA adapters merged).")],
    tasks: Annotated[str, typer.Option("--tasks", help="Comma-separated lm-eval task names (qlm ships "
                                       "qlm_demo_mc, qlm_demo_gen, qlm_demo_ppl, generated locally).")],
    include_path: Annotated[str | None, typer.Option(
        "--include-path", help="A folder of extra task YAMLs (local data: dataset_path: json).")] = None,
    num_fewshot: Annotated[int | None, typer.Option("--num-fewshot", min=0, help="Few-shot examples.")] = None,
    limit: Annotated[float | None, typer.Option(
        "--limit", help="Documents per task (a count of 1 or more, or a fraction in (0, 1)).")] = None,
    batch_size: Annotated[int, typer.Option("--batch-size", min=1, help="Requests per forward pass.")] = 8,
    max_length: Annotated[int | None, typer.Option(
        "--max-length", min=1, help="Context window (default: the model's max_position_embeddings).")] = None,
    apply_chat_template: Annotated[bool, typer.Option(
        "--apply-chat-template", help="Wrap prompts in the checkpoint tokenizer's chat template.")] = False,
    backend: Annotated[EvalBackend, typer.Option(
        "--backend", help="qlm: qlm's own model; hf: lm-eval's hf model (the checkpoint is exported to HF first "
        "when needed).")] = EvalBackend["qlm"],
    tp: Annotated[int, typer.Option("--tp", min=1, help="Tensor-parallel ranks for the qlm backend, for models that "
                                    "do not fit one device (qlm starts torchrun with that many local processes).")] = 1,
    dtype: Annotated[WeightDtype, typer.Option("--dtype", help="Weights and compute dtype.")] = WeightDtype["fp32"],
    output: Annotated[Path | None, typer.Option(
        "--output", help="Folder for lm-eval's files, as lm_eval --output_path writes them: DIR/<checkpoint path, "
        "sanitized>/results_<date>.json (and samples_<task>_<date>.jsonl with --log-samples). Checked writable "
        "before the evaluation starts.")] = None,
    iteration: Annotated[int | None, typer.Option(
        "--iteration", min=0, help="The iteration of a Megatron checkpoint root or a qlm run (default: its "
        "latest).")] = None,
    log_samples: Annotated[bool, typer.Option("--log-samples", help="Keep every request and response.")] = False,
):
    """Evaluate a checkpoint with lm-evaluation-harness. Local tasks load without scanning lm-eval's built-in
    index; built-in tasks that need the Hugging Face hub fail with a one-line error offline."""
    from qlm_core.eval.runner import EvalConfig, check_config, result_rows, results_folder, run_eval, worker_argv
    from qlm_core.eval.tasks import DEMO_NOTES

    config = EvalConfig(
        checkpoint=checkpoint, tasks=[t.strip() for t in tasks.split(",") if t.strip()], include_path=include_path,
        num_fewshot=num_fewshot, limit=limit, batch_size=batch_size, max_length=max_length,
        apply_chat_template=apply_chat_template, backend=backend.value, dtype=dtype.value,
        output=str(output) if output else None, log_samples=log_samples, tp=tp, iteration=iteration,
    )
    check_config(config)
    if relaunch_if_needed(LaunchConfig(nproc_per_node=tp), worker_argv(config), "evaluation"):
        return
    results = run_eval(config)
    if results is None:  # another rank of a tensor-parallel evaluation: rank 0 reports
        return
    table = Table(title=f"{escape(checkpoint)} ({backend.value} backend)", title_justify="left")
    for column in ("task", "version", "filter", "n-shot", "metric", "value", "stderr"):
        table.add_column(column, no_wrap=column == "task", overflow="fold")  # the task name is never cut
    for task, filter_name, metric, value, stderr in result_rows(results):
        table.add_row(escape(task), str(results["versions"].get(task, "")), escape(filter_name),
                      str(results["n-shot"].get(task, "")), escape(metric), f"{value:.4f}",
                      "" if stderr is None else f"± {stderr:.4f}")
    console.print(table)
    for task in results["results"]:
        figures = ", ".join(f"{m} {v:.4f}" for t, f, m, v, _ in result_rows(results) if t == task)
        console.print(f"{task}: {figures}", markup=False, highlight=False)
        if task in DEMO_NOTES:
            console.print(f"note: {DEMO_NOTES[task]}", markup=False, highlight=False)
    if output:
        console.print(f"results written under {results_folder(config)}", markup=False, highlight=False)
