"""Rendering helpers shared by the commands: one console, progress bars, key/value and memory tables."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

console = Console()
err_console = Console(stderr=True)


PLAIN_PROGRESS_SECONDS = 30.0  # without a terminal (nohup, Slurm, | tee): a plain progress line at most this often


class PlainProgress:
    """Progress for a log file, where a rich bar shows nothing until it stops: a plain line once the work has taken
    `every` seconds, then at most every `every` seconds, and a last one at the end if any was written (a short job
    writes none)."""

    def __init__(self, write, every: float = PLAIN_PROGRESS_SECONDS, first: bool = False):
        """`first`: write the first call's line at once (a run's first step says its pace)."""
        self.write, self.every = write, every
        self.last, self.wrote, self.ended = time.monotonic() - (every if first else 0.0), False, False

    def __call__(self, line: str, done: int, total: int | None):
        now, end = time.monotonic(), total is not None and done >= total
        if self.ended:
            return
        if now - self.last >= self.every or (end and self.wrote):
            self.last, self.wrote, self.ended = now, True, end
            self.write(line)


@contextmanager
def progress_bar(description: str) -> Iterator:
    """Yields a qlm_core progress callback (done, total, what) drawing a rich bar on a terminal, else a plain line
    now and then (PlainProgress). DESCRIPTION and WHAT are data (file and tensor names), shown as written."""
    if not err_console.is_terminal:
        plain = PlainProgress(lambda line: err_console.print(line, markup=False, highlight=False, soft_wrap=True))

        def report_plain(done: int, total: int, what: str = ""):
            plain(f"{description}: {done}/{total} {what}".rstrip(), done, total)

        yield report_plain
        return
    with Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[what]}"),
        TimeElapsedColumn(), console=err_console, transient=True,
    ) as bar:
        task = bar.add_task(escape(description), total=None, what="")

        def report(done: int, total: int, what: str = ""):
            bar.update(task, completed=done, total=total, what=escape(str(what)))

        yield report


def kv_table(title: str, items: dict[str, Any]) -> Table:
    """TITLE is Rich markup; the keys and values are data, shown as written."""
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column(style="cyan")
    table.add_column()
    for key, value in items.items():
        table.add_row(escape(str(key)), escape(str(value)))
    return table


MEMORY_NOTES = {
    "weights": "parameters on this rank (and a frozen DPO / RL reference)",
    "grads": "gradient buffers (parallel.grad_reduce_dtype)",
    "optimizer": "fp32 masters + Adam moments",
    "activations": "saved for backward, all in-flight micro-batches",
    "logits_loss": "loss head: fp32 softmax (chunked: input, lse)",
    "workspace": "largest transient (recompute / loss logits / CP K/V)", "pp_buffers": "pipeline stage I/O kept",
    "comm_buffers": "ZeRO 2 buckets / ZeRO 3 gathered params",
    "rollout": "RL: whole rollout model; KV cache + synced weights past training's",
    "allocator": "allowance: fragmentation + CUDA context",
}


def memory_table(memory, title: str) -> Table:
    """The heaviest stage's memory by component (a qlm_core.profile.memory estimate), with the fit verdict."""
    from qlm_core.profile.memory import COMPONENTS, GIB

    heavy = memory.heaviest
    table = Table(title=title, title_justify="left")
    for name, justify in (("component", "left"), ("GiB", "right"), ("share", "right"), ("what", "left")):
        table.add_column(name, justify=justify)
    for key in COMPONENTS:
        value = heavy.components[key]
        table.add_row(key, f"{value / GIB:,.2f}", f"{value / heavy.total:.0%}", MEMORY_NOTES[key])
    verdict = (f"[green]fits[/], headroom {memory.headroom_gib:.1f} GiB" if memory.fits
               else f"[bold red]OOM by {-memory.headroom_gib:.1f} GiB[/]")
    table.add_row("[bold]total", f"[bold]{memory.total_gib:,.2f}", "", f"of {memory.capacity_gib:g} GiB: {verdict}")
    return table
