"""The process-group grid: world = dp x pp x cp x tp, tp fastest-varying (a TP group's ranks are adjacent, so they
share a node's NVLink), then cp, pp, dp:  rank = ((dp_rank * pp + pp_rank) * cp + cp_rank) * tp + tp_rank.

Routed experts fold the same ranks differently, as Megatron-Core does: within one pipeline stage the dp·cp·tp ranks,
numbered i = (dp_rank * cp + cp_rank) * tp + tp_rank, are etp x ep x edp with etp fastest: etp_rank = i % etp,
ep_rank = i // etp % ep, edp_rank = i // (etp * ep). Expert e lives on ep rank e // (E / ep), split over its etp
group like a TP linear; its gradients are reduced over the edp group (dp·cp·tp / (ep·etp) ranks). Dense parameters
keep the groups above.

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
    ep: int = 1  # expert model parallel: the routed experts are divided among ep ranks
    etp: int | None = None  # expert tensor parallel; None: tp (Megatron-Core's default)

    def __post_init__(self):
        if self.etp is None:
            object.__setattr__(self, "etp", self.tp)

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @property
    def edp(self) -> int:
        """Expert data parallel: the ranks of a pipeline stage that hold the same experts."""
        return self.dp * self.cp * self.tp // (self.ep * self.etp)

    @property
    def expert_parallel(self) -> bool:
        """Whether the routed experts are laid out differently from the dense TP split (EP, or ETP != TP)."""
        return self.ep > 1 or self.etp != self.tp

    def expert_coords(self, rank: int) -> dict[str, int]:
        c = self.coords(rank)
        inner = (c["dp"] * self.cp + c["cp"]) * self.tp + c["tp"]
        return {"etp": inner % self.etp, "ep": inner // self.etp % self.ep, "edp": inner // (self.etp * self.ep)}

    def coords(self, rank: int) -> dict[str, int]:
        tp_rank = rank % self.tp
        cp_rank = rank // self.tp % self.cp
        pp_rank = rank // (self.tp * self.cp) % self.pp
        dp_rank = rank // (self.tp * self.cp * self.pp)
        return {"dp": dp_rank, "pp": pp_rank, "cp": cp_rank, "tp": tp_rank}

    def rank_of(self, dp: int, pp: int, cp: int, tp: int) -> int:
        return ((dp * self.pp + pp) * self.cp + cp) * self.tp + tp


def resolve_sizes(world: int, tp: int = 1, pp: int = 1, cp: int = 1, dp: int | None = None, ep: int = 1,
                  etp: int | None = None) -> ParallelSizes:
    """dp may be omitted: it is then world / (tp * pp * cp); etp: tp when omitted."""
    for name, size in (("tp", tp), ("pp", pp), ("cp", cp), ("dp", 1 if dp is None else dp), ("ep", ep),
                       ("etp", 1 if etp is None else etp)):
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
    sizes = ParallelSizes(tp=tp, pp=pp, cp=cp, dp=dp, ep=ep, etp=etp)
    if (dp * cp * tp) % (sizes.ep * sizes.etp):
        raise QlmError(f"ep*etp = {sizes.ep}*{sizes.etp} does not divide dp*cp*tp = {dp}*{cp}*{tp} = {dp * cp * tp}",
                       "choose ep and etp whose product divides the ranks of a pipeline stage")
    return sizes


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
    # routed experts (see the module docstring); all None when the experts follow the dense TP split
    expert_group: ProcessGroup | None = None  # ep x etp: the ranks tokens are dispatched among
    expert_dp_group: ProcessGroup | None = None  # edp: expert gradients are reduced over it
    expert_coords: dict[str, int] = field(default_factory=lambda: {"etp": 0, "ep": 0, "edp": 0})
    pp_ranks: tuple[int, ...] = (0,)  # global ranks of this rank's pipeline, stage order
    ranks: tuple[int, ...] = (0,)  # the global rank of each rank of this grid (grid rank -> global rank)
    # one model replica: the tp x pp x cp ranks of this data-parallel rank (rank order; its first, tp = pp = cp = 0,
    # is the replica's leader), and the data-parallel ranks of this rank's place in the replica; made by
    # build_replica_groups
    replica_group: ProcessGroup | None = None
    replica_ranks: tuple[int, ...] = (0,)
    dp_group: ProcessGroup | None = None
    _replica_groups_built: bool = False
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
    def ep_rank(self) -> int:
        return self.expert_coords["ep"]

    @property
    def etp_rank(self) -> int:
        return self.expert_coords["etp"]

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
        if ranks != sorted(ranks):  # torch numbers a group's members by global rank; the expert dispatch relies on it
            raise ValueError(f"Grid.build needs its ranks in increasing order, got {ranks}")
        if len(ranks) != sizes.world:
            raise QlmError(f"world size {len(ranks)} != dp*pp*cp*tp = {sizes.world}",
                           "launch dp*pp*cp*tp processes")
        me = dist.get_rank()
        rank = ranks.index(me) if me in ranks else None
        grid = cls(sizes, rank=rank or 0, coords=sizes.coords(rank or 0), expert_coords=sizes.expert_coords(rank or 0),
                   ranks=tuple(ranks))
        axes = {"dp": range(sizes.dp), "pp": range(sizes.pp), "cp": range(sizes.cp), "tp": range(sizes.tp)}

        def groups_varying(varying: tuple[str, ...]):
            return _groups_varying(sizes, ranks, me, varying)

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
        if sizes.expert_parallel:
            grid.expert_group, grid.expert_dp_group = (
                _expert_groups(sizes, ranks, me, varying) for varying in (("ep", "etp"), ("edp",)))
        return grid if rank is not None else None

    def build_replica_groups(self) -> None:
        """replica_group, replica_ranks and dp_group (what RL's rollouts use), made at their first use rather than
        by build (every other run would pay for groups it never uses). A collective: every rank of the grid calls
        it; later calls do nothing."""
        if self._replica_groups_built:
            return
        self._replica_groups_built = True
        if not dist.is_initialized() or self.sizes.world == 1:
            return
        ranks, me = list(self.ranks), dist.get_rank()
        self.replica_group, replica_ranks = _groups_varying(self.sizes, ranks, me, ("pp", "cp", "tp"))
        self.replica_ranks = tuple(replica_ranks)
        self.dp_group = _groups_varying(self.sizes, ranks, me, ("dp",))[0]

    def describe(self) -> str:
        s = self.sizes
        experts = f", experts ep{s.ep} x etp{s.etp} x edp{s.edp}" if s.expert_parallel else ""
        return f"dp{s.dp} x pp{s.pp} x cp{s.cp} x tp{s.tp}{experts} (rank {self.rank}: {self.coords})"


def _groups_varying(sizes: ParallelSizes, ranks: list[int], me: int, varying: tuple[str, ...]):
    """One group per assignment of the fixed axes (a collective: every rank creates every group in the same
    order); returns (the group containing `me`, its members), or (None, [])."""
    axes = {"dp": range(sizes.dp), "pp": range(sizes.pp), "cp": range(sizes.cp), "tp": range(sizes.tp)}
    fixed = [a for a in ("dp", "pp", "cp", "tp") if a not in varying]
    mine = None
    for values in product(*(axes[a] for a in fixed)):
        where = dict(zip(fixed, values, strict=True))
        members = sorted(ranks[sizes.rank_of(**{**where, **dict(zip(varying, free, strict=True))})]
                         for free in product(*(axes[a] for a in varying)))
        group = dist.new_group(members)
        if me in members:
            mine = (group, members)
    return mine or (None, [])


def _expert_groups(sizes: ParallelSizes, ranks: list[int], me: int, varying: tuple[str, ...]) -> ProcessGroup | None:
    """One group per pipeline stage and assignment of the expert axes not in `varying`; returns this rank's.
    Collective: every rank creates every group in the same order."""
    by_key: dict[tuple, list[int]] = {}
    for position in range(sizes.world):
        coords = sizes.expert_coords(position)
        key = (sizes.coords(position)["pp"],) + tuple(coords[a] for a in ("etp", "ep", "edp") if a not in varying)
        by_key.setdefault(key, []).append(ranks[position])
    mine = None
    for key in sorted(by_key):
        members = sorted(by_key[key])
        group = dist.new_group(members)
        if me in members:
            mine = group
    return mine
