"""Start the worker processes: qlm re-runs itself under torchrun (torch.distributed.run) unless it already runs
under torchrun or Slurm's srun.

SIGTERM / SIGINT to this (parent) process: torchrun's agent forwards the signal to every worker (they run in their
own sessions, so a terminal's Ctrl-C reaches only this process), waits up to SHUTDOWN_TIMEOUT_S for them to save
and exit (the trainer's signal handler, qlm_core/train/signals.py), and raises SignalException here; qlm exits with
128 + the signal's number and no traceback (rank 0 has printed where the checkpoint is). A second signal cuts
torchrun's wait short; from then on this process ignores signals and waits for the workers itself, so the run's
lock (held here) is never released while a worker still writes its checkpoint."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import typer

from qlm_cli.render import err_console
from qlm_core.errors import QlmError

# how long the workers get to save a checkpoint and exit after a signal before torchrun kills them
SHUTDOWN_TIMEOUT_S = 900


@dataclass
class LaunchConfig:
    nproc_per_node: int
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int = 29500


def under_launcher() -> bool:
    """True inside a torchrun worker or an srun task of a multi-task job."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return True
    # SLURM_STEP_ID: an srun step; the batch script itself has SLURM_NTASKS and SLURM_PROCID too, but is one process
    return (int(os.environ.get("SLURM_NTASKS", "1") or 1) > 1 and "SLURM_PROCID" in os.environ
            and "SLURM_STEP_ID" in os.environ)


def _torchrun_has(option: str) -> bool:
    """Whether this torch's torchrun takes `option` (--shutdown-timeout is recent; qlm allows torch >= 2.4)."""
    from torch.distributed.run import get_args_parser

    return any(option in action.option_strings for action in get_args_parser()._actions)


def torchrun_args(config: LaunchConfig, module_argv: list[str]) -> list[str]:
    args = [f"--nproc-per-node={config.nproc_per_node}", f"--nnodes={config.nnodes}"]
    if _torchrun_has("--shutdown-timeout"):  # time for the workers' checkpoint after a forwarded signal
        args.append(f"--shutdown-timeout={SHUTDOWN_TIMEOUT_S}")
    if config.nnodes == 1 and config.master_addr is None:
        args.append("--standalone")
    else:
        if config.master_addr is None:
            raise QlmError("multi-node runs need --master-addr", "pass the address of node 0")
        args += [f"--node-rank={config.node_rank}", f"--master-addr={config.master_addr}",
                 f"--master-port={config.master_port}"]
    return args + ["-m", "qlm_cli.main", *module_argv]


class _QuietShutdown(logging.Filter):
    """Drops torchrun's per-worker "Received 15 death signal" / "Sending process N closing signal" warnings and its
    "failed (exitcode: 143)" error for workers that stopped on a signal: qlm reports a signalled stop in one line
    (rank 0's)."""

    QUIET = ("Received %s death signal", "Sending process %s closing signal")
    STOPPED = (128 + signal.SIGTERM, 128 + signal.SIGINT)

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        if message.startswith("failed (exitcode: %s)") and record.args and record.args[0] in self.STOPPED:
            return False
        return not message.startswith(self.QUIET)


_TORCHRUN_LOGGERS = ("torch.distributed.elastic.agent.server.api", "torch.distributed.elastic.multiprocessing.api")


def worker_threads(nproc_per_node: int) -> int:
    """OpenMP threads per worker when the user set none: this process's cores shared by the local workers."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, nproc_per_node))


def _children() -> list[int]:
    try:
        text = " ".join(Path(task, "children").read_text() for task in Path("/proc/self/task").iterdir())
    except OSError:
        return []
    return [int(pid) for pid in text.split()]


def _outlive_workers(older_children: set[int], timeout_s: float):
    """After torchrun gave up waiting (a further signal interrupted it): ignore SIGINT/SIGTERM and wait until every
    worker (a child of this process not among OLDER_CHILDREN) has exited, killing what is left after TIMEOUT_S (a
    checkpoint is written to a temporary name and renamed, so a killed save loses nothing written before)."""
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    waiting, deadline = set(_children()) - older_children, time.monotonic() + timeout_s
    try:
        while waiting:
            for pid in list(waiting):
                try:
                    if os.waitpid(pid, os.WNOHANG)[0]:
                        waiting.discard(pid)
                except ChildProcessError:
                    waiting.discard(pid)  # reaped elsewhere
            if waiting and time.monotonic() > deadline:
                for pid in waiting:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                deadline = float("inf")
            if waiting:
                time.sleep(0.1)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def launch(config: LaunchConfig, module_argv: list[str]) -> int:
    """Run `python -m qlm_cli.main MODULE_ARGV` on every local rank; returns the exit code (128 + N after signal
    N reached this process)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    # torchrun sets OMP_NUM_THREADS=1 with a warning when it is unset; set it ourselves (cores / local workers)
    omp_was_set = "OMP_NUM_THREADS" in os.environ
    if not omp_was_set:
        os.environ["OMP_NUM_THREADS"] = str(worker_threads(config.nproc_per_node))
    quiet = _QuietShutdown()
    for name in _TORCHRUN_LOGGERS:
        logging.getLogger(name).addFilter(quiet)
    older_children = set(_children())
    try:
        torchrun_main(torchrun_args(config, module_argv))
    except ChildFailedError as exc:
        # the earliest failure (timestamps are whole seconds: then one that exited by itself, not by a signal): the
        # others are usually workers torchrun stopped because of it
        first = (min(exc.failures.values(), key=lambda f: (f.timestamp, f.exitcode < 0, f.local_rank))
                 if exc.failures else None)
        code = first.exitcode if first is not None else 1
        if isinstance(code, int) and code < 0:  # a worker ended by signal -N
            return 128 - code
        return code if isinstance(code, int) and code > 0 else 1
    except SignalException as exc:
        _outlive_workers(older_children, SHUTDOWN_TIMEOUT_S)
        return 128 + int(exc.sigval)
    finally:
        for name in _TORCHRUN_LOGGERS:
            logging.getLogger(name).removeFilter(quiet)
        if not omp_was_set:
            os.environ.pop("OMP_NUM_THREADS", None)
    return 0


def relaunch_if_needed(config: LaunchConfig, worker_argv: list[str], what: str) -> bool:
    """Outside torchrun/srun, with more than one process to run: run WORKER_ARGV on every rank under torchrun and
    return True (the caller is done), or exit with the workers' code when they fail. False: this process does the
    work itself (one process, or already a worker)."""
    if under_launcher() or config.nproc_per_node * config.nnodes <= 1:
        return False
    code = launch(config, worker_argv)
    if code > 128 and code - 128 in (signal.SIGTERM, signal.SIGINT):
        raise typer.Exit(code)  # stopped by a signal: the workers said where the checkpoint is
    if code:
        err_console.print(f"[bold red]error:[/] {what} failed (exit code {code}); the messages above say why.")
        raise typer.Exit(code)
    return True
