"""Run directories of `qlm train`: runs that collide, resume, output locations, faults while a checkpoint is saved.

Faults are injected with a sitecustomize.py on the case's PYTHONPATH (the qlm process imports it at start-up)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from battery.case import Case, says

REPO = Path(__file__).resolve().parents[2]
LOCK = ".qlm.lock"
LATEST = "checkpoints/latest_checkpointed_iteration.txt"
_BACKGROUND: dict[str, subprocess.Popen] = {}


def _train(fx, out, *extra):
    return ["train", fx.recipe(), "--output", out, *extra]


_FIXTURE = threading.Lock()


def _run(root: Path, fx) -> Path:
    """A private copy of the finished-run fixture. Built under a lock: run.py's threads would otherwise build it
    twice at once into one directory (the run-directory lock then refuses the second build)."""
    with _FIXTURE:
        fx.run()
    return fx.copy("run", root)


def _inject(root: Path, code: str) -> dict:
    """Environment that makes the qlm process run CODE first (a sitecustomize module)."""
    inject = root / "inject"
    inject.mkdir(exist_ok=True)
    (inject / "sitecustomize.py").write_text(code)
    return {"PYTHONPATH": os.pathsep.join([str(inject), str(REPO)])}


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _all(*checks):
    def check(root, out):
        for c in checks:
            if (problem := c(root, out)) is not None:
                return problem
        return None
    return check


def _no_lock(name="run"):
    return lambda root, out: f"{name}/{LOCK} left behind" if (root / name / LOCK).exists() else None


def _metrics_intact(root, out):
    """The copied finished run still has its 4 step rows and 1 eval row."""
    run = root / "run"
    try:
        steps, evals = [r["step"] for r in _rows(run / "metrics.jsonl")], [r["step"] for r in _rows(run / "eval.jsonl")]
    except (OSError, ValueError) as exc:
        return f"run logs damaged: {exc}"
    if steps != [1, 2, 3, 4] or evals != [4]:
        return f"run logs changed: steps {steps}, evals {evals}"
    return None


def _latest_is(value: str):
    def check(root, out):
        text = (root / "run" / LATEST).read_text().strip() if (root / "run" / LATEST).exists() else None
        return None if text == value else f"latest is {text!r}, expected {value!r}"
    return check


# --- runs that collide ------------------------------------------------------------------------------------------


def _lock_held_by(pid: int, host: str):
    def setup(root, fx):
        run = _run(root, fx)
        (run / LOCK).write_text(f"{pid} {host} feedface\n")
        return _train(fx, run)
    return setup


def _stale_lock(content: str):
    def setup(root, fx):
        run = _run(root, fx)
        (run / LOCK).write_text(content)
        return _train(fx, run)
    return setup


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


# the first of two runs waits before each step until the case's check says "go" (so it is still running when the
# second one starts, however slow the machine)
WAIT_FOR_GO = """
import os, time
import qlm_core.train.metrics as metrics
real = metrics.MetricsWriter.log_step
def waiting(self, m):
    deadline = time.time() + 300
    while not os.path.exists(os.environ["QLM_BATTERY_GO"]) and time.time() < deadline:
        time.sleep(0.05)
    real(self, m)
