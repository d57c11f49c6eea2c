"""The loop shared by the torchrun workers that run a list of named jobs into one output folder:

    python tests/workers/x_worker.py OUTDIR ...

Each rank runs every job in order, with a barrier after each; a job that raises leaves its traceback in
`OUTDIR/{name}.rank{rank}.error` (the pytest modules read those files) and then fails the run.
"""

import sys
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist


def run_jobs(jobs: list[tuple[str, Callable[[Path], None]]], timeout_s: float = 120,
             num_threads: int | None = None) -> None:
    """Join the gloo group, run `jobs` (name, fn(OUTDIR)) with OUTDIR = argv[1], then leave the group.

    `num_threads`, when given, is set with torch.set_num_threads once the group is up."""
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    outdir = Path(sys.argv[1])
    for name, job in jobs:
        try:
            job(outdir)
        except Exception:  # record, then fail: the test reports every failing case from these files
            (outdir / f"{name}.rank{dist.get_rank()}.error").write_text(traceback.format_exc())
            raise
        dist.barrier()
    dist.barrier()
    dist.destroy_process_group()
