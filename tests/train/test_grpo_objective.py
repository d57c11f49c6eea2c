"""The GRPO objective through the Engine: a step's loss is grpo_loss.py's over the whole batch, and splitting the
batch into any micro-batch count leaves the loss and the gradient unchanged (fp32 sums in another order: 1e-6)."""

import json

import pytest
import torch
from conftest import run_worker_jobs
from parallel_cases import GLOBAL_BATCH, SEQ, SPEC
from rl_cases import CASES, MICRO, STEPS, case_parts, rollout_batch

from qlm_core.config import OptimConfig, ParallelConfig
from qlm_core.parallel.state import Grid
from qlm_core.train.engine import Engine
from qlm_core.train.objectives.grpo import GrpoObjective
from qlm_core.train.objectives.grpo_loss import (
    GrpoLoss,
    StepCounts,
    grpo_token_loss,
    reduce_grpo_loss,
    rollout_correction_weights,
)


def engine(loss: GrpoLoss, micro_batch_size: int) -> Engine:
    return Engine(SPEC, ParallelConfig(), Grid.single(), micro_batch_size=micro_batch_size,
                  global_batch_size=GLOBAL_BATCH, seq_length=SEQ, optim=OptimConfig(lr=1e-3), seed=3,
                  objective=GrpoObjective(loss))


LOSSES = [GrpoLoss(loss_type="grpo", beta=0.04, max_completion_length=SEQ),
          GrpoLoss(loss_type="dapo", epsilon_high=0.28, max_completion_length=SEQ),
          GrpoLoss(loss_type="dr_grpo", importance_sampling_level="sequence", beta=0.04, max_completion_length=SEQ),
          GrpoLoss(loss_type="bnpo", rollout_correction="token_truncate", correction_clip_max=1.2,
                   max_completion_length=SEQ)]


@pytest.mark.parametrize("loss", LOSSES,
                         ids=lambda c: f"{c.loss_type}-{c.importance_sampling_level}-{c.rollout_correction}")
def test_the_step_loss_is_the_batch_loss_and_any_split_gives_the_same_gradient(loss):
    results = {}
    for micro in (8, 4, 1):
        e = engine(loss, micro)
        batch = rollout_batch()
        if micro == 8:  # the whole batch by hand, through grpo_loss.py
            with torch.no_grad():
                positions = torch.arange(SEQ)[None].expand(GLOBAL_BATCH, SEQ)
                logps = -e.chunks[0].loss(e.chunks[0](batch.input_ids, positions), batch.labels)
            mask = batch.labels >= 0
            old, correction = batch.old_logps, None
            if loss.rollout_correction != "none":  # π_old the trainer's own, the rollout's weighing the tokens
                correction = rollout_correction_weights(loss, logps, old, mask)
                old = logps
            per_token, _ = grpo_token_loss(loss, logps, old, batch.advantages, mask, batch.ref_logps,
                                           correction=correction)
            expected = reduce_grpo_loss(loss, per_token, mask, StepCounts(GLOBAL_BATCH, int(mask.sum()))).item()
        loss_sum = e.forward_backward(batch)
        grads = torch.cat([e.optimizer.full_grad(p).flatten() for p in e.chunks[0].parameters()])
        results[micro] = (e.global_loss(loss_sum), grads, e.objective.figures())
    assert results[8][0] == pytest.approx(expected, rel=1e-6, abs=2e-7)
    for micro in (4, 1):
        # the loss is a sum of advantage-signed terms of size ~1 that cancel to ~1e-2: fp32 adds them in another
        # order per split, so its error is ~1e-7 absolute
        assert results[micro][0] == pytest.approx(results[8][0], rel=1e-6, abs=2e-7), micro
        assert torch.allclose(results[micro][1], results[8][1], rtol=1e-5, atol=1e-7), micro
        assert results[micro][2] == pytest.approx(results[8][2], rel=1e-6)
    figures = results[8][2]
    clipped = figures["clip_ratio/region_mean"]  # with the correction π_old is π: nothing is clipped
    assert (clipped == 0) if loss.rollout_correction != "none" else 0 < clipped < 1
    assert ("kl" in figures) == (loss.beta != 0)


