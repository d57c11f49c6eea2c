"""Finer recompute: Megatron's recompute_modules (core_attn, mlp, layernorm, with recompute = "selective") and
torchtitan's per-op policy (recompute = "op"). Each reproduces the one-process gradients of no recompute exactly,
keeps what the saved-tensor meter measures and what profile/activations.py predicts, per layer, and is accepted by
the recipe and by `qlm profile`. (Multi-rank parity: tests/parallel_cases.py recompute_modules_all, recompute_op,
pp2_recompute_mlp_layernorm; TP + SP per-layer bytes: tests/workers/profile_worker.py.)"""

import json

import pytest
import torch
from conftest import call_qlm
from parallel_cases import SPEC

from qlm_core.config import recipe_from_dict
from qlm_core.errors import QlmError
from qlm_core.models.gpt import GPTModel, ParallelOptions
from qlm_core.profile.activations import ActivationInputs, layer_bytes
from qlm_core.profile.measure import SavedTensorMeter

OPTIONS = {  # name: (recompute, recompute_modules)
    "none": ("none", ("core_attn",)),
    "selective": ("selective", ("core_attn",)),
    "mlp": ("selective", ("mlp",)),
    "layernorm": ("selective", ("layernorm",)),
    "all_modules": ("selective", ("core_attn", "mlp", "layernorm")),
    "op": ("op", ("core_attn",)),
    "full": ("full", ("core_attn",)),
}
SEQ, ROWS = 32, 2


def batch():
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, SPEC.vocab_size, (ROWS, SEQ), generator=g), torch.randint(0, SPEC.vocab_size, (ROWS, SEQ),
                                                                                       generator=g)


def model(name: str, dtype=torch.float32) -> GPTModel:
    recompute, modules = OPTIONS[name]
    m = GPTModel(SPEC, parallel=ParallelOptions(recompute=recompute, recompute_modules=modules), num_layers=3,
                 dtype=dtype)
    m.reset_parameters(generator=torch.Generator().manual_seed(1))
    return m


def loss_and_grads(name: str):
    m = model(name)
    ids, labels = batch()
    loss = m(ids, labels=labels).sum()
    loss.backward()
    return loss.item(), {n: p.grad for n, p in m.named_parameters()}


@pytest.mark.parametrize("name", [n for n in OPTIONS if n != "none"])
def test_recompute_reproduces_the_gradients_of_no_recompute(name):
    ref_loss, ref_grads = loss_and_grads("none")
    loss, grads = loss_and_grads(name)
    assert loss == ref_loss
    for key, grad in grads.items():
        assert torch.equal(grad, ref_grads[key]), (name, key)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("name", OPTIONS)
def test_saved_bytes_per_layer_match_the_formula(name, dtype):
    m = model(name, dtype)
    ids, labels = batch()
    with SavedTensorMeter(m) as meter:
        loss = m(ids, labels=labels).sum()
    loss.backward()
    recompute, modules = OPTIONS[name]
    x = ActivationInputs(SPEC, SEQ, ROWS, dtype_bytes=dtype.itemsize, device="cpu", recompute_modules=modules)
    assert meter.layer_bytes()["layer1"] == pytest.approx(layer_bytes(x, recompute), rel=0.02), name


def test_finer_recompute_keeps_less_than_selective():
    x = ActivationInputs(SPEC, SEQ, ROWS, dtype_bytes=2, device="cpu")
    kept = {name: layer_bytes(ActivationInputs(SPEC, SEQ, ROWS, dtype_bytes=2, device="cpu", recompute_modules=m), r)
            for name, (r, m) in OPTIONS.items()}
    assert kept["full"] < kept["all_modules"] < kept["mlp"] < kept["selective"] < kept["none"]
    assert kept["op"] < kept["selective"] and kept["layernorm"] < kept["selective"]
    assert layer_bytes(x, "selective") == kept["selective"]  # the default modules are today's selective


def test_recipe_reads_recompute_modules_and_names_a_bad_one():
    parallel = recipe_from_dict({"parallel": {"recompute": "selective",
                                              "recompute_modules": ["mlp", "layernorm"]}}).parallel
    assert parallel.recompute_modules == ["mlp", "layernorm"]
    assert recipe_from_dict({}).parallel.recompute_modules == ["core_attn"]
    assert recipe_from_dict({"parallel": {"recompute": "op"}}).parallel.recompute == "op"
    with pytest.raises(QlmError, match=r"parallel.recompute_modules\[1\] 'moe_act' is not one of core_attn, mlp"):
        recipe_from_dict({"parallel": {"recompute_modules": ["mlp", "moe_act"]}})


def test_profile_takes_the_new_options():
    common = ["profile", "--model", "qwen2-7b", "--seq-len", "8192", "--num-gpus", "4", "--tp", "4", "--sp", "--json"]
    kept = {}
    for name, extra in {"selective": ["--recompute", "selective"],
                        "modules": ["--recompute", "selective", "--recompute-modules", "core_attn,mlp,layernorm"],
                        "op": ["--recompute", "op"]}.items():
        code, out, err = call_qlm(*common, *extra)
        assert code == 0, err
        kept[name] = json.loads(out)["memory"]["components_gib"]["activations"]
    assert kept["modules"] < kept["op"] < kept["selective"]
    code, _, err = call_qlm(*common, "--recompute", "selective", "--recompute-modules", "core_attn,moe")
    assert code == 2 and "'moe' is not one of core_attn, mlp, layernorm" in err


def test_op_under_zero_bubble_is_refused_before_anything_runs():
    code, _, err = call_qlm("profile", "--model", "qwen2-7b", "--seq-len", "4096", "--num-gpus", "8", "--tp", "4",
                            "--pp", "2", "--sp", "--pp-schedule", "zero_bubble", "--recompute", "op")
    assert code == 2 and 'recompute "op" cannot run under pp_schedule zero_bubble' in err
    assert err.count("\n") == 1  # one line
