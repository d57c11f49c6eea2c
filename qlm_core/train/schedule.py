"""Learning-rate schedules: linear warmup, then constant, cosine or warmup-stable-decay (WSD)."""

from __future__ import annotations

import math

from qlm_core.config import LrSchedule, choices


def learning_rate(step: int, total_steps: int, *, lr: float, min_lr: float = 0.0, warmup: int = 0,
                  schedule: LrSchedule = "cosine", wsd_decay_fraction: float = 0.1) -> float:
    """The rate for optimizer step `step` (0-based) of `total_steps`."""
    assert schedule in choices(LrSchedule), f"lr_schedule {schedule!r}"  # the recipe's schema checked it (config.py)
    if step < warmup:
        return lr * (step + 1) / warmup
    if schedule == "constant":
        return lr
    span = max(total_steps - warmup, 1)
    if schedule == "cosine":
        progress = min((step - warmup) / span, 1.0)
        return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
    decay_steps = max(int(round(span * wsd_decay_fraction)), 1)
    decay_start = total_steps - decay_steps
    if step < decay_start:
        return lr
    return lr + (min_lr - lr) * min((step - decay_start + 1) / decay_steps, 1.0)
