"""The profile's time of an RL step (profile/rl_timing.py): the weight sync, the leaders' KV-cache decoding and the
reward models beside the training pass, each checked against its formula worked by hand; and the search weighs them
(more data-parallel leaders decode a step's completions in parallel)."""

from __future__ import annotations

import pytest

from qlm_core.config import ParallelConfig
from qlm_core.hardware import GPUS
from qlm_core.models.parameters import num_parameters
from qlm_core.models.presets import PRESETS
from qlm_core.profile.case import ProfileCase
from qlm_core.profile.efficiency import Efficiency
from qlm_core.profile.rl_timing import RL_COMPONENTS
from qlm_core.profile.timing import TIME_COMPONENTS, estimate_time

GPU = GPUS["h100"]
SPEC = PRESETS["qwen3-8b"]


def rl_case(**fields) -> ProfileCase:
    base = dict(spec=SPEC, model_name="qwen3-8b", parallel=ParallelConfig(zero_stage=1), seq_len=3072,
                micro_batch_size=1, global_batch_size=64, num_gpus=8, dtype="bf16", rl=True, rl_completion_tokens=2048)
    return ProfileCase(**{**base, **fields})


def test_a_language_model_step_has_no_rl_time():
    times = estimate_time(rl_case(rl=False), GPU).components
    assert set(RL_COMPONENTS) <= set(TIME_COMPONENTS) == set(times)
    assert all(times[key] == 0 for key in RL_COMPONENTS)


def test_decoding_one_completion_at_a_time_reads_the_weights_and_the_cache_each_step():
    """One completion per leader (batch 1): each decode step is bound by HBM (the weights, then the cache up to
    that token), the prefill by the GEMMs; the sum over the 2047 steps is exact (the cost is linear in the context)."""
    case = rl_case(global_batch_size=8, rl_completion_tokens=2048)  # dp 8: one completion a leader
    rates = Efficiency().rates(GPU)
    weights = 2 * num_parameters(SPEC)
    kv = SPEC.num_layers * 2 * SPEC.num_query_groups * SPEC.kv_channels * 2  # bytes a token adds to the cache
    prompt, steps = 3072 - 2048, 2047
    reads = steps * weights + kv * (steps * prompt + steps * (steps + 1) / 2)
    generate = estimate_time(case, GPU).components["rl_generate"]
    prefill = generate - reads / (GPU.hbm_gbps * 1e9)
    assert 0 < prefill < 0.05 * generate  # the prefill of 1024 tokens: a small part next to 2047 reads of 16 GB
    gemm_rate = GPU.peak_tflops * 1e12 * rates.gemm(SPEC.hidden_size, SPEC.ffn_hidden_size)
    assert prefill == pytest.approx(2 * num_parameters(SPEC) * prompt / gemm_rate, rel=0.15)  # + attention


def test_more_leaders_share_the_decoding_and_a_batch_bound_adds_passes():
    """The leaders decode their shares at once: dp 8 decodes an eighth of dp 1's completions per leader (at batch 8
    each step costs about what batch 64's does: the weights' reads dominate); rollout_batch_size = 8 at dp 1 runs
    8 passes of 8 instead of one of 64."""
    one = estimate_time(rl_case(num_gpus=1), GPU).components["rl_generate"]
    eight = estimate_time(rl_case(num_gpus=8), GPU).components["rl_generate"]
    bounded = estimate_time(rl_case(num_gpus=1, rl_batch_rows=8), GPU).components["rl_generate"]
    assert eight < one < bounded
    assert bounded == pytest.approx(8 * eight, rel=1e-9)  # 8 passes of batch 8, each a dp-8 leader's one pass


def test_a_group_prompt_is_prefilled_once_when_the_decode_batches_hold_whole_groups():
    """generate_groups prefills a group's prompt once and copies its cache to the group's rows: with one new token
    (no decoding steps, only the prefill) 8 completions a prompt cost an eighth of 8 prompts; a decode batch bound
    that splits groups (12 rows of groups of 8) prefills every row, as the decoder then does. The rollout's
    prefill working set shrinks alike."""
    from qlm_core.profile.memory import estimate_memory

    def prefill(**fields):
        return estimate_time(rl_case(rl_completion_tokens=1, **fields), GPU).components["rl_generate"]

    assert prefill(rl_generations=8) == pytest.approx(prefill() / 8, rel=1e-12)
    assert prefill(rl_generations=8, rl_batch_rows=12) == pytest.approx(prefill(rl_batch_rows=12), rel=1e-12)
    assert prefill(rl_generations=8, rl_batch_rows=16) == pytest.approx(prefill(rl_batch_rows=16) / 8, rel=1e-12)
    # a share of 6 in groups of 4 (a scaled-down probe's): the decoder answers each row on its own
    assert rl_case(rl_generations=4, rl_batch_rows=4).rl_prefill_rows(4, 6) == 4

    def rollout(**fields):
        return estimate_memory(rl_case(num_gpus=1, **fields), 80).stages[0].components["rollout"]

    assert rollout(rl_generations=8) < rollout()


