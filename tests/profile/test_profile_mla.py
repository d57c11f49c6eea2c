"""qlm profile for multi-latent attention in one process: an MLA layer's saved bytes equal the saved-tensor
measurement byte for byte (q's low rank or not, values narrower than keys or not; recompute none / selective
core_attn, layernorm, mlp / full / op; bf16 and fp32), an in-process --probe of a tiny DeepSeek-V3-shaped model,
MLA's FLOPs and its decoding cache."""

import dataclasses

import pytest
import torch
from parallel_cases import MLA
from test_profile_moe import _held_by_layer

from qlm_core.config import ParallelConfig
from qlm_core.hardware import gpu_spec
from qlm_core.models.flops import layer_flops_per_token
from qlm_core.models.gpt import GPTModel, ParallelOptions
from qlm_core.profile.activations import ActivationInputs, forward_terms, layer_bytes
from qlm_core.profile.attention_terms import kv_cache_entries
from qlm_core.profile.case import ProfileCase
from qlm_core.profile.measure import SavedTensorMeter
from qlm_core.profile.probe import probe

SEQ, BATCH = 64, 2
RECOMPUTES = [("none", ()), ("selective", ("core_attn",)), ("selective", ("layernorm",)), ("selective", ("mlp",)),
              ("full", ()), ("op", ())]


def mla_spec(q_lora_rank, v_head_dim):
    return MLA.replace(num_layers=3, mla=dataclasses.replace(MLA.mla, q_lora_rank=q_lora_rank, v_head_dim=v_head_dim),
                       moe=dataclasses.replace(MLA.moe, layer_pattern=()))


def measure(spec, recompute, modules, dtype):
    model = GPTModel(spec, parallel=ParallelOptions(recompute=recompute, recompute_modules=modules), num_layers=3,
                     dtype=dtype)
    g = torch.Generator().manual_seed(0)
    ids, labels = (torch.randint(0, spec.vocab_size, (BATCH, SEQ), generator=g) for _ in range(2))
    with SavedTensorMeter(model) as meter:
        loss = model(ids, labels=labels).sum()
        held = _held_by_layer(meter)
        loss.backward()
    # the meter does not see the norms' discarded outputs go (recompute of layernorm), for any attention kind
    assert meter.live_bytes == 0 or "layernorm" in modules
    return held


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("recompute, modules", RECOMPUTES, ids=[f"{r}-{'-'.join(m)}" for r, m in RECOMPUTES])
@pytest.mark.parametrize("q_lora_rank, v_head_dim", [(24, 8), (None, 12)], ids=["q_lora-narrow_v", "q_proj-equal_v"])
def test_mla_layer_bytes_equal_saved_tensors(q_lora_rank, v_head_dim, recompute, modules, dtype):
    spec = mla_spec(q_lora_rank, v_head_dim)
    held = measure(spec, recompute, modules or ("core_attn",), dtype)
    x = ActivationInputs(spec, SEQ, BATCH, dtype_bytes=dtype.itemsize, device="cpu",
                         recompute_modules=modules or ("core_attn",))
    assert layer_bytes(x, recompute) == held["layer1"] == held["layer2"]
    if recompute == "none":  # the first layer also holds the rotary part's cos and sin for every layer
        assert layer_bytes(x, recompute) + forward_terms(x, False)["rope cos/sin"] == held["layer0"]


def test_probe_of_an_mla_model_measures_what_is_predicted():
    """`qlm profile --probe` on CPU: the DeepSeek-V3-shaped model (dense first layer, group-limited sigmoid routing
    with the correction bias, a shared expert) allocates the predicted model states and saves the predicted
    activations."""
    case = ProfileCase(spec=MLA, model_name="tiny-mla", parallel=ParallelConfig(zero_stage=1), seq_len=128,
                       global_batch_size=2, num_gpus=1)
    result = probe(case, gpu_spec("a100-80g"), steps=1)
    for key in ("weights", "grads", "optimizer"):
        assert result.predicted[key] == result.measured[key], key
    assert result.predicted["activations"] == pytest.approx(result.measured["activations"], rel=0.01)


def test_mla_flops_and_cache():
    """Per token: q down/up, kv down/up and the output projection; QK^T over the q/k head and AV over the value
    head; the cache keeps the latent and the rotary key part."""
    spec = MLA
    h, heads, m = spec.hidden_size, spec.num_attention_heads, spec.mla
    projections = (h * m.q_lora_rank + m.q_lora_rank * heads * m.q_head_dim + h * (m.kv_lora_rank + m.qk_rope_head_dim)
                   + m.kv_lora_rank * heads * (m.qk_nope_head_dim + m.v_head_dim) + heads * m.v_head_dim * h)
    matmuls, attention = layer_flops_per_token(spec, 0, keys=100)
    assert matmuls == pytest.approx(2 * projections + 2 * 3 * h * spec.ffn_hidden_size, rel=1e-12)
    assert attention == pytest.approx(2 * 100 * heads * (m.q_head_dim + m.v_head_dim), rel=1e-12)
    assert kv_cache_entries(spec) == m.kv_lora_rank + m.qk_rope_head_dim
