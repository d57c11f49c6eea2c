"""The published training runs the profile's time and memory models are held against (calibration_runs.json: one
row a run — model, GPU, layout, batch, the published tokens/s/GPU and memory, the source and the assumptions that
map it onto qlm's options), each run as a ProfileCase on its GPU, and the error statistics of a prediction.

What each source's framework does that qlm's trainer does not is set per source group (FRAMEWORKS): NeMo overlaps
TP communication (70B and 405B recipes) and pipeline sends and reduces bf16 gradients; Megatron-LM 2021 ran fp16
and reduced gradients in fp16; MosaicML's FSDP `DEFAULT` mixed precision gathers fp32 parameters and reduces in
bf16, and MPT's ALiBi rotates no q and k (the RoPE stand-in would count copies MPT never makes); torchtitan reduces
gradients in fp32.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from qlm_core.config import ParallelConfig
from qlm_core.hardware import GpuSpec, gpu_spec
from qlm_core.models.presets import PRESETS
from qlm_core.models.spec import ModelSpec
from qlm_core.profile.case import ProfileCase
from qlm_core.profile.efficiency import Efficiency
from qlm_core.profile.memory import Allowance, estimate_memory
from qlm_core.profile.timing import estimate_time

RUNS_FILE = Path(__file__).with_name("calibration_runs.json")
# orderings the sources publish (the ratio between two runs of one table), for rows outside RUNS_FILE (Float8)
ORDERINGS_FILE = Path(__file__).with_name("calibration_orderings.json")

# Targets of issue 14, held by tests/profile/test_profile_calibration.py
MEDIAN_ERROR_AT_MOST = 0.10
WITHIN_15_AT_LEAST = 24
WORST_RATIO_AT_MOST = 1.5
MEMORY_ERROR_AT_MOST = 0.15

FRAMEWORKS = {  # source group prefix -> what its framework does (ProfileCase fields)
    "torchtitan": dict(framework_reduce_dtype="fp32", loss_chunk_tokens=0),  # its loss takes the whole logits
    # NeMo's performance recipes (performance_mode) set plugins.grad_reduce_in_fp32 = False: bf16 main grads
    "NeMo": dict(framework_reduce_dtype="bf16", p2p_overlap=True),
    "Megatron-LM 2021": dict(framework_reduce_dtype="fp16", dtype="fp16"),
    "MosaicML": dict(framework_reduce_dtype="bf16", param_gather_dtype="fp32", rotary=False),  # ALiBi positions
}


@dataclass
class CalibrationRun:
    id: str
    group: str
    case: ProfileCase
    gpu: GpuSpec
    published_tokens_per_s: float
    published_memory_gib: float | None
    row: dict = field(repr=False)


@dataclass
class RunResult:
    run: CalibrationRun
    predicted_tokens_per_s: float
    memory_gib: float
    fits: bool
    megatron_mfu: float
    mfu: float

    @property
    def ratio(self) -> float:
        """Predicted / published tokens/s/GPU."""
        return self.predicted_tokens_per_s / self.run.published_tokens_per_s

    @property
    def memory_error(self) -> float | None:
        published = self.run.published_memory_gib
        return None if published is None else self.memory_gib / published - 1


def _framework(group: str) -> dict:
    return next((v for k, v in FRAMEWORKS.items() if group.startswith(k)), {})


def case_of(fields: dict, spec: ModelSpec, model_name: str, num_gpus: int, group: str) -> ProfileCase:
    """A published run's configuration (the rows' field names) as a ProfileCase, plus what its framework does that
    qlm's trainer does not."""
    framework = dict(_framework(group))
    dtype = framework.pop("dtype", fields.get("precision", "bf16"))
    recompute = fields["recompute"]
    if group.startswith("torchtitan") and recompute == "selective":
        recompute = "op"  # torchtitan's selective_ac_option = "op" (the row maps it to selective: qlm had no op)
    parallel = ParallelConfig(
        tp=fields.get("tp", 1), pp=fields.get("pp", 1), vpp=fields.get("vpp", 1), cp=fields.get("cp", 1),
        dp=fields["dp"], sp=fields.get("sp", False), zero_stage=fields["zero"], recompute=recompute,
        pp_schedule=fields.get("pp_schedule", "1f1b"), cp_comm_type=fields.get("cp_comm_type", "p2p"),
        overlap_grad_reduce=True, overlap_param_gather=fields["zero"] in (1, 2))
    tp_overlap = "tp_comm_overlap" in fields.get("not_expressible", [])  # the source overlaps it; qlm's trainer not
    return ProfileCase(spec=spec, model_name=model_name, parallel=parallel, seq_len=fields["seq_len"],
                       micro_batch_size=fields["mbs"], global_batch_size=fields["gbs"], num_gpus=num_gpus,
                       dtype=dtype, tp_comm_overlap=tp_overlap, **framework)


