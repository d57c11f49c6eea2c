"""Stopping a run cleanly: on SIGTERM / SIGINT (train.exit_signal_handler, Megatron's --exit-signal-handler) or once
the run has taken train.exit_duration_minutes (Megatron's --exit-duration-in-mins).

A signal handler only records the signal; the trainer asks `StopControl.poll()` after every step. The poll is one
all-reduce (max) over every rank of [the signal this rank received, rank 0's "time is up"], so all ranks agree on
the same step to stop at even when the signal reached only some of them (or reached them during different steps).
The trainer then saves a checkpoint and the run exits: 128 + the signal's number after a signal (what a shell
reports for a process the signal ended: 143 for SIGTERM, 130 for Ctrl-C, so a job script or scheduler sees that
the run did not finish), 0 after the time limit (a planned stop, like train.exit_interval).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from dataclasses import dataclass

HANDLED = (signal.SIGTERM, signal.SIGINT)
# After a signal, a rank that does not reach the next poll within this long is stuck (e.g. in an NCCL collective
# with a rank that died, which is why torchrun signalled the survivors) and exits; below torchrun's shutdown wait.
STUCK_AFTER_SIGNAL_S = 600.0


@dataclass(frozen=True)
class StopReason:
    signum: int = 0  # 0: the time limit
    minutes: float = 0.0  # the limit, when that is the reason

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else "train.exit_duration_minutes"

    @property
    def exit_code(self) -> int:
        return 128 + self.signum if self.signum else 0

    def describe(self) -> str:
        if self.signum:
            return f"stopped by {self.name}"
        return f"stopped after train.exit_duration_minutes = {self.minutes:g}"


def exit_code_for(signum: int) -> int:
    return 128 + int(signum)


class StopControl:
    """Within `with StopControl(...)`: SIGTERM/SIGINT are recorded (when `handle_signals`), the previous handlers come
    back on exit. `poll(device)` after each step: the agreed StopReason or None. Repeated signals are ignored (a
    second Ctrl-C does not abort the checkpoint being written; `kill -9` does)."""

    def __init__(self, handle_signals: bool = True, duration_minutes: float = 0.0, is_rank0: bool = True,
                 started: float | None = None):
        self.handle_signals = handle_signals
        self.duration_minutes = duration_minutes
        self.is_rank0 = is_rank0
        self.started = time.monotonic() if started is None else started
        self.received = 0
        self._previous: dict[int, object] = {}
        self._watchdog: threading.Timer | None = None

    def __enter__(self) -> StopControl:
        if self.handle_signals and threading.current_thread() is threading.main_thread():
            for signum in HANDLED:
                self._previous[signum] = signal.signal(signum, self._record)
        return self

    def __exit__(self, *exc):
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
        self._cancel_watchdog()
        return False

    def _record(self, signum, frame):
        if not self.received:
            self.received = signum
            self._watchdog = threading.Timer(STUCK_AFTER_SIGNAL_S, _exit_stuck, (signum,))
            self._watchdog.daemon = True
            self._watchdog.start()

    def _cancel_watchdog(self):
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None

    def time_is_up(self) -> bool:
        return self.duration_minutes > 0 and time.monotonic() - self.started >= self.duration_minutes * 60

    def poll(self, device=None, clock: bool = True) -> StopReason | None:
        """The stop every rank agrees on (a collective when torch.distributed is initialised: call it on every rank
        at the same point). `clock=False`: signals only (before the first step, so that a run always progresses)."""
        signum, late = self.received, int(clock and self.is_rank0 and self.time_is_up())
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            import torch

            flags = torch.tensor([signum, late], dtype=torch.int64, device=device)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            signum, late = (int(v) for v in flags.tolist())
        if signum:
            self._cancel_watchdog()  # every rank reached the poll: the stop (and its checkpoint) goes ahead
            return StopReason(signum)
        if late:
            return StopReason(0, self.duration_minutes)
        return None


def _exit_stuck(signum: int):
    print(f"error: stopped by {signal.Signals(signum).name}, but this rank did not finish its step within "
          f"{STUCK_AFTER_SIGNAL_S:g} s (another rank failed?); no checkpoint was saved by it, resume from the last one",
          file=sys.stderr, flush=True)
    os._exit(exit_code_for(signum))
