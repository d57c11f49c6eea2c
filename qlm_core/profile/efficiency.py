"""How fast a GPU runs what a training step is made of: fitted constants, by GPU family, and the user's overrides.

  GEMMs        fraction of the dense bf16 peak, rising with the GEMM's size: gemm_max · g / (g + gemm_half), where
               g is the smaller of its two weight dimensions on this rank (hidden 4096 at TP 1 runs closer to the
               peak than hidden 16384 split 8 ways into 2048-wide slices).
  attention    the flash-attention kernel: forward at `attn_fwd` of the peak; its backward does 2.5x the forward's
               FLOPs (five matmuls to two) at `attn_bwd`.
  elementwise  norms, rotary embedding, SwiGLU, residual adds, dropout-free casts: memory-bound, `elementwise`
               bytes per token and layer in units of e·(h + ffn) (forward and backward), at HBM speed.
  collectives  `comm` of the link's bandwidth (NCCL's bus-bandwidth fraction for large messages); communication
               hidden under compute still costs `overlap_penalty` of its duration (NCCL's kernels take SMs).
  overhead     `step_overhead_s` per optimizer step (the launch, data and Python work no kernel hides).

The constants come from bench/profile_calibration.py's fit to published runs (qlm_core/profile/calibration.py);
A100 rows fit "ampere", H100 rows "hopper". Families without published rows here (Blackwell, MI300X) take
Hopper's fit, said as such wherever the profile prints what it assumed. `Efficiency` holds only what a user
overrides (`--efficiency` flattens every kernel to one fraction, as qlm's earlier single-number model did).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from qlm_core.hardware import GpuSpec

ATTENTION_BACKWARD_FLOPS = 2.5  # flash attention's backward / forward FLOPs


@dataclass(frozen=True)
class KernelRates:
    """The constants of one GPU family (see the module docstring)."""

    gemm_max: float
    gemm_half: float
    attn_fwd: float
    attn_bwd: float
    elementwise: float
    comm: float
    overlap_penalty: float
    step_overhead_s: float
    source: str = ""  # where the numbers come from, for the profile's "assumed" lines

    def gemm(self, k: float, n: float) -> float:
        """Fraction of peak of a GEMM with weight dimensions k x n on this rank."""
        g = min(k, n)
        return self.gemm_max * g / (g + self.gemm_half)

    def overlapped(self, comm_s: float, compute_s: float) -> float:
        """Seconds that `comm_s` of communication adds when it runs under `compute_s` of compute."""
        return max(0.0, comm_s - compute_s) + self.overlap_penalty * min(comm_s, compute_s)


# bench/profile_calibration.py --fit writes these (the 32 published runs of calibration_runs.json)
FITTED: dict[str, KernelRates] = {
    "ampere": KernelRates(
        gemm_max=0.7792, gemm_half=730.6131, attn_fwd=0.25, attn_bwd=0.2,
        elementwise=43.1843, comm=0.9, overlap_penalty=0.4488, step_overhead_s=0.1902,
        source='fit to 10 runs of calibration_runs.json'),
    "hopper": KernelRates(
        gemm_max=0.7345, gemm_half=0.0, attn_fwd=0.25, attn_bwd=0.2,
        elementwise=43.1843, comm=0.9, overlap_penalty=0.4488, step_overhead_s=0.1902,
        source='fit to 22 runs of calibration_runs.json'),
}
STAND_IN = {"blackwell": "hopper", "cdna3": "hopper"}  # no published rows: Hopper's fit, said as such


@dataclass(frozen=True)
class Efficiency:
    """The user's overrides of the fitted rates (None: the fit for the GPU's family)."""

    compute: float | None = None  # one fraction of peak for every GEMM and the attention kernel
    comm: float | None = None
    overlap_penalty: float | None = None

    def rates(self, gpu: GpuSpec) -> KernelRates:
        family = gpu.family if gpu.family in FITTED else STAND_IN.get(gpu.family, "hopper")
        rates = FITTED[family]
        if family != gpu.family:
            rates = replace(rates, source=f"{family}'s fit ({gpu.family} has no published runs in the calibration)")
        if self.compute is not None:
            rates = replace(rates, gemm_max=self.compute, gemm_half=0.0, attn_fwd=self.compute,
                            attn_bwd=self.compute, elementwise=0.0, step_overhead_s=0.0,
                            source=f"--efficiency {self.compute:g} for every kernel")
        if self.comm is not None:
            rates = replace(rates, comm=self.comm)
        if self.overlap_penalty is not None:
            rates = replace(rates, overlap_penalty=self.overlap_penalty)
        return rates
