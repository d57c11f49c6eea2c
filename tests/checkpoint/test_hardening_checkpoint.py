"""Hostile checkpoints and output locations for `qlm convert`: one line on stderr (`error: PROBLEM; FIX.`), exit 2,
nothing half-written and an old output intact (issue 13)."""

from __future__ import annotations

import errno
import json
import pathlib
import shutil
import struct

import pytest
import torch
from conftest import call_qlm, make_hf_model

from qlm_core.checkpoint.convert.verify import VerifyReport, bit_equal, compare_tensors
from qlm_core.checkpoint.io.safe_load import safe_torch_load
from qlm_core.errors import QlmError
from qlm_core.models.layout import ModelLayout
from qlm_core.models.spec import ModelSpec

LATEST = "latest_checkpointed_iteration.txt"
NOT_UTF8 = b"\xff\xfe{\xe9}"


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / "hf"
    make_hf_model(path, "qwen2")
    return path


def converted(tmp_path_factory, *args) -> pathlib.Path:
    out = tmp_path_factory.mktemp("ckpt") / "out"
    code, _, stderr = call_qlm(*args, "--out", out, "--no-verify")
    assert code == 0, stderr
    return out


@pytest.fixture(scope="module")
def mcore(hf, tmp_path_factory):
    return converted(tmp_path_factory, "convert", "hf2mcore", "--hf", hf, "--tp", "2")


@pytest.fixture(scope="module")
def ds(hf, tmp_path_factory):
    return converted(tmp_path_factory, "convert", "hf2ds", "--hf", hf)


@pytest.fixture(scope="module")
def ds_bf16(hf, tmp_path_factory):
    return converted(tmp_path_factory, "convert", "hf2ds", "--hf", hf, "--dtype", "bf16")


def one_error(result, *needles) -> str:
    code, stdout, stderr = result
    assert code == 2, (code, stdout, stderr[-2000:])
    assert "Traceback" not in stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "; " in errors[0], stderr
    for needle in needles:
        assert needle in errors[0], (needle, errors[0])
    return errors[0]


def no_leftovers(directory: pathlib.Path):
    assert not [p.name for p in directory.iterdir() if ".partial" in p.name or ".old-" in p.name]


def copy(src, dst):
    return shutil.copytree(src, dst)


# ---- text and JSON metadata --------------------------------------------------------------------------------------

def test_metadata_files_not_utf8(run_qlm, hf, mcore, ds, tmp_path):
    src = copy(hf, tmp_path / "hf")
    (src / "config.json").write_bytes(NOT_UTF8)
    one_error(run_qlm("convert", "hf2mcore", "--hf", src, "--out", tmp_path / "o1"), "config.json", "UTF-8")
    mc = copy(mcore, tmp_path / "mc")
    (mc / LATEST).write_bytes(NOT_UTF8)
    one_error(run_qlm("convert", "mcore2hf", "--mcore", mc, "--out", tmp_path / "o2"), LATEST, "UTF-8")
    d = copy(ds, tmp_path / "ds")
    (d / "latest").write_bytes(NOT_UTF8)
    one_error(run_qlm("convert", "ds2hf", "--ds", d, "--out", tmp_path / "o3"), "latest", "UTF-8")
    assert not any((tmp_path / f"o{i}").exists() for i in (1, 2, 3))


def test_config_json_that_is_not_an_object(run_qlm, hf, tmp_path):
    src = copy(hf, tmp_path / "hf")
    (src / "config.json").write_text("[1, 2]")
    one_error(run_qlm("convert", "hf2mcore", "--hf", src, "--out", tmp_path / "out"), "config.json", "list")


def test_config_json_sizes(run_qlm, hf, tmp_path):
    src = copy(hf, tmp_path / "hf")
    config = json.loads((src / "config.json").read_text())
    del config["hidden_size"]
    (src / "config.json").write_text(json.dumps(config))
    one_error(run_qlm("convert", "hf2mcore", "--hf", src, "--out", tmp_path / "out"), "lacks hidden_size")
    config["hidden_size"] = "64"
    (src / "config.json").write_text(json.dumps(config))
    one_error(run_qlm("convert", "hf2mcore", "--hf", src, "--out", tmp_path / "out"), "hidden_size '64'")


# ---- files that lie ----------------------------------------------------------------------------------------------

def test_safetensors_header_longer_than_file(run_qlm, hf, tmp_path):
    src = copy(hf, tmp_path / "hf")
    data = bytearray((src / "model.safetensors").read_bytes())
    data[:8] = struct.pack("<Q", 2**62)
    (src / "model.safetensors").write_bytes(bytes(data))
    one_error(run_qlm("convert", "hf2mcore", "--hf", src, "--out", tmp_path / "out"), "model.safetensors", "header")


