"""Weight sync: the rollout model built in memory from the trainer's shards equals, bit for bit, the whole-model
shard that `qlm convert` writes at TP 1 from the same trainer's checkpoint, at every training layout here."""

import json

import pytest
import torch
from conftest import run_worker_jobs
from workers.sync_worker import CASES

from qlm_core.checkpoint.formats.megatron.legacy import MegatronTorchCheckpoint
from qlm_core.models.layout import ModelLayout, build_shard


@pytest.fixture(scope="module")
def synced(tmp_path_factory):
    out, code, errors = run_worker_jobs("sync_worker.py", 2, tmp_path_factory.mktemp("sync"), timeout=900)
    assert code == 0, errors
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("case", CASES)
def test_synced_rollout_weights_equal_what_convert_writes(case, synced):
    ckpt = MegatronTorchCheckpoint(synced / case)
    layout = ModelLayout(ckpt.spec, make_vocab_size_divisible_by=ckpt.layout.make_vocab_size_divisible_by)
    expected = {k: v for k, v in build_shard(layout, 0, 0, 0, ckpt, torch.float32).items() if v is not None}
    rollout = torch.load(synced / f"{case}.rollout.pt", weights_only=True)
    assert sorted(rollout) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(rollout[name], tensor), name
    assert ckpt.layout.tp * ckpt.layout.pp * ckpt.layout.ep > 1 or case in ("cp2", "dp2_zero3")
    # the rollout source's sync: to each replica's leader only, bucket by bucket, the same tensors
    assert json.loads((synced / f"{case}.json").read_text())["leaders_bucketed_equal"]


@pytest.mark.distributed
@pytest.mark.parametrize("case", CASES)
def test_the_trainer_agrees_with_a_rollout_on_the_synced_weights(case, synced):
    """train_rollout_logprob_abs_diff: the rollout decodes at TP 1 on the synced weights, the trainer recomputes the
    same tokens' log-probs at its own layout; fp32 on CPU, within 1e-5. An MoE policy's rollout records its routes and
    the trainer, at ep2 and tp2·SP·ep2, routes every token of them to the same experts."""
    figures = json.loads((synced / f"{case}.json").read_text())
    assert figures["train_rollout_logprob_abs_diff/max"] <= 1e-5, figures
    if CASES[case][1]:  # an MoE policy: the trainer's own routers choose every recorded route again
        assert figures["moe_route_mismatch"] == 0.0, figures


def test_a_refilled_rollout_model_equals_a_fresh_one():
    """From the second step on the rollout model is refilled in place: after an update it holds exactly what a model
    built anew from the same weights holds (vocabulary padding included)."""
    from parallel_cases import SPEC

    from qlm_core.config import OptimConfig, ParallelConfig
    from qlm_core.parallel.state import Grid
    from qlm_core.train.engine import Batch, Engine
    from qlm_core.train.weight_sync import (
        WeightSync,
        fill_rollout_model,
        gather_weights,
        rollout_model,
        sync_rollout_model,
    )

    engine = Engine(SPEC, ParallelConfig(), Grid.single(), micro_batch_size=2, global_batch_size=2, seq_length=8,
                    optim=OptimConfig(lr=1e-2), seed=3)
    model = rollout_model(engine)
    sync = WeightSync(engine, bucket_bytes=4096)  # the run's: its trainer states and refill plans kept
    kept = sync_rollout_model(sync, None, builds=True)
    before = {k: v.clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    tokens = torch.randint(0, SPEC.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    for step in range(2):
        engine.train_step(Batch(tokens[:, :-1], tokens[:, 1:]), lr=1e-2)
        fill_rollout_model(engine, gather_weights(engine), model)
        assert sync_rollout_model(sync, kept, builds=True) is kept
        fresh = rollout_model(engine).state_dict()
        for refilled in (model.state_dict(), kept.state_dict()):
            assert sorted(fresh) == sorted(refilled)
            changed = 0
            for name, tensor in fresh.items():
                if isinstance(tensor, torch.Tensor):
                    assert torch.equal(refilled[name], tensor), (step, name)
                    changed += not torch.equal(before[name], tensor)
            assert changed > 0  # the update reached the rollout model


@pytest.mark.parametrize("spec_name", ["SPEC", "MOE"])
def test_a_streamed_sync_fills_a_shell_with_what_a_fresh_build_holds(spec_name):
    """The run's sync: a model shell (random until filled) refilled as each bucket arrives holds exactly what a
    model built from the whole weights holds: tied or untied output, vocabulary padding, an MoE model's experts."""
    import parallel_cases

    from qlm_core.config import OptimConfig, ParallelConfig
    from qlm_core.parallel.state import Grid
    from qlm_core.train.engine import Engine
    from qlm_core.train.weight_sync import WeightSync, rollout_model, sync_rollout_model

    spec = getattr(parallel_cases, spec_name)
    engine = Engine(spec, ParallelConfig(), Grid.single(), micro_batch_size=2, global_batch_size=2, seq_length=8,
                    optim=OptimConfig(lr=1e-2), seed=3)
    shell = sync_rollout_model(WeightSync(engine, bucket_bytes=4096), None, builds=True)  # the run's sync
    fresh = rollout_model(engine).state_dict()
    streamed = shell.state_dict()
    assert sorted(fresh) == sorted(streamed)
    for name, tensor in fresh.items():
        if isinstance(tensor, torch.Tensor):
            assert torch.equal(streamed[name], tensor), name
