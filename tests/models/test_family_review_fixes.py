"""What the families' review found: transformers' own defaults and classes are the reference for each decision."""

import argparse

import pytest
import torch
import transformers
import yaml

from qlm_core.checkpoint.formats.megatron.args import make_args, spec_from_args
from qlm_core.checkpoint.formats.megatron.bridge_config import bridge_args
from qlm_core.errors import QlmError
from qlm_core.models.layout import ModelLayout
from qlm_core.models.moe_spec import MoeSpec
from qlm_core.models.presets import PRESETS
from qlm_core.models.spec import ModelSpec


@pytest.mark.parametrize("preset", ["opt-1.3b", "gemma-3-1b", "ernie-4.5-21b-a3b", "ernie-4.5-0.3b", "bloom-560m",
                                    "gemma-2-2b"])
def test_a_config_without_tie_word_embeddings_ties_as_transformers_does(preset):
    config = PRESETS[preset].to_hf_config()
    del config["tie_word_embeddings"]  # transformers 4.x leaves a default out of a saved config.json
    assert transformers.AutoConfig.for_model(**config).tie_word_embeddings
    assert ModelSpec.from_hf_config(config).tie_word_embeddings


def _bridge(tmp_path, **model):
    config = {"num_layers": 2, "hidden_size": 32, "ffn_hidden_size": 64, "num_attention_heads": 4,
              "vocab_size": 100, "normalization": "RMSNorm", "position_embedding_type": "rope", **model}
    path = tmp_path / "run_config.yaml"
    path.write_text(yaml.safe_dump({"model": config}))
    return bridge_args(path)


def test_bridge_activations_are_read_as_what_they_are(tmp_path):
    assert spec_from_args(_bridge(tmp_path, gated_linear_unit=True)).activation == "swiglu"
    relu = _bridge(tmp_path, gated_linear_unit=False, activation_func="torch.nn.functional.relu")
    assert relu.qlm_relu and not relu.swiglu
    assert spec_from_args(_bridge(tmp_path, gated_linear_unit=False,
                                  activation_func="torch.nn.functional.gelu")).activation == "gelu"
    with pytest.raises(QlmError, match="not an MLP qlm builds"):
        _bridge(tmp_path, gated_linear_unit=True, activation_func="torch.nn.functional.gelu")  # gated erf GELU


def test_megatron_learned_positions_need_qlm_s_model_type():
    args = make_args(ModelLayout(PRESETS["opt-1.3b"]), torch.float32)
    assert spec_from_args(args) == PRESETS["opt-1.3b"].replace(bos_token_id=None, eos_token_id=None)  # not args
    foreign = argparse.Namespace(**{k: v for k, v in vars(args).items() if k != "qlm_model_type"})
    with pytest.raises(QlmError, match="learned_absolute positions"):
        spec_from_args(foreign)


def test_an_export_refuses_a_choice_the_family_s_class_cannot_hold():
    llama = PRESETS["llama3-8b"]
    for changed in (llama.replace(norm="layernorm"), llama.replace(activation="gelu"),
                    PRESETS["gemma-3-1b"].replace(scaled_embedding=False)):
        with pytest.raises(QlmError, match="has no Hugging Face config"):
            changed.to_hf_config()


def test_a_sigmoid_router_keeps_pre_softmax_with_its_bias():
    """Megatron ignores moe_router_pre_softmax under sigmoid scores (Megatron-Bridge providers set both)."""
    MoeSpec(8, 2, 32, pre_softmax=True, score_function="sigmoid", expert_bias=True)
    with pytest.raises(QlmError, match="pre-softmax"):
        MoeSpec(8, 2, 32, pre_softmax=True, expert_bias=True)