def test_safetensors_shape_that_disagrees_with_its_bytes(run_qlm, hf, tmp_path):
    src = copy(hf, tmp_path / "hf")
    data = (src / "model.safetensors").read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    header["model.norm.weight"]["dtype"] = "BF16"  # the same shape in half the bytes it holds
    text = json.dumps(header, separators=(",", ":")).encode().ljust(length)
    (src / "model.safetensors").write_bytes(data[:8] + text + data[8 + length:])
    one_error(run_qlm("convert", "hf2mcore", "--hf", src, "--out", tmp_path / "out", "--no-verify"),
              "model.norm.weight", "BF16", "256 bytes")


def test_num_hidden_layers_disagrees_with_layer_types(run_qlm, hf, tmp_path):
    src = copy(hf, tmp_path / "hf")
    config = json.loads((src / "config.json").read_text())
    assert len(config["layer_types"]) == 4
    config["num_hidden_layers"] = 3
    (src / "config.json").write_text(json.dumps(config))
    one_error(run_qlm("convert", "hf2mcore", "--hf", src, "--out", tmp_path / "out", "--no-verify"),
              "num_hidden_layers 3", "layer_types")


def test_config_with_fewer_layers_than_the_weights(run_qlm, hf, tmp_path):
    src = copy(hf, tmp_path / "hf")
    config = json.loads((src / "config.json").read_text())
    config["num_hidden_layers"], config["layer_types"] = 3, config["layer_types"][:3]
    (src / "config.json").write_text(json.dumps(config))
    one_error(run_qlm("convert", "hf2mcore", "--hf", src, "--out", tmp_path / "out", "--no-verify"),
              "layers 3", "model.layers.3.")
    one_error(run_qlm("convert", "hf2ds", "--hf", src, "--out", tmp_path / "out2", "--no-verify"), "layers 3")


def test_megatron_args_that_contradict_the_shards(run_qlm, mcore, tmp_path):
    mc = copy(mcore, tmp_path / "mc")
    shutil.rmtree(mc / "hf")
    for file in (mc / "release").glob("mp_rank_*/model_optim_rng.pt"):
        state = safe_torch_load(file)
        state["args"].ffn_hidden_size = 128
        torch.save(state, file)
    one_error(run_qlm("convert", "mcore2hf", "--mcore", mc, "--out", tmp_path / "out"),
              "decoder.layers.0.mlp.linear_fc1.weight", "[96, 64]", "[128, 64]", "ffn_hidden_size")


def test_megatron_args_parallel_sizes_disagree_with_folders(run_qlm, mcore, tmp_path):
    mc = copy(mcore, tmp_path / "mc")
    for file in (mc / "release").glob("mp_rank_*/model_optim_rng.pt"):
        state = safe_torch_load(file)
        state["args"].pipeline_model_parallel_size = 2
        torch.save(state, file)
    one_error(run_qlm("convert", "mcore2hf", "--mcore", mc, "--out", tmp_path / "out"),
              "TP 2 PP 1", "TP 2 PP 2", "pipeline_model_parallel_size")


def test_sharded_model_missing_a_shard(run_qlm, hf, tmp_path):
    from safetensors.torch import load_file, save_file

    src = tmp_path / "sharded"
    src.mkdir()
    for item in hf.iterdir():
        if item.suffix != ".safetensors":
            shutil.copy2(item, src / item.name)
    tensors = load_file(hf / "model.safetensors")
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for file, part in halves.items():
        save_file({n: tensors[n] for n in part}, src / file, metadata={"format": "pt"})
    weight_map = {n: file for file, part in halves.items() for n in part}
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (src / "model-00002-of-00002.safetensors").unlink()
    one_error(run_qlm("convert", "hf2mcore", "--hf", src, "--out", tmp_path / "out"),
              "model-00002-of-00002.safetensors", "index")


def test_deepspeed_latest_outside_the_checkpoint(run_qlm, ds, tmp_path):
    d = copy(ds, tmp_path / "ds")
    shutil.copytree(d / "global_step0", tmp_path / "elsewhere")
    (d / "latest").write_text("../elsewhere")
    one_error(run_qlm("convert", "ds2hf", "--ds", d, "--out", tmp_path / "out"), "../elsewhere", "latest")
    one_error(run_qlm("convert", "ds2hf", "--ds", d, "--tag", "../elsewhere", "--out", tmp_path / "out"), "--tag")
    from qlm_core.checkpoint.formats.deepspeed.checkpoint import resolve_tag_dir

    assert resolve_tag_dir(d, "global_step0/") == d / "global_step0"  # a shell-completed tag directory


