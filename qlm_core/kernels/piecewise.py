"""Attention computed piece by piece (kernels/pieces.py): forward merges the pieces' partial results by log-sum-exp,
backward runs each piece's kernel backward against the merged out and lse and sums the gradients.

Nothing of q x k elements is allocated: each piece runs a fused kernel (torch's CPU flash op, flash-attn or the
memory-efficient kernel on CUDA) that keeps its scores in tiles; the buffers here are the size of q, k and v.
"""

from __future__ import annotations

import itertools

import torch
from torch.autograd import Function

from qlm_core.kernels import stacked, varlen
from qlm_core.kernels.alibi import tile_bias
from qlm_core.kernels.attention import accumulation_dtype, attention_backward, attention_forward_with_lse
from qlm_core.kernels.pieces import FULL, UPPER, Piece
from qlm_core.kernels.sinks import add_sinks, sinks_grad


def _take(t: torch.Tensor, row, index: slice, kind: str) -> torch.Tensor:
    """t[row, :, index] as [1 or b, h, n, d] (or [.., n] for lse), read back to front for an UPPER piece."""
    part = t[:, :, index] if row is None else t[row : row + 1, :, index]
    return part.flip(2) if kind == UPPER else part


def _put(t: torch.Tensor, row, index: slice) -> torch.Tensor:
    """The view of t that a piece's result goes to."""
    return t[:, :, index] if row is None else t[row : row + 1, :, index]


def disjoint(pieces: list[Piece]) -> bool:
    """Whether each query and each key is in at most one piece (then nothing needs merging or summing)."""
    for attr in ("q", "k"):
        seen: dict = {}
        for piece in pieces:
            seen.setdefault(piece.row, []).append(getattr(piece, attr))
        if None in seen and len(seen) > 1:
            return False
        for spans in seen.values():
            spans.sort(key=lambda s: s.start)
            if any(a.stop > b.start for a, b in itertools.pairwise(spans)):
                return False
    return True


def _bias_key(piece: Piece) -> tuple:
    return piece.q.stop - piece.q.start, piece.k.stop - piece.k.start, piece.shift, piece.kind


class _Biases:
    """What changes every piece's scores, for one pass over the pieces: Gemma 2's `softcap`, and ALiBi's bias of
    each piece as its kernel reads it (no slopes: None). The last bias built is kept, so tiles of one shape and shift
    (a diagonal of a long row's tiles), which run one after another (_rest orders them so), share it, one tile's
    bias alive at a time."""

    def __init__(self, slopes: torch.Tensor | None, softcap: float | None = None):
        self.slopes, self.softcap, self.key, self.bias = slopes, softcap, None, None

    @property
    def any(self) -> bool:
        return self.slopes is not None or self.softcap is not None

    def __call__(self, piece: Piece) -> torch.Tensor | None:
        if self.slopes is None:
            return None
        assert piece.shift is not None, "ALiBi needs pieces built positional"
        key = _bias_key(piece)
        if key != self.key:
            self.key, self.bias = None, None  # the old one freed before the new one is built
            self.key, self.bias = key, tile_bias(self.slopes, *key)
        return self.bias


def _piece_forward(q, k, v, piece: Piece, scale, biases: _Biases):
    out, lse = attention_forward_with_lse(
        _take(q, piece.row, piece.q, piece.kind), _take(k, piece.row, piece.k, piece.kind),
        _take(v, piece.row, piece.k, piece.kind), scale=scale, causal=piece.kind != FULL, bias=biases(piece),
        softcap=biases.softcap,
    )
    if piece.kind == UPPER:
        out, lse = out.flip(2), lse.flip(2)
    return out, lse


def _varlen(q, biases: _Biases) -> bool:
    return not biases.any and varlen.available(q)


def _forward_all(q, k, v, pieces: list[Piece], scale, biases: _Biases):
    """(piece, out, lse) for every piece: one varlen call per kind where flash-attn can, else one call a piece (the
    callers run the groups of kernels/stacked.py first and hand this the rest)."""
    batched = varlen.forward(q, k, v, pieces, scale) if _varlen(q, biases) else {}
    for index, piece in enumerate(pieces):
        yield (piece, *(batched[index] if index in batched else _piece_forward(q, k, v, piece, scale, biases)))


