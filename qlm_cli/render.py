"""Rendering helpers shared by the commands: one console, progress bars, key/value and tensor tables."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

console = Console()
err_console = Console(stderr=True)


@contextmanager
def progress_bar(description: str) -> Iterator:
    """Yields a qlm_core progress callback (done, total, what) drawing a rich bar."""
    with Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[what]}"),
        TimeElapsedColumn(), console=err_console, transient=True,
    ) as bar:
        task = bar.add_task(description, total=None, what="")

        def report(done: int, total: int, what: str):
            bar.update(task, completed=done, total=total, what=what)

        yield report


def kv_table(title: str, items: dict[str, Any]) -> Table:
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column(style="cyan")
    table.add_column()
    for key, value in items.items():
        table.add_row(str(key), str(value))
    return table
