"""LoRA adapters as TensorSources over ModelLayout.lora_tensors: a seeded init, in-memory adapters, and the base
weights merged with their adapters (W + alpha/r * B A). What a LoRA checkpoint holds: formats/megatron/lora_args.py."""


from __future__ import annotations

import math
import zlib

import torch

from qlm_core.checkpoint.formats.megatron.lora_args import LoraSettings, all_lora_tensors, check_targets, lora_scale
from qlm_core.models.layout import (
    ModelLayout,
    TensorLayout,
    TensorSource,
    read_range,
    read_shard_tensor,
)


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
        self.factors = {a.name[: -len("lora_A.weight")] + "weight": (a, b)
                        for a, b in zip(tensors[::2], tensors[1::2], strict=True)}

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
