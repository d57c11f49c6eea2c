"""DeepSeek-V3-class models in the one decoder, against transformers: multi-latent attention (with and without q's
low rank, values narrower than keys, yarn with mscale_all_dim, rotary rows interleaved and in halves), the sigmoid
router limited to groups (tied group scores broken as transformers breaks them) with its correction bias and
scaling, shared experts and dense first layers; greedy decoding from the latent cache; the config in and out."""

import json

import pytest
import torch
import torch.nn.functional as F
import transformers
from conftest import MLA_KINDS, make_hf_model
from helpers import assert_greedy_generate_equals_transformers, qlm_from_hf

from qlm_core.errors import QlmError
from qlm_core.kernels.rope import rope_attention_factor, rope_inv_freq
from qlm_core.models.attention import KVCache
from qlm_core.models.layout import ModelLayout
from qlm_core.models.moe import MoELayer, route
from qlm_core.models.moe_spec import MoeSpec
from qlm_core.models.spec import ModelSpec

IDS = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(0))
LABELS = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("kind", list(MLA_KINDS))
def test_logits_loss_and_routes_equal_transformers(mla_models, kind):
    model, spec = qlm_from_hf(mla_models[kind])
    ref = transformers.AutoModelForCausalLM.from_pretrained(mla_models[kind], dtype=torch.float32).eval()
    routes = []
    hooks = [layer.mlp.register_forward_hook(lambda m, i, out: routes.append(m)) for layer in model.decoder.layers
             if isinstance(layer.mlp, MoELayer)]
    with torch.no_grad():
        expected = ref(IDS).logits
        assert (model(IDS) - expected).abs().max().item() <= 1e-5
        want = F.cross_entropy(expected.flatten(0, 1), LABELS.flatten(), reduction="none").view(2, 40)
        assert (model(IDS, labels=LABELS) - want).abs().max().item() <= 1e-5
    for hook in hooks:
        hook.remove()
    assert len(routes) == 2 * spec.moe.num_moe_layers(spec.num_layers)  # the MoE layers ran (dense first ones not)
    assert spec.mla.v_head_dim != spec.mla.q_head_dim
    assert spec.moe.expert_bias != (spec.model_type == "deepseek_v2")  # V2 routes by softmax, without the bias


def hf_router(kind_config: dict, weight: torch.Tensor, bias: torch.Tensor):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    router = DeepseekV3TopkRouter(transformers.DeepseekV3Config(**kind_config))
    with torch.no_grad():
        router.weight.copy_(weight)
        router.e_score_correction_bias.copy_(bias)
    return router


def test_group_limited_router_equals_transformers_with_tied_groups():
    """16 experts in 4 groups, 2 groups kept, top 4: groups 0, 1 and 2 hold the same router rows and biases, so
    their group scores tie for the two places; transformers' choice of groups (and so of experts, whose weights
    are the same scores) is qlm's, token by token."""
    config = dict(hidden_size=32, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                  routed_scaling_factor=2.5, norm_topk_prob=True)
    generator = torch.Generator().manual_seed(3)
    weight, bias = torch.randn(16, 32, generator=generator), torch.randn(16, generator=generator) * 0.1
    weight[4:8], weight[8:12], bias[4:8], bias[8:12] = weight[:4], weight[:4], bias[:4], bias[:4]
    hidden = torch.randn(64, 32, generator=generator)
    _, hf_weights, hf_indices = hf_router(config, weight, bias)(hidden)
    moe = MoeSpec(num_experts=16, topk=4, ffn_hidden_size=8, score_function="sigmoid", expert_bias=True,
                  num_groups=4, group_topk=2, topk_scaling_factor=2.5)
    probs, indices = route(hidden @ weight.t(), moe, bias)
    group_scores = [(hidden @ weight[g:g + 4].t()).sigmoid().add(bias[g:g + 4]).topk(2).values.sum(-1)
                    for g in (0, 4, 8)]
    assert torch.equal(group_scores[0], group_scores[1]) and torch.equal(group_scores[0], group_scores[2])
    assert torch.equal(indices, hf_indices)  # the same experts in the same order: ties broken alike
    assert (probs - hf_weights).abs().max() <= 1e-6
    chosen_groups = (indices // 4).unique()
    assert {0, 1, 2} & set(chosen_groups.tolist())


@pytest.mark.parametrize("params", [
    dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64, beta_fast=32, beta_slow=1,
         mscale=1.0, mscale_all_dim=0.8),
    dict(rope_type="yarn", factor=40.0, original_max_position_embeddings=4096),
    dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=512, attention_factor=1.3, truncate=False),
])
def test_yarn_frequencies_and_factors_equal_transformers(params):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, yarn_apply_mscale

    config = transformers.DeepseekV3Config(qk_rope_head_dim=64, max_position_embeddings=163840,
                                           rope_parameters={**params, "rope_theta": 10000.0})
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    hf_config = config.to_dict()
    spec = ModelSpec.from_hf_config({**hf_config, "vocab_size": 300, "architectures": ["DeepseekV3ForCausalLM"]})
    assert torch.equal(rope_inv_freq(64, spec.rope_theta, spec.rope_scaling), inv_freq)
    assert rope_attention_factor(spec.rope_scaling) == pytest.approx(factor, rel=1e-12)
    from qlm_core.models.attention_mla import softmax_scale

    assert softmax_scale(spec) == pytest.approx(yarn_apply_mscale(config.rope_parameters, 192 ** -0.5), rel=1e-12)


