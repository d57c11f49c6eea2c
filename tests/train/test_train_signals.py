"""Stopping `qlm train` cleanly (SIGTERM / SIGINT, train.exit_duration_minutes), honest summary figures, strict
JSON logs, wandb logging, the torchrun launcher's signal path and the Slurm example."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qlm_core.train.engine import Engine

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "tiny-parity.toml"


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.getbasetemp() / "demo-cache"  # shared with test_train_metrics.py


def sets(cache, *extra):
    args = ["--set", f"data.cache_dir={cache}", "--set", "train.train_iters=4", "--set", "train.global_batch_size=4"]
    for kv in extra:
        args += ["--set", kv]
    return args


@pytest.fixture
def signal_at_step(monkeypatch):
    """Engine.train_step sends SIGNUM to this process during step N (1-based): the signal lands mid-step."""
    def arm(n: int, signum: int = signal.SIGTERM):
        real, calls = Engine.train_step, {"n": 0}

        def step(self, batch, lr):
            calls["n"] += 1
            if calls["n"] == n:
                os.kill(os.getpid(), signum)
            return real(self, batch, lr)
        monkeypatch.setattr(Engine, "train_step", step)
        return calls
    return arm


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_finishes_the_step_saves_and_exits_128_plus_signum(run_qlm, cache, tmp_path, signal_at_step, signum):
    signal_at_step(2, signum)
    before = signal.getsignal(signum)
    code, out, err = run_qlm("train", RECIPE, "--output", tmp_path / "run", *sets(cache))
    assert code == 128 + signum, err
    assert signal.getsignal(signum) is before  # the trainer's handler is gone again
    name = signal.Signals(signum).name
    assert f"stopped by {name} at step 2; checkpoint saved to" in err
    assert "resume by re-running the same command" in err and "Traceback" not in out + err
    ckpts = tmp_path / "run" / "checkpoints"
    assert (ckpts / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["stopped"]["step"] == 2 and summary["steps"] == 2


def test_resume_after_sigterm_continues_from_the_saved_step(run_qlm, cache, tmp_path, signal_at_step, monkeypatch):
    signal_at_step(3)
    code, _, err = run_qlm("train", RECIPE, "--output", tmp_path / "run", *sets(cache))
    assert code == 143, err
    monkeypatch.undo()
    code, _, err = run_qlm("train", RECIPE, "--output", tmp_path / "run", *sets(cache))
    assert code == 0, err
    assert [r["step"] for r in rows(tmp_path / "run" / "metrics.jsonl")] == [1, 2, 3, 4]


def test_exit_duration_minutes_saves_and_exits_zero(run_qlm, cache, tmp_path):
    code, out, err = run_qlm("train", RECIPE, "--output", tmp_path / "run",
                             *sets(cache, "train.exit_duration_minutes=0.0001"))
    assert code == 0, err
    assert "stopped after train.exit_duration_minutes = 0.0001 at step 1; checkpoint saved to" in err
    assert (tmp_path / "run" / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == "1"


def wandb_records(path: Path) -> list:
    """The records of an offline run's .wandb file (a LevelDB-style log of wandb's protobuf Records)."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data, records, pos, pending = path.read_bytes(), [], 7, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7]) if left >= 7 else (0, 0, 0)
        if kind == 0:  # block padding
            pos += left
            continue
        pending = (b"" if kind in (1, 2) else pending) + data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # full / last chunk
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def test_wandb_offline_run_holds_the_history_and_resumes_the_same_run(run_qlm, cache, tmp_path, monkeypatch,
                                                                      signal_at_step):
    pytest.importorskip("wandb")
    run = tmp_path / "run"
    wandb_sets = sets(cache, "logging.wandb_project=qlm-test", "train.eval_interval=4")
    signal_at_step(2)
    for expected in (143, 0):  # stopped at step 2, then resumed to the end
        monkeypatch.setenv("WANDB_MODE", "offline")
        monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-env"))
        monkeypatch.setenv("WANDB_SILENT", "true")
        code, _, err = run_qlm("train", RECIPE, "--output", run, *wandb_sets)
        assert code == expected, err
        monkeypatch.undo()
    run_id = (run / "wandb_run_id").read_text().strip()
    offline = sorted((run / "wandb" / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(offline) == 2  # both invocations logged to the one wandb run
    logged = {}
    # wandb's service process writes the file; finish() can return before its last records are on disk
    deadline = time.monotonic() + 60
    while True:
        records = wandb_records(next(offline[-1].glob("*.wandb")))
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    for record in records:
        if record.WhichOneof("record_type") == "history":
            logged.update({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                           for item in record.history.item})
        if record.WhichOneof("record_type") == "run":
            config = {item.key: item.value_json for item in record.run.config.update}
    last = rows(run / "metrics.jsonl")[-1]
    assert logged["step"] == 4 and math.isclose(logged["train/loss"], last["loss"]) and "valid/loss" in logged
    assert '"qlm-tiny"' in config["model"] and "wandb_project" in config["logging"]


def test_wandb_without_the_package_is_one_line_naming_the_extra(run_qlm, cache, tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    code, _, err = run_qlm("train", RECIPE, "--output", tmp_path / "run", *sets(cache, "logging.wandb_project=p"))
    assert code == 2 and err.count("error:") == 1 and 'pip install "qlm[wandb]"' in err
    assert not (tmp_path / "run").exists()



def relaunch_exit(monkeypatch, fake_torchrun) -> tuple[int, list]:
    """qlm's launcher outside torchrun with 2 local ranks and `fake_torchrun` as torchrun: (exit code, what it
    printed as errors)."""
    import typer

    from qlm_cli import launch

    monkeypatch.setattr("torch.distributed.run.main", fake_torchrun)
    for name in ("RANK", "WORLD_SIZE", "SLURM_NTASKS", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    printed = []
    monkeypatch.setattr(launch.err_console, "print", lambda *a, **k: printed.append(a))
    with pytest.raises(typer.Exit) as exit_info:
        launch.relaunch_if_needed(launch.LaunchConfig(2), ["train", "r.toml"], "training")
    return exit_info.value.exit_code, printed

def test_launcher_sets_omp_threads_and_turns_a_signal_into_its_exit_code(monkeypatch):
    """torchrun's agent raises SignalException in the parent after forwarding SIGTERM to the workers: qlm exits
    128 + 15 without a traceback or an error line; OMP_NUM_THREADS is set for the workers (torchrun stays quiet)."""
    import typer
    from torch.distributed.elastic.multiprocessing.api import SignalException

    import qlm_cli.launch as launch

    seen = {}

    def fake_torchrun(args):
        seen["args"], seen["omp"] = args, os.environ.get("OMP_NUM_THREADS")
        raise SignalException("got SIGTERM", sigval=signal.SIGTERM)

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert relaunch_exit(monkeypatch, fake_torchrun) == (143, [])
    assert int(seen["omp"]) == max(1, len(os.sched_getaffinity(0)) // 2)
    assert f"--shutdown-timeout={launch.SHUTDOWN_TIMEOUT_S}" in seen["args"]
    assert "OMP_NUM_THREADS" not in os.environ  # the parent's environment is left as it was
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    with pytest.raises(typer.Exit):
        launch.relaunch_if_needed(launch.LaunchConfig(2), ["train", "r.toml"], "training")
    assert seen["omp"] == "3"  # the user's choice wins



def test_launcher_reports_the_worker_that_stopped_not_the_one_torchrun_then_killed(monkeypatch):
    """Rank 1 stops on SIGINT (exit 130); torchrun then SIGTERMs rank 0 (exit -15) in the same second: qlm exits
    130 (the stop), silently."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure


    def fake_torchrun(args):
        failures = {0: ProcessFailure(0, 100, -15, "/nonexistent"), 1: ProcessFailure(1, 101, 130, "/nonexistent")}
        failures[0].timestamp = failures[1].timestamp = 1_700_000_000
        raise ChildFailedError("qlm", failures)

    assert relaunch_exit(monkeypatch, fake_torchrun) == (130, [])

@pytest.mark.distributed
@pytest.mark.slow
def test_two_ranks_sigterm_to_the_launcher_saves_and_the_resume_finishes(cache, tmp_path):
    import time

    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "qlm_cli.main", "train", RECIPE, "--output", run,
           *sets(cache, "parallel.dp=2", "train.train_iters=6")]
    # each step slowed to 0.5 s (tests/workers/slow_steps): the signal after step 1 lands before step 6 on any machine
    env = {**os.environ, "COLUMNS": "200", "QLM_TEST_STEP_SECONDS": "0.5",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "tests" / "workers" / "slow_steps"),
                                                        os.environ.get("PYTHONPATH")]))}
    env.pop("OMP_NUM_THREADS", None)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    deadline = time.monotonic() + 600
    while not (run / "metrics.jsonl").exists() or not (run / "metrics.jsonl").read_text().strip():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 143, err[-3000:]
    assert "Traceback" not in out + err and "OMP_NUM_THREADS" not in err and "death signal" not in err
    stopped = json.loads((run / "summary.json").read_text())["stopped"]
    assert stopped["reason"] == "SIGTERM" and 1 <= stopped["step"] < 6
    assert f"stopped by SIGTERM at step {stopped['step']}; checkpoint saved to" in err
    latest = (run / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip()
    assert int(latest) == stopped["step"]
    resumed = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [r["step"] for r in rows(run / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]


def test_slurm_example_parses_and_names_the_recipe_and_real_options(monkeypatch):
    import shlex

    import typer

    from qlm_cli.main import app
    from qlm_core.config import load_recipe

    script = REPO / "examples" / "slurm" / "qwen2-7b-128k.sbatch"
    assert subprocess.run(["bash", "-n", script], capture_output=True).returncode == 0
    text = script.read_text().replace("\\\n", " ")
    line = next(line for line in text.splitlines() if line.lstrip().startswith("srun "))
    words = shlex.split(line)
    args = words[words.index("qlm") + 2:]
    assert words[words.index("qlm") + 1] == "train" and args[0] == "recipes/qwen2-7b-128k.toml"
    options = {opt for p in typer.main.get_command(app).commands["train"].params for opt in p.opts}
    flags = [a for a in args if a.startswith("--")]
    assert flags and set(flags) <= options, set(flags) - options
    sets = [args[i + 1] for i, a in enumerate(args) if a == "--set"]
    recipe = load_recipe(REPO / args[0], sets)  # every --set names a real key with a valid value
    assert recipe.train.exit_signal_handler and recipe.train.exit_duration_minutes > 0
    # the variables srun sets for each task are the ones qlm's distributed init reads
    from qlm_core.parallel.state import launch_env

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    for name, value in {"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1"}.items():
        monkeypatch.setenv(name, value)
    assert launch_env() == (5, 16, 1)
    assert "export MASTER_PORT" in text and "MASTER_ADDR" in text



def test_a_rank_stuck_after_a_signal_exits_by_itself(monkeypatch):
    """A survivor blocked in a collective with a dead rank never reaches the next poll: it exits after a bound
    (below torchrun's shutdown wait); a rank that does reach the poll is not cut short."""
    from qlm_core.train import signals

    exits = []
    monkeypatch.setattr(signals, "STUCK_AFTER_SIGNAL_S", 0.2)
    monkeypatch.setattr(signals, "_exit_stuck", lambda signum: exits.append(signum))
    with signals.StopControl() as stop:
        stop._record(signal.SIGTERM, None)
        time.sleep(0.6)
    assert exits == [signal.SIGTERM]
    with signals.StopControl() as stop:
        stop._record(signal.SIGTERM, None)
        assert stop.poll() == signals.StopReason(signal.SIGTERM)
        time.sleep(0.6)
    assert exits == [signal.SIGTERM]  # the poll cancelled the second watchdog


def test_a_further_signal_does_not_end_the_launcher_before_its_workers(monkeypatch):
    """A second Ctrl-C cuts torchrun's wait short (SignalException while it shuts the workers down): qlm's launcher
    still waits for the workers (ignoring further signals) before it returns and releases the run's lock."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    workers = []

    def interrupted_torchrun(args):
        workers.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.5)"]))
        raise SignalException("got SIGINT", sigval=signal.SIGINT)

    code, printed = relaunch_exit(monkeypatch, interrupted_torchrun)
    assert code == 128 + signal.SIGINT and not printed
    assert signal.getsignal(signal.SIGINT) is not signal.SIG_IGN  # the handlers are restored
    with pytest.raises(ProcessLookupError):
        os.kill(workers[0].pid, 0)  # exited and reaped before the launcher returned