metrics.MetricsWriter.log_step = waiting
"""


def _concurrent(root, fx):
    """A first run is under way (its lock exists) when the second starts into the same directory."""
    out = root / "run"
    env = {**os.environ, **_inject(root, WAIT_FOR_GO), "OMP_NUM_THREADS": "1", "QLM_BATTERY_GO": str(root / "go")}
    first = subprocess.Popen([sys.executable, "-m", "qlm_cli.main", *map(str, _train(fx, out))], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    _BACKGROUND[str(root)] = first
    deadline = time.time() + 240
    while not (out / LOCK).exists() and first.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    if not (out / LOCK).exists():
        first.kill()
        raise RuntimeError("the first run never took its lock")
    return _train(fx, out)


def _concurrent_check(root, out):
    first = _BACKGROUND.pop(str(root))
    (root / "go").touch()
    try:
        first.wait(timeout=280)
    except subprocess.TimeoutExpired:
        os.killpg(first.pid, signal.SIGKILL)
        return "the first run did not finish"
    if first.returncode:
        return f"the first run failed: {first.stderr.read().decode()[-300:]}"
    steps = [r["step"] for r in _rows(root / "run" / "metrics.jsonl")]
    if steps != [1, 2, 3, 4]:
        return f"metrics.jsonl interleaved: {steps}"
    return says("in use by another qlm train", "PID")(root, out)


# --- resume -----------------------------------------------------------------------------------------------------


def _cut_last_line(name: str):
    def setup(root, fx):
        run = _run(root, fx)
        log = run / name
        log.write_text(log.read_text() + '{"step": 5, "loss": 1.2')  # a kill in the middle of a write
        return _train(fx, run)
    return setup


def _logs_parse(root, out):
    for name in ("metrics.jsonl", "eval.jsonl"):
        try:
            _rows(root / "run" / name)
        except ValueError as exc:
            return f"{name} still does not parse: {exc}"
    return _metrics_intact(root, out)


def _bad_middle_line(root, fx):
    run = _run(root, fx)
    lines = (run / "metrics.jsonl").read_text().splitlines()
    lines[1] = "garbage"
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return _train(fx, run)


def _with_latest(text: str | None):
    def setup(root, fx):
        run = _run(root, fx)
        if text is None:
            (run / LATEST).unlink()
        else:
            (run / LATEST).write_text(text)
        return _train(fx, run)
    return setup


def _replaced_dir_holds_old_run(root, out):
    moved = sorted(root.glob("run.replaced-*"))
    if len(moved) != 1:
        return f"expected one run.replaced-* directory, found {[p.name for p in moved]}"
    if [r["step"] for r in _rows(moved[0] / "metrics.jsonl")] != [1, 2, 3, 4]:
        return "the moved-aside run lost its metrics"
    if not (moved[0] / "checkpoints" / "iter_0000004").is_dir():
        return "the moved-aside run lost its checkpoints"
    new = [r["step"] for r in _rows(root / "run" / "metrics.jsonl")]
    return None if new == [1, 2, 3, 4] else f"the new run logged {new}"


def _foreign_dir(force: bool):
    def setup(root, fx):
        out = root / "mine"
        out.mkdir()
        (out / "notes.txt").write_text("my notes\n")
        return _train(fx, out, *(["--force"] if force else []))
    return setup


def _foreign_untouched(root, out):
    names = sorted(p.name for p in (root / "mine").iterdir())
    if names != ["notes.txt"] or (root / "mine" / "notes.txt").read_text() != "my notes\n":
        return f"the directory was written into: {names}"
    return None if not list(root.glob("mine.replaced-*")) else "the foreign directory was moved"


def _corrupt_config(root, fx):
    run = _run(root, fx)
    (run / "config.toml").write_bytes(b"[model\n\xff\xfe not toml")
    return _train(fx, run)


def _config_valid(root, out):
    import tomllib

    try:
        tomllib.loads((root / "run" / "config.toml").read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        return f"config.toml still corrupt: {exc}"
    return None


# --- output locations and write faults --------------------------------------------------------------------------

ENOSPC_SAVE = """
import errno
import qlm_core.checkpoint.formats.megatron.legacy as legacy
def full(obj, path):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"half a checkpoint")
    raise OSError(errno.ENOSPC, "No space left on device", str(path))
