"""How the writers report progress: progress(done, total, what), e.g. a rich bar's update in the CLI."""

from __future__ import annotations

from collections.abc import Callable

Progress = Callable[[int, int, str], None]  # (done, total, what)


def no_progress(done: int, total: int, what: str):
    pass