def test_bf16_zero2_without_optimizer_files(run_qlm, ds_bf16, tmp_path):
    d = copy(ds_bf16, tmp_path / "ds")
    removed = sorted(p.name for p in (d / "global_step0").glob("*optim_states.pt"))
    assert removed == ["bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"]
    for name in removed:
        (d / "global_step0" / name).unlink()
    one_error(run_qlm("convert", "ds2hf", "--ds", d, "--out", tmp_path / "out"), removed[0], "--allow-bf16-weights")
    assert not (tmp_path / "out").exists()
    code, stdout, stderr = run_qlm("convert", "ds2hf", "--ds", d, "--out", tmp_path / "out", "--allow-bf16-weights",
                                   "--no-verify")
    assert code == 0, stderr
    assert "warning:" in stderr and "fp32 precision was lost" in stderr
    from qlm_core.checkpoint.sources.open import open_checkpoint  # eval / generate / train read the module weights

    assert "module weights, no optimizer files" in open_checkpoint(d).description


# ---- NaN ---------------------------------------------------------------------------------------------------------

def test_bit_equal_treats_same_nan_as_equal():
    a = torch.tensor([1.0, float("nan"), 3.0], dtype=torch.bfloat16)
    assert bit_equal(a, a.clone()) and not torch.equal(a, a.clone())
    assert not bit_equal(a, torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16))
    assert not bit_equal(a, a.float())


def test_verify_with_nan_in_source_warns(run_qlm, hf, tmp_path):
    from safetensors.torch import load_file, save_file

    src = copy(hf, tmp_path / "hf")
    tensors = load_file(src / "model.safetensors")
    tensors["model.layers.1.mlp.up_proj.weight"][0, :5] = float("nan")
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    code, stdout, stderr = run_qlm("convert", "hf2mcore", "--hf", src, "--out", tmp_path / "out", "--verify")
    assert code == 0, stderr
    assert "verified" in stdout
    warning = next(line for line in stderr.splitlines() if line.startswith("warning:"))
    assert "NaN" in warning and "model.layers.1.mlp.up_proj.weight" in warning and " 5 " in warning


def test_compare_tensors_counts_nan(hf):
    from qlm_core.checkpoint.formats.hf.checkpoint import HFCheckpoint
    from qlm_core.models.layout import HFTensorSource

    class NaNSource:
        def __init__(self, inner):
            self.inner = inner

        def stored_dtype(self, tensor):
            return self.inner.stored_dtype(tensor)

        def read_into(self, tensor, start, stop, out):
            self.inner.read_into(tensor, start, stop, out)
            if tensor.name == "decoder.final_layernorm.weight":
                out[:2] = float("nan")

    ckpt = HFCheckpoint(hf)
    layout = ModelLayout(ckpt.spec)
    source = NaNSource(HFTensorSource(ckpt))
    report = VerifyReport()
    compare_tensors(report, (layout, source), (layout, source), torch.float32)
    assert report.ok and report.nan_counts == {"model.norm.weight": 2}
    assert "model.norm.weight has 2 NaN" in report.warnings()[0]


# ---- outputs -----------------------------------------------------------------------------------------------------

def old_output(tmp_path) -> pathlib.Path:
    old = tmp_path / "old"
    old.mkdir()
    (old / "keep.txt").write_text("precious")
    return old


def assert_old_kept(old):
    assert [p.name for p in old.iterdir()] == ["keep.txt"] and (old / "keep.txt").read_text() == "precious"
    no_leftovers(old.parent)


def test_out_below_a_regular_file(run_qlm, hf, tmp_path):
    (tmp_path / "afile").write_text("x")
    one_error(run_qlm("convert", "hf2mcore", "--hf", hf, "--out", tmp_path / "afile" / "sub"), "afile", "is a file")


@pytest.mark.parametrize("code", [errno.EACCES, errno.EROFS])
def test_out_in_unwritable_directory(run_qlm, hf, tmp_path, monkeypatch, code):
    """Root ignores chmod: the refusal is injected where the staging directory is made."""
    ro = tmp_path / "ro"
    ro.mkdir()
    real = pathlib.Path.mkdir

    def refuse(self, *args, **kwargs):
        if ro in self.parents:
            raise OSError(code, __import__("os").strerror(code), str(self))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "mkdir", refuse)
    one_error(run_qlm("convert", "hf2ds", "--hf", hf, "--out", ro / "out"), str(ro / "out"),
              __import__("os").strerror(code))
    assert not list(ro.iterdir())


