"""The bandwidth a process group's collectives get, from where its ranks sit (qlm's rank order: tp fastest, then
cp, pp, dp; parallel/state.py) and the cluster's shape.

A group inside one NVLink domain moves data at NVLink speed. A group that spans domains is bound by the NICs:
NCCL runs one ring (channel) per NIC, so a group with k ranks in each domain drives k NICs at once, and its bus
bandwidth is k NICs' worth, at most NVLink's (a data-parallel group of 128 ranks at TP 1 has 8 ranks per node and
gets 8 x 50 GB/s; the same group at TP 8 has 1 rank per node and gets one NIC's 50 GB/s). A point-to-point
transfer between two domains uses one NIC.
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


@lru_cache(maxsize=4096)
def group_bandwidth(gpu: GpuSpec, sizes: ParallelSizes, dims: tuple[str, ...], comm: float) -> float:
    """Bytes/s of a collective's bus bandwidth over the group `dims`."""
    domains, per_domain = ranks_per_domain(gpu, group_ranks(sizes, dims))
    if domains == 1:
        return gpu.nvlink_gbps * 1e9 * comm
    return min(gpu.nvlink_gbps, per_domain * gpu.internode_gbps) * 1e9 * comm


@lru_cache(maxsize=4096)
def p2p_bandwidth(gpu: GpuSpec, sizes: ParallelSizes, comm: float) -> float:
    """Bytes/s of the slowest pipeline hop (one NIC when the pipeline leaves its NVLink domain)."""
    domains, _ = ranks_per_domain(gpu, group_ranks(sizes, ("pp",)))
    return (gpu.nvlink_gbps if domains == 1 else gpu.internode_gbps) * 1e9 * comm
