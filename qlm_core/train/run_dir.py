"""The run directory of `qlm train` before anything is written into it: what it holds, the lock that keeps two runs
out of one directory, and `--force`.

RUN/.qlm.lock   "PID HOST TOKEN" of the process that holds the run (the launcher, or rank 0 of a run started by
                srun / a user's torchrun). Workers that qlm's launcher starts inherit TOKEN through QLM_RUN_LOCK and
                count as the holder. A lock whose PID is gone on this host is stale: recovered with a notice; one
                taken on another host cannot be checked from here and is removed by hand.

A directory is accepted when it does not exist, is empty (but for the lock), or is a qlm run (config.toml,
metrics.jsonl or checkpoints/). A run with history (steps logged or checkpoints saved) is continued only with
checkpoint.resume; a fresh start into it needs `--force`, which moves the old files to a sibling
RUN.replaced-YYYYmmdd-HHMMSS directory (nothing is deleted) before the new run writes anything.
"""

from __future__ import annotations

import atexit
import errno
import os
import secrets
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

from qlm_core.checkpoint.formats.megatron.legacy import LATEST_FILE
from qlm_core.checkpoint.sources.open import CHECKPOINTS_DIR
from qlm_core.disk import file_in_the_way, pid_alive, write_fault
from qlm_core.errors import QlmError
from qlm_core.train.metrics import parse_log

LOCK_NAME = ".qlm.lock"
LOCK_ENV = "QLM_RUN_LOCK"
RUN_MARKERS = ("config.toml", "metrics.jsonl", CHECKPOINTS_DIR)


def _stderr_notice(text: str):
    print(text, file=sys.stderr, flush=True)


def os_error(path: Path, exc: OSError, what: str = "write to") -> QlmError:
    """A one-line QlmError for an OSError met while writing PATH: the cause by errno, and the fix."""
    cause = exc.strerror or str(exc)
    fault = write_fault(exc)
    if fault == "in_the_way":
        parent = file_in_the_way(path)
        if parent is not None:
            return QlmError(f"cannot {what} {path}: {parent} is a file, not a directory",
                            "choose another --output (or train.output)")
    if fault in ("denied", "read_only"):
        return QlmError(f"cannot {what} {path}: {cause}",
                        "choose a writable --output (or train.output), or fix the directory's permissions")
    if fault in ("no_space", "quota"):
        return QlmError(f"cannot {what} {path}: {cause}", "free space on that disk or choose another --output")
    return QlmError(f"cannot {what} {path}: {cause}", "check the path and the disk, or choose another --output")


def run_history(run_dir: Path) -> list[str]:
    """What of an earlier run RUN holds: logged steps or evals, saved checkpoints (empty: nothing to lose)."""
    run_dir = Path(run_dir)
    found = [name for name in ("metrics.jsonl", "eval.jsonl")
             if (run_dir / name).is_file() and (run_dir / name).stat().st_size > 0]
    ckpt = run_dir / CHECKPOINTS_DIR
    if ckpt.is_dir() and ((ckpt / LATEST_FILE).exists() or any(ckpt.glob("iter_*"))):
        found.append(f"{CHECKPOINTS_DIR}/")
    return found


def _contents(run_dir: Path) -> list[Path]:
    try:
        return [p for p in Path(run_dir).iterdir()
                if p.name != LOCK_NAME and not p.name.startswith(f"{LOCK_NAME}.")]  # the lock and its temporaries
    except OSError as exc:
        raise os_error(run_dir, exc, "read") from None


def check_run_dir(run_dir: Path, resume: bool, force: bool = False):
    """The read-only checks (nothing is written): RUN is usable as this run's directory."""
    run_dir = Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise QlmError(f"the run directory {run_dir} is a file", "choose another --output (or train.output)")
    if not run_dir.is_dir():
        for parent in run_dir.parents:
            if parent.exists():
                if not parent.is_dir():
                    raise QlmError(f"cannot create the run directory {run_dir}: {parent} is a file, not a directory",
                                   "choose another --output (or train.output)")
                break
        return
    contents = _contents(run_dir)
    if contents and not any((run_dir / marker).exists() for marker in RUN_MARKERS):
        shown = ", ".join(sorted(p.name for p in contents)[:3]) + (", ..." if len(contents) > 3 else "")
        raise QlmError(f"{run_dir} is not empty ({shown}) and is not a qlm run directory (no config.toml, "
                       f"metrics.jsonl or {CHECKPOINTS_DIR}/)", "choose a new or empty --output")
    history = run_history(run_dir)
    if history and not resume and not force:
        raise QlmError(f"{run_dir} holds an earlier run ({', '.join(history)}) and checkpoint.resume is off",
                       "pass --resume to continue it, --force to start over (the old files are moved to "
                       f"{run_dir.name}.replaced-TIME, not deleted), or choose another --output")
    if history and resume and not force:
        for name in ("metrics.jsonl", "eval.jsonl"):
            parse_log(run_dir / name)  # a damaged line is named now, not by rank 0 after the launch


