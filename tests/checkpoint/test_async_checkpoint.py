"""`checkpoint.async_save` (issue 17 item 4): the training thread copies the checkpoint to host memory and trains on
while a background thread writes it, renames it into place and replaces `latest` last. The files are the bytes a
synchronous save writes at the same step, a failed background write is raised at the next wait, and a SIGKILL in
the middle of a background write, then a restart, gives the uninterrupted losses bit for bit (both formats, one
process and two ranks through `qlm train`)."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from parallel_cases import GLOBAL_BATCH, SEQ, SPEC, make_batch

from qlm_core.checkpoint.formats.megatron.legacy import LATEST_FILE
from qlm_core.checkpoint.io.safe_load import safe_torch_load
from qlm_core.config import OptimConfig, ParallelConfig
from qlm_core.errors import QlmError
from qlm_core.parallel.state import Grid
from qlm_core.train import checkpointing
from qlm_core.train.async_checkpoint import CheckpointSaver
from qlm_core.train.checkpointing import CheckpointWrite, TrainState, load_checkpoint, save_checkpoint
from qlm_core.train.engine import Batch, Engine

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "tiny-parity.toml"
FORMATS = ("torch", "torch_dist")
LR = 1e-3


def engine() -> Engine:
    return Engine(SPEC, ParallelConfig(), Grid.single(), micro_batch_size=2, global_batch_size=GLOBAL_BATCH,
                  seq_length=SEQ, optim=OptimConfig(), seed=3)


BATCH = Batch(*make_batch("plain"))


def train(model: Engine, steps: int) -> list[float]:
    return [model.train_step(BATCH, LR).loss for _ in range(steps)]


def files(root: Path) -> dict[str, bytes]:
    """Every file of a checkpoint directory by relative path. DCP's `.metadata` names the directory it was
    written to (storage_meta.checkpoint_id), so it is compared loaded, without that field."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != ".metadata"}


def dcp_metadata(iteration_dir: Path):
    from qlm_core.checkpoint.formats.megatron.torch_dist import SafeFileSystemReader

    metadata = SafeFileSystemReader(str(iteration_dir)).read_metadata()
    metadata.storage_meta = None
    return metadata


class Gate:
    """Holds every background write until opened: what the training thread does meanwhile happens, for certain,
    while the write is pending."""

    def __init__(self, monkeypatch):
        self.open, self.started = threading.Event(), threading.Event()
        self.threads: list[str] = []
        real = CheckpointWrite.write_files

        def held(write, *args, **kwargs):
            self.threads.append(threading.current_thread().name)
            self.started.set()
            assert self.open.wait(60), "the test never opened the gate"
            return real(write, *args, **kwargs)

        monkeypatch.setattr(CheckpointWrite, "write_files", held)


@pytest.mark.parametrize("fmt", FORMATS)
def test_async_save_writes_what_a_synchronous_save_writes_while_training_goes_on(fmt, tmp_path, monkeypatch):
    model = engine()
    train(model, 2)
    state = TrainState(iteration=2, consumed_samples=2 * GLOBAL_BATCH)
    save_checkpoint(tmp_path / "sync", model, state, keep_last=2, extra_args={}, fmt=fmt)
    gate = Gate(monkeypatch)
    saver = CheckpointSaver(asynchronous=True)
    saver.save(tmp_path / "async", model, state, 2, {}, fmt)
    assert gate.started.wait(60)
    train(model, 2)  # weights and Adam moments move on while the write is pending
    assert not (tmp_path / "async" / LATEST_FILE).exists()  # nothing published before the files are written
    assert (tmp_path / "async" / ".iter_0000002.partial").is_dir()
    gate.open.set()
    saver.close()
    assert gate.threads and all(name.startswith("qlm-checkpoint") for name in gate.threads)
    sync, written = files(tmp_path / "sync"), files(tmp_path / "async")
    assert sorted(written) == sorted(sync) and len(sync) >= 2
    for name in sync:
        assert written[name] == sync[name], name
    if fmt == "torch_dist":
        iteration = "iter_0000002"
        assert dcp_metadata(tmp_path / "async" / iteration) == dcp_metadata(tmp_path / "sync" / iteration)


