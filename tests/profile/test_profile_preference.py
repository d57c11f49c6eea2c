"""`qlm profile` on a preference recipe: a pair is two sequences of one micro-batch, a frozen reference is a second
copy of the weights, and a reference that is not precomputed runs a forward of every micro-batch."""

import dataclasses
from pathlib import Path

import pytest

from qlm_core.config import load_recipe
from qlm_core.hardware import gpu_spec
from qlm_core.profile.case import case_from_recipe
from qlm_core.profile.memory import estimate_memory
from qlm_core.profile.timing import estimate_time

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "qwen2-7b-dpo.toml"
GPU = gpu_spec("h100")


def _case(precompute: bool, lora_rank: int = 0, **parallel):
    recipe = load_recipe(RECIPE)
    recipe = dataclasses.replace(
        recipe, preference=dataclasses.replace(recipe.preference, precompute_reference=precompute),
        lora=dataclasses.replace(recipe.lora, rank=lora_rank),
        parallel=dataclasses.replace(recipe.parallel, **parallel))
    return case_from_recipe(recipe)


def test_a_pair_is_two_sequences_and_a_frozen_reference_a_second_copy():
    precomputed, frozen = _case(True), _case(False)
    assert precomputed.micro_batch_size == 2 * load_recipe(RECIPE).train.micro_batch_size
    assert (frozen.reference_copy, frozen.reference_forward) == (True, True)
    assert (precomputed.reference_copy, precomputed.reference_forward) == (False, False)
    weights = [estimate_memory(c, GPU.memory_gib).heaviest.components["weights"] for c in (precomputed, frozen)]
    assert weights[1] == pytest.approx(2 * weights[0], rel=0.01)  # bf16 policy + bf16 frozen copy


@pytest.mark.parametrize("parallel", [{}, {"pp": 2, "tp": 2, "cp": 1}, {"tp": 4, "sp": False},
                                      {"pp": 2, "tp": 2, "cp": 1, "pp_schedule": "zero_bubble"}],
                         ids=["tp4_cp2", "tp2_pp2", "tp4_no_sp", "tp2_pp2_zero_bubble"])
def test_the_reference_forward_costs_about_a_forward(parallel):
    """The frozen copy's forward: a third of the policy's forward + backward GEMMs and attention (its GEMMs at the
    same rates), plus its forward collectives; the precomputed table costs nothing per step."""
    precomputed, frozen = _case(True, **parallel), _case(False, **parallel)
    assert estimate_time(precomputed, GPU).components["reference"] == 0
    step = {c.reference_forward: estimate_time(c, GPU) for c in (precomputed, frozen)}
    reference = step[True].components["reference"]
    assert reference > 0.25 * step[False].components["compute"]
    assert reference < 0.6 * step[False].components["compute"]
    added = step[True].step_s - step[False].step_s
    if frozen.parallel.pp == 1:
        assert added == pytest.approx(reference)
    else:  # the reference's own forward-only schedule adds (p-1)/v of it, which zero-bubble recovers none of
        p = frozen.parallel
        bubble = step[True].components["pp_bubble"] - step[False].components["pp_bubble"]
        assert bubble == pytest.approx(reference / frozen.num_microbatches * (p.pp - 1) / p.vpp)
        assert added == pytest.approx(reference + bubble)


def test_lora_runs_the_policy_without_adapters_as_its_reference():
    lora = _case(False, lora_rank=16)
    assert (lora.reference_copy, lora.reference_forward) == (False, True)
    assert estimate_time(lora, GPU).components["reference"] > 0


TINY_DPO = Path(__file__).resolve().parents[2] / "recipes" / "tiny-dpo.toml"


@pytest.mark.parametrize("precompute, lora_rank", [(False, 0), (True, 0), (False, 4)],
                         ids=["frozen", "precomputed", "adapters_off"])
def test_the_probe_trains_pairs_with_the_reference_the_run_would_have(precompute, lora_rank):
    """`qlm profile --probe` on a DPO recipe runs the trainer's preference step: the frozen copy is measured in
    `weights` as it is predicted, and the pairs' activations as the policy's (the reference forward keeps none)."""
    from qlm_core.profile.probe import probe

    recipe = load_recipe(TINY_DPO)
    recipe = dataclasses.replace(
        recipe, model=dataclasses.replace(recipe.model, load=""),
        preference=dataclasses.replace(recipe.preference, precompute_reference=precompute),
        lora=dataclasses.replace(recipe.lora, rank=lora_rank))
    result = probe(case_from_recipe(recipe, num_gpus=1), GPU, steps=2)
    for key in ("weights", "grads", "optimizer"):
        assert result.error(key) == pytest.approx(0, abs=1e-6), key
    assert abs(result.error("logits_loss")) < 1e-3  # the pair's per-row sums besides the loss head's
    assert abs(result.error("activations")) < 0.05


def test_a_recipe_without_dp_names_the_device_count_it_assumed(run_qlm):
    code, _, err = run_qlm("profile", str(TINY_DPO))
    assert code == 2
    assert "at 32 GPUs (dp 32)" in err and "--num-gpus" in err, err


def test_the_reference_is_one_forward_at_one_rank():
    """tp = cp = pp = 1: exactly the forward's GEMMs, attention, a third of the elementwise work and the logits."""
    from qlm_core.models.flops import layer_flops_per_token
    from qlm_core.profile.timing import (
        Efficiency,
        elementwise_seconds,
        gemm_seconds,
        logits_gemm_seconds,
        microbatch_times,
    )

    case = _case(False, tp=1, sp=False, cp=1)
    rates, peak = Efficiency().rates(GPU), GPU.peak_tflops * 1e12
    tokens, layers = case.micro_batch_size * case.seq_len, case.layout().stage_layer_counts[0]
    attention = tokens * layer_flops_per_token(case.spec, case.seq_len, case.mean_doc_len)[1] / (peak * rates.attn_fwd)
    gemm = tokens * layers * sum(gemm_seconds(case, rates, peak).values())
    elementwise = tokens * layers * sum(elementwise_seconds(case, rates, GPU).values())
    logits = tokens * logits_gemm_seconds(case, rates, peak)
    expected = gemm + layers * attention + elementwise / 3 + logits
    assert microbatch_times(case, GPU, rates, 0)["reference"] == pytest.approx(expected, rel=1e-12)


def test_command_line_sizes_count_pairs_and_lora_picks_the_reference():
    from qlm_core.errors import QlmError
    from qlm_core.profile.case import build_case, validate_case

    recipe = load_recipe(TINY_DPO)
    case = build_case(recipe, micro_batch_size=3, global_batch_size=6, num_gpus=1)
    assert (case.micro_batch_size, case.global_batch_size) == (6, 12)
    assert build_case(recipe, lora_rank=4, num_gpus=1).preference_reference == "adapters_off"
    lora_recipe = dataclasses.replace(recipe, lora=dataclasses.replace(recipe.lora, rank=4))
    assert build_case(lora_recipe, lora_rank=0, num_gpus=1).preference_reference == "frozen"
    with pytest.raises(QlmError, match="preference training takes dense models"):
        validate_case(build_case(recipe, model="qwen3-30b-a3b", num_gpus=1))