class RunLock:
    """RUN/.qlm.lock, held for the run's life; released (file removed) by the process that created it."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK_NAME
        self.token = secrets.token_hex(8)
        self.owned = False

    def _read(self, path: Path | None = None) -> tuple[int, str, str] | None:
        try:
            pid, host, token = (path or self.path).read_text().split()
            return int(pid), host, token
        except FileNotFoundError:
            raise
        except (OSError, ValueError, UnicodeDecodeError):
            return None  # garbled (written by hand, or by a file system without hard links and a crash)

    def _create(self, host: str) -> bool:
        """Put a complete lock file in place, or return False when one exists. The text is written to a private
        name first and hard-linked into place, so no other process ever reads an empty lock."""
        private = self.path.with_name(f"{LOCK_NAME}.{self.token}")
        private.write_text(f"{os.getpid()} {host} {self.token}\n")
        try:
            os.link(private, self.path)
            return True
        except FileExistsError:
            return False
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
                raise
            try:  # no hard links here: an exclusive create (a reader may see it empty for a moment)
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(fd, "w") as fh:
                fh.write(private.read_text())
            return True
        finally:
            private.unlink(missing_ok=True)

    def _take_stale(self, held: tuple[int, str, str] | None) -> bool:
        """Remove the lock judged stale, unless another process replaced it since it was read: the file is renamed
        to a private name first and its text compared, so two processes recovering at once cannot remove each
        other's fresh lock. True when the stale lock is gone."""
        moved = self.path.with_name(f"{LOCK_NAME}.stale-{self.token}")
        try:
            os.replace(self.path, moved)
        except FileNotFoundError:
            return True
        try:
            now = self._read(moved)
        except FileNotFoundError:
            return True
        if now != held:  # a live lock taken meanwhile: put it back (unless yet another one is in place)
            try:
                os.link(moved, self.path)
            except FileExistsError:
                pass
            moved.unlink(missing_ok=True)
            return False
        moved.unlink(missing_ok=True)
        return True

    def acquire(self, notice: Callable[[str], None] = _stderr_notice) -> bool:
        """True: this process created the lock; False: it already belonged to this process or its launcher."""
        host = socket.gethostname()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if self._create(host):
                    break
                try:
                    held = self._read()
                except FileNotFoundError:
                    continue  # released meanwhile
            except OSError as exc:
                raise os_error(self.path.parent, exc) from None
            if held is not None:
                pid, held_host, token = held
                if pid == os.getpid() or token == os.environ.get(LOCK_ENV):
                    return False
                if held_host != host:
                    raise QlmError(f"{self.path.parent} is in use by another qlm train (PID {pid} on host "
                                   f"{held_host}, lock file {self.path}); its liveness cannot be checked from "
                                   f"{host}", "wait for that run to end or choose another --output; if it is not "
                                   "running, delete the lock file") from None
                if pid_alive(pid):
                    raise QlmError(f"{self.path.parent} is in use by another qlm train (PID {pid} on host "
                                   f"{held_host}, lock file {self.path})",
                                   "wait for that run to end or choose another --output; if it is not running, "
                                   "delete the lock file") from None
                what = f"PID {pid} on {held_host} is gone"
            else:
                try:
                    if time.time() - self.path.stat().st_mtime < 10:
                        time.sleep(0.2)  # perhaps being written right now (file systems without hard links)
                        continue
                except FileNotFoundError:
                    continue
                what = "it is unreadable"
            if self._take_stale(held):
                notice(f"note: recovered the stale lock {self.path} ({what})")
        else:
            raise QlmError(f"could not take the lock {self.path} (it keeps changing)", "make sure no other qlm "
                           "train writes into this directory, then retry")
        self.owned = True
        os.environ[LOCK_ENV] = self.token  # workers started from here (torchrun) are holders too
        atexit.register(self.release)
        return True

    def release(self):
        if not self.owned:
            return
        self.owned = False
        try:
            held = self._read()
            if held is not None and held[2] == self.token:
                self.path.unlink()
        except FileNotFoundError:
            pass
        if os.environ.get(LOCK_ENV) == self.token:
            del os.environ[LOCK_ENV]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()


def _move_aside(run_dir: Path, notice: Callable[[str], None]) -> Path:
    run_dir = run_dir.resolve()  # `--output .` has no name of its own
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = run_dir.with_name(f"{run_dir.name}.replaced-{stamp}")
    n = 1
    while target.exists():
        n += 1
        target = run_dir.with_name(f"{run_dir.name}.replaced-{stamp}-{n}")
    try:
        target.mkdir()
        for entry in _contents(run_dir):
            os.replace(entry, target / entry.name)
    except OSError as exc:
        raise os_error(target, exc, "move the old run to") from None
    notice(f"note: --force: the earlier run's files were moved to {target}")
    return target


def claim_run_dir(run_dir: Path, resume: bool, force: bool = False,
                  notice: Callable[[str], None] = _stderr_notice) -> RunLock:
    """Check RUN (check_run_dir), create it, take its lock and, with `force`, move an earlier run aside. The lock is
    released by `release()` (or at exit) when this call created it."""
    run_dir = Path(run_dir)
    check_run_dir(run_dir, resume, force)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise os_error(run_dir, exc, "create the run directory") from None
    lock = RunLock(run_dir)
    lock.acquire(notice)
    try:
        check_run_dir(run_dir, resume, force)  # again under the lock: another run may have written meanwhile
        if force and _contents(run_dir) and any((run_dir / m).exists() for m in RUN_MARKERS):
            _move_aside(run_dir, notice)
    except BaseException:
        lock.release()
        raise
    return lock
