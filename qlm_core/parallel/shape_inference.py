"""Whether the forward running now is torch pipelining's metadata inference: in a schedule's first step each stage
runs one extra forward, on placeholder inputs, to learn its output shapes. Layers that keep state across a step's
micro-batches (the MoE layer's records and global-batch counts) leave that forward out."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

_depth = 0


def active() -> bool:
    return _depth > 0


@contextmanager
def inferring() -> Iterator[None]:
    global _depth
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
