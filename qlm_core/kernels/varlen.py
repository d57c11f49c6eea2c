"""flash-attn's variable-length kernels for many pieces at once (CUDA, fp16/bf16, flash-attn installed).

The pieces of one kind (CAUSAL squares, FULL rectangles, UPPER squares as a window) are packed back to back into
[total, heads, dim] with cumulative lengths (the THD layout of Megatron's packed sequences) and run as one kernel call,
instead of one call per document. Gradients come back per piece, so the caller
merges and sums exactly as it does for per-piece kernels.

flash-attn has returned the log-sum-exp of varlen calls as [heads, total] (2.x recent) or padded [batch, heads,
max_len] (early 2.x); both are read, and backward is handed the layout forward produced.
"""

from __future__ import annotations

import inspect

import torch

from qlm_core.kernels.attention import FLASH_BACKWARD_DEFAULTS, call_declared, flash_attn_internal
from qlm_core.kernels.pieces import CAUSAL, FULL, UPPER, Piece

try:  # optional CUDA kernels; never required
    from flash_attn import flash_attn_varlen_func as _VARLEN_FWD
except Exception:  # noqa: BLE001 - any import failure means "not available"
    _VARLEN_FWD = None


def _varlen_backward():
    return flash_attn_internal("_flash_attn_varlen_backward")


_LSE_PADDED = {"seen": False}  # whether this flash-attn returned varlen lse as [batch, h, max_len]


def available(q: torch.Tensor) -> bool:
    return (_VARLEN_FWD is not None and _varlen_backward() is not None and q.is_cuda
            and q.dtype in (torch.float16, torch.bfloat16))


def _rows(t: torch.Tensor, piece: Piece, index: slice) -> list[torch.Tensor]:
    """The piece's [n, h, d] (or [n, h] for lse) blocks, one per batch row it covers."""
    rows = range(t.shape[0]) if piece.row is None else (piece.row,)
    return [t[r, :, index].transpose(0, 1) for r in rows]


def _pack(t: torch.Tensor, pieces: list[Piece], attr: str) -> torch.Tensor:
    return torch.cat([block for piece in pieces for block in _rows(t, piece, getattr(piece, attr))]).contiguous()


def _lengths(pieces: list[Piece], attr: str, batch: int) -> list[int]:
    """Each packed block's length, from the pieces alone (no device read)."""
    lengths = []
    for piece in pieces:
        index = getattr(piece, attr)
        lengths += [index.stop - index.start] * (batch if piece.row is None else 1)
    return lengths


def _bounds(lengths: list[int], device) -> torch.Tensor:
    """Cumulative lengths as int32 on the device, copied from pinned memory without a stream synchronisation."""
    bounds = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    if device.type == "cuda":
        return bounds.pin_memory().to(device, non_blocking=True)
    return bounds.to(device)


def _unpack(packed: torch.Tensor, pieces: list[Piece], b: int, lengths: list[int]) -> list[torch.Tensor]:
    """[total, ...] back into one [1 or b, h, n, ...] tensor per piece."""
    blocks = iter(packed.split(lengths))
    out = []
    for piece in pieces:
        count = b if piece.row is None else 1
        out.append(torch.stack([next(blocks).transpose(0, 1) for _ in range(count)]))
    return out


