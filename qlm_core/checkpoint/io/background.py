"""One write at a time on a background thread: `submit` waits for the write before it, `wait` returns the pending
write's result and raises its exception on the calling thread (a failed background write is never lost)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any


class BackgroundWriter:
    def __init__(self, name: str = "qlm-writer"):
        # one worker: writes run in submission order and never overlap; Python joins it at exit, so a write in
        # flight still finishes when the main thread is done
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._pending: Future | None = None

    @property
    def pending(self) -> bool:
        return self._pending is not None

    def submit(self, job: Callable[..., Any], *args) -> Any:
        """Wait for the pending write (its result is returned, its exception raised), then start `job(*args)`."""
        previous = self.wait()
        self._pending = self._executor.submit(job, *args)
        return previous

    def wait(self) -> Any:
        """The pending write's result (None when there is none); its exception is raised here."""
        pending, self._pending = self._pending, None
        return pending.result() if pending is not None else None

    def close(self):
        """Shut the thread down once the pending write (whose outcome is left to wait()) has finished."""
        self._executor.shutdown(wait=True)
