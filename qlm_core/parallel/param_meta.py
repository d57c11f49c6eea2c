"""What the gradient and optimizer code must know about a parameter beyond its tensor, in one typed record.

Layers mark their parameters when they create them (`mark`); gradient buffers, optimizers and FSDP read the marks
(`meta_of`). A parameter never marked has the default ParamMeta: replicated over TP, nothing special.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cache
from typing import TypeVar

import torch

_ATTRIBUTE = "qlm_param_meta"
Param = TypeVar("Param", bound=torch.Tensor)


@dataclass(frozen=True)
class ParamMeta:
    # Each TP rank holds a different part of the tensor. Unmarked parameters are replicated over TP.
    tp_split: bool = False
    # Replicated over TP while each TP rank computes only a partial gradient (its sequence shard, or its output
    # slice for a LoRA A factor): the gradient is all-reduced (SUM) over the TP group.
    sequence_parallel: bool = False
    # The tied word embedding held by both the first and the last pipeline stage: its gradient is all-reduced over
    # the embedding group.
    shared_embedding: bool = False
    # The last stage's copy of the tied embedding: the same values as the first stage's, so left out of the
    # gradient norm.
    tied_copy: bool = False
    # A routed expert's weight under expert parallelism: held by one expert-model-parallel position (ep x etp),
    # replicated over the expert-data-parallel group, over which its gradient is reduced.
    expert: bool = False


_UNMARKED = ParamMeta()


def meta_of(param: torch.Tensor) -> ParamMeta:
    return getattr(param, _ATTRIBUTE, _UNMARKED)


@cache
def _with_flags(meta: ParamMeta, flags: tuple[tuple[str, bool], ...]) -> ParamMeta:
    return replace(meta, **dict(flags))


def mark(param: Param, **flags: bool) -> Param:
    """Set the named ParamMeta flags of `param` (the others keep their values); returns `param`."""
    setattr(param, _ATTRIBUTE, _with_flags(meta_of(param), tuple(sorted(flags.items()))))
    return param


def copy_meta(source: torch.Tensor, target: torch.Tensor) -> None:
    """Give `target` the marks of `source` (a parameter replaced by another, e.g. by FSDP's DTensor parameter)."""
    setattr(target, _ATTRIBUTE, meta_of(source))


def counts_in_grad_norm(param: torch.Tensor, tp_rank: int) -> bool:
    """Whether this rank adds `param`'s gradient to the global gradient norm, so that every gradient element of
    the model counts exactly once: a TP-replicated parameter only on TP rank 0, the tied copy never, an expert's
    on every rank (its norm is summed over the expert-model-parallel group, not the TP group)."""
    meta = meta_of(param)
    return not meta.tied_copy and (meta.tp_split or meta.expert or tp_rank == 0)
