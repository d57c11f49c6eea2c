"""`qlm train`'s run directory under hostile conditions: the lock, resume repairs, write faults, start-up checks."""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from qlm_core.checkpoint.formats.megatron.legacy import LATEST_FILE
from qlm_core.config import ModelConfig, OptimConfig, ParallelConfig
from qlm_core.errors import QlmError
from qlm_core.models.presets import PRESETS
from qlm_core.parallel.state import Grid
from qlm_core.train import checkpointing
from qlm_core.train.checkpointing import TrainState, resume_iteration, save_checkpoint
from qlm_core.train.metrics import MetricsWriter
from qlm_core.train.run_dir import LOCK_ENV, LOCK_NAME, RunLock, check_run_dir, claim_run_dir
from qlm_core.train.sources import check_spec_matches_load

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "tiny-parity.toml"


def old_run(path: Path, iterations=(2, 4), latest: str | None = "4") -> Path:
    """A run directory as a finished qlm run leaves it (logs and empty checkpoint iteration dirs)."""
    (path / "checkpoints").mkdir(parents=True)
    (path / "config.toml").write_text("[train]\n")
    (path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (1, 2, 3, 4)))
    (path / "eval.jsonl").write_text(json.dumps({"step": 4, "valid_loss": 1.0}) + "\n")
    for i in iterations:
        (path / "checkpoints" / f"iter_{i:07d}").mkdir()
    if latest is not None:
        (path / "checkpoints" / LATEST_FILE).write_text(latest)
    return path


@pytest.fixture(autouse=True)
def _no_inherited_lock(monkeypatch):
    monkeypatch.delenv(LOCK_ENV, raising=False)


# --- the lock ---------------------------------------------------------------------------------------------------


def test_a_live_lock_names_pid_and_host(tmp_path):
    (tmp_path / LOCK_NAME).write_text(f"1 {socket.gethostname()} cafe\n")  # PID 1 is alive
    with pytest.raises(QlmError, match=rf"PID 1 on host {socket.gethostname()}"):
        RunLock(tmp_path).acquire()
    (tmp_path / LOCK_NAME).write_text(f"{os.getpid() + 10**6} elsewhere cafe\n")  # another host: never stale here
    with pytest.raises(QlmError, match="on host elsewhere"):
        RunLock(tmp_path).acquire()


def test_a_stale_lock_is_recovered_with_a_notice(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / LOCK_NAME).write_text(f"{dead.pid} {socket.gethostname()} cafe\n")
    notes = []
    lock = RunLock(tmp_path)
    assert lock.acquire(notes.append)
    assert len(notes) == 1 and "stale lock" in notes[0] and str(dead.pid) in notes[0]
    assert (tmp_path / LOCK_NAME).read_text().split()[0] == str(os.getpid())
    lock.release()
    assert not (tmp_path / LOCK_NAME).exists()


def test_a_lock_being_written_is_not_taken_for_stale(tmp_path):
    lock_file = tmp_path / LOCK_NAME
    lock_file.write_text("")  # another starter between creating and writing it

    def finish_writing():
        time.sleep(0.3)
        lock_file.write_text(f"1 {socket.gethostname()} cafe\n")

    writer = threading.Thread(target=finish_writing)
    writer.start()
    try:
        with pytest.raises(QlmError, match="in use by another qlm train .PID 1 "):
            RunLock(tmp_path).acquire()
    finally:
        writer.join()
    assert lock_file.read_text().startswith("1 ")


def test_two_starters_recovering_one_stale_lock_do_not_remove_each_others(tmp_path, monkeypatch):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lock_file = tmp_path / LOCK_NAME
    lock_file.write_text(f"{dead.pid} {socket.gethostname()} cafe\n")
    real_read = RunLock._read
    calls = []

    def read_then_rival_recovers(self, *path):
        held = real_read(self, *path)
        if not calls:  # the rival removes the stale lock and takes its own after this read
            calls.append(1)
            lock_file.write_text(f"1 {socket.gethostname()} rival\n")
        return held

    monkeypatch.setattr(RunLock, "_read", read_then_rival_recovers)
    with pytest.raises(QlmError, match="PID 1 "):
        RunLock(tmp_path).acquire()
    assert lock_file.read_text().split()[2] == "rival"
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK_NAME]


