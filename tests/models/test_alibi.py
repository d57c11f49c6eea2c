"""ALiBi (kernels/alibi.py) on every kernel path one process has — pieces of packed documents and windows cut into
tiles, stacked or not, the plain causal row, a decoding step's key mask — against the scores-plus-bias formula in
fp64; its slopes against BLOOM's and MPT's own code; and a long packed row that builds nothing of s^2 / 4."""

from __future__ import annotations

import pytest
import torch

from qlm_core.kernels.alibi import alibi_slopes, tiles
from qlm_core.kernels.attention import masked_attention
from qlm_core.kernels.pieces import CAUSAL, FULL, UPPER, Documents, self_attention_pieces
from qlm_core.kernels.piecewise import piecewise_attention
from qlm_core.profile.measure import LargestTensor
from tests.models.test_attention_kernels import document_mask, make

TOL = 1e-5


@pytest.mark.parametrize("heads", [1, 2, 3, 4, 5, 6, 8, 12, 16, 20, 24, 32, 40, 71, 112])
def test_slopes_are_bloom_and_mpt_slopes(heads):
    """transformers' BLOOM builds slopes from the power of two below the head count and MPT from the one above: the
    same numbers, which alibi_slopes gives (a count that is not a power of two takes the second rule's odd ones)."""
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    ours = alibi_slopes(heads).double()
    bloom = build_alibi_tensor(torch.ones(1, 2), heads, torch.float64).view(heads, 2)[:, 1]
    mpt = build_mpt_alibi_tensor(heads, 2).view(heads, 2)[:, 0].double().neg()
    assert torch.allclose(ours, bloom, rtol=1e-6) and torch.allclose(ours, mpt, rtol=1e-6)


def reference(q, k, v, slopes, scale, mask, positions=None):
    """softmax(q k^T scale + slope (j - i)) v in fp64 where `mask` [b, 1, sq, sk] allows; `positions` (of the
    queries, default the last sq of the keys')."""
    q, k, v = (t.double() for t in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    keys = torch.arange(k.shape[2], dtype=torch.float64)
    queries = keys[-q.shape[2]:] if positions is None else positions.double()
    bias = slopes.double().view(1, -1, 1, 1) * (keys[None, :] - queries[:, None])
    scores = (q @ k.transpose(-1, -2) * scale + bias).masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, -1) @ v


CASES = {
    "causal": (None, None),
    "documents": (torch.tensor([[0] * 3 + [1] * 9 + [2] * 12, [0] * 24]), None),
    "documents_window": (torch.tensor([[0] * 3 + [1] * 9 + [2] * 12, [0] * 24]), 4),
    "window": (None, 5),
    # documents of one length: their tiles run stacked, one kernel call per (shape, shift)
    "equal_documents": (torch.tensor([[0] * 6 + [1] * 6 + [2] * 6 + [3] * 6, [0] * 12 + [1] * 12]), None),
}


@pytest.mark.parametrize("edge", [4, 5, 256])
@pytest.mark.parametrize("name", CASES)
def test_tiles_with_alibi_match_the_formula(name, edge):
    segment_ids, window = CASES[name]
    q, k, v = make(2, 4, 2, 24, 24, 8, seed=5)
    slopes = alibi_slopes(4, bias_max=3.0)
    docs = None if segment_ids is None else Documents.from_segment_ids(segment_ids)
    pieces = tiles(self_attention_pieces(docs, 24, window, positional=True), edge)
    assert max(max(p.q.stop - p.q.start, p.k.stop - p.k.start) for p in pieces) <= edge
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = piecewise_attention(*leaves, pieces, 0.5, slopes=slopes)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    out.backward(grad)
    ref = [t.double().requires_grad_() for t in (q, k, v)]
    mask = document_mask(torch.zeros(2, 24, dtype=torch.long) if segment_ids is None else segment_ids, window)
    ref_out = reference(*ref, slopes, 0.5, mask)
    ref_out.backward(grad.double())
    assert (out.double() - ref_out).abs().max() <= TOL
    for got, want in zip(leaves, ref, strict=True):
        assert (got.grad.double() - want.grad).abs().max() <= TOL
    plain = piecewise_attention(q, k, v, pieces, 0.5)  # the bias moves the result: a test that dropped it fails
    assert (plain.double() - ref_out).abs().max() > 1e-2


