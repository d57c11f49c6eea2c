"""The one conversion every direction runs (hf2mcore, mcore2hf, mcore2mcore, ds2hf, ...; `qlm convert SRC --to`):
the source opened by its format (checkpoint/sources/), the target written by its format into a staged folder, its
config and tokenizer files beside, and with --verify the written checkpoint reopened and compared with the source,
every tensor bit for bit and then the logits. Nothing is renamed into place unless all of it succeeded."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from qlm_core.checkpoint.convert.verify import (
    AUTO_VERIFY_MAX_PARAMS,
    VerifyReport,
    compare_logits,
    compare_tensors,
    hf_logits_fn,
    qlm_logits_fn,
    scan_nan,
)
from qlm_core.checkpoint.io.progress import Progress, no_progress
from qlm_core.checkpoint.io.staging import check_output_dir, staged_output
from qlm_core.checkpoint.sources.format_api import CheckpointFormat, OpenedCheckpoint, ReadOptions, WriteOptions
from qlm_core.checkpoint.sources.nearby import tokenizer_near
from qlm_core.dtypes import dtype_named
from qlm_core.errors import QlmError
from qlm_core.models.layout import ModelLayout, TensorSource
from qlm_core.models.parameters import num_parameters


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


def open_source(fmt: CheckpointFormat, src: str | Path, out: str | Path, force: bool,
                options: ReadOptions) -> tuple[OpenedCheckpoint, Path]:
    """SRC opened by its format, and OUT checked: free (or --force) and not the source or inside it."""
    opened = fmt.open(Path(src), options)
    out = Path(out)
    check_output_dir(out, force, opened.root)
    return opened, out


def verify_written(opened: OpenedCheckpoint, target: CheckpointFormat, tmp: Path, layout: ModelLayout,
                   dtype: torch.dtype, options: WriteOptions) -> VerifyReport:
    """Reopen what was written: every view's tensors against the source's, a carried training state, then the
    logits of the first view against the source's (transformers' for HF models, qlm's model otherwise)."""
    report = VerifyReport()
    views = target.reopen(tmp, layout, dtype, options)
    for view in views:
        compare_tensors(report, (opened.layout, opened.weights), (view.layout, view.weights), view.dtype)
    if options.carrier is not None:
        options.carrier.verify(report, tmp)
    reference = (hf_logits_fn(opened.hf_path, dtype) if opened.hf_path is not None
                 else qlm_logits_fn(opened.layout, opened.weights, dtype))
    candidate = (hf_logits_fn(tmp, dtype) if target.hf_logits
                 else qlm_logits_fn(views[0].layout, views[0].weights, dtype))
    compare_logits(report, reference, candidate, opened.spec)
    finish_report(report)
    return report


def convert_opened(opened: OpenedCheckpoint, out: Path, target: CheckpointFormat, layout: ModelLayout,
                   dtype: torch.dtype, options: WriteOptions, *, started: float, force: bool = False,
                   verify: bool | None = None, progress: Progress = no_progress,
                   notes: tuple[str, ...] = ()) -> ConvertResult:
    """`opened` (its output folder already checked free, or --force) -> `out` in `target`'s format at `layout` and
    `dtype`; `started`: when the conversion began (perf_counter), for the result's seconds."""
    report = None
    with staged_output(out, force) as tmp:
        target.write(tmp, layout, opened.weights, dtype, options, progress)
        opened.side_files(tmp / target.side_folder if target.side_folder else tmp, dtype, target.name)
        if should_verify(verify, opened.spec):
            report = verify_written(opened, target, tmp, layout, dtype, options)
    warnings = unverified_warnings(verify, opened.spec, (opened.layout, opened.weights))
    return ConvertResult(out, *dir_bytes(out), time.perf_counter() - started, report, [*opened.notes, *notes],
                         [*opened.warnings, *warnings])
