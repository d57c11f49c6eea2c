"""Preference losses against TRL's own code (DPOTrainer._compute_loss, CPOTrainer.cpo_loss, ORPOTrainer), on random
log-probs; the log-prob helper against a plain per-token loop."""

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from qlm_core.errors import QlmError
from qlm_core.train.objectives.preference_loss import PreferenceLossConfig, preference_loss, sequence_logps

PAIRS, SEQ = 6, 12
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")


def random_batch(seed=0):
    """Per-token log-probs of 2·PAIRS sequences ([chosen; rejected], TRL's order) with a response mask each."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(2 * PAIRS, SEQ, dtype=torch.long)
    for row in range(2 * PAIRS):
        start = int(torch.randint(1, 5, (1,), generator=g))
        end = int(torch.randint(start + 1, SEQ + 1, (1,), generator=g))
        mask[row, start:end] = 1
    shift_mask = mask[:, 1:]
    per_token = -torch.rand(2 * PAIRS, SEQ - 1, generator=g) * 3 * shift_mask
    ref_per_token = -torch.rand(2 * PAIRS, SEQ - 1, generator=g) * 3 * shift_mask
    return mask, per_token, ref_per_token


def sums(per_token, shift_mask):
    logps, tokens = per_token.sum(1), shift_mask.sum(1)
    return (*logps.chunk(2), *tokens.chunk(2))


def trl_dpo(loss_types, loss_weights, beta, mask, per_token, ref_per_token, label_smoothing=0.0):
    """TRL's DPOTrainer._compute_loss on a stand-in trainer and model that returns the given per-token log-probs."""
    trl_dpo_module = pytest.importorskip("trl.trainer.dpo_trainer")
    rows = per_token.shape[0]
    outputs = SimpleNamespace(log_probs=per_token, entropy=torch.zeros_like(per_token),
                              mean_logits=torch.zeros_like(per_token),
                              is_top1=torch.zeros_like(per_token, dtype=torch.bool))
    model = lambda **kwargs: outputs  # noqa: E731
    accelerator = SimpleNamespace(device=torch.device("cpu"), gather=lambda t: t, gather_for_metrics=lambda t: t)
    ref = ref_per_token.sum(1)
    trainer = SimpleNamespace(
        model=SimpleNamespace(training=True), accelerator=accelerator, aux_loss_enabled=False, ld_alpha=None,
        precompute_ref_logps=True, f_divergence_type="reverse_kl", loss_types=loss_types, loss_weights=loss_weights,
        beta=beta, label_smoothing=label_smoothing, use_weighting=False, _tp_size=1, _total_train_tokens=0,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)}, args=SimpleNamespace(discopop_tau=0.05))
    inputs = {"input_ids": torch.ones(rows, SEQ, dtype=torch.long), "attention_mask": torch.ones(rows, SEQ),
              "completion_mask": mask, "ref_chosen_logps": ref[:PAIRS], "ref_rejected_logps": ref[PAIRS:]}
    loss = trl_dpo_module.DPOTrainer._compute_loss(trainer, model, inputs, False)
    return loss, {k: v[-1] for k, v in trainer._metrics["train"].items()}


def check_metrics(ours, theirs):
    for name in METRICS:
        assert float(ours[name]) == pytest.approx(float(theirs[name]), abs=1e-6), name


@pytest.mark.parametrize("loss_type", ["sigmoid", "hinge", "ipo"])
@pytest.mark.parametrize("seed", [0, 1])
def test_dpo_losses_match_trl(loss_type, seed):
    mask, per_token, ref_per_token = random_batch(seed)
    chosen, rejected, chosen_n, rejected_n = sums(per_token, mask[:, 1:])
    ref_chosen, ref_rejected, _, _ = sums(ref_per_token, mask[:, 1:])
    beta = 0.3
    theirs, metrics = trl_dpo([loss_type], [1.0], beta, mask, per_token, ref_per_token)
    out = preference_loss(PreferenceLossConfig(loss_type=loss_type, beta=beta), chosen, rejected, chosen_n,
                          rejected_n, ref_chosen, ref_rejected)
    assert out.losses.shape == (PAIRS,) and out.nll is None
    assert float(out.loss) == pytest.approx(float(theirs), abs=1e-6)
    assert float(theirs) > 0.05  # not a degenerate value both sides could get by accident
    check_metrics(out.metrics, metrics)
    assert 0 < float(metrics["rewards/accuracies"]) < 1  # the batch has pairs either way


def test_rpo_alpha_matches_trl_sft_term():
    """TRL ≥ 1.0 spells RPO as loss_type [sigmoid, sft] with weights [1, rpo_alpha]."""
    mask, per_token, ref_per_token = random_batch(2)
    chosen, rejected, chosen_n, rejected_n = sums(per_token, mask[:, 1:])
    ref_chosen, ref_rejected, _, _ = sums(ref_per_token, mask[:, 1:])
    theirs, _ = trl_dpo(["sigmoid", "sft"], [1.0, 0.7], 0.1, mask, per_token, ref_per_token)
    out = preference_loss(PreferenceLossConfig(beta=0.1, rpo_alpha=0.7), chosen, rejected, chosen_n, rejected_n,
                          ref_chosen, ref_rejected)
    assert float(out.loss) == pytest.approx(float(theirs), abs=1e-6)
    plain = preference_loss(PreferenceLossConfig(beta=0.1), chosen, rejected, chosen_n, rejected_n, ref_chosen,
                            ref_rejected)
    assert float(out.loss - plain.loss) == pytest.approx(0.7 * float(out.nll), abs=1e-6) and float(out.nll) > 0.1


