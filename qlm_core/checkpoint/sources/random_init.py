"""Random initialisation as a TensorSource: every global tensor is drawn from its own seeded generator, so any
parallel layout gets exactly the same initial model (a rank builds only its shards)."""

from __future__ import annotations

import math
import zlib

import torch

from qlm_core.models.layout import ModelLayout, TensorLayout
from qlm_core.models.norms import NORM_WEIGHT_SUFFIXES, norm_kind


class RandomInitSource:
    """Megatron's default init: N(0, std) weights, std / sqrt(2 L) for the layers that feed the residual stream
    (linear_proj, linear_fc2), ones for norms, zeros for biases (and the routers' expert biases)."""

    def __init__(self, layout: ModelLayout, seed: int = 1234, std: float = 0.02):
        self.layout, self.seed, self.std = layout, seed, std
        self._cached: tuple[str, torch.Tensor] | None = None

    def stored_dtype(self, tensor: TensorLayout) -> torch.dtype:
        return torch.float32

    def _full(self, tensor: TensorLayout) -> torch.Tensor:
        name = tensor.stored_name
        if self._cached is None or self._cached[0] != name:
            shape = list(tensor.shape)
            shape[tensor.axis] = tensor.real_extent  # padding rows are never read
            if name.endswith(NORM_WEIGHT_SUFFIXES):
                value = torch.full(shape, norm_kind(self.layout.spec).init)
            elif name.endswith((".bias", ".expert_bias")):
                value = torch.zeros(shape)
            else:
                std = self.std
                if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
                    std = self.std / math.sqrt(2.0 * self.layout.spec.num_layers)
                generator = torch.Generator().manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()))
                value = torch.randn(shape, generator=generator) * std
            self._cached = (name, value)
        return self._cached[1]

    def read_into(self, tensor: TensorLayout, start: int, stop: int, out: torch.Tensor):
        out.copy_(self._full(tensor).narrow(tensor.axis, start, stop - start))
