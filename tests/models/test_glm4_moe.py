"""GLM-4.5 / 4.6 / Air (glm4_moe) in the one decoder: grouped-query attention rotating the first half of each head
(partial_rotary_factor), q/k/v biases and q/k norms as config.json switches them, DeepSeek-V3's group-limited
sigmoid router with its correction bias, a shared expert and dense first layers. Logits equal transformers', the
config round-trips, HF -> TP2 x PP2 x EP2 -> HF is bit-exact; the GLM-4.5-Air and GLM-4.5 presets carry the published
counts."""

import json

import pytest
import torch
import transformers
from conftest import make_hf_model
from helpers import assert_same_hf, qlm_from_hf

from qlm_core.checkpoint.convert.hf_megatron import hf_to_mcore, mcore_to_hf
from qlm_core.errors import QlmError
from qlm_core.models.parameters import num_parameters
from qlm_core.models.presets import PRESETS
from qlm_core.models.spec import ModelSpec

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
IDS = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    path = tmp_path_factory.mktemp("glm") / "glm4_moe"
    make_hf_model(path, "glm4_moe")
    return path


def test_logits_equal_transformers(glm):
    model, spec = qlm_from_hf(glm)
    assert (spec.rotary_percent, spec.rope_dim, spec.qk_layernorm, spec.qkv_bias) == (0.5, 8, True, True)
    ref = transformers.AutoModelForCausalLM.from_pretrained(glm, dtype=torch.float32).eval()
    with torch.no_grad():
        assert (model.eval()(IDS)[..., :300] - ref(IDS).logits).abs().max().item() <= 1e-5


def test_config_round_trips_and_converts_bit_exact(glm, tmp_path):
    spec = ModelSpec.from_hf_dir(glm)
    assert ModelSpec.from_hf_config(spec.to_hf_config()) == spec
    written = transformers.AutoConfig.for_model(**spec.to_hf_config())
    assert (written.attention_bias, written.use_qk_norm, written.rope_parameters["partial_rotary_factor"]) == \
        (True, True, 0.5)
    assert hf_to_mcore(glm, tmp_path / "mcore", tp=2, pp=2, ep=2, verify=True).verify.ok
    assert mcore_to_hf(tmp_path / "mcore", tmp_path / "hf", verify=True).verify.ok
    assert_same_hf(glm, tmp_path / "hf")


def test_an_odd_rotary_share_is_one_line(glm):
    config = json.loads((glm / "config.json").read_text())
    config["rope_parameters"]["partial_rotary_factor"] = 0.3125  # 5 of 16 dims
    with pytest.raises(QlmError, match="rotates an odd 5.0 of 16 head dims"):
        ModelSpec.from_hf_config(config)


@pytest.mark.parametrize("preset, total, active", [("glm-4.5-air", 106e9, 12e9), ("glm-4.5", 355e9, 32e9)])
def test_presets_carry_the_published_parameter_counts(preset, total, active):
    """GLM counts the active parameters without the embedding and the output layer (and GLM-4.5's 355B with its
    multi-token prediction layer, which the preset leaves out)."""
    spec = PRESETS[preset]
    assert num_parameters(spec) == pytest.approx(total, rel=0.02)
    vocab = 2 * spec.vocab_size * spec.hidden_size
    assert num_parameters(spec, active=True) - vocab == pytest.approx(active, rel=0.03)
    hf = spec.to_hf_config()
    assert ModelSpec.from_hf_config({**transformers.AutoConfig.for_model(**hf).to_dict(),
                                     "architectures": hf["architectures"]}) == spec


def test_partial_rotary_takes_glms_default_and_a_full_rotation_is_written(glm):
    """transformers' Glm4MoeConfig rotates half of each head when config.json names no partial_rotary_factor: qlm
    reads an absent key as 0.5 and writes a full rotation (1.0) out explicitly."""
    config = json.loads((glm / "config.json").read_text())
    del config["rope_parameters"]["partial_rotary_factor"]
    assert ModelSpec.from_hf_config(config).rotary_percent == 0.5
    full = ModelSpec.from_hf_dir(glm).replace(rotary_percent=1.0)
    written = full.to_hf_config()
    assert written["partial_rotary_factor"] == 1.0
    assert transformers.AutoConfig.for_model(**written).rope_parameters["partial_rotary_factor"] == 1.0
    assert ModelSpec.from_hf_config(written) == full


def test_yarn_on_partially_rotated_grouped_query_attention_gives_transformers_logits(tmp_path):
    """YaRN (rope_parameters yarn, truncated and not) on grouped-query attention rotating half of each head:
    transformers' logits past the original context, and the config round-trips."""
    for truncate in (True, False):
        path = tmp_path / f"truncate_{truncate}"
        make_hf_model(path, "glm4_moe", rope_parameters={
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5, "truncate": truncate})
        model, spec = qlm_from_hf(path)
        assert spec.rope_scaling.truncate is truncate
        ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        with torch.no_grad():
            assert (model.eval()(IDS)[..., :300] - ref(IDS).logits).abs().max().item() <= 1e-5
        assert ModelSpec.from_hf_config(spec.to_hf_config()) == spec
