"""`qlm profile`: memory per rank and s/sample of a layout, predicted (and probed), or a search for the best one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from qlm_cli.choices import ComputeDtype, CpComm, Gpu, PipelineSchedule, Recompute, enum_of, value_of
from qlm_cli.render import console, err_console, memory_table, progress_bar
from qlm_core.config import GradReduceDtype, check_number, choices, load_recipe

GradDtype = enum_of("GradDtype", choices(GradReduceDtype))


def _time_table(time) -> Table:
    from qlm_core.profile.rl_timing import RL_COMPONENTS
    from qlm_core.profile.timing import TIME_COMPONENTS

    table = Table(title="time per step (slowest stage)", title_justify="left")
    table.add_column("component")
    table.add_column("s / step", justify="right")
    table.add_column("share", justify="right")
    rl = any(time.components[key] for key in RL_COMPONENTS)
    for key in TIME_COMPONENTS:
        value = time.components[key]
        if key in RL_COMPONENTS and not rl:  # not an RL step
            continue
        table.add_row(key, f"{value:,.3f}", f"{value / time.step_s:.0%}")
    table.add_row("[bold]step", f"[bold]{time.step_s:,.3f}", "")
    return table


def _print_profile(case, gpu, memory, time):
    from qlm_core.profile import report
    from qlm_core.profile.memory import GIB

    p, heavy = case.parallel, memory.heaviest
    console.print(f"[bold]{escape(case.model_name)}[/] on {case.num_gpus} x {escape(gpu.name)}: {case.describe()}, "
                  f"seq {case.seq_len}, micro-batch {case.micro_batch_size}, global batch {case.global_batch_size} "
                  f"({case.num_microbatches} micro-batches per step), {case.dtype}", highlight=False)
    documents = (f"packed documents of {case.mean_doc_len:,} tokens on average" if case.mean_doc_len
                 else "one document per sample (packed data: --mean-doc-len / data.mean_doc_len)")
    window = f", sliding window {case.spec.sliding_window:,}" if case.spec.sliding_window else ""
    console.print(report.parameters_line(case.spec), highlight=False)
    console.print(f"attention: {documents}{window}", highlight=False)
    console.print(memory_table(memory, f"memory per rank, heaviest pipeline stage ({heavy.stage} of {p.pp})"))
    console.print(f"activations: {heavy.activation_per_layer / GIB:.3f} GiB per layer per micro-batch x "
                  f"{heavy.layers} layers x {heavy.inflight_microbatches:.3g} micro-batches in flight", highlight=False)
    console.print(_time_table(time))
    console.print(f"[bold]{time.s_per_sample:.3f} s/sample[/], {time.tokens_per_s_per_device:,.0f} tokens/s per "
                  f"device, {time.tflops_per_device:.0f} TFLOP/s per device, MFU {time.mfu:.1%} (qlm's FLOPs: causal "
                  f"attention halved; {time.megatron_mfu:.1%} by Megatron-LM's count)", highlight=False)
    for line in report.assumed_lines(case, gpu, time.rates):
        console.print(f"[dim]assumed: {escape(line)}[/]", highlight=False)


def _print_probe(result):
    from qlm_core.profile.probe import CPU_STEP_OVERHEAD_NOTE, probe_rows

    table = Table(title=f"probe on {result.device}: {escape(result.case.model_name)}, {result.case.describe()}, "
                        f"seq {result.case.seq_len}, stage {result.stage}", title_justify="left")
    for name in ("component", "predicted GiB", "measured GiB", "error"):
        table.add_column(name, justify="left" if name == "component" else "right")
    for key, predicted, measured, error in probe_rows(result):
        table.add_row(key, f"{predicted:.6f}", "—" if measured is None else f"{measured:.6f}",
                      "—" if error is None else f"{error:+.1%}")
    console.print(table)
    for key, (predicted_s, measured_s) in (result.rl_times or {}).items():
        console.print(f"{key} (s a step, the slowest leader): predicted {predicted_s:.4g}, measured {measured_s:.4g}",
                      highlight=False)
    error = result.predicted_s_per_sample / result.measured_s_per_sample - 1
    console.print(f"s/sample: predicted {result.predicted_s_per_sample:.4g}, measured "
                  f"{result.measured_s_per_sample:.4g} ({error:+.0%})", highlight=False)
    if result.device == "cpu":
        console.print(f"[dim]{CPU_STEP_OVERHEAD_NOTE}; transients are predicted only on CPU.[/]")


def _print_search(result, top: int):
    from qlm_core.profile.memory import GIB
    from qlm_core.profile.search import why_faster

    console.print(f"{result.evaluated} layouts costed ({result.invalid} more refused by the trainer's checks), "
                  f"{len(result.fitting)} fit {result.gpu.memory_gib:g} GiB", highlight=False)
    table = Table(title=f"best {min(top, len(result.fitting))} layouts", title_justify="left")
    for name in ("#", "layout", "s/sample", "tok/s/dev", "MFU", "GiB", "headroom", "why it beats the next"):
        table.add_column(name, justify="left" if name in ("layout", "why it beats the next") else "right")
    for i, c in enumerate(result.fitting[:top]):
        why = why_faster(c, result.fitting[i + 1]) if i + 1 < len(result.fitting) else ""
        table.add_row(str(i + 1), c.case.describe(), f"{c.s_per_sample:.3f}",
                      f"{c.time.tokens_per_s_per_device:,.0f}", f"{c.time.mfu:.1%}", f"{c.memory.total_gib:.1f}",
                      f"{c.memory.headroom_gib:.1f}", why)
    console.print(table)
    rejected = Table(title="fastest layouts that do not fit", title_justify="left")
    for name in ("layout", "s/sample", "needs GiB", "OOM by", "largest part"):
        rejected.add_column(name, justify="left" if name in ("layout", "largest part") else "right")
    for c in result.rejected[:5]:
        parts = c.memory.heaviest.components
        key = max((k for k in parts if k != "allocator"), key=parts.get)
        rejected.add_row(c.case.describe(), f"{c.s_per_sample:.3f}", f"{c.memory.total_gib:.1f}",
                         f"[red]{c.oom_by_gib:.1f} GiB[/]", f"{key} {parts[key] / GIB:.1f} GiB")
    console.print(rejected)
    for note in result.notes:
        console.print(f"• {note}", highlight=False)


def profile(
    recipe: Annotated[Path | None, typer.Argument(help="A recipe (TOML) to read the model, layout and batch "
                                                          "from; default: the seed's case.")] = None,
    model: Annotated[str | None, typer.Option("--model", help="Preset name or HF model directory.")] = None,
    seq_len: Annotated[int | None, typer.Option("--seq-len", help="Tokens per sample.")] = None,
    mbs: Annotated[int | None, typer.Option("--mbs", help="Micro-batch size.")] = None,
    gbs: Annotated[int | None, typer.Option("--gbs", help="Global batch size.")] = None,
    tp: Annotated[int | None, typer.Option("--tp", help="Tensor parallel size.")] = None,
    pp: Annotated[int | None, typer.Option("--pp", help="Pipeline parallel size.")] = None,
    vpp: Annotated[int | None, typer.Option("--vpp", help="Virtual pipeline chunks per stage.")] = None,
    cp: Annotated[int | None, typer.Option("--cp", help="Context parallel size.")] = None,
    cp_comm_type: Annotated[CpComm | None, typer.Option("--cp-comm-type", help="Context-parallel attention "
                                                          "exchange.")] = None,
    dp: Annotated[int | None, typer.Option("--dp", help="Data parallel size (default: what --num-gpus "
                                                           "leaves).")] = None,
    sp: Annotated[bool | None, typer.Option("--sp/--no-sp", help="Sequence parallelism.")] = None,
    ep: Annotated[int | None, typer.Option("--ep", help="Expert parallel size (MoE; parallel.ep): the routed "
                                                           "experts divided over ep ranks.")] = None,
    etp: Annotated[int | None, typer.Option("--etp", help="Expert tensor parallel size (MoE; parallel.etp; "
                                                             "default tp).")] = None,
    moe_imbalance: Annotated[float | None, typer.Option(
        "--moe-imbalance", help="Under EP: the rows the busiest EP rank receives over the mean, which the profile "
                                "sizes its dispatch buffers, expert activations and all-to-alls for (default 1.25, "
                                "Switch Transformer's training capacity factor; a capacity factor caps it).")] = None,
    zero: Annotated[int | None, typer.Option("--zero", help="ZeRO stage 0-3.")] = None,
    recompute: Annotated[Recompute | None, typer.Option("--recompute", help="Activation recomputation.")] = None,
    recompute_num_layers: Annotated[int | None, typer.Option(
        "--recompute-num-layers", help="With full: recompute the first N layers of each chunk.")] = None,
    recompute_modules: Annotated[str | None, typer.Option(
        "--recompute-modules", help="With selective: what to recompute, comma-separated from core_attn, mlp, "
        "layernorm (Megatron's --recompute-modules; default core_attn).")] = None,
    pp_schedule: Annotated[PipelineSchedule | None, typer.Option("--pp-schedule", help="Pipeline schedule.")] = None,
    dtype: Annotated[ComputeDtype | None, typer.Option("--dtype", help="Compute dtype.")] = None,
    grad_reduce_dtype: Annotated[GradDtype | None, typer.Option(
        "--grad-reduce-dtype", help="Gradient buffers and their reduction: fp32, or the compute dtype "
        "(parallel.grad_reduce_dtype; default: the recipe's, else fp32).")] = None,
    lora_rank: Annotated[int | None, typer.Option("--lora-rank", help="LoRA rank (0: off).")] = None,
    loss_chunk_tokens: Annotated[int | None, typer.Option(
        "--loss-chunk-tokens", help="Tokens the loss projects at a time (train.loss_chunk_tokens; default: the "
                                    "recipe's, else 2048; 0: the whole logits at once).")] = None,
    mean_doc_len: Annotated[int | None, typer.Option(
        "--mean-doc-len", help="Packed data: token-weighted mean document length E[L^2]/E[L] in tokens (what "
                               "attention work scales with); attention FLOPs and time follow the documents "
                               "(data.mean_doc_len; default: the recipe's, else one per sample).")] = None,
    gpu: Annotated[Gpu, typer.Option("--gpu", case_sensitive=False, help="GPU preset (the options below adjust "
                                     "its figures).")] = Gpu["a100-80g"],
    num_gpus: Annotated[int | None, typer.Option("--num-gpus", help="Devices in all (default: tp*pp*cp*dp "
                                                                       "with --dp, else 32).")] = None,
    gpu_memory_gb: Annotated[float | None, typer.Option("--gpu-memory-gb", help="Override the memory (GiB).")] = None,
    peak_tflops: Annotated[float | None, typer.Option("--peak-tflops", help="Override the bf16 peak.")] = None,
    nvlink_gbps: Annotated[float | None, typer.Option("--nvlink-gbps", help="Override NVLink GB/s.")] = None,
    internode_gbps: Annotated[float | None, typer.Option("--internode-gbps", help="Override inter-node "
                                                                                     "GB/s per GPU.")] = None,
    gpus_per_node: Annotated[int | None, typer.Option("--gpus-per-node", help="Override GPUs per node.")] = None,
    nvlink_domain: Annotated[int | None, typer.Option(
        "--nvlink-domain", help="Override the GPUs one NVLink fabric joins (GB200 NVL72: 72).")] = None,
    efficiency: Annotated[float | None, typer.Option(
        "--efficiency", help="One fraction of peak for every GEMM and attention kernel (default: the rates "
                             "fitted to published runs, bench/profile_calibration.py).")] = None,
    comm_efficiency: Annotated[float | None, typer.Option(
        "--comm-efficiency", help="Fraction of link bandwidth collectives reach (default: the fitted one).")] = None,
    allocator_fraction: Annotated[float, typer.Option("--allocator-fraction", help="Allocator overhead allowance "
                                                                                   "(fraction).")] = 0.08,
    context_gb: Annotated[float, typer.Option("--context-gb", help="CUDA context + NCCL allowance (GiB).")] = 1.0,
    search: Annotated[bool, typer.Option("--search", help="Rank every layout that fits --num-gpus x --gpu.")] = False,
    top: Annotated[int, typer.Option("--top", min=1, help="Layouts to show with --search.")] = 5,
    probe: Annotated[bool, typer.Option(
        "--probe", help="Also run real steps (scaled down on CPU) and compare.")] = False,
    steps: Annotated[int, typer.Option("--steps", min=2, help="Steps to run with --probe.")] = 3,
    probe_max_ranks: Annotated[int, typer.Option("--probe-max-ranks", min=1, help="Most processes a CPU probe "
                                                                                  "starts.")] = 16,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON document (keys in the README).")] = False,
    plot: Annotated[Path | None, typer.Option("--plot", help="Write a stacked-bar PNG of the memory.")] = None,
):
    """Memory per rank (heaviest pipeline stage) and s/sample of a parallel layout, or --search for the best one.

    Without a recipe it profiles the seed's case (recipes/qwen2-7b-128k.toml): qwen2-7b, seq 131072, micro-batch 1,
    global batch 16, bf16, 32 x a100-80g as tp 4 x cp 4 x dp 2, SP on, p2p ring attention, ZeRO 1, full recompute;
    every option replaces one of those values (`qlm profile --tp 4 --cp 4` is that case).
    """
    from qlm_core.profile import report
    from qlm_core.profile.case import build_case
    from qlm_core.profile.machine import MachineOptions

    machine = MachineOptions(gpu.value, gpu_memory_gb, peak_tflops, nvlink_gbps, internode_gbps, gpus_per_node,
                             nvlink_domain, efficiency, comm_efficiency, allocator_fraction, context_gb)
    check_number("--moe-imbalance", moe_imbalance, least=1)
    if plot is not None:
        report.check_plot_path(plot)  # before any work
    layout_options = dict(tp=tp, pp=pp, vpp=vpp, cp=cp, dp=dp, sp=sp, ep=ep, etp=etp,
                          cp_comm_type=value_of(cp_comm_type),
                          zero_stage=zero, recompute=value_of(recompute), recompute_num_layers=recompute_num_layers,
                          pp_schedule=value_of(pp_schedule),
                          recompute_modules=None if recompute_modules is None else
                          [m.strip() for m in recompute_modules.split(",") if m.strip()])
    case = build_case(load_recipe(recipe) if recipe is not None else None, model=model, seq_len=seq_len,
                      micro_batch_size=mbs, global_batch_size=gbs, num_gpus=num_gpus, dtype=value_of(dtype),
                      lora_rank=lora_rank, loss_chunk_tokens=loss_chunk_tokens, mean_doc_len=mean_doc_len,
                      **layout_options)
    if moe_imbalance is not None:
        case = case.replace(moe_imbalance=moe_imbalance)
    if grad_reduce_dtype is not None:  # not a layout option: a model's layout search still runs without one
        case = case.with_parallel(grad_reduce_dtype=grad_reduce_dtype.value)
    device, eff, allowance = machine.device(), machine.rates(), machine.allowance()
    if recipe is None and model is not None:  # the user's model: say what else was assumed
        given = {k for k, v in layout_options.items() if v is not None}
        assumed = [flag for flag, value in (("--seq-len", seq_len), ("--mbs", mbs), ("--gbs", gbs),
                                            ("--dtype", dtype)) if value is None]
        case = _resolve_model_case(case, given, num_gpus, search, device, eff, allowance, assumed, json_out)
    if search:
        _search(case, device, eff, allowance, top, json_out, plot)
    else:
        _one_layout(case, device, eff, allowance, probe, steps, probe_max_ranks, json_out, plot)


def _search(case, device, eff, allowance, top: int, json_out: bool, plot: Path | None):
    """--search: every layout that fits, ranked; a table (or JSON) and optionally the memory of the top ones."""
    from qlm_core.profile import report
    from qlm_core.profile.search import search as run_search

    with progress_bar(f"search on {case.num_gpus} GPUs") as report_progress:
        result = run_search(case, case.num_gpus, device, eff, allowance,
                            progress=lambda done, total: report_progress(done, total, "layouts"))
    if json_out:
        print(json.dumps(report.search_dict(result, case, eff, allowance, top), indent=2))
    else:
        _print_search(result, top)
    if plot is not None:
        bars = [(f"#{i + 1} {c.case.describe()}", c.memory.heaviest.components)
                for i, c in enumerate(result.fitting[:top])]
        bars += [(f"OOM {c.case.describe()}", c.memory.heaviest.components) for c in result.rejected[:2]]
        _saved(report.plot_memory(bars, device.memory_gib, plot, f"{case.model_name}, seq {case.seq_len}, "
                                  f"{case.num_gpus} x {device.name}"), json_out)


def _one_layout(case, device, eff, allowance, probe: bool, steps: int, max_ranks: int, json_out: bool,
                plot: Path | None):
    """One layout: its memory and time predicted (and, with --probe, measured); a table (or JSON), a plot."""
    from qlm_core.profile import report
    from qlm_core.profile.case import validate_case
    from qlm_core.profile.memory import estimate_memory
    from qlm_core.profile.timing import estimate_time

    validate_case(case)
    memory = estimate_memory(case, device.memory_gib, "cuda", allowance)
    time = estimate_time(case, device, eff)
    probed = None
    if probe:
        from qlm_core.profile.probe import probe as run_probe

        with progress_bar("probe") as report_progress:
            probed = run_probe(case, device, steps=steps, efficiency=eff, allowance=allowance, max_ranks=max_ranks,
                               progress=lambda done, total: report_progress(done, total, "steps"))
    if json_out:
        document = report.profile_dict(case, device, eff, allowance, memory, time)
        if probed is not None:
            document["probe"] = report.probe_dict(probed)
        print(json.dumps(document, indent=2))
    else:
        _print_profile(case, device, memory, time)
        if probed is not None:
            _print_probe(probed)
    if plot is not None:
        if probed is None:
            bars = [(f"stage {s.stage}", s.components) for s in memory.stages]
            title, capacity = f"{case.model_name}: {case.describe()}", device.memory_gib
        else:  # the probe's (scaled-down) case: predicted beside measured, no device line
            bars = [("predicted", probed.predicted), ("measured", probed.measured)]
            title, capacity = f"probe on {probed.device}: {probed.case.describe()}, stage {probed.stage}", None
        _saved(report.plot_memory(bars, capacity, plot, title), json_out)


def _resolve_model_case(case, given: set[str], num_gpus: int | None, search: bool, device, eff, allowance,
                        assumed: list[str], quiet: bool):
    """--model without a recipe: profile/search.resolve_model_case, under a progress bar when it searches."""
    from qlm_core.profile.search import resolve_model_case

    if given:  # the layout is the user's: nothing to search
        case, line = resolve_model_case(case, given, num_gpus, search, device, eff, allowance, assumed)
    else:
        with progress_bar("smallest layout that fits") as report_progress:
            case, line = resolve_model_case(case, given, num_gpus, search, device, eff, allowance, assumed,
                                            lambda done, total: report_progress(done, total, "layouts"))
    (err_console if quiet else console).print(line, markup=False, highlight=False, soft_wrap=True)
    return case


def _saved(path: Path, quiet: bool):
    if not quiet:
        console.print(f"plot: {escape(str(path))}", highlight=False)
