"""LoRA adapters as checkpoint data: what a LoRA run's args say, a seeded init, in-memory adapters, and the base
weights merged with their adapters (W + alpha/r * B A), all as TensorSources over ModelLayout.lora_tensors.

A LoRA run's checkpoint holds only the adapters, under Megatron-style names (`decoder.layers.N.<linear>.lora_A.weight`,
sharded like the model: see ModelLayout.lora_tensors), and its args name the base weights:
  qlm_lora_base     path of the base checkpoint (HF directory or Megatron checkpoint)
  qlm_lora_rank     r          qlm_lora_alpha   alpha (the adapter output is scaled by alpha / r)
  qlm_lora_targets  list of linear_qkv / linear_proj / linear_fc1 / linear_fc2
  qlm_lora_dropout  dropout on the adapter input while training (no effect on the weights)
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ..errors import QlmError
from .layout import (
    LORA_TARGETS,
    ModelLayout,
    TensorLayout,
    TensorSource,
    read_range,
    read_shard_tensor,
)

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


class LoraInitSource:
    """Initial adapters: A ~ kaiming_uniform(a=sqrt(5)) over the global fan-in (PEFT's init, U(+-1/sqrt(in))),
    B = 0. Each A is drawn from its own generator seeded by its global name, so every layout starts the same."""

    def __init__(self, seed: int = 1234):
        self.seed = seed
        self._cached: tuple[str, torch.Tensor] | None = None

    def stored_dtype(self, tensor: TensorLayout) -> torch.dtype:
        return torch.float32

    def _full(self, tensor: TensorLayout) -> torch.Tensor:
        if self._cached is None or self._cached[0] != tensor.name:
            if ".lora_B." in tensor.name:
                value = torch.zeros(tensor.shape)
            else:
                generator = torch.Generator().manual_seed(self.seed * 1_000_003 + zlib.crc32(tensor.name.encode()))
                bound = 1.0 / math.sqrt(tensor.shape[1])
                value = torch.empty(tensor.shape).uniform_(-bound, bound, generator=generator)
            self._cached = (tensor.name, value)
        return self._cached[1]

    def read_into(self, tensor: TensorLayout, start: int, stop: int, out: torch.Tensor):
        out.copy_(self._full(tensor).narrow(tensor.axis, start, stop - start))


class GlobalTensorSource:
    """Whole global tensors held in memory, by global name (e.g. a one-process model's adapters)."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def stored_dtype(self, tensor: TensorLayout) -> torch.dtype:
        return self.tensors[tensor.name].dtype

    def read_into(self, tensor: TensorLayout, start: int, stop: int, out: torch.Tensor):
        out.copy_(self.tensors[tensor.name].narrow(tensor.axis, start, stop - start))


class MergedSource:
    """The base weights with every adapted weight replaced by W + scale * B A, computed in fp32 for just the range
    asked for: rows of W need those rows of B and all of A; columns of W all of B and those columns of A."""

    def __init__(self, base: TensorSource, adapters: TensorSource, layout: ModelLayout, settings: LoraSettings):
        self.base, self.adapters, self.scale = base, adapters, lora_scale(settings)
        tensors = all_lora_tensors(layout, settings)
        self.factors = {a.name[: -len("lora_A.weight")] + "weight": (a, b) for a, b in zip(tensors[::2], tensors[1::2])}

    def stored_dtype(self, tensor: TensorLayout) -> torch.dtype:
        return self.base.stored_dtype(tensor)

    def read_into(self, tensor: TensorLayout, start: int, stop: int, out: torch.Tensor):
        if tensor.name not in self.factors:
            self.base.read_into(tensor, start, stop, out)
            return
        a, b = self.factors[tensor.name]
        weight = read_range(self.base, tensor, start, stop, torch.float32)
        if tensor.axis == 0:
            delta = read_range(self.adapters, b, start, stop, torch.float32) @ self._whole(a)
        else:
            delta = self._whole(b) @ read_range(self.adapters, a, start, stop, torch.float32)
        out.copy_(weight.add_(delta, alpha=self.scale))

    def _whole(self, factor: TensorLayout) -> torch.Tensor:
        return read_range(self.adapters, factor, 0, factor.shape[factor.axis], torch.float32)


def merged_source(base_source: TensorSource, adapter_source: TensorSource, layout: ModelLayout,
                  lora_config: LoraSettings) -> TensorSource:
    """A TensorSource of the merged model (what PEFT's merge_and_unload computes)."""
    return MergedSource(base_source, adapter_source, layout, lora_config)


def build_lora_shard(layout: ModelLayout, tp_rank: int, pp_rank: int, chunk: int, source: TensorSource,
                     settings: LoraSettings, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """One shard's adapters (what the rank at (tp_rank, pp_rank) of a LoRA run saves for `chunk`), read from any
    source of global adapter tensors: e.g. adapters saved at another TP/PP."""
    entries = layout.lora_shard_entries(pp_rank, chunk, settings.rank, check_targets(settings))
    return {name: read_shard_tensor(tensor, layout.tp, tp_rank, source, dtype) for name, tensor in entries}
