"""The hostile battery: every case in tests/battery/cases_*.py, each in a subprocess in a fresh directory, judged by
case.judge. Prints the count of clean results per class and writes runs/battery/results.json.

    python tests/battery/run.py [-k SUBSTRING] [--jobs 2] [--keep DIR]
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parent.parent)]

from battery.case import Case, Outcome, judge  # noqa: E402
from battery.fixtures import Fixtures  # noqa: E402


def collect() -> list[Case]:
    cases = []
    for path in sorted(HERE.glob("cases_*.py")):
        cases += importlib.import_module(f"battery.{path.stem}").CASES
    return cases


def run_case(case: Case, root: Path, fixtures: Fixtures) -> tuple[Case, str | None, Outcome | None]:
    root.mkdir(parents=True)
    try:
        made = case.setup(root, fixtures)
    except Exception as exc:  # a broken case, not a qlm result
        return case, f"setup failed: {exc!r}", None
    argv, env = made if isinstance(made, tuple) else (made, {})
    env = {**os.environ, "COLUMNS": "200", "PYTHONPATH": str(HERE.parent.parent), **env}
    proc = subprocess.Popen([sys.executable, "-m", "qlm_cli.main", *map(str, argv)], cwd=root, env=env,
                            stdin=subprocess.PIPE if "stdin" in case.extra else subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    stdin = case.extra.get("stdin")
    if case.interrupt is not None:
        delay, signum = case.interrupt
        try:
            proc.wait(timeout=delay)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signum) if signum == signal.SIGKILL else proc.send_signal(signum)
    try:
        stdout, stderr = proc.communicate(input=stdin, timeout=case.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        if case.cleanup is not None:
            case.cleanup(root)
        return case, f"timed out after {case.timeout} s", Outcome(-9, stdout, stderr)
    outcome = Outcome(proc.returncode, stdout, stderr)
    try:
        return case, judge(case, root, outcome), outcome
    finally:
        if case.cleanup is not None:
            case.cleanup(root)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-k", default="", help="only cases whose class or name contains this")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--keep", type=Path, default=None, help="keep the cases' directories here")
    parser.add_argument("--out", type=Path, default=Path("runs/battery/results.json"))
    args = parser.parse_args()
    cases = [c for c in collect() if args.k in c.klass or args.k in c.name]
    base = args.keep or Path(tempfile.mkdtemp(prefix="qlm-battery-"))
    fixtures = Fixtures(base / "_fixtures")
    for build in ("hf", "tokenizer", "sft_jsonl", "recipe", "megatron", "run"):  # before threads share them
        getattr(fixtures, build)()
    start = time.perf_counter()
    with ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(lambda ic: run_case(ic[1], base / f"{ic[0]:03d}", fixtures), enumerate(cases)))
    rows, clean = [], Counter()
    total = Counter()
    for case, problem, outcome in results:
        total[case.klass] += 1
        clean[case.klass] += problem is None
        last = outcome.stderr.strip().splitlines()[-1] if outcome and outcome.stderr.strip() else ""
        rows.append({"class": case.klass, "case": case.name, "clean": problem is None, "problem": problem,
                     "exit": outcome.code if outcome else None, "message": last[:400]})
        if problem is not None:
            print(f"NOT CLEAN [{case.klass}] {case.name}: {problem}")
    print(f"\n{'class':<28} clean / cases")
    for klass in sorted(total):
        print(f"{klass:<28} {clean[klass]:>5} / {total[klass]}")
    print(f"{'all':<28} {sum(clean.values()):>5} / {sum(total.values())}   ({time.perf_counter() - start:.0f} s)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=1))
    print(f"wrote {args.out}")
    sys.exit(0 if sum(clean.values()) == sum(total.values()) else 1)


if __name__ == "__main__":
    main()
