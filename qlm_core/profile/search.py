"""`qlm profile --search`: every layout the trainer accepts on N devices, the ones that fit, ranked by s/sample.

Enumerated: tp x pp x cp x dp = N (dp derived), vpp 1-4 where the stages divide (interleaved 1F1B), the 1F1B and
zero-bubble schedules for pp > 1, ZeRO 0-3, recompute none / selective / full, and for cp > 1 every CP comm type.
Fixed: SP on whenever tp > 1 (it only removes memory: the same bytes cross the TP group either way), overlapped
gradient reduce and parameter gather, the case's micro and global batch. Each candidate passes the trainer's own
checks (train.validate.validate_layout and models.layout.ModelLayout: heads, query groups, layers, sequence by
2·cp (and by tp under SP), batch by mbs·dp, schedule rules) before it is costed. For full recompute the search also
tries recomputing only the first N layers of each chunk and keeps the smallest N that fits (it is faster).
GPipe is left out: it holds every micro-batch and is never faster than 1F1B.
MoE models also enumerate expert parallelism (expert_layouts): ep dividing num_experts, etp 1 or tp, ep·etp dividing
the dp·cp·tp ranks of a stage (ep 1 with etp tp is the all-gather dispatch); dense models are enumerated as before.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import product

from qlm_core.config import CpCommType, RecomputeMode, choices
from qlm_core.errors import QlmError
from qlm_core.hardware import GpuSpec
from qlm_core.parallel.pipeline_rules import MULTI_CHUNK_SCHEDULES
from qlm_core.profile.case import ProfileCase, validate_case, validate_inputs
from qlm_core.profile.memory import GIB, Allowance, MemoryEstimate, estimate_memory
from qlm_core.profile.timing import TIME_COMPONENTS, Efficiency, TimeEstimate, estimate_time

RECOMPUTE = choices(RecomputeMode)
CP_COMM = choices(CpCommType)


@dataclass
class Candidate:
    case: ProfileCase
    memory: MemoryEstimate
    time: TimeEstimate

    @property
    def s_per_sample(self) -> float:
        return self.time.s_per_sample

    @property
    def oom_by_gib(self) -> float:
        return max(0.0, -self.memory.headroom_gib)


@dataclass
class SearchResult:
    fitting: list[Candidate]  # ranked, fastest first
    rejected: list[Candidate]  # do not fit, fastest first
    invalid: int  # combinations the trainer would refuse
    gpu: GpuSpec
    notes: list[str] = field(default_factory=list)  # why full-sequence (cp = 1) layouts fail or lose

    @property
    def evaluated(self) -> int:
        return len(self.fitting) + len(self.rejected)


def _divisors(n: int) -> list[int]:
    """The divisors of n in increasing order (by trial division up to sqrt(n): a device count of 10^9 answers at
    once)."""
    small, large = [], []
    d = 1
    while d * d <= n:
        if n % d == 0:
            small.append(d)
            if d * d != n:
                large.append(n // d)
        d += 1
    return small + large[::-1]


def expert_layouts(base: ProfileCase, tp: int, stage_ranks: int) -> list[tuple[int, int | None]]:
    """(ep, etp) candidates of an MoE model on a stage of `stage_ranks` = dp·cp·tp ranks; [(1, None)] when dense."""
    moe = base.spec.moe
    if moe is None:
        return [(1, None)]
    out = []
    for ep in _divisors(moe.num_experts):
        for etp in dict.fromkeys((tp, 1)):
            if stage_ranks % (ep * etp) == 0:
                out.append((ep, None if etp == tp else etp))
    return out


def _grid_passes(base: ProfileCase, num_gpus: int, tp: int, pp: int, cp: int) -> bool:
    """The trainer's rules that tp, pp and cp alone decide (validate_case applies them again to each candidate):
    skipping a grid here changes no result, it only keeps a huge --num-gpus from enumerating what cannot pass."""
    spec, dp = base.spec, num_gpus // (tp * pp * cp)
    return (spec.num_attention_heads % tp == 0 and pp <= spec.num_layers
            and (cp == 1 or base.seq_len % (2 * cp) == 0)
            and base.global_batch_size % (base.micro_batch_size * dp) == 0)


def layout_choices(base: ProfileCase, num_gpus: int) -> list[dict]:
    """Every combination of the parallel fields before validation (dp is what remains of num_gpus)."""
    layers, out = base.spec.num_layers, []
    for tp in _divisors(num_gpus):
        for pp in _divisors(num_gpus // tp):
            for cp in _divisors(num_gpus // (tp * pp)):
                if not _grid_passes(base, num_gpus, tp, pp, cp):
                    continue
                vpps = [1] if pp == 1 else [v for v in (1, 2, 3, 4) if layers % (pp * v) == 0]
                for vpp in vpps:
                    schedules = ["1f1b"] if pp == 1 else (["1f1b", "zero_bubble"] if vpp == 1
                                                          else list(MULTI_CHUNK_SCHEDULES))
                    for schedule in schedules:
                        for (ep, etp), zero in product(expert_layouts(base, tp, num_gpus // pp), (0, 1, 2, 3)):
                            for recompute in RECOMPUTE:
                                for comm in (CP_COMM if cp > 1 else ("p2p",)):
                                    out.append(dict(
                                        tp=tp, pp=pp, vpp=vpp, cp=cp, dp=None, sp=tp > 1, cp_comm_type=comm,
                                        ep=ep, etp=etp,
                                        pp_schedule=schedule, zero_stage=zero, recompute=recompute,
                                        recompute_modules=(list(base.parallel.recompute_modules)
                                                           if recompute == "selective" else ["core_attn"]),
                                        recompute_num_layers=None, overlap_grad_reduce=True,
                                        overlap_param_gather=zero in (1, 2),
                                        num_layers_in_first_pipeline_stage=None,
                                        num_layers_in_last_pipeline_stage=None))
    return out


def layouts(base: ProfileCase, num_gpus: int):
    """Every combination before validation, as cases."""
    for fields in layout_choices(base, num_gpus):
        yield base.replace(num_gpus=num_gpus).with_parallel(**fields)


def _cost(case, gpu, eff, allowance) -> Candidate:
    return Candidate(case, estimate_memory(case, gpu.memory_gib, "cuda", allowance), estimate_time(case, gpu, eff))


def _fewest_recomputed(case: ProfileCase, full: Candidate, gpu, eff, allowance) -> Candidate:
    """The smallest recompute_num_layers (per chunk) that still fits: fewer recomputed layers is faster."""
    per_chunk = case.spec.num_layers // (case.parallel.pp * case.parallel.vpp)
    lo, hi, best = 1, per_chunk - 1, full
    while lo <= hi:
        mid = (lo + hi) // 2
        trial = _cost(case.with_parallel(recompute_num_layers=mid), gpu, eff, allowance)
        if trial.memory.fits:
            best, hi = trial, mid - 1
        else:
            lo = mid + 1
    return best


Progress = Callable[[int, int], None]  # (layouts done, layouts in all), called as the search goes


def search(base: ProfileCase, num_gpus: int, gpu: GpuSpec, eff: Efficiency = Efficiency(),
           allowance: Allowance = Allowance(), progress: Progress | None = None) -> SearchResult:
    validate_inputs(base.replace(num_gpus=num_gpus))  # errors of the input itself, not of one layout
    fitting, rejected, invalid = [], [], 0
    choices_ = layout_choices(base, num_gpus)
    base = base.replace(num_gpus=num_gpus)
    for done, fields in enumerate(choices_):
        if progress is not None and done % 64 == 0:
            progress(done, len(choices_))
        case = base.with_parallel(**fields)
        try:
            validate_case(case)
        except QlmError:
            invalid += 1
            continue
        candidate = _cost(case, gpu, eff, allowance)
        if not candidate.memory.fits:
            rejected.append(candidate)
            continue
        if case.parallel.recompute == "full":
            candidate = _fewest_recomputed(case, candidate, gpu, eff, allowance)
        fitting.append(candidate)
    if progress is not None:
        progress(len(choices_), len(choices_))
    if not fitting and not rejected:
        raise QlmError(f"no layout of {base.model_name} on {num_gpus} GPUs passes the trainer's checks",
                       "change --num-gpus, --seq-len or the batch sizes")
    fitting.sort(key=lambda c: (round(c.s_per_sample, 6), -c.memory.headroom_gib))
    # The rejected that matter are those that would have been fast: near misses first among equally fast ones.
    rejected.sort(key=lambda c: (float(f"{c.s_per_sample:.3g}"), c.oom_by_gib))
    return SearchResult(fitting, rejected, invalid, gpu, explain_full_sequence(fitting, rejected, base.seq_len))


def smallest_fitting(base: ProfileCase, gpu: GpuSpec, eff: Efficiency = Efficiency(),
                     allowance: Allowance = Allowance(), num_gpus: int | None = None,
                     max_gpus: int = 4096, progress: Progress | None = None) -> SearchResult | None:
    """The search on the fewest devices where some layout fits: `num_gpus` when given, else 1, 2, 4, ... up to
    max_gpus; None when nothing fits. The result's fitting[0] is the fastest layout at that device count."""
    validate_inputs(base.replace(num_gpus=num_gpus or 1))
    counts = [num_gpus] if num_gpus else [2**k for k in range(max_gpus.bit_length()) if 2**k <= max_gpus]
    for n in counts:
        try:
            result = search(base, n, gpu, eff, allowance, progress=progress)
        except QlmError:  # no layout of n devices passes the trainer's checks (e.g. the batch by dp)
            continue
        if result.fitting:
            return result
    return None


