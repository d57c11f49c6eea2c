"""The attention kernels with log-sum-exp against a float64 math reference (forward, and backward through autograd),
and piecewise (document / window) attention against full masked attention."""

from __future__ import annotations

import inspect
import itertools
import math

import pytest
import torch

from qlm_core.kernels import attention as attn
from qlm_core.kernels import stacked
from qlm_core.kernels.attention import attention_backward, attention_forward_with_lse
from qlm_core.kernels.pieces import FULL, Documents, Piece, self_attention_pieces
from qlm_core.kernels.piecewise import disjoint, piecewise_attention

TOL = 1e-5


def reference(q, k, v, scale, causal, mask=None):
    """softmax(q k^T * scale + mask) v in float64; rows with no visible key give 0 and lse = -inf."""
    q, k, v = (t.double() for t in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    s = q @ k.transpose(-1, -2) * scale
    allowed = torch.ones(s.shape[-2:], dtype=torch.bool)
    if causal:
        allowed = allowed.tril()
    if mask is not None:
        allowed = allowed & mask
    s = s.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return p @ v, lse


def make(b, hq, hk, sq, sk, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, h, s, d, generator=g) for h, s in ((hq, sq), (hk, sk), (hk, sk)))


CASES = {
    "causal": dict(b=2, hq=3, hk=3, sq=9, sk=9, causal=True),
    "non_causal": dict(b=2, hq=3, hk=3, sq=9, sk=9, causal=False),
    "gqa_causal": dict(b=2, hq=4, hk=2, sq=8, sk=8, causal=True),
    "gqa_rect": dict(b=1, hq=4, hk=2, sq=5, sk=11, causal=False),
    "rect": dict(b=2, hq=2, hk=2, sq=12, sk=5, causal=False),
}


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("backend", ["default", "math"])
def test_forward_backward_match_reference(name, backend, monkeypatch):
    c = CASES[name]
    if backend == "math":
        monkeypatch.setattr(attn, "_CPU_FLASH", None)
        monkeypatch.setattr(attn, "_CPU_FLASH_BWD", None)
    d, scale = 16, 1 / math.sqrt(16)
    q, k, v = make(c["b"], c["hq"], c["hk"], c["sq"], c["sk"], d)
    out, lse = attention_forward_with_lse(q, k, v, scale=scale, causal=c["causal"])
    assert out.shape == q.shape and lse.shape == q.shape[:3] and lse.dtype == torch.float32
    ref_q, ref_k, ref_v = (t.double().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse = reference(ref_q, ref_k, ref_v, scale, c["causal"])
    assert (out.double() - ref_out).abs().max() <= TOL
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    finite = torch.isfinite(ref_lse)
    assert (lse.double() - ref_lse)[finite].abs().max() <= TOL

    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    grads = attention_backward(grad, q, k, v, out, lse, scale=scale, causal=c["causal"])
    ref_out.backward(grad.double())
    for got, ref_t in zip(grads, (ref_q, ref_k, ref_v), strict=True):
        assert got.shape == ref_t.shape and torch.isfinite(got).all()
        assert (got.double() - ref_t.grad).abs().max() <= TOL


def test_backward_with_merged_lse_over_key_blocks():
    """Per-block backward with the final (merged) out/lse, summed over blocks, equals the full backward."""
    q, k, v = make(2, 4, 2, 6, 10, 8)
    scale = 0.3
    out, lse = attention_forward_with_lse(q, k, v, scale=scale, causal=False)
    grad = torch.randn_like(out)
    full = attention_backward(grad, q, k, v, out, lse, scale=scale, causal=False)
    dq = torch.zeros_like(q)
    dks, dvs = [], []
    for cols in (slice(0, 3), slice(3, 10)):
        bq, bk, bv = attention_backward(grad, q, k[:, :, cols], v[:, :, cols], out, lse, scale=scale, causal=False)
        dq += bq
        dks.append(bk)
        dvs.append(bv)
    assert (dq - full[0]).abs().max() <= TOL
    assert (torch.cat(dks, 2) - full[1]).abs().max() <= TOL
    assert (torch.cat(dvs, 2) - full[2]).abs().max() <= TOL


def document_mask(segment_ids, window):
    """[b, 1, s, s] bool: same document, causal, fewer than `window` back (the reference only)."""
    s = segment_ids.shape[1]
    back = torch.arange(s)[:, None] - torch.arange(s)[None, :]
    allowed = (back >= 0) & (back < (window or s))
    return (allowed & (segment_ids[:, :, None] == segment_ids[:, None, :]))[:, None]


PIECEWISE = {
    "documents": (torch.tensor([[0] * 3 + [1] * 9 + [2] * 12, [0] * 24]), None),
    "documents_window": (torch.tensor([[0] * 3 + [1] * 9 + [2] * 12, [0] * 24]), 4),
    "window_one": (torch.tensor([[0] * 24, [0] * 10 + [1] * 14]), 1),
    "window": (None, 5),
    # documents of one length: their pieces run stacked, one kernel call per shape (kernels/stacked.py)
    "equal_documents": (torch.tensor([[0] * 6 + [1] * 6 + [2] * 6 + [3] * 6, [0] * 12 + [1] * 12]), None),
    "equal_documents_window": (torch.tensor([[0] * 6 + [1] * 6 + [2] * 6 + [3] * 6, [0] * 12 + [1] * 12]), 4),
}


@pytest.mark.parametrize("name", PIECEWISE)
@pytest.mark.parametrize("backend", ["default", "math"])
def test_piecewise_attention_matches_masked_attention(name, backend, monkeypatch):
    if backend == "math":
        monkeypatch.setattr(attn, "_CPU_FLASH", None)
        monkeypatch.setattr(attn, "_CPU_FLASH_BWD", None)
    segment_ids, window = PIECEWISE[name]
    q, k, v = make(2, 4, 2, 24, 24, 8)
    docs = None if segment_ids is None else Documents.from_segment_ids(segment_ids)
    pieces = self_attention_pieces(docs, 24, window)
    assert disjoint(pieces) == (window in (None, 1))  # a wider window merges two pieces per query block
    if name.startswith("equal"):
        assert any(len(group.indices) > 2 for group in stacked.groups(pieces, q.device))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = piecewise_attention(*leaves, pieces, 0.5)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    out.backward(grad)
    ref = [t.double().requires_grad_() for t in (q, k, v)]
    mask = document_mask(torch.zeros(2, 24, dtype=torch.long) if segment_ids is None else segment_ids, window)
    ref_out, _ = reference(*ref, 0.5, False, mask)
    ref_out.backward(grad.double())
    assert (out.double() - ref_out).abs().max() <= TOL
    for a, b in zip(leaves, ref, strict=True):
        assert (a.grad.double() - b.grad).abs().max() <= TOL


def test_empty_keys():
    q, k, v = make(1, 4, 2, 6, 6, 8)
    # No keys at all: out 0, lse -inf, zero grads (the CPU op would crash on this).
    out, lse = attention_forward_with_lse(q, k[:, :, :0], v[:, :, :0], scale=0.5, causal=False)
    assert (out == 0).all() and torch.isneginf(lse).all()
    empty_k = k[:, :, :0]
    dq, dk, dv = attention_backward(torch.ones_like(out), q, empty_k, empty_k, out, lse, scale=0.5, causal=False)
    assert (dq == 0).all() and dk.shape == (1, 2, 0, 8)


def test_bad_arguments():
    q, k, v = make(1, 3, 2, 4, 4, 8)
    with pytest.raises(ValueError, match="multiple"):
        attention_forward_with_lse(q, k, v, scale=1.0, causal=False)
    q, k, v = make(1, 2, 2, 4, 5, 8)
    with pytest.raises(ValueError, match="equal"):
        attention_forward_with_lse(q, k, v, scale=1.0, causal=True)


def _fake_varlen(padded_lse: bool):
    """flash-attn's varlen forward and backward, played by the CPU kernels one sequence at a time, with either lse
    layout (and window (0, -1) for UPPER squares): checks qlm's packing of pieces into THD and back, not flash-attn."""

    def segments(cu):
        bounds = cu.tolist()
        return [slice(a, b) for a, b in itertools.pairwise(bounds)]

    def seq(t, rows, upper):
        part = t[rows].transpose(0, 1)[None]
        return part.flip(2) if upper else part

    def forward(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal, return_attn_probs, window_size=(-1, -1)):
        upper = tuple(window_size) == (0, -1)
        assert cu_q.dtype == torch.int32 and max_q == max(cu_q.diff().tolist())
        out = torch.empty_like(q)
        lse = (torch.zeros(len(cu_q) - 1, q.shape[1], max_q) if padded_lse else torch.zeros(q.shape[1], q.shape[0]))
        for i, (sq, sk) in enumerate(zip(segments(cu_q), segments(cu_k), strict=True)):
            o, piece_lse = attention_forward_with_lse(seq(q, sq, upper), seq(k, sk, upper), seq(v, sk, upper),
                                                      scale=softmax_scale, causal=causal or upper)
            o, piece_lse = (o.flip(2), piece_lse.flip(2)) if upper else (o, piece_lse)
            out[sq] = o[0].transpose(0, 1)
            if padded_lse:
                lse[i, :, : sq.stop - sq.start] = piece_lse[0]
            else:
                lse[:, sq] = piece_lse[0]
        return out, lse, None

    def backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                 max_seqlen_k, dropout_p, softmax_scale, causal, window_size):
        upper = tuple(window_size) == (0, -1)
        batch = len(cu_seqlens_q) - 1
        want = (batch, q.shape[1], max_seqlen_q) if padded_lse else (q.shape[1], q.shape[0])
        assert tuple(softmax_lse.shape) == want  # the layout forward returned, not merely one that slices alike
        for i, (sq, sk) in enumerate(zip(segments(cu_seqlens_q), segments(cu_seqlens_k), strict=True)):
            lse = softmax_lse[i, :, : sq.stop - sq.start] if padded_lse else softmax_lse[:, sq]
            grads = attention_backward(seq(dout, sq, upper), seq(q, sq, upper), seq(k, sk, upper),
                                       seq(v, sk, upper), seq(out, sq, upper),
                                       lse[None].flip(2) if upper else lse[None],
                                       scale=softmax_scale, causal=causal or upper)
            for target, grad, rows in zip((dq, dk, dv), grads, (sq, sk, sk), strict=True):
                target[rows] = (grad.flip(2) if upper else grad)[0].transpose(0, 1)

    params = frozenset(inspect.signature(backward).parameters)
    return forward, lambda: (backward, params)