def test_tiles_cover_each_piece_once():
    """A causal square cut into tiles: causal squares on the diagonal, full tiles below it, each (query, key) of the
    triangle in one tile; an upper square the same above its diagonal; the shifts say where each tile lies."""
    for kind in (CAUSAL, UPPER, FULL):
        from qlm_core.kernels.pieces import Piece

        piece = Piece(None, slice(3, 14), slice(3, 14) if kind != FULL else slice(20, 27), kind, 5)
        seen = torch.zeros(11, 27, dtype=torch.long)
        for tile in tiles([piece], 4):
            n, m = tile.q.stop - tile.q.start, tile.k.stop - tile.k.start
            block = torch.ones(n, m, dtype=torch.long)
            if tile.kind == CAUSAL:
                block = block.tril()
            elif tile.kind == UPPER:
                block = block.triu()
            seen[tile.q.start - 3:tile.q.stop - 3, tile.k.start:tile.k.stop] += block
            assert tile.shift == 5 + (tile.k.start - piece.k.start) - (tile.q.start - piece.q.start)
        want = torch.zeros_like(seen)
        full = torch.ones(11, piece.k.stop - piece.k.start, dtype=torch.long)
        want[:, piece.k] = full.tril() if kind == CAUSAL else full.triu() if kind == UPPER else full
        assert torch.equal(seen, want), kind


def test_decoding_step_with_alibi():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, h, s, 16, generator=g) for h, s in ((4, 1), (2, 10), (2, 10)))
    slopes = alibi_slopes(4)
    key_mask = torch.rand(3, 1, 1, 10, generator=g) > 0.3
    key_mask[:, ..., -1] = True
    out = masked_attention(q, k, v, key_mask, 0.25, slopes=slopes)
    assert (out.double() - reference(q, k, v, slopes, 0.25, key_mask)).abs().max() <= TOL


@pytest.mark.slow
def test_long_packed_alibi_row_builds_nothing_of_s_squared():
    """s = 8192 in three documents, forward and backward: no tensor of s^2 / 4 elements or more (a bias or mask of
    the whole row, or of one document, would be)."""
    s, heads = 8192, 2
    segment_ids = torch.repeat_interleave(torch.arange(3), torch.tensor([1000, 5192, 2000]))[None]
    q, k, v = (t.requires_grad_() for t in make(1, heads, heads, s, s, 8, seed=1))
    pieces = tiles(self_attention_pieces(Documents.from_segment_ids(segment_ids), s, None, positional=True))
    with LargestTensor() as seen:
        piecewise_attention(q, k, v, pieces, 0.3, slopes=alibi_slopes(heads)).sum().backward()
    assert seen.largest < s * s // 4, seen.largest


def test_an_alibi_model_runs_packed_and_decodes_as_it_runs_whole():
    """A model with ALiBi positions: packed documents give each document's own logits (ALiBi needs no position ids:
    a document's tokens are as far apart packed as alone), and a KV cache's prefill and steps (the decoding key
    mask) give the whole row's; the slopes move the logits (a model that dropped them would not)."""
    from helpers import cached_logits

    from qlm_core.kernels import alibi
    from qlm_core.models import load_model_spec
    from qlm_core.models.gpt import GPTModel

    spec = load_model_spec("qlm-tiny").replace(position="alibi")
    torch.manual_seed(0)
    model = GPTModel(spec).eval()
    ids = torch.randint(0, spec.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        whole = model(ids)
        segments = torch.tensor([[0] * 10 + [1] * 14] * 2)
        packed = model(ids, segment_ids=segments)
        assert (packed[:, :10] - whole[:, :10]).abs().max() <= TOL
        assert (packed[:, 10:] - model(ids[:, 10:])).abs().max() <= TOL
        assert (cached_logits(model, ids, 16) - whole).abs().max() <= TOL
        old, alibi.TILE = alibi.TILE, 5  # tiles smaller than the row: the same logits
        try:
            from qlm_core.models import attention_gqa

            attention_gqa._causal_pieces.cache_clear()
            assert (model(ids) - whole).abs().max() <= TOL
        finally:
            alibi.TILE = old
            attention_gqa._causal_pieces.cache_clear()
        for layer in model.decoder.layers:  # slopes of 0: no positions at all
            layer.self_attention.slopes = torch.zeros_like(layer.self_attention.slopes)
        assert (model(ids) - whole).abs().max() > 1e-3
