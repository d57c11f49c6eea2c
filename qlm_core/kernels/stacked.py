"""Pieces of one shape in one kernel call (any device without flash-attn's variable-length kernels).

Pieces of one row each (kernels/pieces.py) that share their kind and their query and key lengths — the documents of a
packed row cut to one length, a rollout group's answers after their shared prompt — are gathered along the batch
dimension by index (an UPPER piece's positions read back to front) and run as one call of the fused kernel, forward
and backward, instead of one call each; their results go back through the same indices. Each batch row of the kernel
is computed alone, so each piece's partial result is the per-piece call's; the merge of a query's pieces may run in
another order (stacked groups first), which changes the last bits of the merged result.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import torch

from qlm_core.kernels.attention import attention_backward, attention_forward_with_lse
from qlm_core.kernels.pieces import FULL, UPPER, Piece


@dataclass(frozen=True)
class Group:
    """Pieces of one kind and shape: `count` of them, `n` queries and `m` keys each; the row and first query / key
    index of each piece ([count] tensors on the device), from which the (row, position) of every query and key they
    read, [count * n] and [count * m] in the kernel's order, are built when a kernel needs them (a long row's
    ALiBi tiles are many: kept as starts, the cache holds O(pieces), not O(tokens x pieces))."""

    indices: tuple[int, ...]
    kind: str
    n: int
    m: int
    rows: torch.Tensor
    q_starts: torch.Tensor
    k_starts: torch.Tensor
    disjoint_queries: bool  # no query in two of the pieces (then a merge can gather, merge and put back at once)

    @property
    def count(self) -> int:
        return len(self.indices)

    def _positions(self, starts: torch.Tensor, length: int) -> torch.Tensor:
        step = torch.arange(length, device=starts.device)
        offsets = step.flip(0) if self.kind == UPPER else step  # an UPPER piece is read back to front
        return (starts[:, None] + offsets).flatten()

    @property
    def q_rows(self) -> torch.Tensor:
        return self.rows.repeat_interleave(self.n)

    @property
    def q_positions(self) -> torch.Tensor:
        return self._positions(self.q_starts, self.n)

    @property
    def k_rows(self) -> torch.Tensor:
        return self.rows.repeat_interleave(self.m)

    @property
    def k_positions(self) -> torch.Tensor:
        return self._positions(self.k_starts, self.m)


def groups(pieces: list[Piece], device, by_shift: bool = False) -> tuple[Group, ...]:
    """The pieces of one row each, by (kind, query length, key length) and with `by_shift` their shift (one ALiBi
    bias for the group), where two or more share one. Every layer of a forward and its backward hand the same
    pieces: their groups are worked out once and kept in a small cache."""
    key = tuple((p.row, p.q.start, p.q.stop, p.k.start, p.k.stop, p.kind, p.shift if by_shift else 0)
                for p in pieces)
    return _groups(key, torch.device(device))


@functools.lru_cache(maxsize=16)
def _groups(key: tuple, device: torch.device) -> tuple[Group, ...]:
    by_shape: dict[tuple, list[int]] = {}
    for index, (row, q_start, q_stop, k_start, k_stop, kind, shift) in enumerate(key):
        if row is not None:
            by_shape.setdefault((kind, q_stop - q_start, k_stop - k_start, shift), []).append(index)
    out = []
    for (kind, n, m, _), indices in by_shape.items():
        if len(indices) < 2:
            continue
        chosen = [key[i] for i in indices]
        spans = sorted((row, q_start) for row, q_start, *_ in chosen)
        disjoint = all(a[0] != b[0] or b[1] >= a[1] + n for a, b in itertools.pairwise(spans))
        rows, q_starts, k_starts = (torch.tensor([piece[column] for piece in chosen], dtype=torch.long, device=device)
                                    for column in (0, 1, 3))
        out.append(Group(tuple(indices), kind, n, m, rows, q_starts, k_starts, disjoint))
    return tuple(out)


def gather(t: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, count: int) -> torch.Tensor:
    """[b, h, s(, d)] at (rows, positions) -> [count, h, len, (d)], a copy."""
    if t.dim() == 3:
        picked = t.permute(0, 2, 1)[rows, positions]  # [N, h]
        return picked.view(count, -1, t.shape[1]).permute(0, 2, 1)
    picked = t.permute(0, 2, 1, 3)[rows, positions]  # [N, h, d]
    return picked.view(count, -1, t.shape[1], t.shape[3]).permute(0, 2, 1, 3)


def put(t: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, values: torch.Tensor,
        accumulate: bool = False) -> None:
    """In place: t at (rows, positions) <- (or += with `accumulate`) values [count, h, len(, d)]."""
    if t.dim() == 3:
        t.permute(0, 2, 1).index_put_((rows, positions), values.permute(0, 2, 1).reshape(-1, t.shape[1]).to(t.dtype),
                                      accumulate=accumulate)
        return
    flat = values.permute(0, 2, 1, 3).reshape(-1, t.shape[1], t.shape[3]).to(t.dtype)
    t.permute(0, 2, 1, 3).index_put_((rows, positions), flat, accumulate=accumulate)


def forward(q, k, v, group: Group, scale: float, bias=None, softcap=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [count, h, n, d], lse [count, h, n]) of the group, positions in the group's order (`bias`: the one
    [1, h, n, m] of every piece, kernels/alibi.py)."""
    qs = (group.q_rows, group.q_positions, group.count)
    ks = (group.k_rows, group.k_positions, group.count)
    return attention_forward_with_lse(gather(q, *qs), gather(k, *ks), gather(v, *ks), scale=scale,
                                      causal=group.kind != FULL, bias=bias, softcap=softcap)


def backward(grad_out, q, k, v, out, lse, group: Group, scale: float,
             bias=None, softcap=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of the group against the final out and lse, positions in the group's order."""
    qs = (group.q_rows, group.q_positions, group.count)
    ks = (group.k_rows, group.k_positions, group.count)
    return attention_backward(gather(grad_out, *qs), gather(q, *qs), gather(k, *ks), gather(v, *ks),
                              gather(out, *qs), gather(lse, *qs), scale=scale, causal=group.kind != FULL, bias=bias,
                              softcap=softcap)
