"""The bandwidth a process group's collectives get, from where its ranks sit (qlm's rank order: tp fastest, then
cp, pp, dp; the routed experts' etp, ep, edp fold within a pipeline stage; parallel/state.py) and the cluster's
shape.

A group inside one NVLink domain moves data at NVLink speed. A group that spans domains is bound by the NICs:
NCCL runs one ring (channel) per NIC, so a group with k ranks in each domain drives k NICs at once, and its bus
bandwidth is k NICs' worth, at most NVLink's (a data-parallel group of 128 ranks at TP 1 has 8 ranks per node and
gets 8 x 50 GB/s; the same group at TP 8 has 1 rank per node and gets one NIC's 50 GB/s). A point-to-point
transfer between two domains uses one NIC. An expert-parallel all-to-all sends each peer its share: the peers in
the rank's domain over NVLink, the others through the rank's own NIC.
"""

from __future__ import annotations

from collections import Counter
from functools import lru_cache
from itertools import product

from qlm_core.hardware import GpuSpec
from qlm_core.parallel.state import ParallelSizes

DIMS = ("dp", "pp", "cp", "tp")


def group_ranks(sizes: ParallelSizes, dims: tuple[str, ...]) -> list[int]:
    """Global ranks of the group over `dims` that holds rank 0."""
    extents = [getattr(sizes, d) if d in dims else 1 for d in DIMS]
    return sorted(sizes.rank_of(*coords) for coords in product(*(range(n) for n in extents)))


def ranks_per_domain(gpu: GpuSpec, ranks: list[int]) -> tuple[int, int]:
    """(NVLink domains the ranks span, the most ranks in one domain)."""
    domains = Counter(rank // gpu.nvlink_gpus for rank in ranks)
    return len(domains), max(domains.values())


def expert_group_ranks(sizes: ParallelSizes, varying: tuple[str, ...]) -> list[int]:
    """Global ranks of the expert-axes group that holds rank 0 (parallel/state.py's fold within a pipeline stage:
    etp fastest, then ep, then edp): varying ("ep", "etp") the all-to-all group, ("edp",) the experts' data-parallel
    group."""
    return [r for r in range(sizes.world) if sizes.coords(r)["pp"] == 0
            and all(v == 0 for axis, v in sizes.expert_coords(r).items() if axis not in varying)]


@lru_cache(maxsize=4096)
def expert_bandwidth(gpu: GpuSpec, sizes: ParallelSizes, varying: tuple[str, ...], comm: float) -> float:
    """Bytes/s of a collective's bus bandwidth over an expert-axes group (as group_bandwidth)."""
    return _bandwidth(gpu, expert_group_ranks(sizes, varying), comm)


@lru_cache(maxsize=4096)
def all_to_all_seconds(gpu: GpuSpec, sizes: ParallelSizes, nbytes: float, comm: float) -> float:
    """Seconds of an all-to-all over the ep x etp group in which the busiest rank sends (and receives) `nbytes`,
    spread evenly over the group's ranks: the share for ranks in its NVLink domain moves at NVLink speed, the share
    for other domains through this rank's NIC, both at once (NCCL runs them concurrently)."""
    ranks = expert_group_ranks(sizes, ("ep", "etp"))
    domains, per_domain = ranks_per_domain(gpu, ranks)
    n = len(ranks)
    intra = nbytes * (per_domain - 1) / n / (gpu.nvlink_gbps * 1e9 * comm)
    inter = nbytes * (n - per_domain) / n / (gpu.internode_gbps * 1e9 * comm) if domains > 1 else 0.0
    return max(intra, inter)


def expert_group_fits_domain(gpu: GpuSpec, sizes: ParallelSizes) -> bool:
    return ranks_per_domain(gpu, expert_group_ranks(sizes, ("ep", "etp")))[0] == 1


@lru_cache(maxsize=4096)
def group_bandwidth(gpu: GpuSpec, sizes: ParallelSizes, dims: tuple[str, ...], comm: float) -> float:
    """Bytes/s of a collective's bus bandwidth over the group `dims`."""
    return _bandwidth(gpu, group_ranks(sizes, dims), comm)


def _bandwidth(gpu: GpuSpec, ranks: list[int], comm: float) -> float:
    domains, per_domain = ranks_per_domain(gpu, ranks)
    if domains == 1:
        return gpu.nvlink_gbps * 1e9 * comm
    return min(gpu.nvlink_gbps, per_domain * gpu.internode_gbps) * 1e9 * comm


@lru_cache(maxsize=4096)
def p2p_bandwidth(gpu: GpuSpec, sizes: ParallelSizes, comm: float) -> float:
    """Bytes/s of the slowest pipeline hop (one NIC when the pipeline leaves its NVLink domain)."""
    domains, _ = ranks_per_domain(gpu, group_ranks(sizes, ("pp",)))
    return (gpu.nvlink_gbps if domains == 1 else gpu.internode_gbps) * 1e9 * comm
