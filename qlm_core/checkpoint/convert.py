"""Streaming conversions between HF and Megatron-Core checkpoints.

Every direction is: open the input as a TensorSource (layout.py), then write the target one file at a time, reading
only the slices that file needs. Peak memory is one output file plus the slices being copied.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ..errors import QlmError
from .hf import (
    HFCheckpoint,
    copy_side_files,
    plan_hf_shards,
    shard_file_names,
    write_hf_index,
    write_hf_shard,
)
from .layout import HFTensorSource, ModelLayout, TensorSource, assemble_hf_tensor, build_shard
from .mcore import (
    HF_SIDE_DIR,
    SHARD_FILE,
    MegatronTorchCheckpoint,
    iteration_dir_name,
    shard_dir_name,
    write_latest,
    write_shard_file,
)
from .megatron_args import DTYPE_NAMES, make_args, set_layout_args
from .staging import check_output_dir, staged_output
from .verify import (
    AUTO_VERIFY_MAX_PARAMS,
    VerifyReport,
    compare_logits,
    compare_tensors,
    hf_logits_fn,
    qlm_logits_fn,
)

Progress = Callable[[int, int, str], None]  # (done, total, what)


def _no_progress(done: int, total: int, what: str):
    pass


@dataclass
class ConvertResult:
    out: Path
    files: int
    bytes_written: int
    seconds: float
    verify: VerifyReport | None


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPE_NAMES:
        raise QlmError(f"unknown dtype {dtype!r}", f"use one of {', '.join(DTYPE_NAMES)}")
    return DTYPE_NAMES[dtype]


def _should_verify(verify: bool | None, spec) -> bool:
    return verify if verify is not None else spec.num_parameters() <= AUTO_VERIFY_MAX_PARAMS


def _dir_bytes(path: Path) -> tuple[int, int]:
    files = [p for p in path.rglob("*") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


def _finish(report: VerifyReport | None):
    if report is not None and not report.ok:
        raise QlmError(f"verification failed: {report.summary()}", "nothing was written; please report this bug")


def write_mcore_torch(root: Path, layout: ModelLayout, source: TensorSource, dtype: torch.dtype,
                      args: argparse.Namespace, iteration: int | None, progress: Progress):
    iteration_dir = root / iteration_dir_name(iteration)
    total = layout.tp * layout.pp
    for pp_rank in range(layout.pp):
        for tp_rank in range(layout.tp):
            name = shard_dir_name(tp_rank, pp_rank, layout.pp)
            progress(pp_rank * layout.tp + tp_rank, total, name)
            chunks = [build_shard(layout, tp_rank, pp_rank, c, source, dtype) for c in range(layout.vpp)]
            write_shard_file(iteration_dir / name / SHARD_FILE, chunks, args, iteration)
            del chunks
    progress(total, total, "done")
    write_latest(root, iteration)


def hf_to_mcore(
    hf: str | Path, out: str | Path, *, tp: int = 1, pp: int = 1, vpp: int = 1,
    first_stage_layers: int | None = None, last_stage_layers: int | None = None,
    dtype: str | torch.dtype | None = None, make_vocab_size_divisible_by: int = 128,
    force: bool = False, verify: bool | None = None, progress: Progress = _no_progress,
) -> ConvertResult:
    started = time.perf_counter()
    src = HFCheckpoint(hf)
    out = Path(out)
    check_output_dir(out, force, src.path)
    layout = ModelLayout(src.spec, tp, pp, vpp, first_stage_layers, last_stage_layers, make_vocab_size_divisible_by)
    src.check_shapes({name: layout.hf_shape(name) for name in layout.hf_tensors})
    dtype = parse_dtype(dtype) or src.weights_dtype
    source = HFTensorSource(src)
    report = None
    with staged_output(out, force) as tmp:
        write_mcore_torch(tmp, layout, source, dtype, make_args(layout, dtype), None, progress)
        copy_side_files(src.path, tmp / HF_SIDE_DIR)
        if _should_verify(verify, src.spec):
            report = VerifyReport()
            written = MegatronTorchCheckpoint(tmp)
            compare_tensors(report, (layout, source), (written.layout, written), dtype)
            compare_logits(report, hf_logits_fn(src.path, dtype), qlm_logits_fn(written.layout, written, dtype),
                           src.spec)
            _finish(report)
    return ConvertResult(out, *_dir_bytes(out), time.perf_counter() - started, report)


def write_hf(out: Path, layout: ModelLayout, source: TensorSource, dtype: torch.dtype, max_shard_bytes: int,
             progress: Progress):
    sizes = {
        name: torch.Size(layout.hf_shape(name)).numel() * dtype.itemsize for name in layout.hf_tensors
    }
    shards = plan_hf_shards(sizes, max_shard_bytes)
    files = shard_file_names(len(shards))
    weight_map = {}
    for i, (names, file) in enumerate(zip(shards, files)):
        progress(i, len(shards), file)
        tensors = {name: assemble_hf_tensor(layout, name, source, dtype) for name in names}
        write_hf_shard(out / file, tensors)
        weight_map.update({name: file for name in names})
        del tensors
    progress(len(shards), len(shards), "done")
    if len(shards) > 1:
        write_hf_index(out, weight_map, sum(sizes.values()))


def _write_hf_config(out: Path, side_dir: Path, spec, dtype: torch.dtype):
    dtype_name = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]
    if (side_dir / "config.json").exists():
        copy_side_files(side_dir, out)
        config = json.loads((out / "config.json").read_text())
        config["torch_dtype" if "torch_dtype" in config or "dtype" not in config else "dtype"] = dtype_name
    else:
        config = spec.to_hf_config(dtype_name)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def mcore_to_hf(
    mcore: str | Path, out: str | Path, *, iteration: int | None = None, dtype: str | torch.dtype | None = None,
    max_shard_size_gb: float = 5.0, force: bool = False, verify: bool | None = None,
    progress: Progress = _no_progress,
) -> ConvertResult:
    started = time.perf_counter()
    src = MegatronTorchCheckpoint(mcore, iteration)
    out = Path(out)
    check_output_dir(out, force, src.root)
    dtype = parse_dtype(dtype) or src.dtype
    report = None
    with staged_output(out, force) as tmp:
        write_hf(tmp, src.layout, src, dtype, int(max_shard_size_gb * 2**30), progress)
        _write_hf_config(tmp, src.root / HF_SIDE_DIR, src.spec, dtype)
        if _should_verify(verify, src.spec):
            report = VerifyReport()
            written = HFCheckpoint(tmp)
            compare_tensors(report, (src.layout, src), (src.layout, HFTensorSource(written)), dtype)
            compare_logits(report, qlm_logits_fn(src.layout, src, dtype), hf_logits_fn(tmp, dtype), src.spec)
            _finish(report)
    return ConvertResult(out, *_dir_bytes(out), time.perf_counter() - started, report)


def mcore_to_mcore(
    mcore: str | Path, out: str | Path, *, tp: int = 1, pp: int = 1, vpp: int = 1,
    first_stage_layers: int | None = None, last_stage_layers: int | None = None,
    iteration: int | None = None, dtype: str | torch.dtype | None = None,
    make_vocab_size_divisible_by: int | None = None, force: bool = False, verify: bool | None = None,
    progress: Progress = _no_progress,
) -> ConvertResult:
    started = time.perf_counter()
    src = MegatronTorchCheckpoint(mcore, iteration)
    out = Path(out)
    check_output_dir(out, force, src.root)
    divisible = make_vocab_size_divisible_by or src.layout.make_vocab_size_divisible_by
    layout = ModelLayout(src.spec, tp, pp, vpp, first_stage_layers, last_stage_layers, divisible)
    dtype = parse_dtype(dtype) or src.dtype
    args = set_layout_args(argparse.Namespace(**vars(src.args)), layout, dtype)
    report = None
    with staged_output(out, force) as tmp:
        write_mcore_torch(tmp, layout, src, dtype, args, src.iteration, progress)
        if (src.root / HF_SIDE_DIR).is_dir():
            copy_side_files(src.root / HF_SIDE_DIR, tmp / HF_SIDE_DIR)
        if _should_verify(verify, src.spec):
            report = VerifyReport()
            written = MegatronTorchCheckpoint(tmp, src.iteration, spec=src.spec)
            compare_tensors(report, (src.layout, src), (written.layout, written), dtype)
            compare_logits(report, qlm_logits_fn(src.layout, src, dtype), qlm_logits_fn(written.layout, written, dtype),
                           src.spec)
            _finish(report)
    return ConvertResult(out, *_dir_bytes(out), time.perf_counter() - started, report)