@pytest.mark.parametrize("kind", list(MLA_KINDS))
def test_config_round_trips_through_transformers(mla_models, kind):
    spec = ModelSpec.from_hf_dir(mla_models[kind])
    assert ModelSpec.from_hf_config(spec.to_hf_config()) == spec
    written = transformers.AutoConfig.for_model(**spec.to_hf_config())
    stored = json.loads((mla_models[kind] / "config.json").read_text())
    layers = "mlp_layer_types" if kind == "glm4_moe_lite" else "first_k_dense_replace"
    router = ("topk_method", "norm_topk_prob") if spec.model_type == "deepseek_v2" else \
        ("n_group", "topk_group", "rope_interleave")  # DeepSeek-V2: greedy softmax routing, always interleaved
    for key in ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", *router,
                "routed_scaling_factor", layers, "n_shared_experts", "num_experts_per_tok", "n_routed_experts"):
        assert getattr(written, key) == stored[key], key
    assert type(written).__name__.lower().startswith(kind.split("_lite")[0].replace("_", ""))
    assert written.rope_parameters == stored["rope_parameters"]


def test_a_latent_cache_holds_the_latent_not_the_heads(mla_models):
    model, spec = qlm_from_hf(mla_models["deepseek_v3"])
    cache = KVCache.empty(spec.num_layers)
    with torch.no_grad():
        model(IDS[:, :10], cache=cache)
    assert cache.length == 10
    assert cache.keys[0].shape == (2, 1, 10, spec.mla.kv_lora_rank)
    assert cache.values[0].shape == (2, 1, 10, spec.mla.qk_rope_head_dim)


@pytest.mark.parametrize("kind", list(MLA_KINDS))
def test_greedy_generate_equals_transformers(tmp_path, kind):
    """`qlm generate` decodes from the latent cache (a left-padded batch of two prompts) as transformers' generate
    does from its own."""
    path = tmp_path / kind
    model = make_hf_model(path, kind, initializer_range=0.2)  # not one token repeated
    assert_greedy_generate_equals_transformers(path, model)


@pytest.mark.parametrize("change, message", [
    (dict(norm_topk_prob=False), "norm_topk_prob is false"),
    (dict(attention_bias=True), "attention_bias=true is not supported for deepseek_v3"),
    (dict(kv_lora_rank=0), "kv_lora_rank is 0, not a positive integer"),
    (dict(qk_rope_head_dim=5), "qk_rope_head_dim 5 is odd"),
    (dict(n_group=3), "n_group must divide the expert count"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}),
     "yarn rope scaling without original_max_position_embeddings"),
])
def test_bad_deepseek_configs_are_one_line(mla_models, change, message):
    config = json.loads((mla_models["deepseek_v3"] / "config.json").read_text())
    with pytest.raises(QlmError, match=message):
        ModelSpec.from_hf_config({**config, **change})


def test_tp_not_dividing_the_latent_is_one_line(mla_models):
    spec = ModelSpec.from_hf_dir(mla_models["deepseek_v3"])  # kv_lora_rank 16 + rope 4 = 20; q_lora_rank 24
    with pytest.raises(QlmError, match="--tp 16 does not divide multi-latent attention's q_lora_rank 24"):
        ModelLayout(spec.replace(num_attention_heads=16, num_query_groups=16), tp=16)
    with pytest.raises(QlmError, match=r"--tp 4 does not divide multi-latent attention's kv_lora_rank \+ "
                                       r"qk_rope_head_dim 22"):
        ModelLayout(spec.replace(mla=spec.mla.__class__(**{**vars(spec.mla), "kv_lora_rank": 18})), tp=4)


@pytest.mark.parametrize("preset, total, active", [
    ("deepseek-v3", 671e9, 37e9), ("kimi-k2", 1.03e12, 32.5e9), ("moonlight-16b-a3b", 16e9, 3e9),
    ("glm-4.7-flash", 30e9, None)])
