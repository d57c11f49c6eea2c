"""Preference-alignment losses (DPO and its variants, SimPO, ORPO) from per-sequence response log-probs.

Pure torch, no model: the caller runs the policy (and, for the DPO family, the reference) on the chosen and rejected
sequences of each pair, turns the logits into per-sequence sums with `sequence_logps`, and calls `preference_loss`.
The formulas are TRL 1.16's, checked against TRL itself in tests/train/test_preference_loss.py:

    DPO family (reference needed), with d = (pi_c - ref_c) - (pi_r - ref_r) on summed log-probs:
      sigmoid   -(1 - ls)·logσ(β·d) - ls·logσ(-β·d)   (cDPO when label_smoothing = ls > 0; TRL's DPOTrainer 1.16
                                                       dropped ls from "sigmoid", its CPOTrainer keeps this form)
      hinge     relu(1 - β·d)
      ipo       (d' - 1/(2β))²,  d' = the same difference on log-probs averaged per response token
      + rpo_alpha · NLL(chosen)   (TRL's rpo_alpha, in 1.16 the "sft" loss with that weight)
    reference-free, on log-probs averaged per response token (p_c, p_r):
      simpo     -(1 - ls)·logσ(β·(p_c - p_r) - γ) - ls·logσ(-(β·(p_c - p_r) - γ))   (CPOTrainer, γ = simpo_gamma)
                + cpo_alpha · NLL(chosen)
      orpo      NLL(chosen) - β·logσ(log_odds),  log_odds = (p_c - p_r) - (log(1 - e^p_c) - log(1 - e^p_r))
                (ORPOTrainer: its `beta` is the paper's λ)
NLL(chosen) is the chosen responses' negative log-likelihood averaged over all their tokens in the batch (token-
weighted, as TRL's cross entropy over the concatenated chosen labels), not per pair.

Metrics, TRL's names (means over the pairs): rewards/chosen = β·(pi_c - ref_c) (reference-free: β·p_c),
rewards/rejected likewise, rewards/accuracies = the share of pairs with rewards chosen > rejected, rewards/margins =
chosen - rejected, logps/chosen and logps/rejected = the policy's log-probs the loss used (summed for the DPO family,
averaged per token for simpo / orpo), plus nll_loss where an NLL term is used and ORPO's log_odds_ratio /
log_odds_chosen.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import get_args

import torch
import torch.nn.functional as F

from qlm_core.config import REFERENCE_FREE_LOSSES, PreferenceConfig, PreferenceLossType
from qlm_core.errors import QlmError

IGNORE_INDEX = -100


@dataclass
class PreferenceLossConfig:
    loss_type: PreferenceLossType = "sigmoid"
    beta: float = 0.1  # DPO's β; IPO's τ; SimPO's β; ORPO's λ (TRL's ORPOConfig calls it beta too)
    label_smoothing: float = 0.0  # cDPO / conservative SimPO: the probability a label is flipped, in [0, 0.5)
    simpo_gamma: float = 0.5  # SimPO's target reward margin γ (TRL's CPOConfig default)
    rpo_alpha: float | None = None  # DPO family: weight of the chosen NLL term (RPO); None: no term
    cpo_alpha: float = 0.0  # simpo: weight of the chosen NLL term (CPOConfig's cpo_alpha; SimPO proper is 0)

    def check(self) -> None:
        """The rules of the losses' settings, named by their [preference] keys (train/validate.py runs them on a
        recipe before any process starts)."""
        if self.loss_type not in get_args(PreferenceLossType):
            raise QlmError(f"unknown preference.loss_type {self.loss_type!r}",
                           f"use one of {', '.join(get_args(PreferenceLossType))}")
        if not self.beta > 0:
            raise QlmError(f"preference.beta {self.beta} is not positive", "set beta > 0 (TRL's default is 0.1)")
        if not 0 <= self.label_smoothing < 0.5:
            raise QlmError(f"preference.label_smoothing {self.label_smoothing} is outside [0, 0.5)",
                           "set label_smoothing to the probability that a preference label is flipped, below 0.5")
        if self.label_smoothing and self.loss_type not in ("sigmoid", "simpo"):
            raise QlmError(f"preference.label_smoothing applies to the sigmoid and simpo losses, not "
                           f"{self.loss_type}", "set preference.label_smoothing = 0 or preference.loss_type = "
                           "\"sigmoid\"")
        if self.rpo_alpha is not None and self.loss_type in REFERENCE_FREE_LOSSES:
            raise QlmError(f"preference.rpo_alpha applies to the DPO losses, not {self.loss_type}",
                           "remove rpo_alpha (simpo: cpo_alpha; orpo always has its NLL term)")
        if self.cpo_alpha and self.loss_type != "simpo":
            raise QlmError(f"preference.cpo_alpha applies to the simpo loss, not {self.loss_type}",
                           "remove cpo_alpha (the DPO losses: rpo_alpha)")

    @classmethod
    def from_recipe(cls, section: PreferenceConfig) -> PreferenceLossConfig:
        return cls(loss_type=section.loss_type, beta=section.beta, label_smoothing=section.label_smoothing,
                   simpo_gamma=section.simpo_gamma, rpo_alpha=section.rpo_alpha, cpo_alpha=section.cpo_alpha)

    @property
    def needs_reference(self) -> bool:
        return self.loss_type not in REFERENCE_FREE_LOSSES


@dataclass
class PreferenceLossOutput:
    loss: torch.Tensor  # scalar: losses.mean() + weight · nll
    losses: torch.Tensor  # [pairs] the preference term of each pair
    nll: torch.Tensor | None  # scalar NLL of the chosen responses (per token), where the loss has that term
    metrics: dict[str, torch.Tensor]  # scalar tensors, detached, TRL's names


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor,
                   shifted: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed log-prob of the labelled tokens, their count) per sequence, fp32, from logits [b, s, v].

    shifted=True: qlm's labels (labels[t] is the token logits[t] predicts, -100 elsewhere; pair_sequences' layout).
    shifted=False: TRL's labels (the input ids with -100 off the response): logits[:, :-1] predict labels[:, 1:],
    as TRL's get_batch_logps / concatenated_forward shift them."""
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} disagree")
    if not shifted:
        logits, labels = logits[:, :-1], labels[:, 1:]
    mask = labels != IGNORE_INDEX
    targets = labels.masked_fill(~mask, 0)
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return (logp * mask).sum(-1), mask.sum(-1)


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, branching at -ln 2 to avoid cancellation."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def _smoothed_sigmoid(logits: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    return -F.logsigmoid(logits) * (1 - label_smoothing) - F.logsigmoid(-logits) * label_smoothing


