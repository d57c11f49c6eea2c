"""One global Megatron tensor as HF tensors and TP shards (the vocabulary of models/layout.py): split along one axis,
a concatenation of `Segment`s, each a row range of one HF tensor or of Megatron's vocabulary padding. Its own module
so that the attention and MLP kinds can state their tensors without importing the whole layout."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

REPLICATED, ROWS, COLS, FC1 = "replicated", "rows", "cols", "fc1"


@dataclass(frozen=True)
class Segment:
    """Entries [start, stop) of the global tensor along its split axis are entries [hf_start, hf_start + stop -
    start) of HF tensor `hf_name` along the same axis; `hf_name` None marks Megatron's vocabulary padding."""

    start: int
    stop: int
    hf_name: str | None
    hf_start: int = 0


@dataclass(frozen=True)
class TensorLayout:
    name: str  # global Megatron name
    shape: tuple[int, ...]  # global shape (vocabulary padded)
    split: str
    segments: tuple[Segment, ...]
    hf_primary: bool = True  # False for the tied output layer, a copy of the embedding
    stored_as: str | None = None  # the tensor checkpoints hold this one as (the tied output layer: the embedding)
    expert: bool = False  # a routed expert's linear: divided over EP ranks, split over the expert-TP size
    dtype: torch.dtype | None = None  # held in this dtype whatever the model's (the routers' expert bias: fp32)
    buffer: bool = False  # a module buffer (the routers' expert bias): saved with the weights, no optimizer state
    # the HF tensor's extra leading axes of size 1 (ERNIE's router bias: HF [1, E], Megatron [E]); read and written
    # whole, as a view
    hf_leading: tuple[int, ...] = ()

    @property
    def stored_name(self) -> str:
        return self.stored_as or self.name

    @property
    def axis(self) -> int:
        return 1 if self.split == COLS else 0

    @property
    def real_extent(self) -> int:
        """Entries along the axis that hold weights (the rest is vocabulary padding)."""
        return max(s.stop for s in self.segments if s.hf_name is not None)

    def tp_ranges(self, tp: int, rank: int) -> list[tuple[int, int]]:
        n = self.shape[self.axis]
        if self.split == REPLICATED:
            return [(0, n)]
        if self.split == FC1:
            half = n // 2
            f = half // tp
            return [(rank * f, (rank + 1) * f), (half + rank * f, half + (rank + 1) * f)]
        part = n // tp
        return [(rank * part, (rank + 1) * part)]

    def shard_shape(self, tp: int) -> tuple[int, ...]:
        shape = list(self.shape)
        shape[self.axis] = sum(b - a for a, b in self.tp_ranges(tp, 0))
        return tuple(shape)


class TensorSource(Protocol):
    """Anything that can hand out ranges of global Megatron tensors: an HF checkpoint, a Megatron checkpoint."""

    def stored_dtype(self, tensor: TensorLayout) -> torch.dtype:
        """The dtype `tensor` is stored in."""

    def read_into(self, tensor: TensorLayout, start: int, stop: int, out: torch.Tensor) -> None:
        """Copy (and cast) global entries [start, stop) of `tensor` along its axis into `out`; the range lies
        within the tensor's real extent."""
