"""LoRA adapters in a checkpoint: what a LoRA run's args say and which tensors the adapters are.

A LoRA run's checkpoint holds only the adapters, under Megatron-style names (`decoder.layers.N.<linear>.lora_A.weight`,
sharded like the model: see ModelLayout.lora_tensors), and its args name the base weights:
  qlm_lora_base     path of the base checkpoint (HF directory or Megatron checkpoint)
  qlm_lora_rank     r          qlm_lora_alpha   alpha (the adapter output is scaled by alpha / r)
  qlm_lora_targets  list of linear_qkv / linear_proj / linear_fc1 / linear_fc2
  qlm_lora_dropout  dropout on the adapter input while training (no effect on the weights)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from qlm_core.errors import QlmError
from qlm_core.models.layout import LORA_TARGETS, ModelLayout, TensorLayout

ADAPTER_FACTORS = (".lora_A.", ".lora_B.")


class LoraSettings(Protocol):
    """What the adapters look like; config.LoraConfig and AdapterArgs both fit."""

    rank: int
    alpha: float
    dropout: float
    target_modules: list[str]


@dataclass(frozen=True)
class AdapterArgs:
    """The LoRA facts stored in a checkpoint's args (see the module docstring)."""

    rank: int
    alpha: float
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    dropout: float = 0.0
    base: str | None = None


def is_adapter_name(name: str) -> bool:
    return any(factor in name for factor in ADAPTER_FACTORS)


def lora_scale(settings: LoraSettings) -> float:
    return settings.alpha / settings.rank


def check_targets(settings: LoraSettings) -> list[str]:
    """The target modules in state_dict order; unknown names are an error."""
    unknown = sorted(set(settings.target_modules) - set(LORA_TARGETS))
    if unknown:
        raise QlmError(f"unknown LoRA target modules {unknown}", f"choose from {', '.join(LORA_TARGETS)}")
    if settings.rank < 1:
        raise QlmError(f"LoRA rank {settings.rank} must be at least 1", "set lora.rank")
    return [t for t in LORA_TARGETS if t in settings.target_modules]


def lora_args(settings: LoraSettings, base: str | None) -> dict:
    """The args entries (make_args(..., **lora_args(...))) of a LoRA run's checkpoint."""
    return dict(
        qlm_lora_base=None if base is None else str(base), qlm_lora_rank=settings.rank,
        qlm_lora_alpha=float(settings.alpha), qlm_lora_targets=check_targets(settings),
        qlm_lora_dropout=float(settings.dropout),
    )


def adapter_args(args, state: dict[str, torch.Tensor]) -> AdapterArgs | None:
    """The adapters a checkpoint holds (None when `state`, one chunk of it, has none). Rank and targets fall back
    on the tensors themselves when the args lack them; alpha then defaults to the rank (scale 1)."""
    names = [n for n in state if is_adapter_name(n)]
    if not names:
        return None
    rank = getattr(args, "qlm_lora_rank", None) or state[next(n for n in names if ".lora_A." in n)].shape[0]
    targets = getattr(args, "qlm_lora_targets", None) or [
        t for t, linear in LORA_TARGETS.items() if any(f".{linear}.lora_" in n for n in names)
    ]
    alpha = getattr(args, "qlm_lora_alpha", None)
    return AdapterArgs(rank=int(rank), alpha=float(rank if alpha is None else alpha), target_modules=list(targets),
                       dropout=float(getattr(args, "qlm_lora_dropout", 0.0) or 0.0),
                       base=getattr(args, "qlm_lora_base", None))


def all_lora_tensors(layout: ModelLayout, settings: LoraSettings) -> list[TensorLayout]:
    targets = check_targets(settings)
    return [t for layer in range(layout.spec.num_layers) for t in layout.lora_tensors(layer, settings.rank, targets)]
