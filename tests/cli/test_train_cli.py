"""`qlm train` end to end through the CLI: parity of layouts, exact resume after SIGKILL, export to HF."""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import RECIPE, REPO, losses, qlm_train

from qlm_core.checkpoint.formats.megatron.legacy import MegatronTorchCheckpoint


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("train-cache")


@pytest.fixture(scope="module")
def baseline(tmp_path_factory, cache):
    run = tmp_path_factory.mktemp("runs") / "base"
    qlm_train(RECIPE, "--output", run, "--set", f"data.cache_dir={cache!s}", "--set", "checkpoint.save_interval=1",
              "--set", "checkpoint.keep_last=20")
    return run


# Through the CLI (recipe -> launcher -> torchrun -> workers): one run per distinct code path. Each dimension alone,
# and more combinations, reproduce the 1-process losses in the Engine-level parity suite (tests/parallel_cases.py);
# the 8-rank tp2·SP x pp2 x dp2 ZeRO 1 run with both overlaps is tests/train/test_moe_train.py's (an MoE model, which
# takes every path a dense one does).
LAYOUTS = {
    "cp2": ["parallel.cp=2"],
    "dp2_zero3": ["parallel.dp=2", "parallel.zero_stage=3"],
}


@pytest.mark.distributed
@pytest.mark.parametrize("layout", LAYOUTS)
def test_layouts_reproduce_the_one_process_losses(layout, baseline, cache, tmp_path):
    sets = [arg for kv in LAYOUTS[layout] for arg in ("--set", kv)]
    qlm_train(RECIPE, "--output", tmp_path / layout, "--set", f"data.cache_dir={cache!s}", *sets, timeout=900)
    ours, reference = losses(tmp_path / layout), losses(baseline)
    assert len(ours) == len(reference) == 10
    assert ours == pytest.approx(reference, rel=1e-4), layout


# The child kills itself with SIGKILL in the middle of its N-th checkpoint file write (after the bytes are half out).
KILL_DURING_WRITE = """
import os, signal, sys
import qlm_core.checkpoint.formats.megatron.legacy as mcore
calls = {"n": 0}
real = mcore.fast_torch_save
def dying_save(obj, path):
    calls["n"] += 1
    if calls["n"] == int(os.environ["QLM_TEST_KILL_AT_SAVE"]):
        with open(path, "wb") as fh:
            fh.write(b"half a checkpoint")
        os.kill(os.getpid(), signal.SIGKILL)
    real(obj, path)
mcore.fast_torch_save = dying_save
from qlm_cli.main import main
sys.argv = ["qlm"] + sys.argv[1:]
main()
"""


def assert_every_checkpoint_loads(run: Path):
    root = run / "checkpoints"
    if not (root / "latest_checkpointed_iteration.txt").exists():
        return
    latest = int((root / "latest_checkpointed_iteration.txt").read_text())
    iterations = sorted(int(p.name[5:]) for p in root.glob("iter_*"))
    assert latest in iterations
    for iteration in iterations:
        ckpt = MegatronTorchCheckpoint(root, iteration)
        assert ckpt.chunk_state(0, 0, 0)["decoder.final_layernorm.weight"].shape == (128,)


@pytest.mark.slow
def test_sigkill_anywhere_then_resume_is_bit_identical(baseline, cache, tmp_path):
    run = tmp_path / "killed"
    args = [RECIPE, "--output", run, "--set", f"data.cache_dir={cache!s}", "--set", "checkpoint.save_interval=1",
            "--set", "checkpoint.keep_last=20"]
    # 1) killed while writing its 4th checkpoint
    proc = qlm_train(*args, check=False, child_code=KILL_DURING_WRITE, env_extra={"QLM_TEST_KILL_AT_SAVE": "4"})
    assert proc.returncode == -signal.SIGKILL
    assert_every_checkpoint_loads(run)
    assert (run / "checkpoints/latest_checkpointed_iteration.txt").read_text() == "3"
    # 2) killed at a random moment
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    child = subprocess.Popen([sys.executable, "-m", "qlm_cli.main", "train", *map(str, args)], env=env, cwd=REPO,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    latest = run / "checkpoints/latest_checkpointed_iteration.txt"
    target = random.Random(os.getpid()).randint(4, 8)  # the kill lands somewhere inside step target + 1
    while child.poll() is None and int(latest.read_text()) < target:
        time.sleep(0.05)
    child.send_signal(signal.SIGKILL)
    assert child.wait() == -signal.SIGKILL, "the run ended before it could be killed"
    assert_every_checkpoint_loads(run)
    # 3) run to the end
    qlm_train(*args)
    assert_every_checkpoint_loads(run)
    assert losses(run) == losses(baseline)  # exactly


@pytest.mark.slow
def test_checkpoint_exports_to_hf_and_transformers_reproduces_validation_loss(cache, tmp_path):
    import transformers

    from qlm_core.config import load_recipe
    from qlm_core.data.loader import collate
    from qlm_core.train.data import build_run_data

    run = tmp_path / "run"
    sets = ["--set", f"data.cache_dir={cache!s}", "--set", "data.packing=false", "--set", "train.train_iters=3"]
    qlm_train(RECIPE, "--output", run, *sets)
    out = tmp_path / "hf"
    subprocess.run([sys.executable, "-m", "qlm_cli.main", "convert", "mcore2hf", "--mcore", str(run / "checkpoints"),
                    "--out", str(out)], check=True, capture_output=True, cwd=REPO)
    assert (out / "tokenizer.json").exists()
    recipe = load_recipe(RECIPE, ["data.packing=false", f"data.cache_dir={cache!s}"])
    data = build_run_data(recipe.data, None, cache, 10 * 8, 8)
    rows = [data.valid[i] for i in range(recipe.train.global_batch_size)]
    input_ids, labels, _, _ = collate(rows)
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids).logits
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    logged = json.loads((run / "eval.jsonl").read_text().splitlines()[-1])["valid_loss"]
    assert loss.item() == pytest.approx(logged, rel=1e-5)