def run_from_row(row: dict) -> CalibrationRun:
    model = row["model"]
    spec = PRESETS[model["preset"]] if model.get("preset") else ModelSpec.from_hf_config(model["hf_config"])
    case = case_of(row, spec, model["name"], row["num_gpus"], row["group"])
    gpu = gpu_spec(row["gpu"], memory_gib=row.get("gpu_memory_gb"))
    published = row["published"]
    return CalibrationRun(row["id"], row["group"], case, gpu, float(published["tokens_per_s_per_gpu"]),
                          published.get("memory_gib"), row)


def load_runs(path: Path = RUNS_FILE) -> list[CalibrationRun]:
    return [run_from_row(row) for row in json.loads(Path(path).read_text())]


def evaluate(runs: list[CalibrationRun], eff: Efficiency = Efficiency(),
             allowance: Allowance = Allowance()) -> list[RunResult]:
    results = []
    for run in runs:
        time = estimate_time(run.case, run.gpu, eff)
        memory = estimate_memory(run.case, run.gpu.memory_gib, "cuda", allowance)
        results.append(RunResult(run, time.tokens_per_s_per_device, memory.total_gib, memory.fits,
                                 time.megatron_mfu, time.mfu))
    return results


def statistics_of(results: list[RunResult]) -> dict:
    """The figures issue 14's targets name."""
    errors = [abs(r.ratio - 1) for r in results]
    worst = max(results, key=lambda r: max(r.ratio, 1 / r.ratio))
    memory_errors = [abs(r.memory_error) for r in results if r.memory_error is not None]
    return {
        "runs": len(results),
        "median_abs_error": statistics.median(errors),
        "within_10": sum(e <= 0.10 for e in errors),
        "within_15": sum(e <= 0.15 for e in errors),
        "worst_run": worst.run.id,
        "worst_factor": max(worst.ratio, 1 / worst.ratio),
        "predicted_not_to_fit": [r.run.id for r in results if not r.fits],
        "memory_runs": len(memory_errors),
        "memory_worst_abs_error": max(memory_errors, default=0.0),
    }


@dataclass
class OrderingStep:
    ordering: str  # its id in ORDERINGS_FILE
    what: str
    change: str  # "A -> B"
    published_ratio: float  # tokens/s/GPU of B / of A
    predicted_ratio: float

    @property
    def error(self) -> float:
        return self.predicted_ratio / self.published_ratio - 1


def _named_spec(name: str) -> ModelSpec:
    if name in PRESETS:
        return PRESETS[name]
    rows = json.loads(RUNS_FILE.read_text())
    return ModelSpec.from_hf_config(next(r["model"]["hf_config"] for r in rows if r["model"]["name"] == name))


def _published_rate(row: dict) -> float:
    """tokens/s/GPU, or TFLOP/s/GPU where the table gives that (its rows share model and sequence, so the ratio
    between two rows is the same)."""
    return float(row["tokens_per_s_per_gpu"] if "tokens_per_s_per_gpu" in row else row["tflops_per_gpu"])


def evaluate_orderings(eff: Efficiency = Efficiency(), path: Path = ORDERINGS_FILE) -> list[OrderingStep]:
    """Each published table's consecutive rows as (published, predicted) ratios of tokens/s/GPU."""
    steps = []
    for ordering in json.loads(Path(path).read_text()):
        spec = (ModelSpec.from_hf_config(ordering["hf_config"]) if "hf_config" in ordering
                else _named_spec(ordering["model"]))
        gpu = gpu_spec(ordering["gpu"], memory_gib=ordering.get("gpu_memory_gb"))
        group = ordering.get("group", "torchtitan")
        rates = []
        for row in ordering["rows"]:
            num_gpus = row.get("num_gpus", ordering.get("num_gpus"))
            case = case_of({**ordering["common"], **row}, spec, ordering["model"], num_gpus, group)
            rates.append((row["label"], _published_rate(row), estimate_time(case, gpu, eff)))
        for (label_a, published_a, time_a), (label_b, published_b, time_b) in zip(rates, rates[1:], strict=False):
            steps.append(OrderingStep(ordering["id"], ordering["what"], f"{label_a} -> {label_b}",
                                      published_b / published_a,
                                      time_b.tokens_per_s_per_device / time_a.tokens_per_s_per_device))
    return steps