def one_process(loss: GrpoLoss, reference: str, spec=SPEC, moe=None, replay=None) -> dict:
    e = Engine(spec, ParallelConfig(), Grid.single(), micro_batch_size=MICRO, global_batch_size=GLOBAL_BATCH,
               seq_length=SEQ, optim=OptimConfig(lr=1e-3), seed=3, moe=moe,
               objective=GrpoObjective(loss, reference=reference, routing_replay=replay))
    batch = rollout_batch(spec)
    results = [e.train_step(batch, lr=1e-3) for _ in range(STEPS)]
    return {"losses": [r.loss for r in results], "grad_norms": [r.grad_norm for r in results],
            "figures": results[-1].figures, "moe": results[-1].moe}


@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory):
    out, code, errors = run_worker_jobs("grpo_worker.py", 2, tmp_path_factory.mktemp("grpo"), timeout=900)
    assert code == 0, errors
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("case", CASES)
def test_every_layout_reproduces_the_one_process_rl_step(case, grpo_run):
    """tp2·SP, cp2 (a sequence's mean over both ranks' parts), pp2, dp2 ZeRO 1 and 3, a frozen reference at pp2
    and cp2, and the MoE model at ep2, tp2·SP·ep2, pp2 and cp2 (router losses included) with routes replayed — or at
    cp2 only compared — from the batch: the RL step's losses and gradient norms within the parity suite's rtol 1e-4,
    its metrics and the route comparison's too."""
    ours = json.loads((grpo_run / f"{case}.json").read_text())
    reference = one_process(*case_parts(case)[1:])
    assert ours["losses"] == pytest.approx(reference["losses"], rel=1e-4)
    assert ours["grad_norms"] == pytest.approx(reference["grad_norms"], rel=1e-4)
    assert ours["figures"] == pytest.approx(reference["figures"], rel=1e-4, abs=1e-9)
    if reference["moe"] is not None:
        assert ours["moe"] == pytest.approx(reference["moe"], rel=1e-4, abs=1e-9)
        assert reference["moe"]["moe_route_mismatch"] > 0.5  # random routes: most are not the router's


def test_a_frozen_reference_is_the_starting_weights():
    """reference = "frozen": at the first step the reference is the policy (KL 0, the loss of a batch whose
    ref_logps are the policy's own); after an update it is still the starting weights, scaled by the temperature."""
    loss = GrpoLoss(loss_type="dapo", beta=0.1, max_completion_length=SEQ)
    temperature = 0.7
    frozen = Engine(SPEC, ParallelConfig(), Grid.single(), micro_batch_size=4, global_batch_size=GLOBAL_BATCH,
                    seq_length=SEQ, optim=OptimConfig(lr=1e-2), seed=3,
                    objective=GrpoObjective(loss, temperature, reference="frozen"))
    batch = rollout_batch()
    batch.ref_logps = None
    positions = torch.arange(SEQ)[None].expand(GLOBAL_BATCH, SEQ)
    with torch.no_grad():
        start = -frozen.chunks[0].loss(frozen.chunks[0](batch.input_ids, positions) / temperature, batch.labels)
    first = frozen.train_step(batch, lr=1e-2)
    assert first.figures["kl"] == pytest.approx(0.0, abs=1e-9)
    assert torch.allclose(frozen.objective.ref, start, atol=1e-6)
    second = frozen.train_step(batch, lr=1e-2)
    assert second.figures["kl"] > 1e-6
    assert torch.allclose(frozen.objective.ref, start, atol=1e-6)  # still the starting weights'
    given = engine(loss, 4)  # the same first step with the reference's log-probs handed in by the batch
    given.objective = GrpoObjective(loss, temperature)
    given.objective.bind(given, None)
    batch.ref_logps = start
    assert given.train_step(batch, lr=1e-2).loss == pytest.approx(first.loss, rel=1e-6, abs=2e-7)
