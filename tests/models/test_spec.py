"""ModelSpec from HF configs (transformers 4.x and 5.x shapes) and presets."""

import json

import pytest
import transformers
from conftest import MODEL_KINDS, TINY

from qlm_core.errors import QlmError
from qlm_core.models import ModelSpec, load_model_spec
from qlm_core.models.parameters import num_parameters
from qlm_core.models.presets import PRESETS

# Parameter counts published on the models' cards / config-derived totals.
PUBLISHED = {
    "qwen2-0.5b": 494_032_768, "qwen2-1.5b": 1_543_714_304, "qwen2-7b": 7_615_616_512,
    "qwen2-72b": 72_706_203_648, "llama2-7b": 6_738_415_616, "llama3-8b": 8_030_261_248,
    "llama3-70b": 70_553_706_496, "mistral-7b": 7_241_732_096,
    # transformers' count of the released configs
    "glm-4-9b": 9_399_951_360, "glm-4-9b-0414": 9_400_279_040, "ernie-4.5-0.3b": 360_748_032,
    "gemma-3-1b": 999_885_952, "opt-1.3b": 1_315_758_080, "bloom-560m": 559_214_592, "bloom-7b1": 7_069_016_064,
    "bloom-176b": 176_247_271_424, "mpt-7b": 6_649_286_656, "mpt-30b": 29_957_200_896,
    "gemma-2-2b": 2_614_341_888, "gemma-2-9b": 9_241_705_984, "gemma-2-27b": 27_227_128_320,
}


@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_spec_from_transformers_config_counts_parameters(kind):
    model_type, extra = MODEL_KINDS[kind]
    config = transformers.AutoConfig.for_model(model_type, **{**TINY, **extra})
    model = transformers.AutoModelForCausalLM.from_config(config)
    spec = ModelSpec.from_hf_config(config.to_dict())
    assert num_parameters(spec) == sum(p.numel() for p in model.parameters())
    assert spec.qkv_bias == any(name.endswith(("q_proj.bias", "query_key_value.bias"))
                                for name, _ in model.named_parameters())
    mha = model_type in ("opt", "bloom", "mpt")  # multi-head attention whatever num_key_value_heads says
    heads = config.num_attention_heads
    assert spec.num_query_groups == (heads if mha else 2) and spec.kv_channels == config.hidden_size // heads


def test_rope_theta_read_from_4x_and_5x_configs():
    legacy = {**TINY, "model_type": "llama", "intermediate_size": 96, "num_hidden_layers": 4,
              "rope_theta": 500000.0, "rope_scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                       "high_freq_factor": 4.0,
                                                       "original_max_position_embeddings": 8192}}
    new = {k: v for k, v in legacy.items() if k not in ("rope_theta", "rope_scaling")}
    new["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    a, b = ModelSpec.from_hf_config(legacy), ModelSpec.from_hf_config(new)
    assert a == b and a.rope_theta == 500000.0 and a.rope_scaling.factor == 8.0


def test_to_hf_config_round_trips_through_transformers(tmp_path):
    spec = PRESETS["llama3.1-8b"]
    (tmp_path / "config.json").write_text(json.dumps(spec.to_hf_config()))
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    assert ModelSpec.from_hf_config(config.to_dict()) == spec


@pytest.mark.parametrize("name,count", PUBLISHED.items())
def test_presets_match_published_parameter_counts(name, count):
    assert num_parameters(load_model_spec(name)) == count


def test_unsupported_model_type_names_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(QlmError, match="qwen2, llama, mistral"):
        load_model_spec(tmp_path)


def test_unknown_preset_lists_presets():
    with pytest.raises(QlmError, match="qwen2-7b"):
        load_model_spec("qwen3-1000b")


@pytest.mark.parametrize("change, message", [
    ({"hidden_size": None}, r"config.json \(qwen2\): has no hidden_size; use a complete config.json"),
    ({"num_attention_heads": "4"}, r"num_attention_heads is '4', not a positive integer"),
    ({"num_hidden_layers": 0}, r"num_hidden_layers is 0, not a positive integer"),
])
def test_an_incomplete_hf_config_is_named_not_a_key_error(change, message):
    config = {"model_type": "qwen2", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4}
    config.update(change)
    config = {k: v for k, v in config.items() if v is not None}
    with pytest.raises(QlmError, match=message):
        ModelSpec.from_hf_config(config)


def test_learned_positions_refuse_longer_sequences():
    """OPT's table has no row past max_position_embeddings: a longer sequence is refused in one line."""
    PRESETS["opt-1.3b"].check_positions(2048)
    with pytest.raises(QlmError, match="longer than the model's 2048 learned positions"):
        PRESETS["opt-1.3b"].check_positions(4096)
    PRESETS["llama3-8b"].check_positions(100_000)  # RoPE extrapolates (a warning elsewhere), no error
