"""Bad input: one line naming the problem and the fix, exit code 2, nothing half-written."""

import json
import shutil

import pytest
from conftest import make_hf_model
from helpers import assert_clean_failure

from qlm_core.checkpoint.formats.megatron import write as convert_module


@pytest.fixture(scope="module")
def good_hf(tmp_path_factory):
    path = tmp_path_factory.mktemp("good") / "hf"
    make_hf_model(path, "qwen2")
    return path


def copy_hf(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_missing_config(run_qlm, good_hf, tmp_path):
    src = copy_hf(good_hf, tmp_path / "src")
    (src / "config.json").unlink()
    out = tmp_path / "out"
    assert_clean_failure(run_qlm("convert", "hf2mcore", "--hf", src, "--out", out), out, "config.json")


def test_unreadable_config(run_qlm, good_hf, tmp_path):
    src = copy_hf(good_hf, tmp_path / "src")
    (src / "config.json").write_text("{not json")
    out = tmp_path / "out"
    assert_clean_failure(run_qlm("convert", "hf2mcore", "--hf", src, "--out", out), out, "config.json")


def test_missing_weights(run_qlm, good_hf, tmp_path):
    src = copy_hf(good_hf, tmp_path / "src")
    (src / "model.safetensors").unlink()
    out = tmp_path / "out"
    assert_clean_failure(run_qlm("convert", "hf2mcore", "--hf", src, "--out", out), out, "safetensors")


def test_truncated_safetensors(run_qlm, good_hf, tmp_path):
    src = copy_hf(good_hf, tmp_path / "src")
    data = (src / "model.safetensors").read_bytes()
    (src / "model.safetensors").write_bytes(data[: len(data) // 2])
    out = tmp_path / "out"
    assert_clean_failure(run_qlm("convert", "hf2mcore", "--hf", src, "--out", out), out, "truncated")


def test_tp_must_divide_heads(run_qlm, good_hf, tmp_path):
    out = tmp_path / "out"
    assert_clean_failure(run_qlm("convert", "hf2mcore", "--hf", good_hf, "--out", out, "--tp", "3"), out,
                         "--tp 3", "num_attention_heads")


def test_pp_must_divide_layers(run_qlm, good_hf, tmp_path):
    out = tmp_path / "out"
    assert_clean_failure(run_qlm("convert", "hf2mcore", "--hf", good_hf, "--out", out, "--pp", "3"), out,
                         "4 layers", "--num-layers-in-first-pipeline-stage")


def test_shapes_must_match_config(run_qlm, good_hf, tmp_path):
    src = copy_hf(good_hf, tmp_path / "src")
    config = json.loads((src / "config.json").read_text())
    config["intermediate_size"] = 128
    (src / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    assert_clean_failure(run_qlm("convert", "hf2mcore", "--hf", src, "--out", out), out, "gate_proj", "[96, 64]")


def test_existing_output_needs_force(run_qlm, good_hf, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    code, _, stderr = run_qlm("convert", "hf2mcore", "--hf", good_hf, "--out", out)
    assert code == 2 and "--force" in stderr and (out / "keep.txt").read_text() == "precious"
    code, stdout, stderr = run_qlm("convert", "hf2mcore", "--hf", good_hf, "--out", out, "--force")
    assert code == 0, stderr
    assert not (out / "keep.txt").exists() and (out / "latest_checkpointed_iteration.txt").exists()
    assert "verified" in stdout


def test_failure_mid_write_leaves_nothing(run_qlm, good_hf, tmp_path, monkeypatch):
    calls = []

    def failing_write(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise OSError("No space left on device")
        return real_write(*args, **kwargs)

    real_write = convert_module.write_shard_file
    monkeypatch.setattr(convert_module, "write_shard_file", failing_write)
    out = tmp_path / "out"
    with pytest.raises(OSError):
        run_qlm("convert", "hf2mcore", "--hf", good_hf, "--out", out, "--tp", "2")
    assert len(calls) == 2 and not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]


def test_mcore_missing_rank_file_and_bad_latest(run_qlm, good_hf, tmp_path):
    mcore = tmp_path / "mcore"
    assert run_qlm("convert", "hf2mcore", "--hf", good_hf, "--out", mcore, "--tp", "2")[0] == 0
    (mcore / "latest_checkpointed_iteration.txt").write_text("500")
    out = tmp_path / "hf"
    assert_clean_failure(run_qlm("convert", "mcore2hf", "--mcore", mcore, "--out", out), out, "iter_0000500")
    (mcore / "latest_checkpointed_iteration.txt").write_text("release")
    shutil.rmtree(mcore / "release" / "mp_rank_01")
    assert_clean_failure(run_qlm("convert", "mcore2hf", "--mcore", mcore, "--out", out), out, "mp_rank_01")


def test_output_inside_input_is_refused(run_qlm, good_hf, tmp_path):
    src = copy_hf(good_hf, tmp_path / "src")
    out = src / "mcore"
    code, _, stderr = run_qlm("convert", "hf2mcore", "--hf", src, "--out", out)
    assert code == 2 and "overlaps" in stderr and not out.exists()
