"""DeepSpeed checkpoints. ds2hf / ds2mcore read what real DeepSpeed engines save (ZeRO 0-3, fp32 and bf16, a tied
embedding, a frozen layer) exactly as DeepSpeed's own zero_to_fp32 rebuilds them; engines load what hf2ds and
mcore2ds write. The peer tests launch torchrun once (3 gloo ranks, so that ZeRO partitions carry padding)."""

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from conftest import launch_torchrun, load_safetensors_dir, make_hf_model
from helpers import assert_clean_failure, assert_same_hf

from qlm_core.checkpoint.convert.deepspeed import ds_to_hf, ds_to_mcore, hf_to_ds, mcore_to_ds
from qlm_core.checkpoint.convert.hf_megatron import hf_to_mcore, mcore_to_hf
from qlm_core.checkpoint.formats.deepspeed.checkpoint import DeepSpeedCheckpoint
from qlm_core.checkpoint.io.safe_load import safe_torch_load

WORLD = 3
TRAIN = {f"zero{stage}_{precision}": (stage, precision == "bf16") for stage in (0, 1, 2, 3)
         for precision in ("fp32", "bf16")}
FROZEN = "model.layers.1."
# DeepSpeed engines that load qlm's output: name -> (ZeRO stage, bf16, the checkpoint the fixture writes)
LOADS = {"zero0": (0, False, "hf2ds"), "zero1": (1, False, "hf2ds"), "zero2": (2, False, "hf2ds"),
         "zero2_bf16": (2, True, "hf2ds_bf16"), "zero1_from_mcore": (1, False, "mcore2ds")}
needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                     reason="deepspeed is not installed (pip install '.[test]')")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ds") / "hf"
    make_hf_model(path, "qwen2_tied")
    return path


# ---- qlm on its own -------------------------------------------------------------------------------------------------


def test_hf_ds_hf_is_bit_exact(tiny, tmp_path):
    source = load_safetensors_dir(tiny)
    result = hf_to_ds(tiny, tmp_path / "ds", verify=True)
    assert result.verify.ok and result.verify.tensors_checked == 2 * len(source)
    assert (tmp_path / "ds/latest").read_text() == "global_step0" and (tmp_path / "ds/config.json").exists()
    state = safe_torch_load(tmp_path / "ds/global_step0/mp_rank_00_model_states.pt")
    assert state["shared_params"] == {"lm_head.weight": "model.embed_tokens.weight"}
    assert state["module"]["lm_head.weight"].data_ptr() == state["module"]["model.embed_tokens.weight"].data_ptr()
    assert list(state["param_shapes"][0])[:3] == ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                                                  "model.layers.0.self_attn.q_proj.bias"]
    back = ds_to_hf(tmp_path / "ds", tmp_path / "hf", verify=True)  # config.json found next to `latest`
    assert back.verify.ok
    assert_same_hf(tmp_path / "hf", source)


def test_bf16_module_keeps_fp32_masters(tiny, tmp_path):
    """--dtype bf16 rounds the module only; the fp32 partition keeps the source's precision, as DeepSpeed does."""
    hf_to_ds(tiny, tmp_path / "ds", dtype="bf16", tag="warm", verify=True)
    state = safe_torch_load(tmp_path / "ds/warm/mp_rank_00_model_states.pt")
    assert state["module"]["model.norm.weight"].dtype == torch.bfloat16
    assert (tmp_path / "ds/warm/bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt").exists()
    ds_to_hf(tmp_path / "ds", tmp_path / "hf")
    assert_same_hf(tmp_path / "hf", load_safetensors_dir(tiny))
    ds_to_hf(tmp_path / "ds", tmp_path / "hf16", dtype="bf16")
    assert_same_hf(tmp_path / "hf16", load_safetensors_dir(tiny), torch.bfloat16)


def test_mcore_ds_mcore_round_trip(hf_models, tmp_path):
    src = hf_models["qwen2"]
    hf_to_mcore(src, tmp_path / "mcore", tp=2, pp=2)
    result = mcore_to_ds(tmp_path / "mcore", tmp_path / "ds", verify=True, fp32_master=False)
    assert result.verify.ok and not (tmp_path / "ds/release").exists()
    assert sorted(p.name for p in (tmp_path / "ds/global_step0").iterdir()) == ["mp_rank_00_model_states.pt"]
    assert DeepSpeedCheckpoint(tmp_path / "ds").zero_stage == 0
    ds_to_mcore(tmp_path / "ds", tmp_path / "back", tp=4, verify=True)
    mcore_to_hf(tmp_path / "back", tmp_path / "hf")
    assert_same_hf(tmp_path / "hf", load_safetensors_dir(src))


