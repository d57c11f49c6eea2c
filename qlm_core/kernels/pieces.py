"""Which parts of the attention matrix are computed: document-aware attention as a list of dense pieces.

Packed sequences (several documents in one row), sliding windows, context-parallel blocks and decoding all ask for
attention under a visibility rule: query p may see key j when both lie in the same document and 0 <= p - j < window.
Instead of a mask of q x k elements, the rule is cut into rectangles that a mask-free kernel computes whole:

  FULL    every query sees every key of the rectangle
  CAUSAL  a square; query i (from the start) sees keys 0..i   (a causal kernel, top-left = bottom-right when square)
  UPPER   a square; query i sees keys i..n-1                  (a causal kernel on both ranges read back to front)

Pieces that cover disjoint keys of the same queries are merged by log-sum-exp, as in ring attention. Positions here
are global token indices (under context parallelism, a rank's tokens are in ascending global order, so any global
interval meets them in one contiguous local range); `Piece` holds local index ranges, ready to slice, and the
distance between its first key's and first query's positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

FULL, CAUSAL, UPPER = "full", "causal", "upper"


class Piece(NamedTuple):
    row: int | None  # batch row; None = every row (the same layout for all)
    q: slice  # local query indices
    k: slice  # local key indices
    kind: str  # FULL | CAUSAL | UPPER
    # the position of its first key minus its first query's, queries and keys each at consecutive positions: what a
    # bias by distance (ALiBi, kernels/alibi.py) needs; None where coalesce joined pieces that are not
    shift: int | None = None


class Span(NamedTuple):
    """A contiguous run of positions [start, end) whose first one is held at local index `local`, the next ones
    at local + step, local + 2 step, ... (step -1 only in mirrored coordinates)."""

    start: int
    end: int
    local: int
    step: int = 1

    def clip(self, start: int, end: int) -> Span | None:
        lo, hi = max(start, self.start), min(end, self.end)
        return Span(lo, hi, self.local + self.step * (lo - self.start), self.step) if lo < hi else None

    def slice(self) -> slice:
        assert self.step == 1
        return slice(self.local, self.local + self.end - self.start)


def _causal_pieces(q: Span, k: Span, row, reverse: bool, window_shift: int) -> list[Piece]:
    """Keys j <= p of q x k. With `reverse`, both spans are in mirrored coordinates (see _mirror) and the pieces are
    mapped back: FULL stays FULL, CAUSAL becomes UPPER."""
    pieces = []

    def add(qs: Span, ks: Span, kind: str):
        if reverse:
            qs, ks = _unmirror(qs, 0), _unmirror(ks, window_shift)
            kind = UPPER if kind == CAUSAL else kind
        pieces.append(Piece(row, qs.slice(), ks.slice(), kind, ks.start - qs.start))

    before = k.clip(k.start, q.start)  # keys before the first query: seen by every query
    if before is not None:
        add(q, before, FULL)
    lo, hi = max(k.start, q.start), min(k.end, q.end)
    if lo < hi:  # the common range: a causal square (one token sees itself: that is a full piece, and can coalesce)
        add(q.clip(lo, hi), k.clip(lo, hi), CAUSAL if hi - lo > 1 else FULL)
        after = q.clip(hi, q.end)  # queries past the last key see all of the common keys
        if after is not None:
            add(after, k.clip(lo, hi), FULL)
    return pieces


# Mirrored coordinates turn "j >= p - window + 1" into the causal rule: p' = -p, j' = -(j + window - 1) gives
# j' <= p'. A mirrored span's local indices run backwards; _unmirror maps a sub-span back to ascending order.


def _mirror(span: Span, shift: int) -> Span:
    return Span(-(span.end - 1 + shift), -(span.start + shift) + 1, span.local + span.end - span.start - 1, -1)


def _unmirror(span: Span, shift: int) -> Span:
    n = span.end - span.start
    return Span(-(span.end - 1) - shift, -span.start - shift + 1, span.local - n + 1)


def band_pieces(q: Span, k: Span, window: int | None, row=None) -> list[Piece]:
    """Pieces of q x k (one document) where 0 <= p - j < window (window None: unbounded)."""
    if window is None:
        return _causal_pieces(q, k, row, False, 0)
    pieces = []
    for start in range(q.start, q.end, window):  # query blocks no longer than the window
        block = q.clip(start, start + window)
        below = k.clip(start, block.end)  # keys from the block's start: only j <= p binds
        if below is not None:
            pieces += _causal_pieces(block, below, row, False, 0)
        above = k.clip(start - window + 1, start)  # keys before it: only j > p - window binds
        if above is not None:
            pieces += _causal_pieces(_mirror(block, 0), _mirror(above, window - 1), row, True, window - 1)
    return pieces


def row_runs(values) -> list[list[tuple[int, int, int]]]:
    """[b, n] tensor -> per row, (start, end, value) of each run of equal values. One host read of the change points
    and their values: a row of one run costs one element, whatever its length."""
    b, n = values.shape
    change = (values[:, 1:] != values[:, :-1]).nonzero()
    read = torch.cat([values[:, 0], values[change[:, 0], change[:, 1] + 1]]).tolist()
    starts: list[list[int]] = [[0] for _ in range(b)]
    run_values: list[list] = [[read[row]] for row in range(b)]
    for (row, col), value in zip(change.tolist(), read[b:], strict=True):
        starts[row].append(col + 1)
        run_values[row].append(value)
    return [list(zip(bounds, bounds[1:] + [n], vals, strict=True))
            for bounds, vals in zip(starts, run_values, strict=True)]


def coalesce(pieces: list[Piece]) -> list[Piece]:
    """Join FULL pieces of one row that share keys and have adjacent queries, or share queries and have adjacent
    keys: fewer, larger kernel calls for the same result. A joined piece whose positions do not run on (a
    context-parallel rank's two chunks, the answers after one shared prompt) has no shift."""
    for attr, other in (("q", "k"), ("k", "q")):
        joined: list[Piece] = []
        for piece in pieces:
            last = joined[-1] if joined else None
            extent = None if last is None else getattr(last, attr).stop - getattr(last, attr).start
            if (last is not None and piece.kind == FULL and last.kind == FULL and last.row == piece.row
                    and getattr(last, other) == getattr(piece, other)
                    and getattr(last, attr).stop == getattr(piece, attr).start):
                span = slice(getattr(last, attr).start, getattr(piece, attr).stop)
                runs_on = last.shift is not None and piece.shift == last.shift + (extent if attr == "k" else -extent)
                joined[-1] = last._replace(**{attr: span, "shift": last.shift if runs_on else None})
            else:
                joined.append(piece)
        pieces = joined
    return pieces


@dataclass(frozen=True)
class Documents:
    """Where the documents of a micro-batch lie, described once per forward and shared by every layer: for each row,
    the global [start, end) of each document (runs of equal segment id); `seq_len` is the global row length."""

    rows: tuple[tuple[tuple[int, int], ...], ...]
    seq_len: int
    # per row, per document: the [start, end) of an earlier document it continues (None: none), whose every key it
    # sees besides its own (a shared prompt's completions, packed once: train/shared_prefix.py); no windows then
    prefixes: tuple[tuple[tuple[int, int] | None, ...], ...] | None = None

    @classmethod
    def from_segment_ids(cls, segment_ids) -> Documents:
        """segment_ids [b, S] in global order (one host read per forward)."""
        rows = row_runs(segment_ids)
        return cls(tuple(tuple((start, end) for start, end, _ in row) for row in rows), segment_ids.shape[1])


def self_attention_pieces(docs: Documents | None, seq_len: int, window: int | None,
                          positional: bool = False) -> list[Piece]:
    """Queries and keys are the same whole rows (one process, or Ulysses after its all-to-all). `positional`: every
    piece keeps its shift (nothing is joined), for a bias by distance."""
    if docs is None:
        whole = Span(0, seq_len, 0)
        return band_pieces(whole, whole, window)
    if docs.prefixes is not None and window is not None:
        raise ValueError("documents that continue a shared prefix take no sliding window")
    pieces, seen = [], []
    for row, documents in enumerate(docs.rows):
        for index, (start, end) in enumerate(documents):
            span = Span(start, end, start)
            prefix = None if docs.prefixes is None else docs.prefixes[row][index]
            if prefix is not None:  # every key of the prefix (merged with its own by log-sum-exp), which it follows
                seen.append(Piece(row, span.slice(), slice(*prefix), FULL, prefix[0] - prefix[1]))
            pieces += band_pieces(span, span, window, row)
    return (seen if positional else coalesce(seen)) + pieces  # the documents after one prefix see it in one piece


def decoding_pieces(key_valid, past: int, new: int, window: int | None, positional: bool = False) -> list[Piece]:
    """Incremental decoding: `key_valid` [b, past + new] (True = a real token); queries are the `new` tokens after
    `past` cached ones, keys all past + new (cache indices). A real token sees every real key before it (within the
    window), a padding token only the padding run it is in (its output is never read). `positional`: as in
    self_attention_pieces; distances are then those of cache indices, padding included (left padding: the real
    tokens' own)."""
    rows = row_runs(key_valid)
    if all(spans == rows[0] for spans in rows):  # no padding (or the same everywhere): one set for every row
        rows = {None: rows[0]}
    pieces = []
    for row, spans in (rows.items() if isinstance(rows, dict) else enumerate(rows)):
        real = [Span(s, e, s) for s, e, valid in spans if valid]
        for start, end, valid in spans:
            queries = Span(start, end, start - past).clip(past, past + new)
            if queries is None:
                continue
            keys = real if valid else [Span(start, end, start)]
            for key_span in keys:
                pieces += band_pieces(queries, key_span, window, row)
    return pieces if positional else coalesce(pieces)
