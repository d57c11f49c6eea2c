"""Optimizer state across layouts: `qlm train` writes a checkpoint at TP2·PP2·DP2, `qlm convert mcore2mcore` reshards
it to TP1·PP1 and then to TP2·PP1, every Adam tensor (fp32 master, exp_avg, exp_avg_sq) stays equal to its merged
original, and `qlm train` resumed at TP2·PP1·DP2 continues with the losses of the uninterrupted run."""

import pytest
import torch

from qlm_core.checkpoint.layout import read_range
from qlm_core.checkpoint.mcore import OPTIMIZER_KEY, MegatronTorchCheckpoint

from test_train_cli import RECIPE, losses, qlm_train

pytestmark = pytest.mark.slow
VIEWS = ("master", "exp_avg", "exp_avg_sq")
COMMON = ["--set", "train.micro_batch_size=1", "--set", "train.train_iters=4", "--set", "checkpoint.save_interval=2",
          "--set", "checkpoint.keep_last=5", "--set", "parallel.zero_stage=1"]


def layout_args(tp, pp, dp):
    return ["--set", f"parallel.tp={tp}", "--set", f"parallel.pp={pp}", "--set", f"parallel.dp={dp}"]


def adam_tensors(root, iteration=None) -> dict[str, torch.Tensor]:
    """Every optimizer tensor of a checkpoint, merged into its full (unpadded) global tensor."""
    merged = {}
    for view in VIEWS:
        ckpt = MegatronTorchCheckpoint(root, iteration, view=view)
        for tensor in ckpt.layout.global_tensors:
            merged[f"{view}:{tensor.name}"] = read_range(ckpt, tensor, 0, tensor.real_extent)
    return merged


def test_adam_states_survive_tp2pp2dp2_to_tp1pp1_to_tp2pp1(tmp_path, run_qlm):
    cache, run = tmp_path / "cache", tmp_path / "run"
    qlm_train(RECIPE, "--output", run, "--set", f"data.cache_dir={cache}", *layout_args(2, 2, 2), *COMMON,
              timeout=900)
    source = run / "checkpoints"
    assert MegatronTorchCheckpoint(source, 2).tp == 2

    code, stdout, stderr = run_qlm("convert", "mcore2mcore", "--mcore", source, "--iteration", "2",
                                   "--out", tmp_path / "tp1pp1", "--tp", "1", "--pp", "1")
    assert code == 0 and "verified 144/144 tensors bit-exact" in stdout, stderr  # 36 weights + 3 x 36 Adam
    assert "RNG states dropped" in " ".join(stdout.split())
    resumed = tmp_path / "resumed"
    code, stdout, stderr = run_qlm("convert", "mcore2mcore", "--mcore", tmp_path / "tp1pp1",
                                   "--out", resumed / "checkpoints", "--tp", "2", "--pp", "1")
    assert code == 0 and "verified 144/144" in stdout, stderr

    original = adam_tensors(source, 2)
    for hop in (tmp_path / "tp1pp1", resumed / "checkpoints"):
        carried = adam_tensors(hop)
        assert carried.keys() == original.keys() and len(original) == 3 * 31  # embedding, 4 x 7, norm, output
        for name, tensor in original.items():
            assert carried[name].dtype == torch.float32 and torch.equal(carried[name], tensor), (hop, name)
        ckpt = MegatronTorchCheckpoint(hop)
        for key in (OPTIMIZER_KEY, "qlm_train_state", "opt_param_scheduler"):
            before, after = MegatronTorchCheckpoint(source, 2).extra_state(key), ckpt.extra_state(key)
            assert (after["step"] == before["step"] == 2) if key == OPTIMIZER_KEY else after == before, key
        assert ckpt.extra_state("rng_state") is None

    # torch_dist holds the weights only, and says so
    code, stdout, _ = run_qlm("convert", "mcore2mcore", "--mcore", tmp_path / "tp1pp1", "--out", tmp_path / "dist",
                              "--format", "torch_dist", "--no-verify")
    assert code == 0 and "Adam states not written" in " ".join(stdout.split())

    qlm_train(RECIPE, "--output", resumed, "--set", f"data.cache_dir={cache}", *layout_args(2, 1, 2), *COMMON,
              timeout=900)
    uninterrupted, continued = losses(run), losses(resumed)
    assert len(uninterrupted) == 4 and len(continued) == 2
    assert continued == pytest.approx(uninterrupted[2:], rel=1e-5)
