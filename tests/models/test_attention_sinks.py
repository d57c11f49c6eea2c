"""Attention sinks (kernels/sinks.py) on every kernel path one process has — pieces of packed documents and windows,
disjoint or merged, stacked or not, the plain causal row, a decoding step's key mask — against gpt-oss's eager
formula in fp64 (transformers' eager_attention_forward: the sink appended to each row's scores, softmax, dropped)."""

from __future__ import annotations

import pytest
import torch

from qlm_core.kernels.attention import masked_attention
from qlm_core.kernels.pieces import Documents, self_attention_pieces
from qlm_core.kernels.piecewise import piecewise_attention
from tests.models.test_attention_kernels import document_mask, make

TOL = 1e-5


def sink_reference(q, k, v, sinks, scale, mask):
    """transformers' own gpt-oss attention (modeling_gpt_oss.eager_attention_forward) in fp64: the sink appended to
    each row's scores, softmax, the sink's column dropped; `mask` [b, 1, sq, sk] bool, True where a key is seen."""
    from types import SimpleNamespace

    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    q, k, v, sinks = (t.double() for t in (q, k, v, sinks))
    module = SimpleNamespace(num_key_value_groups=q.shape[1] // k.shape[1], sinks=sinks, training=False)
    additive = torch.zeros(mask.shape, dtype=torch.float64).masked_fill(~mask, torch.finfo(torch.float64).min)
    out, _ = eager_attention_forward(module, q, k, v, additive, scaling=scale)
    return out.transpose(1, 2)  # [b, sq, h, d] -> [b, h, sq, d]


CASES = {
    "causal": (None, None),
    "documents": (torch.tensor([[0] * 3 + [1] * 9 + [2] * 12, [0] * 24]), None),
    "documents_window": (torch.tensor([[0] * 3 + [1] * 9 + [2] * 12, [0] * 24]), 4),
    "equal_documents": (torch.tensor([[0] * 6 + [1] * 6 + [2] * 6 + [3] * 6, [0] * 12 + [1] * 12]), None),
    "window": (None, 5),
}


@pytest.mark.parametrize("name", CASES)
def test_pieces_with_sinks_match_the_eager_formula(name):
    segment_ids, window = CASES[name]
    q, k, v = make(2, 4, 2, 24, 24, 8, seed=5)
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(6)) * 2
    docs = None if segment_ids is None else Documents.from_segment_ids(segment_ids)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    out = piecewise_attention(*leaves[:3], self_attention_pieces(docs, 24, window), 0.5, leaves[3])
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    out.backward(grad)
    ref = [t.double().requires_grad_() for t in (q, k, v, sinks)]
    mask = document_mask(torch.zeros(2, 24, dtype=torch.long) if segment_ids is None else segment_ids, window)
    ref_out = sink_reference(*ref, 0.5, mask)
    ref_out.backward(grad.double())
    assert (out.double() - ref_out).abs().max() <= TOL
    for got, want in zip(leaves, ref, strict=True):
        assert (got.grad.double() - want.grad).abs().max() <= TOL


def test_sinks_take_weight_from_the_keys():
    """A large sink leaves a query little to spread over its keys: the output shrinks toward 0 (so a test that
    ignored the sinks would fail the comparison above)."""
    q, k, v = make(1, 2, 2, 6, 6, 4, seed=1)
    pieces = self_attention_pieces(None, 6, None)
    plain = piecewise_attention(q, k, v, pieces, 0.5)
    sunk = piecewise_attention(q, k, v, pieces, 0.5, torch.tensor([20.0, -20.0]))
    assert sunk[:, 0].abs().max() < 1e-6 and (sunk[:, 1] - plain[:, 1]).abs().max() < 1e-6


def test_decoding_step_with_sinks():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, h, s, 16, generator=g) for h, s in ((4, 1), (2, 10), (2, 10)))
    sinks = torch.randn(4, generator=g)
    key_mask = torch.rand(3, 1, 1, 10, generator=g) > 0.3
    key_mask[:, ..., -1] = True
    out = masked_attention(q, k, v, key_mask, 0.25, sinks)
    ref = sink_reference(q, k, v, sinks, 0.25, key_mask)
    assert (out.double() - ref).abs().max() <= TOL


