"""The process-group grid: world = dp x pp x cp x tp, tp fastest-varying (a TP group's ranks are adjacent, so they
share a node's NVLink), then cp, pp, dp:  rank = ((dp_rank * pp + pp_rank) * cp + cp_rank) * tp + tp_rank.

Built once per process from torchrun's (or Slurm's) environment. Backend nccl on CUDA, gloo otherwise.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta
from itertools import product

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from qlm_core.errors import QlmError


@dataclass(frozen=True)
class ParallelSizes:
    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp: int = 1

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    def coords(self, rank: int) -> dict[str, int]:
        tp_rank = rank % self.tp
        cp_rank = rank // self.tp % self.cp
        pp_rank = rank // (self.tp * self.cp) % self.pp
        dp_rank = rank // (self.tp * self.cp * self.pp)
        return {"dp": dp_rank, "pp": pp_rank, "cp": cp_rank, "tp": tp_rank}

    def rank_of(self, dp: int, pp: int, cp: int, tp: int) -> int:
        return ((dp * self.pp + pp) * self.cp + cp) * self.tp + tp


def resolve_sizes(world: int, tp: int = 1, pp: int = 1, cp: int = 1, dp: int | None = None) -> ParallelSizes:
    """dp may be omitted: it is then world / (tp * pp * cp)."""
    for name, size in (("tp", tp), ("pp", pp), ("cp", cp), ("dp", 1 if dp is None else dp)):
        if size < 1:
            raise QlmError(f"{name} must be >= 1, got {size}", f"set parallel.{name} (or --{name}) to 1 or more")
    model = tp * pp * cp
    if dp is None:
        if world % model:
            raise QlmError(f"world size {world} is not divisible by tp*pp*cp = {model}",
                           "launch a multiple of tp*pp*cp processes or change the layout")
        dp = world // model
    if dp * model != world:
        raise QlmError(f"world size {world} != dp*pp*cp*tp = {dp}*{pp}*{cp}*{tp} = {dp * model}",
                       "launch dp*pp*cp*tp processes (or omit dp)")
    return ParallelSizes(tp=tp, pp=pp, cp=cp, dp=dp)


def _env_int(*names: str) -> int | None:
    for name in names:
        if os.environ.get(name, "").strip():
            return int(os.environ[name])
    return None


def launch_env() -> tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun, else Slurm's srun, else a single process."""
    rank = _env_int("RANK", "SLURM_PROCID")
    world = _env_int("WORLD_SIZE", "SLURM_NTASKS")
    local = _env_int("LOCAL_RANK", "SLURM_LOCALID")
    if rank is None or world is None:
        return 0, 1, 0
    return rank, world, local or 0


def first_slurm_host(nodelist: str) -> str:
    """The first host of a Slurm node list such as "gpu[03-05,07],cpu1" -> "gpu03"."""
    head = nodelist.split(",")[0] if "[" not in nodelist.split(",")[0] else nodelist[: nodelist.index("]") + 1]
    if "[" not in head:
        return head
    prefix, ranges = head[:-1].split("[", 1)
    return prefix + ranges.split(",")[0].split("-")[0]


def init_distributed(timeout_s: float = 1800.0) -> tuple[int, int]:
    """Initialise the default process group if launched by torchrun / srun; returns (rank, world size)."""
    rank, world, local = launch_env()
    if world == 1 and not dist.is_initialized():
        return 0, 1
    if not dist.is_initialized():
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(local % torch.cuda.device_count())
        nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
        os.environ.setdefault("MASTER_ADDR", first_slurm_host(nodelist) if nodelist else "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        dist.init_process_group(
            backend="nccl" if cuda else "gloo", rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s),
        )
    return dist.get_rank(), dist.get_world_size()


