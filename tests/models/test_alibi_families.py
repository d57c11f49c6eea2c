"""BLOOM (`bloom`) and MPT (`mpt`), the ALiBi families, through the verbs besides the shared family tests
(test_model.py, test_packed_attention.py, test_convert.py, test_torch_dist.py, test_eval.py, test_deepspeed.py):
greedy decoding, Megatron's names and args, and what qlm refuses."""

from __future__ import annotations

import pytest
import torch
from conftest import make_hf_model
from helpers import assert_greedy_generate_equals_transformers, assert_sft_then_lora_export_equals_transformers

from qlm_core.errors import QlmError
from qlm_core.models.layout import ModelLayout
from qlm_core.models.spec import ModelSpec


@pytest.mark.parametrize("kind", ["bloom", "mpt"])
def test_greedy_generate_equals_transformers(tmp_path, kind):
    """`qlm generate` of a left-padded batch (ALiBi over a KV cache: the decoding key mask's bias) as transformers'
    generate (BLOOM's ALiBi counts positions from each row's first real token, MPT's from the cache's first)."""
    path = tmp_path / "model"
    model = make_hf_model(path, kind, initializer_range=0.2)  # not one token repeated
    assert_greedy_generate_equals_transformers(path, model, max_new_tokens=12)


def test_megatron_names_and_args_round_trip(hf_models):
    """The embedding's norm is Megatron-DeepSpeed's `embedding.word_embeddings.norm`, query_key_value is linear_qkv
    as it lies (head by head), and the args say ALiBi, --openai-gelu, --embed-layernorm, LayerNorm and biases; read
    back they give the same spec."""
    from qlm_core.checkpoint.formats.hf.checkpoint import HFCheckpoint
    from qlm_core.checkpoint.formats.megatron.args import make_args, spec_from_args

    spec = HFCheckpoint(hf_models["bloom"]).spec
    layout = ModelLayout(spec, tp=2)
    names = [name for name, _ in layout.shard_entries(0)]
    assert names[:3] == ["embedding.word_embeddings.weight", "embedding.word_embeddings.norm.weight",
                         "embedding.word_embeddings.norm.bias"]
    qkv = next(t for n, t in layout.shard_entries(0) if n == "decoder.layers.0.self_attention.linear_qkv.weight")
    assert [(s.start, s.stop, s.hf_name, s.hf_start) for s in qkv.segments] == [
        (0, 288, "transformer.h.0.self_attention.query_key_value.weight", 0)]
    args = make_args(layout, torch.float32)
    assert (args.position_embedding_type, args.openai_gelu, args.embed_layernorm, args.normalization,
            args.add_bias_linear) == ("alibi", True, True, "LayerNorm", True)
    assert spec_from_args(args) == spec.replace(bos_token_id=None, eos_token_id=None)  # the tokenizer's, not args'


def test_configs_bloom_cannot_hold_are_refused(hf_models):
    """An MLP other than 4 h wide, or no embedding norm, has no BLOOM config.json; a config.json with the residual
    after the norm (apply_residual_connection_post_layernorm) is refused in one line."""
    from qlm_core.checkpoint.formats.hf.checkpoint import HFCheckpoint, read_config

    spec = HFCheckpoint(hf_models["bloom"]).spec
    with pytest.raises(QlmError, match="MLP width"):
        spec.replace(ffn_hidden_size=100).to_hf_config()
    with pytest.raises(QlmError, match="embedding_norm"):
        spec.replace(embedding_norm=False).to_hf_config()
    config = read_config(hf_models["bloom"])
    with pytest.raises(QlmError, match="apply_residual_connection_post_layernorm"):
        ModelSpec.from_hf_config({**config, "apply_residual_connection_post_layernorm": True})


