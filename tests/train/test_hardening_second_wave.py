"""The second wave's features under hostile input (issue 31): layouts the pipeline runtime cannot run, non-finite
numbers, MoE configs and checkpoints that lie, Megatron args that contradict the stored tensors, preference files
that mix formats or types, damaged caches and run files. Each is one line before any process starts, or the right
result; none is a traceback or a silent wrong result."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import call_qlm, make_hf_model
from safetensors.torch import load_file, save_file

from qlm_core.config import ParallelConfig, load_recipe
from qlm_core.errors import QlmError
from qlm_core.models.presets import PRESETS
from qlm_core.models.spec import ModelSpec
from qlm_core.parallel.state import resolve_sizes
from qlm_core.train.validate import validate_layout

REPO = Path(__file__).resolve().parents[2]
TINY_MOE = REPO / "recipes" / "tiny-moe.toml"


def one_error(result, *needles) -> str:
    code, stdout, stderr = result
    assert code == 2, (code, stdout[-1500:], stderr[-1500:])
    assert "Traceback" not in stdout + stderr
    lines = [line for line in stderr.splitlines()  # not warnings, nor lm-eval's tqdm bars
             if line.strip() and not line.startswith("warning:") and "%|" not in line]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "; " in lines[0], stderr
    missing = [n for n in needles if n not in lines[0]]
    assert not missing, (missing, lines[0])
    return lines[0]


# ---- layouts the pipeline runtime refuses: one line before any process starts -----------------------------------

@pytest.mark.parametrize("schedule,vpp,gbs,needles", [
    ("1f1b", 1, 16, ["1f1b on pp = 2 stages needs at least 2 micro-batches", "this layout has 1",
                     "train.global_batch_size 16", "at least 32"]),
    ("interleaved_1f1b", 2, 48, ["needs a multiple of 2 micro-batches", "this layout has 3", "a multiple of 32"]),
    ("zero_bubble", 2, 16, ["needs a multiple of 2", "this layout has 1"]),
])
def test_too_few_micro_batches_for_the_schedule_is_one_line(schedule, vpp, gbs, needles):
    spec, config = PRESETS["qlm-tiny-moe"], ParallelConfig(pp=2, vpp=vpp, dp=2, ep=2, pp_schedule=schedule)
    with pytest.raises(QlmError) as caught:
        validate_layout(spec, config, resolve_sizes(4, pp=2, dp=2, ep=2), 128, 8, gbs)
    assert all(n in caught.value.line() for n in needles), caught.value.line()


def test_gpipe_takes_any_micro_batch_count():
    validate_layout(PRESETS["qlm-tiny-moe"], ParallelConfig(pp=2, dp=2, ep=2, pp_schedule="gpipe"),
                    resolve_sizes(4, pp=2, dp=2, ep=2), 128, 8, 16)


def test_the_issue_layout_is_refused_by_train_and_profile_alike(tmp_path):
    sets = ["--set", "parallel.ep=2", "--set", "parallel.pp=2", "--set", "parallel.dp=2"]
    line = one_error(call_qlm("train", TINY_MOE, *sets, "--output", tmp_path / "run"),
                     "needs at least 2 micro-batches per step, this layout has 1", "train.micro_batch_size 8")
    assert not (tmp_path / "run").exists()
    assert one_error(call_qlm("profile", TINY_MOE, "--ep", "2", "--pp", "2", "--dp", "2")) == line


def test_the_moe_rules_every_rank_checks_are_checked_by_the_dry_run(tmp_path):
    one_error(call_qlm("train", TINY_MOE, "--set", "parallel.pp=2", "--set", 'moe.aux_loss_type="transformers"',
                       "--set", "train.global_batch_size=32", "--dry-run"), "aux_loss_type", "parallel.pp = 1")


# ---- non-finite numbers ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("override", ["moe.aux_loss_coeff=inf", "moe.aux_loss_coeff=nan", "preference.beta=nan",
                                      "optim.lr=inf", "optim.clip_grad=-inf", "train.exit_duration_minutes=inf",
                                      "data.weights=[1.0, nan]"])
def test_a_non_finite_recipe_number_is_refused(override):
    key = override.split("=")[0]
    with pytest.raises(QlmError) as caught:
        load_recipe(None, [override])
    assert f"{key}" in caught.value.line() and "finite" in caught.value.line(), caught.value.line()


@pytest.mark.parametrize("flag,value", [("--temperature", "nan"), ("--temperature", "inf"), ("--top-p", "nan")])
def test_generate_refuses_non_finite_sampling_before_reading_anything(tmp_path, flag, value):
    one_error(call_qlm("generate", tmp_path / "missing", "--prompt", "hi", flag, value), flag, "finite")


@pytest.mark.parametrize("value", ["inf", "nan"])
def test_eval_refuses_a_non_finite_limit(tmp_path, value):
    one_error(call_qlm("eval", tmp_path, "--tasks", "qlm_demo_mc", "--limit", value), "--limit", "finite")


def test_profile_refuses_an_imbalance_no_ep_rank_can_receive():
    one_error(call_qlm("profile", TINY_MOE, "--moe-imbalance", "1e300", "--ep", "2"), "experts / top-k = 8/2")


def test_profile_search_on_a_billion_gpus_answers_at_once():
    import time

    start = time.monotonic()
    one_error(call_qlm("profile", "--search", "--num-gpus", "1000000000"), "no layout", "1000000000 GPUs")
    assert time.monotonic() - start < 60  # before the fix: a trial division loop to 10^9 (never answered)


def test_search_reports_its_progress():
    from qlm_core.hardware import gpu_spec
    from qlm_core.profile.case import build_case
    from qlm_core.profile.search import search

    seen = []
    case = build_case(load_recipe(REPO / "recipes" / "tiny-sft.toml"), num_gpus=4)
    result = search(case, 4, gpu_spec("a100-80g"), progress=lambda done, total: seen.append((done, total)))
    total = seen[-1][1]
    assert seen[0][0] == 0 and seen[-1] == (total, total) and total >= result.evaluated + result.invalid
    assert all(b[0] >= a[0] for a, b in zip(seen, seen[1:], strict=False))


# ---- EP without dp on a local launch -----------------------------------------------------------------------------

@pytest.mark.parametrize("sets,dp", [({"ep": 2}, 2), ({"ep": 4, "tp": 2, "sp": True}, 4),
                                     ({"ep": 4, "etp": 1, "tp": 2, "sp": True}, 2), ({"ep": 2, "cp": 2}, 1),
                                     ({"ep": 2, "dp": 4}, 4)])
def test_a_local_launch_picks_the_fewest_dp_ranks_that_hold_the_experts(sets, dp):
    from qlm_core.train.plan import local_dp, local_dp_note, world_size

    recipe = load_recipe(TINY_MOE, [f"parallel.{k}={json.dumps(v)}" for k, v in sets.items()])
    assert local_dp(recipe.parallel) == dp
    p = recipe.parallel
    assert world_size(recipe, None, 1) == (p.tp * p.pp * p.cp * dp,) * 2
    note = local_dp_note(recipe, None)
    assert (note is not None) == ("dp" not in sets and dp > 1)


def test_ep_without_dp_dry_run_starts_the_ranks_ep_needs(tmp_path):
    code, out, err = call_qlm("train", TINY_MOE, "--set", "parallel.ep=2", "--dry-run")
    assert code == 0, err
    assert "starting dp = 2" in err and "2 = dp2 x pp1 x cp1 x tp1" in out


# ---- HF configs and MoE checkpoints that lie -----------------------------------------------------------------------

MIXTRAL = dict(model_type="mixtral", vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)


@pytest.mark.parametrize("key,value", [("sliding_window", 0), ("sliding_window", -4), ("sliding_window", "4096"),
                                       ("num_key_value_heads", 0), ("head_dim", "8"), ("rope_theta", "x"),
                                       ("rms_norm_eps", float("nan")), ("max_position_embeddings", -1)])
def test_an_hf_config_number_out_of_range_is_one_line(key, value):
    with pytest.raises(QlmError) as caught:
        ModelSpec.from_hf_config({**MIXTRAL, key: value})
    assert key in caught.value.line()


def test_a_mixtral_window_is_read():
    assert ModelSpec.from_hf_config({**MIXTRAL, "sliding_window": 16}).sliding_window == 16
    assert ModelSpec.from_hf_config({**MIXTRAL, "sliding_window": None}).sliding_window is None


@pytest.fixture(scope="module")
def fused_moe(tmp_path_factory):
    """A tiny Qwen3-MoE saved in transformers-5's fused expert layout (gate_up_proj [E, 2F, H], down_proj
    [E, H, F])."""
    import transformers

    src = tmp_path_factory.mktemp("moe") / "src"
    make_hf_model(src, "qwen3_moe")
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    fused = src.parent / "fused"
    shutil.copytree(src, fused)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(fused / "model.safetensors"),
              metadata={"format": "pt"})
    return fused


def _edited(fused: Path, tmp_path: Path, change) -> Path:
    out = tmp_path / "hf"
    shutil.copytree(fused, out)
    state = load_file(out / "model.safetensors")
    change(state)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("name,change,needles", [
    ("row", lambda s: s.update({"model.layers.0.mlp.experts.gate_up_proj": torch.cat(
        [s["model.layers.0.mlp.experts.gate_up_proj"], s["model.layers.0.mlp.experts.gate_up_proj"][:, :1]], 1)}),
     ["gate_up_proj", "[4, 65, 64]", "[4, 64, 64]"]),
    ("expert", lambda s: s.update({"model.layers.1.mlp.experts.down_proj": torch.cat(
        [s["model.layers.1.mlp.experts.down_proj"], s["model.layers.1.mlp.experts.down_proj"][:1]], 0)}),
     ["down_proj", "[5, 64, 32]", "[4, 64, 32]"]),
    ("twice", lambda s: s.update({"model.layers.0.mlp.experts.2.up_proj.weight": torch.zeros(32, 64)}),
     ["model.layers.0.mlp.experts.2.up_proj.weight twice", "gate_up_proj"]),
])
def test_a_fused_expert_tensor_is_consumed_whole_or_refused(fused_moe, tmp_path, name, change, needles):
    hf = _edited(fused_moe, tmp_path, change)
    one_error(call_qlm("convert", "hf2mcore", "--hf", hf, "--out", tmp_path / "out"), *needles)
    assert not (tmp_path / "out").exists()


# ---- Megatron args / run_config.yaml that contradict the stored tensors -------------------------------------------

@pytest.fixture(scope="module")
def llama_mcore(tmp_path_factory):
    """A tiny Qwen3 (no qkv bias, untied output) as a legacy Megatron checkpoint at TP2 and as torch_dist."""
    root = tmp_path_factory.mktemp("qwen3")
    make_hf_model(root / "hf", "qwen3")
    for fmt in ("torch", "torch_dist"):
        code, _, err = call_qlm("convert", "hf2mcore", "--hf", root / "hf", "--out", root / fmt, "--tp",
                                "2" if fmt == "torch" else "1", "--format", fmt, "--no-verify")
        assert code == 0, err
    return root


def _legacy_files(root: Path) -> list[Path]:
    return sorted((root / "release").glob("mp_rank_*/model_optim_rng.pt"))


def test_a_stored_qkv_bias_the_args_deny_is_refused_not_dropped(llama_mcore, tmp_path):
    from qlm_core.checkpoint.io.safe_load import safe_torch_load

    mc = tmp_path / "mc"
    shutil.copytree(llama_mcore / "torch", mc)
    for file in _legacy_files(mc):
        state = safe_torch_load(file)
        weight = state["model"]["decoder.layers.0.self_attention.linear_qkv.weight"]
        state["model"]["decoder.layers.0.self_attention.linear_qkv.bias"] = torch.ones(weight.shape[0])
        torch.save(state, file)
    one_error(call_qlm("convert", "mcore2hf", "--mcore", mc, "--out", tmp_path / "out", "--verify"),
              "linear_qkv.bias", "add_qkv_bias")
    assert not (tmp_path / "out").exists()


def test_a_stored_output_layer_of_a_tied_model_is_refused(tmp_path):
    from qlm_core.checkpoint.io.safe_load import safe_torch_load

    make_hf_model(tmp_path / "hf", "qwen2", tie_word_embeddings=True)
    code, _, err = call_qlm("convert", "hf2mcore", "--hf", tmp_path / "hf", "--out", tmp_path / "mc", "--no-verify")
    assert code == 0, err
    for file in _legacy_files(tmp_path / "mc"):
        state = safe_torch_load(file)
        state["model"]["output_layer.weight"] = state["model"]["embedding.word_embeddings.weight"] * 2
        torch.save(state, file)
    one_error(call_qlm("convert", "mcore2hf", "--mcore", tmp_path / "mc", "--out", tmp_path / "out"),
              "output_layer.weight", "share_embeddings_and_output_weights")


def test_a_torch_dist_key_the_args_deny_is_refused(llama_mcore, tmp_path, monkeypatch):
    from qlm_core.checkpoint.formats.megatron import torch_dist

    real = torch_dist.TorchDistCheckpoint._check_tensors

    def with_bias(self):  # as if the files held a bias the args rule out
        from torch.distributed.checkpoint.metadata import TensorProperties, TensorStorageMetadata

        self.tensors["decoder.layers.self_attention.linear_qkv.bias"] = TensorStorageMetadata(
            TensorProperties(dtype=torch.float32), torch.Size([2, 8]), [])
        return real(self)

    monkeypatch.setattr(torch_dist.TorchDistCheckpoint, "_check_tensors", with_bias)
    one_error(call_qlm("convert", "mcore2hf", "--mcore", llama_mcore / "torch_dist", "--out", tmp_path / "out"),
              "decoder.layers.self_attention.linear_qkv.bias", "add_qkv_bias")


def _bridge_checkpoint(llama_mcore: Path, tmp_path: Path, **model) -> Path:
    """The legacy checkpoint without args or hf/ (as Megatron-Bridge saves), and a run_config.yaml beside it."""
    import yaml

    from qlm_core.checkpoint.io.safe_load import safe_torch_load

    mc = tmp_path / "bridge"
    shutil.copytree(llama_mcore / "torch", mc)
    shutil.rmtree(mc / "hf")
    for file in _legacy_files(mc):
        state = safe_torch_load(file)
        state.pop("args")
        torch.save(state, file)
    spec = ModelSpec.from_hf_dir(llama_mcore / "hf")
    config = {"num_layers": spec.num_layers, "hidden_size": spec.hidden_size, "ffn_hidden_size": spec.ffn_hidden_size,
              "num_attention_heads": spec.num_attention_heads, "num_query_groups": spec.num_query_groups,
              "kv_channels": spec.kv_channels, "vocab_size": spec.vocab_size, "position_embedding_type": "rope",
              "normalization": "RMSNorm", "gated_linear_unit": True, "add_bias_linear": False,
              "add_qkv_bias": False, "share_embeddings_and_output_weights": False, "rotary_base": spec.rope_theta,
              "layernorm_epsilon": spec.norm_epsilon, "tensor_model_parallel_size": 2, "qk_layernorm": True,
              "max_position_embeddings": spec.max_position_embeddings, **model}
    (mc / "release" / "run_config.yaml").write_text(yaml.safe_dump({"model": config}))
    return mc


def test_a_bridge_config_that_ties_an_untied_checkpoint_is_refused(llama_mcore, tmp_path):
    mc = _bridge_checkpoint(llama_mcore, tmp_path, share_embeddings_and_output_weights=True)
    one_error(call_qlm("convert", "mcore2hf", "--mcore", mc, "--out", tmp_path / "out", "--verify"),
              "output_layer.weight", "run_config.yaml", "share_embeddings_and_output_weights")
    assert not (tmp_path / "out").exists()


def test_an_honest_bridge_config_converts(llama_mcore, tmp_path):
    mc = _bridge_checkpoint(llama_mcore, tmp_path)
    code, _, err = call_qlm("convert", "mcore2hf", "--mcore", mc, "--out", tmp_path / "out", "--verify")
    assert code == 0, err


def test_a_bridge_topk_above_the_experts_names_the_bridge_key(llama_mcore, tmp_path):
    mc = _bridge_checkpoint(llama_mcore, tmp_path, num_moe_experts=4, moe_router_topk=6, moe_ffn_hidden_size=32)
    one_error(call_qlm("convert", "mcore2hf", "--mcore", mc, "--out", tmp_path / "out"),
              "moe_router_topk 6", "run_config.yaml", "4 experts")


# ---- preference files that mix formats or types ---------------------------------------------------------------------

def _pairs(tmp_path: Path, records: list[dict], name: str = "pairs.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _load(path: Path):
    from qlm_core.data.preference import load_preferences

    return load_preferences(path, cache_dir=str(path.parent / "cache"))


TRL = {"prompt": "say a", "chosen": "a", "rejected": "b"}


@pytest.mark.parametrize("records,needles", [
    ([TRL, {**TRL, "chosen": [{"role": "assistant", "content": "a b"}]}, {**TRL, "chosen": '"c g h a"'}],
     ["column 'chosen' is text in record 1 but a list in record 2"]),
    ([TRL] * 4 + [{**TRL, "chosen": 5}], ["column 'chosen' is text in record 1 but a number in record 5"]),
    ([{"instruction": "say a", "chosen": "a", "rejected": "b"}, TRL],
     ["record 2", "trl format", "'prompt'", "alpaca format"]),
    ([{"instruction": "", "input": " ", "chosen": "a", "rejected": "b"}], ["record 1", "the prompt is empty"]),
    ([TRL, {"prompt": [{"role": "user", "content": " "}], "chosen": "a", "rejected": "b"}],
     ["column 'prompt'"]),
    ([{"prompt": [{"role": "user", "content": " "}], "chosen": "a", "rejected": "b"}], ["the prompt is empty"]),
    ([{"conversations": [{"from": "human", "value": ""}], "chosen": {"from": "gpt", "value": "a"},
       "rejected": {"from": "gpt", "value": "b"}}], ["record 1", "the prompt is empty"]),
    ([TRL, {**TRL, "rejected": "a"}], ["record 2", "chosen and rejected responses are the same"]),
])
def test_a_preference_file_that_mixes_or_blanks_is_one_line_naming_the_record(tmp_path, records, needles):
    with pytest.raises(QlmError) as caught:
        _load(_pairs(tmp_path, records))
    assert all(n in caught.value.line() for n in needles), caught.value.line()


def test_text_that_looks_like_json_stays_text(tmp_path):
    rows = _load(_pairs(tmp_path, [{**TRL, "chosen": '"c g h a"'}, {**TRL, "chosen": "[1, 2]"}]))
    assert [r["chosen"][0]["content"] for r in rows] == ['"c g h a"', "[1, 2]"]


# ---- damaged run files and caches ---------------------------------------------------------------------------------

@pytest.mark.parametrize("content", [b"\xff\xfe\x00run", b"not/an id\n"])
def test_a_damaged_wandb_run_id_is_one_line_before_the_run(tmp_path, monkeypatch, content):
    pytest.importorskip("wandb")
    run = tmp_path / "run"
    run.mkdir()
    (run / "wandb_run_id").write_bytes(content)
    (run / "config.toml").write_text("")
    monkeypatch.setenv("WANDB_MODE", "offline")
    one_error(call_qlm("train", REPO / "recipes" / "tiny-sft.toml", "--output", run,
                       "--set", 'logging.wandb_project="qlm"'), "wandb_run_id", "wandb run id")


def test_a_damaged_reference_table_is_recomputed_never_trusted(tmp_path, capsys):
    import numpy as np
    from safetensors.numpy import save_file as save_np

    from qlm_core.train.objectives import reference_table

    tables = {"train": np.arange(8, dtype=np.float64).reshape(4, 2)}
    path = tmp_path / "reference-logps-x.safetensors"
    save_np(tables, str(path), metadata={reference_table.DIGEST_KEY: reference_table._digest(tables)})
    assert reference_table.read_table(path)["train"].tolist() == tables["train"].tolist()
    whole = path.read_bytes()
    path.write_bytes(whole[: len(whole) - 9])  # cut short
    assert reference_table.read_table(path) == {}
    flipped = bytearray(whole)
    flipped[-3] ^= 0xFF  # a bit flipped in a number
    path.write_bytes(bytes(flipped))
    assert reference_table.read_table(path) == {}
    save_np(tables, str(path))  # no checksum: written by something else
    assert reference_table.read_table(path) == {}
    assert capsys.readouterr().err.count("is damaged") == 3


def test_a_sigmoid_routed_run_trains_saves_and_resumes(tmp_path):
    sets = ["--set", 'moe.router_score_function="sigmoid"', "--set", "moe.router_expert_bias=true", "--set",
            "train.train_iters=2", "--set", "schedule.warmup_iters=0", "--set", "checkpoint.save_interval=1",
            "--set", "train.eval_iters=1", "--set", "train.eval_interval=0", "--set", "logging.plot=false",
            "--set", "logging.tensorboard=false", "--set", f"data.cache_dir={json.dumps(str(tmp_path / 'cache'))}"]
    code, out, err = call_qlm("train", TINY_MOE, "--output", tmp_path / "run", *sets)
    assert code == 0, err[-2000:]
    side = tmp_path / "run" / "checkpoints" / "hf"
    assert (side / "tokenizer.json").is_file() and not (side / "config.json").exists()
    code, out, err = call_qlm("train", TINY_MOE, "--output", tmp_path / "run", *sets[:-8],
                              "--set", "train.train_iters=3", *sets[-6:])
    assert code == 0 and "resuming from iteration 2" in " ".join(out.split()), err[-2000:]
    one_error(call_qlm("convert", "mcore2hf", "--mcore", tmp_path / "run" / "checkpoints", "--out",
                       tmp_path / "hf"), "sigmoid", "Megatron format")


# ---- first-wave cases that fell short of one clean line ---------------------------------------------------------

@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2") / "hf"
    make_hf_model(path, "qwen2")
    return path


def _with_nan(qwen2: Path, tmp_path: Path) -> Path:
    return _edited(qwen2, tmp_path, lambda s: s["model.layers.1.mlp.up_proj.weight"][0, :5].fill_(float("nan")))


def test_an_unverified_large_model_is_still_scanned_for_nan(qwen2, tmp_path, monkeypatch):
    from qlm_core.checkpoint.convert import skeleton

    monkeypatch.setattr(skeleton, "AUTO_VERIFY_MAX_PARAMS", 0)  # as a model above 2B parameters
    code, out, err = call_qlm("convert", "hf2mcore", "--hf", _with_nan(qwen2, tmp_path), "--out", tmp_path / "mc")
    assert code == 0, err
    assert "the source was scanned for NaN" in out
    assert "model.layers.1.mlp.up_proj.weight has 5 NaN values" in " ".join(err.split())


def test_no_verify_says_nan_were_not_looked_for(qwen2, tmp_path):
    code, out, err = call_qlm("convert", "hf2mcore", "--hf", _with_nan(qwen2, tmp_path), "--out", tmp_path / "mc",
                              "--no-verify")
    assert code == 0 and "NaN in the source were not looked for" in " ".join(out.split()), out + err


def test_a_conversion_without_a_tokenizer_says_so(qwen2, tmp_path):
    hf = tmp_path / "hf"
    shutil.copytree(qwen2, hf)
    for file in hf.glob("tokenizer*"):
        file.unlink()
    code, out, err = call_qlm("convert", "hf2mcore", "--hf", hf, "--out", tmp_path / "mc", "--no-verify")
    assert code == 0 and "has no tokenizer files" in " ".join(err.split()), err
    code, out, err = call_qlm("convert", "hf2mcore", "--hf", qwen2, "--out", tmp_path / "mc2", "--no-verify")
    assert code == 0 and "tokenizer" not in err, err


def _header_edit(qwen2: Path, tmp_path: Path, change) -> Path:
    import struct

    hf = tmp_path / "hf"
    shutil.copytree(qwen2, hf)
    file = hf / "model.safetensors"
    data = file.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    change(header)
    text = json.dumps(header, separators=(",", ":")).encode()  # offsets count from the data, whatever this length
    file.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + length:])
    return hf


def test_a_header_entry_that_overlaps_another_names_both(qwen2, tmp_path):
    def overlap(header):
        first = header["model.layers.0.mlp.down_proj.weight"]["data_offsets"]
        header["model.layers.0.mlp.up_proj.weight"]["data_offsets"] = [first[0], first[0] + (
            header["model.layers.0.mlp.up_proj.weight"]["data_offsets"][1]
            - header["model.layers.0.mlp.up_proj.weight"]["data_offsets"][0])]

    hf = _header_edit(qwen2, tmp_path, overlap)
    one_error(call_qlm("convert", "hf2mcore", "--hf", hf, "--out", tmp_path / "out"),
              "model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.down_proj.weight", "overlap")


def test_a_header_dtype_safetensors_does_not_define_names_the_tensor(qwen2, tmp_path):
    hf = _header_edit(qwen2, tmp_path, lambda h: h["model.norm.weight"].update(dtype="F99"))
    one_error(call_qlm("convert", "hf2mcore", "--hf", hf, "--out", tmp_path / "out"), "model.norm.weight", "'F99'")


def test_more_stages_than_layers_suggests_a_possible_pp(qwen2, tmp_path):
    line = one_error(call_qlm("convert", "hf2mcore", "--hf", qwen2, "--out", tmp_path / "out", "--pp", "8"),
                     "--pp 8 is more pipeline stages than the model's 4 layers", "at most 4")
    assert "2, 4" in line


def test_a_legacy_file_in_torch_s_old_format_is_read(qwen2, tmp_path):
    from qlm_core.checkpoint.io.safe_load import safe_torch_load

    code, _, err = call_qlm("convert", "hf2mcore", "--hf", qwen2, "--out", tmp_path / "mc", "--tp", "2",
                            "--no-verify")
    assert code == 0, err
    for file in _legacy_files(tmp_path / "mc"):
        torch.save(safe_torch_load(file), file, _use_new_zipfile_serialization=False)  # Megatron-LM of 2020
    code, out, err = call_qlm("convert", "mcore2hf", "--mcore", tmp_path / "mc", "--out", tmp_path / "out",
                              "--verify")
    assert code == 0 and "verified" in out, err


def test_a_stray_expert_rank_folder_is_named(tmp_path):
    make_hf_model(tmp_path / "hf", "qwen3_moe")
    code, _, err = call_qlm("convert", "hf2mcore", "--hf", tmp_path / "hf", "--out", tmp_path / "mc", "--ep", "2",
                            "--no-verify")
    assert code == 0, err
    shutil.copytree(tmp_path / "mc/release/mp_rank_00_001", tmp_path / "mc/release/mp_rank_00_002")
    one_error(call_qlm("convert", "mcore2hf", "--mcore", tmp_path / "mc", "--out", tmp_path / "out"),
              "mp_rank_00_002", "expert_model_parallel_size = 2")


def test_a_sequence_longer_than_the_model_s_context_is_warned(qwen2, tmp_path):
    from qlm_core.train.plan import plan_run

    recipe = load_recipe(REPO / "recipes" / "tiny-sft.toml", [f"model.load={json.dumps(str(qwen2))}",
                                                             'model.spec=""', "data.seq_length=512",
                                                             "data.train=[]"])
    plan = plan_run(recipe, 1, check_files=False)
    assert any("data.seq_length = 512 is longer than the model's max_position_embeddings = 256" in w
               for w in plan.warnings), plan.warnings


@pytest.mark.parametrize("backend", ["qlm", "hf"])
def test_a_document_lm_eval_reads_as_a_list_is_one_line_naming_it(qwen2, tmp_path, backend):
    pytest.importorskip("lm_eval")
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "d.jsonl").write_text('{"text": "fine"}\n{"text": "[1, 2, 3]"}\n')
    (tasks / "t.yaml").write_text(f"""task: list_ppl
