"""What `qlm profile` is told of the machine beside its case: the GPU preset and its overrides, the rates the model
reaches and the memory allowance, each number checked in one place (the errors name the CLI flags)."""

from __future__ import annotations

from dataclasses import dataclass

from qlm_core.config import check_number
from qlm_core.hardware import GpuSpec, gpu_spec
from qlm_core.profile.efficiency import Efficiency
from qlm_core.profile.memory import Allowance


@dataclass(frozen=True)
class MachineOptions:
    gpu: str = "a100-80g"
    gpu_memory_gb: float | None = None
    peak_tflops: float | None = None
    nvlink_gbps: float | None = None
    internode_gbps: float | None = None
    gpus_per_node: int | None = None
    nvlink_domain: int | None = None
    efficiency: float | None = None  # None: the fitted rates of the GPU's family
    comm_efficiency: float | None = None
    allocator_fraction: float = 0.08
    context_gb: float = 1.0

    def __post_init__(self):
        for flag, value in (("--efficiency", self.efficiency), ("--comm-efficiency", self.comm_efficiency)):
            check_number(flag, value, above=0, most=1, meaning="a fraction of peak, e.g. 0.45")
        for flag, value in (("--gpu-memory-gb", self.gpu_memory_gb), ("--peak-tflops", self.peak_tflops),
                            ("--nvlink-gbps", self.nvlink_gbps), ("--internode-gbps", self.internode_gbps),
                            ("--nvlink-domain", self.nvlink_domain)):
            check_number(flag, value, above=0)
        check_number("--allocator-fraction", self.allocator_fraction, least=0, below=1)
        check_number("--context-gb", self.context_gb, least=0)

    def device(self) -> GpuSpec:
        return gpu_spec(self.gpu, memory_gib=self.gpu_memory_gb, peak_tflops=self.peak_tflops,
                        nvlink_gbps=self.nvlink_gbps, internode_gbps=self.internode_gbps,
                        gpus_per_node=self.gpus_per_node, nvlink_domain=self.nvlink_domain)

    def rates(self) -> Efficiency:
        return Efficiency(compute=self.efficiency, comm=self.comm_efficiency)

    def allowance(self) -> Allowance:
        return Allowance(self.allocator_fraction, self.context_gb)