@dataclass
class PairTerms:
    """Per-pair figures of a batch [pairs]: what preference_loss averages and a distributed step sums."""

    losses: torch.Tensor  # the preference term of each pair (with its graph)
    chosen_rewards: torch.Tensor  # detached, as the metrics below
    rejected_rewards: torch.Tensor
    logged_chosen: torch.Tensor  # logps/chosen: summed (DPO family) or per-token (simpo, orpo) log-probs
    logged_rejected: torch.Tensor
    nll_weight: float | None  # the weight of NLL(chosen) in the loss; None: no such term
    extra: dict[str, torch.Tensor]  # orpo: log_odds_ratio, log_odds_chosen per pair


def pair_terms(config: PreferenceLossConfig, chosen_logps: torch.Tensor, rejected_logps: torch.Tensor,
               chosen_tokens: torch.Tensor, rejected_tokens: torch.Tensor,
               ref_chosen_logps: torch.Tensor | None = None,
               ref_rejected_logps: torch.Tensor | None = None) -> PairTerms:
    """The module doc's per-pair terms from summed response log-probs [pairs] and response token counts [pairs]."""
    beta, ls = config.beta, config.label_smoothing
    chosen_tokens, rejected_tokens = chosen_tokens.to(chosen_logps.dtype), rejected_tokens.to(rejected_logps.dtype)
    extra = {}
    if config.needs_reference:
        if ref_chosen_logps is None or ref_rejected_logps is None:
            raise ValueError(f"loss_type {config.loss_type} needs the reference model's log-probs")
        chosen_ratio, rejected_ratio = chosen_logps - ref_chosen_logps, rejected_logps - ref_rejected_logps
        delta = chosen_ratio - rejected_ratio
        if config.loss_type == "sigmoid":
            losses = _smoothed_sigmoid(beta * delta, ls)
        elif config.loss_type == "hinge":
            losses = torch.relu(1 - beta * delta)
        else:  # ipo, on per-token averages
            delta = chosen_ratio / chosen_tokens.clamp(min=1.0) - rejected_ratio / rejected_tokens.clamp(min=1.0)
            losses = (delta - 1 / (2 * beta)) ** 2
        chosen_rewards, rejected_rewards = beta * chosen_ratio.detach(), beta * rejected_ratio.detach()
        logged_chosen, logged_rejected = chosen_logps, rejected_logps
        weight = config.rpo_alpha
    else:
        chosen_avg, rejected_avg = chosen_logps / chosen_tokens, rejected_logps / rejected_tokens
        if config.loss_type == "simpo":
            losses = _smoothed_sigmoid(beta * ((chosen_avg - rejected_avg) - config.simpo_gamma / beta), ls)
            weight = config.cpo_alpha or None
        else:  # orpo
            chosen_avg, rejected_avg = chosen_avg.float(), rejected_avg.float()
            log_odds = (chosen_avg - rejected_avg) - (_log1mexp(chosen_avg) - _log1mexp(rejected_avg))
            ratio = F.logsigmoid(log_odds)
            losses = -beta * ratio
            weight = 1.0
            extra = {"log_odds_ratio": ratio.detach(), "log_odds_chosen": log_odds.detach()}
        chosen_rewards, rejected_rewards = beta * chosen_avg.detach(), beta * rejected_avg.detach()
        logged_chosen, logged_rejected = chosen_avg, rejected_avg
    return PairTerms(losses, chosen_rewards, rejected_rewards, logged_chosen.detach(), logged_rejected.detach(),
                     weight, extra)