def _dominant(candidate: Candidate) -> str:
    parts = candidate.memory.heaviest.components
    key = max((k for k in parts if k != "allocator"), key=parts.get)
    return f"{key} {parts[key] / GIB:.1f} GiB"


def explain_full_sequence(fitting: list[Candidate], rejected: list[Candidate], seq_len: int) -> list[str]:
    """Why layouts that keep the whole sequence on each rank (cp = 1) fail or lose."""
    full_fit = [c for c in fitting if c.case.parallel.cp == 1]
    full_oom = [c for c in rejected if c.case.parallel.cp == 1]
    total = len(full_fit) + len(full_oom)
    if not total:
        return []
    notes = [f"without context parallelism each rank holds all {seq_len} tokens: {len(full_oom)} of {total} such "
             f"layouts do not fit."]
    if full_oom:
        worst = min(full_oom, key=lambda c: c.memory.total_gib)
        notes.append(f"the closest to fitting, {worst.case.describe()}, needs {worst.memory.total_gib:.1f} GiB of "
                     f"{worst.memory.capacity_gib:.0f} (OOM by {worst.oom_by_gib:.1f} GiB; largest: "
                     f"{_dominant(worst)}).")
        for mode in ("none", "selective"):
            group = [c for c in full_oom if c.case.parallel.recompute == mode]
            if group and not any(c.case.parallel.recompute == mode for c in full_fit):
                least = min(group, key=lambda c: c.memory.total_gib)
                per_layer = least.memory.heaviest.activation_per_layer / GIB
                # the note is about the cp = 1 layouts; layouts with CP may fit with this mode (and rank above)
                where = ("every layout without CP OOMs (it fits only with context parallelism)"
                         if any(c.case.parallel.recompute == mode for c in fitting) else "every layout OOMs")
                note = (f"recompute {mode}: {where}; at best {least.case.describe()} keeps "
                        f"{per_layer:.2f} GiB per layer per micro-batch, {_dominant(least)}")
                if mode == "selective":
                    note += (" (selective recompute drops only the attention kernel's output and log-sum-exp: "
                             "flash attention keeps no s x s scores to drop)")
                notes.append(note + ".")
    if full_fit and fitting:
        best_full, best = full_fit[0], fitting[0]
        if best.case.parallel.cp > 1:
            notes.append(f"the fastest that fits without CP, {best_full.case.describe()}, is "
                         f"{best_full.s_per_sample / best.s_per_sample - 1:.1%} slower than {best.case.describe()} "
                         f"({why_faster(best, best_full)}) and leaves {best_full.memory.headroom_gib:.1f} GiB "
                         f"against {best.memory.headroom_gib:.1f}.")
    elif not full_fit:
        notes.append("so every layout that fits uses context parallelism.")
    return notes


