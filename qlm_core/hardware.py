"""GPU presets for the time and memory models, with user overrides.

Numbers are vendor datasheet figures for the SXM / OAM parts: memory in GiB as the driver reports it (rounded), dense
bf16 tensor-core TFLOP/s (no sparsity), HBM bandwidth, NVLink (AMD: Infinity Fabric) bandwidth per GPU per direction
(half the "bidirectional" figure vendors quote), the NIC bandwidth per GPU of the usual cluster build (one HDR
200 Gb/s InfiniBand NIC per A100/A800, one NDR 400 Gb/s NIC per Hopper, Blackwell or MI300X GPU), the GPUs per node
and the NVLink domain (the GPUs one NVLink fabric joins: a node's 8, or GB200 NVL72's 72). `family` picks the fitted
kernel efficiencies (qlm_core/profile/efficiency.py). Override any figure when your cluster differs
(`--gpu-memory-gb`, `--peak-tflops`, `--nvlink-gbps`, `--internode-gbps`, `--gpus-per-node`, `--nvlink-domain`).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import MutableMapping
from dataclasses import dataclass

from qlm_core.errors import QlmError


@dataclass(frozen=True)
class GpuSpec:
    name: str
    memory_gib: float
    peak_tflops: float  # dense bf16
    hbm_gbps: float  # GB/s
    nvlink_gbps: float  # GB/s per GPU per direction, inside a node
    internode_gbps: float  # GB/s per GPU per direction, across nodes (its NIC)
    gpus_per_node: int = 8
    nvlink_domain: int | None = None  # GPUs joined by NVLink (None: a node's)
    family: str = "hopper"  # whose fitted kernel efficiencies apply (profile/efficiency.py)

    @property
    def nvlink_gpus(self) -> int:
        return self.nvlink_domain or self.gpus_per_node

    def replace(self, **changes) -> GpuSpec:
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})


GPUS: dict[str, GpuSpec] = {
    "a100-40g": GpuSpec("a100-40g", 40.0, 312.0, 1555.0, 300.0, 25.0, family="ampere"),
    "a100-80g": GpuSpec("a100-80g", 80.0, 312.0, 2039.0, 300.0, 25.0, family="ampere"),
    "a800": GpuSpec("a800", 80.0, 312.0, 2039.0, 200.0, 25.0, family="ampere"),  # NVLink cut to 400 GB/s bidir.
    "h100": GpuSpec("h100", 80.0, 989.0, 3350.0, 450.0, 50.0),
    "h800": GpuSpec("h800", 80.0, 989.0, 3350.0, 200.0, 50.0),  # H100 with NVLink cut to 400 GB/s bidirectional
    "h20": GpuSpec("h20", 96.0, 148.0, 4000.0, 450.0, 50.0),
    "h200": GpuSpec("h200", 141.0, 989.0, 4800.0, 450.0, 50.0),
    "b200": GpuSpec("b200", 180.0, 2250.0, 8000.0, 900.0, 50.0, family="blackwell"),
    "gb200": GpuSpec("gb200", 184.0, 2500.0, 8000.0, 900.0, 50.0, gpus_per_node=4, nvlink_domain=72,
                     family="blackwell"),  # NVL72: 18 trays of 4 GPUs on one NVLink fabric
    "mi300x": GpuSpec("mi300x", 192.0, 1307.0, 5300.0, 448.0, 50.0, family="cdna3"),  # Infinity Fabric 7 x 64 GB/s
}


def local_gpu() -> GpuSpec | None:
    """The preset of this machine's CUDA device, told by its name (A100 40/80 GB by its memory); None without CUDA
    or for a device with no preset."""
    import torch  # here, not at the top: the CLI reads GPUS for its option choices before torch is needed

    if not torch.cuda.is_available():
        return None
    device = torch.cuda.get_device_properties(torch.cuda.current_device())
    name = device.name.lower()
    families = sorted({key.split("-")[0] for key in GPUS}, key=len, reverse=True)  # "h200" before "h20"
    family = next((f for f in families if f in name), None)
    if family is None:
        return None
    candidates = [gpu for key, gpu in GPUS.items() if key.split("-")[0] == family]
    return min(candidates, key=lambda gpu: abs(gpu.memory_gib - device.total_memory / 2**30))


def gpu_spec(name: str, **overrides) -> GpuSpec:
    """A preset by name (case and `-sxm` suffix ignored) with any non-None overrides applied."""
    key = name.lower().removesuffix("-sxm")
    if key not in GPUS:
        raise QlmError(f"unknown GPU {name!r}", f"use one of {', '.join(GPUS)} (and --peak-tflops etc. to adjust)")
    gpu = GPUS[key].replace(**overrides)
    for field in ("memory_gib", "peak_tflops", "hbm_gbps", "nvlink_gbps", "internode_gbps", "gpus_per_node",
                  "nvlink_domain"):
        if getattr(gpu, field) is not None and getattr(gpu, field) <= 0:
            raise QlmError(f"{field} must be positive, got {getattr(gpu, field)}", "fix the override")
    return gpu


# torch >= 2.9 reads PYTORCH_ALLOC_CONF first and PYTORCH_CUDA_ALLOC_CONF after it; older torch only the second
ALLOCATOR_CONF_VARIABLES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
EXPANDABLE_SEGMENTS = "expandable_segments:True"


def configure_cuda_allocator(environ: MutableMapping[str, str] | None = None,
                             cuda_available: bool | None = None) -> str | None:
    """On CUDA, PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (as torchtitan runs) unless the user set an allocator
    configuration in either variable: segments then grow in place instead of fragmenting into fixed-size blocks,
    so reserved memory stays close to allocated memory. Returns the value set, None when nothing was. The caching
    allocator reads the variable once, when CUDA first allocates: call this before that (each rank's set-up does),
    and child processes inherit it."""
    environ = os.environ if environ is None else environ
    if cuda_available is None:
        import torch

        cuda_available = torch.cuda.is_available()
    if not cuda_available or any(name in environ for name in ALLOCATOR_CONF_VARIABLES):  # even set empty
        return None
    environ["PYTORCH_CUDA_ALLOC_CONF"] = EXPANDABLE_SEGMENTS
    return EXPANDABLE_SEGMENTS


def empty_device_cache(device) -> bool:
    """Hand the caching allocator's unused blocks of DEVICE (a torch.device) back to the driver (torch.cuda.empty_cache
    and its peers); False for a device without a caching allocator (the CPU)."""
    import torch

    empty = getattr(torch.get_device_module(device.type), "empty_cache", None)
    if empty is None:
        return False
    empty()
    return True


def measure_cpu_peak_tflops(size: int = 1024, repeats: int = 5, min_seconds: float = 0.3) -> float:
    """Best fp32 matmul rate of this process, in TFLOP/s: the fastest of at least `repeats` probes spread over at
    least `min_seconds` (one probe taken while other processes load the cores reads low; the trainer also raises the
    peak when a step runs faster, so MFU stays <= 1)."""
    import torch

    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b
    best, runs, began = float("inf"), 0, time.perf_counter()
    while runs < repeats or (time.perf_counter() - began < min_seconds and runs < 50 * repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
        runs += 1
    return 2 * size**3 / best / 1e12
