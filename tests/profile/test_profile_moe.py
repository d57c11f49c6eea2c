"""qlm profile for MoE and Qwen3 models in one process: the MoE layer's and the q/k norms' saved bytes equal the
saved-tensor measurement byte for byte (none / selective mlp / full / op, a gated shared expert, the aux-loss graphs,
the grouped kernel's row padding and its per-expert fallback), an in-process --probe of a tiny MoE model, total and
active parameters in the report, the FLOP counts (qlm's and Megatron-LM's convention) from active parameters, and
the time model costing experts by top-k."""

import dataclasses
import json

import pytest
import torch

from qlm_core.config import MoeConfig, ParallelConfig
from qlm_core.hardware import gpu_spec
from qlm_core.models.flops import flops_per_sequence, megatron_flops_per_sequence
from qlm_core.models.gpt import GPTModel, ParallelOptions
from qlm_core.models.moe_spec import MoeSpec
from qlm_core.models.parameters import num_parameters
from qlm_core.models.presets import PRESETS
from qlm_core.models.spec import ModelSpec
from qlm_core.profile.activations import ActivationInputs, forward_terms, layer_bytes, layer_terms
from qlm_core.profile.case import ProfileCase, build_case, case_from_dict, case_to_dict
from qlm_core.profile.measure import SavedTensorMeter
from qlm_core.profile.memory import activation_inputs, estimate_memory
from qlm_core.profile.probe import probe
from qlm_core.profile.report import model_dict, parameters_line
from qlm_core.profile.timing import Efficiency, estimate_time, microbatch_times

BASE = dict(vocab_size=300, hidden_size=64, ffn_hidden_size=96, num_layers=3, num_attention_heads=4,
            num_query_groups=2, kv_channels=16, max_position_embeddings=256, rope_theta=10000.0, norm_epsilon=1e-6,
            tie_word_embeddings=False)
# Qwen3-MoE: q/k norms, top-k then softmax; Qwen2-MoE: pre-softmax routing, a gated shared expert, qkv bias
QWEN3_MOE = ModelSpec(model_type="qwen3_moe", qkv_bias=False, qk_layernorm=True, moe=MoeSpec(8, 2, 32), **BASE)
QWEN2_MOE = ModelSpec(model_type="qwen2_moe", qkv_bias=True, **BASE, moe=MoeSpec(
    8, 2, 32, pre_softmax=True, shared_expert_hidden_size=48, shared_expert_gate=True))
QWEN3 = ModelSpec(model_type="qwen3", qkv_bias=False, qk_layernorm=True, **BASE)
# ERNIE 4.5 MoE: softmax scores chosen with a correction bias, renormalised; an ungated shared expert
ERNIE_MOE = ModelSpec(model_type="ernie4_5_moe", qkv_bias=False, rotary_interleaved=True, **BASE, moe=MoeSpec(
    8, 2, 32, expert_bias=True, shared_expert_hidden_size=32))
SPECS = {"qwen3_moe": QWEN3_MOE, "qwen2_moe": QWEN2_MOE, "ernie4_5_moe": ERNIE_MOE}
SEQ, BATCH = 64, 2


def _held_by_layer(meter: SavedTensorMeter) -> dict[str, int]:
    """Bytes each layer still holds for backward (a storage by the layer that first saved it); unlike
    meter.layer_bytes() this leaves out what a layer saved and freed within its forward (the unused loss graphs)."""
    held: dict[str, int] = {}
    for nbytes, label, _ in meter.live.values():
        held[label] = held.get(label, 0) + nbytes
    return held


def _measure(spec, recompute="none", dtype=torch.bfloat16, seq=SEQ, batch=BATCH, moe_options=None):
    model = GPTModel(spec, parallel=ParallelOptions(recompute=recompute, recompute_modules=("mlp",)), num_layers=3,
                     dtype=dtype, moe_options=moe_options)
    g = torch.Generator().manual_seed(0)
    ids, labels = (torch.randint(0, spec.vocab_size, (batch, seq), generator=g) for _ in range(2))
    with SavedTensorMeter(model) as meter:
        loss = model(ids, labels=labels).sum()
        held = _held_by_layer(meter)
        loss.backward()
    assert meter.live_bytes == 0  # everything saved was released by backward
    return held


