"""Qwen3 and the MoE models (Qwen2-MoE, Qwen3-MoE, Mixtral) in the one decoder, against transformers: logits, loss,
router choices, the load-balancing losses (Megatron's per layer by hand, transformers' as it returns it) and their
gradients."""

import dataclasses
import json
import math

import pytest
import torch
import torch.nn.functional as F
import transformers
from conftest import QWEN3_MOE_KINDS

from qlm_core.checkpoint.formats.hf.checkpoint import HFCheckpoint
from qlm_core.config import MoeConfig
from qlm_core.errors import QlmError
from qlm_core.models.gpt import GPTModel
from qlm_core.models.layout import HFTensorSource, ModelLayout, build_shard
from qlm_core.models.moe import MoELayer, capacity_keep
from qlm_core.models.parameters import num_parameters
from qlm_core.models.presets import PRESETS
from qlm_core.models.spec import ModelSpec

MOE_KINDS = [k for k in QWEN3_MOE_KINDS if k != "qwen3"]


def qlm_from_hf(path, options=None):
    ckpt = HFCheckpoint(path)
    layout = ModelLayout(ckpt.spec)
    model = GPTModel(ckpt.spec, padded_vocab=layout.padded_vocab, moe_options=options)
    model.load_state_dict(build_shard(layout, 0, 0, 0, HFTensorSource(ckpt)), strict=True)
    return model, ckpt.spec


def reference(path, **config):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **config)


def router_logits(model: GPTModel, ids) -> list[torch.Tensor]:
    """Each MoE layer's router logits [tokens, E] in one forward (batch-major tokens, as transformers flattens)."""
    seen = []
    hooks = [layer.mlp.router.register_forward_hook(lambda m, i, out: seen.append(out))
             for layer in model.decoder.layers if isinstance(layer.mlp, MoELayer)]
    model(ids)
    for hook in hooks:
        hook.remove()
    s, b = ids.shape[1], ids.shape[0]
    return [t.view(s, b, -1).transpose(0, 1).reshape(b * s, -1) for t in seen]  # qlm runs [s, b] token order


IDS = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(0))
LABELS = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("kind", list(QWEN3_MOE_KINDS))
def test_logits_loss_and_router_choices_equal_transformers(moe_models, kind):
    model, spec = qlm_from_hf(moe_models[kind])
    ref = reference(moe_models[kind]).eval()
    with torch.no_grad():
        out = ref(IDS, output_router_logits=spec.moe is not None)
        assert (model.eval()(IDS) - out.logits).abs().max().item() <= 1e-5
        expected_loss = F.cross_entropy(out.logits.flatten(0, 1), LABELS.flatten(), reduction="none").view(2, 40)
        assert (model(IDS, labels=LABELS) - expected_loss).abs().max().item() <= 1e-5
        if spec.moe is None:
            assert spec.qk_layernorm and spec.kv_channels == 24 and spec.hidden_size == 64
            return
        ours = router_logits(model, IDS)
    assert len(ours) == len(out.router_logits) == spec.moe.num_moe_layers(spec.num_layers)
    for mine, theirs in zip(ours, out.router_logits, strict=True):  # gpt-oss's router logits reach tens
        scale = theirs.abs().max().item() if kind == "gpt_oss" else 1.0
        assert (mine - theirs).abs().max().item() <= 1e-5 * scale
        k = spec.moe.topk
        assert torch.equal(mine.topk(k).indices.sort().values, theirs.topk(k).indices.sort().values)