def pair_metric_sums(terms: PairTerms) -> dict[str, torch.Tensor]:
    """The metrics' sums over the pairs (divide by the pair count for TRL's means)."""
    sums = {
        "rewards/chosen": terms.chosen_rewards.sum(),
        "rewards/rejected": terms.rejected_rewards.sum(),
        "rewards/accuracies": (terms.chosen_rewards > terms.rejected_rewards).float().sum(),
        "rewards/margins": (terms.chosen_rewards - terms.rejected_rewards).sum(),
        "logps/chosen": terms.logged_chosen.sum(),
        "logps/rejected": terms.logged_rejected.sum(),
    }
    sums.update({name: value.sum() for name, value in terms.extra.items()})
    return sums


def preference_loss(config: PreferenceLossConfig, chosen_logps: torch.Tensor, rejected_logps: torch.Tensor,
                    chosen_tokens: torch.Tensor, rejected_tokens: torch.Tensor,
                    ref_chosen_logps: torch.Tensor | None = None,
                    ref_rejected_logps: torch.Tensor | None = None) -> PreferenceLossOutput:
    """The loss of a batch of pairs from summed response log-probs [pairs] and response token counts [pairs]
    (policy; reference for the DPO family). See the module doc for the formulas."""
    terms = pair_terms(config, chosen_logps, rejected_logps, chosen_tokens, rejected_tokens, ref_chosen_logps,
                       ref_rejected_logps)
    pairs = terms.losses.numel()
    loss, nll = terms.losses.mean(), None
    if terms.nll_weight is not None:
        nll = -chosen_logps.sum() / chosen_tokens.to(chosen_logps.dtype).sum().clamp(min=1.0)
        loss = loss + terms.nll_weight * nll
    metrics = {name: value / pairs for name, value in pair_metric_sums(terms).items()}
    if nll is not None:
        metrics["nll_loss"] = nll.detach()
    return PreferenceLossOutput(loss=loss, losses=terms.losses, nll=nll, metrics=metrics)