def test_the_lock_is_reentrant_for_its_workers_and_released_by_its_owner(tmp_path, monkeypatch):
    owner = RunLock(tmp_path)
    assert owner.acquire()
    assert os.environ[LOCK_ENV] == owner.token  # what torchrun's workers inherit
    (tmp_path / LOCK_NAME).write_text(f"1 {socket.gethostname()} {owner.token}\n")  # as the launcher's lock
    worker = RunLock(tmp_path)
    assert worker.acquire() is False  # the launcher's token: this worker is the holder, not a rival
    worker.release()
    assert (tmp_path / LOCK_NAME).exists()
    owner.release()
    assert not (tmp_path / LOCK_NAME).exists() and LOCK_ENV not in os.environ


def test_permission_denied_on_the_lock_is_one_error(tmp_path, monkeypatch):
    def denied(source, path, *args, **kwargs):
        if str(path).endswith(LOCK_NAME):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real(source, path, *args, **kwargs)

    real = os.link
    monkeypatch.setattr(os, "link", denied)
    with pytest.raises(QlmError, match=r"cannot write to .*Permission denied; choose a writable --output"):
        claim_run_dir(tmp_path / "run", resume=True)


# --- what the run directory holds -------------------------------------------------------------------------------


def test_a_foreign_directory_is_refused_even_with_force(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    for force in (False, True):
        with pytest.raises(QlmError, match="is not a qlm run directory"):
            claim_run_dir(tmp_path, resume=True, force=force)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_a_fresh_start_into_an_old_run_needs_force_which_moves_it_aside(tmp_path):
    run = old_run(tmp_path / "run")
    with pytest.raises(QlmError, match=r"holds an earlier run \(metrics.jsonl, eval.jsonl, checkpoints/\).*--force"):
        claim_run_dir(run, resume=False)
    assert (run / "metrics.jsonl").exists() and not (run / LOCK_NAME).exists()
    notes = []
    lock = claim_run_dir(run, resume=False, force=True, notice=notes.append)
    moved = list(tmp_path.glob("run.replaced-*"))
    assert len(moved) == 1 and (moved[0] / "checkpoints" / "iter_0000004").is_dir()
    assert sorted(p.name for p in run.iterdir()) == [LOCK_NAME]
    assert str(moved[0]) in notes[-1]
    lock.release()


def test_output_under_a_regular_file(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(QlmError, match="f is a file, not a directory"):
        check_run_dir(tmp_path / "f" / "run", resume=True)
    with pytest.raises(QlmError, match="is a file"):
        check_run_dir(tmp_path / "f", resume=True)


# --- resume -----------------------------------------------------------------------------------------------------


def test_resume_iteration_names_what_is_there(tmp_path):
    root = old_run(tmp_path / "run") / "checkpoints"
    assert resume_iteration(root) == 4 and resume_iteration(root, 2) == 2
    with pytest.raises(QlmError, match=r"load_iteration = 3 .*iterations: 2, 4"):
        resume_iteration(root, 3)
    (root / LATEST_FILE).write_text("9")
    with pytest.raises(QlmError, match=r"names iteration 9.*iterations: 2, 4"):
        resume_iteration(root)
    (root / LATEST_FILE).unlink()
    with pytest.raises(QlmError, match=r"no latest_checkpointed_iteration.txt"):
        resume_iteration(root)
    assert resume_iteration(tmp_path / "new" / "checkpoints") is None


def test_a_truncated_last_log_line_is_dropped_and_no_eval_row_repeats(tmp_path, capsys):
    run = old_run(tmp_path / "run")
    with open(run / "metrics.jsonl", "a") as fh:
        fh.write('{"step": 5, "lo')  # killed mid-write
    writer = MetricsWriter(run, tensorboard=False, resumed_from=4)
    assert "incomplete last line" in capsys.readouterr().err
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]
    writer.log_eval(4, 1.0)  # the final evaluation of a re-run finished run
    assert len((run / "eval.jsonl").read_text().splitlines()) == 1
    assert not list(run.glob("*.tmp"))


def test_a_damaged_middle_log_line_is_named(tmp_path):
    run = old_run(tmp_path / "run")
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("\n".join([lines[0], "garbage", *lines[2:]]) + "\n")
    with pytest.raises(QlmError, match=r"metrics.jsonl line 2 is not a JSON object"):
        MetricsWriter(run, tensorboard=False, resumed_from=4)


# --- a checkpoint that cannot be written ------------------------------------------------------------------------


def tiny_engine():
    from qlm_core.train.engine import Engine

    return Engine(PRESETS["qlm-tiny"], ParallelConfig(), Grid.single(), micro_batch_size=1, global_batch_size=1,
                  seq_length=16, dtype=torch.float32, optim=OptimConfig(), source=None, seed=0)


def test_disk_full_during_a_checkpoint_keeps_the_last_complete_one(tmp_path, monkeypatch):
    engine, root = tiny_engine(), tmp_path / "checkpoints"
    save_checkpoint(root, engine, TrainState(iteration=1), keep_last=5, extra_args={})

    def full(obj, path):
        path.write_bytes(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpointing, "write_shard_file",
                        lambda path, *a, **k: (path.parent.mkdir(parents=True), full(None, path)))
    with pytest.raises(QlmError, match=r"iteration 2 could not be written .*model_optim_rng.pt: No space left "
                                       r"on device.*iteration 1\) is intact"):
        save_checkpoint(root, engine, TrainState(iteration=2), keep_last=5, extra_args={})
    assert sorted(p.name for p in root.iterdir()) == ["iter_0000001", LATEST_FILE]
    assert (root / LATEST_FILE).read_text() == "1"


def test_resaving_an_iteration_keeps_the_old_copy_until_the_new_one_is_in_place(tmp_path, monkeypatch):
    """checkpoint.load_iteration = 1 in a run that saved 1 and 2: its next save is iteration 2 again."""
    engine, root = tiny_engine(), tmp_path / "checkpoints"
    for iteration in (1, 2):
        save_checkpoint(root, engine, TrainState(iteration=iteration), keep_last=5, extra_args={})
    old_shard = next((root / "iter_0000002").rglob("*.pt")).read_bytes()
    real_replace = os.replace

    def failing_move_in(source, target):
        if Path(source).name == "iter_0000002" and Path(source).parent.name.endswith(".partial"):
            raise OSError(errno.EIO, "Input/output error")
        return real_replace(source, target)

    monkeypatch.setattr(checkpointing.os, "replace", failing_move_in)
    with pytest.raises(QlmError, match="Input/output error"):
        save_checkpoint(root, engine, TrainState(iteration=2, consumed_samples=99), keep_last=5, extra_args={})
    assert next((root / "iter_0000002").rglob("*.pt")).read_bytes() == old_shard
    assert (root / LATEST_FILE).read_text() == "2"


def test_a_swap_killed_midway_is_finished_before_resuming(tmp_path):
    engine, root = tiny_engine(), tmp_path / "checkpoints"
    save_checkpoint(root, engine, TrainState(iteration=2), keep_last=5, extra_args={})
    os.replace(root / "iter_0000002", root / ".iter_0000002.replaced")  # killed before the new copy moved in
    assert resume_iteration(root) == 2
    assert sorted(p.name for p in root.iterdir()) == ["iter_0000002", LATEST_FILE]


# --- start-up checks --------------------------------------------------------------------------------------------


def test_spec_beside_load_must_be_the_same_model():
    tiny = PRESETS["qlm-tiny"]
    check_spec_matches_load(ModelConfig(spec="qlm-tiny", load="x"), tiny)  # same model: fine
    check_spec_matches_load(ModelConfig(load="x"), PRESETS["qwen2-7b"])  # spec left at its default: not compared
    with pytest.raises(QlmError, match=r"model.spec qwen2-7b and model.load x are different models"):
        check_spec_matches_load(ModelConfig(spec="qwen2-7b", load="x"), tiny)


def test_dry_run_names_a_missing_model_load_and_warns_of_long_warmup(run_qlm, tmp_path):
    gone = tmp_path / "gone"
    no_spec = tmp_path / "no-spec.toml"
    no_spec.write_text(RECIPE.read_text().replace('spec = "qlm-tiny"', ""))
    code, _, stderr = run_qlm("train", no_spec, "--dry-run", "--set", f"model.load='{gone}'")
    assert code == 2 and f"model.load {gone} does not exist" in stderr
    code, stdout, stderr = run_qlm("train", RECIPE, "--dry-run", "--set", f"model.load='{gone}'")  # spec named
    assert code == 0 and f"warning: model.load {gone} does not exist here" in stderr
    assert "random init" not in stdout and "qlm-tiny from model.spec" in " ".join(stdout.split())
    code, _, stderr = run_qlm("train", RECIPE, "--dry-run", "--set", "schedule.warmup_iters=10")
    assert code == 0 and "warning: schedule.warmup_iters = 10 >= the run's 10 steps" in stderr


def test_dry_run_shows_the_resume_point(run_qlm, tmp_path):
    """The header says where a resumed run starts (a checkpoint written by save_checkpoint, TP1 PP1 DP1)."""
    run = tmp_path / "run"
    save_checkpoint(run / "checkpoints", tiny_engine(), TrainState(iteration=3), keep_last=5, extra_args={})
    code, stdout, stderr = run_qlm("train", RECIPE, "--dry-run", "--output", run)
    assert code == 0, stderr
    assert "resuming from iteration 3 (layout tp1 pp1 dp1)" in stdout
    code, stdout, _ = run_qlm("train", RECIPE, "--dry-run", "--output", run, "--no-resume")
    assert code == 0 and "resuming" not in stdout


def test_a_write_fault_in_the_run_directory_is_one_line_naming_the_file(tmp_path):
    """Disk full while appending metrics.jsonl (or writing config.toml, summary.json, loss.png) mid-run."""
    from qlm_core.config import Recipe
    from qlm_core.train.trainer import Trainer

    def full_disk():
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "run" / "metrics.jsonl"))

    trainer = Trainer(Recipe(), tmp_path / "run")
    trainer._run = full_disk
    with pytest.raises(QlmError, match=r"cannot write to .*run/metrics.jsonl: No space left on device; free space"):
        trainer.run()

    def elsewhere():  # not the run directory's fault: not renamed as one
        raise OSError(errno.ENOSPC, "No space left on device", "/elsewhere/file")

    trainer._run = elsewhere
    with pytest.raises(OSError):
        trainer.run()


