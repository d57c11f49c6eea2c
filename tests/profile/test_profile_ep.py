"""qlm profile under expert parallelism against the real multi-rank trainer (gloo ranks): the model states of EP
layouts (ep2, ep2 x dp ZeRO 2, ep2 x tp2·SP with etp 2 and 1) equal the Engine's tensors on every rank; an MoE
layer's saved bytes under EP equal the formula at the rows the rank received; `probe` of ep2 (2 ranks) and
ep2·tp2·SP (4 ranks) measures what it predicts (states exact, activations within 5%)."""

import json
from pathlib import Path

import pytest
from conftest import TESTS_DIR, launch_torchrun
from parallel_cases import MOE
from workers.profile_worker import EP_LAYER_CASES, EP_STATE_CASES

from qlm_core.config import ParallelConfig, load_recipe
from qlm_core.errors import QlmError
from qlm_core.hardware import gpu_spec
from qlm_core.profile.case import ProfileCase, build_case, validate_case
from qlm_core.profile.memory import estimate_memory
from qlm_core.profile.probe import probe
from qlm_core.profile.search import expert_layouts, layouts
from qlm_core.profile.timing import estimate_time

REPO = Path(__file__).resolve().parents[2]
EP_RECIPES = ("qwen3-30b-a3b-8gpu.toml", "qwen3-30b-a3b-32gpu.toml")


@pytest.fixture(scope="module")
def ep_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("profile_ep")
    proc = launch_torchrun(TESTS_DIR / "workers" / "profile_worker.py", 4, out, "ep", timeout=600)
    errors = "\n".join(p.read_text() for p in out.glob("*.error"))
    return out, proc.returncode, errors or proc.stderr[-3000:]


@pytest.mark.distributed
@pytest.mark.parametrize("case", EP_STATE_CASES)
def test_ep_model_states_equal_the_engines_tensors(case, ep_run):
    out, code, errors = ep_run
    files = sorted((out / "ep_states").glob(f"{case}.rank*.json")) if (out / "ep_states").exists() else []
    assert len(files) == EP_STATE_CASES[case].world, f"worker exit {code}: {errors}"
    for file in files:
        result = json.loads(file.read_text())
        assert result["predicted"] == result["measured"], (file.name, result)


@pytest.mark.distributed
@pytest.mark.parametrize("case", EP_LAYER_CASES)
def test_ep_layer_bytes_equal_the_formula_at_the_received_rows(case, ep_run):
    out, code, errors = ep_run
    files = sorted((out / "ep_layer").glob(f"{case}.rank*.json")) if (out / "ep_layer").exists() else []
    assert len(files) == EP_LAYER_CASES[case][0], f"worker exit {code}: {errors}"
    for file in files:
        result = json.loads(file.read_text())
        assert result["predicted"] == result["measured"], (file.name, result)


@pytest.mark.distributed
@pytest.mark.parametrize("parallel, world", [(dict(ep=2), 2), (dict(ep=2, tp=2, sp=True), 4)],
                         ids=["ep2", "ep2_tp2_sp"])