@pytest.mark.parametrize("fmt", FORMATS)
def test_resume_after_an_async_save_continues_bit_for_bit(fmt, tmp_path, monkeypatch):
    reference = engine()
    uninterrupted = train(reference, 6)
    model = engine()
    train(model, 3)
    gate = Gate(monkeypatch)
    saver = CheckpointSaver(asynchronous=True)
    saver.save(tmp_path, model, TrainState(iteration=3, consumed_samples=3 * GLOBAL_BATCH), 2, {}, fmt)
    assert gate.started.wait(60)
    assert train(model, 3) == uninterrupted[3:]  # training during the write is unchanged by it
    gate.open.set()
    saver.close()
    resumed = engine()
    state, _ = load_checkpoint(tmp_path, resumed)
    assert state.iteration == 3
    assert train(resumed, 3) == uninterrupted[3:]


def test_a_failed_background_write_is_raised_at_the_next_save(tmp_path, monkeypatch):
    model, root = engine(), tmp_path / "checkpoints"
    saver = CheckpointSaver(asynchronous=True)
    saver.save(root, model, TrainState(iteration=1), 5, {}, "torch")
    real = checkpointing.write_shard_file

    def full_at_two(path, models, args, iteration, extra):
        if iteration != 2:
            return real(path, models, args, iteration, extra)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpointing, "write_shard_file", full_at_two)
    saver.save(root, model, TrainState(iteration=2), 5, {}, "torch")  # returns: the write fails in the background
    with pytest.raises(QlmError, match=r"iteration 2 could not be written .*model_optim_rng.pt: No space left on "
                                       r"device.*iteration 1\) is intact"):
        saver.save(root, model, TrainState(iteration=3), 5, {}, "torch")  # a second save waits for the first
    assert sorted(p.name for p in root.iterdir()) == ["iter_0000001", LATEST_FILE]
    assert (root / LATEST_FILE).read_text() == "1"
    saver.save(root, model, TrainState(iteration=3), 5, {}, "torch")  # the saver still works afterwards
    saver.close()
    assert (root / LATEST_FILE).read_text() == "3"


def test_a_bug_in_the_background_write_is_raised_as_itself(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise ValueError("a bug, not a write fault")

    monkeypatch.setattr(checkpointing, "write_shard_file", broken)
    saver = CheckpointSaver(asynchronous=True)
    saver.save(tmp_path, engine(), TrainState(iteration=1), 5, {}, "torch")
    with pytest.raises(ValueError, match="a bug, not a write fault"):
        saver.close()
    assert not (tmp_path / LATEST_FILE).exists() and not list(tmp_path.glob(".iter_*"))


def test_async_save_is_a_recipe_key():
    from qlm_core.config import load_recipe

    assert load_recipe(RECIPE, ["checkpoint.async_save=true"]).checkpoint.async_save is True
    assert load_recipe(RECIPE, []).checkpoint.async_save is False


# ---- through `qlm train`: SIGKILL in the middle of a background write, then a restart -----------------------------

# Every process of the launch loads this (tests/workers/kill_in_background_write/sitecustomize.py): the rank named
# SIGKILLs itself in the middle of its background write of checkpoint N.
KILL_HOOK = REPO / "tests" / "workers" / "kill_in_background_write"


def qlm_train(*args, env_extra=None, timeout=900) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200", **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "qlm_cli.main", "train", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=REPO)


def losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines() if line]


