"""Outputs are written to a hidden sibling directory and renamed into place only once complete and verified, so a
failed or interrupted run never leaves a half-written checkpoint behind."""

from __future__ import annotations

import os
import shutil
import uuid
from contextlib import contextmanager
from pathlib import Path

from qlm_core.errors import QlmError


def check_output_dir(out: Path, force: bool, *sources: Path):
    out = Path(out).resolve()
    for src in sources:
        src = Path(src).resolve()
        if out == src or src in out.parents or out in src.parents:
            raise QlmError(f"output {out} overlaps the input {src}", "choose a separate --out directory")
    if out.exists() and not out.is_dir():
        raise QlmError(f"{out} exists and is a file", "choose a directory path for --out")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise QlmError(f"{out} exists and is not empty", "pass --force to replace it or choose another --out")


@contextmanager
def staged_output(out: Path, force: bool = False):
    """Yield a fresh temporary directory; on success it replaces `out`, on any error it is removed."""
    out = Path(out)
    check_output_dir(out, force)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out)
