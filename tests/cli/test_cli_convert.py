"""`qlm convert` help texts and `inspect` through the console entry point."""

import json
import re

import pytest

from qlm_core.checkpoint.convert.hf_megatron import hf_to_mcore

OPTIONS = {
    "hf2mcore": ["--hf", "--out", "--tp", "--pp", "--vpp", "--num-layers-in-first-pipeline-stage",
                 "--num-layers-in-last-pipeline-stage", "--dtype", "--make-vocab-size-divisible-by", "--force",
                 "--verify", "--format"],
    "mcore2hf": ["--mcore", "--out", "--iteration", "--dtype", "--max-shard-size", "--force", "--verify"],
    "mcore2mcore": ["--mcore", "--out", "--tp", "--pp", "--vpp", "--num-layers-in-first-pipeline-stage",
                    "--num-layers-in-last-pipeline-stage", "--iteration", "--dtype", "--force", "--verify",
                    "--format"],
    "mcore2peft": ["--mcore", "--out", "--iteration", "--force"],
    "ds2hf": ["--ds", "--out", "--tag", "--config", "--dtype", "--max-shard-size", "--force", "--verify"],
    "ds2mcore": ["--ds", "--out", "--tag", "--config", "--tp", "--pp", "--vpp", "--num-layers-in-first-pipeline-stage",
                 "--num-layers-in-last-pipeline-stage", "--dtype", "--make-vocab-size-divisible-by", "--force",
                 "--verify"],
    "hf2ds": ["--hf", "--out", "--tag", "--dtype", "--fp32-master", "--force", "--verify"],
    "mcore2ds": ["--mcore", "--out", "--iteration", "--tag", "--dtype", "--fp32-master", "--force", "--verify",
                 "--config"],
    "inspect": ["--iteration", "--tensors", "--json"],
}


@pytest.mark.parametrize("command", OPTIONS)
def test_every_option_is_explained(run_qlm, command):
    code, stdout, _ = run_qlm("convert", command, "--help")
    assert code == 0
    for option in OPTIONS[command]:
        line = next((row for row in stdout.splitlines() if re.search(rf"{option}\b", row)), None)
        assert line is not None, option
        # each option row carries help text after the option and its type
        assert len(re.sub(r"[│\s]+", " ", line).strip().split(" ")) > 3, line


def test_convert_help_lists_directions(run_qlm):
    code, stdout, _ = run_qlm("convert", "--help")
    assert code == 0 and all(c in stdout for c in OPTIONS)


def test_inspect_hf_and_mcore(run_qlm, hf_models, tmp_path):
    code, stdout, _ = run_qlm("convert", "inspect", hf_models["qwen2"], "--json")
    report = json.loads(stdout)
    assert code == 0 and report["format"] == "hf"
    assert {"name": "model.layers.0.self_attn.q_proj.bias", "shape": [64], "dtype": "float32",
            "where": "model.safetensors"} in report["tensors"]
    hf_to_mcore(hf_models["qwen2"], tmp_path / "m", tp=2, pp=2, vpp=2)
    code, stdout, _ = run_qlm("convert", "inspect", tmp_path / "m", "--json")
    report = json.loads(stdout)
    assert report["format"] == "mcore-torch"
    assert report["layout"] == {"iteration": "release", "tp": 2, "pp": 2, "vpp": 2, "stage_layers": [2, 2],
                                "padded_vocab": 512, "dtype": "float32"}
    assert report["args"]["num_query_groups"] == 2
    rows = [t for t in report["tensors"] if t["where"] == "mp_rank_01_001/model1"]
    assert {"name": "output_layer.weight", "shape": [256, 64], "dtype": "float32",
            "where": "mp_rank_01_001/model1"} in rows
    code, stdout, stderr = run_qlm("convert", "inspect", tmp_path / "m")
    assert code == 0 and "mcore-torch" in stdout and "decoder.layers.0.mlp.linear_fc1.weight" in stdout


def test_inspect_unknown_directory(run_qlm, tmp_path):
    code, _, stderr = run_qlm("convert", "inspect", tmp_path)
    assert code == 2 and "cannot tell the checkpoint format" in stderr
