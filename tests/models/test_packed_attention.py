"""Packed documents and sliding windows without a dense mask: the pieces cover exactly the visible pairs, a packed
row equals each of its documents run on its own, decoding with padding equals each row alone, and nothing of
s x s elements is ever created."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import qlm_from_hf
from torch.utils._python_dispatch import TorchDispatchMode

from qlm_core.kernels.pieces import CAUSAL, FULL, UPPER, Piece, Span, band_pieces, decoding_pieces, row_runs
from qlm_core.models.gpt import GPTModel, KVCache
from qlm_core.models.spec import ModelSpec


def _covered(pieces, nq, nk):
    """How many times each (query, key) pair is computed."""
    counts = torch.zeros(nq, nk, dtype=torch.long)
    for piece in pieces:
        n_q, n_k = piece.q.stop - piece.q.start, piece.k.stop - piece.k.start
        if piece.kind == FULL:
            block = torch.ones(n_q, n_k, dtype=torch.long)
        else:
            assert n_q == n_k, piece
            block = torch.ones(n_q, n_k, dtype=torch.long)
            block = block.tril() if piece.kind == CAUSAL else block.triu()
        counts[piece.q, piece.k] += block
    return counts


def test_band_pieces_cover_each_visible_pair_once():
    rng = random.Random(0)
    for _ in range(250):
        q0, k0 = rng.randint(0, 30), rng.randint(0, 30)
        q1, k1 = q0 + rng.randint(1, 30), k0 + rng.randint(1, 30)
        window = rng.choice([None, 1, 2, 3, 5, 8, 40])
        q_local, k_local = rng.randint(0, 4), rng.randint(0, 4)
        pieces = band_pieces(Span(q0, q1, q_local), Span(k0, k1, k_local), window)
        got = _covered(pieces, q_local + q1 - q0, k_local + k1 - k0)
        p = torch.arange(q0, q1)[:, None]
        j = torch.arange(k0, k1)[None, :]
        want = torch.zeros_like(got)
        want[q_local:, k_local:] = ((p - j >= 0) & (p - j < (window or 10**9))).long()
        assert torch.equal(got, want), (q0, q1, k0, k1, window, pieces)


def test_window_pieces_stay_within_the_band():
    """A window of w over n tokens costs about n*w pairs, not n*n: no piece reaches further back than w."""
    pieces = band_pieces(Span(0, 1000, 0), Span(0, 1000, 0), 64)
    assert UPPER in {p.kind for p in pieces}
    assert sum((p.q.stop - p.q.start) * (p.k.stop - p.k.start) for p in pieces) <= 1000 * 2 * 64


DOCS = [[13, 30, 1, 4, 16], [40, 1, 23]]  # two packed rows of 64 tokens, one-token documents too; mistral window 8


def _packed_batch(spec, generator):
    rows = []
    for lengths in DOCS:
        rows.append([torch.randint(0, spec.vocab_size, (n + 1,), generator=generator) for n in lengths])
    ids = torch.stack([torch.cat([d[:-1] for d in row]) for row in rows])
    labels = torch.stack([torch.cat([d[1:] for d in row]) for row in rows])
    segments = torch.stack([torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in DOCS])
    positions = torch.stack([torch.cat([torch.arange(n) for n in r]) for r in DOCS])
    return rows, ids, labels, segments, positions


@pytest.mark.parametrize("kind", ["qwen2", "mistral", "qwen2_swa", "bloom", "mpt"])
def test_packed_rows_equal_each_document_alone(hf_models, kind):
    """fp32 logits and every parameter gradient of a packed batch equal those of its documents run one by one."""
    model, spec = qlm_from_hf(hf_models[kind])
    assert kind in ("qwen2", "bloom", "mpt") or spec.sliding_window < max(max(r) for r in DOCS)
    docs, ids, labels, segments, positions = _packed_batch(spec, torch.Generator().manual_seed(3))
    params = dict(model.named_parameters())

    logits = model(ids, positions, segment_ids=segments)
    loss = model(ids, positions, segment_ids=segments, labels=labels).sum()
    packed_grads = torch.autograd.grad(loss, list(params.values()))

    alone_logits, alone_loss = [], 0.0
    for row in docs:
        alone_logits.append(torch.cat([model(d[None, :-1])[0] for d in row]))
        alone_loss = alone_loss + sum(model(d[None, :-1], labels=d[None, 1:]).sum() for d in row)
    alone_grads = torch.autograd.grad(alone_loss, list(params.values()))

    assert (logits - torch.stack(alone_logits)).abs().max().item() <= 1e-5
    for name, got, want in zip(params, packed_grads, alone_grads, strict=True):
        assert (got - want).abs().max().item() <= 1e-5 * max(1.0, want.abs().max().item()), name


@pytest.mark.parametrize("kind", ["qwen2", "mistral", "qwen2_swa", "bloom", "mpt"])
def test_padded_decoding_equals_each_row_alone(hf_models, kind):
    """Left-padded prompts (qlm eval's generation) decoded with a KV cache past mistral's window give each row's
    logits as if it ran alone."""
    model, spec = qlm_from_hf(hf_models[kind])
    generator = torch.Generator().manual_seed(4)
    lengths, total, steps = [20, 13, 6], 20, 6
    rows = [torch.randint(0, spec.vocab_size, (n + steps,), generator=generator) for n in lengths]
    ids = torch.zeros(len(rows), total, dtype=torch.long)
    mask = torch.zeros(len(rows), total, dtype=torch.long)
    for i, (row, n) in enumerate(zip(rows, lengths, strict=True)):
        ids[i, total - n:], mask[i, total - n:] = row[:n], 1
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        cache = KVCache.empty(spec.num_layers)
        got = [model(ids, positions, cache=cache, attention_mask=mask)[:, -1]]
        for t in range(steps - 1):
            mask = torch.cat((mask, torch.ones(len(rows), 1, dtype=torch.long)), 1)
            step_ids = torch.stack([row[n + t] for row, n in zip(rows, lengths, strict=True)])[:, None]
            step_pos = torch.tensor([[n + t] for n in lengths])
            got.append(model(step_ids, step_pos, cache=cache, attention_mask=mask)[:, -1])
        for i, (row, n) in enumerate(zip(rows, lengths, strict=True)):
            alone = model(row[None, : n + steps - 1])[0, n - 1 :]
            assert (torch.stack([g[i] for g in got]) - alone).abs().max().item() <= 1e-5


def test_row_runs():
    values = torch.tensor([[0, 0, 1, 1, 1, 2], [5, 5, 5, 5, 5, 5]])
    assert row_runs(values) == [[(0, 2, 0), (2, 5, 1), (5, 6, 2)], [(0, 6, 5)]]


def test_decoding_pieces_cover_exactly_what_decoding_sees():
    """Real queries see the real keys before them (within the window), padding only its own run."""
    valid = torch.tensor([[False, False, True, True, True, True], [True] * 6, [False, True, True, False, True, True]])
    for past, window in ((0, None), (3, None), (0, 2), (4, 3)):
        new = valid.shape[1] - past
        pieces = decoding_pieces(valid, past=past, new=new, window=window)
        for row in range(valid.shape[0]):
            got = _covered([p for p in pieces if p.row in (None, row)], new, valid.shape[1])
            want = torch.zeros_like(got)
            for i in range(new):
                p = past + i
                for j in range(p + 1):
                    near = window is None or p - j < window
                    same_pad_run = not valid[row, p] and not valid[row, j:p + 1].any()
                    want[i, j] = int(near and (bool(valid[row, p] and valid[row, j]) or same_pad_run))
            assert torch.equal(got, want), (row, past, window)


def test_single_token_decoding_is_one_piece():
    """Without padding every row shares one fully visible piece: a single kernel call, nothing to merge; its first
    key lies 9 before its query (ALiBi's shift)."""
    pieces = decoding_pieces(torch.ones(4, 10, dtype=torch.bool), past=9, new=1, window=None)
    assert pieces == [Piece(None, slice(0, 1), slice(0, 10), FULL, -9)]


def test_bad_decoding_and_packing_inputs_are_errors(hf_models):
    model, spec = qlm_from_hf(hf_models["qwen2"])
    ids = torch.zeros(2, 5, dtype=torch.long)
    with pytest.raises(ValueError, match="attention_mask must be"):
        model(ids, attention_mask=torch.ones(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="neither context parallelism nor segment_ids"):
        model(ids, segment_ids=torch.zeros_like(ids), cache=KVCache.empty(spec.num_layers))


SEQ = 8192
SMALL = ModelSpec(
    model_type="qwen2", vocab_size=256, hidden_size=32, ffn_hidden_size=64, num_layers=2, num_attention_heads=4,
    num_query_groups=2, kv_channels=8, max_position_embeddings=SEQ, rope_theta=10000.0, norm_epsilon=1e-6,
    qkv_bias=True, tie_word_embeddings=False,
)


class _LargestTensor(TorchDispatchMode):
    """The most elements of any tensor an operator returns while active, and any that looks like a block of
    attention scores (its last two dims both longer than `block`)."""

    def __init__(self, block: int):
        super().__init__()
        self.block, self.largest, self.op, self.scores = block, 0, None, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if not isinstance(t, torch.Tensor):
                continue
            if t.numel() > self.largest:
                self.largest, self.op = t.numel(), func
            if t.dim() >= 2 and min(t.shape[-2:]) > self.block:
                self.scores.append((func, tuple(t.shape)))
        return out


@pytest.mark.parametrize("window", [None, 512])
def test_packed_forward_backward_creates_nothing_quadratic(window):
    """At s = 8192 with 8 documents, no operator returns (and so nothing saves) a tensor of s*s/4 elements, nor a
    query-block x key-block one."""
    spec = SMALL if window is None else ModelSpec(**{**SMALL.__dict__, "model_type": "mistral", "qkv_bias": False,
                                                     "sliding_window": window})
    model = GPTModel(spec)
    generator = torch.Generator().manual_seed(0)
    lengths = [300, 1700, 900, 1292, 1000, 1500, 500, 1000]
    assert sum(lengths) == SEQ
    ids = torch.randint(0, spec.vocab_size, (1, SEQ), generator=generator)
    segments = torch.repeat_interleave(torch.arange(8), torch.tensor(lengths))[None]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    probe = _LargestTensor(block=512)  # wider than any activation's last two dims (hidden 32, ffn 64, vocab 256)
    with probe:
        loss = model(ids, positions, segment_ids=segments, labels=ids.roll(-1, 1)).mean()
        loss.backward()
    assert model.decoder.layers[0].self_attention.linear_qkv.weight.grad.abs().sum() > 0
    assert probe.largest < SEQ * SEQ // 4, (probe.largest, probe.op)
    assert not probe.scores, probe.scores[:3]  # no per-document score matrix either (the kernels keep tiles)