def kill_then_resume(run: Path, sets: list[str], kill_rank: int = 0) -> subprocess.CompletedProcess:
    """Killed (SIGKILL) in the background write of checkpoint 4, then re-run to the end; returns the re-run."""
    args = [RECIPE, "--output", run, *sets, "--set", "checkpoint.async_save=true"]
    marker = run.parent / f"{run.name}.on-training-thread"
    path = os.pathsep.join(filter(None, [str(KILL_HOOK), str(REPO), os.environ.get("PYTHONPATH")]))
    killed = qlm_train(*args, env_extra={"PYTHONPATH": path, "QLM_TEST_KILL_AT_SAVE": "4",
                                         "QLM_TEST_KILL_RANK": str(kill_rank), "QLM_TEST_MARKER": str(marker)})
    assert killed.returncode != 0 and not marker.exists(), killed.stderr[-3000:]
    if kill_rank == 0:
        assert killed.returncode == -signal.SIGKILL
    root = run / "checkpoints"
    assert (root / LATEST_FILE).read_text() == "3"  # the previous checkpoint is the latest, and whole
    assert (root / ".iter_0000004.partial").is_dir() and not (root / "iter_0000004").exists()
    resumed = qlm_train(*args)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    assert "resuming from iteration 3" in " ".join(resumed.stdout.split())
    assert not list(root.glob(".iter_*"))  # the killed write's staging removed
    return resumed


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("async-cache")


def common_sets(cache: Path) -> list[str]:
    return ["--set", f"data.cache_dir={cache!s}", "--set", "checkpoint.save_interval=1",
            "--set", "checkpoint.keep_last=20"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, cache):
    """One process, synchronous saves, never killed."""
    run = tmp_path_factory.mktemp("runs") / "sync"
    proc = qlm_train(RECIPE, "--output", run, *common_sets(cache))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run


@pytest.mark.slow
@pytest.mark.parametrize("fmt", FORMATS)
def test_sigkill_during_a_background_write_then_restart_is_bit_identical(fmt, uninterrupted, cache, tmp_path):
    run = tmp_path / fmt
    kill_then_resume(run, [*common_sets(cache), "--set", f"checkpoint.format={fmt}"])
    assert losses(run) == losses(uninterrupted)  # exactly
    assert len(losses(run)) == 10


@pytest.mark.slow
@pytest.mark.distributed
def test_two_ranks_sigkill_during_a_background_write_then_restart_is_bit_identical(cache, tmp_path):
    """tp2 through qlm's torchrun launch: rank 1 is killed in its background write of checkpoint 4 (torchrun ends
    rank 0); the restart continues with the losses of an uninterrupted tp2 run with synchronous saves, and the
    checkpoints written in the background are the synchronous run's bytes."""
    sets = [*common_sets(cache), "--set", "parallel.tp=2"]
    reference = qlm_train(RECIPE, "--output", tmp_path / "sync", *sets)
    assert reference.returncode == 0, reference.stderr[-3000:]
    kill_then_resume(tmp_path / "async", sets, kill_rank=1)
    assert losses(tmp_path / "async") == losses(tmp_path / "sync")
    for iteration in ("iter_0000003", "iter_0000010"):
        for shard in ("mp_rank_00", "mp_rank_01"):
            ours = safe_torch_load(tmp_path / "async/checkpoints" / iteration / shard / "model_optim_rng.pt")
            theirs = safe_torch_load(tmp_path / "sync/checkpoints" / iteration / shard / "model_optim_rng.pt")
            for key in ("model", "qlm_optimizer", "qlm_train_state", "opt_param_scheduler", "iteration"):
                assert_same(ours[key], theirs[key], f"{iteration}/{shard}/{key}")


def assert_same(ours, theirs, where: str):
    if isinstance(theirs, dict):
        assert ours.keys() == theirs.keys(), where
        for key in theirs:
            assert_same(ours[key], theirs[key], f"{where}.{key}")
    elif isinstance(theirs, (list, tuple)):
        assert len(ours) == len(theirs), where
        for index, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            assert_same(a, b, f"{where}[{index}]")
    elif isinstance(theirs, torch.Tensor):
        assert torch.equal(ours, theirs), where
    else:
        assert ours == theirs, where