@pytest.mark.parametrize("padded_lse", [False, True])
@pytest.mark.parametrize("name", ["documents", "documents_window"])
def test_varlen_packing_matches_masked_attention(name, padded_lse, monkeypatch):
    from qlm_core.kernels import varlen

    forward, backward = _fake_varlen(padded_lse)
    monkeypatch.setattr(varlen, "_VARLEN_FWD", forward)
    monkeypatch.setattr(varlen, "_varlen_backward", backward)
    monkeypatch.setattr(varlen, "available", lambda q: True)
    kinds = []
    real_group = varlen._Group
    monkeypatch.setattr(varlen, "_Group", lambda *a: kinds.append(a[3][a[4][0]].kind) or real_group(*a))
    test_piecewise_attention_matches_masked_attention(name, "default", monkeypatch)
    assert set(kinds) == ({"causal"} if name == "documents" else {"causal", "full", "upper"})  # all went through


def test_stacked_pieces_that_share_queries_merge_one_by_one():
    """Two pieces of one shape over the same queries (keys 0-5 and 10-15 of row 0) and one over other queries: one
    kernel call, merged piece by piece where the queries repeat; equal to the masked reference."""
    q, k, v = make(2, 4, 2, 24, 24, 8)
    pieces = [Piece(0, slice(16, 22), slice(0, 6), FULL), Piece(0, slice(16, 22), slice(10, 16), FULL),
              Piece(1, slice(3, 9), slice(12, 18), FULL)]
    (group,) = stacked.groups(pieces, q.device)
    assert group.indices == (0, 1, 2) and not group.disjoint_queries
    mask = torch.zeros(2, 1, 24, 24, dtype=torch.bool)
    for piece in pieces:
        mask[piece.row, 0, piece.q, piece.k] = True
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = piecewise_attention(*leaves, pieces, 0.5)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    out.backward(grad)
    ref = [t.double().requires_grad_() for t in (q, k, v)]
    ref_out, _ = reference(*ref, 0.5, False, mask)
    seen = mask.any(-1)[:, :, :, None].expand(ref_out.shape[0], ref_out.shape[1], 24, 1)
    ref_out = torch.where(seen, ref_out, torch.zeros(()))  # a query in no piece gets 0
    (ref_out * grad.double()).sum().backward()
    assert (out.double() - ref_out).abs().max() <= TOL
    for a, b in zip(leaves, ref, strict=True):
        assert (a.grad.double() - b.grad.nan_to_num()).abs().max() <= TOL


def test_decoding_attention_keeps_bf16_scores_in_fp32():
    """One query a row against 1024 cached keys in bf16, sharp scores (scale 1): as close to the fp64 result as
    torch's fused masked kernel (which keeps the scores in fp32); scores in bf16 are ~1.7x further off."""
    import torch.nn.functional as F

    from qlm_core.kernels.attention import masked_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(4, h, s, 64, generator=g) for h, s in ((8, 1), (2, 1024), (2, 1024)))
    mask = torch.rand(4, 1, 1, 1024, generator=g) > 0.1
    exact = masked_attention(q.double(), k.double(), v.double(), mask, 1.0)
    ours = masked_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask, 1.0).double()
    fused = F.scaled_dot_product_attention(q.bfloat16().reshape(4, 2, 4, 64), k.bfloat16(), v.bfloat16(),
                                           attn_mask=mask, scale=1.0).reshape(4, 8, 1, 64).double()
    assert (ours - exact).abs().max() <= 1.25 * (fused - exact).abs().max()
