"""GRPO's loss and its variants equal TRL 1.16's GRPOTrainer._compute_loss (loss, gradient and metrics) on the same
completions, advantages and log-probs; the step's normalisers make any micro-batch split give the same loss."""

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from qlm_core.errors import QlmError
from qlm_core.train.objectives.grpo_loss import (
    GrpoLoss,
    StepCounts,
    grpo_metric_sums,
    grpo_token_loss,
    reduce_grpo_loss,
)

pytest.importorskip("trl")

B, T = 6, 9


class _OneProcess:
    """What _compute_loss asks of accelerate, for one process."""

    num_processes = 1
    sync_gradients = True

    def gather(self, x):
        return x

    def gather_for_metrics(self, x):
        return x

    def reduce(self, x, reduction="sum"):
        return x


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([9, 4, 7, 1, 9, 5])
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    # ratios on both sides of the clip, per token and per sequence (GSPO's mean log-ratio)
    logps = old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3 + torch.randn(B, 1, generator=g) * 0.3
    ref = old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.2
    advantages = torch.randn(B, generator=g, dtype=torch.float64)
    return logps, old, ref, advantages, mask


def _trl(loss: GrpoLoss, logps, old, ref, advantages, mask, vllm_ratio=None):
    from trl.trainer.grpo_trainer import GRPOTrainer

    trainer = GRPOTrainer.__new__(GRPOTrainer)  # only _compute_loss's own state, no model or data
    trainer.__dict__.update(
        top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        importance_sampling_level=loss.importance_sampling_level, beta=loss.beta, loss_type=loss.loss_type,
        epsilon_low=loss.epsilon_low, epsilon_high=loss.upper,
        use_vllm=vllm_ratio is not None, vllm_importance_sampling_correction=vllm_ratio is not None,
        model=SimpleNamespace(training=True), current_gradient_accumulation_steps=1,
        max_completion_length=loss.max_completion_length, accelerator=_OneProcess(), _entropy_bonus_enabled=False,
        aux_loss_enabled=False, _metrics={"train": defaultdict(list)},
        args=SimpleNamespace(use_bias_correction_kl=False, delta=loss.delta, steps_per_generation=1))
    trainer._get_per_token_logps_and_entropies = lambda *args, **kwargs: (logps, torch.zeros_like(logps), None)
    inputs = {"prompt_ids": torch.zeros(B, 1, dtype=torch.long), "prompt_mask": torch.ones(B, 1),
              "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": mask,
              "advantages": advantages, "old_per_token_logps": old, "ref_per_token_logps": ref,
              "num_items_in_batch": mask.sum(), "importance_sampling_ratio": vllm_ratio}
    return trainer._compute_loss(None, inputs), trainer._metrics["train"]


def _ours(loss: GrpoLoss, logps, old, ref, advantages, mask):
    per_token, stats = grpo_token_loss(loss, logps, old, advantages, mask, ref)
    value = reduce_grpo_loss(loss, per_token, mask, StepCounts(sequences=B, tokens=int(mask.sum())))
    return value, {name: total / count for name, (total, count) in grpo_metric_sums(stats, mask).items()}


CASES = [GrpoLoss(loss_type=kind, importance_sampling_level=level, beta=beta, epsilon_high=high,
                  max_completion_length=T)
         for kind in ("grpo", "bnpo", "dr_grpo", "dapo") for level in ("token", "sequence")
         for beta in (0.0, 0.04) for high in (None, 0.28)]


@pytest.mark.parametrize("loss", CASES, ids=lambda c: f"{c.loss_type}-{c.importance_sampling_level}-beta{c.beta}-"
                                                      f"high{c.epsilon_high}")
def test_loss_gradient_and_metrics_equal_trl(loss):
    logps, old, ref, advantages, mask = _batch()
    ours_in, trl_in = logps.clone().requires_grad_(), logps.clone().requires_grad_()
    ours, our_metrics = _ours(loss, ours_in, old, ref, advantages, mask)
    theirs, their_metrics = _trl(loss, trl_in, old, ref, advantages, mask)
    ours.backward()
    theirs.backward()
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-10, abs=1e-12)
    assert torch.allclose(ours_in.grad, trl_in.grad, rtol=1e-10, atol=1e-12)
    for name in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "kl"):
        if name in their_metrics:
            assert our_metrics[name] == pytest.approx(their_metrics[name][0], rel=1e-6), name  # TRL sums in fp32
    assert ("kl" in our_metrics) == (loss.beta != 0.0)
    assert our_metrics["clip_ratio/region_mean"] > 0  # the batch does reach the clip