legacy.fast_torch_save = full
"""

ENOSPC_TORCH_SAVE = """
import errno, torch
def full(obj, f, *args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")
torch.save = full
"""

EACCES_LOCK = """
import errno, os, pathlib
real_open, real_write = os.open, pathlib.Path.write_text
def denied_open(path, *args, **kwargs):  # the lock (and its private temporary) cannot be created
    if ".qlm.lock" in os.path.basename(str(path)):
        raise PermissionError(errno.EACCES, "Permission denied", str(path))
    return real_open(path, *args, **kwargs)
def denied_write(self, *args, **kwargs):
    if ".qlm.lock" in self.name:
        raise PermissionError(errno.EACCES, "Permission denied", str(self))
    return real_write(self, *args, **kwargs)
os.open, pathlib.Path.write_text = denied_open, denied_write
"""

EACCES_LATEST = """
import errno, pathlib
real = pathlib.Path.write_text
def denied(self, *args, **kwargs):
    if self.name.startswith(".latest_checkpointed_iteration"):
        raise PermissionError(errno.EACCES, "Permission denied", str(self))
    return real(self, *args, **kwargs)
pathlib.Path.write_text = denied
"""


def _faulty_resume(code: str, *sets: str):
    def setup(root, fx):
        run = _run(root, fx)
        args = [a for s in ("train.train_iters=6", *sets) for a in ("--set", s)]
        return _train(fx, run, *args), _inject(root, code)
    return setup


def _no_new_checkpoint(root, out):
    ckpt = root / "run" / "checkpoints"
    names = sorted(p.name for p in ckpt.iterdir())
    extra = [n for n in names if n not in ("hf", "iter_0000002", "iter_0000004", "latest_checkpointed_iteration.txt")]
    return f"half-written checkpoint left: {extra}" if extra else None


def _fresh_fault(code: str, *sets: str):
    def setup(root, fx):
        args = [a for s in sets for a in ("--set", s)]
        return _train(fx, root / "run", *args), _inject(root, code)
    return setup


def _fresh_has_no_checkpoint(root, out):
    ckpt = root / "run" / "checkpoints"
    iters = sorted(p.name for p in ckpt.glob("*iter_*")) if ckpt.exists() else []
    if iters or (ckpt / "latest_checkpointed_iteration.txt").exists():
        return f"a checkpoint was left: {iters}"
    return None


def _under_file(root, fx):
    (root / "afile").write_text("x")
    return _train(fx, root / "afile" / "run")


def _is_file(root, fx):
    (root / "afile").write_text("x")
    return _train(fx, root / "afile")


# --- other hostile train input ----------------------------------------------------------------------------------


def _spec_disagrees(root, fx):
    """spec names the qlm-tiny preset, load the HF fixture (another shape)."""
    text, n = re.subn(r'^spec = ".*"$', 'spec = "qlm-tiny"', fx.recipe().read_text(), count=1, flags=re.M)
    assert n == 1
    (root / "recipe.toml").write_text(text)
    return ["train", root / "recipe.toml", "--output", root / "run"]


def _without_spec(root, fx) -> Path:
    text, n = re.subn(r'^spec = ".*"\n', "", fx.recipe().read_text(), count=1, flags=re.M)
    assert n == 1
    (root / "recipe.toml").write_text(text)
    return root / "recipe.toml"


def _load_is_file(root, fx):
    return _train(fx, root / "run", "--set", f"model.load='{fx.hf() / 'config.json'}'")


OLD_RUN_UNTOUCHED = _all(_metrics_intact, _latest_is("4"), _no_lock())

CASES = [
    # 1. runs that collide
    Case("rundir collide", "rundir: lock held by a live process on this host",
         _lock_held_by(1, socket.gethostname()),
         check=_all(says("PID 1", socket.gethostname(), LOCK), _metrics_intact)),
    Case("rundir collide", "rundir: lock held by a process on another host",
         _lock_held_by(4242, "some-other-node"), check=_all(says("PID 4242", "some-other-node"), _metrics_intact)),
    Case("rundir collide", "rundir: stale lock of a dead PID is recovered",
         lambda root, fx: _stale_lock(f"{_dead_pid()} {socket.gethostname()} deadbeef\n")(root, fx), expect_ok=True,
         check=_all(says("recovered the stale lock"), _no_lock(), _metrics_intact)),
    Case("rundir collide", "rundir: empty lock file (crash while taking it) is recovered", _stale_lock(""),
         expect_ok=True, check=_all(says("recovered the stale lock"), _no_lock())),
    Case("rundir collide", "rundir: second train into a directory a running train holds", _concurrent,
         check=_concurrent_check, timeout=400),
    # resume and start over
    Case("rundir resume", "rundir: truncated last line of metrics.jsonl is dropped", _cut_last_line("metrics.jsonl"),
         expect_ok=True, check=_all(says("dropped the incomplete last line", "metrics.jsonl"), _logs_parse)),
    Case("rundir resume", "rundir: truncated last line of eval.jsonl is dropped", _cut_last_line("eval.jsonl"),
         expect_ok=True, check=_all(says("eval.jsonl"), _logs_parse)),
    Case("rundir resume", "rundir: a garbage middle line of metrics.jsonl", _bad_middle_line,
         check=says("metrics.jsonl line 2")),
    Case("rundir resume", "rundir: re-running a finished run adds no eval row",
         lambda root, fx: _train(fx, _run(root, fx)), expect_ok=True,
         check=_all(_metrics_intact, says("resuming from iteration 4", stream="stdout"), _no_lock())),
    Case("rundir resume", "rundir: checkpoint.resume=false into an old run",
         lambda root, fx: _train(fx, _run(root, fx), "--set", "checkpoint.resume=false"),
         check=_all(says("holds an earlier run", "--force"), OLD_RUN_UNTOUCHED)),
    Case("rundir resume", "rundir: --no-resume into an old run",
         lambda root, fx: _train(fx, _run(root, fx), "--no-resume"),
         check=_all(says("checkpoint.resume is off"), OLD_RUN_UNTOUCHED)),
    Case("rundir resume", "rundir: --force --no-resume moves the old run aside",
         lambda root, fx: _train(fx, _run(root, fx), "--force", "--no-resume"), expect_ok=True,
         check=_all(says("--force", "run.replaced-"), _replaced_dir_holds_old_run, _no_lock())),
    Case("rundir resume", "rundir: a non-empty directory that is not a qlm run", _foreign_dir(False),
         check=_all(says("is not a qlm run directory", "notes.txt"), _foreign_untouched)),
    Case("rundir resume", "rundir: --force does not move a foreign directory", _foreign_dir(True),
         check=_all(says("is not a qlm run directory"), _foreign_untouched)),
    Case("rundir resume", "rundir: checkpoint.load_iteration=2 resumes there",
         lambda root, fx: _train(fx, _run(root, fx), "--set", "checkpoint.load_iteration=2"), expect_ok=True,
         check=_all(says("resuming from iteration 2 (layout tp1 pp1 dp1)", stream="stdout"), _metrics_intact)),
    Case("rundir resume", "rundir: checkpoint.load_iteration=3 is not saved",
         lambda root, fx: _train(fx, _run(root, fx), "--set", "checkpoint.load_iteration=3"),
         check=_all(says("load_iteration = 3", "iterations: 2, 4"), OLD_RUN_UNTOUCHED)),
    Case("rundir resume", "rundir: latest file names a missing iteration", _with_latest("9"),
         check=_all(says("names iteration 9", "iterations: 2, 4"), _metrics_intact)),
    Case("rundir resume", "rundir: latest file holds garbage", _with_latest("soon"),
         check=says("'soon'", "checkpoint.load_iteration")),
    Case("rundir resume", "rundir: checkpoints without a latest file", _with_latest(None),
         check=_all(says("no latest_checkpointed_iteration.txt", "iterations: 2, 4"), _metrics_intact)),
    Case("rundir resume", "rundir: corrupted config.toml in a run directory", _corrupt_config, expect_ok=True,
         check=_all(_config_valid, _metrics_intact)),
    Case("rundir resume", "rundir: dry run of a resumable run says so",
         lambda root, fx: _train(fx, _run(root, fx), "--dry-run"), expect_ok=True,
         check=says("resuming from iteration 4 (layout tp1 pp1 dp1)", stream="stdout")),
    Case("rundir resume", "rundir: dry run with a checkpoint.load_iteration that is not saved",
         lambda root, fx: _train(fx, _run(root, fx), "--dry-run", "--set", "checkpoint.load_iteration=7"),
         check=says("load_iteration = 7", "iterations: 2, 4")),
    # 2. output locations and write faults
    Case("rundir output", "rundir: --output under a regular file", _under_file,
         check=_all(says("afile is a file"), lambda root, out: None if (root / "afile").read_text() == "x"
                    else "the file was changed")),
    Case("rundir output", "rundir: --output is a regular file", _is_file, check=says("is a file")),
    Case("rundir output", "rundir: --output in a directory that cannot be created (/proc)",
         lambda root, fx: _train(fx, "/proc/qlm-no-such/run"), check=says("/proc/qlm-no-such/run")),
    Case("rundir output", "rundir: permission denied taking the lock",
         lambda root, fx: (_train(fx, root / "run"), _inject(root, EACCES_LOCK)),
         check=says("Permission denied", "writable --output")),
    Case("rundir output", "rundir: disk full while a checkpoint is written", _faulty_resume(ENOSPC_SAVE),
         check=_all(says("iteration 6", "No space left on device", "iteration 4) is intact"), _latest_is("4"),
                    _no_new_checkpoint, _no_lock())),
    Case("rundir output", "rundir: disk full in torch.save of a first torch_dist checkpoint",
         _fresh_fault(ENOSPC_TORCH_SAVE, "checkpoint.format=torch_dist"),
         check=_all(says("iteration 2", "No space left on device", "no earlier checkpoint"),
                    _fresh_has_no_checkpoint)),
    Case("rundir output", "rundir: permission denied replacing the latest pointer", _faulty_resume(EACCES_LATEST),
         check=_all(says("Permission denied", "iteration 4) is intact"), _latest_is("4"), _no_new_checkpoint)),
    # 4/5. hostile train input
    Case("rundir input", "rundir: dry run with a model.load that does not exist and no model.spec",
         lambda root, fx: ["train", _without_spec(root, fx), "--output", root / "run", "--dry-run", "--set",
                           f"model.load='{root / 'nowhere'}'"],
         check=says("model.load", "nowhere", "does not exist")),
    Case("rundir input", "rundir: dry run with a missing model.load beside a model.spec warns",
         lambda root, fx: _train(fx, root / "run", "--dry-run", "--set", f"model.load='{root / 'nowhere'}'"),
         expect_ok=True, check=_all(says("warning: model.load", "does not exist here"),
                                    lambda root, out: "says random init" if "random init" in out.stdout else None)),
    Case("rundir input", "rundir: a real run with a model.load that does not exist",
         lambda root, fx: _train(fx, root / "run", "--set", f"model.load='{root / 'nowhere'}'"),
         check=_all(says("nowhere", "does not exist"),
                    lambda root, out: "run dir written" if (root / "run").exists() else None)),
    Case("rundir input", "rundir: model.load is a file", _load_is_file, check=says("config.json", "not a directory")),
    Case("rundir input", "rundir: model.spec and model.load are different models", _spec_disagrees,
         check=says("model.spec qlm-tiny", "different models")),
    Case("rundir input", "rundir: warmup_iters >= train_iters warns (dry run)",
         lambda root, fx: _train(fx, root / "run", "--dry-run", "--set", "schedule.warmup_iters=10"),
         expect_ok=True, check=says("warning: schedule.warmup_iters = 10 >= the run's 4 steps")),
    Case("rundir input", "rundir: a data file that does not exist",
         lambda root, fx: _train(fx, root / "run", "--set", f"data.train=['{root / 'gone.jsonl'}']"),
         check=_all(says("gone.jsonl"), lambda root, out: "run dir written" if (root / "run").exists() else None)),
    Case("rundir input", "rundir: a recipe that is not UTF-8",
         lambda root, fx: ["train", _write(root / "r.toml", b"[model]\nspec = \"\xff\"\n"), "--output", root / "run"],
         check=says("not UTF-8")),
]


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path
