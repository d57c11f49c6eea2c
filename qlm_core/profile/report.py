"""The `--json` documents of `qlm profile` (stable keys, documented in the README) and the `--plot` PNG."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

from qlm_core.checkpoint.io.staging import probe_writable
from qlm_core.disk import replace_atomically
from qlm_core.errors import QlmError
from qlm_core.hardware import GpuSpec
from qlm_core.models.activations import activation_kind
from qlm_core.models.parameters import num_parameters
from qlm_core.models.spec import parameters_text
from qlm_core.profile.case import ProfileCase
from qlm_core.profile.efficiency import KernelRates
from qlm_core.profile.memory import COMPONENTS, GIB, Allowance, MemoryEstimate
from qlm_core.profile.probe import ProbeResult
from qlm_core.profile.search import SearchResult, why_faster
from qlm_core.profile.timing import TIME_COMPONENTS, Efficiency, TimeEstimate
from qlm_core.profile.topology import group_bandwidth, p2p_bandwidth

SCHEMA = "qlm-profile/1"


def _r(value: float, digits: int = 4) -> float:
    return round(float(value), digits)


def model_dict(case: ProfileCase) -> dict:
    s = case.spec
    return {"name": case.model_name, "parameters": num_parameters(s),
            "active_parameters": num_parameters(s, active=True), "hidden_size": s.hidden_size,
            "ffn_hidden_size": s.ffn_hidden_size, "num_layers": s.num_layers,
            "num_attention_heads": s.num_attention_heads, "num_query_groups": s.num_query_groups,
            "vocab_size": s.vocab_size, "moe": moe_dict(s.moe)}


def parameters_line(spec) -> str:
    """The model's parameter count; an MoE model's total and active (per token) counts and its experts."""
    counts = parameters_text(num_parameters(spec), num_parameters(spec, active=True))
    if spec.moe is None:
        return f"parameters: {counts}"
    moe = spec.moe
    shared = f", shared expert FFN {moe.shared_expert_hidden_size:,}" if moe.shared_expert_hidden_size else ""
    return (f"parameters: {counts} per token (MoE: {moe.num_experts} experts, top-{moe.topk}, expert FFN "
            f"{moe.ffn_hidden_size:,}{shared}; {moe.num_moe_layers(spec.num_layers)} of {spec.num_layers} layers)")


def moe_dict(moe) -> dict | None:
    if moe is None:
        return None
    return {"num_experts": moe.num_experts, "topk": moe.topk, "ffn_hidden_size": moe.ffn_hidden_size,
            "shared_expert_hidden_size": moe.shared_expert_hidden_size,
            "moe_layers": None if not moe.layer_pattern else sum(moe.layer_pattern)}


def layout_dict(case: ProfileCase) -> dict:
    p = case.parallel
    return {
        "describe": case.describe(), "num_gpus": case.num_gpus, "tp": p.tp, "pp": p.pp, "vpp": p.vpp, "cp": p.cp,
        "dp": case.sizes.dp, "sp": p.sp, "cp_comm_type": p.cp_comm_type, "pp_schedule": p.pp_schedule,
        "zero_stage": p.zero_stage, "recompute": p.recompute, "recompute_num_layers": p.recompute_num_layers,
        "overlap_grad_reduce": p.overlap_grad_reduce, "overlap_param_gather": p.overlap_param_gather,
        "bucket_size_mb": p.bucket_size_mb, "grad_reduce_dtype": case.grad_reduce_dtype, "seq_len": case.seq_len,
        "micro_batch_size": case.micro_batch_size,
        "global_batch_size": case.global_batch_size, "num_microbatches": case.num_microbatches,
        "dtype": case.dtype, "lora_rank": case.lora_rank, "loss_chunk_tokens": case.loss_chunk_tokens,
        "mean_doc_len": case.mean_doc_len, "ep": case.sizes.ep, "etp": case.sizes.etp,
        "edp": case.sizes.edp if case.expert_parallel else None,
        "moe_imbalance": case.load_factor if case.expert_parallel else None,
        "preference_reference": case.preference_reference or None,
    }


def gpu_dict(gpu: GpuSpec, eff: Efficiency) -> dict:
    rates = eff.rates(gpu)
    return {"name": gpu.name, "memory_gib": gpu.memory_gib, "peak_tflops": gpu.peak_tflops,
            "hbm_gbps": gpu.hbm_gbps, "nvlink_gbps": gpu.nvlink_gbps, "internode_gbps": gpu.internode_gbps,
            "gpus_per_node": gpu.gpus_per_node, "nvlink_domain": gpu.nvlink_gpus, "family": gpu.family,
            "rates": {k: v for k, v in dataclasses.asdict(rates).items()},
            "comm_efficiency": rates.comm, "overlap_penalty": rates.overlap_penalty}


def memory_dict(memory: MemoryEstimate, allowance: Allowance) -> dict:
    heavy = memory.heaviest
    return {
        "stage": heavy.stage,
        "components_gib": {k: _r(heavy.components[k] / GIB) for k in COMPONENTS},
        "total_gib": _r(memory.total_gib), "capacity_gib": memory.capacity_gib,
        "headroom_gib": _r(memory.headroom_gib), "fits": memory.fits,
        "activation_per_layer_gib": _r(heavy.activation_per_layer / GIB, 6),
        "inflight_microbatches": _r(heavy.inflight_microbatches, 3), "layers": heavy.layers,
        "stages_total_gib": [_r(s.total / GIB) for s in memory.stages],
        "allocator": {"fraction": allowance.fraction, "context_gib": allowance.context_gib},
    }


def time_dict(time: TimeEstimate) -> dict:
    return {
        "step_s": _r(time.step_s), "s_per_sample": _r(time.s_per_sample),
        "tokens_per_s_per_device": _r(time.tokens_per_s_per_device, 2),
        "tflops_per_device": _r(time.tflops_per_device, 2), "mfu": _r(time.mfu),
        "megatron_tflops_per_device": _r(time.megatron_tflops_per_device, 2), "megatron_mfu": _r(time.megatron_mfu),
        "components_s": {k: _r(time.components[k]) for k in TIME_COMPONENTS},
    }


def assumed_lines(case: ProfileCase, gpu: GpuSpec, rates: KernelRates) -> list[str]:
    """What the time model assumed, so that a user can see why it predicts what it does."""
    p, sizes = case.parallel, case.sizes
    gemm = rates.gemm(case.spec.hidden_size, case.spec.ffn_hidden_size / p.tp)
    lines = [f"kernels ({rates.source}): GEMMs at {gemm:.0%} of {gpu.peak_tflops:g} TFLOP/s for this model's "
             f"shapes, flash attention forward {rates.attn_fwd:.0%} and backward {rates.attn_bwd:.0%}, "
             f"{rates.step_overhead_s:.3g} s per step of overhead"]
    links = []
    for name, dims, size in (("tp", ("tp",), p.tp), ("cp", ("cp",), p.cp), ("dp", ("dp", "cp"), sizes.dp * p.cp)):
        if size > 1:
            links.append(f"{name} {group_bandwidth(gpu, sizes, dims, rates.comm) / 1e9:,.0f} GB/s")
    if p.pp > 1:
        links.append(f"pp sends {p2p_bandwidth(gpu, sizes, rates.comm) / 1e9:,.0f} GB/s")
    if links:
        lines.append(f"links ({gpu.nvlink_gpus} GPUs per NVLink domain, {gpu.internode_gbps:g} GB/s NIC per GPU, "
                     f"{rates.comm:.0%} of the link): " + ", ".join(links))
    overlaps = [name for name, on in (("grad reduce", p.overlap_grad_reduce), ("param gather", p.overlap_param_gather),
                                      ("TP comm", case.tp_comm_overlap), ("pipeline sends", case.p2p_overlap)) if on]
    lines.append(f"overlapped: {', '.join(overlaps) or 'nothing'} (hidden communication costs "
                 f"{rates.overlap_penalty:.0%} of itself); gradients reduced in {case.grad_reduce_dtype}")
    moe = case.spec.moe
    if moe is not None:
        options = case.moe
        routing = "drop-less" if options.capacity_factor is None else f"capacity factor {options.capacity_factor:g}"
        losses = "kept" if options.aux_loss_coeff or options.z_loss_coeff else "not kept (no coefficient)"
        if case.expert_parallel:
            lines.append(_expert_parallel_line(case, gpu, rates, routing, losses))
        else:
            rows = case.micro_batch_size * case.seq_len // p.cp * moe.topk
            lines.append(f"MoE: {routing} routing, {rows:,} routed rows per micro-batch on every TP rank (all-gather "
                         f"dispatch, no expert parallelism), expert GEMMs at "
                         f"{rates.gemm(case.spec.hidden_size, moe.ffn_hidden_size / p.tp):.0%} for their shape, the "
                         f"permutation at HBM speed; aux/z-loss graphs {losses}")
    return lines


def _expert_parallel_line(case: ProfileCase, gpu: GpuSpec, rates: KernelRates, routing: str, losses: str) -> str:
    """The EP assumptions: experts per rank, the load allowance, all-to-all volume per layer and its links."""
    from qlm_core.profile.moe_timing import ep_layer_bytes, expert_ffn
    from qlm_core.profile.topology import all_to_all_seconds, expert_bandwidth, expert_group_fits_domain

    p, sizes, moe = case.parallel, case.sizes, case.spec.moe
    T = case.micro_batch_size * case.seq_len / p.cp
    token_bytes, counts = ep_layer_bytes(case, T, 1)
    seconds = all_to_all_seconds(gpu, sizes, token_bytes + counts, rates.comm)
    where = ("inside one NVLink domain" if expert_group_fits_domain(gpu, sizes)
             else f"across NVLink domains (the NIC's {gpu.internode_gbps:g} GB/s for the remote share)")
    edp_bw = expert_bandwidth(gpu, sizes, ("edp",), rates.comm) / 1e9 if sizes.edp > 1 else 0.0
    fc1_rows = activation_kind(case.spec).fc1_rows(expert_ffn(case))
    return (f"MoE expert parallelism: ep {sizes.ep} x etp {sizes.etp} (edp {sizes.edp}"
            + (f", expert gradients over {edp_bw:,.0f} GB/s" if sizes.edp > 1 else "") + "), "
            f"{moe.num_experts // sizes.ep} experts of FFN {expert_ffn(case):g} per rank; {routing} routing sized "
            f"for a busiest-rank load of {case.load_factor:g}x the mean (--moe-imbalance); all-to-all per MoE layer "
            f"and micro-batch (forward + backward, counts included) {(token_bytes + counts) / 2**20:,.1f} MiB on "
            f"the busiest rank, {seconds * 1e3:.3g} ms {where}; expert GEMMs at "
            f"{rates.gemm(case.spec.hidden_size, fc1_rows):.0%} for their shape; aux/z-loss graphs "
            f"{losses}")


def profile_dict(case: ProfileCase, gpu: GpuSpec, eff: Efficiency, allowance: Allowance, memory: MemoryEstimate,
                 time: TimeEstimate) -> dict:
    return {"schema": SCHEMA, "kind": "profile", "model": model_dict(case), "layout": layout_dict(case),
            "gpu": gpu_dict(gpu, eff), "memory": memory_dict(memory, allowance), "time": time_dict(time),
            "assumed": assumed_lines(case, gpu, time.rates)}


def search_dict(result: SearchResult, base: ProfileCase, eff: Efficiency, allowance: Allowance, top: int,
                rejected: int = 5) -> dict:
    ranked = result.fitting[:top]
    entries = []
    for i, c in enumerate(ranked):
        entry = {"rank": i + 1, "layout": layout_dict(c.case), "memory": memory_dict(c.memory, allowance),
                 "time": time_dict(c.time), "why": None}
        if i + 1 < len(result.fitting):
            entry["why"] = why_faster(c, result.fitting[i + 1])
        entries.append(entry)
    return {
        "schema": SCHEMA, "kind": "search", "model": model_dict(base), "gpu": gpu_dict(result.gpu, eff),
        "num_gpus": base.num_gpus, "seq_len": base.seq_len, "evaluated": result.evaluated, "invalid": result.invalid,
        "fitting": len(result.fitting), "results": entries,
        "rejected": [{"layout": layout_dict(c.case), "total_gib": _r(c.memory.total_gib),
                      "oom_by_gib": _r(c.oom_by_gib), "s_per_sample": _r(c.s_per_sample),
                      "components_gib": {k: _r(c.memory.heaviest.components[k] / GIB) for k in COMPONENTS}}
                     for c in result.rejected[:rejected]],
        "notes": result.notes,
    }


def probe_dict(result: ProbeResult) -> dict:
    components = {}
    for key in COMPONENTS:
        measured = result.measured.get(key)
        error = result.error(key)
        components[key] = {"predicted_gib": _r(result.predicted[key] / GIB, 6),
                           "measured_gib": None if measured is None else _r(measured / GIB, 6),
                           "error": None if error is None else _r(error)}
    total_pred, total_meas = result.predicted_total_comparable, result.measured_total
    return {
        "schema": SCHEMA, "kind": "probe", "device": result.device, "stage": result.stage,
        "model": model_dict(result.case), "layout": layout_dict(result.case),
        "measured_components": list(result.measured_keys),
        "components": components,
        "total": {"predicted_gib": _r(total_pred / GIB, 6), "measured_gib": _r(total_meas / GIB, 6),
                  "error": _r(total_pred / total_meas - 1) if total_meas else None},
        "s_per_sample": {"predicted": _r(result.predicted_s_per_sample, 6),
                         "measured": _r(result.measured_s_per_sample, 6),
                         "error": _r(result.predicted_s_per_sample / result.measured_s_per_sample - 1)},
        "rl_times_s": {key: {"predicted": _r(predicted, 6), "measured": _r(measured, 6)}
                       for key, (predicted, measured) in (result.rl_times or {}).items()},
    }


def plot_memory(bars: list[tuple[str, dict[str, float]]], capacity_gib: float | None, path: Path,
                title: str) -> Path:
    """Stacked bars of memory components (bytes) per label, with the device capacity as a line."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise QlmError("--plot needs matplotlib", "pip install matplotlib") from None
    figure, axis = plt.subplots(figsize=(max(6.0, 1.3 * len(bars) + 3), 4.8))
    bottoms = [0.0] * len(bars)
    colors = plt.get_cmap("tab10")
    for i, key in enumerate(COMPONENTS):
        heights = [parts.get(key, 0.0) / GIB for _, parts in bars]
        if any(heights):
            axis.bar(range(len(bars)), heights, bottom=bottoms, label=key, color=colors(i % 10))
            bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    if capacity_gib:
        axis.axhline(capacity_gib, color="black", linestyle="--", linewidth=1, label=f"device {capacity_gib:g} GiB")
    axis.set_xticks(range(len(bars)))
    axis.set_xticklabels([label for label, _ in bars], rotation=20, ha="right", fontsize=8)
    axis.set_ylabel("GiB per rank")
    axis.set_title(title, fontsize=10)
    axis.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    figure.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:  # a reader never sees half a PNG
        replace_atomically(path, lambda partial: figure.savefig(partial, dpi=120,
                                                                format=path.suffix[1:].lower() or "png"))
    except OSError as exc:
        raise QlmError(f"cannot write --plot {path} ({exc.strerror or exc})", "pass a path you can write to") from None
    finally:
        plt.close(figure)
    return path


PLOT_FORMATS = (".png", ".pdf", ".svg", ".jpg", ".jpeg")


def check_plot_path(path: Path):
    """--plot can be written, checked before any work: a known image suffix, matplotlib installed, its folder
    created and a probe file written and removed there."""
    path = Path(path)
    if path.suffix.lower() not in PLOT_FORMATS:
        raise QlmError(f"--plot {path} has no image suffix", f"end it in one of {', '.join(PLOT_FORMATS)}")
    if importlib.util.find_spec("matplotlib") is None:
        raise QlmError("--plot needs matplotlib", "pip install matplotlib")
    if path.is_dir():
        raise QlmError(f"--plot {path} is a directory", "pass a file name, e.g. --plot mem.png")
    folder = path.parent
    existing = next(p for p in (folder, *folder.parents) if p.exists() or p == Path(p.anchor or "."))
    if existing.exists() and not existing.is_dir():
        raise QlmError(f"--plot {path}: {existing} is a file, not a folder", "pass a path inside a folder")
    try:
        probe_writable(folder)
    except OSError as exc:
        raise QlmError(f"cannot write --plot {path} ({exc.strerror or exc})", "pass a path you can write to") from None