dataset_path: json
dataset_kwargs:
  data_files:
    test: {tasks / 'd.jsonl'}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
""")
    one_error(call_qlm("eval", qwen2, "--tasks", "list_ppl", "--include-path", tasks, "--backend", backend),
              "task list_ppl document 1", "a list", "doc_to_target: text")


# ---- caches and config files that lie (helpers' battery, second round) -----------------------------------------

QWEN2_MOE = dict(model_type="qwen2_moe", vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                 moe_intermediate_size=16, shared_expert_intermediate_size=32)


@pytest.mark.parametrize("key,value", [("decoder_sparse_step", 0), ("decoder_sparse_step", "2"),
                                       ("mlp_only_layers", "1"), ("mlp_only_layers", [-1]),
                                       ("norm_topk_prob", "yes"), ("moe_intermediate_size", 0),
                                       ("shared_expert_intermediate_size", 1.5), ("num_experts_per_tok", 5),
                                       ("num_experts", True)])
def test_an_hf_moe_config_value_of_the_wrong_kind_is_one_line(key, value):
    with pytest.raises(QlmError) as caught:
        ModelSpec.from_hf_config({**QWEN2_MOE, key: value})
    assert key in caught.value.line() or "num_experts" in caught.value.line()


def test_an_honest_hf_moe_config_is_read():
    spec = ModelSpec.from_hf_config({**QWEN2_MOE, "mlp_only_layers": [1], "norm_topk_prob": True})
    assert spec.moe.layer_pattern == (1, 0) and not spec.moe.pre_softmax and spec.moe.shared_expert_hidden_size == 32


def _bridge_yaml(tmp_path: Path, **model) -> Path:
    import yaml

    config = {"num_layers": 2, "hidden_size": 32, "ffn_hidden_size": 64, "num_attention_heads": 4,
              "vocab_size": 100, "normalization": "RMSNorm", "gated_linear_unit": True,
              "position_embedding_type": "rope", **model}
    path = tmp_path / "run_config.yaml"
    path.write_text(yaml.safe_dump({"model": config}))
    return path


def test_a_bridge_config_s_expert_parallel_sizes_are_read(tmp_path):
    from qlm_core.checkpoint.formats.megatron.bridge_config import bridge_args

    args = bridge_args(_bridge_yaml(tmp_path, expert_model_parallel_size=2, expert_tensor_parallel_size=1))
    assert (args.expert_model_parallel_size, args.expert_tensor_parallel_size) == (2, 1)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_non_finite_bridge_number_is_one_line(tmp_path, value):
    from qlm_core.checkpoint.formats.megatron.bridge_config import bridge_args

    with pytest.raises(QlmError) as caught:
        bridge_args(_bridge_yaml(tmp_path, rotary_base=value))
    assert "model.rotary_base" in caught.value.line() and "finite" in caught.value.line()


def test_a_demo_file_cut_short_is_built_again(tmp_path):
    from qlm_core.data.demo import build_demo

    paths = build_demo(tmp_path / "demo", num_train=40, num_eval=8, corpus_paragraphs=10, preference_pairs=10)
    whole = paths.train.read_bytes()
    paths.train.write_bytes(whole[: len(whole) // 2])
    build_demo(tmp_path / "demo", num_train=40, num_eval=8, corpus_paragraphs=10, preference_pairs=10)
    assert paths.train.read_bytes() == whole


def test_a_damaged_datasets_cache_is_rebuilt_with_a_warning(tmp_path, capsys):
    records = [{**TRL, "chosen": f"a {i}"} for i in range(6)]
    path = _pairs(tmp_path, records)
    expected = [p["chosen"] for p in _load(path)]
    arrows = sorted((tmp_path / "cache").rglob("*.arrow"))
    assert arrows
    for arrow in arrows:
        arrow.write_bytes(arrow.read_bytes()[:64])
    again = _load(path)
    assert [p["chosen"] for p in again] == expected and len(expected) == 6
    assert "datasets cache of" in capsys.readouterr().err


def _indexed(tmp_path: Path) -> Path:
    import numpy as np

    from qlm_core.data.indexed import IndexedWriter

    prefix = tmp_path / "corpus"
    with IndexedWriter(prefix, np.int32) as writer:
        for n in (5, 3, 7, 4):
            writer.add_document(np.arange(n, dtype=np.int32))
    return prefix


@pytest.mark.parametrize("edit,needle", [
    (lambda raw, n: raw[:34] + (-3).to_bytes(4, "little", signed=True) + raw[38:], "negative length"),
    # the second pointer moved by one token: the sum of the lengths still matches the .bin's size
    (lambda raw, n: raw[:34 + 4 * n + 8] + (24).to_bytes(8, "little") + raw[34 + 4 * n + 16:], "does not start where"),
])
def test_an_index_whose_pointers_or_lengths_lie_is_one_line(tmp_path, edit, needle):
    from qlm_core.data.indexed import IndexedDataset

    prefix = _indexed(tmp_path)
    idx = prefix.with_suffix(".idx")
    raw = idx.read_bytes()
    idx.write_bytes(edit(raw, 4))
    with pytest.raises(QlmError) as caught:
        IndexedDataset(prefix)
    assert needle in caught.value.line() and "qlm data preprocess" in caught.value.line()


def test_a_sample_order_cache_edited_since_it_was_written_is_rebuilt(tmp_path):
    import numpy as np

    from qlm_core.data.indexed import IndexedDataset
    from qlm_core.data.pretrain import PackedDataset, PretrainConfig

    indexed = IndexedDataset(_indexed(tmp_path))
    config = PretrainConfig(seq_length=4, cache_dir=str(tmp_path / "samples"))
    fresh = PackedDataset(indexed, range(4), 6, config)
    expected = [fresh[i]["input_ids"].tolist() for i in range(6)]
    (cache,) = (tmp_path / "samples").glob("*.npz")
    with np.load(cache) as stored:
        arrays = {k: stored[k] for k in stored.files}
    arrays["shuffle"] = arrays["shuffle"][::-1].copy()  # a valid-looking order that is not the seed's
    np.savez(cache, **arrays)
    again = PackedDataset(indexed, range(4), 6, config)
    assert [again[i]["input_ids"].tolist() for i in range(6)] == expected


def test_a_file_where_the_run_s_cache_folder_goes_is_one_line(tmp_path):
    (tmp_path / "in-the-way").write_text("x")
    one_error(call_qlm("train", REPO / "recipes" / "tiny-sft.toml", "--dry-run", "--output", tmp_path / "run",
                       "--set", f"data.cache_dir={tmp_path / 'in-the-way' / 'cache'}"),
              "data.cache_dir", "is a file, not a folder")


def test_a_file_where_inductor_s_cache_goes_is_one_line(tmp_path):
    from qlm_core.train.validate import validate_compile_cache

    (tmp_path / "file").write_text("x")
    with pytest.raises(QlmError) as caught:
        validate_compile_cache({"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "file" / "inductor")})
    assert "TORCHINDUCTOR_CACHE_DIR" in caught.value.line()
    validate_compile_cache({"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "new" / "inductor")})


def test_a_directory_where_a_run_file_goes_is_one_line(tmp_path):
    from qlm_core.train.objectives.reference_table import read_table
    from qlm_core.train.wandb_log import read_run_id

    (tmp_path / "table.safetensors").mkdir()
    (tmp_path / "wandb_run_id").mkdir()
    for call, path in ((read_table, "table.safetensors"), (read_run_id, "wandb_run_id")):
        with pytest.raises(QlmError) as caught:
            call(tmp_path / path)
        assert "is a directory" in caught.value.line()


# ---- numbers and layouts at their extremes (the profile/generate/numbers battery) ---------------------------------

def test_a_tiny_temperature_samples_near_greedy_without_nan(hf_models):
    from helpers import qlm_from_hf

    from qlm_core.decode.sampling import Sampling, generate_rows, left_pad

    model, spec = qlm_from_hf(hf_models["qwen2"])
    ids, mask = left_pad([[1, 2, 3, 4], [5, 6]], 0)
    greedy = generate_rows(model, ids, mask, max_new_tokens=4, eos_token_id=None)
    tiny = generate_rows(model, ids, mask, max_new_tokens=4, eos_token_id=None, sampling=Sampling(temperature=1e-300))
    assert [g.tokens for g in tiny] == [g.tokens for g in greedy]


def test_each_row_decodes_to_its_own_room_in_the_window(hf_models):
    from helpers import qlm_from_hf

    from qlm_core.decode.sampling import generate_rows, left_pad

    model, spec = qlm_from_hf(hf_models["qwen2"])
    ids, mask = left_pad([[1, 2, 3], [4, 5, 6, 7, 8]], 0)
    out = generate_rows(model, ids, mask, max_new_tokens=5, eos_token_id=None, row_limits=[5, 2])
    assert [len(g.tokens) for g in out] == [5, 2] and [g.finish for g in out] == ["length", "length"]
    alone = generate_rows(model, ids[:1, 2:], mask[:1, 2:], max_new_tokens=5, eos_token_id=None)
    assert out[0].tokens == alone[0].tokens


def test_a_document_count_past_any_task_means_all_of_it():
    from qlm_core.eval.runner import documents_limit

    assert documents_limit(1e300) is None and documents_limit(3.0) == 3 and documents_limit(0.5) == 0.5


def test_a_continuation_longer_than_max_length_is_one_line():
    from types import SimpleNamespace

    from qlm_core.eval.requests import check_continuations_fit

    request = SimpleNamespace(task_name="qlm_demo_mc", doc_id=3, args=("context", "a b c d"))
    with pytest.raises(QlmError, match="document 3: its continuation is 4 tokens.*pass --max-length 4 or more"):
        check_continuations_fit([request], str.split, 2)
    check_continuations_fit([request], str.split, 4)


def test_min_lr_above_lr_is_refused():
    from qlm_core.config import load_recipe
    from qlm_core.train.validate import validate_recipe

    recipe = load_recipe(REPO / "recipes" / "tiny-sft.toml", ["schedule.min_lr=1.0"])
    with pytest.raises(QlmError, match="schedule.min_lr 1 is above optim.lr"):
        validate_recipe(recipe)


def test_blend_weights_near_the_float_limit_blend_evenly():
    from qlm_core.data.pretrain import blend_schedule, parse_blend

    datasets, _ = blend_schedule([1e308, 1e308], 6)
    assert datasets.tolist() == [0, 1, 0, 1, 0, 1]
    with pytest.raises(QlmError, match="not a finite non-negative number"):
        parse_blend([(float("inf"), "a"), (1.0, "b")])


def test_a_virtual_pipeline_layout_is_not_told_to_use_gpipe():
    spec, config = PRESETS["qlm-tiny-moe"], ParallelConfig(pp=2, vpp=2, pp_schedule="interleaved_1f1b")
    with pytest.raises(QlmError) as caught:
        validate_layout(spec, config, resolve_sizes(2, pp=2), 64, 8, 24)
    assert "a multiple of 16" in caught.value.line() and "gpipe" not in caught.value.line()


def test_profile_names_the_recipe_keys_for_an_uneven_split():
    line = one_error(call_qlm("profile", REPO / "recipes" / "tiny-sft.toml", "--pp", "3"), "use a --pp that divides")
    assert "parallel.num_layers_in_first_pipeline_stage" in line and "--num-layers-in-first" not in line


def test_profile_and_train_refuse_a_preference_layout_in_the_same_words(tmp_path):
    dpo = REPO / "recipes" / "tiny-dpo.toml"
    profile = one_error(call_qlm("profile", dpo, "--pp", "2", "--dp", "2"), "train.micro_batch_size 8")
    train = one_error(call_qlm("train", dpo, "--dry-run", "--output", tmp_path / "run", "--set", "parallel.pp=2",
                               "--set", "parallel.dp=2"))
    assert profile == train
