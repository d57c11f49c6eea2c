"""The conversions between DeepSpeed checkpoints (of a transformers module: HF parameter names) and HF /
Megatron-Core (ds2hf, ds2mcore, hf2ds, mcore2ds), through the same formats and the one conversion (skeleton.py)."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from qlm_core.checkpoint.convert.hf_megatron import check_output_layout, expert_layout
from qlm_core.checkpoint.convert.skeleton import ConvertResult, convert_opened, open_source, parse_dtype
from qlm_core.checkpoint.formats.megatron.args import make_args
from qlm_core.checkpoint.formats.megatron.format import TORCH
from qlm_core.checkpoint.io.progress import Progress, no_progress
from qlm_core.checkpoint.sources.deepspeed_format import DEEPSPEED_FORMAT
from qlm_core.checkpoint.sources.format_api import ReadOptions, WriteOptions
from qlm_core.checkpoint.sources.hf_format import HF_FORMAT
from qlm_core.checkpoint.sources.megatron_format import MEGATRON_FORMAT
from qlm_core.models.layout import ModelLayout


def ds_to_hf(
    ds: str | Path, out: str | Path, *, tag: str | None = None, config: str | Path | None = None,
    dtype: str | torch.dtype | None = None, max_shard_size_gb: float = 5.0, force: bool = False,
    verify: bool | None = None, progress: Progress = no_progress, allow_bf16_weights: bool = False,
) -> ConvertResult:
    """DeepSpeed (ZeRO 0-3) -> HF: the fp32 master weights (default dtype fp32), frozen and tied params included.
    `config`: the HF config (dir or config.json) of the trained model; default a config.json next to the checkpoint."""
    started = time.perf_counter()
    read = ReadOptions(tag=tag, config=config, allow_bf16_weights=allow_bf16_weights)
    src, out = open_source(DEEPSPEED_FORMAT, ds, out, force, read)
    dtype = parse_dtype(dtype) or src.dtype
    options = WriteOptions(max_shard_bytes=int(max_shard_size_gb * 2**30))
    return convert_opened(src, out, HF_FORMAT, src.layout, dtype, options, started=started, force=force,
                          verify=verify, progress=progress)


def ds_to_mcore(
    ds: str | Path, out: str | Path, *, tag: str | None = None, config: str | Path | None = None, tp: int = 1,
    pp: int = 1, vpp: int = 1, ep: int = 1, etp: int | None = None, first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
    dtype: str | torch.dtype | None = None, make_vocab_size_divisible_by: int = 128, force: bool = False,
    verify: bool | None = None, progress: Progress = no_progress, allow_bf16_weights: bool = False,
) -> ConvertResult:
    """DeepSpeed (ZeRO 0-3) -> Megatron-Core legacy torch (release/), streamed one rank file at a time; `ep`, `etp`:
    expert parallel and expert tensor parallel sizes (MoE models; etp None: tp)."""
    started = time.perf_counter()
    read = ReadOptions(tag=tag, config=config, allow_bf16_weights=allow_bf16_weights)
    src, out = open_source(DEEPSPEED_FORMAT, ds, out, force, read)
    layout = ModelLayout(src.spec, tp, pp, vpp, first_stage_layers, last_stage_layers, make_vocab_size_divisible_by,
                         **expert_layout(src.spec, ep, etp))
    check_output_layout(layout, TORCH)
    dtype = parse_dtype(dtype) or src.dtype
    options = WriteOptions(args=make_args(layout, dtype))
    return convert_opened(src, out, MEGATRON_FORMAT, layout, dtype, options, started=started, force=force,
                          verify=verify, progress=progress)


def hf_to_ds(
    hf: str | Path, out: str | Path, *, tag: str | None = None, dtype: str | torch.dtype | None = None,
    fp32_master: bool = True, force: bool = False, verify: bool | None = None, progress: Progress = no_progress,
) -> ConvertResult:
    """HF -> DeepSpeed: OUT/latest + OUT/<tag>/mp_rank_00_model_states.pt (+ fp32 masters as one ZeRO-2 partition),
    with the HF config and tokenizer files next to `latest`."""
    started = time.perf_counter()
    src, out = open_source(HF_FORMAT, hf, out, force, ReadOptions())
    dtype = parse_dtype(dtype) or src.dtype
    options = WriteOptions(tag=tag or "global_step0", global_steps=0, fp32_master=fp32_master)
    return convert_opened(src, out, DEEPSPEED_FORMAT, src.layout, dtype, options, started=started, force=force,
                          verify=verify, progress=progress)


def mcore_to_ds(
    mcore: str | Path, out: str | Path, *, iteration: int | None = None, tag: str | None = None,
    dtype: str | torch.dtype | None = None, fp32_master: bool = True, force: bool = False,
    verify: bool | None = None, progress: Progress = no_progress, config: str | Path | None = None,
) -> ConvertResult:
    """Megatron-Core (any TP/PP, a LoRA run merged) -> DeepSpeed; tag default global_step<iteration>. `config`: the
    architecture (HF dir, config.json or preset) for a checkpoint without Megatron-LM args."""
    started = time.perf_counter()
    src, out = open_source(MEGATRON_FORMAT, mcore, out, force, ReadOptions(iteration=iteration, config=config))
    dtype = parse_dtype(dtype) or src.dtype
    steps = src.iteration or 0
    options = WriteOptions(tag=tag or f"global_step{steps}", global_steps=steps, fp32_master=fp32_master)
    return convert_opened(src, out, DEEPSPEED_FORMAT, src.layout, dtype, options, started=started, force=force,
                          verify=verify, progress=progress)