def cpo_trainer(loss_type, beta, label_smoothing=0.0, simpo_gamma=0.5):
    cpo = pytest.importorskip("trl.experimental.cpo.cpo_trainer")
    self = SimpleNamespace(alpha=0.0, beta=beta, label_smoothing=label_smoothing, loss_type=loss_type,
                           simpo_gamma=simpo_gamma, accelerator=SimpleNamespace(device=torch.device("cpu")))
    return lambda c, r: cpo.CPOTrainer.cpo_loss(self, c, r)


@pytest.mark.parametrize("label_smoothing", [0.0, 0.2])
def test_cdpo_label_smoothing_matches_trl_conservative_sigmoid(label_smoothing):
    """cDPO: TRL's CPOTrainer keeps the smoothed sigmoid; fed the log-ratios it is DPO's sigmoid loss."""
    mask, per_token, ref_per_token = random_batch(3)
    chosen, rejected, chosen_n, rejected_n = sums(per_token, mask[:, 1:])
    ref_chosen, ref_rejected, _, _ = sums(ref_per_token, mask[:, 1:])
    theirs, _, _ = cpo_trainer("sigmoid", 0.2, label_smoothing)(chosen - ref_chosen, rejected - ref_rejected)
    out = preference_loss(PreferenceLossConfig(beta=0.2, label_smoothing=label_smoothing), chosen, rejected,
                          chosen_n, rejected_n, ref_chosen, ref_rejected)
    torch.testing.assert_close(out.losses, theirs, rtol=0, atol=1e-6)
    if label_smoothing == 0.0:  # and at 0 it is DPOTrainer's sigmoid loss
        dpo, _ = trl_dpo(["sigmoid"], [1.0], 0.2, mask, per_token, ref_per_token)
        assert float(out.loss) == pytest.approx(float(dpo), abs=1e-6)


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_simpo_matches_trl_cpo(label_smoothing):
    mask, per_token, _ = random_batch(4)
    chosen, rejected, chosen_n, rejected_n = sums(per_token, mask[:, 1:])
    beta, gamma = 2.0, 0.8
    # CPOTrainer.concatenated_forward averages the log-probs per token for simpo
    losses, chosen_rewards, rejected_rewards = cpo_trainer("simpo", beta, label_smoothing, gamma)(
        chosen / chosen_n, rejected / rejected_n)
    out = preference_loss(PreferenceLossConfig(loss_type="simpo", beta=beta, simpo_gamma=gamma,
                                               label_smoothing=label_smoothing), chosen, rejected, chosen_n, rejected_n)
    torch.testing.assert_close(out.losses, losses, rtol=0, atol=1e-6)
    assert float(out.loss) == pytest.approx(float(losses.mean()), abs=1e-6) and out.nll is None
    assert float(out.metrics["rewards/chosen"]) == pytest.approx(float(chosen_rewards.mean()), abs=1e-6)
    assert float(out.metrics["rewards/rejected"]) == pytest.approx(float(rejected_rewards.mean()), abs=1e-6)
    accuracy = float((chosen_rewards > rejected_rewards).float().mean())
    assert float(out.metrics["rewards/accuracies"]) == pytest.approx(accuracy, abs=1e-6)
    assert float(out.metrics["logps/chosen"]) == pytest.approx(float((chosen / chosen_n).mean()), abs=1e-6)
    with_nll = preference_loss(PreferenceLossConfig(loss_type="simpo", beta=beta, simpo_gamma=gamma, cpo_alpha=0.5,
                                                    label_smoothing=label_smoothing),
                               chosen, rejected, chosen_n, rejected_n)
    assert float(with_nll.loss) == pytest.approx(float(losses.mean()) + 0.5 * float(-chosen.sum() / chosen_n.sum()),
                                                 abs=1e-5)