def why_faster(a: Candidate, b: Candidate, limit: int = 2) -> str:
    """Why `a` is faster than `b`: the per-step components where it saves most (or the tie-break)."""
    diffs = {k: (b.time.components[k] - a.time.components[k]) / a.case.global_batch_size for k in TIME_COMPONENTS}
    gain = b.s_per_sample - a.s_per_sample
    if gain <= 1e-6 * max(b.s_per_sample, 1e-12):
        return f"same predicted time, {a.memory.headroom_gib - b.memory.headroom_gib:+.1f} GiB more headroom"
    top = sorted((k for k in diffs if diffs[k] > 0.05 * gain), key=lambda k: -diffs[k])[:limit]
    parts = ", ".join(f"{k} -{diffs[k]:.3g} s" for k in top)
    return f"-{gain:.3g} s/sample: {parts}"


def resolve_model_case(case: ProfileCase, given: set[str], num_gpus: int | None, search: bool, gpu: GpuSpec,
                       eff: Efficiency, allowance: Allowance, assumed: list[str],
                       progress: Callable[[int, int], None] | None = None) -> tuple[ProfileCase, str]:
    """A model named without a recipe: with no layout option (`given` names the layout options set), the smallest
    layout that fits (the fewest devices, then the fastest; under --search only the device count). Returns the case
    and one line naming it and which of its values are defaults (`assumed`: the options not given)."""
    if given:
        how = (f"layout from {', '.join(sorted('--' + k.replace('_stage', '').replace('_', '-') for k in given))}, "
               f"the rest qlm's defaults")
    else:
        found = smallest_fitting(case, gpu, eff, allowance, num_gpus=num_gpus, progress=progress)
        if found is None:
            how = (f"no layout fits {num_gpus or 'up to 4096'} x {gpu.name}: qlm's default layout shown "
                   f"(try --search, --seq-len, --recompute full)")
        elif search:
            case = case.replace(num_gpus=found.fitting[0].case.num_gpus)
            how = f"the fewest devices where a layout fits: {case.num_gpus}"
        else:
            case = found.fitting[0].case
            how = "the smallest layout that fits (fewest devices, then fastest; any layout option fixes it)"
    line = (f"resolved case: {case.model_name}, seq {case.seq_len}, micro-batch {case.micro_batch_size}, global "
            f"batch {case.global_batch_size}, {case.dtype}"
            + (f" ({', '.join(assumed)} not given: defaults)" if assumed else "")
            + (f"; {case.describe()} on {case.num_gpus} x {gpu.name}" if not search else "")
            + f"; {how}")
    return case, line
