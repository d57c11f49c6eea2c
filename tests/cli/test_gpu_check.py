"""bench/gpu_check.sh's dry mode (issue 17 item 7): it exits 0, and every command it prints names files, workers,
verbs, flags and recipe keys that exist (the qlm commands are parsed by qlm itself)."""

import importlib.util
import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "gpu_check.sh"


def run(*args, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, cwd=REPO,
                          env={**__import__("os").environ, "PYTHON": sys.executable})


def printed_commands(stdout: str) -> list[tuple[dict, list[str], str | None]]:
    """(environment, argv, stdout file) of every `  $ ` line."""
    commands = []
    for line in stdout.splitlines():
        if not line.startswith("  $ "):
            continue
        text = line[4:].rsplit("    # ", 1)[0]
        redirect = None
        if " > OUT/" in text:
            text, redirect = text.split(" > OUT/")
        words = shlex.split(text)
        env = {}
        while "=" in words[0] and not words[0].startswith("-"):
            key, value = words.pop(0).split("=", 1)
            env[key] = value
        commands.append((env, words, redirect))
    return commands


@pytest.fixture(scope="module")
def dry():
    proc = run("--dry-run")
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def workers_module():
    spec = importlib.util.spec_from_file_location("gpu_check_workers", REPO / "bench" / "gpu_check_workers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_without_cuda_it_says_so_lists_the_commands_and_fails(dry):
    proc = run()
    assert proc.returncode == 2, proc.stderr  # nothing was checked: not a pass
    assert "nothing was checked: no CUDA device" in proc.stderr
    assert "dry run (no CUDA device" in proc.stdout
    assert printed_commands(proc.stdout) == printed_commands(dry)


def test_every_check_prints_its_commands_and_what_it_proves(dry):
    names = [line.split("]")[0][1:] for line in dry.splitlines() if line.startswith("[")]
    assert names == ["install-qlm", "install-flash-attn", "env", "nccl", "parity-cuda-cpu", "qwen2-1.5b-4k",
                     "qwen2-1.5b-4k-compiled",
                     "profile-probe", "long-context", "gloo-cuda-parity", "train-metrics", "grpo"]
    assert len(printed_commands(dry)) >= 20
    assert "gpu_check.json" in dry


def test_the_worker_commands_name_existing_files_and_parse(dry):
    from parallel_cases import CASES

    workers = workers_module()
    seen = set()
    for _, argv, _ in printed_commands(dry):
        if argv[:3] == ["python", "-m", "torch.distributed.run"]:
            argv = ["python", *argv[5:]]  # the script and its arguments
        if len(argv) > 1 and argv[1].endswith(".py"):
            assert (REPO / argv[1]).is_file(), argv
            args = workers.build_parser().parse_args(argv[2:])
            assert args.name in workers.WORKERS
            seen.add(args.name)
            if args.case:
                assert args.case in CASES and CASES[args.case].world == 2
            assert all(case in CASES for case in args.cases)
    assert seen == set(workers.WORKERS)  # every worker is run by some check


def test_the_qlm_commands_are_valid_qlm_commands(dry, tmp_path):
    """`qlm profile` as printed, without --probe (the prediction alone, on this CPU); `qlm train` as printed with
    --dry-run (every --set key and value checked against the recipe schema, train.empty_cache_interval included)."""
    verbs = []
    for _, argv, redirect in printed_commands(dry):
        if argv[1:3] != ["-m", "qlm_cli.main"]:
            continue
        args = [a.replace("runs/gpu_check", str(tmp_path)) for a in argv[3:]]
        verbs.append(args[0])
        if args[0] == "profile":
            assert redirect == "profile_probe.json" and "--probe" in args
            args = [a for a in args if a not in ("--probe",)]
        else:
            assert (REPO / args[1]).is_file()
            args.append("--dry-run")
        proc = subprocess.run([sys.executable, "-m", "qlm_cli.main", *args], capture_output=True, text=True,
                              timeout=300, cwd=REPO)
        assert proc.returncode == 0, (args, proc.stderr)
        if args[0] == "profile":
            document = json.loads(proc.stdout)
            assert document["layout"]["global_batch_size"] == 8
    assert sorted(verbs) == ["profile", "train", "train"]


def test_an_unknown_check_is_refused():
    proc = run("--dry-run", "--only", "nope")
    assert proc.returncode == 2 and "unknown check nope" in proc.stderr