def test_cli_hf2ds_inspect_and_errors(run_qlm, tiny, tmp_path):
    ds = tmp_path / "ds"
    code, stdout, stderr = run_qlm("convert", "hf2ds", "--hf", tiny, "--out", ds, "--tag", "global_step7")
    assert code == 0 and "verified" in stdout, stderr
    code, stdout, _ = run_qlm("convert", "inspect", ds, "--json")
    report = json.loads(stdout)
    assert code == 0 and report["format"] == "deepspeed"
    assert report["layout"]["tag"] == "global_step7" and report["layout"]["zero_stage"] == 2
    rows = {row["name"]: row for row in report["tensors"]}
    assert rows["lm_head.weight"]["where"] == "tied to model.embed_tokens.weight"
    assert rows["model.norm.weight"]["dtype"] == "float32"

    out = tmp_path / "hf"
    assert_clean_failure(run_qlm("convert", "ds2hf", "--ds", ds, "--out", out, "--tag", "global_step9"), out,
                         "no tag 'global_step9'", "global_step7")
    (ds / "config.json").rename(tmp_path / "config.json")
    assert_clean_failure(run_qlm("convert", "ds2hf", "--ds", ds, "--out", out), out, "--config")
    assert_clean_failure(run_qlm("convert", "ds2mcore", "--ds", ds, "--out", out, "--config", tmp_path / "nowhere"),
                         out, "no config.json")
    (ds / "latest").unlink()
    assert_clean_failure(run_qlm("convert", "ds2hf", "--ds", ds, "--out", out, "--config", tmp_path / "config.json"),
                         out, "no `latest` file", "--tag", "global_step7")
    code, _, stderr = run_qlm("convert", "ds2hf", "--ds", ds, "--out", out, "--config", tmp_path / "config.json",
                              "--tag", "global_step7")
    assert code == 0, stderr
    make_hf_model(tmp_path / "bigger", "qwen2_tied", num_hidden_layers=5)
    out2 = tmp_path / "hf2"
    assert_clean_failure(run_qlm("convert", "ds2hf", "--ds", ds / "global_step7", "--out", out2, "--config",
                                 tmp_path / "bigger"), out2, "model.layers.4", "--config")