def test_the_config_reads_each_models_routing(moe_models):
    specs = {kind: HFCheckpoint(moe_models[kind]).spec for kind in QWEN3_MOE_KINDS}
    assert specs["qwen2_moe"].moe.pre_softmax and specs["qwen2_moe"].moe.shared_expert_gate
    assert specs["qwen2_moe"].moe.layer_pattern == (1, 1, 0, 1)  # mlp_only_layers = [2]
    assert not specs["qwen3_moe"].moe.pre_softmax and not specs["qwen3_moe"].moe.shared_expert_hidden_size
    assert not specs["mixtral"].moe.pre_softmax and specs["mixtral"].moe.ffn_hidden_size == 32
    ernie = specs["ernie4_5_moe"]
    assert ernie.moe.expert_bias and not ernie.moe.pre_softmax and ernie.moe.score_function == "softmax"
    assert ernie.moe.layer_pattern == (0, 1, 1, 1) and ernie.moe.shared_expert_hidden_size == 32  # start index 1
    assert ernie.rotary_interleaved and not ernie.moe.shared_expert_gate
    for kind, spec in specs.items():  # config.json written back reads the same
        assert ModelSpec.from_hf_config(json.loads(json.dumps(spec.to_hf_config()))) == spec, kind
        transformers.AutoConfig.for_model(**spec.to_hf_config())  # and transformers takes it


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_megatron_aux_loss_is_e_sum_f_p_per_layer(moe_models, kind):
    """E·Σᵢ fᵢ·Pᵢ of each layer from its router logits by hand, and the z-loss mean(logsumexp²)."""
    model, spec = qlm_from_hf(moe_models[kind], MoeConfig(aux_loss_coeff=1.0, z_loss_coeff=1.0))
    logits = router_logits(model, IDS)
    records = model.moe.tracker.take_records()
    E, k, T = spec.moe.num_experts, spec.moe.topk, IDS.numel()
    assert len(records) == len(logits)
    biases = [layer.mlp.router.expert_bias for layer in model.decoder.layers if isinstance(layer.mlp, MoELayer)]
    for record, layer_logits, bias in zip(records, logits, biases, strict=True):
        counts = torch.bincount(layer_logits.topk(k).indices.flatten(), minlength=E).float()
        probs = torch.softmax(layer_logits, dim=-1).mean(0)
        expected = E * ((counts / (T * k)) * probs).sum()
        assert torch.allclose(record.aux_loss, expected, rtol=1e-6)  # fᵢ: the unbiased choices (Megatron's)
        # the load: the experts chosen, ERNIE's with its correction bias added to the softmax's probabilities
        choice = layer_logits if bias is None else torch.softmax(layer_logits, -1) + bias
        assert torch.equal(record.tokens_per_expert, torch.bincount(choice.topk(k).indices.flatten(), minlength=E))
        assert torch.allclose(record.z_loss, torch.logsumexp(layer_logits, -1).square().mean(), rtol=1e-6)


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_transformers_aux_loss_and_gradients_equal_transformers(moe_models, kind):
    """aux_loss_type = transformers: the loss transformers returns with output_router_logits=True, and the gradient
    of cross entropy + coeff · aux equal to transformers' for the router, an expert and the embedding."""
    coeff = 0.5
    model, spec = qlm_from_hf(moe_models[kind], MoeConfig(aux_loss_coeff=coeff, aux_loss_type="transformers"))
    ref = reference(moe_models[kind], router_aux_loss_coef=coeff)
    out = ref(IDS, labels=IDS, output_router_logits=True)
    loss = model(IDS[:, :-1], labels=IDS[:, 1:]).mean()
    # transformers shifts inside its loss and routes every token, the last one too: run ours on all tokens as well
    model.moe.tracker.pending.clear()
    model.moe.tracker.take_records()
    model(IDS)
    aux = model.moe.tracker.transformers_aux_loss(spec.moe.num_experts, coeff)
    assert torch.allclose(aux / coeff, out.aux_loss, rtol=1e-6)
    (loss + aux).backward()
    out.loss.backward()
    moe_layer = next(i for i in range(spec.num_layers) if spec.is_moe_layer(i))
    mine = model.decoder.layers[moe_layer].mlp
    theirs = ref.model.layers[moe_layer].mlp
    router = theirs.router if kind == "gpt_oss" else theirs.gate
    assert torch.allclose(mine.router.weight.grad, router.weight.grad, atol=1e-6, rtol=1e-4)
    expert = mine.experts.local_experts[1]
    down, gate_up = theirs.experts.down_proj.grad[1], theirs.experts.gate_up_proj.grad[1]
    if kind == "gpt_oss":  # [f, h] and [h, 2f] with gate and up in alternate columns; biases on all three
        down, gate_up = down.t(), torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], dim=1).t()
        assert torch.allclose(mine.router.bias.grad, router.bias.grad, atol=1e-6, rtol=1e-4)
        bias = theirs.experts.gate_up_proj_bias.grad[1]
        assert torch.allclose(expert.linear_fc1.bias.grad, torch.cat([bias[0::2], bias[1::2]]), atol=1e-6, rtol=1e-4)
        assert torch.allclose(expert.linear_fc2.bias.grad, theirs.experts.down_proj_bias.grad[1], atol=1e-6,
                              rtol=1e-4)
    # gpt-oss's experts are scaled x100 (conftest: past the clamp): fp32 sums of its larger terms differ further in
    # their last bits with the order the CPU's kernels take (seen: 3.3e-6 on entries up to 1.1)
    atol = 1e-5 if kind == "gpt_oss" else 1e-6
    assert torch.allclose(expert.linear_fc2.weight.grad, down, atol=atol, rtol=1e-4)
    assert torch.allclose(expert.linear_fc1.weight.grad, gate_up, atol=atol, rtol=1e-4)
    assert torch.allclose(model.embedding.word_embeddings.weight.grad[:300], ref.model.embed_tokens.weight.grad,
                          atol=1e-6, rtol=1e-4)


