"""The ground floor for the disk, which every other floor may use: whether the process that left a temporary still
lives, what an OSError met while writing means (one errno table), and replacing a file or a folder whole through a
temporary sibling, so that a full disk or a kill -9 never leaves a reader half a file and the old result stays until
the new one is complete."""

from __future__ import annotations

import errno
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Literal

WriteFault = Literal["no_space", "quota", "too_large", "read_only", "denied", "in_the_way", "name_too_long", "io"]

# The OSErrors that mean "this output cannot be written there" (not a bug in qlm): each caller turns the fault into
# one line whose fix names its own setting (--out, --output, data.cache_dir, an output prefix).
WRITE_FAULTS: dict[int, WriteFault] = {
    errno.ENOSPC: "no_space",
    errno.EDQUOT: "quota",
    errno.EFBIG: "too_large",
    errno.EROFS: "read_only",
    errno.EACCES: "denied",
    errno.EPERM: "denied",
    errno.ENOTDIR: "in_the_way",
    errno.EEXIST: "in_the_way",
    errno.EISDIR: "in_the_way",
    errno.ENAMETOOLONG: "name_too_long",
    errno.EIO: "io",
}


def write_fault(exc: BaseException | None) -> WriteFault | None:
    """The fault an OSError reports for a write (None: not an OSError, or not one of WRITE_FAULTS)."""
    return WRITE_FAULTS.get(exc.errno) if isinstance(exc, OSError) else None


def os_reason(exc: OSError) -> str:
    """The cause of an OSError as the C library words it (`No space left on device`)."""
    return exc.strerror or (os.strerror(exc.errno) if exc.errno else (str(exc) or type(exc).__name__))


def file_in_the_way(path: Path) -> Path | None:
    """The nearest existing ancestor of PATH (PATH included) when it is a file, where a folder must go."""
    for part in (Path(path), *Path(path).parents):
        if part.exists():
            return part if not part.is_dir() else None
    return None


def pid_alive(pid: int) -> bool:
    """Whether process PID exists on this host (another user's process counts as alive)."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError, ValueError):  # gone, or not a pid at all
        return False
    except PermissionError:
        return True
    return True


TEMPORARY_MARK = ".tmp-"  # .NAME.tmp-PID[SUFFIX]: the writer's pid, so that a killed writer's leftovers are known


def temporary_sibling(path: Path, keep_suffix: bool = False) -> Path:
    """The hidden sibling a writer of PATH fills before the rename (keep_suffix: ending like PATH, for writers that
    pick the format by the name, as numpy's savez and matplotlib's savefig do)."""
    path = Path(path)
    return path.with_name(f".{path.name}{TEMPORARY_MARK}{os.getpid()}{path.suffix if keep_suffix else ''}")


def replace_atomically(path: Path, write: Callable[[Path], object], keep_suffix: bool = False):
    """Replace PATH whole: `write(temporary)` fills a temporary sibling, renamed over PATH once complete; on any
    failure the temporary is removed and PATH is as it was."""
    temporary = temporary_sibling(path, keep_suffix)
    try:
        write(temporary)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def write_text_atomic(path: Path, text: str):
    """Replace PATH's text whole (replace_atomically)."""
    replace_atomically(path, lambda temporary: temporary.write_text(text))


def replace_folder(new: Path, out: Path):
    """Move the complete folder NEW to OUT; an old OUT is set aside first and deleted only once NEW is in place
    (put back when the second rename fails)."""
    new, out = Path(new), Path(out)
    if not out.exists():
        os.replace(new, out)
        return
    old = out.parent / f".{out.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    os.replace(out, old)
    try:
        os.replace(new, out)
    except OSError:
        os.replace(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)
