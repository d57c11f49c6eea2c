"""`qlm profile --probe`: run a few real training steps of the layout through the trainer's Engine and set what was
measured beside what memory.py / timing.py predict for the very same case.

On a CPU-only machine the model is scaled down to a tiny one of the same structure (the same heads and query groups,
head dim 8, the same FFN/hidden and vocabulary/hidden ratios, 2 layers per pipeline chunk; MoE: the same experts and
top-k, their sizes in the same ratio), the sequence to a few
hundred tokens divisible as the layout needs (a chunked loss keeps its number of chunks where the tokens allow), and
data parallelism to at most 2; the ranks are gloo processes.
On GPUs the model is the real one and data parallelism shrinks only to fit the local devices. Measured:
  weights / grads / optimizer  the bytes of the tensors the Engine allocated (after one step)
  activations / logits_loss    peak live bytes saved for backward during a step (saved-tensor hooks, each storage
                               once), split at the peak into the layers (+ embedding) and the loss region
  total                        CUDA: torch.cuda.max_memory_allocated(); CPU: the sum of the measured components
  comm_buffers                 ZeRO 2: the peak bucket storage GradientBuffers borrowed during backward
  rollout                      RL: a leader's rollout model, and the peak of its weight sync and decoding above the
                               training step's (profile/probe_rl.py); with the seconds of each beside the prediction
  expert load                  expert parallelism: the rows the rank's MoE layers received over those they sent
                               (measure.ExpertLoadMeter); the prediction is made at the measured rank's load (a
                               tiny random router is not the full model's), the case's allowance is reported beside
Other transients (workspace, pipeline buffers, ZeRO 3's gathered parameters) and the allocator allowance are only
predicted on CPU: hooks do not see them.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from qlm_core.errors import QlmError
from qlm_core.hardware import GpuSpec
from qlm_core.parallel.cross_entropy import loss_is_chunked
from qlm_core.profile.case import ProfileCase, case_to_dict, validate_case
from qlm_core.profile.memory import GIB, Allowance, estimate_memory
from qlm_core.profile.timing import Efficiency, estimate_time

MEASURED = ("weights", "grads", "optimizer", "activations", "logits_loss")
CPU_STEP_OVERHEAD_NOTE = "CPU step times of a tiny model are dominated by per-operation overhead, not FLOPs"


@dataclass
class ProbeResult:
    case: ProfileCase  # the case that ran (scaled down on CPU)
    device: str
    stage: int
    predicted: dict[str, float]  # bytes, memory.COMPONENTS of that stage
    measured: dict[str, float]  # bytes, MEASURED (+ "total" on CUDA)
    predicted_s_per_sample: float
    measured_s_per_sample: float
    expert_load: float | None = None  # EP: the measured rank's rows received / sent (the prediction's load)
    rl_times: dict[str, tuple[float, float]] | None = None  # RL: (predicted, measured) seconds of rl_sync, rl_generate

    def error(self, key: str) -> float | None:
        if key not in self.measured or not self.measured[key]:
            return None
        return self.predicted_of(key) / self.measured[key] - 1

    def predicted_of(self, key: str) -> float:
        if key == "total":
            return self.predicted_total_comparable
        return self.predicted[key]

    @property
    def predicted_total_comparable(self) -> float:
        """What the measured total covers: every allocated component on CUDA, the measured ones on CPU."""
        if self.device == "cuda":
            return sum(v for k, v in self.predicted.items() if k != "allocator")
        return sum(self.predicted[k] for k in self.measured_keys)

    @property
    def measured_keys(self) -> tuple[str, ...]:
        return MEASURED + (("rollout",) if "rollout" in self.measured else ())

    @property
    def measured_total(self) -> float:
        return self.measured.get("total") or sum(self.measured[k] for k in self.measured_keys)


def _round_up(value: int, unit: int) -> int:
    return -(-value // unit) * unit


def scale_down(case: ProfileCase, max_ranks: int = 16, target_seq: int = 128) -> ProfileCase:
    """A CPU-sized case with the layout and the model's structure kept (see the module docstring)."""
    p, s = case.parallel, case.spec
    d = 8
    hidden = s.num_attention_heads * d
    ffn = max(2 * p.tp, _round_up(round(s.ffn_hidden_size / s.hidden_size * hidden), 2 * p.tp))
    vocab = max(256, round(s.vocab_size / s.hidden_size * hidden))
    layers = p.pp * p.vpp * 2
    unit = math.lcm(2 * p.cp if p.cp > 1 else 1, p.cp * p.tp if p.sp and p.tp > 1 else 1)
    seq = _round_up(target_seq, unit)
    model_ranks = p.tp * p.pp * p.cp
    experts = case.sizes.ep * case.sizes.etp  # ep·etp must divide dp·cp·tp: the fewest data ranks that allow it
    least_dp = experts // math.gcd(experts, p.cp * p.tp)
    dp = max(min(case.sizes.dp, 2), least_dp)
    if model_ranks * dp > max_ranks:
        dp = least_dp
    if model_ranks * dp > max_ranks:
        raise QlmError(f"the layout needs {model_ranks * dp} ranks even with dp = {dp}; a CPU probe runs at most "
                       f"{max_ranks}", "raise --probe-max-ranks or probe a smaller tp/pp/cp/ep")
    m = case.num_microbatches
    m = min(m, 2) if p.pp == 1 else (p.pp * (2 if p.vpp > 1 else 1) if m >= p.pp else m)
    spec = s.replace(hidden_size=hidden, ffn_hidden_size=ffn, num_layers=layers, kv_channels=d, vocab_size=vocab,
                     max_position_embeddings=max(seq, 256), sliding_window=None, window_layers=None,
                     moe=_scaled_moe(s, hidden, layers, math.lcm(p.tp, case.sizes.etp)))
    parallel = replace(p, dp=None, num_layers_in_first_pipeline_stage=None, num_layers_in_last_pipeline_stage=None,
                       recompute_num_layers=None if p.recompute_num_layers is None else min(p.recompute_num_layers, 2))
    tokens, chunk = case.micro_batch_size * case.seq_len // p.cp, case.loss_chunk_tokens
    if loss_is_chunked(chunk, tokens):  # a chunked loss stays chunked, in as many chunks as far as the tokens allow
        scaled_tokens = case.micro_batch_size * seq // p.cp
        chunk = max(1, min(round(chunk * scaled_tokens / tokens), scaled_tokens - 1))
    # RL: completions keep their share of the sequence, at most half of it (the prompt keeps the rest)
    completion = max(1, min(round(case.rl_completion_tokens * seq / case.seq_len), seq // 2))
    scaled = case.replace(spec=spec, model_name=f"{case.model_name} (scaled down)", parallel=parallel, seq_len=seq,
                          global_batch_size=case.micro_batch_size * dp * m, num_gpus=model_ranks * dp,
                          loss_chunk_tokens=chunk, rl_completion_tokens=completion)
    validate_case(scaled)
    return scaled


def _scaled_moe(spec, hidden: int, layers: int, tp: int):
    """The experts of a scaled-down model: the same number, top-k and routing, expert and shared-expert sizes in
    the same ratio to the hidden size, the layer pattern's first `layers` entries."""
    moe = spec.moe
    if moe is None:
        return None

    def scaled(size: int) -> int:  # `tp`: what the sizes split over (tp, and etp for the experts)
        return size and max(2 * tp, _round_up(round(size / spec.hidden_size * hidden), 2 * tp))
    pattern = moe.layer_pattern[:layers]
    return replace(moe, ffn_hidden_size=scaled(moe.ffn_hidden_size),
                   shared_expert_hidden_size=scaled(moe.shared_expert_hidden_size),
                   layer_pattern=() if all(pattern) else pattern)


def fit_to_gpus(case: ProfileCase, devices: int) -> ProfileCase:
    """The real model on the local GPUs: data parallelism shrinks to what fits (the global batch with it)."""
    p = case.parallel
    model_ranks = p.tp * p.pp * p.cp
    if model_ranks > devices:
        raise QlmError(f"the layout needs {model_ranks} GPUs even with dp = 1; this machine has {devices}",
                       "probe a smaller tp/pp/cp or run on more GPUs")
    dp = min(case.sizes.dp, devices // model_ranks)
    if dp == case.sizes.dp:
        return case
    m = case.num_microbatches
    return case.replace(parallel=replace(p, dp=None), num_gpus=model_ranks * dp,
                        global_batch_size=case.micro_batch_size * dp * m)


Progress = Callable[[int, int], None]  # (steps done, steps in all) of the probe's rank 0


def _read_progress(path: Path) -> tuple[int, int] | None:
    try:
        done, total = path.read_text().split()
        return int(done), int(total)
    except (OSError, ValueError):
        return None


def run_probe_ranks(case: ProfileCase, steps: int, timeout_s: float = 900,
                    progress: Progress | None = None) -> list[dict]:
    """Every rank's measurements: in this process for one rank, else one torchrun launch."""
    from qlm_core.profile.probe_worker import run_rank

    if case.num_gpus == 1:
        from qlm_core.parallel.state import Grid

        return [run_rank(case, steps, Grid.single(), on_step=progress)]
    with tempfile.TemporaryDirectory(prefix="qlm-probe-") as tmp:
        out = Path(tmp)
        (out / "case.json").write_text(json.dumps(case_to_dict(case)))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={case.num_gpus}",
               "-m", "qlm_core.profile.probe_worker", str(out / "case.json"), str(out), str(steps)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        with subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
                              start_new_session=True) as proc:
            stderr = _wait(proc, out / "progress", timeout_s, progress)
        errors = sorted(out.glob("rank*.error"))
        if proc.returncode or errors:
            detail = errors[0].read_text().strip().splitlines()[-1] if errors else stderr.strip()[-500:]
            raise QlmError(f"the probe's ranks failed: {detail}", "see the message; the layout itself is valid")
        return [json.loads(f.read_text()) for f in sorted(out.glob("rank*.json"))]


def _wait(proc: subprocess.Popen, progress_file: Path, timeout_s: float, progress: Progress | None) -> str:
    """The launch's stderr once it has ended, reporting rank 0's steps meanwhile; stopped (its whole process group)
    after timeout_s."""
    import threading

    chunks: list[str] = []
    reader = threading.Thread(target=lambda: chunks.append(proc.stderr.read()), daemon=True)
    reader.start()  # a full stderr pipe must not stall the ranks
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None:
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise QlmError(f"the probe did not finish in {timeout_s:.0f} s", "probe a smaller layout")
        if progress is not None and (seen := _read_progress(progress_file)) is not None:
            progress(*seen)
        time.sleep(0.2)
    reader.join()
    return "".join(chunks)


def probe(case: ProfileCase, gpu: GpuSpec, *, steps: int = 3, efficiency: Efficiency = Efficiency(),
          allowance: Allowance = Allowance(), max_ranks: int = 16, progress: Progress | None = None) -> ProbeResult:
    cuda = torch.cuda.is_available()
    ran = fit_to_gpus(case, torch.cuda.device_count()) if cuda else scale_down(case, max_ranks)
    if ran.rl:  # reward models are not loaded (probe_rl.py): predicted without them
        ran = ran.replace(rl_reward_model_params=0)
    device = "cuda" if cuda else "cpu"
    if not cuda:  # a CPU "device": all of its RAM, its fp32 matmul peak, loopback links
        from qlm_core.hardware import measure_cpu_peak_tflops

        peak = measure_cpu_peak_tflops()
        gpu = replace(gpu, name="cpu", peak_tflops=peak, hbm_gbps=10.0, nvlink_gbps=2.0, internode_gbps=2.0)
        allowance = Allowance(0.0, 0.0)
        efficiency = Efficiency(compute=1.0, comm=1.0)
    ranks = run_probe_ranks(ran, steps, progress=progress)
    memory = estimate_memory(ran, gpu.memory_gib, device, allowance)
    stage = memory.heaviest.stage
    mine = [r for r in ranks if r["stage"] == stage]
    worst = max(mine, key=lambda r: sum(r["states"].values()) + r["activations"] + r["logits_loss"]
                + r.get("rollout", 0))
    load = worst.get("expert_load")
    if load is not None:  # predict at the load the measured rank saw (ProfileCase.moe_imbalance, unchecked here)
        memory = estimate_memory(ran.replace(moe_imbalance=load), gpu.memory_gib, device, allowance)
    measured = {**{k: float(v) for k, v in worst["states"].items()}, "activations": float(worst["activations"]),
                "logits_loss": float(worst["logits_loss"])}
    for key in ("comm_buffers", "rollout"):
        if key in worst:
            measured[key] = float(worst[key])
    if worst.get("max_allocated"):
        measured["total"] = float(max(r["max_allocated"] for r in mine))
    step_s = max(sum(r["step_times"]) / len(r["step_times"]) for r in ranks)
    predicted = estimate_time(ran, gpu, efficiency)
    rl_times = None
    if ran.rl:  # the slowest rank's (a leader's, or a rank waiting for one), beside the prediction
        leaders = [r["rl_times"] for r in ranks if "rl_times" in r]
        rl_times = {key: (predicted.components[key], max(t[key] for t in leaders)) for key in leaders[0]}
    return ProbeResult(ran, device, stage, dict(memory.stages[stage].components), measured,
                       predicted.s_per_sample, step_s / ran.global_batch_size, load, rl_times)


def probe_rows(result: ProbeResult) -> list[tuple[str, float, float | None, float | None]]:
    """(component, predicted GiB, measured GiB or None, relative error or None), then the total."""
    rows = []
    for key, value in result.predicted.items():
        measured = result.measured.get(key)
        rows.append((key, value / GIB, None if measured is None else measured / GIB, result.error(key)))
    total_measured = result.measured_total
    error = result.predicted_total_comparable / total_measured - 1 if total_measured else None
    rows.append(("total (measured part)" if result.device == "cpu" else "total (max allocated)",
                 result.predicted_total_comparable / GIB, total_measured / GIB, error))
    return rows
