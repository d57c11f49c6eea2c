"""DPO through `qlm train` under each parallel layout reproduces the 1-process losses and metrics (rtol 1e-4, 10
steps), and the three reference models agree: a frozen copy, the precomputed table, and under LoRA the policy with
its adapters off. A run stopped and resumed gives the uninterrupted numbers bit for bit, and the precomputed table is
read again, not recomputed."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from conftest import make_chat_hf_model
from helpers import REPO, qlm_train

RECIPE = """
[model]
spec = "qlm-tiny"
dtype = "fp32"
[data]
kind = "preference"
train = ["@demo"]
seq_length = 32
packing = false
cache_dir = {cache}
[preference]
loss_type = "sigmoid"
beta = 0.1
rpo_alpha = 0.5
[train]
micro_batch_size = 2
global_batch_size = 8
train_iters = 10
eval_interval = 5
eval_iters = 1
[optim]
lr = 1e-3
[schedule]
lr_schedule = "constant"
[checkpoint]
save_interval = 5
[logging]
tensorboard = false
plot = false
"""
CHECKED = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected", "nll_loss")


def rows(run: Path, name: str = "metrics.jsonl") -> list[dict]:
    return [json.loads(line) for line in (run / name).read_text().splitlines() if line]


@pytest.fixture(scope="module")
def recipe(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("dpo-parallel")
    path = root / "dpo.toml"
    path.write_text(RECIPE.format(cache=json.dumps(str(root / "cache"))))
    return path


@pytest.fixture(scope="module")
def baseline(recipe) -> Path:
    run = recipe.parent / "base"
    qlm_train(recipe, "--output", run)
    return run


def assert_same_run(run: Path, reference: Path):
    ours, theirs = rows(run), rows(reference)
    assert len(ours) == len(theirs) == 10
    for a, b in zip(ours, theirs, strict=True):
        for key in CHECKED:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (a["step"], key, a[key], b[key])
    for a, b in zip(rows(run, "eval.jsonl"), rows(reference, "eval.jsonl"), strict=True):
        assert a["valid_loss"] == pytest.approx(b["valid_loss"], rel=1e-4)
        assert a["valid_rewards/accuracies"] == pytest.approx(b["valid_rewards/accuracies"], abs=1e-6)


def test_baseline_learns(baseline):
    line = rows(baseline)
    assert line[0]["rewards/accuracies"] == 0.0 and line[0]["rewards/margins"] == 0.0  # the policy is the reference
    assert line[-1]["loss"] < line[0]["loss"] and line[-1]["rewards/margins"] > 0


# Each layout with a reference model of its own (the frozen copy is the baseline's): the layouts and the references
# are checked together, each against the same 1-process numbers.
LAYOUTS = {
    "tp2_sp": ["parallel.tp=2", "parallel.sp=true"],
    "pp2_precomputed": ["parallel.pp=2", "preference.precompute_reference=true"],
    "pp2_vpp2_interleaved": ["parallel.pp=2", "parallel.vpp=2", "parallel.pp_schedule=interleaved_1f1b"],
    "cp2": ["parallel.cp=2"],
    "dp2_zero1_precomputed": ["parallel.dp=2", "parallel.zero_stage=1", "preference.precompute_reference=true"],
    "dp2_zero3": ["parallel.dp=2", "parallel.zero_stage=3"],
}


@pytest.mark.distributed
@pytest.mark.parametrize("layout", LAYOUTS)
def test_layouts_reproduce_the_one_process_dpo(layout, recipe, baseline, tmp_path):
    sets = [arg for value in LAYOUTS[layout] for arg in ("--set", value)]
    qlm_train(recipe, "--output", tmp_path / layout, *sets)
    assert_same_run(tmp_path / layout, baseline)


def test_stop_and_resume_is_bit_identical(recipe, baseline, tmp_path):
    run = tmp_path / "resumed"
    qlm_train(recipe, "--output", run, "--set", "train.exit_interval=5")
    assert len(rows(run)) == 5
    qlm_train(recipe, "--output", run)
    assert [r["loss"] for r in rows(run)] == [r["loss"] for r in rows(baseline)]
    assert [r["rewards/margins"] for r in rows(run)] == [r["rewards/margins"] for r in rows(baseline)]


def test_precomputed_reference_is_kept_and_reused_on_resume(recipe, baseline, tmp_path):
    run, cache = tmp_path / "pre", tmp_path / "cache"
    sets = ["--set", "preference.precompute_reference=true", "--set", f"data.cache_dir={cache}"]
    qlm_train(recipe, "--output", run, "--set", "train.exit_interval=5", *sets)
    (table,) = (cache / "datasets").glob("reference-logps-*.safetensors")
    stamp = table.stat().st_mtime_ns
    qlm_train(recipe, "--output", run, *sets)
    assert table.stat().st_mtime_ns == stamp  # read, not written again
    assert_same_run(run, baseline)  # the table's numbers are the frozen copy's


def test_a_kill_while_the_table_is_written_leaves_nothing_trusted_and_the_rerun_is_exact(recipe, tmp_path):
    """SIGKILL in the middle of the precomputed table's write (half of it under the temporary name): no table is
    left under its own name, the re-run computes it again (the dead writer's temporary removed) and trains exactly
    as an uninterrupted run."""
    cache = tmp_path / "cache"
    sets = ["--set", "preference.precompute_reference=true", "--set", f"data.cache_dir={cache}"]
    qlm_train(recipe, "--output", tmp_path / "whole", *sets, "--set", f"data.cache_dir={tmp_path / 'cache2'}")
    hook = os.pathsep.join(filter(None, [str(REPO / "tests" / "workers" / "kill_in_table_write"), str(REPO),
                                         os.environ.get("PYTHONPATH")]))
    killed = qlm_train(recipe, "--output", tmp_path / "run", *sets, check=False,
                       env_extra={"PYTHONPATH": hook, "QLM_TEST_KILL_IN_TABLE": "1"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    (temporary,) = (cache / "datasets").glob(".reference-logps-*.tmp-*")
    assert not list((cache / "datasets").glob("reference-logps-*"))
    os.utime(temporary, (time.time() - 120, time.time() - 120))  # a writer that died a while ago
    qlm_train(recipe, "--output", tmp_path / "run", *sets)
    assert not temporary.exists()
    assert [[r[k] for k in CHECKED] for r in rows(tmp_path / "run")] == [
        [r[k] for k in CHECKED] for r in rows(tmp_path / "whole")]  # bit for bit


def test_a_resume_reads_the_model_load_iteration_the_run_started_from(recipe, tmp_path):
    """model.load is a run whose latest checkpoint moves on (2 -> 4) while a DPO run that started from it is
    stopped: the resumed run's reference (and starting point) stay iteration 2, as the uninterrupted run had."""
    src = tmp_path / "src"
    qlm_train(recipe, "--output", src, "--set", "train.train_iters=4", "--set", "checkpoint.save_interval=2",
              "--set", "checkpoint.keep_last=0")
    latest = src / "checkpoints" / "latest_checkpointed_iteration.txt"
    latest.write_text("2")
    sets = ["--set", f"model.load={json.dumps(str(src))}"]
    qlm_train(recipe, "--output", tmp_path / "straight", *sets)
    qlm_train(recipe, "--output", tmp_path / "run", *sets, "--set", "train.exit_interval=5")
    latest.write_text("4")
    resumed = qlm_train(recipe, "--output", tmp_path / "run", *sets)
    assert "iteration 2, which this run started from" in " ".join(resumed.stdout.split())
    assert [[r[k] for k in CHECKED] for r in rows(tmp_path / "run")] == [
        [r[k] for k in CHECKED] for r in rows(tmp_path / "straight")]
    assert json.loads((tmp_path / "run" / "model_load.json").read_text()) == {"load": str(src), "iteration": 2}


@pytest.fixture(scope="module")
def lora_recipe(recipe) -> Path:
    """The recipe on a loaded tiny Qwen2 with rank-4 LoRA adapters (the reference: the adapters switched off)."""
    model = recipe.parent / "hf"
    make_chat_hf_model(model, recipe.parent / "lora-demo")
    text = recipe.read_text().replace('spec = "qlm-tiny"', f"load = {json.dumps(str(model))}")
    path = recipe.parent / "lora.toml"
    path.write_text(text + "[lora]\nrank = 4\nalpha = 8.0\n")
    return path


@pytest.mark.distributed
def test_lora_reference_is_the_base_and_pp2_reproduces_it(lora_recipe, tmp_path):
    one, pp2 = tmp_path / "lora", tmp_path / "lora-pp2"
    qlm_train(lora_recipe, "--output", one)
    line = rows(one)
    assert line[0]["rewards/chosen"] == 0.0 and line[0]["rewards/rejected"] == 0.0  # adapters start at zero
    assert line[-1]["rewards/margins"] > 0
    qlm_train(lora_recipe, "--output", pp2, "--set", "parallel.pp=2")
    assert_same_run(pp2, one)