def destroy_distributed():
    """Without the barrier about 1 run in 12 aborts at exit on gloo (docs/ARCHITECTURE.md §2)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@dataclass
class Grid:
    """This rank's coordinates and the process groups every parallel dimension needs. Groups are None when the
    run is a single process (every parallel layer is then the plain layer)."""

    sizes: ParallelSizes
    rank: int = 0
    coords: dict[str, int] = field(default_factory=lambda: {"dp": 0, "pp": 0, "cp": 0, "tp": 0})
    tp_group: ProcessGroup | None = None
    pp_group: ProcessGroup | None = None
    cp_group: ProcessGroup | None = None
    dp_cp_group: ProcessGroup | None = None  # gradients are reduced over data x context ranks
    embedding_group: ProcessGroup | None = None  # first and last pipeline stage, for tied embeddings
    pp_ranks: tuple[int, ...] = (0,)  # global ranks of this rank's pipeline, stage order
    device: torch.device = field(default_factory=default_device)

    @property
    def tp_rank(self) -> int:
        return self.coords["tp"]

    @property
    def pp_rank(self) -> int:
        return self.coords["pp"]

    @property
    def cp_rank(self) -> int:
        return self.coords["cp"]

    @property
    def dp_rank(self) -> int:
        return self.coords["dp"]

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.sizes.pp - 1

    @classmethod
    def single(cls) -> Grid:
        return cls(ParallelSizes())

    @classmethod
    def build(cls, sizes: ParallelSizes, ranks: list[int] | None = None) -> Grid | None:
        """Create every group. Every process of the default group must call this with the same arguments
        (new_group is collective). `ranks`: the global ranks forming this grid (default: all); a process outside
        them gets None."""
        if not dist.is_initialized():
            if sizes.world != 1:
                raise QlmError(f"layout needs {sizes.world} processes but this is a single process",
                               "launch with torchrun (qlm train does it for you)")
            return cls.single()
        ranks = list(range(dist.get_world_size())) if ranks is None else list(ranks)
        if len(ranks) != sizes.world:
            raise QlmError(f"world size {len(ranks)} != dp*pp*cp*tp = {sizes.world}",
                           "launch dp*pp*cp*tp processes")
        me = dist.get_rank()
        rank = ranks.index(me) if me in ranks else None
        grid = cls(sizes, rank=rank or 0, coords=sizes.coords(rank or 0))
        axes = {"dp": range(sizes.dp), "pp": range(sizes.pp), "cp": range(sizes.cp), "tp": range(sizes.tp)}

        def groups_varying(varying: tuple[str, ...]):
            """One group per assignment of the fixed axes; returns the group containing this rank."""
            fixed = [a for a in ("dp", "pp", "cp", "tp") if a not in varying]
            mine = None
            for values in product(*(axes[a] for a in fixed)):
                where = dict(zip(fixed, values, strict=True))
                members = sorted(
                    ranks[sizes.rank_of(**{**where, **dict(zip(varying, free, strict=True))})]
                    for free in product(*(axes[a] for a in varying))
                )
                group = dist.new_group(members)
                if me in members:
                    mine = (group, members)
            return mine or (None, [])

        grid.tp_group = groups_varying(("tp",))[0]
        grid.cp_group = groups_varying(("cp",))[0]
        grid.dp_cp_group = groups_varying(("dp", "cp"))[0]
        grid.pp_group, pp_ranks = groups_varying(("pp",))
        grid.pp_ranks = tuple(pp_ranks)
        # The embedding group joins the first and last stage of each pipeline (one group per pipeline).
        for dp, cp, tp in product(axes["dp"], axes["cp"], axes["tp"]) if sizes.pp > 1 else ():
            members = sorted({ranks[sizes.rank_of(dp, 0, cp, tp)], ranks[sizes.rank_of(dp, sizes.pp - 1, cp, tp)]})
            group = dist.new_group(members)
            if me in members:
                grid.embedding_group = group
        return grid if rank is not None else None

    def describe(self) -> str:
        s = self.sizes
        return f"dp{s.dp} x pp{s.pp} x cp{s.cp} x tp{s.tp} (rank {self.rank}: {self.coords})"