def test_the_weight_sync_moves_the_model_and_the_reward_models_run_forward():
    """Sync: the model's bytes read and written once on the leader, over the replica (tp 2) and to the other leaders
    (dp 4); a reward model of N parameters costs 2 N FLOPs per token of every completion of the leader."""
    rates = Efficiency().rates(GPU)
    model = 2 * num_parameters(SPEC)
    case = rl_case(parallel=ParallelConfig(tp=2, sp=True, zero_stage=1), rl_reward_model_params=10**9)
    times = estimate_time(case, GPU).components
    nvlink = GPU.nvlink_gbps * 1e9 * rates.comm
    assert times["rl_sync"] == pytest.approx(2 * model / (GPU.hbm_gbps * 1e9) + 2 * model / nvlink, rel=1e-9)
    reward = 2 * 10**9 * (64 // 4) * 3072 / (GPU.peak_tflops * 1e12 * rates.gemm_max)
    assert times["rl_reward"] == pytest.approx(reward, rel=1e-9)
    assert estimate_time(rl_case(), GPU).components["rl_reward"] == 0  # reward functions only


def test_the_grpo_recipe_fits_and_decodes_on_every_gpu():
    """recipes/qwen3-8b-grpo.toml (the search's pick on 8 H100s) fits, and decodes faster than tp2·cp2·dp2 (the
    recipe's layout before decoding was in the profile) does with its two leaders, which fits too."""
    from pathlib import Path

    from qlm_core.config import load_recipe
    from qlm_core.profile.case import build_case, validate_case
    from qlm_core.profile.memory import estimate_memory

    recipe = load_recipe(Path(__file__).resolve().parents[2] / "recipes" / "qwen3-8b-grpo.toml")
    pick = build_case(recipe, num_gpus=8)
    validate_case(pick)
    two_leaders = pick.with_parallel(tp=2, sp=True, cp=2, zero_stage=1, recompute="none")
    assert estimate_memory(pick, GPU.memory_gib).fits and estimate_memory(two_leaders, GPU.memory_gib).fits
    assert pick.sizes.dp == 8 and two_leaders.sizes.dp == 2
    times = estimate_time(pick, GPU).components, estimate_time(two_leaders, GPU).components
    assert times[0]["rl_generate"] < times[1]["rl_generate"] / 3
    assert sum(times[0].values()) < sum(times[1].values())


def _probe(num_gpus: int, **parallel):
    from pathlib import Path

    from qlm_core.config import load_recipe
    from qlm_core.profile.case import build_case
    from qlm_core.profile.probe import probe

    recipe = load_recipe(Path(__file__).resolve().parents[2] / "recipes" / "tiny-grpo.toml")
    return probe(build_case(recipe, num_gpus=num_gpus, **parallel), GPU, steps=3)


def _check_probe(result):
    """Every measured component within 10% of the prediction, the rollout's among them; the leaders' sync and
    decoding timed."""
    assert "rollout" in result.measured and result.measured["rollout"] > 0
    for key in result.measured_keys:
        assert result.error(key) == pytest.approx(0.0, abs=0.10), (key, result.predicted[key], result.measured[key])
    assert set(result.rl_times) == {"rl_sync", "rl_generate"}
    assert all(predicted > 0 and measured > 0 for predicted, measured in result.rl_times.values())


def test_the_probe_runs_an_rl_step_and_measures_its_rollout():
    """`qlm profile recipes/tiny-grpo.toml --probe --num-gpus 1`: the rollout model is measured beside the
    training states and activations."""
    _check_probe(_probe(1))


@pytest.mark.distributed
def test_the_probe_runs_an_rl_step_at_dp2():
    """Two leaders, each decoding its half of the completions on the weights rank 0 broadcast to both. (At tp2 the
    tiny model's decoding and training peaks come within a few percent of each other, where the rollout's excess
    over training is a difference of two near-equal measurements.)"""
    result = _probe(2)
    assert result.case.sizes.dp == 2
    _check_probe(result)


def test_the_moe_grpo_recipe_fits_with_its_routes_replayed():
    """recipes/qwen1.5-moe-a2.7b-grpo.toml (the search's pick on 8 H100s): an MoE policy whose whole rollout model
    (26.7 GiB) fits beside ZeRO 3's shards, its decoding's KV cache, prefill and one synced bucket within what the
    training step's transients free (a sync that held the model whole once more would not fit)."""
    from pathlib import Path

    from qlm_core.config import load_recipe
    from qlm_core.profile.case import build_case, validate_case
    from qlm_core.profile.memory import estimate_memory
    from qlm_core.train.objectives.recipe import recipe_objective

    recipe = load_recipe(Path(__file__).resolve().parents[2] / "recipes" / "qwen1.5-moe-a2.7b-grpo.toml")
    case = build_case(recipe, num_gpus=8)
    validate_case(case)
    assert case.spec.moe is not None and case.sizes.dp == 8 and recipe_objective(recipe).routing_replay
    memory = estimate_memory(case, GPU.memory_gib)
    assert memory.fits
    assert memory.stages[0].components["rollout"] == 2 * num_parameters(case.spec)  # bf16: the model only
    assert memory.total_gib + 2 * num_parameters(case.spec) / 2**30 > GPU.memory_gib


def test_a_layout_whose_leaders_cannot_take_whole_prompts_is_refused():
    """The trainer refuses a step whose prompts do not divide among the data-parallel ranks (validate.validate_rl);
    so does the profile, and the search never ranks such a layout (32 prompts of 8 over dp 64)."""
    from qlm_core.errors import QlmError
    from qlm_core.profile.case import validate_case

    case = rl_case(global_batch_size=256, rl_generations=8, num_gpus=64)
    with pytest.raises(QlmError, match="32 prompts .* do not divide among 64 data-parallel ranks"):
        validate_case(case)
    validate_case(rl_case(global_batch_size=256, rl_generations=8, num_gpus=32))