def test_presets_carry_the_published_parameter_counts(preset, total, active):
    """DeepSeek-V3 (671B total, 37B active, as its report counts them without the MTP module), Kimi-K2 (~1T total,
    32B active) and Moonlight (16B total, 3B active); each preset's config loads in transformers as the family."""
    from qlm_core.models.parameters import num_parameters
    from qlm_core.models.presets import PRESETS

    spec = PRESETS[preset]
    assert num_parameters(spec) == pytest.approx(total, rel=0.02)
    if active is None:  # "A3B": GLM counts the active parameters without the embedding and the output layer
        vocab = 2 * spec.vocab_size * spec.hidden_size
        assert num_parameters(spec, active=True) - vocab == pytest.approx(3e9, rel=0.1)
    else:
        assert num_parameters(spec, active=True) == pytest.approx(active, rel=0.04)
    hf = spec.to_hf_config()
    config = transformers.AutoConfig.for_model(**hf)
    assert ModelSpec.from_hf_config({**config.to_dict(), "architectures": hf["architectures"]}) == spec


def test_deepseek_v2_lite_preset_carries_its_published_counts():
    """15.7B total, 2.4B active (DeepSeek counts the active ones without the input embedding)."""
    from qlm_core.models.parameters import num_parameters
    from qlm_core.models.presets import PRESETS

    spec = PRESETS["deepseek-v2-lite"]
    assert num_parameters(spec) == pytest.approx(15.7e9, rel=0.005)
    assert num_parameters(spec, active=True) - spec.vocab_size * spec.hidden_size == pytest.approx(2.4e9, rel=0.03)
    hf = spec.to_hf_config()
    config = transformers.AutoConfig.for_model(**hf)
    assert type(config).__name__ == "DeepseekV2Config"
    assert ModelSpec.from_hf_config({**config.to_dict(), "architectures": hf["architectures"]}) == spec


def test_deepseek_v2s_group_limited_routing_and_renormalisation_are_refused():
    """DeepSeek-V2's group_limited_greedy scores a group by its best expert (Megatron-Core's router cannot), and
    transformers' DeepseekV2 never renormalises whatever norm_topk_prob says: one line each."""
    from qlm_core.models.presets import PRESETS

    base = PRESETS["deepseek-v2-lite"].to_hf_config()
    with pytest.raises(QlmError, match="topk_method 'group_limited_greedy'"):
        ModelSpec.from_hf_config({**base, "topk_method": "group_limited_greedy", "n_group": 8, "topk_group": 3})
    with pytest.raises(QlmError, match="norm_topk_prob is true, which transformers' DeepseekV2 ignores"):
        ModelSpec.from_hf_config({**base, "norm_topk_prob": True})


def test_deepseek_v3s_release_total_counts_its_mtp_layer_and_the_copies():
    """DeepSeek-V3's Hugging Face release holds 685B parameters: the 671B model and its 14B MTP module (one MoE
    layer, eh_proj and norms, with copies of the embedding and the output layer)."""
    from qlm_core.models.parameters import mtp_parameters, num_parameters
    from qlm_core.models.presets import PRESETS

    spec = PRESETS["deepseek-v3"]
    copies = 2 * spec.vocab_size * spec.hidden_size
    assert spec.mtp_num_layers == 1 and mtp_parameters(spec) + copies == pytest.approx(14e9, rel=0.04)
    assert num_parameters(spec) + mtp_parameters(spec) + copies == pytest.approx(685e9, rel=0.002)


def test_absent_router_keys_take_transformers_defaults(mla_models):
    """A hand-written config.json without n_group, topk_group, routed_scaling_factor, n_shared_experts or
    first_k_dense_replace reads as transformers reads it (DeepSeek-V3's 8, 4, 2.5, 1, 3)."""
    config = json.loads((mla_models["deepseek_v3"] / "config.json").read_text())
    stripped = {k: v for k, v in config.items() if k not in (
        "n_group", "topk_group", "routed_scaling_factor", "n_shared_experts", "first_k_dense_replace")}
    stripped["n_routed_experts"] = 32
    hf = transformers.DeepseekV3Config(**stripped)
    moe = ModelSpec.from_hf_config(stripped).moe
    assert (moe.num_groups, moe.group_topk, moe.topk_scaling_factor) == (hf.n_group, hf.topk_group,
                                                                          hf.routed_scaling_factor)
    assert moe.shared_expert_hidden_size == hf.n_shared_experts * hf.moe_intermediate_size
    assert moe.layer_pattern[:4] == tuple(int(i >= hf.first_k_dense_replace) for i in range(4))


def test_values_wider_than_keys_are_one_line(mla_models):
    config = json.loads((mla_models["deepseek_v3"] / "config.json").read_text())
    with pytest.raises(QlmError, match="v_head_dim 16 is wider than the q/k head"):
        ModelSpec.from_hf_config({**config, "v_head_dim": 16})
