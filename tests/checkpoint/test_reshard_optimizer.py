"""Optimizer state across layouts: `qlm train` writes a checkpoint at TP2·PP2·DP2, `qlm convert mcore2mcore` reshards
it to TP1·PP1 and then to TP2·PP1, every Adam tensor (fp32 master, exp_avg, exp_avg_sq) stays equal to its merged
original, and `qlm train` resumed at TP2·PP1·DP2 continues with the losses of the uninterrupted run. A torch_dist
checkpoint of the trainer holds the same state as a torch one and resumes at another layout without a reshard."""

import shutil

import pytest
import torch
from helpers import RECIPE, losses, qlm_train

from qlm_core.checkpoint.formats.megatron.format import open_megatron
from qlm_core.checkpoint.formats.megatron.legacy import MegatronTorchCheckpoint
from qlm_core.checkpoint.formats.megatron.torch_dist import TorchDistCheckpoint
from qlm_core.checkpoint.formats.megatron.trainer_state import OPTIMIZER_KEY
from qlm_core.models.layout import read_range

pytestmark = [pytest.mark.slow, pytest.mark.distributed]  # qlm train at up to 8 ranks
VIEWS = ("master", "exp_avg", "exp_avg_sq")
COMMON = ["--set", "train.micro_batch_size=1", "--set", "train.train_iters=4", "--set", "checkpoint.save_interval=2",
          "--set", "checkpoint.keep_last=5", "--set", "parallel.zero_stage=1"]


def layout_args(tp, pp, dp):
    return ["--set", f"parallel.tp={tp}", "--set", f"parallel.pp={pp}", "--set", f"parallel.dp={dp}"]


def adam_tensors(root, iteration=None, views=VIEWS) -> dict[str, torch.Tensor]:
    """Every optimizer tensor (or weight: view "model") of a checkpoint of either format, merged into its full
    (unpadded) global tensor."""
    merged = {}
    for view in views:
        ckpt = open_megatron(root, iteration, view=view)
        for tensor in ckpt.layout.global_tensors:
            merged[f"{view}:{tensor.name}"] = read_range(ckpt, tensor, 0, tensor.real_extent)
    return merged


@pytest.fixture(scope="module")
def torch_run(tmp_path_factory):
    """`qlm train` at TP2·PP2·DP2 (ZeRO 1), checkpoints in Megatron's torch format at steps 2 and 4."""
    root = tmp_path_factory.mktemp("reshard")
    qlm_train(RECIPE, "--output", root / "run", "--set", f"data.cache_dir={root / 'cache'}", *layout_args(2, 2, 2),
              *COMMON, timeout=900)
    return root / "run", root / "cache"


def test_adam_states_survive_tp2pp2dp2_to_tp1pp1_to_tp2pp1(torch_run, tmp_path, run_qlm):
    run, cache = torch_run
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

    # to torch_dist and back: the Adam states travel beside the weights
    code, stdout, stderr = run_qlm("convert", "mcore2mcore", "--mcore", tmp_path / "tp1pp1", "--out",
                                   tmp_path / "dist", "--format", "torch_dist")
    assert code == 0 and "verified 144/144" in stdout, stderr
    code, stdout, stderr = run_qlm("convert", "mcore2mcore", "--mcore", tmp_path / "dist", "--out",
                                   tmp_path / "dist_back", "--tp", "2", "--pp", "2", "--format", "torch")
    assert code == 0 and "verified 144/144" in stdout, stderr
    for hop in (tmp_path / "dist", tmp_path / "dist_back"):
        carried = adam_tensors(hop)
        assert all(torch.equal(carried[name], tensor) for name, tensor in original.items()), hop
        assert open_megatron(hop).extra_state(OPTIMIZER_KEY)["step"] == 2

    qlm_train(RECIPE, "--output", resumed, "--set", f"data.cache_dir={cache}", *layout_args(2, 1, 2), *COMMON,
              timeout=900)
    uninterrupted, continued = losses(run), losses(resumed)
    assert len(uninterrupted) == 4 and len(continued) == 2
    assert continued == pytest.approx(uninterrupted[2:], rel=1e-5)


def test_torch_dist_checkpoints_hold_the_torch_state_and_resume_at_another_layout(torch_run, tmp_path):
    run, cache = torch_run
    qlm_train(RECIPE, "--output", tmp_path / "torch_dist", "--set", f"data.cache_dir={cache}", *layout_args(2, 2, 2),
              *COMMON, "--set", "checkpoint.format=torch_dist", timeout=900)
    legacy, dist = run / "checkpoints", tmp_path / "torch_dist" / "checkpoints"
    assert isinstance(open_megatron(dist, 2), TorchDistCheckpoint)
    assert len(list((dist / "iter_0000002").glob("__*_0.distcp"))) == 8  # every rank wrote its own chunks
    assert losses(tmp_path / "torch_dist") == losses(run)
    ours, theirs = adam_tensors(dist, 2, VIEWS + ("model",)), adam_tensors(legacy, 2, VIEWS + ("model",))
    assert ours.keys() == theirs.keys() and len(ours) == 4 * 31
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name
    for key in (OPTIMIZER_KEY, "qlm_train_state", "opt_param_scheduler"):
        mine, reference = open_megatron(dist, 2).extra_state(key), open_megatron(legacy, 2).extra_state(key)
        assert (mine["step"] == reference["step"]) if key == OPTIMIZER_KEY else mine == reference, key

    resumed = tmp_path / "resumed"
    shutil.copytree(dist / "iter_0000002", resumed / "checkpoints" / "iter_0000002")
    (resumed / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("2")
    qlm_train(RECIPE, "--output", resumed, "--set", f"data.cache_dir={cache}", *layout_args(1, 1, 2), *COMMON,
              "--set", "checkpoint.format=torch_dist", timeout=900)
    assert losses(resumed) == pytest.approx(losses(tmp_path / "torch_dist")[2:], rel=1e-5)
