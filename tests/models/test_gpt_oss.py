"""gpt-oss in the one decoder, against transformers' GptOss: its clamped SwiGLU bit for bit, packed documents and a
KV cache past the sliding window, greedy `qlm generate`, its released MXFP4 experts dequantised on import, the packed
expert tensors written back as its files hold them, and the expert-TP rule its biases bring. (Logits, router choices
and gradients: tests/models/test_moe_model.py; conversion: tests/checkpoint/test_moe_convert.py; real megatron-core:
tests/checkpoint/test_moe_megatron_peer.py, which run the same tiny model.)"""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
import transformers
from conftest import make_hf_model
from helpers import (
    assert_greedy_generate_equals_transformers,
    assert_same_hf,
    assert_sft_then_lora_export_equals_transformers,
    cached_logits,
    qlm_from_hf,
)
from safetensors.torch import load_file, save_file
from transformers.integrations.mxfp4 import FP4_VALUES, convert_moe_packed_tensors
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

from qlm_core.checkpoint.convert.hf_megatron import hf_to_mcore, mcore_to_hf
from qlm_core.checkpoint.formats.hf.checkpoint import HFCheckpoint
from qlm_core.errors import QlmError
from qlm_core.kernels.clamped_swiglu import LIMIT, ClampedSwiGLUFunction, clamped_swiglu_reference
from qlm_core.models.layout import ModelLayout

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt_oss") / "model"
    make_hf_model(path, "gpt_oss")
    return path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_clamped_swiglu_equals_transformers_gate_bit_for_bit(dtype):
    """transformers' GptOssExperts._apply_gate on its [gate0, up0, gate1, up1, ...] columns against qlm's on
    [gate; up]: the same values and gradients, with both clamps binding on some entries."""
    config = transformers.GptOssConfig(hidden_size=8, intermediate_size=64, num_local_experts=1)
    theirs_fn = GptOssExperts(config)._apply_gate
    torch.manual_seed(0)
    gate, up = ((torch.randn(6, 64) * 6).to(dtype) for _ in range(2))
    above = torch.nextafter(torch.tensor(LIMIT, dtype=dtype), torch.tensor(100.0, dtype=dtype))
    edges = torch.tensor([LIMIT, -LIMIT, above, -above], dtype=dtype)  # at the limits: the clamps pass the gradient
    gate[0, :4], up[0, :4] = edges, edges
    assert (gate > LIMIT).any() and (up.abs() > LIMIT).any()
    grad = torch.randn(6, 64).to(dtype)
    interleaved = torch.stack([gate, up], dim=-1).reshape(6, 128).requires_grad_()
    ours_in = torch.cat([gate, up], dim=-1).requires_grad_()
    theirs, ours = theirs_fn(interleaved), ClampedSwiGLUFunction.apply(ours_in)
    assert torch.equal(ours, theirs) and torch.equal(clamped_swiglu_reference(ours_in), theirs)
    theirs.backward(grad)
    ours.backward(grad)
    assert torch.equal(ours_in.grad, torch.cat([interleaved.grad[:, 0::2], interleaved.grad[:, 1::2]], dim=-1))
    assert (ours_in.grad[:, :64][gate > LIMIT] == 0).all()


def test_the_tiny_model_clamps_its_experts(gpt_oss):
    """The fixture's experts see fc1 outputs past the limit on real inputs (so the logits tests exercise the
    clamps): every expert's fc1 on the first MoE layer's normalised input."""
    model, spec = qlm_from_hf(gpt_oss)
    layer = model.decoder.layers[0]
    seen = []
    hook = layer.pre_mlp_layernorm.register_forward_hook(lambda module, args, out: seen.append(out))
    with torch.no_grad():
        model(torch.randint(0, spec.vocab_size, (2, 40), generator=torch.Generator().manual_seed(2)))
        hook.remove()
        fc1 = torch.stack([torch.nn.functional.linear(seen[0], e.linear_fc1.weight, e.linear_fc1.bias)
                           for e in layer.mlp.experts.local_experts])
    assert 0.05 < (fc1 > LIMIT).float().mean().item() < 0.5