def test_orpo_matches_trl():
    orpo = pytest.importorskip("trl.experimental.orpo.orpo_trainer")
    mask, per_token, _ = random_batch(5)
    shift_mask = mask[:, 1:]
    chosen, rejected, chosen_n, rejected_n = sums(per_token, shift_mask)
    beta = 0.25
    self = SimpleNamespace(beta=beta, accelerator=SimpleNamespace(device=torch.device("cpu")))
    losses, chosen_rewards, rejected_rewards, ratio, log_odds = orpo.ORPOTrainer.odds_ratio_loss(
        self, chosen / chosen_n, rejected / rejected_n)
    # ORPOTrainer's NLL: cross entropy over the chosen rows' response tokens, mean over all of them
    chosen_token_logps = per_token[:PAIRS][shift_mask[:PAIRS].bool()]
    nll = -chosen_token_logps.mean()
    theirs = nll - losses.mean()
    out = preference_loss(PreferenceLossConfig(loss_type="orpo", beta=beta), chosen, rejected, chosen_n, rejected_n)
    assert float(out.loss) == pytest.approx(float(theirs), abs=1e-6)
    assert float(out.nll) == pytest.approx(float(nll), abs=1e-6)
    torch.testing.assert_close(out.losses, -losses, rtol=0, atol=1e-6)
    assert float(out.metrics["log_odds_ratio"]) == pytest.approx(float(ratio), abs=1e-6)
    assert float(out.metrics["log_odds_chosen"]) == pytest.approx(float(log_odds), abs=1e-6)
    assert float(out.metrics["rewards/margins"]) == pytest.approx(float((chosen_rewards - rejected_rewards).mean()),
                                                                  abs=1e-6)


def test_orpo_log1mexp_is_stable_near_zero():
    """Near log p = 0 (p → 1) log(1 - p) must not cancel to -inf: compare with float64."""
    logps = torch.tensor([-1e-6, -1e-3, -0.5, -0.7, -5.0])
    ones = torch.ones(5)
    out = preference_loss(PreferenceLossConfig(loss_type="orpo"), logps, logps - 1.0, ones, ones)
    c, r = logps.double(), logps.double() - 1.0
    log_odds = (c - r) - (torch.log(-torch.expm1(c)) - torch.log(-torch.expm1(r)))
    assert torch.isfinite(out.loss)
    assert float(out.metrics["log_odds_chosen"]) == pytest.approx(float(log_odds.mean()), rel=1e-5)


def test_sequence_logps_matches_a_token_loop_and_trl_shift():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, 11, generator=g)
    ids = torch.randint(0, 11, (3, 7), generator=g)
    trl_labels = ids.clone()
    trl_labels[:, :3] = -100  # prompt
    trl_labels[2, 6] = -100  # padding
    ours_labels = torch.full_like(ids, -100)
    ours_labels[:, :-1] = trl_labels[:, 1:]  # qlm's convention: labels[t] is the token logits[t] predicts
    total, count = sequence_logps(logits, ours_labels)
    expect, n = torch.zeros(3), torch.zeros(3, dtype=torch.long)
    for b in range(3):
        for t in range(6):
            if trl_labels[b, t + 1] != -100:
                expect[b] += torch.log_softmax(logits[b, t], -1)[trl_labels[b, t + 1]]
                n[b] += 1
    torch.testing.assert_close(total, expect, rtol=0, atol=1e-5)
    assert count.tolist() == n.tolist() == [4, 4, 3]
    unshifted = sequence_logps(logits, trl_labels, shifted=False)
    torch.testing.assert_close(unshifted[0], expect, rtol=0, atol=1e-5)
    cpo = pytest.importorskip("trl.experimental.cpo.cpo_trainer")
    torch.testing.assert_close(cpo.CPOTrainer.get_batch_logps(logits, trl_labels.clone()), total, rtol=0, atol=1e-5)


def test_bad_configs_are_user_errors():
    with pytest.raises(QlmError, match="unknown preference.loss_type 'kto'"):
        PreferenceLossConfig(loss_type="kto").check()
    with pytest.raises(QlmError, match="label_smoothing 0.5 is outside"):
        PreferenceLossConfig(label_smoothing=0.5).check()
    with pytest.raises(QlmError, match="rpo_alpha applies to the DPO losses, not orpo"):
        PreferenceLossConfig(loss_type="orpo", rpo_alpha=1.0).check()
    with pytest.raises(QlmError, match="not positive"):
        PreferenceLossConfig(beta=0.0).check()
    PreferenceLossConfig(loss_type="ipo", beta=0.5).check()
    with pytest.raises(ValueError, match="needs the reference"):
        preference_loss(PreferenceLossConfig(), torch.zeros(2), torch.zeros(2), torch.ones(2), torch.ones(2))


def test_metrics_by_hand():
    """Small margins count as correct, ties do not (TRL: chosen > rejected); rewards are β·log-ratios."""
    chosen = torch.tensor([-10.0, -10.0, -10.0, -12.0])
    rejected = torch.tensor([-10.001, -10.0, -9.0, -15.0])
    ref = torch.full((4,), -11.0)
    tokens = torch.full((4,), 5.0)
    out = preference_loss(PreferenceLossConfig(beta=0.5), chosen, rejected, tokens, tokens, ref, ref)
    assert float(out.metrics["rewards/accuracies"]) == 0.5
    assert float(out.metrics["rewards/chosen"]) == pytest.approx(0.5 * (1 + 1 + 1 - 1) / 4)
    assert float(out.metrics["rewards/margins"]) == pytest.approx(0.5 * (0.001 + 0 - 1 + 3) / 4, abs=1e-6)
    assert float(out.metrics["logps/rejected"]) == pytest.approx(float(rejected.mean()))
