"""flash-attn's variable-length kernels for many pieces at once (CUDA, fp16/bf16, flash-attn installed).

The pieces of one kind (CAUSAL squares, or FULL rectangles) are packed back to back into [total, heads, dim] with
cumulative lengths (the THD layout of Megatron's packed sequences) and run as one kernel call, instead of one call per
document. UPPER pieces (sliding windows only) keep the per-piece path. Gradients come back per piece, so the caller
merges and sums exactly as it does for per-piece kernels.

flash-attn has returned the log-sum-exp of varlen calls as [heads, total] (2.x recent) or padded [batch, heads,
max_len] (early 2.x); both are read, and backward is handed the layout forward produced.
"""

from __future__ import annotations

import torch

from .attention import FLASH_BACKWARD_DEFAULTS, call_declared, flash_attn_internal
from .pieces import CAUSAL, FULL, Piece

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


def _pack(t: torch.Tensor, pieces: list[Piece], attr: str):
    blocks = [block for piece in pieces for block in _rows(t, piece, getattr(piece, attr))]
    lengths = [block.shape[0] for block in blocks]
    bounds = torch.tensor([0] + lengths, device=t.device).cumsum(0).to(torch.int32)
    return torch.cat(blocks).contiguous(), bounds, max(lengths), lengths


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


def _lse_like(blocks: torch.Tensor, reference: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """[total, h] back into the layout `reference` (forward's lse) has."""
    if reference.dim() == 2:
        return blocks.transpose(0, 1).contiguous()
    padded = reference.new_zeros(reference.shape)
    for i, part in enumerate(blocks.split(lengths)):
        padded[i, :, : part.shape[0]] = part.transpose(0, 1)
    return padded


def _groups(pieces: list[Piece]) -> dict[str, list[int]]:
    groups: dict[str, list[int]] = {CAUSAL: [], FULL: []}
    for index, piece in enumerate(pieces):
        if piece.kind in groups:
            groups[piece.kind].append(index)
    return groups


class _Group:
    """The pieces of one kind packed back to back: q, k, v as [total, h, d] with their cumulative lengths."""

    def __init__(self, q, k, v, pieces: list[Piece], indices: list[int]):
        self.indices, self.pieces, self.batch = indices, [pieces[i] for i in indices], q.shape[0]
        self.q, self.cu_q, self.max_q, self.q_lengths = _pack(q, self.pieces, "q")
        self.k, self.cu_k, self.max_k, self.k_lengths = _pack(k, self.pieces, "k")
        self.v = _pack(v, self.pieces, "k")[0]
        self.causal = self.pieces[0].kind == CAUSAL

    def pack_q(self, t: torch.Tensor) -> torch.Tensor:
        return _pack(t, self.pieces, "q")[0]

    def unpack(self, packed: torch.Tensor, attr: str = "q") -> list[torch.Tensor]:
        return _unpack(packed, self.pieces, self.batch, self.q_lengths if attr == "q" else self.k_lengths)


def _packed_groups(q, k, v, pieces: list[Piece]):
    for indices in _groups(pieces).values():
        if indices:
            yield _Group(q, k, v, pieces, indices)


def forward(q, k, v, pieces: list[Piece], scale: float) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """{piece index: (out [1|b, h, n, d], lse [1|b, h, n] fp32)} for every CAUSAL and FULL piece."""
    results = {}
    for g in _packed_groups(q, k, v, pieces):
        out, lse, _ = _VARLEN_FWD(g.q, g.k, g.v, g.cu_q, g.cu_k, g.max_q, g.max_k, softmax_scale=scale,
                                  causal=g.causal, return_attn_probs=True)
        _LSE_PADDED["seen"] = lse.dim() == 3
        lses = g.unpack(_lse_blocks(lse, g.q_lengths).float())
        results.update(zip(g.indices, zip(g.unpack(out), lses)))
    return results


def backward(grad_out, q, k, v, out, lse, pieces: list[Piece], scale: float) -> dict[int, tuple]:
    """{piece index: (dq, dk, dv)} for every CAUSAL and FULL piece, against the final (merged) out and lse."""
    results = {}
    for g in _packed_groups(q, k, v, pieces):
        # The layout flash-attn's forward returned: [h, total], or padded [batch, h, max_len].
        reference = (lse.new_empty(len(g.q_lengths), q.shape[1], -(-g.max_q // 128) * 128) if _LSE_PADDED["seen"]
                     else lse.new_empty(q.shape[1], sum(g.q_lengths)))
        dq, dk, dv = torch.empty_like(g.q), torch.empty_like(g.k), torch.empty_like(g.v)
        call_declared(
            _varlen_backward(), dout=g.pack_q(grad_out.to(q.dtype)), q=g.q, k=g.k, v=g.v,
            out=g.pack_q(out.to(q.dtype)), softmax_lse=_lse_like(g.pack_q(lse).float(), reference, g.q_lengths),
            dq=dq, dk=dk, dv=dv, cu_seqlens_q=g.cu_q, cu_seqlens_k=g.cu_k, max_seqlen_q=g.max_q,
            max_seqlen_k=g.max_k, softmax_scale=scale, causal=g.causal, **FLASH_BACKWARD_DEFAULTS,
        )
        results.update(zip(g.indices, zip(g.unpack(dq), g.unpack(dk, "k"), g.unpack(dv, "k"))))
    return results
