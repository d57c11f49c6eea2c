"""The conversions between HF and Megatron-Core checkpoints (hf2mcore, mcore2hf, mcore2mcore, mcore2peft): each
opens its source by format (checkpoint/sources/), decides the output layout, dtype and what is written beside the
weights, and runs the one conversion (skeleton.py). Every direction streams: peak memory is one output file plus
the slices being copied.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from qlm_core.checkpoint.convert.skeleton import ConvertResult, convert_opened, dir_bytes, open_source, parse_dtype
from qlm_core.checkpoint.convert.train_state import TrainStateCarrier
from qlm_core.checkpoint.formats.hf.checkpoint import is_hf_dir, write_hf_config
from qlm_core.checkpoint.formats.hf.write import write_hf
from qlm_core.checkpoint.formats.megatron.args import make_args, set_layout_args
from qlm_core.checkpoint.formats.megatron.format import TORCH, check_format, open_megatron
from qlm_core.checkpoint.formats.megatron.legacy import HF_SIDE_DIR, check_legacy_experts
from qlm_core.checkpoint.io.progress import Progress, no_progress
from qlm_core.checkpoint.io.staging import check_output_dir, staged_output
from qlm_core.checkpoint.sources.format_api import ReadOptions, WriteOptions
from qlm_core.checkpoint.sources.hf_format import HF_FORMAT
from qlm_core.checkpoint.sources.megatron_format import MEGATRON_FORMAT
from qlm_core.errors import QlmError
from qlm_core.models.layout import ModelLayout


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
    src, out = open_source(HF_FORMAT, hf, out, force, ReadOptions())
    layout = ModelLayout(src.spec, tp, pp, vpp, first_stage_layers, last_stage_layers, make_vocab_size_divisible_by,
                         **expert_layout(src.spec, ep, etp))
    check_output_layout(layout, format)
    dtype = parse_dtype(dtype) or src.dtype
    options = WriteOptions(megatron_format=format, args=make_args(layout, dtype, ckpt_format=format))
    return convert_opened(src, out, MEGATRON_FORMAT, layout, dtype, options, started=started, force=force,
                          verify=verify, progress=progress)


def mcore_to_hf(
    mcore: str | Path, out: str | Path, *, iteration: int | None = None, dtype: str | torch.dtype | None = None,
    max_shard_size_gb: float = 5.0, force: bool = False, verify: bool | None = None,
    progress: Progress = no_progress, config: str | Path | None = None,
) -> ConvertResult:
    """`config`: an HF directory or preset naming the architecture (needed when the checkpoint stores no Megatron
    args and has no run_config.yaml); the export then has exactly its vocab_size rows (no Megatron padding)."""
    started = time.perf_counter()
    src, out = open_source(MEGATRON_FORMAT, mcore, out, force, ReadOptions(iteration=iteration, config=config))
    dtype = parse_dtype(dtype) or src.dtype
    options = WriteOptions(max_shard_bytes=int(max_shard_size_gb * 2**30))
    return convert_opened(src, out, HF_FORMAT, src.layout, dtype, options, started=started, force=force,
                          verify=verify, progress=progress)


def mcore_to_mcore(
    mcore: str | Path, out: str | Path, *, tp: int = 1, pp: int = 1, vpp: int = 1, ep: int = 1,
    etp: int | None = None, first_stage_layers: int | None = None, last_stage_layers: int | None = None,
    iteration: int | None = None, dtype: str | torch.dtype | None = None,
    make_vocab_size_divisible_by: int | None = None, force: bool = False, verify: bool | None = None,
    progress: Progress = no_progress, format: str | None = None, config: str | Path | None = None,
) -> ConvertResult:
    """`format`: "torch" or "torch_dist" (default: the source's). The output also carries qlm's training state
    (Adam states re-sliced like the weights, step, train state, scheduler; see train_state.py); a LoRA run's
    adapters stay adapters."""
    started = time.perf_counter()
    src = MEGATRON_FORMAT.open(Path(mcore), ReadOptions(iteration=iteration, config=config, keep_adapters=True))
    ckpt = src.reader
    format = check_format(format or ckpt.ckpt_format)
    if ckpt.lora is not None and not ckpt.holds_base:
        raise QlmError(f"{ckpt.root} holds only LoRA adapters", "export them with mcore2peft, or merged with mcore2hf")
    out = Path(out)
    check_output_dir(out, force, src.root)
    divisible = make_vocab_size_divisible_by or src.layout.make_vocab_size_divisible_by
    layout = ModelLayout(src.spec, tp, pp, vpp, first_stage_layers, last_stage_layers, divisible,
                         **expert_layout(src.spec, ep, etp))
    check_output_layout(layout, format)
    dtype = parse_dtype(dtype) or src.dtype
    if ckpt.args_from == "checkpoint":
        args = set_layout_args(argparse.Namespace(**vars(ckpt.args)), layout, dtype)
    else:  # no Megatron args stored: complete ones from the architecture (--config or run_config.yaml)
        args = make_args(layout, dtype, iteration=ckpt.iteration or 0)
    args.ckpt_format = format
    carrier = TrainStateCarrier(ckpt, layout)
    options = WriteOptions(megatron_format=format, args=args, iteration=ckpt.iteration, carrier=carrier,
                           reopen_spec=src.spec)
    return convert_opened(src, out, MEGATRON_FORMAT, layout, dtype, options, started=started, force=force,
                          verify=verify, progress=progress, notes=tuple(carrier.notes))


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
    src = MEGATRON_FORMAT.open(Path(mcore), ReadOptions(iteration=iteration, config=config, keep_adapters=True)).reader
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
