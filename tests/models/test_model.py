"""The one decoder against transformers, and its state_dict against the checkpoint layout."""

import pytest
import torch
import torch.nn.functional as F
import transformers
from conftest import MODEL_KINDS
from helpers import cached_logits, qlm_from_hf

from qlm_core.checkpoint.formats.hf.checkpoint import HFCheckpoint
from qlm_core.models.gpt import GPTModel
from qlm_core.models.layout import ModelLayout


@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_logits_and_loss_equal_transformers(hf_models, kind):
    model, spec = qlm_from_hf(hf_models[kind])
    reference = transformers.AutoModelForCausalLM.from_pretrained(hf_models[kind], dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, spec.vocab_size, (2, 40), generator=generator)  # 40 > mistral's window of 8
    labels = torch.randint(0, spec.vocab_size, (2, 40), generator=generator)
    with torch.no_grad():
        expected = reference(ids).logits
        assert (model(ids) - expected).abs().max().item() <= 1e-5
        expected_loss = F.cross_entropy(expected.flatten(0, 1), labels.flatten(), reduction="none").view(2, 40)
        assert (model(ids, labels=labels) - expected_loss).abs().max().item() <= 1e-5


@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_packed_and_cached_paths_equal_transformers(hf_models, kind):
    """The masks built for packed documents and for decoding with a KV cache keep Mistral's sliding window."""
    model, spec = qlm_from_hf(hf_models[kind])
    reference = transformers.AutoModelForCausalLM.from_pretrained(hf_models[kind], dtype=torch.float32).eval()
    ids = torch.randint(0, spec.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(ids).logits
        one_document = model(ids, segment_ids=torch.zeros_like(ids))
        assert (one_document - expected).abs().max().item() <= 1e-5
        assert (cached_logits(model, ids, 30) - expected).abs().max().item() <= 1e-5


def test_loss_gradient_matches_transformers(hf_models):
    model, spec = qlm_from_hf(hf_models["qwen2"])
    reference = transformers.AutoModelForCausalLM.from_pretrained(hf_models["qwen2"], dtype=torch.float32)
    ids = torch.randint(0, spec.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    model(ids[:, :-1], labels=ids[:, 1:]).mean().backward()
    F.cross_entropy(reference(ids[:, :-1]).logits.flatten(0, 1), ids[:, 1:].flatten()).backward()
    ours = model.decoder.layers[0].mlp.linear_fc2.weight.grad
    theirs = reference.model.layers[0].mlp.down_proj.weight.grad
    assert torch.allclose(ours, theirs, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("kind", ["qwen2", "qwen2_tied"])
@pytest.mark.parametrize("pp,vpp,first,last", [(1, 1, None, None), (2, 1, None, None), (2, 2, None, None),
                                               (3, 1, 2, None), (2, 1, 1, None)])
def test_stage_state_dict_is_the_megatron_shard(hf_models, kind, pp, vpp, first, last):
    """Names, order and shapes of every stage model's state_dict equal the layout's shard entries."""
    spec = HFCheckpoint(hf_models[kind]).spec
    layout = ModelLayout(spec, 1, pp, vpp, first, last)
    for stage in range(pp):
        for chunk in range(vpp):
            layers = layout.chunk_layers(stage, chunk)
            model = GPTModel(spec, pre_process=layout.is_first(stage, chunk), post_process=layout.is_last(stage, chunk),
                             layer_offset=layers.start, num_layers=len(layers), padded_vocab=layout.padded_vocab)
            state = model.state_dict()
            entries = layout.shard_entries(stage, chunk)
            assert list(state) == [name for name, _ in entries]
            for name, tensor in entries:
                assert (state[name] is None) == (tensor is None)
                if tensor is not None:
                    assert tuple(state[name].shape) == tensor.shard_shape(1)


def test_opt_release_keys_without_the_model_prefix(hf_models, tmp_path):
    """OPT's releases were saved from OPTModel (keys `decoder.*`, no lm_head): read as transformers reads them."""
    import shutil

    from safetensors.torch import load_file, save_file

    src = hf_models["opt"]
    shutil.copytree(src, tmp_path / "opt")
    tensors = load_file(src / "model.safetensors")
    save_file({name.removeprefix("model."): t for name, t in tensors.items() if name != "lm_head.weight"},
              tmp_path / "opt" / "model.safetensors", metadata={"format": "pt"})
    model, spec = qlm_from_hf(tmp_path / "opt")
    reference = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    ids = torch.randint(0, spec.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (model(ids) - reference(ids).logits).abs().max().item() <= 1e-5
    assert "model.decoder.embed_positions.weight" in HFCheckpoint(tmp_path / "opt").names