def test_force_under_a_users_launcher_moves_the_old_run_aside(run_qlm, tmp_path, monkeypatch):
    """srun or a user's torchrun starts the ranks itself: rank 0 applies --force (there is no qlm launcher)."""
    run = old_run(tmp_path / "run")
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(name, value)
    code, _, stderr = run_qlm("train", RECIPE, "--output", run, "--force", "--no-resume",
                              "--set", "train.train_iters=1")
    assert code == 0, stderr
    moved = list(tmp_path.glob("run.replaced-*"))
    assert len(moved) == 1 and (moved[0] / "checkpoints" / "iter_0000004").is_dir(), stderr
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 1


def test_a_bad_uneven_pipeline_in_a_recipe_names_the_recipe_keys(run_qlm):
    code, _, stderr = run_qlm("train", RECIPE, "--dry-run", "--set", "parallel.pp=2",
                              "--set", "parallel.num_layers_in_first_pipeline_stage=3",
                              "--set", "parallel.num_layers_in_last_pipeline_stage=3")
    assert code == 2 and "parallel.num_layers_in_first_pipeline_stage 3 + parallel.num_layers_in_last_pipeline_" \
        "stage 3 hold 6 layers" in " ".join(stderr.split()), stderr
    assert "--num-layers" not in stderr and "--pp" not in stderr


