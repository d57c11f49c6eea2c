"""Gemma 2 (`gemma2`) besides the shared family tests (test_model.py, test_convert.py, test_eval.py, ...): its
soft-capped attention on every kernel path one process has, against transformers' own eager formula in fp64; the
soft-capped logits through the chunked loss; and that the caps bind on the tiny model (decoding:
tests/eval/test_eval_prefix.py)."""

from __future__ import annotations

import pytest
import torch
from helpers import qlm_from_hf

from qlm_core.kernels.alibi import tiles
from qlm_core.kernels.attention import masked_attention
from qlm_core.kernels.pieces import Documents, self_attention_pieces
from qlm_core.kernels.piecewise import piecewise_attention
from tests.models.test_attention_kernels import document_mask, make

TOL = 1e-5


def softcap_reference(q, k, v, cap, scale, mask):
    """transformers' Gemma 2 attention (modeling_gemma2.eager_attention_forward) in fp64; `mask` [b, 1, sq, sk]
    bool, True where a key is seen."""
    from types import SimpleNamespace

    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    q, k, v = (t.double() for t in (q, k, v))
    module = SimpleNamespace(num_key_value_groups=q.shape[1] // k.shape[1], training=False)
    additive = torch.zeros(mask.shape, dtype=torch.float64).masked_fill(~mask, torch.finfo(torch.float64).min)
    out, _ = eager_attention_forward(module, q, k, v, additive, scaling=scale, softcap=cap)
    return out.transpose(1, 2)


CASES = {
    "causal": (None, None),
    "documents": (torch.tensor([[0] * 3 + [1] * 9 + [2] * 12, [0] * 24]), None),
    "documents_window": (torch.tensor([[0] * 3 + [1] * 9 + [2] * 12, [0] * 24]), 4),
    "equal_documents": (torch.tensor([[0] * 6 + [1] * 6 + [2] * 6 + [3] * 6, [0] * 12 + [1] * 12]), None),
}


@pytest.mark.parametrize("edge", [5, 512])
@pytest.mark.parametrize("name", CASES)
def test_soft_capped_tiles_match_transformers_formula(name, edge):
    segment_ids, window = CASES[name]
    q, k, v = make(2, 4, 2, 24, 24, 8, seed=5)
    q = q * 3  # scores past the cap of 2
    docs = None if segment_ids is None else Documents.from_segment_ids(segment_ids)
    pieces = tiles(self_attention_pieces(docs, 24, window), edge)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = piecewise_attention(*leaves, pieces, 0.5, softcap=2.0)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    out.backward(grad)
    ref = [t.double().requires_grad_() for t in (q, k, v)]
    mask = document_mask(torch.zeros(2, 24, dtype=torch.long) if segment_ids is None else segment_ids, window)
    ref_out = softcap_reference(*ref, 2.0, 0.5, mask)
    ref_out.backward(grad.double())
    assert (out.double() - ref_out).abs().max() <= TOL
    for got, want in zip(leaves, ref, strict=True):
        assert (got.grad.double() - want.grad).abs().max() <= TOL
    uncapped = piecewise_attention(q, k, v, pieces, 0.5)  # the cap binds: a test that dropped it fails
    assert (uncapped.double() - ref_out).abs().max() > 1e-2


def test_decoding_step_with_softcap():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, h, s, 16, generator=g) for h, s in ((4, 1), (2, 10), (2, 10)))
    key_mask = torch.rand(3, 1, 1, 10, generator=g) > 0.3
    key_mask[:, ..., -1] = True
    out = masked_attention(q * 3, k, v, key_mask, 0.25, softcap=2.0)
    assert (out.double() - softcap_reference(q * 3, k, v, 2.0, 0.25, key_mask)).abs().max() <= TOL


def test_chunked_loss_soft_caps_as_the_whole_logits(hf_models):
    """The loss head chunk by chunk (its own backward, soft-capped) gives the whole logits' soft-capped loss and
    gradients; both caps bind on the tiny model (without them the logits move)."""
    model, spec = qlm_from_hf(hf_models["gemma2"])
    ids = torch.randint(0, spec.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    labels = ids.roll(-1, 1)
    params = [p for p in model.parameters()]
    model.loss_chunk_tokens = 0
    whole = model(ids, labels=labels).sum()
    want = torch.autograd.grad(whole, params)
    for chunk in (7, 16):
        model.loss_chunk_tokens = chunk
        chunked = model(ids, labels=labels).sum()
        got = torch.autograd.grad(chunked, params)
        assert (chunked - whole).abs() <= 1e-5 * whole.abs()
        for a, b in zip(got, want, strict=True):
            assert (a - b).abs().max() <= 1e-5 * max(1.0, b.abs().max().item())
    with torch.no_grad():
        logits = model(ids)
        assert logits.abs().max() <= spec.logit_softcap
        for field in ("attention_softcap", "logit_softcap"):
            model.spec = spec.replace(**{field: None})
            for layer in model.decoder.layers:
                layer.self_attention.spec = model.spec
            assert (model(ids) - logits).abs().max() > 1e-3, field
        model.spec = spec



@pytest.mark.slow
def test_qlm_train_sft_dpo_then_lora_and_export(tmp_path):
    """`qlm train` of a tiny Gemma 2: SFT and DPO lower their losses through both soft-caps, and LoRA from the SFT
    run exports merged with qlm's logits in transformers."""
    from helpers import assert_sft_then_lora_export_equals_transformers

    assert_sft_then_lora_export_equals_transformers(tmp_path, "gemma2", dpo=True)


def test_configs_read_and_write_as_transformers_does(hf_models):
    """Keys a Gemma 2 config.json leaves out take Gemma2Config's defaults (a window of 4096, caps of 50 and 30); a
    spec without a window exports every layer as full attention (Gemma2Config would window the even ones); RL at a
    temperature other than 1 is refused on a soft-capped model (the trainer scales the final norm's output, which
    the cap does not commute with)."""
    import transformers

    from qlm_core.checkpoint.formats.hf.checkpoint import read_config
    from qlm_core.errors import QlmError
    from qlm_core.models.presets import PRESETS
    from qlm_core.models.spec import ModelSpec
    from qlm_core.train.validate import validate_rl_model

    config = {k: v for k, v in read_config(hf_models["gemma2"]).items()
              if k not in ("sliding_window", "attn_logit_softcapping", "final_logit_softcapping", "layer_types")}
    spec = ModelSpec.from_hf_config(config)
    theirs = transformers.AutoConfig.for_model(**config)
    assert (spec.sliding_window, spec.attention_softcap, spec.logit_softcap) == (
        theirs.sliding_window, theirs.attn_logit_softcapping, theirs.final_logit_softcapping) == (4096, 50.0, 30.0)
    assert spec.window_layers == (True, False, True, False)
    plain = PRESETS["gemma-2-2b"].replace(sliding_window=None, window_layers=None)
    exported = transformers.AutoConfig.for_model(**plain.to_hf_config())
    assert set(exported.layer_types) == {"full_attention"}
    assert ModelSpec.from_hf_config(plain.to_hf_config()).sliding_window is None
    validate_rl_model(PRESETS["gemma-2-2b"], 1.0)
    with pytest.raises(QlmError, match="rl.temperature = 0.7 on a model whose logits are soft-capped"):
        validate_rl_model(PRESETS["gemma-2-2b"], 0.7)
