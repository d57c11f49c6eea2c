"""Write faults that torch and safetensors report as their own exceptions, as the OSError they stand for.

On a full disk torch.save raises a RuntimeError from its zip writer ("PytorchStreamWriter failed writing file",
"[enforce fail at inline_container.cc] unexpected pos N vs M") and safetensors a SafetensorError that carries the
OS error number ("I/O error: No space left on device (os error 28)"). Neither is an OSError, so without this a
full disk during a checkpoint would end in a traceback."""

from __future__ import annotations

import errno
import os
import re
import shutil
from pathlib import Path

_OS_ERROR_NUMBER = re.compile(r"\(os error (\d+)\)")
_TORCH_WRITER = ("PytorchStreamWriter failed writing", "inline_container.cc", "unexpected pos")
_NEARLY_FULL = 1 << 20  # bytes free below which a torch writer failure is taken for a full disk


def as_write_os_error(exc: BaseException, path: Path) -> OSError | None:
    """`exc` as an OSError naming `path` when it is a write fault, else None (a bug: let it propagate)."""
    if isinstance(exc, OSError):
        return exc
    if type(exc).__name__ == "CheckpointException":  # torch.distributed.checkpoint: every rank's failure, gathered
        for failure in getattr(exc, "failures", {}).values():
            found = as_write_os_error(failure[0] if isinstance(failure, tuple) else failure, path)
            if found is not None:
                return found
        return None
    text = str(exc)
    number = _OS_ERROR_NUMBER.search(text)
    if number and type(exc).__name__ == "SafetensorError" and "while serializing" in text:  # not a read
        code = int(number.group(1))
        return OSError(code, os.strerror(code), str(path))
    if isinstance(exc, RuntimeError) and any(marker in text for marker in _TORCH_WRITER):
        if _free_bytes(Path(path)) < _NEARLY_FULL:
            return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return OSError(errno.EIO, "torch could not write the file (an I/O error)", str(path))
    return None


def _free_bytes(path: Path) -> int:
    for candidate in (path, *path.parents):
        if candidate.exists():
            try:
                return shutil.disk_usage(candidate).free
            except OSError:
                return 0
    return 0