def test_rerunning_a_finished_run_keeps_its_record(run_qlm, tmp_path):
    """No step left: nothing is evaluated again and summary.json keeps the figures of the run that trained."""
    run = tmp_path / "run"
    code, _, stderr = run_qlm("train", RECIPE, "--output", run, "--set", "train.train_iters=1")
    assert code == 0, stderr
    before = {name: (run / name).read_bytes() for name in ("summary.json", "metrics.jsonl", "eval.jsonl")}
    code, out, stderr = run_qlm("train", RECIPE, "--output", run, "--resume", "--set", "train.train_iters=1")
    assert code == 0, stderr
    assert {name: (run / name).read_bytes() for name in before} == before
    assert "already finished at step 1" in " ".join(out.split())


def test_a_crash_while_rewriting_the_runs_hf_config_leaves_the_old_one(tmp_path, monkeypatch):
    """Every start rewrites RUN/checkpoints/hf/config.json, which every checkpoint of the run is read with."""
    from qlm_core.train.trainer import write_hf_side_dir

    root = tmp_path / "checkpoints"
    write_hf_side_dir(root, PRESETS["qlm-tiny"], None)
    before = (root / "hf" / "config.json").read_text()
    real_write = Path.write_text

    def torn(self, text, *args, **kwargs):
        if self.name == "config.json":
            real_write(self, text[:10])
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(self, text, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", torn)
    with pytest.raises(OSError):
        write_hf_side_dir(root, PRESETS["qlm-tiny"], None)
    monkeypatch.undo()
    assert (root / "hf" / "config.json").read_text() == before
    assert sorted(p.name for p in root.iterdir()) == ["hf"]