@pytest.mark.slow
def test_lora_run_exports_to_peft_and_merged_hf_alike(baseline, cache, tmp_path):
    """LoRA on the baseline run's model through the CLI; the PEFT export on the base model and the merged export
    must give the same logits."""
    import transformers
    from peft import PeftModel

    lora = tmp_path / "lora"
    qlm_train(REPO / "recipes" / "tiny-lora.toml", "--output", lora, "--set", f"data.cache_dir={cache!s}",
              "--set", f"model.load={baseline!s}", "--set", "train.train_iters=3", "--set", "data.seq_length=64",
              "--set", "parallel.tp=2", "--set", "parallel.sp=true")
    assert sorted({name.split(".lora_")[0].split(".")[-1] for name in MegatronTorchCheckpoint(
        lora / "checkpoints").chunk_state(0, 0, 0)}) == ["linear_fc1", "linear_fc2", "linear_proj", "linear_qkv"]

    def convert(*args):
        subprocess.run([sys.executable, "-m", "qlm_cli.main", "convert", *map(str, args)], check=True,
                       capture_output=True, cwd=REPO)

    convert("mcore2hf", "--mcore", baseline / "checkpoints", "--out", tmp_path / "base")
    convert("mcore2hf", "--mcore", lora / "checkpoints", "--out", tmp_path / "merged")
    convert("mcore2peft", "--mcore", lora / "checkpoints", "--out", tmp_path / "peft")
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, tmp_path / "peft").eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    ids = torch.randint(0, 297, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        adapted, reference = peft_model(ids).logits, merged(ids).logits
        assert (adapted - reference).abs().max().item() <= 1e-5
        with peft_model.disable_adapter():
            assert (peft_model(ids).logits - reference).abs().max().item() > 1e-4  # the adapters did something


@pytest.mark.parametrize("sets,message", [
    (["parallel.tpp=2"], "unknown key parallel.tpp; did you mean 'tp'?"),
    (["parallel.tp=two"], "parallel.tp must be an integer"),
    (["data.train=['/nonexistent.jsonl']"], "data file /nonexistent.jsonl does not exist"),
    (["parallel.tp=3"], "parallel.tp 3 does not divide num_attention_heads 4"),
    (["optim.lrr=1"], "did you mean 'lr'?"),
    (["checkpoint.format=zarr"], "checkpoint.format 'zarr' is not one of torch, torch_dist"),
    (["checkpoint.format=torch_dist", "lora.rank=4", "model.load=base"],
     "checkpoint.format torch_dist does not hold LoRA adapters"),
    (["lora.rank=4"], "LoRA needs pretrained weights to adapt"),
    (["schedule.lr_schedule=linear"], "schedule.lr_schedule 'linear' is not one of constant, cosine, wsd"),
    (["model.dtype=fp16"], "model.dtype 'fp16' is not one of bf16, fp32"),
])
def test_bad_recipes_get_one_line_errors(run_qlm, sets, message, tmp_path):
    """Checked before any process starts (no --dry-run: a real launch stops at the same check)."""
    args = [arg for kv in sets for arg in ("--set", kv)]
    code, _, stderr = run_qlm("train", RECIPE, "--output", tmp_path / "run", *args)
    assert code == 2 and message in stderr, stderr
    assert len([line for line in stderr.splitlines() if line.strip()]) == 1
    assert not (tmp_path / "run").exists()


def test_empty_dataset_and_world_mismatch(run_qlm, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    code, _, stderr = run_qlm("train", RECIPE, "--set", f"data.train=['{empty}']", "--output", tmp_path / "run")
    assert code == 2 and "holds no records" in stderr
    code, _, stderr = run_qlm("train", RECIPE, "--set", "parallel.tp=2", "--nproc-per-node", "3", "--output",
                              tmp_path / "run")
    assert code == 2 and "world size 3 is not divisible by tp*pp*cp = 2" in stderr


def test_dry_run_prints_layout_and_memory(run_qlm):
    code, stdout, _ = run_qlm("train", RECIPE, "--set", "parallel.tp=2", "--set", "parallel.zero_stage=1",
                              "--nproc-per-node", "4", "--dry-run")
    assert code == 0
    assert "dp2 x pp1 x cp1 x tp2" in stdout and "[parallel]" in stdout and "optimizer" in stdout


@pytest.mark.slow  # the baseline fixture trains a model
def test_dry_run_of_a_recipe_that_loads_a_qlm_run(run_qlm, baseline):
    """The memory estimate reads the model from whatever model.load holds, as the run itself would."""
    code, stdout, stderr = run_qlm("train", RECIPE, "--set", f"model.load={baseline}", "--dry-run")
    assert code == 0, stderr
    assert f"qlm run {baseline}" in " ".join(stdout.split()) and "memory per rank" in stdout


def test_workers_get_the_resume_flag_but_not_force():
    """--resume/--no-resume travel to the torchrun workers; --force does not (the launcher moved the old run)."""
    from qlm_cli.commands.train import _argv_for_workers

    assert _argv_for_workers(Path("r.toml"), ["a.b=1"], "out", False) == [
        "train", "r.toml", "--output", "out", "--set", "a.b=1", "--no-resume"]
    assert _argv_for_workers(Path("r.toml"), [], "out", True)[-1] == "--resume"
    assert _argv_for_workers(Path("r.toml"), [], "out")[-1] == "out"


def test_run_header_says_where_a_resumed_run_starts():
    from qlm_cli.commands.train import RunView
    from qlm_cli.render import console
    from qlm_core.train.trainer import Event

    data = {"layout": "dp1", "model": "random init of qlm-tiny", "steps": 10, "start_step": 4, "params": 1e6,
            "train_samples": 8, "peak_tflops": 1.0, "peak_source": "recipe",
            "resumed": "resuming from iteration 4 (layout tp2 pp1 dp1)"}
    view = RunView()
    with console.capture() as captured:
        view(Event("start", data))
    text = " ".join(captured.get().split())
    assert "resuming from iteration 4 (layout tp2 pp1 dp1)" in text and "random init" not in text


def test_without_a_terminal_the_run_prints_plain_step_lines(monkeypatch):
    """Under nohup, Slurm or | tee a rich bar shows nothing until the run ends: the first step, then a line every
    PLAIN_PROGRESS_SECONDS, then the last step are printed as plain lines."""
    from qlm_cli import render
    from qlm_cli.commands.train import RunView
    from qlm_cli.render import console
    from qlm_core.train.metrics import StepMetrics
    from qlm_core.train.trainer import Event

    clock = [1000.0]
    monkeypatch.setattr(render.time, "monotonic", lambda: clock[0])
    data = {"layout": "dp1", "model": "random init of qlm-tiny", "steps": 100, "start_step": 0, "params": 1e6,
            "train_samples": 8, "peak_tflops": 1.0, "peak_source": "recipe"}
    view = RunView()

    def step(n: int) -> Event:
        return Event("step", {"metrics": StepMetrics(step=n, loss=2.5, grad_norm=1.0, lr=1e-3, label_tokens=8,
                                                     samples=8 * n, step_time_s=0.1, s_per_sample=0.01,
                                                     tokens_per_s=640.0, tflops_per_device=0.1, mfu=0.1,
                                                     mem_peak_gb=1.0)})

    assert not console.is_terminal  # pytest captures the output
    with console.capture() as captured:
        view(Event("start", data))
        for n in range(1, 101):
            clock[0] += 1.0  # a step a second: lines at steps 1, 31, 61, 91 and 100
            view(step(n))
    lines = [line for line in captured.get().splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == ["1/100", "31/100", "61/100", "91/100", "100/100"], lines
    assert "loss 2.5000" in lines[0] and "640 tok/s" in lines[0]
