"""Checkpoints across expert parallelism, through qlm's Engine: a run at tp2 (sp) x ep2 saves (legacy `torch` and
torch_dist); resumed at ep1 x tp1 and at ep4 it trains on with the losses the uninterrupted run has (weights and Adam
states carried). One torchrun launch (4 gloo ranks, tests/workers/ep_checkpoint_worker.py) runs every job."""

import json

import pytest
from conftest import run_worker_jobs
from parallel_cases import GLOBAL_BATCH, MOE, MOE_TRAINING, SEQ, make_batch
from workers.ep_checkpoint_worker import AFTER, OPTIM, SAVED

from qlm_core.checkpoint.formats.megatron.format import open_megatron
from qlm_core.config import ParallelConfig
from qlm_core.parallel.state import Grid
from qlm_core.train.engine import Batch, Engine

FORMATS = ("torch", "torch_dist")


@pytest.fixture(scope="module")
def ep_run(tmp_path_factory):
    return run_worker_jobs("ep_checkpoint_worker.py", 4, tmp_path_factory.mktemp("ep_ckpt"), timeout=600)


@pytest.fixture(scope="module")
def uninterrupted():
    """One process, SAVED + AFTER steps without a checkpoint: the losses after the save point."""
    engine = Engine(MOE, ParallelConfig(), Grid.single(), micro_batch_size=1, global_batch_size=GLOBAL_BATCH,
                    seq_length=SEQ, optim=OPTIM, seed=1234, moe=MOE_TRAINING)
    input_ids, labels, _, _ = make_batch("moe")
    losses = []
    for _ in range(SAVED + AFTER):
        loss = engine.forward_backward(Batch(input_ids, labels, None, None))
        engine.update()
        losses.append(engine.global_loss(loss))
    return losses[SAVED:]


def result(ep_run, name: str) -> dict:
    out, code, errors = ep_run
    file = out / f"{name}.json"
    assert file.exists(), f"worker exit {code}: {errors}"
    return json.loads(file.read_text())


@pytest.mark.distributed
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("job", ["saved", "ep1", "ep4"])
def test_resume_across_ep_continues_the_uninterrupted_run(ep_run, uninterrupted, fmt, job):
    got = result(ep_run, f"{fmt}.{job}")
    assert got["resumed_from"] == SAVED
    assert got["losses"] == pytest.approx(uninterrupted, rel=1e-4), (fmt, job)


@pytest.mark.distributed
def test_the_legacy_files_are_megatrons_expert_parallel_folders(ep_run):
    """tp2 x ep2 with etp 2 on 4 ranks (dp 2): every rank has expert-data-parallel rank 0, so all four write, each
    folder mp_rank_TT_EEE holding its dense TP shard and its EP rank's two experts (local numbers 0 and 1)."""
    out, code, errors = ep_run
    result(ep_run, "torch.saved")
    iteration = out / "torch/checkpoints" / f"iter_{SAVED:07d}"
    assert sorted(p.name for p in iteration.iterdir()) == ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000",
                                                           "mp_rank_01_001"]
    ckpt = open_megatron(out / "torch/checkpoints")
    assert (ckpt.tp, ckpt.ep, ckpt.etp) == (2, 2, 2)
    names = ckpt.chunk_state(1, 0, 0, ep_rank=1)
    assert "decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight" in names
    assert "decoder.layers.0.mlp.experts.local_experts.2.linear_fc1.weight" not in names
    assert tuple(names["decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight"].shape) == (32, 64)
    optimizer = ckpt.extra_state("qlm_optimizer")
    assert optimizer["step"] == SAVED
