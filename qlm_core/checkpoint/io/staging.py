"""Outputs are written to a hidden sibling directory and renamed into place only once complete and verified, so a
failed or interrupted run never leaves a half-written checkpoint behind, and an old output is replaced only by a
complete new one.

The sibling is `.NAME.partial-PID-XXXXXXXX`. A run killed before it finished leaves one behind: the next run into
the same output removes it (unless the process that made it is still running)."""

from __future__ import annotations

import errno
import os
import re
import shutil
import uuid
from contextlib import contextmanager
from pathlib import Path

from qlm_core.checkpoint.io.write_faults import as_write_os_error
from qlm_core.disk import WriteFault, os_reason, pid_alive, replace_folder, write_fault
from qlm_core.errors import QlmError

# the fix for each write fault (qlm_core.disk's errno table) of an --out: one line naming the path and the cause
_FIXES: dict[WriteFault, str] = {
    "no_space": "free space on that disk or choose another --out",
    "quota": "free space in your quota or choose another --out",
    "too_large": "choose another --out (the file system refuses files that large)",
    "read_only": "choose an --out on a writable file system",
    "denied": "choose an --out you may write to (or fix its permissions)",
    "in_the_way": "choose an --out whose parents are directories",
    "name_too_long": "choose a shorter --out path",
    "io": "check that disk (an I/O error) or choose another --out",
}


def _ancestor_problem(out: Path) -> QlmError | None:
    """--out below a regular file (or a dangling path component) can never be created."""
    for parent in out.parents:
        if parent.exists():
            if not parent.is_dir():
                return QlmError(f"cannot create {out}: {parent} is a file, not a directory",
                                "choose an --out whose parents are directories")
            return None
        if parent.is_symlink():
            return QlmError(f"cannot create {out}: {parent} is a dangling symbolic link",
                            "choose another --out or fix the link")
    return None


def check_output_dir(out: Path, force: bool, *sources: Path):
    out = Path(out).resolve()
    for src in sources:
        src = Path(src).resolve()
        if out == src or src in out.parents or out in src.parents:
            raise QlmError(f"output {out} overlaps the input {src}", "choose a separate --out directory")
    if out.exists() and not out.is_dir():
        raise QlmError(f"{out} exists and is a file", "choose a directory path for --out")
    problem = _ancestor_problem(out)
    if problem is not None:
        raise problem
    if out.is_dir() and any(out.iterdir()) and not force:
        raise QlmError(f"{out} exists and is not empty", "pass --force to replace it or choose another --out")


def write_error(out: Path, exc: OSError, staging: Path | None = None) -> QlmError | None:
    """The one-line error for an OSError met while writing `out` (through `staging`), or None when it is not a
    write problem."""
    fault = write_fault(exc)
    if fault is None or (fault == "in_the_way" and exc.errno != errno.ENOTDIR):
        return None  # EEXIST / EISDIR inside the staging folder: qlm's own doing, not the user's --out
    fix = _FIXES[fault]
    cause = os_reason(exc)
    filename = str(exc.filename or "")
    if staging is not None and filename.startswith(str(staging)):
        filename = str(out) + filename[len(str(staging)):]
    elif filename and not (filename.startswith(str(out)) or Path(filename) in out.parents
                           or Path(filename).parent == out.parent):
        # not the output at all: an input that cannot be read (the output was not touched)
        return QlmError(f"cannot read {filename}: {cause}", "check that file's permissions and disk")
    where = f" ({filename})" if filename and filename != str(out) else ""
    kept = "; the old output is intact" if out.exists() else ""
    return QlmError(f"cannot write {out}: {cause}{where}{kept}", fix)


_STAGING = re.compile(r"^\.(?P<name>.+)\.(?P<kind>partial|old)-(?:(?P<pid>\d+)-)?[0-9a-f]{8}$")


def remove_stale_staging(out: Path):
    """Remove what a killed run into `out` left behind: `.partial-*` staging directories and the `.old-*` copy of a
    replaced output (put back first, if the kill came between the two renames and `out` is missing)."""
    out = Path(out)
    if not out.parent.is_dir():
        return
    for path in sorted(out.parent.iterdir()):
        match = _STAGING.match(path.name)
        if match is None or match["name"] != out.name or not path.is_dir():
            continue
        if match["pid"] is not None and pid_alive(int(match["pid"])):
            continue
        if match["kind"] == "old" and not out.exists():
            os.replace(path, out)
        else:
            shutil.rmtree(path, ignore_errors=True)


@contextmanager
def staged_output(out: Path, force: bool = False):
    """Yield a fresh temporary directory; on success it replaces `out`, on any error it is removed. OSErrors that
    mean the output cannot be written (full disk, read-only, no permission) become one-line errors."""
    out = Path(out)
    check_output_dir(out, force)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_staging(out)
        check_output_dir(out, force)  # again: the stale clean-up may have put a killed run's old output back
        tmp.mkdir()
    except OSError as exc:
        error = write_error(out, exc, tmp)
        if error is None:
            raise
        raise error from None
    try:
        yield tmp
        replace_folder(tmp, out)
    except BaseException as exc:  # re-raised unless it is a write fault (write_faults.py; torch's DCP
        shutil.rmtree(tmp, ignore_errors=True)  # CheckpointException is a BaseException)
        os_error = as_write_os_error(exc, tmp) if not isinstance(exc, (KeyboardInterrupt, SystemExit)) else None
        error = write_error(out, os_error, tmp) if os_error is not None else None
        if error is None:
            raise
        raise error from None


def probe_writable(folder: Path):
    """Create `folder` and write and remove a probe file in it: an OSError (read-only, permission, a file in the
    way, full disk) says now, before the work, that the output could not be written later."""
    probe = Path(folder) / f".qlm-write-check-{os.getpid()}"
    Path(folder).mkdir(parents=True, exist_ok=True)
    probe.write_bytes(b"")
    probe.unlink()