def _stacked_groups(q, pieces: list[Piece], biases: _Biases) -> tuple[stacked.Group, ...]:
    """The groups of pieces that share a shape (and with ALiBi a shift), run by one kernel call each (not where
    flash-attn's varlen runs, nor soft-capped tiles: their plain math holds a group's scores at once)."""
    if _varlen(q, biases) or biases.softcap is not None:
        return ()
    return stacked.groups(pieces, q.device, by_shift=biases.slopes is not None)


def _group_bias(group: stacked.Group, pieces: list[Piece], biases: _Biases) -> torch.Tensor | None:
    return biases(pieces[group.indices[0]])


def _rest(pieces: list[Piece], groups: tuple[stacked.Group, ...], slopes=None) -> list[Piece]:
    """The pieces no group runs (with ALiBi, those of one bias one after another)."""
    grouped = {index for group in groups for index in group.indices}
    rest = [piece for index, piece in enumerate(pieces) if index not in grouped]
    return rest if slopes is None else sorted(rest, key=lambda piece: (*_bias_key(piece), piece.q.start))


def _piece_backward(grad_out, q, k, v, out, lse, piece: Piece, scale, biases: _Biases):
    row, kind = piece.row, piece.kind
    grads = attention_backward(
        _take(grad_out, row, piece.q, kind), _take(q, row, piece.q, kind), _take(k, row, piece.k, kind),
        _take(v, row, piece.k, kind), _take(out, row, piece.q, kind), _take(lse, row, piece.q, kind),
        scale=scale, causal=kind != FULL, bias=biases(piece), softcap=biases.softcap,
    )
    return tuple(g.flip(2) for g in grads) if kind == UPPER else grads


def merge(out: torch.Tensor, lse: torch.Tensor, blk_out: torch.Tensor, blk_lse: torch.Tensor):
    """In place: (out, lse) <- softmax-weighted combination of two partial results over disjoint keys."""
    new = torch.logaddexp(lse, blk_lse)
    base = new.masked_fill(torch.isneginf(new), 0.0)  # both -inf: weights exp(-inf) = 0, not NaN
    out.mul_(torch.exp(lse - base)[..., None]).add_(blk_out.to(out.dtype) * torch.exp(blk_lse - base)[..., None])
    lse.copy_(new)