def test_disk_full_mid_write_keeps_old_output(run_qlm, hf, mcore, tmp_path, monkeypatch):
    from qlm_core.checkpoint.formats.hf import checkpoint as hf_format
    from qlm_core.checkpoint.formats.megatron import write as megatron_write

    old = old_output(tmp_path)
    calls = []
    real_write = megatron_write.write_shard_file

    def full(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device", str(args[0]))
        return real_write(*args, **kwargs)

    monkeypatch.setattr(megatron_write, "write_shard_file", full)
    one_error(run_qlm("convert", "hf2mcore", "--hf", hf, "--out", old, "--force", "--tp", "2"),
              "No space left on device", str(old), "old output is intact")
    assert_old_kept(old)

    def full_safetensors(path, tensors):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(hf_format, "save_file", lambda *a, **k: full_safetensors(a[1], a[0]))
    one_error(run_qlm("convert", "mcore2hf", "--mcore", mcore, "--out", old, "--force"), "No space left on device")
    assert_old_kept(old)


def test_stale_partial_directories_are_removed(run_qlm, hf, tmp_path):
    stale = [tmp_path / ".out.partial-0123abcd", tmp_path / ".out.partial-999999999-0123abcd"]
    for path in stale:
        path.mkdir()
        (path / "junk").write_text("left by a killed run")
    other = tmp_path / ".other.partial-0123abcd"  # another output's: not ours to remove
    other.mkdir()
    code, _, stderr = run_qlm("convert", "hf2mcore", "--hf", hf, "--out", tmp_path / "out", "--no-verify")
    assert code == 0, stderr
    assert not any(p.exists() for p in stale) and other.exists()
    assert (tmp_path / "out" / LATEST).exists()


# ---- uneven pipelines ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def spec(hf):
    return ModelSpec.from_hf_dir(hf)


@pytest.mark.parametrize("kwargs, needles", [
    (dict(pp=2, first_stage_layers=1, last_stage_layers=2),
     ["--num-layers-in-first-pipeline-stage 1", "--num-layers-in-last-pipeline-stage 2", "hold 3 layers",
      "add up to 4"]),
    (dict(pp=3, first_stage_layers=3, last_stage_layers=3), ["at most 3"]),
    (dict(pp=1, last_stage_layers=2), ["--num-layers-in-last-pipeline-stage 2", "--pp > 1"]),
    (dict(pp=3, first_stage_layers=1), ["valid --num-layers-in-first-pipeline-stage values at --pp 3: 2"]),
    (dict(pp=2, vpp=2, first_stage_layers=1), ["[1, 3]", "first/last stage sizes that --vpp divides"]),
])
def test_uneven_pipeline_errors(spec, kwargs, needles):
    with pytest.raises(QlmError) as err:
        ModelLayout(spec, **kwargs)
    for needle in needles:
        assert needle in err.value.line(), (needle, err.value.line())


def test_two_stages_sized_both_ways_as_megatron_accepts(spec):
    assert ModelLayout(spec, pp=2, first_stage_layers=1, last_stage_layers=3).stage_layer_counts == (1, 3)


def test_uneven_pipeline_convert_cli(run_qlm, hf, tmp_path):
    old = old_output(tmp_path)
    one_error(run_qlm("convert", "hf2mcore", "--hf", hf, "--out", old, "--force", "--pp", "2",
                      "--num-layers-in-first-pipeline-stage", "1", "--num-layers-in-last-pipeline-stage", "2"),
              "--num-layers-in-first-pipeline-stage 1")
    assert_old_kept(old)


def test_inspect_reads_deepspeeds_latest_by_the_readers_rules(run_qlm, tmp_path):
    (tmp_path / "mp_rank_00_model_states.pt").touch()
    (tmp_path / "latest").write_bytes(b"global_step1\xff")
    one_error(run_qlm("convert", "inspect", tmp_path), "latest is not UTF-8 text")
    (tmp_path / "latest").write_text("../outside")
    one_error(run_qlm("convert", "inspect", tmp_path), "is not a tag directory inside")


def test_torch_and_safetensors_write_faults_are_os_errors(tmp_path, monkeypatch):
    """On a full disk torch.save raises a RuntimeError from its zip writer and safetensors a SafetensorError with
    the OS error number (both measured on a full tmpfs); staged outputs and checkpoints name them as write faults."""
    import shutil
    from collections import namedtuple

    from safetensors import SafetensorError

    from qlm_core.checkpoint.io import write_faults

    found = write_faults.as_write_os_error(
        SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)"), tmp_path)
    assert found.errno == errno.ENOSPC and found.filename == str(tmp_path)
    torch_error = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10, 10, 0))
    assert write_faults.as_write_os_error(torch_error, tmp_path).errno == errno.ENOSPC
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10 << 30, 0, 10 << 30))
    assert write_faults.as_write_os_error(torch_error, tmp_path).errno == errno.EIO
    assert write_faults.as_write_os_error(RuntimeError("shape mismatch"), tmp_path) is None  # a bug stays a bug