def test_delta_caps_the_ratio_as_trl_does():
    loss = GrpoLoss(loss_type="dapo", delta=1.1, max_completion_length=T)
    logps, old, ref, advantages, mask = _batch(1)
    ours, our_metrics = _ours(loss, logps, old, ref, advantages, mask)
    theirs, their_metrics = _trl(loss, logps, old, ref, advantages, mask)
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-10)
    for name in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"):  # of the capped ratio
        assert our_metrics[name] == pytest.approx(their_metrics[name][0], rel=1e-6), name
    assert ours.item() != pytest.approx(_ours(GrpoLoss(loss_type="dapo", max_completion_length=T), logps, old, ref,
                                              advantages, mask)[0].item(), rel=1e-6)


def test_dual_clip_bounds_a_negative_advantage():
    logps, old = torch.tensor([[2.0]]), torch.tensor([[0.0]])  # ratio e² ≈ 7.4
    loss = GrpoLoss(loss_type="dapo", dual_clip=3.0, max_completion_length=1)
    per_token, _ = grpo_token_loss(loss, logps, old, torch.tensor([-1.0]), torch.ones(1, 1))
    assert per_token.item() == pytest.approx(3.0)  # -min(7.4·(-1), 1.2·(-1)) = 7.4, bounded by c·|A| = 3
    per_token, _ = grpo_token_loss(GrpoLoss(loss_type="dapo", max_completion_length=1), logps, old,
                                   torch.tensor([-1.0]), torch.ones(1, 1))
    assert per_token.item() == pytest.approx(torch.e ** 2)


@pytest.mark.parametrize("kind", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_any_micro_batch_split_gives_the_step_loss_and_gradient(kind):
    """The step's normalisers: the micro-batches' shares add up to the one-batch loss and gradient exactly."""
    loss = GrpoLoss(loss_type=kind, beta=0.04, max_completion_length=T)
    logps, old, ref, advantages, mask = _batch(2)
    step = StepCounts(sequences=B, tokens=int(mask.sum()))
    whole_in = logps.clone().requires_grad_()
    whole = reduce_grpo_loss(loss, grpo_token_loss(loss, whole_in, old, advantages, mask, ref)[0], mask, step)
    whole.backward()
    for sizes in ((1, 5), (2, 2, 2), (3, 3), (1,) * 6):
        split_in = logps.clone().requires_grad_()
        total, start = 0.0, 0
        for size in sizes:
            rows = slice(start, start + size)
            per_token, _ = grpo_token_loss(loss, split_in[rows], old[rows], advantages[rows], mask[rows], ref[rows])
            total = total + reduce_grpo_loss(loss, per_token, mask[rows], step)
            start += size
        total.backward()
        assert total.item() == pytest.approx(whole.item(), rel=1e-12), sizes
        assert torch.allclose(split_in.grad, whole_in.grad, rtol=1e-12, atol=1e-15), sizes


@pytest.mark.parametrize("field, value", [("loss_type", "ppo"), ("epsilon", -0.1), ("epsilon_high", float("nan")),
                                          ("delta", 1.0), ("dual_clip", 0.5), ("beta", float("inf")),
                                          ("kl_estimator", "k4"), ("max_completion_length", 0)])
def test_a_wrong_setting_is_one_line(field, value):
    with pytest.raises(QlmError, match=f"rl.{field}"):
        GrpoLoss(**{field: value})


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_rollout_correction_equals_trls_vllm_importance_sampling(mode):
    """TRL's vLLM importance-sampling correction (its ratio from _generate_and_score_completions, then
    _compute_loss with use_vllm): π_old the trainer's own log-probs, the rollout's weighing each token."""
    from qlm_core.train.objectives.grpo_loss import rollout_correction_weights

    loss = GrpoLoss(loss_type="dapo", beta=0.04, max_completion_length=T, rollout_correction=mode,
                    correction_clip_min=0.5, correction_clip_max=1.5)
    logps, rollout, ref, advantages, mask = _batch(3)
    trainer_old = logps.clone()  # the trainer's π_old: this step's forward
    weights = rollout_correction_weights(loss, trainer_old, rollout, mask)
    diff = (trainer_old - rollout) * mask  # TRL's formula, written out
    diff = diff.sum(-1, keepdim=True) if mode.startswith("sequence") else diff
    ratio = torch.exp(diff)
    expected = (ratio.clamp(0.5, 1.5) if mode.endswith("truncate")
                else ratio.masked_fill((ratio < 0.5) | (ratio > 1.5), 0.0))
    assert torch.equal(weights, expected)
    assert (weights != ratio).any() and (weights == ratio).any()  # the bounds bind on some tokens, not all
    ours_in, trl_in = logps.clone().requires_grad_(), logps.clone().requires_grad_()
    per_token, _ = grpo_token_loss(loss, ours_in, trainer_old, advantages, mask, ref, correction=weights)
    ours = reduce_grpo_loss(loss, per_token, mask, StepCounts(sequences=B, tokens=int(mask.sum())))
    theirs = _trl(loss, trl_in, trainer_old, ref, advantages, mask, vllm_ratio=weights)[0]
    ours.backward()
    theirs.backward()
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-10)
    assert torch.allclose(ours_in.grad, trl_in.grad, rtol=1e-10, atol=1e-12)
