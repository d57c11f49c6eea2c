"""ALiBi (BLOOM, MPT): no position embedding; each head adds slope_h * (j - i) to the score of query i and key j.

The bias depends only on the distance, so a piece of the attention matrix (kernels/pieces.py) needs one number
besides its size: `Piece.shift`, its first key's position minus its first query's. Pieces are cut into tiles of at
most TILE x TILE (`tiles`) and each tile's bias [1, heads, n, m] (fp32, whatever the inputs' dtype, on the CPU; the
inputs' dtype in CUDA's memory-efficient kernel) is handed to the fused kernel as its additive mask: nothing of
s x s is ever built, whatever the sequence length, and the merge of the tiles by log-sum-exp is that of any other
pieces.
"""

from __future__ import annotations

import math

import torch

from qlm_core.kernels.pieces import CAUSAL, FULL, UPPER, Piece

# A tile's edge: its bias is heads x TILE^2 fp32 (32 MiB for 32 heads a rank). bench/alibi.py, s = 8192 packed, bf16,
# 8 heads, 2 threads: forward + backward 4.7x the bias-free pieces' time with tiles of 128, 2.2-2.4x with 256,
# 1.6-1.9x with 512, 1.3-1.5x with 1024 (whose bias is 4x larger), 2.0x with 2048; one whole row: 1.65x with 512.
TILE = 512


def alibi_slopes(heads: int, bias_max: float = 8.0) -> torch.Tensor:
    """The slope of each head [heads] (fp32): 2^(-bias_max * k / n) for k = 1..n, n the next power of two of
    `heads`; for another head count those of even k first (2, 4, ..., n: the slopes of n / 2 heads), then those of
    odd k (the ALiBi paper's rule, which BLOOM's and MPT's code compute in their two ways)."""
    n = 2 ** math.ceil(math.log2(heads))
    slopes = [2.0 ** (-bias_max * k / n) for k in range(1, n + 1)]
    if n != heads:
        slopes = (slopes[1::2] + slopes[::2])[:heads]
    return torch.tensor(slopes, dtype=torch.float32)


def tile_bias(slopes: torch.Tensor, n: int, m: int, shift: int, kind: str) -> torch.Tensor:
    """[1, heads, n, m] fp32: slope * (j - i + shift) for query i and key j of a piece (an UPPER piece's as its
    kernel reads it, both axes back to front)."""
    distance = torch.arange(m, device=slopes.device)[None, :] - torch.arange(n, device=slopes.device)[:, None] + shift
    if kind == UPPER:
        distance = distance.flip(0, 1)
    return (slopes.float()[:, None, None] * distance.float())[None]


def _cuts(start: int, stop: int, edge: int) -> list[tuple[int, int]]:
    return [(lo, min(lo + edge, stop)) for lo in range(start, stop, edge)]


def tiles(pieces: list[Piece], edge: int | None = None) -> list[Piece]:
    """The same attention as `pieces`, each cut into pieces of at most edge x edge (None: TILE): a CAUSAL (UPPER)
    square into CAUSAL (UPPER) squares on its diagonal and FULL rectangles below (above) it."""
    edge = edge or TILE
    out = []
    for piece in pieces:
        n, m = piece.q.stop - piece.q.start, piece.k.stop - piece.k.start
        if n <= edge and m <= edge:
            out.append(piece)
            continue
        for q_lo, q_hi in _cuts(piece.q.start, piece.q.stop, edge):
            for k_lo, k_hi in _cuts(piece.k.start, piece.k.stop, edge):
                dq, dk = q_lo - piece.q.start, k_lo - piece.k.start
                if piece.kind == FULL or dq == dk:
                    kind = piece.kind
                elif (piece.kind == CAUSAL) == (dk < dq):  # below a causal diagonal, above an upper one
                    kind = FULL
                else:
                    continue
                shift = None if piece.shift is None else piece.shift + dk - dq
                out.append(Piece(piece.row, slice(q_lo, q_hi), slice(k_lo, k_hi), kind, shift))
    return out
