"""One hostile input or fault: how to set it up, and what a clean result is.

Clean means: exit code != 0, no traceback, one line on stderr (`error: PROBLEM; FIX.`), and nothing half-written
(no `.partial` / `.tmp` leftovers under the case's directory; the case's own `check` for what must survive)."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

LEFTOVER = re.compile(r"\.(partial|tmp)")
# lines a run may print to stderr besides the error: rich progress remnants, qlm's own warnings
NOISE = re.compile(r"^\s*$")


@dataclass
class Outcome:
    code: int
    stdout: str
    stderr: str


@dataclass
class Case:
    """`setup(root, fixtures)` builds what the case needs under `root` (a fresh directory) and returns qlm's argv
    (without `qlm`), or (argv, env) with extra environment variables. `check(root, outcome)` returns a problem
    (text) or None: that old results survived, that nothing was written, that the message names the right thing.
    `expect_ok`: the input is odd but valid (the run must succeed; e.g. a path with [brackets])."""

    klass: str  # the class: "1 data loss", "2 not utf-8", ..., or "first hour"
    name: str
    setup: Callable
    check: Callable[[Path, Outcome], str | None] | None = None
    expect_ok: bool = False
    timeout: float = 300
    # a fault injected while the command runs: (seconds after start, signal number); the case's check judges it
    interrupt: tuple[float, int] | None = None
    extra: dict = field(default_factory=dict)  # "stdin": text fed to the command
    cleanup: Callable[[Path], None] | None = None  # run after judging, whatever the outcome (e.g. unmount)


def judge(case: Case, root: Path, outcome: Outcome) -> str | None:
    """None when the outcome is clean, else what is wrong with it."""
    text = outcome.stdout + outcome.stderr
    if "Traceback (most recent call last)" in text:
        return "traceback"
    if case.expect_ok:
        if outcome.code != 0:
            return f"exit {outcome.code} on valid input: {outcome.stderr.strip()[-300:]}"
    elif case.interrupt is None:
        if outcome.code == 0:
            return "exit 0"
        lines = [line for line in outcome.stderr.splitlines() if not NOISE.match(line)]
        errors = [line for line in lines if line.startswith("error:")]
        if len(errors) != 1:
            return f"{len(errors)} error lines: {outcome.stderr.strip()[-300:]}"
        if "; " not in errors[0]:
            return f"no fix named: {errors[0]}"
    leftovers = [str(p.relative_to(root)) for p in root.rglob("*") if LEFTOVER.search(p.name)]
    if leftovers:
        return f"left behind: {', '.join(leftovers[:3])}"
    if case.check is not None:
        return case.check(root, outcome)
    return None


def says(*words, stream="stderr"):
    """A check: the stream (whitespace folded) holds every one of WORDS."""
    def check(root, out):
        text = " ".join(getattr(out, stream).split())
        missing = [w for w in words if w not in text]
        return f"{stream} does not say {missing}: {getattr(out, stream).strip()[-300:]}" if missing else None
    return check


def all_of(*checks):
    """A check: every one of CHECKS passes (the first problem is reported)."""
    def check(root, out):
        for c in checks:
            problem = c(root, out)
            if problem:
                return problem
        return None
    return check