def test_a_model_with_sinks_decodes_as_it_runs_whole():
    """The plain row (one causal piece), packed documents and a KV cache's prefill and steps (the decoding key mask)
    give the same logits; the sink logits are Megatron's core_attention.softmax_offset, one per head, and move the
    logits (a model that ignored them would give its sink-free logits)."""
    from helpers import cached_logits

    from qlm_core.models import load_model_spec
    from qlm_core.models.gpt import GPTModel

    spec = load_model_spec("qlm-tiny").replace(attention_sinks=True)
    torch.manual_seed(0)
    model = GPTModel(spec).eval()
    offsets = [n for n in model.state_dict() if n.endswith("softmax_offset")]
    assert offsets == [f"decoder.layers.{i}.self_attention.core_attention.softmax_offset" for i in range(4)]
    with torch.no_grad():
        for layer in model.decoder.layers:
            layer.self_attention.core_attention.softmax_offset.copy_(torch.randn(4) * 2)
        ids = torch.randint(0, spec.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
        whole = model(ids)
        assert (model(ids, segment_ids=torch.zeros_like(ids)) - whole).abs().max() <= TOL
        assert (cached_logits(model, ids, 16) - whole).abs().max() <= TOL
        for layer in model.decoder.layers:
            layer.self_attention.core_attention.softmax_offset.fill_(-1e4)  # sinks that take nothing
        plain = GPTModel(spec.replace(attention_sinks=False)).eval()
        plain.load_state_dict({n: t for n, t in model.state_dict().items() if not n.endswith("softmax_offset")},
                              strict=False)
        assert (model(ids) - plain(ids)).abs().max() <= TOL
        assert (whole - plain(ids)).abs().max() > 1e-3


def test_sinks_round_trip_megatron_args_and_are_refused_where_nothing_reads_them():
    """softmax_type "learnable" in a Megatron checkpoint's args means sinks and back; "off-by-one" (a fixed sink
    qlm does not build) is refused in one line, and so are an HF config.json that would drop the sinks (no family
    here reads them from config.json yet) and sinks on multi-latent attention (which has no softmax_offset)."""
    import argparse

    from qlm_core.checkpoint.formats.megatron.args import make_args, spec_from_args
    from qlm_core.errors import QlmError
    from qlm_core.models import load_model_spec
    from qlm_core.models.layout import ModelLayout

    spec = load_model_spec("qlm-tiny").replace(attention_sinks=True)
    args = make_args(ModelLayout(spec), torch.float32)
    assert args.softmax_type == "learnable" and spec_from_args(args).attention_sinks
    assert make_args(ModelLayout(spec.replace(attention_sinks=False)), torch.float32).softmax_type == "vanilla"
    with pytest.raises(QlmError, match="softmax_type 'off-by-one'"):
        spec_from_args(argparse.Namespace(**{**vars(args), "softmax_type": "off-by-one"}))
    with pytest.raises(QlmError, match="attention_sinks has no Hugging Face config"):
        spec.to_hf_config()
    with pytest.raises(QlmError, match="attention sinks with 'mla'"):
        load_model_spec("qlm-tiny-mla").replace(attention_sinks=True)


def test_sinks_in_bf16_round_once():
    """The sinks rescale the fp32 accumulator before the output's one bf16 rounding: as close to the fp64 result
    as the sink-free bf16 attention is to its own (rescaling the rounded output rounded twice: ~1.2x further)."""
    q, k, v = make(2, 8, 8, 256, 256, 64, seed=3)
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(4))
    pieces = self_attention_pieces(None, 256, None)

    def error(with_sinks):
        s = sinks if with_sinks else None
        exact = piecewise_attention(q.double(), k.double(), v.double(), pieces, 0.125,
                                    None if s is None else s.double())
        ours = piecewise_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), pieces, 0.125, s)
        return ((ours.double() - exact).abs() / exact.abs().clamp(min=1e-3)).median()

    assert error(True) <= 1.1 * error(False)