# ---- against real DeepSpeed -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def deepspeed_runs(tiny, tmp_path_factory):
    """Train and save with every ZeRO stage, load qlm's outputs into engines: one torchrun launch."""
    root = tmp_path_factory.mktemp("deepspeed")
    hf_to_ds(tiny, root / "hf2ds")
    hf_to_ds(tiny, root / "hf2ds_bf16", dtype="bf16")
    hf_to_mcore(tiny, root / "mcore", tp=2, pp=2)
    mcore_to_ds(root / "mcore", root / "mcore2ds")
    cases = {
        "hf": str(tiny), "results": str(root),
        "train": [{"name": name, "stage": stage, "bf16": bf16, "out": str(root / name)}
                  for name, (stage, bf16) in TRAIN.items()],
        "load": [{"name": f"load_{name}", "stage": stage, "bf16": bf16, "ckpt": str(root / ckpt),
                  "reference_hf": str(tiny)} for name, (stage, bf16, ckpt) in LOADS.items()],
        "zero_to_fp32": [{"ckpt": str(root / ckpt), "out": str(root / f"{ckpt}.z2f.pt")}
                         for ckpt in ("hf2ds", "hf2ds_bf16", "mcore2ds")],
    }
    (root / "cases.json").write_text(json.dumps(cases))
    worker = Path(__file__).parents[1] / "peers" / "deepspeed_worker.py"
    proc = launch_torchrun(worker, WORLD, root / "cases.json", timeout=900,
                           env={"DS_ACCELERATOR": "cpu", "TOKENIZERS_PARALLELISM": "false"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return root


@pytest.mark.distributed
@needs_deepspeed
@pytest.mark.peer
@pytest.mark.parametrize("case", TRAIN)
def test_ds2hf_equals_deepspeeds_own_fp32_weights(deepspeed_runs, tiny, tmp_path, case):
    stage, bf16 = TRAIN[case]
    result = ds_to_hf(deepspeed_runs / case, tmp_path / "hf", config=tiny, verify=True)
    assert result.verify.ok, result.verify.summary()
    ours = load_safetensors_dir(tmp_path / "hf")
    expected = torch.load(deepspeed_runs / f"{case}.expected.pt", weights_only=True)
    for name, tensor in expected.items():  # fp32 masters; frozen params in the run's dtype; lm_head = embedding
        mine = ours["model.embed_tokens.weight" if name == "lm_head.weight" else name]
        assert torch.equal(mine, tensor.float()), name
    original = load_safetensors_dir(tiny)
    frozen = [name for name in ours if name.startswith(FROZEN)]
    assert frozen and all(name in expected for name in frozen) == (stage != 1)  # ZeRO 1 leaves them to the module
    for name in frozen:
        assert torch.equal(ours[name], original[name].to(torch.bfloat16 if bf16 else torch.float32).float()), name
    trained = [name for name in ours if not name.startswith(FROZEN)]
    assert not any(torch.equal(ours[name], original[name]) for name in trained if "norm" not in name)


@pytest.mark.distributed
@needs_deepspeed
@pytest.mark.peer
def test_deepspeed_engines_load_qlm_output(deepspeed_runs):
    for name, (_, bf16, _) in LOADS.items():
        result = json.loads((deepspeed_runs / f"load_{name}.json").read_text())
        assert result["loaded"] and result["step_loss_finite"] and result["max_weight_diff"] == 0.0, (name, result)
        # fp32 engines reproduce transformers exactly; a bf16 engine's forward differs by bf16 rounding
        assert result["max_abs_diff"] <= (2e-2 if bf16 else 0.0), (name, result)


@pytest.mark.distributed
@needs_deepspeed
@pytest.mark.peer
def test_zero_to_fp32_reads_hf2ds_output(deepspeed_runs, tiny):
    for ckpt in ("hf2ds", "hf2ds_bf16", "mcore2ds"):
        rebuilt = torch.load(deepspeed_runs / f"{ckpt}.z2f.pt", weights_only=True)
        source = load_safetensors_dir(tiny)
        assert sorted(rebuilt) == sorted([*source, "lm_head.weight"])
        for name, tensor in source.items():
            assert rebuilt[name].dtype == torch.float32 and torch.equal(rebuilt[name], tensor), (ckpt, name)


@pytest.mark.distributed
@needs_deepspeed
@pytest.mark.peer
@pytest.mark.parametrize("case", ["zero3_bf16", "zero2_fp32"])
def test_ds2mcore_mcore2hf_round_trip(deepspeed_runs, tiny, tmp_path, case):
    direct = ds_to_hf(deepspeed_runs / case, tmp_path / "direct", config=tiny)
    mcore = ds_to_mcore(deepspeed_runs / case, tmp_path / "mcore", config=tiny, tp=2, pp=2, verify=True)
    assert mcore.verify.ok and direct.files
    mcore_to_hf(tmp_path / "mcore", tmp_path / "hf", verify=True)
    assert_same_hf(tmp_path / "hf", load_safetensors_dir(tmp_path / "direct"))
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    assert model.config.tie_word_embeddings


@pytest.mark.distributed
@needs_deepspeed
@pytest.mark.peer
def test_corrupt_deepspeed_checkpoints_fail_cleanly(run_qlm, deepspeed_runs, tiny, tmp_path):
    for case, rank_file in (("zero3_bf16", "zero_pp_rank_2_mp_rank_00_model_states.pt"),
                            ("zero3_fp32", "zero_pp_rank_1_mp_rank_00_optim_states.pt"),
                            ("zero2_bf16", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt")):
        ds = shutil.copytree(deepspeed_runs / case, tmp_path / case)
        (ds / "global_step2" / rank_file).unlink()
        out = tmp_path / f"{case}-out"
        assert_clean_failure(run_qlm("convert", "ds2hf", "--ds", ds, "--out", out, "--config", tiny), out, rank_file)
        assert_clean_failure(run_qlm("convert", "ds2mcore", "--ds", ds, "--out", out, "--config", tiny, "--tp", "2"),
                             out, rank_file)
    ds = shutil.copytree(deepspeed_runs / "zero1_bf16", tmp_path / "nolatest")
    (ds / "latest").unlink()
    out = tmp_path / "out"
    assert_clean_failure(run_qlm("convert", "ds2hf", "--ds", ds, "--out", out, "--config", tiny), out,
                         "no `latest` file", "global_step2")
    assert_clean_failure(run_qlm("convert", "ds2hf", "--ds", ds, "--out", out, "--config", tiny, "--tag",
                                 "global_step3"), out, "no tag 'global_step3'")
    code, stdout, stderr = run_qlm("convert", "ds2hf", "--ds", ds, "--out", out, "--config", tiny, "--tag",
                                   "global_step2")
    assert code == 0 and "verified" in stdout, stderr


def test_a_deepseek_v3_run_without_mtp_weights_reads_back(mla_models, tmp_path):
    """DeepSeek-V3's config.json counts a multi-token prediction layer that transformers (and so a DeepSpeed run
    of it) never holds: the checkpoint is read without it, as the HF directory is."""
    source = load_safetensors_dir(mla_models["deepseek_v3"])
    assert hf_to_ds(mla_models["deepseek_v3"], tmp_path / "ds", verify=True).verify.ok
    assert ds_to_hf(tmp_path / "ds", tmp_path / "hf", verify=True).verify.ok
    assert_same_hf(tmp_path / "hf", source)


def test_tied_opt_round_trips_through_deepspeed(hf_models, tmp_path):
    """OPT's names (model.decoder.*): the tied output layer shares the embedding under its own name."""
    src = hf_models["opt"]
    hf_to_ds(src, tmp_path / "ds", verify=True)
    state = safe_torch_load(tmp_path / "ds/global_step0/mp_rank_00_model_states.pt")
    assert state["shared_params"] == {"lm_head.weight": "model.decoder.embed_tokens.weight"}
    assert list(state["module"])[0] == "model.decoder.embed_tokens.weight"
    ds_to_hf(tmp_path / "ds", tmp_path / "hf")
    assert_same_hf(tmp_path / "hf", load_safetensors_dir(src))


@pytest.mark.parametrize("kind", ["qwen2", "opt", "gemma3", "glm", "bloom", "mpt", "gemma2", "qwen3_moe", "mixtral",
                                  "gpt_oss", "ernie4_5_moe", "deepseek_v3", "glm4_moe"])
def test_the_module_is_transformers_state_dict_in_its_order_and_converts_back(hf_models, moe_models, mla_models, kind,
                                                                              tmp_path):
    """DeepSpeed saves the engine's module: transformers' state_dict, whose parameters' order its flat fp32
    partitions follow. qlm writes exactly those names in that order (MoE experts fused as transformers >= 5 holds
    them, Mixtral's router and ERNIE's correction bias under mlp.gate, DeepSeek's correction bias a buffer) and reads
    them back."""
    src = {**hf_models, **moe_models, **mla_models}.get(kind)
    if src is None:  # GLM-4.5: its own fixture elsewhere
        src = tmp_path / "src"
        make_hf_model(src, kind)
    assert hf_to_ds(src, tmp_path / "ds", verify=True).verify.ok
    state = safe_torch_load(tmp_path / "ds/global_step0/mp_rank_00_model_states.pt")
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(src))
    assert list(state["param_shapes"][0]) == [name for name, _ in model.named_parameters()]
    assert sorted(state["module"]) == sorted(model.state_dict())
    assert state["buffer_names"] == [name for name in model.state_dict() if name.endswith("e_score_correction_bias")
                                     and kind in ("deepseek_v3", "glm4_moe")]
    assert ds_to_hf(tmp_path / "ds", tmp_path / "hf", verify=True).verify.ok
    assert_same_hf(tmp_path / "hf", src)


def test_a_per_expert_module_of_an_earlier_qlm_still_reads(moe_models, tmp_path):
    src = moe_models["qwen3_moe"]
    hf_to_ds(src, tmp_path / "ds", fp32_master=False)
    file = tmp_path / "ds/global_step0/mp_rank_00_model_states.pt"
    state = safe_torch_load(file)
    module = state["module"]
    for name in [n for n in module if n.endswith("experts.gate_up_proj")]:
        prefix, fused = name[: -len("gate_up_proj")], module.pop(name)
        down, ffn = module.pop(prefix + "down_proj"), fused.shape[1] // 2
        for e in range(fused.shape[0]):
            module[f"{prefix}{e}.gate_proj.weight"] = fused[e, :ffn].clone()
            module[f"{prefix}{e}.up_proj.weight"] = fused[e, ffn:].clone()
            module[f"{prefix}{e}.down_proj.weight"] = down[e].clone()
    state["param_shapes"] = [{name: tensor.shape for name, tensor in module.items()}]
    torch.save(state, file)
    assert ds_to_hf(tmp_path / "ds", tmp_path / "hf", verify=True).verify.ok
    assert_same_hf(tmp_path / "hf", src)