def empty_result(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Accumulators for merging: out 0 and lse -inf (a row that sees nothing stays so)."""
    out = torch.zeros(q.shape, dtype=accumulation_dtype(q.dtype), device=q.device)
    return out, torch.full(q.shape[:3], float("-inf"), dtype=out.dtype, device=q.device)


def _merge_group(out: torch.Tensor, lse: torch.Tensor, pieces: list[Piece], group: stacked.Group,
                 blk_out: torch.Tensor, blk_lse: torch.Tensor) -> None:
    """merge() of a stacked group's results: gathered, merged and put back at once when no query is in two of its
    pieces, else piece by piece (in order)."""
    rows, positions = group.q_rows, group.q_positions
    if group.disjoint_queries:
        current_out, current_lse = (stacked.gather(t, rows, positions, group.count) for t in (out, lse))
        merge(current_out, current_lse, blk_out, blk_lse)
        stacked.put(out, rows, positions, current_out)
        stacked.put(lse, rows, positions, current_lse)
        return
    for slot, index in enumerate(group.indices):
        piece = pieces[index]
        one_out, one_lse = blk_out[slot : slot + 1], blk_lse[slot : slot + 1]
        if piece.kind == UPPER:
            one_out, one_lse = one_out.flip(2), one_lse.flip(2)
        merge(_put(out, piece.row, piece.q), _put(lse, piece.row, piece.q), one_out, one_lse)


def attend_pieces(q, k, v, pieces: list[Piece], scale: float, out: torch.Tensor, lse: torch.Tensor, slopes=None,
                  softcap=None):
    """Merge every piece's attention into the accumulators (out, lse) from empty_result (`slopes` [hq]: ALiBi's,
    over pieces built positional; `softcap`: Gemma 2's, over pieces cut into tiles)."""
    biases = _Biases(slopes, softcap)
    groups = _stacked_groups(q, pieces, biases)
    for group in groups:
        _merge_group(out, lse, pieces, group,
                     *stacked.forward(q, k, v, group, scale, _group_bias(group, pieces, biases), softcap))
    for piece, blk_out, blk_lse in _forward_all(q, k, v, _rest(pieces, groups, slopes), scale, biases):
        merge(_put(out, piece.row, piece.q), _put(lse, piece.row, piece.q), blk_out, blk_lse)


def attend_pieces_backward(grad_out, q, k, v, out, lse, pieces: list[Piece], scale: float, dq, dk, dv, slopes=None,
                           softcap=None):
    """Add each piece's gradients (against the final out and lse) into dq, dk, dv."""
    biases = _Biases(slopes, softcap)
    groups = _stacked_groups(q, pieces, biases)
    for group in groups:
        bq, bk, bv = stacked.backward(grad_out, q, k, v, out, lse, group, scale, _group_bias(group, pieces, biases),
                                      softcap)
        stacked.put(dq, group.q_rows, group.q_positions, bq, accumulate=True)
        stacked.put(dk, group.k_rows, group.k_positions, bk, accumulate=True)
        stacked.put(dv, group.k_rows, group.k_positions, bv, accumulate=True)
    rest = _rest(pieces, groups, slopes)
    batched = varlen.backward(grad_out, q, k, v, out, lse, rest, scale) if _varlen(q, biases) else {}
    for index, piece in enumerate(rest):
        bq, bk, bv = (batched[index] if index in batched
                      else _piece_backward(grad_out, q, k, v, out, lse, piece, scale, biases))
        _put(dq, piece.row, piece.q).add_(bq)
        _put(dk, piece.row, piece.k).add_(bk)
        _put(dv, piece.row, piece.k).add_(bv)


def like_q(q: torch.Tensor, dtype=None) -> torch.Tensor:
    """An empty [b, h, s, d] buffer laid out as [s, b, h, d] in memory, like q (a view of linear_qkv's output): the
    attention output then reaches linear_proj as a view, not a copy."""
    b, h, s, d = q.shape
    return torch.empty(s, b, h, d, dtype=dtype or q.dtype, device=q.device).permute(1, 2, 0, 3)


class _PiecewiseAttention(Function):
    @staticmethod
    def forward(ctx, q, k, v, pieces, scale, sinks, slopes, softcap):
        alone = sinks is None and disjoint(pieces)  # sinks rescale the fp32 accumulator before its one rounding
        if alone:  # every query in exactly one piece: write the kernels' results straight into place
            out = like_q(q).zero_()
            lse = torch.full(q.shape[:3], float("-inf"), dtype=accumulation_dtype(q.dtype), device=q.device)
            biases = _Biases(slopes, softcap)
            groups = _stacked_groups(q, pieces, biases)
            for group in groups:
                blk_out, blk_lse = stacked.forward(q, k, v, group, scale, _group_bias(group, pieces, biases), softcap)
                stacked.put(out, group.q_rows, group.q_positions, blk_out)
                stacked.put(lse, group.q_rows, group.q_positions, blk_lse)
            for piece, blk_out, blk_lse in _forward_all(q, k, v, _rest(pieces, groups, slopes), scale, biases):
                _put(out, piece.row, piece.q).copy_(blk_out)
                _put(lse, piece.row, piece.q).copy_(blk_lse)
        else:
            acc, lse = empty_result(q)
            attend_pieces(q, k, v, pieces, scale, acc, lse, slopes, softcap)
            add_sinks(acc, lse, sinks)
            out = like_q(q).copy_(acc)
            del acc
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.pieces, ctx.scale, ctx.alone, ctx.slopes, ctx.softcap = pieces, scale, alone, slopes, softcap
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dtype = q.dtype if ctx.alone else accumulation_dtype(q.dtype)
        dq, dk, dv = (torch.zeros(t.shape, dtype=dtype, device=t.device) for t in (q, k, v))
        attend_pieces_backward(grad_out, q, k, v, out, lse, ctx.pieces, ctx.scale, dq, dk, dv, ctx.slopes, ctx.softcap)
        dsinks = sinks_grad(grad_out, out, lse, sinks)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, dsinks, None, None


def piecewise_attention(q, k, v, pieces: list[Piece], scale: float, sinks: torch.Tensor | None = None,
                        slopes: torch.Tensor | None = None, softcap: float | None = None) -> torch.Tensor:
    """Differentiable attention of q [b, hq, sq, d] against k, v [b, hk, sk, d] over `pieces` (local indices);
    a query in no piece gets 0 (and, with `sinks` [hq], a learned logit per head in every softmax:
    kernels/sinks.py; with `slopes` [hq], ALiBi's bias by distance over pieces built positional and cut into
    tiles: kernels/alibi.py; with `softcap`, Gemma 2's cap · tanh(scores / cap), over pieces cut into tiles)."""
    return _PiecewiseAttention.apply(q, k, v, pieces, scale, sinks, slopes, softcap)
