"""The GPU check behind bench/gpu_check.sh: on a machine with one CUDA GPU, what the CPU suite cannot show, in under
10 minutes, as one summary table (markdown on stdout and OUT/gpu_check.md, every figure in OUT/gpu_check.json).

    bench/gpu_check.sh                 # run every check (OUT: $OUT if set, else runs/gpu_check)
    bench/gpu_check.sh --dry-run       # print every command it would run and exit 0 (without CUDA and without
                                       # --dry-run it prints the same, says nothing was checked, and exits 2)
    bench/gpu_check.sh --only env nccl # some of the checks

Each check is one or more commands, each in its own process under its own timeout (a crash or a hang costs only its
row), all of them within a 9-minute budget; a failing command records FAIL and the run goes on. The checks and
what each proves are in `plan()`; the commands' own code is bench/gpu_check_workers.py. One GPU cannot hold a
multi-rank NCCL job (NCCL refuses two ranks on one device), so the multi-rank parity cases run on gloo with CUDA
tensors, several ranks sharing the GPU, and NCCL itself is checked on one rank.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORKERS = "bench/gpu_check_workers.py"
BUDGET_S = 540  # every command together; the machine allows 10 minutes a command
PYTHON = "python"  # stands for this interpreter (sys.executable) in a Command's argv
# the 2-rank parity cases that run with gloo on CUDA tensors (tests/parallel_cases.py): TP + SP, ring attention
# with packed documents, a pipeline schedule, the distributed optimizer, packed TP
GLOO_CASES = ("tp2_sp", "cp2_packed", "pp2_1f1b", "dp2_zero1", "packed_tp2")
PROFILE_ARGS = ("--model", "qwen2-1.5b", "--seq-len", "4096", "--mbs", "1", "--gbs", "8", "--tp", "1", "--pp", "1",
                "--cp", "1", "--dp", "1", "--no-sp", "--zero", "0", "--recompute", "none", "--dtype", "bf16",
                "--gpu", "h200", "--num-gpus", "1")
GRPO_SETS = ("model.load=''", "train.train_iters=10", "train.eval_interval=5", "checkpoint.save_interval=0",
             "logging.plot=false", "logging.tensorboard=false")
TRAIN_SETS = ("train.train_iters=20", "train.empty_cache_interval=5", "train.eval_interval=0",
              "checkpoint.save_interval=0", "logging.plot=false", "logging.tensorboard=false")


@dataclass
class Command:
    argv: list[str]  # PYTHON stands for this interpreter
    timeout_s: int
    env: dict[str, str] = field(default_factory=dict)  # on top of the run's environment
    stdout_file: str | None = None  # relative to the output directory: stdout goes there instead of the log

    def shown(self) -> str:
        prefix = "".join(f"{k}={shlex.quote(v)} " for k, v in self.env.items())
        redirect = f" > OUT/{self.stdout_file}" if self.stdout_file else ""
        return prefix + shlex.join(self.argv) + redirect


@dataclass
class Step:
    name: str
    proves: str
    commands: list[Command]
    skip_if: Command | None = None  # a command whose success makes the step unnecessary (an install)
    optional: bool = False  # failing is SKIP (the fallback is used), not FAIL


def worker(name: str, out: str, *args: str, timeout_s: int, env: dict[str, str] | None = None) -> Command:
    return Command([PYTHON, WORKERS, name, "--out", out, *args], timeout_s, env or {})


def torchrun(nproc: int, script: str, *args: str, timeout_s: int) -> Command:
    return Command([PYTHON, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", script,
                    *args], timeout_s)


def qlm(*args: str, timeout_s: int, stdout_file: str | None = None) -> Command:
    return Command([PYTHON, "-m", "qlm_cli.main", *args], timeout_s, stdout_file=stdout_file)


def plan(out: str) -> list[Step]:
    """The checks, in the order they run (the most telling first, should the budget run out)."""
    cpu_only = {"CUDA_VISIBLE_DEVICES": ""}
    return [
        Step("install-qlm", "qlm imports (else `pip install --no-deps -e .`, nothing downloaded)",
             [Command([PYTHON, "-m", "pip", "install", "-q", "--no-deps", "-e", "."], 120)],
             skip_if=Command([PYTHON, "-c", "import qlm_core, qlm_cli"], 30)),
        Step("install-flash-attn", "flash-attn is there or installs quickly; else the torch-native kernels run",
             [Command([PYTHON, "-m", "pip", "install", "-q", "--no-build-isolation", "--retries", "0", "--timeout",
                       "10", "flash-attn"], 120, {"MAX_JOBS": "16"})],
             skip_if=Command([PYTHON, "-c", "import flash_attn"], 30), optional=True),
        Step("env", "the device, its preset, NCCL, flash-attn; PYTORCH_CUDA_ALLOC_CONF set by qlm after `import "
                    "torch` puts the allocator on expandable segments; a bf16 matmul's TFLOP/s",
             [worker("env", out, timeout_s=60)]),
        Step("nccl", "NCCL runs the collectives qlm uses (all-reduce, all-gather, reduce-scatter, all-to-all, "
                     "broadcast) with the right values, on one rank",
             [torchrun(1, WORKERS, "nccl", "--out", out, timeout_s=60)]),
        Step("parity-cuda-cpu", "the parity suite's one-process reference (plain, packed, windowed, MoE; 5 AdamW "
                                "steps, fp32) gives the CPU's losses and grad norms on CUDA (rtol 1e-4)",
             [worker("parity-reference", out, "--device", "cpu", timeout_s=90, env=cpu_only),
              worker("parity-reference", out, "--device", "cuda", timeout_s=60),
              worker("parity-compare-devices", out, timeout_s=30)]),
        Step("qwen2-1.5b-4k", "one GPU trains a Qwen2-1.5B-shaped model (bf16, seq 4096, 8 micro-batches of 1, "
                              "random init and tokens): tokens/s, MFU, peak allocated vs reserved",
             [worker("throughput", out, timeout_s=150)]),
        Step("qwen2-1.5b-4k-compiled", "the same with train.compile = true (each decoder layer compiled): "
                                       "tokens/s against the eager row, and the compile cost",
             [worker("throughput", out, "--compile", timeout_s=180)]),
        Step("profile-probe", "`qlm profile --probe` on the real model: predicted vs measured memory (max "
                              "allocated) and step time",
             [qlm("profile", *PROFILE_ARGS, "--probe", "--steps", "3", "--json", timeout_s=150,
                  stdout_file="profile_probe.json"),
              worker("profile-summary", out, timeout_s=30)]),
        Step("long-context", "packed (8 documents) vs unpacked at 32k on CUDA: flash-attn's varlen path against "
                             "the torch-native pieces (bf16 errors against an fp32 run), peak and time ratios",
             [worker("attention", out, "--kernels", kernels, "--dtype", dtype, *packed, timeout_s=60)
              for kernels, dtype, packed in (("native", "fp32", ["--packed"]), ("native", "bf16", ["--packed"]),
                                             ("native", "bf16", []), ("flash", "bf16", ["--packed"]),
                                             ("flash", "bf16", []))]
             + [worker("long-context-summary", out, timeout_s=30)]),
        Step("gloo-cuda-parity", "2 ranks sharing the GPU over gloo with CUDA tensors reproduce the CUDA reference's "
                                 "losses and grad norms (rtol 1e-4) for " + ", ".join(GLOO_CASES)
                                 + "; a case gloo cannot run on CUDA fails with its error",
             [torchrun(2, WORKERS, "parity-rank", "--out", out, "--case", case, timeout_s=45) for case in GLOO_CASES]
             + [worker("parity-compare-gloo", out, "--cases", *GLOO_CASES, timeout_s=30)]),
        Step("train-metrics", "`qlm train` on CUDA writes mem_allocated_gb and mem_reserved_gb in metrics.jsonl "
                              "and runs with train.empty_cache_interval",
             [qlm("train", "recipes/tiny-sft.toml", "--output", f"{out}/tiny-sft", "--force",
                  *[arg for value in TRAIN_SETS for arg in ("--set", value)], timeout_s=120),
              worker("train-metrics", out, timeout_s=30)]),
        Step("grpo", "`qlm train recipes/tiny-grpo.toml` on CUDA from a random init (fp32, 10 steps): the trainer's "
                     "and the sampler's log-probs of the sampled tokens (max |diff|), seconds of weight sync, "
                     "rollout and whole step",
             [qlm("train", "recipes/tiny-grpo.toml", "--output", f"{out}/tiny-grpo", "--force",
                  *[arg for value in GRPO_SETS for arg in ("--set", value)], timeout_s=120),
              worker("grpo-summary", out, timeout_s=30)]),
    ]


def child_env(extra: dict[str, str]) -> dict[str, str]:
    """The repository and tests/ first on PYTHONPATH (the parity workers import parallel_cases, workers.*)."""
    path = os.pathsep.join(filter(None, [str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **extra}


def run_command(command: Command, out: Path, log, timeout_s: float) -> tuple[int | None, str]:
    """(exit code or None on timeout, the output's last line)."""
    argv = [sys.executable if a == PYTHON else a for a in command.argv]
    log.write(f"$ {command.shown()}\n")
    log.flush()
    stdout = open(out / command.stdout_file, "w") if command.stdout_file else log  # noqa: SIM115
    try:
        proc = subprocess.run(argv, cwd=REPO, env=child_env(command.env), stdout=stdout, stderr=subprocess.PIPE,
                              text=True, timeout=timeout_s, check=False)
        code, stderr = proc.returncode, proc.stderr
    except subprocess.TimeoutExpired as exc:
        code = None
        stderr = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
    finally:
        if stdout is not log:
            stdout.close()
    log.write(stderr)
    log.write(f"[exit {code if code is not None else f'timeout after {timeout_s:.0f} s'}]\n")
    lines = [line for line in stderr.splitlines() if line.strip()]
    return code, lines[-1][:200] if lines else ""


def run_step(step: Step, out: Path, deadline: float) -> dict:
    started = time.monotonic()
    row = {"check": step.name, "proves": step.proves, "figures": {}, "note": ""}
    (out / "logs").mkdir(parents=True, exist_ok=True)
    with open(out / "logs" / f"{step.name}.log", "w") as log:
        if step.skip_if is not None and run_command(step.skip_if, out, log, step.skip_if.timeout_s)[0] == 0:
            return {**row, "status": "PASS", "note": "already there", "seconds": time.monotonic() - started}
        failures = []
        for command in step.commands:
            remaining = deadline - time.monotonic()
            if remaining < 10:
                failures.append("out of time")
                break
            code, last = run_command(command, out, log, min(command.timeout_s, remaining))
            if code != 0:
                failures.append(f"{shlex.join(command.argv[1:])[:70]}: "
                                + ("timeout" if code is None else f"exit {code}") + (f": {last}" if last else ""))
    result_file = out / "results" / f"{step.name}.json"
    if result_file.exists():  # the step's last worker judged the figures
        row.update(json.loads(result_file.read_text()))
    else:
        row["status"] = "FAIL" if failures else "PASS"
    if failures:
        row["note"] = "; ".join(filter(None, [row["note"], *failures]))
        if step.optional and row["status"] != "PASS":
            row["status"] = "SKIP"
    row["seconds"] = time.monotonic() - started
    return row


def figures_text(figures: dict) -> str:
    def shown(value):
        return f"{value:.4g}" if isinstance(value, float) else str(value)
    return ", ".join(f"{k}={shown(v)}" for k, v in figures.items() if not isinstance(v, (dict, list)))


def table(rows: list[dict]) -> str:
    lines = ["| check | status | s | figures | note |", "|---|---|---|---|---|"]
    for row in rows:
        cells = [row["check"], row["status"], f"{row.get('seconds', 0):.0f}", figures_text(row["figures"]),
                 row["note"]]
        lines.append("| " + " | ".join(str(c).replace("|", "/").replace("\n", " ") for c in cells) + " |")
    return "\n".join(lines)


def write_atomic(path: Path, text: str):
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(text)
    partial.replace(path)


def cuda_state() -> str | None:
    """None when a CUDA device is usable, else why not."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return f"no CUDA device (torch {torch.__version__}: torch.cuda.is_available() is False)"
    return None


def dry_run(steps: list[Step], out: str, why: str):
    print(f"dry run ({why}): the commands it would run, in order, from {REPO}")
    print(f"(python = {sys.executable}; OUT = {out}; each line ends with its timeout; budget {BUDGET_S} s)")
    for step in steps:
        print(f"\n[{step.name}] {step.proves}")
        if step.skip_if is not None:
            print(f"  skipped when this succeeds: {step.skip_if.shown()}")
        for command in step.commands:
            print(f"  $ {command.shown()}    # {command.timeout_s} s")
    print(f"\nsummary: a markdown table on stdout and in {out}/gpu_check.md, every figure in {out}/gpu_check.json")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="print the commands and exit 0")
    parser.add_argument("--out", help="output directory (default: $OUT, else runs/gpu_check)")
    parser.add_argument("--only", nargs="+", metavar="CHECK", help="run only these checks")
    args = parser.parse_args(argv)
    out = args.out or os.environ.get("OUT") or "runs/gpu_check"
    steps = plan(out)
    if args.only:
        unknown = sorted(set(args.only) - {s.name for s in steps})
        if unknown:
            parser.error(f"unknown check {', '.join(unknown)}; the checks: {', '.join(s.name for s in steps)}")
        steps = [s for s in steps if s.name in args.only]
    why = "--dry-run" if args.dry_run else cuda_state()
    if why is not None:
        dry_run(steps, out, why)
        if args.dry_run:
            return 0
        print(f"\nnothing was checked: {why}; run it on a machine with a CUDA GPU (or pass --dry-run to only list "
              "the commands)", file=sys.stderr)
        return 2  # a check that did not run must not read as one that passed

    root = Path(out) if Path(out).is_absolute() else REPO / out
    (root / "results").mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + BUDGET_S
    rows = []
    for step in steps:
        print(f"[{step.name}] ...", flush=True)
        rows.append(run_step(step, root, deadline))
        print(f"[{step.name}] {rows[-1]['status']} in {rows[-1]['seconds']:.0f} s {rows[-1]['note']}", flush=True)
    summary = table(rows)
    print("\n" + summary)
    write_atomic(root / "gpu_check.md", summary + "\n")
    write_atomic(root / "gpu_check.json", json.dumps({"rows": rows}, indent=1) + "\n")
    print(f"\nwrote {root}/gpu_check.md and {root}/gpu_check.json (logs in {root}/logs)")
    return 0 if all(row["status"] in ("PASS", "SKIP") for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