def _inputs(spec, dtype=torch.bfloat16, seq=SEQ, batch=BATCH, **kwargs):
    return ActivationInputs(spec, seq, batch, dtype_bytes=dtype.itemsize, device="cpu", recompute_modules=("mlp",),
                            **kwargs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("recompute", ["none", "op"])
@pytest.mark.parametrize("kind", sorted(SPECS))
def test_moe_layer_bytes_equal_saved_tensors(kind, recompute, dtype):
    spec = SPECS[kind]
    held = _measure(spec, recompute, dtype)
    x = _inputs(spec, dtype)
    assert layer_bytes(x, recompute) == held["layer1"] == held["layer2"]
    assert layer_bytes(x, recompute) + forward_terms(x, False)["rope cos/sin"] == held["layer0"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_recomputed_moe_layers_keep_their_checkpoints(dtype):
    """Selective recompute of `mlp` keeps the MoE layer's input (Qwen3's q/k norm terms stay: they are attention's);
    full recompute keeps the layer input."""
    for kind, spec in SPECS.items():
        x = _inputs(spec, dtype)
        for recompute in ("selective", "full"):
            held = _measure(spec, recompute, dtype)
            assert layer_bytes(x, recompute) == held["layer1"] == held["layer2"], (kind, recompute)
        assert "sorted tokens (expert fc1 input)" in layer_terms(x, "none")
        assert "sorted tokens (expert fc1 input)" not in layer_terms(x, "selective")


@pytest.mark.parametrize("kind", sorted(SPECS))
def test_moe_loss_graphs_are_kept_while_a_coefficient_is_set(kind):
    spec = SPECS[kind]
    held = _measure(spec, moe_options=MoeConfig(aux_loss_coeff=0.01))
    x = _inputs(spec, moe_losses=True)
    assert layer_terms(x)["aux / z-loss graphs (fp32)"] > 0
    assert layer_bytes(x) == held["layer1"]


@pytest.mark.parametrize("expert_ffn, seq", [(32, 61), (30, SEQ)], ids=["padded-rows", "per-expert-loop"])
def test_grouped_kernel_padding_and_fallback(expert_ffn, seq):
    """61 tokens x top-2 = 122 rows: the grouped GEMM pads its outputs to 128; an expert size of 30 bf16 elements
    (60 bytes) is not 16-byte aligned, so the kernel loops over experts and pads nothing."""
    spec = QWEN3_MOE.replace(moe=MoeSpec(8, 2, expert_ffn))
    held = _measure(spec, seq=seq, batch=1)
    x = _inputs(spec, seq=seq, batch=1)
    assert layer_bytes(x) == held["layer1"]


@pytest.mark.parametrize("groups", [2, 4], ids=["q-copied", "q-view"])
def test_qwen3_qk_norm_bytes_equal_saved_tensors(groups):
    """q's norm keeps its own copy when the rank's heads span several groups of several heads, else a view."""
    spec = QWEN3.replace(num_query_groups=groups)
    held = _measure(spec)
    x = _inputs(spec)
    assert layer_terms(x)["q norm input"] == (0 if groups == 4 else 2 * 4 * 16 * SEQ * BATCH)
    assert layer_bytes(x) == held["layer1"]


def test_probe_of_an_moe_model_measures_what_is_predicted():
    """`qlm profile --probe` on CPU: the scaled-down MoE model (a gated shared expert, q/k norms, one dense layer
    among MoE layers) allocates exactly the predicted model states and saves the predicted activations."""
    spec = QWEN2_MOE.replace(num_layers=4, qk_layernorm=True, moe=MoeSpec(
        8, 2, 32, pre_softmax=True, shared_expert_hidden_size=48, shared_expert_gate=True, layer_pattern=(1, 0, 1, 1)))
    case = ProfileCase(spec=spec, model_name="tiny-moe", parallel=ParallelConfig(zero_stage=1), seq_len=128,
                       global_batch_size=2, num_gpus=1)
    result = probe(case, gpu_spec("a100-80g"), steps=1)
    assert result.case.spec.moe.layer_pattern == (1, 0)  # 2 layers per chunk, the pattern's first two
    for key in ("weights", "grads", "optimizer"):
        assert result.predicted[key] == result.measured[key], key
    assert result.predicted["activations"] == pytest.approx(result.measured["activations"], rel=0.01)


def test_report_has_total_and_active_parameters():
    case = build_case(model="qwen3-30b-a3b", seq_len=4096, num_gpus=8, tp=2)
    model = model_dict(case)
    assert model["parameters"] == num_parameters(PRESETS["qwen3-30b-a3b"]) > 30e9
    assert 3.2e9 < model["active_parameters"] < 3.4e9  # Qwen3-30B-A3B: 3.3B activated
    assert model["moe"] == {"num_experts": 128, "topk": 8, "ffn_hidden_size": 768, "shared_expert_hidden_size": 0,
                            "moe_layers": None}
    assert "30.53B total, 3.35B active" in parameters_line(case.spec)
    assert model_dict(build_case(model="qwen3-8b"))["moe"] is None


def test_case_round_trips_with_moe():
    """The probe hands its case to worker ranks as JSON."""
    case = build_case(model="qwen2-57b-a14b").replace(moe=MoeConfig(aux_loss_coeff=1e-3))
    case = case.replace(spec=case.spec.replace(moe=MoeSpec(8, 2, 32, layer_pattern=(0, 1) * 14)))
    assert case_from_dict(json.loads(json.dumps(case_to_dict(case)))) == case


def test_flops_count_active_parameters():
    """Each token runs top-k experts, the shared expert, the router and its gate: qlm's count is 6·(active
    matmul parameters) + attention; Megatron-LM's counts k·F + S per MoE layer and no router."""
    spec = PRESETS["qwen1.5-moe-a2.7b"]
    s, h, L, moe = 4096, spec.hidden_size, spec.num_layers, spec.moe
    embeddings = 2 * spec.vocab_size * h
    norms = L * 2 * h + h
    matmuls = num_parameters(spec, active=True) - embeddings - norms - L * spec.qkv_rows  # no qkv bias FLOPs
    attention = 2 * 2 * (s / 2) * spec.num_attention_heads * spec.kv_channels * L
    logits = 2 * h * spec.vocab_size
    assert flops_per_sequence(spec, s) == pytest.approx(3 * s * (2 * matmuls + attention + logits), rel=1e-12)
    a, g, q = spec.num_attention_heads, spec.num_query_groups, spec.num_attention_heads * spec.kv_channels
    megatron = 12 * s * L * h * h * ((1 + g / a + s / h) * q / h
                                     + 1.5 * (moe.topk * moe.ffn_hidden_size + moe.shared_expert_hidden_size) / h)
    assert megatron_flops_per_sequence(spec, s) == pytest.approx(megatron + 6 * s * h * spec.vocab_size, rel=1e-12)
    every_expert = spec.replace(moe=dataclasses.replace(moe, topk=moe.num_experts))
    assert flops_per_sequence(every_expert, s) > 3 * flops_per_sequence(spec, s)  # 4 of 60 experts run, not 60


def _case(spec, **parallel) -> ProfileCase:
    return build_case(model="qwen3-30b-a3b", seq_len=4096, num_gpus=8, **parallel).replace(spec=spec)


def test_expert_time_follows_topk_not_the_number_of_experts():
    gpu, spec = gpu_spec("a100-80g"), PRESETS["qwen3-30b-a3b"]
    base = microbatch_times(_case(spec, tp=2, sp=True), gpu, Efficiency(), 0)
    more_experts = spec.replace(moe=MoeSpec(256, 8, 768))
    more_topk = spec.replace(moe=MoeSpec(128, 16, 768))
    # 256 experts: only the router's GEMM grows
    assert base["compute"] < microbatch_times(_case(more_experts, tp=2, sp=True), gpu, Efficiency(), 0)["compute"] \
        < 1.05 * base["compute"]
    assert microbatch_times(_case(more_topk, tp=2, sp=True), gpu, Efficiency(), 0)["compute"] > 1.2 * base["compute"]
    # the MoE layer's collectives: tokens gathered, outputs reduce-scattered, probabilities and choices gathered
    assert base["tp_comm"] > 0


def test_moe_profile_is_sensible_on_h100():
    case = build_case(model="qwen3-30b-a3b", seq_len=4096, num_gpus=8, tp=2, pp=2, zero_stage=1,
                      recompute="selective")
    gpu = gpu_spec("h100")
    time, memory = estimate_time(case, gpu), estimate_memory(case, gpu.memory_gib)
    assert 0.1 < time.mfu < 0.5 and time.megatron_mfu > time.mfu
    heavy = memory.heaviest
    x = activation_inputs(case)
    assert heavy.activation_per_layer == layer_bytes(x, "selective", moe_layer=True)
    terms = layer_terms(x, "selective")  # tp 2 without SP: the experts' rows are all T·k, their FFN split
    assert terms["sorted tokens (expert fc1 input)"] == 2 * 2048 * 4096 * 8
    assert terms["expert fc1 output"] == 2 * 768 * 4096 * 8 and terms["q/k norm 1/rms (fp32)"] == 4 * 18 * 4096