def _lse_blocks(lse: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """flash-attn's varlen lse as [total, h] whichever layout it came in."""
    if lse.dim() == 2:  # [h, total]
        return lse.transpose(0, 1)
    return torch.cat([lse[i, :, :n].transpose(0, 1) for i, n in enumerate(lengths)])  # [batch, h, max_len]


def _lse_like(blocks: torch.Tensor, shape: tuple, lengths: list[int]) -> torch.Tensor:
    """[total, h] back into the layout of `shape` (what forward's lse had)."""
    if len(shape) == 2:
        return blocks.transpose(0, 1).contiguous()
    padded = blocks.new_zeros(shape)
    for i, part in enumerate(blocks.split(lengths)):
        padded[i, :, : part.shape[0]] = part.transpose(0, 1)
    return padded


# How each kind of piece is asked of flash-attn: an UPPER square is the window [i, end) of a non-causal call.
_KIND_ARGS = {CAUSAL: dict(causal=True), FULL: dict(causal=False), UPPER: dict(causal=False, window_size=(0, -1))}
_UPPER_BACKWARD = dict(window_size=(0, -1), window_size_left=0, window_size_right=-1)


def _supports_windows() -> bool:
    return "window_size" in inspect.signature(_VARLEN_FWD).parameters


class _Group:
    """The pieces of one kind packed back to back: q, k, v as [total, h, d] with their cumulative lengths."""

    def __init__(self, q, k, v, pieces: list[Piece], indices: list[int]):
        self.indices, self.pieces, self.batch = indices, [pieces[i] for i in indices], q.shape[0]
        self.kind = self.pieces[0].kind
        self.q_lengths, self.k_lengths = _lengths(self.pieces, "q", self.batch), _lengths(self.pieces, "k", self.batch)
        self.max_q, self.max_k = max(self.q_lengths), max(self.k_lengths)
        self.cu_q, self.cu_k = _bounds(self.q_lengths, q.device), _bounds(self.k_lengths, q.device)
        self.q, self.k, self.v = _pack(q, self.pieces, "q"), _pack(k, self.pieces, "k"), _pack(v, self.pieces, "k")

    def pack_q(self, t: torch.Tensor) -> torch.Tensor:
        return _pack(t, self.pieces, "q")

    def unpack(self, packed: torch.Tensor, attr: str = "q") -> list[torch.Tensor]:
        return _unpack(packed, self.pieces, self.batch, self.q_lengths if attr == "q" else self.k_lengths)


def _packed_groups(q, k, v, pieces: list[Piece]):
    """One group per kind. Left to the per-piece path: UPPER pieces on a flash-attn without windows, and groups of
    single queries with grouped K/V (flash-attn's seqlen_q = 1 path swaps heads into the batch and has returned a
    mis-ordered lse for batches of several)."""
    by_kind: dict[str, list[int]] = {CAUSAL: [], FULL: [], UPPER: []}
    for index, piece in enumerate(pieces):
        by_kind[piece.kind].append(index)
    if not _supports_windows():
        by_kind[UPPER] = []
    for indices in by_kind.values():
        if not indices:
            continue
        group = _Group(q, k, v, pieces, indices)
        if group.max_q == 1 and q.shape[1] != k.shape[1]:
            continue
        yield group


def forward(q, k, v, pieces: list[Piece], scale: float) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """{piece index: (out [1|b, h, n, d], lse [1|b, h, n] fp32)} for the pieces it batches (see _packed_groups)."""
    results = {}
    for g in _packed_groups(q, k, v, pieces):
        out, lse, _ = _VARLEN_FWD(g.q, g.k, g.v, g.cu_q, g.cu_k, g.max_q, g.max_k, softmax_scale=scale,
                                  return_attn_probs=True, **_KIND_ARGS[g.kind])
        _LSE_PADDED["seen"] = lse.dim() == 3
        lses = g.unpack(_lse_blocks(lse, g.q_lengths).float())
        results.update(zip(g.indices, zip(g.unpack(out), lses, strict=True), strict=True))
    return results


def backward(grad_out, q, k, v, out, lse, pieces: list[Piece], scale: float) -> dict[int, tuple]:
    """{piece index: (dq, dk, dv)} for the pieces forward batched, against the final (merged) out and lse."""
    results = {}
    for g in _packed_groups(q, k, v, pieces):
        # The layout flash-attn's forward returned: [h, total], or [batch, h, max_seqlen_q].
        shape = (len(g.q_lengths), q.shape[1], g.max_q) if _LSE_PADDED["seen"] else (q.shape[1], sum(g.q_lengths))
        # Rows that attend nothing have lse -inf; any finite value gives them zero gradients (as attention_backward).
        merged = g.pack_q(lse.masked_fill(torch.isneginf(lse), 0.0)).float()
        window = _UPPER_BACKWARD if g.kind == UPPER else {}
        dq, dk, dv = torch.empty_like(g.q), torch.empty_like(g.k), torch.empty_like(g.v)
        call_declared(
            _varlen_backward(), dout=g.pack_q(grad_out.to(q.dtype)), q=g.q, k=g.k, v=g.v,
            out=g.pack_q(out.to(q.dtype)), softmax_lse=_lse_like(merged, shape, g.q_lengths),
            dq=dq, dk=dk, dv=dv, cu_seqlens_q=g.cu_q, cu_seqlens_k=g.cu_k, max_seqlen_q=g.max_q,
            max_seqlen_k=g.max_k, softmax_scale=scale, causal=g.kind == CAUSAL, **{**FLASH_BACKWARD_DEFAULTS, **window},
        )
        grads = zip(g.unpack(dq), g.unpack(dk, "k"), g.unpack(dv, "k"), strict=True)
        results.update(zip(g.indices, grads, strict=True))
    return results
