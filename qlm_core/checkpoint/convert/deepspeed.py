"""Streaming conversions between DeepSpeed checkpoints (of a transformers module: HF parameter names; formats in
deepspeed.py) and HF / Megatron-Core, through the same layout module and writers as convert.py."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from qlm_core.checkpoint.convert.hf_megatron import (
    ConvertResult,
    Progress,
    dir_bytes,
    finish_report,
    no_progress,
    open_for_export,
    parse_dtype,
    should_verify,
    unverified_warnings,
    write_export_config,
    write_hf,
    write_mcore_torch,
)
from qlm_core.checkpoint.convert.verify import (
    VerifyReport,
    compare_logits,
    compare_tensors,
    hf_logits_fn,
    qlm_logits_fn,
)
from qlm_core.checkpoint.formats.deepspeed.checkpoint import MODULE, DeepSpeedCheckpoint
from qlm_core.checkpoint.formats.deepspeed.config import copy_hf_side_files
from qlm_core.checkpoint.formats.deepspeed.write import check_tag, write_deepspeed
from qlm_core.checkpoint.formats.hf.checkpoint import HFCheckpoint
from qlm_core.checkpoint.formats.megatron.args import make_args
from qlm_core.checkpoint.formats.megatron.legacy import HF_SIDE_DIR, MegatronTorchCheckpoint
from qlm_core.checkpoint.io.staging import check_output_dir, staged_output
from qlm_core.checkpoint.sources.open import open_deepspeed
from qlm_core.models.layout import HFTensorSource, ModelLayout, TensorSource


def ds_to_hf(
    ds: str | Path, out: str | Path, *, tag: str | None = None, config: str | Path | None = None,
    dtype: str | torch.dtype | None = None, max_shard_size_gb: float = 5.0, force: bool = False,
    verify: bool | None = None, progress: Progress = no_progress, allow_bf16_weights: bool = False,
) -> ConvertResult:
    """DeepSpeed (ZeRO 0-3) -> HF: the fp32 master weights (default dtype fp32), frozen and tied params included.
    `config`: the HF config (dir or config.json) of the trained model; default a config.json next to the checkpoint."""
    started = time.perf_counter()
    src, spec, config_path = open_deepspeed(ds, tag, config, allow_bf16_weights)
    out = Path(out)
    check_output_dir(out, force, src.root)
    layout = ModelLayout(spec)
    src.check_layout(layout)
    dtype = parse_dtype(dtype) or torch.float32
    source = HFTensorSource(src)
    report = None
    with staged_output(out, force) as tmp:
        write_hf(tmp, layout, source, dtype, int(max_shard_size_gb * 2**30), progress)
        copy_hf_side_files(config_path, tmp, dtype)
        if should_verify(verify, spec):
            report = VerifyReport()
            compare_tensors(report, (layout, source), (layout, HFTensorSource(HFCheckpoint(tmp))), dtype)
            compare_logits(report, qlm_logits_fn(layout, source, dtype), hf_logits_fn(tmp, dtype), spec)
            finish_report(report)
    return ConvertResult(out, *dir_bytes(out), time.perf_counter() - started, report, list(src.notes),
                         [*src.warnings, *unverified_warnings(verify, spec, (layout, source))])


def ds_to_mcore(
    ds: str | Path, out: str | Path, *, tag: str | None = None, config: str | Path | None = None, tp: int = 1,
    pp: int = 1, vpp: int = 1, first_stage_layers: int | None = None, last_stage_layers: int | None = None,
    dtype: str | torch.dtype | None = None, make_vocab_size_divisible_by: int = 128, force: bool = False,
    verify: bool | None = None, progress: Progress = no_progress, allow_bf16_weights: bool = False,
) -> ConvertResult:
    """DeepSpeed (ZeRO 0-3) -> Megatron-Core legacy torch (release/), streamed one rank file at a time."""
    started = time.perf_counter()
    src, spec, config_path = open_deepspeed(ds, tag, config, allow_bf16_weights)
    out = Path(out)
    check_output_dir(out, force, src.root)
    layout = ModelLayout(spec, tp, pp, vpp, first_stage_layers, last_stage_layers, make_vocab_size_divisible_by)
    src.check_layout(layout)
    dtype = parse_dtype(dtype) or torch.float32
    source = HFTensorSource(src)
    report = None
    with staged_output(out, force) as tmp:
        write_mcore_torch(tmp, layout, source, dtype, make_args(layout, dtype), None, progress)
        copy_hf_side_files(config_path, tmp / HF_SIDE_DIR)
        if should_verify(verify, spec):
            report = VerifyReport()
            written = MegatronTorchCheckpoint(tmp)
            compare_tensors(report, (layout, source), (written.layout, written), dtype)
            compare_logits(report, qlm_logits_fn(layout, source, dtype), qlm_logits_fn(written.layout, written, dtype),
                           spec)
            finish_report(report)
    return ConvertResult(out, *dir_bytes(out), time.perf_counter() - started, report, list(src.notes),
                         [*src.warnings, *unverified_warnings(verify, spec, (layout, source))])


def _write_and_verify_ds(tmp: Path, layout: ModelLayout, source: TensorSource, dtype: torch.dtype, tag: str,
                         global_steps: int, fp32_master: bool, reference, verify: bool, progress: Progress):
    """Write, then read back: the module (at `dtype`) and the fp32 masters against the source, then logits."""
    write_deepspeed(tmp, layout, source, dtype, check_tag(tag), global_steps, fp32_master, progress=progress)
    if not verify:
        return None
    report = VerifyReport()
    module = HFTensorSource(DeepSpeedCheckpoint(tmp, tag, view=MODULE))
    compare_tensors(report, (layout, source), (layout, module), dtype)
    if fp32_master:
        compare_tensors(report, (layout, source), (layout, HFTensorSource(DeepSpeedCheckpoint(tmp, tag))),
                        torch.float32)
    compare_logits(report, reference(), qlm_logits_fn(layout, module, dtype), layout.spec)
    finish_report(report)
    return report


def hf_to_ds(
    hf: str | Path, out: str | Path, *, tag: str | None = None, dtype: str | torch.dtype | None = None,
    fp32_master: bool = True, force: bool = False, verify: bool | None = None, progress: Progress = no_progress,
) -> ConvertResult:
    """HF -> DeepSpeed: OUT/latest + OUT/<tag>/mp_rank_00_model_states.pt (+ fp32 masters as one ZeRO-2 partition),
    with the HF config and tokenizer files next to `latest`."""
    started = time.perf_counter()
    src = HFCheckpoint(hf)
    out = Path(out)
    check_output_dir(out, force, src.path)
    layout = ModelLayout(src.spec)
    src.check_shapes({name: layout.hf_shape(name) for name in layout.hf_tensors})
    dtype = parse_dtype(dtype) or src.weights_dtype
    with staged_output(out, force) as tmp:
        report = _write_and_verify_ds(tmp, layout, HFTensorSource(src), dtype, tag or "global_step0", 0, fp32_master,
                                      lambda: hf_logits_fn(src.path, dtype), should_verify(verify, src.spec), progress)
        copy_hf_side_files(src.path, tmp, dtype)
    return ConvertResult(out, *dir_bytes(out), time.perf_counter() - started, report,
                         warnings=unverified_warnings(verify, src.spec, (layout, HFTensorSource(src))))


def mcore_to_ds(
    mcore: str | Path, out: str | Path, *, iteration: int | None = None, tag: str | None = None,
    dtype: str | torch.dtype | None = None, fp32_master: bool = True, force: bool = False,
    verify: bool | None = None, progress: Progress = no_progress, config: str | Path | None = None,
) -> ConvertResult:
    """Megatron-Core (any TP/PP, a LoRA run merged) -> DeepSpeed; tag default global_step<iteration>. `config`: the
    architecture (HF dir, config.json or preset) for a checkpoint without Megatron-LM args."""
    started = time.perf_counter()
    src, out, dtype, source, side_dir = open_for_export(mcore, iteration, out, force, dtype, config)
    steps = src.iteration or 0
    with staged_output(out, force) as tmp:
        report = _write_and_verify_ds(tmp, src.layout, source, dtype, tag or f"global_step{steps}", steps, fp32_master,
                                      lambda: qlm_logits_fn(src.layout, source, dtype),
                                      should_verify(verify, src.spec), progress)
        write_export_config(tmp, side_dir, src.spec, dtype, config, copy=copy_hf_side_files)
    return ConvertResult(out, *dir_bytes(out), time.perf_counter() - started, report,
                         warnings=unverified_warnings(verify, src.spec, (src.layout, source)))