def test_megatron_aux_loss_gradient_enters_through_the_layer_output(moe_models):
    """The attached loss adds d(coeff · aux)/d(router) to the router's gradient and nothing to the forward."""
    base, _ = qlm_from_hf(moe_models["qwen3_moe"])
    with_aux, _ = qlm_from_hf(moe_models["qwen3_moe"], MoeConfig(aux_loss_coeff=0.1))
    assert torch.equal(base(IDS, labels=LABELS), with_aux(IDS, labels=LABELS))
    base(IDS, labels=LABELS).mean().backward()
    with_aux.moe.tracker.take_records()
    with_aux(IDS, labels=LABELS).mean().backward()
    records = with_aux.moe.tracker.take_records()
    total = sum(r.aux_loss for r in records)
    # the same gradient by autograd on the explicit sum: rebuild the aux from the router logits
    explicit, spec = qlm_from_hf(moe_models["qwen3_moe"])
    logits = []
    hooks = [layer.mlp.router.register_forward_hook(lambda m, i, out: logits.append(out))
             for layer in explicit.decoder.layers]
    main = explicit(IDS, labels=LABELS).mean()
    for hook in hooks:
        hook.remove()
    E, k, T = spec.moe.num_experts, spec.moe.topk, IDS.numel()
    aux = sum(0.1 * E / (k * T * T) * (torch.softmax(lg, -1).sum(0)
                                        * torch.bincount(lg.topk(k).indices.flatten(), minlength=E)).sum()
              for lg in logits)
    assert torch.allclose(aux.detach(), total, rtol=1e-6)
    (main + aux).backward()
    for a, b in zip(with_aux.parameters(), explicit.parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad, atol=1e-7, rtol=1e-5)
    router = with_aux.decoder.layers[0].mlp.router.weight.grad
    assert not torch.allclose(router, base.decoder.layers[0].mlp.router.weight.grad, atol=1e-7, rtol=1e-5)


def test_capacity_keeps_each_experts_most_probable_tokens():
    indices = torch.tensor([[0, 1], [0, 2], [0, 1], [1, 0]])
    probs = torch.tensor([[0.6, 0.4], [0.9, 0.1], [0.7, 0.3], [0.8, 0.2]])
    keep = capacity_keep(indices, probs, num_experts=3, capacity=2).view(4, 2)
    # expert 0 has tokens 0 (0.6), 1 (0.9), 2 (0.7), 3 (0.2): keeps 1 and 2; expert 1: 0.4, 0.3, 0.8 -> 0.8, 0.4
    assert keep.tolist() == [[False, True], [True, True], [True, False], [True, False]]


