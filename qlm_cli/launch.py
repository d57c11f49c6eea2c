"""Start the worker processes: qlm re-runs itself under torchrun (torch.distributed.run) unless it already runs
under torchrun or Slurm's srun."""

from __future__ import annotations

import os
from dataclasses import dataclass

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
