"""Start the worker processes: qlm re-runs itself under torchrun (torch.distributed.run) unless it already runs
under torchrun or Slurm's srun."""

from __future__ import annotations

import os
from dataclasses import dataclass

import typer

from qlm_cli.render import err_console
from qlm_core.errors import QlmError


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
    return int(os.environ.get("SLURM_NTASKS", "1") or 1) > 1 and "SLURM_PROCID" in os.environ


def torchrun_args(config: LaunchConfig, module_argv: list[str]) -> list[str]:
    args = [f"--nproc-per-node={config.nproc_per_node}", f"--nnodes={config.nnodes}"]
    if config.nnodes == 1 and config.master_addr is None:
        args.append("--standalone")
    else:
        if config.master_addr is None:
            raise QlmError("multi-node runs need --master-addr", "pass the address of node 0")
        args += [f"--node-rank={config.node_rank}", f"--master-addr={config.master_addr}",
                 f"--master-port={config.master_port}"]
    return args + ["-m", "qlm_cli.main", *module_argv]


def launch(config: LaunchConfig, module_argv: list[str]) -> int:
    """Run `python -m qlm_cli.main MODULE_ARGV` on every local rank; returns the exit code."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    try:
        torchrun_main(torchrun_args(config, module_argv))
    except ChildFailedError as exc:
        failures = exc.failures
        first = min(failures) if failures else None
        code = failures[first].exitcode if first is not None else 1
        return code if isinstance(code, int) and code > 0 else 1
    return 0


def relaunch_if_needed(config: LaunchConfig, worker_argv: list[str], what: str) -> bool:
    """Outside torchrun/srun, with more than one process to run: run WORKER_ARGV on every rank under torchrun and
    return True (the caller is done), or exit with the workers' code when they fail. False: this process does the
    work itself (one process, or already a worker)."""
    if under_launcher() or config.nproc_per_node * config.nnodes <= 1:
        return False
    code = launch(config, worker_argv)
    if code:
        err_console.print(f"[bold red]error:[/] {what} failed (exit code {code}); the messages above say why.")
        raise typer.Exit(code)
    return True