def test_capacity_factor_drops_tokens_in_the_model(moe_models):
    model, _ = qlm_from_hf(moe_models["mixtral"])
    dropping, _ = qlm_from_hf(moe_models["mixtral"], MoeConfig(capacity_factor=0.5))
    with torch.no_grad():
        assert not torch.allclose(model(IDS), dropping(IDS))
        roomy, _ = qlm_from_hf(moe_models["mixtral"], MoeConfig(capacity_factor=4.0))  # room for every token
        assert torch.equal(model(IDS), roomy(IDS))


PUBLISHED = {  # (total, active) parameters in billions, as their model cards state them
    "qwen3-0.6b": (0.6, None), "qwen3-1.7b": (1.7, None), "qwen3-4b": (4.0, None), "qwen3-8b": (8.2, None),
    "qwen3-14b": (14.8, None), "qwen3-32b": (32.8, None), "qwen3-30b-a3b": (30.5, 3.3),
    "qwen3-235b-a22b": (235, 22), "qwen1.5-moe-a2.7b": (14.3, 2.7), "qwen2-57b-a14b": (57, 14),
    "mixtral-8x7b": (46.7, 12.9), "mixtral-8x22b": (141, 39),
}


def states(count: int, published: float) -> bool:
    """Whether a model card's figure states `count` parameters: the count in billions rounded or cut to the
    figure's decimals (cards do both: Qwen3-30B-A3B's 3.35B active is "3.3B")."""
    decimals = len(str(published).partition(".")[2])
    billions = count / 1e9
    return published in (round(billions, decimals), math.floor(billions * 10**decimals) / 10**decimals)


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_presets_have_the_published_parameter_counts(name):
    total, active = PUBLISHED[name]
    spec = PRESETS[name]
    assert states(num_parameters(spec), total), num_parameters(spec)
    if active is None:
        assert num_parameters(spec, active=True) == num_parameters(spec)
    else:
        assert states(num_parameters(spec, active=True), active), num_parameters(spec, active=True)


def test_unsupported_moe_configs_say_what_to_change(moe_models):
    config = json.loads((moe_models["mixtral"] / "config.json").read_text())
    with pytest.raises(QlmError, match="router_jitter_noise"):
        ModelSpec.from_hf_config({**config, "router_jitter_noise": 0.1})
    with pytest.raises(QlmError, match="num_experts_per_tok"):
        ModelSpec.from_hf_config({**config, "num_experts_per_tok": 9})
    spec = HFCheckpoint(moe_models["qwen3_moe"]).spec
    with pytest.raises(QlmError, match="--tp 3 does not divide"):
        ModelLayout(spec.replace(num_attention_heads=6, num_query_groups=3), tp=3)
    sigmoid = spec.replace(moe=dataclasses.replace(spec.moe, score_function="sigmoid"))
    with pytest.raises(QlmError, match="sigmoid"):
        sigmoid.to_hf_config()
    with pytest.raises(QlmError, match="qk_layernorm goes with model types qwen3, qwen3_moe"):
        spec.replace(model_type="qwen2_moe", qkv_bias=True, moe=dataclasses.replace(
            spec.moe, shared_expert_hidden_size=32, shared_expert_gate=True)).to_hf_config()
    with pytest.raises(QlmError, match="qkv_bias goes with model types qwen2, qwen2_moe"):
        spec.replace(qkv_bias=True).to_hf_config()


def test_ernie_moe_preset_counts_what_transformers_builds_from_its_config():
    """ERNIE-4.5-21B-A3B: transformers' model of the preset's config.json holds 21,825,437,888 parameters, qlm's count
    the same less the 27 routers' correction biases (buffers in Megatron); 3.35B active (the card's "3B")."""
    spec = PRESETS["ernie-4.5-21b-a3b"]
    config = transformers.AutoConfig.for_model(**spec.to_hf_config())
    with torch.device("meta"):
        reference_count = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(config).parameters())
    assert reference_count == 21_825_437_888
    assert num_parameters(spec) == reference_count - 27 * 64
    assert num_parameters(spec, active=True) == 3_352_148_480
