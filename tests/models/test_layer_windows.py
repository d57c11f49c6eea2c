"""Sliding windows on some layers only (Qwen2's use_sliding_window with max_window_layers / layer_types; Megatron's
window_attn_skip_freq): read from config.json as transformers reads it, written back, carried through Megatron's
args with Megatron's window convention, and counted per layer."""

from __future__ import annotations

import argparse

import pytest
import torch
import transformers
from conftest import TINY

from qlm_core.checkpoint.formats.megatron.args import make_args, spec_from_args
from qlm_core.errors import QlmError
from qlm_core.models.flops import model_layer_flops_per_token
from qlm_core.models.layout import ModelLayout
from qlm_core.models.spec import ModelSpec

QWEN2_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)


@pytest.mark.parametrize("model_type,extra", [
    ("qwen2", dict(max_window_layers=1)),
    ("qwen3", dict(max_window_layers=3)),
    ("qwen2_moe", dict(QWEN2_MOE, max_window_layers=3)),  # its own rule: odd-numbered layers below max_window_layers
    ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)),  # every layer
    ("qwen2", dict(layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"])),
])
def test_windowed_layers_are_those_transformers_windows(model_type, extra):
    config = transformers.AutoConfig.for_model(model_type, **{**TINY, "use_sliding_window": True,
                                                              "sliding_window": 8, **extra})
    model = transformers.AutoModelForCausalLM.from_config(config)
    expected = tuple(getattr(layer.self_attn, "sliding_window", None) or None for layer in model.model.layers)
    spec = ModelSpec.from_hf_config(config.to_dict())
    assert spec.windows == expected and 8 in expected
    assert ModelSpec.from_hf_config(spec.to_hf_config()) == spec


def test_config_without_use_sliding_window_has_no_window():
    spec = ModelSpec.from_hf_config({"model_type": "qwen2", **TINY, "sliding_window": 8, "use_sliding_window": False})
    assert spec.sliding_window is None and spec.windows == (None,) * 4


def test_window_layers_settle_and_refuse():
    base = ModelSpec.from_hf_config({"model_type": "qwen2", **TINY})
    assert base.replace(sliding_window=8, window_layers=(True,) * 4).window_layers is None  # every layer: plain
    assert base.replace(sliding_window=8, window_layers=(False,) * 4).sliding_window is None  # none: no window
    with pytest.raises(QlmError, match="one true/false per layer"):
        base.replace(sliding_window=8, window_layers=(True, False))
    with pytest.raises(QlmError, match="without a sliding_window"):
        base.replace(window_layers=(True, False, True, False))
    mistral = ModelSpec.from_hf_config({"model_type": "mistral", **TINY, "sliding_window": 8})
    with pytest.raises(QlmError, match="no Hugging Face config"):
        mistral.replace(window_layers=(True, False, True, False)).to_hf_config()
    llama = ModelSpec.from_hf_config({"model_type": "llama", **TINY})
    with pytest.raises(QlmError, match="no Hugging Face config"):
        llama.replace(sliding_window=8).to_hf_config()


def _qwen2_windows(pattern):
    return ModelSpec.from_hf_config({"model_type": "qwen2", **TINY, "use_sliding_window": True, "sliding_window": 8,
                                     "layer_types": ["sliding_attention" if w else "full_attention" for w in pattern]})


def test_megatron_args_carry_the_windows_in_megatrons_convention():
    spec = _qwen2_windows([False, True, True, False])
    args = make_args(ModelLayout(spec), torch.float32)
    # Megatron's (left, 0) sees `left` earlier keys and the query itself: HF's window of 8 is (7, 0)
    assert tuple(args.window_size) == (7, 0) and args.window_attn_skip_freq == [0, 1, 1, 0]
    assert spec_from_args(args) == spec
    mistral = ModelSpec.from_hf_config({"model_type": "mistral", **TINY, "sliding_window": 8})
    args = make_args(ModelLayout(mistral), torch.float32)
    assert tuple(args.window_size) == (7, 0) and args.window_attn_skip_freq is None
    assert spec_from_args(args) == mistral


def test_megatron_lm_window_args_read_as_megatron_core_applies_them():
    spec = _qwen2_windows([True] * 4)
    args = vars(make_args(ModelLayout(spec), torch.float32))
    for key in ("qlm_sliding_window", "qlm_model_type"):
        args.pop(key)
    args["qlm_model_type"] = "qwen2"  # qlm before qlm_sliding_window: it wrote the window itself as `left`
    read = spec_from_args(argparse.Namespace(**{**args, "window_size": (8, 0)}))
    assert read.sliding_window == 8
    args.pop("qlm_model_type")  # Megatron-LM's own: (left, 0) is left + 1 keys; every 2nd layer full
    read = spec_from_args(argparse.Namespace(**{**args, "window_size": (4095, 0), "window_attn_skip_freq": 2}))
    assert read.sliding_window == 4096 and read.window_layers == (True, False, True, False)
    with pytest.raises(QlmError, match="later keys"):
        spec_from_args(argparse.Namespace(**{**args, "window_size": (7, 3)}))
    with pytest.raises(QlmError, match="window_attn_skip_freq"):
        spec_from_args(argparse.Namespace(**{**args, "window_size": (7, 0), "window_attn_skip_freq": [1, 0]}))


def test_flops_count_each_layers_own_window():
    full = ModelSpec.from_hf_config({"model_type": "qwen2", **TINY})
    half = _qwen2_windows([False, True, False, True])
    seq = 4096
    per_layer = {spec: model_layer_flops_per_token(spec, seq) / 4 for spec in (full, half)}
    windowed = model_layer_flops_per_token(full.replace(sliding_window=8), seq) / 4
    assert per_layer[half] == pytest.approx((per_layer[full] + windowed) / 2)
    # a decoding step's token reads every cached key its layer's window reaches
    decode = model_layer_flops_per_token(half, seq, keys=seq)
    assert decode == pytest.approx((model_layer_flops_per_token(full, seq, keys=seq)
                                    + model_layer_flops_per_token(full, seq, keys=8)) / 2)
