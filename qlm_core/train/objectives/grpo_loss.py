"""The policy-gradient losses of group-relative RL (GRPO and the variants users pick by name) from per-token log-probs.

Pure torch, no model: the caller has the policy's per-token log-probs of the sampled completions (`logps`, with
gradient), those of the policy that sampled them (`old_logps`, π_old: the rollout's), each completion's advantage,
the completion mask and, for a KL term, the reference's log-probs. The formulas are TRL 1.16's GRPOTrainer
(`_compute_loss`), checked against TRL itself in tests/train/test_grpo_loss.py:

    r = exp(logps - old_logps) per token, or GSPO's per sequence: exp(mean over the sequence's tokens of the same)
    per-token loss  -min(r·A, clip(r, 1 - ε_low, 1 + ε_high)·A)      (DAPO's clip-higher: ε_high ≠ ε_low)
                    r capped at δ first when `delta` is set (TRL's two-sided clipping, INTELLECT-2)
                    dual-clip (Ye et al. 2020): for A < 0 at most -c·A, c = `dual_clip` > 1
                    + β·KL(π ‖ π_ref) per token: k3 = e^(ref - logp) - (ref - logp) - 1 (TRL's), k1 = logp - ref,
                    k2 = (logp - ref)² / 2
    reduction       grpo     each sequence's token mean, summed over sequences / the step's sequences
                    bnpo     token sum / the step's completion tokens   (= dapo: TRL's bnpo normalises per
                    dapo     micro-batch, which equals this when the step is one micro-batch)
                    dr_grpo  token sum / (the step's sequences · max_completion_length)

The normalisers count the whole optimizer step (every micro-batch and data-parallel rank: `StepCounts`), so each
micro-batch's loss is its share of the step's and splitting the batch differently changes neither the loss nor the
update. Metrics, TRL's names: clip_ratio/low_mean, clip_ratio/high_mean, clip_ratio/region_mean (token means of the
clipped share), kl (token mean of the estimator), each as (sum, count) so that steps and ranks add up exactly.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import get_args

import torch

from qlm_core.config import (
    GrpoLossType,
    ImportanceSamplingLevel,
    KlEstimator,
    RlConfig,
    RolloutCorrection,
)
from qlm_core.errors import QlmError


@dataclass(frozen=True)
class GrpoLoss:
    """The loss users pick by name, with TRL's parameter names (epsilon = ε_low, epsilon_high defaults to it)."""

    loss_type: GrpoLossType = "dapo"
    importance_sampling_level: ImportanceSamplingLevel = "token"
    epsilon: float = 0.2
    epsilon_high: float | None = None
    delta: float | None = None
    dual_clip: float | None = None
    beta: float = 0.0
    kl_estimator: KlEstimator = "k3"
    max_completion_length: int = 256
    rollout_correction: RolloutCorrection = "none"
    correction_clip_min: float | None = None  # TIS / masked IS bounds on exp(log π_old - log π_rollout)
    correction_clip_max: float | None = 3.0

    @classmethod
    def from_recipe(cls, rl: RlConfig) -> GrpoLoss:
        return cls(**{f: getattr(rl, f) for f in cls.__dataclass_fields__})

    def __post_init__(self):
        for name, options in (("loss_type", GrpoLossType), ("importance_sampling_level", ImportanceSamplingLevel),
                              ("kl_estimator", KlEstimator), ("rollout_correction", RolloutCorrection)):
            if getattr(self, name) not in get_args(options):
                raise QlmError(f"rl.{name} {getattr(self, name)!r} is not one qlm knows",
                               f"use one of {', '.join(get_args(options))}")
        for name, least in (("epsilon", 0.0), ("epsilon_high", 0.0), ("delta", 1.0), ("dual_clip", 1.0),
                            ("beta", 0.0), ("correction_clip_min", 0.0), ("correction_clip_max", 0.0)):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not math.isfinite(value) or value < least
                                      or (value == least and name in ("delta", "dual_clip"))):
                bound = f"above {least:g}" if name in ("delta", "dual_clip") else f"{least:g} or more"
                raise QlmError(f"rl.{name} is {value!r}, not a finite number {bound}", f"set rl.{name} {bound}")
        if (self.correction_clip_min is not None and self.correction_clip_max is not None
                and self.correction_clip_min > self.correction_clip_max):
            raise QlmError(f"rl.correction_clip_min {self.correction_clip_min} is above rl.correction_clip_max "
                           f"{self.correction_clip_max}", "give a minimum at or below the maximum")
        if self.max_completion_length < 1:
            raise QlmError(f"rl.max_completion_length is {self.max_completion_length}", "set it to 1 or more")

    @property
    def epsilon_low(self) -> float:
        return self.epsilon

    @property
    def upper(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


@dataclass(frozen=True)
class StepCounts:
    """What the whole optimizer step holds (all micro-batches, all data-parallel ranks): the normalisers."""

    sequences: int
    tokens: int


def kl_per_token(logps: torch.Tensor, ref_logps: torch.Tensor, estimator: KlEstimator) -> torch.Tensor:
    """An estimate of KL(π ‖ π_ref) per sampled token (Schulman's k1, k2, k3)."""
    log_ratio = ref_logps - logps
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio * log_ratio
    return torch.exp(log_ratio) - log_ratio - 1


def _local_rows(x: torch.Tensor) -> torch.Tensor:
    return x.sum(-1)


def rollout_correction_weights(loss: GrpoLoss, old_logps: torch.Tensor, rollout_logps: torch.Tensor,
                               mask: torch.Tensor, row_sum: Callable[[torch.Tensor], torch.Tensor] = _local_rows
                               ) -> torch.Tensor:
    """TRL's vLLM importance-sampling correction: exp(log π_old - log π_rollout) per token, or per sequence (the
    sum over its tokens), truncated to [clip_min, clip_max] or masked to 0 outside them. [B, T] or [B, 1]."""
    diff = (old_logps - rollout_logps) * mask.to(old_logps.dtype)
    if loss.rollout_correction.startswith("sequence"):
        diff = row_sum(diff).unsqueeze(-1)
    ratio = torch.exp(diff)
    low = -math.inf if loss.correction_clip_min is None else loss.correction_clip_min
    high = math.inf if loss.correction_clip_max is None else loss.correction_clip_max
    if loss.rollout_correction.endswith("truncate"):
        return torch.clamp(ratio, min=low, max=high)
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


def grpo_token_loss(loss: GrpoLoss, logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor,
                    mask: torch.Tensor, ref_logps: torch.Tensor | None = None,
                    row_sum: Callable[[torch.Tensor], torch.Tensor] = _local_rows,
                    correction: torch.Tensor | None = None,
                    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token loss [B, T] (before masking) and the masked per-token statistics the metrics sum: `low`, `high`
    (clipped on either side, where the clip binds), `kl` (when beta > 0). logps, old_logps, ref_logps, mask: [B, T];
    advantages [B]. `row_sum`: a row's sum over its whole sequence (under context parallelism, every rank's part:
    parallel/tensor.sum_across), for GSPO's sequence mean. `correction`: rollout_correction_weights, multiplying
    the policy term (as TRL does, before the KL term)."""
    mask = mask.to(logps.dtype)
    log_ratio = logps - old_logps
    if loss.importance_sampling_level == "sequence":  # GSPO: the sequence's mean log-ratio, for all its tokens
        log_ratio = (row_sum(log_ratio * mask) / row_sum(mask).detach().clamp(min=1.0)).unsqueeze(-1)
    ratio = torch.exp(log_ratio)
    advantage = advantages.unsqueeze(1).to(logps.dtype)
    clipped = torch.clamp(ratio, 1 - loss.epsilon_low, 1 + loss.upper)
    capped = ratio if loss.delta is None else torch.clamp(ratio, max=loss.delta)
    per_token = -torch.min(capped * advantage, clipped * advantage)
    if loss.dual_clip is not None:  # a negative advantage's loss is bounded by c·|A|
        per_token = torch.where(advantage < 0, torch.minimum(per_token, -loss.dual_clip * advantage), per_token)
    # [B, T], or [B, 1] per sequence (GSPO): TRL averages those over sequences, not tokens; of the ratio after the
    # delta cap, as TRL counts them
    stats = {"low": ((capped < 1 - loss.epsilon_low) & (advantage < 0)).to(logps.dtype),
             "high": ((capped > 1 + loss.upper) & (advantage > 0)).to(logps.dtype)}
    if correction is not None:
        per_token = per_token * correction
    if loss.beta != 0.0:
        if ref_logps is None:
            raise ValueError("a KL term (beta > 0) needs the reference's log-probs")
        kl = kl_per_token(logps, ref_logps, loss.kl_estimator)
        per_token = per_token + loss.beta * kl
        stats["kl"] = kl.detach()
    return per_token.expand_as(mask), stats


def reduce_grpo_loss(loss: GrpoLoss, per_token: torch.Tensor, mask: torch.Tensor, step: StepCounts,
                     row_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """This micro-batch's share of the step's loss: summed over micro-batches and ranks it is the step's loss.
    `row_tokens`: each row's completion tokens over its whole sequence (default: this mask's; under context
    parallelism the sum over the ranks' parts)."""
    mask = mask.to(per_token.dtype)
    if loss.loss_type == "grpo":
        counts = mask.sum(-1) if row_tokens is None else row_tokens.to(per_token.dtype)
        per_sequence = (per_token * mask).sum(-1) / counts.clamp(min=1.0)
        return per_sequence.sum() / max(step.sequences, 1)
    total = (per_token * mask).sum()
    if loss.loss_type == "dr_grpo":
        return total / (max(step.sequences, 1) * loss.max_completion_length)
    return total / max(step.tokens, 1)


def grpo_metric_sums(stats: dict[str, torch.Tensor], mask: torch.Tensor) -> dict[str, tuple[float, float]]:
    """(sum, count) per TRL metric over this micro-batch's completion tokens (a per-sequence statistic: over its
    sequences, as TRL counts them); the step's value is Σsum / Σcount."""
    mask = mask.to(torch.float64)

    def summed(x: torch.Tensor) -> tuple[float, float]:
        if x.shape[1] == 1:
            return float(x.double().sum()), float(x.shape[0])
        return float((x.double() * mask).sum()), float(mask.sum())

    sums = {"clip_ratio/low_mean": summed(stats["low"]), "clip_ratio/high_mean": summed(stats["high"]),
            "clip_ratio/region_mean": summed((stats["low"] + stats["high"]).clamp(max=1))}
    if "kl" in stats:
        sums["kl"] = summed(stats["kl"])
    return sums