def test_probe_of_an_ep_layout_measures_what_is_predicted(parallel, world):
    """`qlm profile --probe` of an EP layout on CPU: model states to the byte, activations within 5% (predicted at
    the rows the measured rank received; its load is reported)."""
    case = ProfileCase(spec=MOE, model_name="tiny-moe", parallel=ParallelConfig(zero_stage=1, **parallel),
                       seq_len=128, global_batch_size=2 * world // parallel.get("tp", 1), num_gpus=world)
    result = probe(case, gpu_spec("a100-80g"), steps=2)
    assert result.case.parallel.ep == 2 and result.expert_load is not None
    for key in ("weights", "grads", "optimizer"):
        assert result.predicted[key] == result.measured[key], key
    assert result.predicted["activations"] == pytest.approx(result.measured["activations"], rel=0.05)


def _qwen3_30b(**parallel):
    return build_case(model="qwen3-30b-a3b", seq_len=4096, global_batch_size=64, num_gpus=8, **parallel)


def test_ep_divides_the_experts_and_shards_their_states_over_edp():
    """ep8 on 8 GPUs: each rank holds 16 of 128 experts; ZeRO 1 over edp 1 keeps their optimizer whole, ZeRO 1 at
    ep2 (edp 4) shards it 4 ways."""
    gpu = gpu_spec("h100")
    dense_tp = estimate_memory(_qwen3_30b(tp=1, zero_stage=1), gpu.memory_gib).heaviest.components
    ep8 = estimate_memory(_qwen3_30b(tp=1, ep=8, zero_stage=1), gpu.memory_gib).heaviest.components
    ep2 = estimate_memory(_qwen3_30b(tp=1, ep=2, zero_stage=1), gpu.memory_gib).heaviest.components
    assert ep8["weights"] < dense_tp["weights"] / 5  # experts are ~95% of the parameters, 1/8 of them here
    assert ep2["optimizer"] < ep8["optimizer"] * 4 / 2 * 0.6  # 64 experts over edp 4 vs 16 over edp 1


def test_ep_time_has_the_all_to_all_and_its_links():
    """The all-to-all is costed (ep_comm); spanning two nodes is slower than one; a larger imbalance allowance
    costs time and activation memory."""
    gpu = gpu_spec("h100")
    one_node = estimate_time(_qwen3_30b(tp=1, ep=8), gpu)
    two_nodes = estimate_time(build_case(model="qwen3-30b-a3b", seq_len=4096, global_batch_size=64, num_gpus=16,
                                         tp=1, ep=16), gpu)
    assert one_node.components["ep_comm"] > 0 and estimate_time(_qwen3_30b(tp=1), gpu).components["ep_comm"] == 0
    assert two_nodes.components["ep_comm"] > 2 * one_node.components["ep_comm"]
    balanced = _qwen3_30b(tp=1, ep=8).replace(moe_imbalance=1.0)
    assert estimate_time(balanced, gpu).step_s < one_node.step_s
    assert estimate_memory(balanced, 80).heaviest.components["activations"] < \
        estimate_memory(_qwen3_30b(tp=1, ep=8), 80).heaviest.components["activations"]


def test_expert_gemms_are_bound_by_their_weights_when_few_rows_reach_each_expert():
    """Qwen3-30B-A3B at 1024 tokens a rank: every rank running all 128 experts reads 400 MB of fc1 weights per layer
    for 26 GFLOP (memory-bound on an H100); EP8 reads an eighth of them for 1.25x the rows, so it is faster."""
    from qlm_core.models.presets import PRESETS
    from qlm_core.profile.efficiency import Efficiency
    from qlm_core.profile.moe_timing import moe_layer_gemm_seconds

    gpu = gpu_spec("h100")
    rates, peak, hbm = Efficiency().rates(gpu), gpu.peak_tflops * 1e12, gpu.hbm_gbps * 1e9
    base = ProfileCase(PRESETS["qwen3-30b-a3b"], "qwen3-30b-a3b", seq_len=4096, global_batch_size=128, num_gpus=8)
    attention = {"linear_qkv": 0.0, "linear_proj": 0.0}
    fc1 = {}
    for ep in (1, 8):
        case = base.with_parallel(tp=2, sp=True, cp=4, dp=1, ep=ep, etp=1 if ep > 1 else None)
        fc1[ep] = moe_layer_gemm_seconds(case, rates, peak, attention, hbm, 4096 / 4)["linear_fc1"]
    weights = 128 * 2 * 384 * 2048 * 2  # E x [2F/tp, h] in bf16
    assert fc1[1] >= weights / hbm / 1024  # per token: the weights once per micro-batch of 1024 tokens
    assert fc1[8] < fc1[1] / 2


def test_ep_input_errors_are_one_line():
    with pytest.raises(QlmError, match="imbalance"):
        validate_case(_qwen3_30b(tp=1, ep=8).replace(moe_imbalance=0.5))
    with pytest.raises(QlmError, match="sequence parallelism"):
        validate_case(_qwen3_30b(tp=2, ep=4, sp=False))
    with pytest.raises(QlmError):
        validate_case(_qwen3_30b(tp=1, ep=3))


def test_search_enumerates_ep_for_moe_models_only():
    case = _qwen3_30b(tp=1)
    assert expert_layouts(case, 2, 8) == [(1, None), (1, 1), (2, None), (2, 1), (4, None), (4, 1), (8, 1)]
    dense = build_case(model="qwen2-7b", seq_len=4096, num_gpus=8)
    assert expert_layouts(dense, 2, 8) == [(1, None)]
    assert {c.parallel.ep for c in layouts(dense, 8)} == {1}
    assert {c.parallel.ep for c in layouts(case, 8)} == {1, 2, 4, 8}


def test_cli_takes_ep_etp_and_the_imbalance(run_qlm):
    code, out, err = run_qlm("profile", "--model", "qwen3-30b-a3b", "--seq-len", "4096", "--gbs", "64", "--tp", "2",
                             "--sp", "--ep", "4", "--etp", "1", "--num-gpus", "8", "--gpu", "h100",
                             "--moe-imbalance", "1.5", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert (doc["layout"]["ep"], doc["layout"]["etp"], doc["layout"]["edp"]) == (4, 1, 2)
    assert doc["layout"]["moe_imbalance"] == 1.5 and "ep4 etp1" in doc["layout"]["describe"]
    assert doc["time"]["components_s"]["ep_comm"] > 0
    assert any("expert parallelism" in line for line in doc["assumed"])


@pytest.mark.parametrize("name", EP_RECIPES)
def test_ep_recipes_dry_run_and_fit(name, run_qlm):
    recipe = REPO / "recipes" / name
    code, _, err = run_qlm("train", recipe, "--dry-run")
    assert code == 0, err
    case = build_case(load_recipe(recipe))
    validate_case(case)
    assert case.expert_parallel and estimate_memory(case, gpu_spec("h100").memory_gib).fits
