"""`qlm convert SRC --to FORMAT`: every pair the named verbs cover, through the one entry point, round trips bit-exact
with --verify; options a direction does not take and pairs qlm does not convert are one line."""

from __future__ import annotations

import pytest
from conftest import call_qlm
from helpers import assert_same_hf


def convert(src, out, to, *options):
    code, stdout, stderr = call_qlm("convert", src, "--to", to, "--out", out, *map(str, options))
    assert code == 0, stderr[-2000:]
    return stdout


@pytest.mark.parametrize("chain", [
    [("torch", "--tp", 2, "--pp", 2, "--verify"), ("hf", "--verify")],
    [("torch_dist", "--tp", 2, "--verify"), ("torch", "--pp", 2, "--verify"), ("hf", "--verify")],
    [("deepspeed", "--verify"), ("torch", "--tp", 2, "--verify"), ("deepspeed", "--verify"), ("hf", "--verify")],
], ids=["hf-torch-hf", "hf-torch_dist-torch-hf", "hf-ds-torch-ds-hf"])
def test_a_chain_of_conversions_gives_back_the_hf_model_bit_for_bit(hf_models, tmp_path, chain):
    src = hf_models["qwen2"]
    for step, (to, *options) in enumerate(chain):
        out = tmp_path / f"{step}-{to}"
        stdout = convert(src, out, to, *options)
        assert "verified" in stdout and "bit-exact" in stdout, stdout
        src = out
    assert_same_hf(src, hf_models["qwen2"])


def test_the_named_verbs_and_the_entry_point_write_the_same_files(hf_models, tmp_path):
    src = hf_models["qwen2"]
    code, _, stderr = call_qlm("convert", "hf2mcore", "--hf", src, "--out", tmp_path / "alias", "--tp", "2")
    assert code == 0, stderr
    convert(src, tmp_path / "entry", "torch", "--tp", 2)
    alias = sorted(p.relative_to(tmp_path / "alias") for p in (tmp_path / "alias").rglob("*") if p.is_file())
    entry = sorted(p.relative_to(tmp_path / "entry") for p in (tmp_path / "entry").rglob("*") if p.is_file())
    assert alias == entry
    for name in alias:
        if name.suffix == ".pt":
            continue  # torch.save embeds the file's archive name, which is the folder's
        assert (tmp_path / "alias" / name).read_bytes() == (tmp_path / "entry" / name).read_bytes(), name


@pytest.mark.parametrize("to,options,needles", [
    ("torch", ["--max-shard-size", "1"], ["--max-shard-size does not apply to hf -> torch (hf2mcore)"]),
    ("hf", [], ["qlm does not convert hf to hf"]),
    ("peft", [], ["qlm does not convert hf to peft", "from hf it writes deepspeed, torch, torch_dist"]),
    ("deepspeed", ["--max-shard-size", "1"], ["--max-shard-size does not apply to hf -> deepspeed (hf2ds)",
                                               "takes --tag, --dtype, --fp32-master"]),
])
def test_an_option_or_pair_qlm_does_not_convert_is_one_line(hf_models, tmp_path, to, options, needles):
    code, _, stderr = call_qlm("convert", hf_models["qwen2"], "--to", to, "--out", tmp_path / "out", *options)
    assert code == 2 and "Traceback" not in stderr, stderr
    line = stderr.strip().splitlines()[-1]
    assert all(n in line for n in needles), line
    assert not (tmp_path / "out").exists()