def test_packed_documents_and_the_kv_cache_equal_transformers_past_the_window(gpt_oss):
    """Two documents packed in one row each equal transformers on the document alone (its window of 8 and its
    sinks per document); decoding with a KV cache from a 30-token prefix equals transformers' full pass."""
    model, spec = qlm_from_hf(gpt_oss)
    reference = transformers.AutoModelForCausalLM.from_pretrained(gpt_oss, dtype=torch.float32).eval()
    ids = torch.randint(0, spec.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(ids).logits
        segments = torch.tensor([[0] * 17 + [1] * 23] * 2)
        positions = torch.cat([torch.arange(17), torch.arange(23)]).expand(2, 40)
        packed = model(ids, positions, segment_ids=segments)
        alone = torch.cat([reference(ids[:, :17]).logits, reference(ids[:, 17:]).logits], dim=1)
        assert (packed - alone).abs().max().item() <= 1e-5
        assert (cached_logits(model, ids, 30) - expected).abs().max().item() <= 1e-5


def test_greedy_generate_equals_transformers(tmp_path):
    """`qlm generate` (a left-padded batch of two prompts, a KV cache past the window) as transformers' generate."""
    path = tmp_path / "model"
    model = make_hf_model(path, "gpt_oss", initializer_range=0.2)  # not one token repeated
    assert_greedy_generate_equals_transformers(path, model, max_new_tokens=12)


def mxfp4_quantised(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, columns, rows] (transformers' layout) -> MXFP4 blocks [E, rows, columns / 32, 16] and scales [E, rows,
    columns / 32], as gpt-oss's release stores them: each 32 values share 2^(scale - 127), each value the nearest
    E2M1 code (low nibble first)."""
    rows_first = weight.transpose(1, 2).float()
    experts, rows, columns = rows_first.shape
    groups = rows_first.reshape(experts, rows, columns // 32, 32)
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=1e-30) / 6.0)).clamp(-127, 127)
    values = torch.tensor(FP4_VALUES)
    codes = (groups / torch.exp2(exponent)[..., None]).unsqueeze(-1).sub(values).abs().argmin(-1).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exponent + 127).to(torch.uint8)


def test_mxfp4_experts_are_dequantised_as_transformers_does(gpt_oss, tmp_path):
    """The release's MXFP4 experts (`*_blocks`, `*_scales`, quantization_config mxfp4) read as transformers'
    convert_moe_packed_tensors dequantises them, convert to Megatron and back to bf16 HF files holding those values,
    and the written config.json has no quantization_config."""
    released = tmp_path / "mxfp4"
    shutil.copytree(gpt_oss, released)
    tensors = load_file(released / "model.safetensors")
    dequantised = {}
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = mxfp4_quantised(tensors.pop(name))
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
        dequantised[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)
    save_file(tensors, str(released / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((released / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (released / "config.json").write_text(json.dumps(config))
    checkpoint = HFCheckpoint(released)
    assert any("MXFP4" in note for note in checkpoint.notes)
    ffn = checkpoint.spec.moe.ffn_hidden_size
    gate = checkpoint.read("model.layers.1.mlp.experts.2.gate_proj.weight")
    assert torch.equal(gate, dequantised["model.layers.1.mlp.experts.gate_up_proj"][2][:, 0::2].t())
    assert gate.shape == (ffn, 64) and gate.dtype == torch.bfloat16
    hf_to_mcore(released, tmp_path / "mcore", tp=2, etp=1, dtype=torch.bfloat16)
    mcore_to_hf(tmp_path / "mcore", tmp_path / "hf", dtype=torch.bfloat16)
    written = load_file(tmp_path / "hf/model.safetensors")
    for name, value in dequantised.items():
        assert torch.equal(written[name], value), name
    assert "quantization_config" not in json.loads((tmp_path / "hf/config.json").read_text())


def test_the_files_hold_the_experts_packed_and_convert_back_bit_exact(gpt_oss, tmp_path):
    """HF -> TP2 · PP2 · EP2 (expert-TP 1) in both Megatron formats -> HF: the same packed tensors, bit for bit; a
    Megatron expert's linear_fc1 is [gate; up] out of gpt-oss's alternate columns."""
    assert hf_to_mcore(gpt_oss, tmp_path / "ep", tp=2, pp=2, ep=2, etp=1, verify=True).verify.ok
    shard = torch.load(tmp_path / "ep/release/mp_rank_01_000_001/model_optim_rng.pt", weights_only=False)["model"]
    fc1 = shard["decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight"]  # global expert 3, whole
    packed = load_file(gpt_oss / "model.safetensors")["model.layers.0.mlp.experts.gate_up_proj"][3]
    assert torch.equal(fc1, torch.cat([packed[:, 0::2], packed[:, 1::2]], dim=1).t())
    assert "decoder.layers.0.mlp.router.bias" in shard
    assert "decoder.layers.0.self_attention.core_attention.softmax_offset" in shard
    assert mcore_to_hf(tmp_path / "ep", tmp_path / "hf", verify=True).verify.ok
    assert_same_hf(gpt_oss, tmp_path / "hf")


def test_expert_biases_split_over_expert_tp_are_one_line(gpt_oss):
    spec = HFCheckpoint(gpt_oss).spec
    with pytest.raises(QlmError, match="Megatron-Core adds an MoE layer's biases at expert-TP 1 only") as info:
        ModelLayout(spec, tp=2)
    assert "--etp 1" in info.value.fix
    assert ModelLayout(spec, tp=2, etp=1).etp == 1


def test_config_round_trips_and_other_swiglu_constants_are_one_line(gpt_oss):
    config = json.loads((gpt_oss / "config.json").read_text())
    spec = HFCheckpoint(gpt_oss).spec
    assert (spec.activation, spec.attention_sinks, spec.linear_bias, spec.window_layers) == \
        ("clamped_swiglu", True, True, (True, False, True, False))
    written = spec.to_hf_config()
    assert transformers.AutoConfig.for_model(**written).rope_parameters["truncate"] is False
    assert type(spec).from_hf_config(written) == spec
    from qlm_core.kernels.clamped_swiglu import ALPHA
    from qlm_core.models.families import FAMILIES

    assert dict(FAMILIES["gpt_oss"].fixed_config) == {"attention_bias": True, "swiglu_alpha": ALPHA,
                                                      "swiglu_limit": LIMIT}
    with pytest.raises(QlmError, match="swiglu_limit is 10.0; qlm builds gpt_oss with swiglu_limit = 7.0"):
        type(spec).from_hf_config({**config, "swiglu_limit": 10.0})
    assert math.isclose(spec.rope_scaling.cos_sin_factor, 0.1 * math.log(4.0) + 1)


def test_deepspeed_files_hold_transformers_packed_experts_and_convert_back(gpt_oss, tmp_path):
    """HF -> DeepSpeed (the module as transformers' state_dict holds it: packed experts) -> Megatron -> HF."""
    from qlm_core.checkpoint.convert.deepspeed import ds_to_mcore, hf_to_ds

    assert hf_to_ds(gpt_oss, tmp_path / "ds", verify=True).verify.ok
    module = torch.load(tmp_path / "ds/global_step0/mp_rank_00_model_states.pt", weights_only=False)["module"]
    reference = transformers.AutoModelForCausalLM.from_pretrained(gpt_oss, dtype=torch.float32).state_dict()
    assert sorted(module) == sorted(reference)
    assert ds_to_mcore(tmp_path / "ds", tmp_path / "mcore", tp=2, etp=1, verify=True).verify.ok
    mcore_to_hf(tmp_path / "mcore", tmp_path / "hf")
    assert_same_hf(gpt_oss, tmp_path / "hf")


@pytest.mark.parametrize("preset, total, active", [("gpt-oss-20b", 20_914_757_184, 3.61e9),
                                                   ("gpt-oss-120b", 116_829_156_672, 5.13e9)])
def test_presets_count_what_transformers_builds_and_the_cards_active_share(preset, total, active):
    """transformers' GptOss of the preset's config.json holds `total` parameters (the model card's 20.91B and
    116.83B); the card counts the active ones without the input embedding."""
    from qlm_core.models.parameters import num_parameters
    from qlm_core.models.presets import PRESETS

    spec = PRESETS[preset]
    config = transformers.AutoConfig.for_model(**spec.to_hf_config())
    with torch.device("meta"):
        reference = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(config).parameters())
    assert reference == num_parameters(spec) == total
    embedding = spec.vocab_size * spec.hidden_size
    assert num_parameters(spec, active=True) - embedding == pytest.approx(active, rel=0.002)


def test_a_megatron_bridge_gpt_oss_run_config_reads_as_gpt_oss(tmp_path):
    """Megatron-Bridge's GPT-OSS provider fields (run_config.yaml) give the spec qlm reads from the HF config."""
    import yaml

    from qlm_core.checkpoint.formats.megatron.args import spec_from_args
    from qlm_core.checkpoint.formats.megatron.bridge_config import bridge_args

    model = {"num_layers": 4, "hidden_size": 64, "ffn_hidden_size": 32, "num_attention_heads": 4,
             "num_query_groups": 2, "kv_channels": 16, "vocab_size": 300, "normalization": "RMSNorm",
             "gated_linear_unit": True,
             "activation_func": {"_target_": "megatron.core.fusions.fused_bias_geglu.quick_gelu"},
             "glu_linear_offset": 1.0, "activation_func_clamp_value": 7.0, "add_bias_linear": True,
             "add_qkv_bias": True, "softmax_type": "learnable", "window_size": [7, 0], "window_attn_skip_freq": 2,
             "position_embedding_type": "yarn", "rotary_base": 150000.0, "yarn_rotary_scaling_factor": 4.0,
             "yarn_original_max_position_embeddings": 64, "yarn_correction_range_round_to_int": False,
             "num_moe_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 32,
             "share_embeddings_and_output_weights": False, "layernorm_epsilon": 1e-5}
    (tmp_path / "run_config.yaml").write_text(yaml.safe_dump({"model": model}))
    spec = spec_from_args(bridge_args(tmp_path / "run_config.yaml"))
    assert (spec.model_type, spec.activation, spec.attention_sinks, spec.linear_bias, spec.window_layers) == \
        ("gpt_oss", "clamped_swiglu", True, True, (True, False, True, False))
    assert (spec.rope_scaling.factor, spec.rope_scaling.original_max_position_embeddings,
            spec.rope_scaling.truncate) == (4.0, 64, False)


def test_qlm_train_sft_then_lora_on_gpt_oss_and_export(tmp_path):
    """`qlm train`: SFT of a tiny gpt-oss (its loss falls), LoRA on its attention from that run, and the merged
    export loads in transformers with qlm's logits."""
    assert_sft_then_lora_export_equals_transformers(tmp_path, "gpt_oss")


def test_checkpoint_edge_cases_are_named_and_packed_tensors_read_once(gpt_oss, tmp_path):
    """TEGroupedMLP's expert biases map to SequentialMLP's names; a missing packed tensor is named as the files name
    it; a packed tensor held both plainly and as MXFP4 is refused; a swiglu Megatron model with gpt-oss's offset is
    not read as plain swiglu; the DeepSpeed reader reads each packed tensor once for all its experts."""
    import argparse

    from qlm_core.checkpoint.formats.megatron.args import make_args, spec_from_args
    from qlm_core.checkpoint.formats.packed_experts import PackedExperts
    from qlm_core.models.layout import normalize_megatron_name

    assert normalize_megatron_name("decoder.layers.0.mlp.experts.linear_fc1.bias3") == \
        "decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.bias"
    broken = tmp_path / "broken"
    shutil.copytree(gpt_oss, broken)
    tensors = load_file(broken / "model.safetensors")
    bias = tensors.pop("model.layers.1.mlp.experts.down_proj_bias")
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(QlmError, match="tensor model.layers.1.mlp.experts.down_proj_bias is missing"):
        HFCheckpoint(broken)
    tensors["model.layers.1.mlp.experts.down_proj_bias"] = bias
    blocks, scales = mxfp4_quantised(tensors["model.layers.0.mlp.experts.down_proj"])
    tensors["model.layers.0.mlp.experts.down_proj_blocks"] = blocks
    tensors["model.layers.0.mlp.experts.down_proj_scales"] = scales
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(QlmError, match="holds model.layers.0.mlp.experts.down_proj twice"):
        HFCheckpoint(broken)
    qwen = HFCheckpoint(gpt_oss).spec.replace(model_type="qwen3_moe", activation="swiglu", linear_bias=False,
                                              attention_sinks=False, qkv_bias=False, rope_scaling=None)
    args = make_args(ModelLayout(qwen), torch.float32)
    assert spec_from_args(args).activation == "swiglu"
    with pytest.raises(QlmError, match="glu_linear_offset 1.0, which qlm's swiglu does not build"):
        spec_from_args(argparse.Namespace(**{**vars(args), "glu_linear_offset": 1.0}))

    checkpoint = HFCheckpoint(gpt_oss)
    reads = []

    class Module:  # a DeepSpeed module's whole-tensor reads
        def has(self, name):
            return name in checkpoint.names

        def dtype(self, name):
            return checkpoint.dtype(name)

        def read(self, name):
            reads.append(name)
            return checkpoint.read(name)

    source = PackedExperts(Module(), checkpoint.spec)
    for name, shape in ((n, checkpoint.shape(n)) for n in source.views):
        out = torch.empty(shape)
        source.read_into(name, 0, 0, shape[0], out)
        assert torch.equal(out, checkpoint.read(name)), name
    assert sorted(reads) == sorted(set(reads)) and len(reads) == 4 * checkpoint.spec.num_layers
