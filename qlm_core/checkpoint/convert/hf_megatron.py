"""Streaming conversions between HF and Megatron-Core checkpoints.

Every direction is: open the input as a TensorSource (layout.py), then write the target one file at a time, reading
only the slices that file needs. Peak memory is one output file plus the slices being copied.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from qlm_core.checkpoint.convert.train_state import TrainStateCarrier
from qlm_core.checkpoint.convert.verify import (
    AUTO_VERIFY_MAX_PARAMS,
    VerifyReport,
    compare_logits,
    compare_tensors,
    hf_logits_fn,
    qlm_logits_fn,
    scan_nan,
)
from qlm_core.checkpoint.formats.hf.checkpoint import (
    HFCheckpoint,
    copy_side_files,
    is_hf_dir,
    plan_hf_shards,
    shard_file_names,
    write_hf_config,
    write_hf_index,
    write_hf_shard,
)
from qlm_core.checkpoint.formats.megatron.args import make_args, set_layout_args
from qlm_core.checkpoint.formats.megatron.configured import config_dir
from qlm_core.checkpoint.formats.megatron.format import TORCH, TORCH_DIST, check_format, open_megatron
from qlm_core.checkpoint.formats.megatron.legacy import (
    HF_SIDE_DIR,
    SHARD_FILE,
    check_legacy_experts,
    iteration_dir_name,
    legacy_shard_ranks,
    shard_dir_name,
    write_latest,
    write_shard_file,
)
from qlm_core.checkpoint.formats.megatron.legacy_stream import STREAMING, StageWriter
from qlm_core.checkpoint.formats.megatron.open_configured import open_megatron_with
from qlm_core.checkpoint.io.staging import check_output_dir, staged_output
from qlm_core.checkpoint.sources.open import megatron_weights
from qlm_core.dtypes import dtype_named
from qlm_core.errors import QlmError
from qlm_core.models.layout import (
    HFTensorSource,
    ModelLayout,
    TensorSource,
    assemble_hf_tensor,
    build_shard,
)
from qlm_core.models.parameters import num_parameters

Progress = Callable[[int, int, str], None]  # (done, total, what)


def no_progress(done: int, total: int, what: str):
    pass


@dataclass
class ConvertResult:
    out: Path
    files: int
    bytes_written: int
    seconds: float
    verify: VerifyReport | None
    notes: list[str] = field(default_factory=list)  # what was not carried over, and why
    warnings: list[str] = field(default_factory=list)  # what the output lost or the source holds (warning lines)


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    return dtype_named(dtype, "--dtype")


def should_verify(verify: bool | None, spec) -> bool:
    return verify if verify is not None else num_parameters(spec) <= AUTO_VERIFY_MAX_PARAMS


def unverified_warnings(verify: bool | None, spec, source: tuple[ModelLayout, TensorSource]) -> list[str]:
    """A conversion that is not verified because the model is large (verify left at its default) still scans the
    source for NaN, which every direction copies bit for bit: the warning names the tensor. An explicit
    --no-verify skips the scan too (the CLI says so)."""
    if verify is not None or should_verify(None, spec):
        return []
    report = VerifyReport()
    scan_nan(report, source)
    return report.warnings()


def missing_tokenizer_warning(out: Path) -> str | None:
    """A converted model without tokenizer files (none beside the source): every later verb needs one named."""
    from qlm_core.checkpoint.sources.open import tokenizer_near

    if tokenizer_near(Path(out)) is not None:
        return None
    return (f"{out} has no tokenizer files (there were none beside the source): qlm eval, generate and train will "
            "need --tokenizer / model.tokenizer, or copy tokenizer.json and tokenizer_config.json in")


def dir_bytes(path: Path) -> tuple[int, int]:
    files = [p for p in path.rglob("*") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


def finish_report(report: VerifyReport | None):
    if report is not None and not report.ok:
        raise QlmError(f"verification failed: {report.summary()}", "nothing was written; please report this bug")


def write_mcore_torch(root: Path, layout: ModelLayout, source: TensorSource, dtype: torch.dtype,
                      args: argparse.Namespace, iteration: int | None, progress: Progress,
                      extra_for: Callable[[int, int, int], dict] | None = None):
    """One rank folder per (TP, PP, EP) position Megatron writes (megatron_legacy.legacy_shard_ranks)."""
    iteration_dir = root / iteration_dir_name(iteration)
    ranks = legacy_shard_ranks(layout.tp, layout.ep, layout.etp)
    total = len(ranks) * layout.pp
    streams = STREAMING and isinstance(source, HFTensorSource) and isinstance(source.hf, HFCheckpoint)
    for pp_rank in range(layout.pp):
        stage = StageWriter(source.hf) if streams else None  # the stage's files filled together, at the end
        for index, (tp_rank, ep_rank) in enumerate(ranks):
            name = shard_dir_name(tp_rank, pp_rank, layout.pp, ep_rank, layout.ep)
            progress(pp_rank * len(ranks) + index, total, name)
            etp_rank = tp_rank % layout.etp
            chunks = [build_shard(layout, tp_rank, pp_rank, c, stage.source if stage else source, dtype, ep_rank,
                                  etp_rank) for c in range(layout.vpp)]
            extra = extra_for(tp_rank, pp_rank, ep_rank) if extra_for is not None else None
            path = iteration_dir / name / SHARD_FILE
            if stage is None:
                write_shard_file(path, chunks, args, iteration, extra)
            else:
                stage.add_file(path, write_shard_file(path, chunks, args, iteration, extra, tensor_bytes=False))
            del chunks
        if stage is not None:
            stage.fill()
    progress(total, total, "done")
    write_latest(root, iteration)


def expert_layout(spec, ep: int, etp: int | None) -> dict:
    """--ep / --etp as ModelLayout arguments; a dense model takes neither."""
    if spec.moe is None and (ep != 1 or etp is not None):
        raise QlmError(f"--ep {ep} / --etp {etp} need a Mixture-of-Experts model ({spec.model_type} is dense)",
                       "drop --ep and --etp")
    return {"ep": ep, "etp": etp}


def check_output_layout(layout: ModelLayout, format: str):
    """Legacy rank folders need an expert-TP size dividing TP; refused before anything is written."""
    if format == TORCH and layout.spec.moe is not None:
        check_legacy_experts(layout.tp, layout.etp)


def hf_to_mcore(
    hf: str | Path, out: str | Path, *, tp: int = 1, pp: int = 1, vpp: int = 1, ep: int = 1, etp: int | None = None,
    first_stage_layers: int | None = None, last_stage_layers: int | None = None,
    dtype: str | torch.dtype | None = None, make_vocab_size_divisible_by: int = 128,
    force: bool = False, verify: bool | None = None, progress: Progress = no_progress, format: str = TORCH,
) -> ConvertResult:
    """`format`: "torch" (legacy, one file per TP/PP(/EP) rank) or "torch_dist" (megatron-core's DCP layout); `ep`,
    `etp`: expert parallel and expert tensor parallel sizes (MoE models; etp None: tp)."""
    started = time.perf_counter()
    check_format(format)
    src = HFCheckpoint(hf)
    out = Path(out)
    check_output_dir(out, force, src.path)
    layout = ModelLayout(src.spec, tp, pp, vpp, first_stage_layers, last_stage_layers, make_vocab_size_divisible_by,
                         **expert_layout(src.spec, ep, etp))
    check_output_layout(layout, format)
    src.check_shapes({name: layout.hf_shape(name) for name in layout.hf_tensors})
    dtype = parse_dtype(dtype) or src.weights_dtype
    source = HFTensorSource(src)
    report = None
    with staged_output(out, force) as tmp:
        write_megatron(format, tmp, layout, source, dtype, make_args(layout, dtype, ckpt_format=format), None, progress)
        copy_side_files(src.path, tmp / HF_SIDE_DIR)
        if should_verify(verify, src.spec):
            report = VerifyReport()
            written = open_megatron(tmp)
            compare_tensors(report, (layout, source), (written.layout, written), dtype)
            compare_logits(report, hf_logits_fn(src.path, dtype), qlm_logits_fn(written.layout, written, dtype),
                           src.spec)
            finish_report(report)
    return ConvertResult(out, *dir_bytes(out), time.perf_counter() - started, report,
                         warnings=unverified_warnings(verify, src.spec, (layout, source)))


def write_megatron(format: str, root: Path, layout: ModelLayout, source: TensorSource, dtype: torch.dtype,
                   args: argparse.Namespace, iteration: int | None, progress: Progress,
                   carrier: TrainStateCarrier | None = None):
    """A Megatron checkpoint in `format`; `carrier`: a training run's state to write beside the weights."""
    if format == TORCH_DIST:
        from qlm_core.checkpoint.formats.megatron.torch_dist_write import write_mcore_torch_dist  # imports DCP

        write_mcore_torch_dist(root, layout, source, dtype, args, iteration, progress,
                               carrier.common_extra() if carrier else None, carrier.dist_parts() if carrier else [])
    else:
        extra_for = carrier.extra_for if carrier else None
        write_mcore_torch(root, layout, source, dtype, args, iteration, progress, extra_for)


def write_hf(out: Path, layout: ModelLayout, source: TensorSource, dtype: torch.dtype, max_shard_bytes: int,
             progress: Progress):
    sizes = {
        name: torch.Size(layout.hf_shape(name)).numel() * dtype.itemsize for name in layout.hf_tensors
    }
    shards = plan_hf_shards(sizes, max_shard_bytes)
    files = shard_file_names(len(shards))
    weight_map = {}
    for i, (names, file) in enumerate(zip(shards, files, strict=True)):
        progress(i, len(shards), file)
        tensors = {name: assemble_hf_tensor(layout, name, source, dtype) for name in names}
        write_hf_shard(out / file, tensors)
        weight_map.update({name: file for name in names})
        del tensors
    progress(len(shards), len(shards), "done")
    if len(shards) > 1:
        write_hf_index(out, weight_map, sum(sizes.values()))


def open_for_export(mcore: str | Path, iteration: int | None, out: str | Path, force: bool,
                    dtype: str | torch.dtype | None, config: str | Path | None = None) -> tuple:
    """A Megatron checkpoint opened to be written elsewhere: (checkpoint, output path — checked to be writable —,
    output dtype — the checkpoint's unless given —, its weights — a LoRA run: the base merged with the adapters —,
    the directory of its HF config and tokenizer files: the `config` directory when one is given).
    `config` (--config: HF directory or preset) supplies the architecture of a checkpoint without Megatron args
    and is checked against one with them (megatron_open.py)."""
    src = open_megatron_with(mcore, iteration, config)
    out = Path(out)
    check_output_dir(out, force, src.root)
    dtype = parse_dtype(dtype) or src.dtype
    source, side_dir = megatron_weights(src)
    return src, out, dtype, source, config_dir(config) or side_dir


def write_export_config(out: Path, side_dir: Path, spec, dtype: torch.dtype, config: str | Path | None,
                        copy=copy_side_files):
    """OUT/config.json (+ tokenizer and generation config). A preset --config describes the model: its config is
    written from the spec, the tokenizer files still come from the checkpoint's side directory."""
    if config is not None and config_dir(config) is None:
        if side_dir.is_dir():
            copy(side_dir, out)
        write_hf_config(out, None, spec, dtype)
    else:
        write_hf_config(out, side_dir, spec, dtype, copy=copy)


def mcore_to_hf(
    mcore: str | Path, out: str | Path, *, iteration: int | None = None, dtype: str | torch.dtype | None = None,
    max_shard_size_gb: float = 5.0, force: bool = False, verify: bool | None = None,
    progress: Progress = no_progress, config: str | Path | None = None,
) -> ConvertResult:
    """`config`: an HF directory or preset naming the architecture (needed when the checkpoint stores no Megatron
    args and has no run_config.yaml); the export then has exactly its vocab_size rows (no Megatron padding)."""
    started = time.perf_counter()
    src, out, dtype, source, side_dir = open_for_export(mcore, iteration, out, force, dtype, config)
    report = None
    with staged_output(out, force) as tmp:
        write_hf(tmp, src.layout, source, dtype, int(max_shard_size_gb * 2**30), progress)
        write_export_config(tmp, side_dir, src.spec, dtype, config)
        if should_verify(verify, src.spec):
            report = VerifyReport()
            written = HFCheckpoint(tmp)
            compare_tensors(report, (src.layout, source), (src.layout, HFTensorSource(written)), dtype)
            compare_logits(report, qlm_logits_fn(src.layout, source, dtype), hf_logits_fn(tmp, dtype), src.spec)
            finish_report(report)
    return ConvertResult(out, *dir_bytes(out), time.perf_counter() - started, report,
                         warnings=unverified_warnings(verify, src.spec, (src.layout, source)))


def mcore_to_mcore(
    mcore: str | Path, out: str | Path, *, tp: int = 1, pp: int = 1, vpp: int = 1, ep: int = 1,
    etp: int | None = None, first_stage_layers: int | None = None, last_stage_layers: int | None = None,
    iteration: int | None = None, dtype: str | torch.dtype | None = None,
    make_vocab_size_divisible_by: int | None = None, force: bool = False, verify: bool | None = None,
    progress: Progress = no_progress, format: str | None = None, config: str | Path | None = None,
) -> ConvertResult:
    """`format`: "torch" or "torch_dist" (default: the source's). The output also carries qlm's training state
    (Adam states re-sliced like the weights, step, train state, scheduler; see train_state.py)."""
    started = time.perf_counter()
    src = open_megatron_with(mcore, iteration, config)
    format = check_format(format or src.ckpt_format)
    if src.lora is not None and not src.holds_base:
        raise QlmError(f"{src.root} holds only LoRA adapters", "export them with mcore2peft, or merged with mcore2hf")
    out = Path(out)
    check_output_dir(out, force, src.root)
    divisible = make_vocab_size_divisible_by or src.layout.make_vocab_size_divisible_by
    layout = ModelLayout(src.spec, tp, pp, vpp, first_stage_layers, last_stage_layers, divisible,
                         **expert_layout(src.spec, ep, etp))
    check_output_layout(layout, format)
    dtype = parse_dtype(dtype) or src.dtype
    if src.args_from == "checkpoint":
        args = set_layout_args(argparse.Namespace(**vars(src.args)), layout, dtype)
    else:  # no Megatron args stored: complete ones from the architecture (--config or run_config.yaml)
        args = make_args(layout, dtype, iteration=src.iteration or 0)
    args.ckpt_format = format
    carrier = TrainStateCarrier(src, layout)
    notes = list(carrier.notes)
    report = None
    with staged_output(out, force) as tmp:
        write_megatron(format, tmp, layout, src, dtype, args, src.iteration, progress, carrier)
        if config is not None or (src.root / HF_SIDE_DIR).is_dir():  # the written checkpoint describes itself
            (tmp / HF_SIDE_DIR).mkdir()
            write_export_config(tmp / HF_SIDE_DIR, config_dir(config) or src.root / HF_SIDE_DIR, src.spec, dtype,
                                config)
        if should_verify(verify, src.spec):
            report = VerifyReport()
            written = open_megatron(tmp, src.iteration, spec=src.spec)
            compare_tensors(report, (src.layout, src), (written.layout, written), dtype)
            carrier.verify(report, tmp)
            compare_logits(report, qlm_logits_fn(src.layout, src, dtype), qlm_logits_fn(written.layout, written, dtype),
                           src.spec)
            finish_report(report)
    return ConvertResult(out, *dir_bytes(out), time.perf_counter() - started, report, notes,
                         unverified_warnings(verify, src.spec, (src.layout, src)))


PEFT_BASE_DIR = "base"  # inside a PEFT export: the base model as HF, when the adapters' base is not one


def peft_base(src) -> tuple[Path | str | None, tuple | None, list[str]]:
    """Where the PEFT adapter's base model is: (base_model_name_or_path — an HF directory when the run's args
    name one —, what to export as HF into OUT/base when the base is a Megatron checkpoint or the checkpoint itself
    — (layout, source, spec, dtype, side dir) —, notes)."""
    if src.holds_base:
        return None, (src.layout, src, src.spec, src.dtype, src.root / HF_SIDE_DIR), []
    if not src.lora.base:
        return None, None, ["the run's args name no base model (qlm_lora_base): base_model_name_or_path is null, "
                            "load the adapter with peft.PeftModel.from_pretrained(base_model, OUT)"]
    path = Path(src.lora.base)
    if not path.exists() and not path.is_absolute():
        path = src.root / path
    if not path.exists():
        return src.lora.base, None, [f"the LoRA base {src.lora.base} does not exist: base_model_name_or_path names "
                                     "it as the run's args do; put the base back there before loading the adapter"]
    if is_hf_dir(path):
        return path.resolve(), None, []
    base = open_megatron(path)
    return None, (base.layout, base, base.spec, base.dtype, base.root / HF_SIDE_DIR), []


def mcore_to_peft(mcore: str | Path, out: str | Path, *, iteration: int | None = None, force: bool = False,
                  progress: Progress = no_progress, config: str | Path | None = None) -> ConvertResult:
    """A LoRA run's adapters (any TP/PP) -> PEFT's adapter_model.safetensors + adapter_config.json, with HF module
    names, for peft.PeftModel.from_pretrained(base transformers model, OUT) and AutoPeftModelForCausalLM: its
    base_model_name_or_path is the HF base the run was trained on (absolute path), or, for a Megatron base (or a
    checkpoint holding the base weights too), that base exported as HF into OUT/base."""
    from qlm_core.checkpoint.formats.hf.peft import export_peft

    started = time.perf_counter()
    src = open_megatron_with(mcore, iteration, config)
    if src.lora is None:
        raise QlmError(f"{src.dir} holds no LoRA adapters", "export full models with mcore2hf")
    out = Path(out)
    check_output_dir(out, force, src.root)
    base_path, base_export, notes = peft_base(src)
    with staged_output(out, force) as tmp:
        progress(0, 2, "adapters")
        if base_export is not None:
            layout, source, spec, dtype, side = base_export
            (tmp / PEFT_BASE_DIR).mkdir()
            write_hf(tmp / PEFT_BASE_DIR, layout, source, dtype, 5 * 2**30, no_progress)
            write_hf_config(tmp / PEFT_BASE_DIR, side if side.is_dir() else None, spec, dtype)
            base_path = (out / PEFT_BASE_DIR).resolve()
            notes.append(f"the base model is exported as HF into {out / PEFT_BASE_DIR} (base_model_name_or_path)")
        export_peft(src.layout, src, src.lora, tmp, base_model_name_or_path=base_path)
        progress(2, 2, "done")
    return ConvertResult(out, *dir_bytes(out), time.perf_counter() - started, None, notes)