def test_released_bloom_and_mpt_configs_read_as_transformers_reads_them(tmp_path):
    """BLOOM-176B's config.json spells the width n_embed; MosaicML's MPT configs leave layer_norm_epsilon out
    (transformers' default 1e-5, not qlm's RMSNorm default) and BLOOM's have no context length (its trained 2048)."""
    import json

    import transformers

    from qlm_core.checkpoint.formats.hf.checkpoint import read_config

    bloom = {"model_type": "bloom", "vocab_size": 300, "n_embed": 96, "n_layer": 2, "num_attention_heads": 12}
    (tmp_path / "config.json").write_text(json.dumps(bloom))
    spec = ModelSpec.from_hf_config(read_config(tmp_path))
    theirs = transformers.BloomConfig(**{k: v for k, v in bloom.items() if k != "model_type"})
    assert (spec.hidden_size, spec.ffn_hidden_size, spec.norm_epsilon, spec.max_position_embeddings) == (
        theirs.hidden_size, 4 * theirs.hidden_size, theirs.layer_norm_epsilon, 2048)
    mpt = {"model_type": "mpt", "vocab_size": 300, "d_model": 64, "n_heads": 4, "n_layers": 2, "max_seq_len": 512}
    spec = ModelSpec.from_hf_config(mpt)
    assert (spec.norm_epsilon, spec.max_position_embeddings) == (transformers.MptConfig().layer_norm_epsilon, 512)


def test_mpt_names_args_and_refusals(hf_models):
    """MPT's Wqkv is [every q; every k; every v] (each Megatron head's rows come from three places), its LayerNorms
    have no bias (qlm's arg qlm_layernorm_no_bias: Megatron's LayerNorm always has one), and the args read back to
    the same spec; attn_config values transformers' MPT does not run (clip_qkv) are refused in one line."""
    from qlm_core.checkpoint.formats.hf.checkpoint import HFCheckpoint, read_config
    from qlm_core.checkpoint.formats.megatron.args import make_args, spec_from_args

    spec = HFCheckpoint(hf_models["mpt"]).spec
    layout = ModelLayout(spec, tp=2)
    qkv = next(t for n, t in layout.shard_entries(0) if n == "decoder.layers.0.self_attention.linear_qkv.weight")
    assert [(s.start, s.hf_start) for s in qkv.segments[:6]] == [(0, 0), (16, 64), (32, 128), (48, 16), (64, 80),
                                                                 (80, 144)]
    assert {s.hf_name for s in qkv.segments} == {"transformer.blocks.0.attn.Wqkv.weight"}
    names = [name for name, _ in layout.shard_entries(0)]
    assert "decoder.layers.0.input_layernorm.weight" in names and "decoder.layers.0.input_layernorm.bias" not in names
    args = make_args(layout, torch.float32)
    assert (args.normalization, args.qlm_layernorm_no_bias, args.position_embedding_type) == ("LayerNorm", True,
                                                                                              "alibi")
    assert spec_from_args(args) == spec.replace(bos_token_id=None, eos_token_id=None)
    config = read_config(hf_models["mpt"])
    with pytest.raises(QlmError, match="attn_config.clip_qkv"):
        ModelSpec.from_hf_config({**config, "attn_config": {**config["attn_config"], "clip_qkv": 6.0}})
    with pytest.raises(QlmError, match="expansion_ratio"):
        ModelSpec.from_hf_config({**config, "expansion_ratio": 2})
    for key, value in (("qk_ln", True), ("alibi_bias_max", 16), ("attn_type", "multiquery_attention")):
        with pytest.raises(QlmError, match=f"attn_config.{key}"):
            ModelSpec.from_hf_config({**config, "attn_config": {**config["attn_config"], key: value}})


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["bloom", "mpt"])
def test_qlm_train_sft_dpo_then_lora_and_export(tmp_path, kind):
    """`qlm train`: SFT of a tiny BLOOM / MPT on packed documents (its loss falls), DPO from that run on the demo's
    preference pairs (its loss falls), LoRA on its fused q/k/v and its output projection from the SFT run, and the
    merged export loads in transformers with qlm's logits."""
    assert_sft_then_lora_export_equals_transformers(tmp_path, kind, dpo=True)
