"""Hostile checkpoints for `qlm convert` (and the readers train/eval share): files that are not UTF-8 or lie about
their contents, NaN weights, outputs that cannot be written, uneven pipeline splits, broken or foreign files.

Faults that need the operating system to misbehave (a full disk, a read-only directory when running as root) are
injected with a sitecustomize.py put first on the case's PYTHONPATH."""

from __future__ import annotations

import json
import os
import shutil
import struct
import textwrap
from pathlib import Path

from battery.case import Case

REPO = Path(__file__).resolve().parents[2]
LATEST = "latest_checkpointed_iteration.txt"
NOT_UTF8 = b"\xff\xfe\x00{\xe9t\xe9}"


# ---- setup helpers ---------------------------------------------------------------------------------------------

def cp(fx, name: str, root: Path) -> Path:
    """A private copy of a checkpoint fixture (hf, or one of Fixtures.checkpoints)."""
    if name == "hf":
        return fx.copy("hf", root)
    dst = root / name
    shutil.copytree(fx.checkpoints(name), dst)
    return dst


def old_output(root: Path) -> Path:
    """An existing output directory a failed convert (with --force) must leave as it was."""
    old = root / "old"
    old.mkdir()
    (old / "keep.txt").write_text("precious")
    return old


def edit_json(path: Path, change):
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def edit_megatron_files(mc: Path, change):
    """Apply change(state) to every rank file of a legacy Megatron checkpoint (release/)."""
    import torch

    from qlm_core.checkpoint.io.safe_load import safe_torch_load

    for file in sorted((mc / "release").glob("mp_rank_*/model_optim_rng.pt")):
        state = safe_torch_load(file)
        change(state)
        torch.save(state, file)


def inject(root: Path, code: str) -> dict:
    """Environment that runs `code` at interpreter start (a sitecustomize.py first on PYTHONPATH)."""
    site = root / "inject"
    site.mkdir()
    (site / "sitecustomize.py").write_text(textwrap.dedent(code))
    return {"PYTHONPATH": os.pathsep.join([str(site), str(REPO)])}


def fail_nth_call(module: str, attr: str, n: int, err: str) -> str:
    """sitecustomize code: the n-th call of module.attr raises OSError(errno.<err>)."""
    return f"""
        import errno, importlib, os
        _mod = importlib.import_module({module!r})
        _real = getattr(_mod, {attr!r})
        _calls = [0]
        def _failing(*args, **kwargs):
            _calls[0] += 1
            if _calls[0] == {n}:
                code = errno.{err}
                raise OSError(code, os.strerror(code), str(args[1]) if len(args) > 1 else None)
            return _real(*args, **kwargs)
        setattr(_mod, {attr!r}, _failing)
        """


def refuse_mkdir_under(path: Path, err: str) -> str:
    """sitecustomize code: creating anything inside `path` fails with errno.<err> (chmod does not stop root)."""
    return f"""
        import errno, os, pathlib
        _real = pathlib.Path.mkdir
        def _mkdir(self, *args, **kwargs):
            if str(self).startswith({str(path) + os.sep!r}):
                raise OSError(errno.{err}, os.strerror(errno.{err}), str(self))
            return _real(self, *args, **kwargs)
        pathlib.Path.mkdir = _mkdir
        """


# ---- check helpers ---------------------------------------------------------------------------------------------

def error_line(out) -> str:
    return next((line for line in out.stderr.splitlines() if line.startswith("error:")), "")


def says(*needles):
    def check(root, out):
        line = error_line(out)
        missing = [n for n in needles if n not in line]
        return f"message lacks {missing}: {line[:300]}" if missing else None
    return check


def old_kept(*needles):
    """The message names `needles` and the old output directory is untouched."""
    def check(root, out):
        keep = root / "old" / "keep.txt"
        if not keep.exists() or keep.read_text() != "precious" or len(list((root / "old").iterdir())) != 1:
            return "the old output was changed or removed"
        return says(*needles)(root, out)
    return check


def nothing_at(name: str, *needles):
    def check(root, out):
        if (root / name).exists():
            return f"{name} was written"
        return says(*needles)(root, out)
    return check


# ---- 2 not utf-8 / malformed metadata --------------------------------------------------------------------------

def hf_config_not_utf8(root, fx):
    hf = cp(fx, "hf", root)
    (hf / "config.json").write_bytes(NOT_UTF8)
    return ["convert", "hf2mcore", "--hf", hf, "--out", root / "out"]


def hf_config_is_list(root, fx):
    hf = cp(fx, "hf", root)
    (hf / "config.json").write_text("[1, 2, 3]")
    return ["convert", "hf2ds", "--hf", hf, "--out", root / "out"]


def hf_config_bad_sizes(root, fx):
    hf = cp(fx, "hf", root)
    edit_json(hf / "config.json", lambda c: c.update(num_attention_heads="four"))
    return ["convert", "hf2mcore", "--hf", hf, "--out", root / "out"]


def megatron_latest_not_utf8(root, fx):
    mc = cp(fx, "megatron", root)
    (mc / LATEST).write_bytes(b"\xff\xfe1\x000")
    return ["convert", "mcore2hf", "--mcore", mc, "--out", root / "out"]


def megatron_latest_not_integer(root, fx):
    mc = cp(fx, "megatron", root)
    (mc / LATEST).write_text("12abc\n")
    return ["convert", "mcore2mcore", "--mcore", mc, "--out", root / "out"]


def megatron_side_config_not_utf8(root, fx):
    mc = cp(fx, "megatron", root)
    (mc / "hf" / "config.json").write_bytes(NOT_UTF8)
    return ["convert", "mcore2hf", "--mcore", mc, "--out", root / "out"]


def deepspeed_latest_not_utf8(root, fx):
    ds = cp(fx, "deepspeed", root)
    (ds / "latest").write_bytes(b"global_step\xff0")
    return ["convert", "ds2hf", "--ds", ds, "--out", root / "out"]


def deepspeed_config_not_utf8(root, fx):
    ds = cp(fx, "deepspeed", root)
    (ds / "config.json").write_bytes(NOT_UTF8)
    return ["convert", "ds2mcore", "--ds", ds, "--out", root / "out"]


def torch_dist_metadata_json_not_utf8(root, fx):
    td = cp(fx, "torch_dist", root)
    (td / "release" / "metadata.json").write_bytes(NOT_UTF8)
    return ["convert", "mcore2hf", "--mcore", td, "--out", root / "out"]


def index_not_utf8(root, fx):
    hf = cp(fx, "hf_sharded", root)
    (hf / "model.safetensors.index.json").write_bytes(NOT_UTF8)
    return ["convert", "hf2mcore", "--hf", hf, "--out", root / "out"]


def index_malformed(root, fx):
    hf = cp(fx, "hf_sharded", root)
    (hf / "model.safetensors.index.json").write_text('{"weight_map": {"model.norm.weight": ')
    return ["convert", "hf2ds", "--hf", hf, "--out", root / "out"]


# ---- 3 files that lie ------------------------------------------------------------------------------------------

def safetensors_header_too_long(root, fx):
    hf = cp(fx, "hf", root)
    file = hf / "model.safetensors"
    data = bytearray(file.read_bytes())
    data[:8] = struct.pack("<Q", 2**62)
    file.write_bytes(bytes(data))
    return ["convert", "hf2mcore", "--hf", hf, "--out", root / "out"]


def safetensors_header_not_a_map(root, fx):
    hf = cp(fx, "hf", root)
    header = b"[1, 2, 3]"
    (hf / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    return ["convert", "hf2mcore", "--hf", hf, "--out", root / "out"]


def safetensors_shape_lies(root, fx):
    hf = cp(fx, "hf", root)
    file = hf / "model.safetensors"
    data = file.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    header["model.norm.weight"]["dtype"] = "BF16"  # the same shape in half the bytes it holds
    text = json.dumps(header, separators=(",", ":")).encode().ljust(length)
    assert len(text) == length
    file.write_bytes(data[:8] + text + data[8 + length:])
    return ["convert", "hf2mcore", "--hf", hf, "--out", root / "out"]


def layer_types_disagree(root, fx):
    hf = cp(fx, "hf", root)
    edit_json(hf / "config.json", lambda c: c.update(num_hidden_layers=3))
    return ["convert", "hf2mcore", "--hf", hf, "--out", root / "out"]


def config_fewer_layers_than_weights(root, fx):
    hf = cp(fx, "hf", root)

    def drop_a_layer(config):
        config["num_hidden_layers"] = 3
        if isinstance(config.get("layer_types"), list):
            config["layer_types"] = config["layer_types"][:3]
    edit_json(hf / "config.json", drop_a_layer)
    old_output(root)
    return ["convert", "hf2mcore", "--hf", hf, "--out", root / "old", "--force"]


def megatron_args_wrong_ffn(root, fx):
    mc = cp(fx, "megatron", root)
    shutil.rmtree(mc / "hf")  # the args are then all that describes the architecture

    def lie(state):
        state["args"].ffn_hidden_size = 128
    edit_megatron_files(mc, lie)
    return ["convert", "mcore2hf", "--mcore", mc, "--out", root / "out"]


def megatron_args_wrong_groups(root, fx):
    mc = cp(fx, "megatron", root)
    shutil.rmtree(mc / "hf")

    def lie(state):
        state["args"].num_query_groups = 4
    edit_megatron_files(mc, lie)
    return ["convert", "mcore2mcore", "--mcore", mc, "--out", root / "out", "--tp", "1", "--pp", "1"]


def megatron_side_config_lies(root, fx):
    mc = cp(fx, "megatron", root)
    edit_json(mc / "hf" / "config.json", lambda c: c.update(intermediate_size=128))
    return ["convert", "mcore2ds", "--mcore", mc, "--out", root / "out"]


def megatron_args_tp_beyond_folders(root, fx):
    mc = cp(fx, "megatron", root)

    def lie(state):
        state["args"].tensor_model_parallel_size = 4
    edit_megatron_files(mc, lie)
    return ["convert", "mcore2hf", "--mcore", mc, "--out", root / "out"]


def sharded_hf_lacks_a_shard(root, fx):
    hf = cp(fx, "hf_sharded", root)
    shard = sorted(hf.glob("model-*.safetensors"))[1]
    shard.unlink()
    return ["convert", "hf2mcore", "--hf", hf, "--out", root / "out"]


def deepspeed_latest_outside(root, fx):
    ds = cp(fx, "deepspeed", root)
    shutil.copytree(ds / "global_step0", root / "elsewhere")
    (ds / "latest").write_text("../elsewhere")
    return ["convert", "ds2hf", "--ds", ds, "--out", root / "out"]


def deepspeed_latest_absolute(root, fx):
    ds = cp(fx, "deepspeed", root)
    (ds / "latest").write_text(str((ds / "global_step0").resolve()))
    return ["convert", "ds2mcore", "--ds", ds, "--out", root / "out"]


def deepspeed_tag_outside(root, fx):
    ds = cp(fx, "deepspeed", root)
    shutil.copytree(ds / "global_step0", root / "elsewhere")
    return ["convert", "ds2hf", "--ds", ds, "--tag", "../elsewhere", "--out", root / "out"]


def deepspeed_bf16_without_optimizer(root, fx):
    ds = cp(fx, "deepspeed_bf16", root)
    for file in (ds / "global_step0").glob("*optim_states.pt"):
        file.unlink()
    return ["convert", "ds2hf", "--ds", ds, "--out", root / "out"]


def deepspeed_bf16_allowed(root, fx):
    ds = cp(fx, "deepspeed_bf16", root)
    for file in (ds / "global_step0").glob("*optim_states.pt"):
        file.unlink()
    return ["convert", "ds2hf", "--ds", ds, "--out", root / "out", "--allow-bf16-weights"]


def warned_precision(root, out):
    if "fp32 precision was lost" not in out.stderr or "warning:" not in out.stderr:
        return f"no warning that fp32 precision was lost: {out.stderr[-300:]}"
    return None if (root / "out" / "config.json").exists() else "no output written"


# ---- 4 NaN in the source ---------------------------------------------------------------------------------------

def nan_weights(root, fx):
    import torch
    from safetensors.torch import load_file, save_file

    hf = cp(fx, "hf", root)
    tensors = load_file(hf / "model.safetensors")
    tensors["model.layers.1.mlp.up_proj.weight"][0, :5] = float("nan")
    save_file(tensors, hf / "model.safetensors", metadata={"format": "pt"})
    assert torch.isnan(load_file(hf / "model.safetensors")["model.layers.1.mlp.up_proj.weight"]).sum() == 5
    return ["convert", "hf2mcore", "--hf", hf, "--out", root / "out", "--verify", "--tp", "2"]


def warned_nan(root, out):
    if "NaN" not in out.stderr or "model.layers.1.mlp.up_proj.weight" not in out.stderr or " 5 " not in out.stderr:
        return f"no warning naming the NaN tensor and count: {out.stderr[-300:]}"
    return None if (root / "out" / LATEST).exists() else "no output written"


# ---- 5 outputs that cannot be written --------------------------------------------------------------------------

def out_under_a_file(root, fx):
    (root / "afile").write_text("not a directory")
    return ["convert", "hf2mcore", "--hf", fx.hf(), "--out", root / "afile" / "sub" / "out"]


def out_read_only(root, fx):
    mc = cp(fx, "megatron", root)
    (root / "ro").mkdir()
    return (["convert", "mcore2hf", "--mcore", mc, "--out", root / "ro" / "out"],
            inject(root, refuse_mkdir_under(root / "ro", "EACCES")))


def out_read_only_fs(root, fx):
    (root / "ro").mkdir()
    return (["convert", "hf2ds", "--hf", fx.hf(), "--out", root / "ro" / "out"],
            inject(root, refuse_mkdir_under(root / "ro", "EROFS")))


def disk_full_torch_save(root, fx):
    old_output(root)
    return (["convert", "hf2mcore", "--hf", fx.hf(), "--out", root / "old", "--force", "--tp", "2"],
            inject(root, fail_nth_call("torch", "save", 2, "ENOSPC")))


def disk_full_safetensors(root, fx):
    mc = cp(fx, "megatron", root)
    old_output(root)
    return (["convert", "mcore2hf", "--mcore", mc, "--out", root / "old", "--force", "--max-shard-size", "0.001"],
            inject(root, fail_nth_call("safetensors.torch", "save_file", 1, "ENOSPC")))


def disk_full_side_files(root, fx):
    old_output(root)
    return (["convert", "hf2ds", "--hf", fx.hf(), "--out", root / "old", "--force", "--no-verify"],
            inject(root, fail_nth_call("shutil", "copy2", 1, "EDQUOT")))


def stale_partial(root, fx):
    for stale in (".out.partial-0123abcd", ".out.partial-999999999-0123abcd"):
        (root / stale).mkdir()
        (root / stale / "junk.pt").write_text("left by a killed run")
    return ["convert", "hf2mcore", "--hf", fx.hf(), "--out", root / "out", "--no-verify"]


def output_written(root, out):
    return None if (root / "out" / LATEST).exists() else "no output written"


# ---- 6 uneven pipelines ----------------------------------------------------------------------------------------

def uneven_no_middle(root, fx):
    old_output(root)
    return ["convert", "hf2mcore", "--hf", fx.hf(), "--out", root / "old", "--force", "--pp", "2",
            "--num-layers-in-first-pipeline-stage", "1", "--num-layers-in-last-pipeline-stage", "2"]


def uneven_too_many(root, fx):
    mc = cp(fx, "megatron", root)
    return ["convert", "mcore2mcore", "--mcore", mc, "--out", root / "out", "--pp", "3",
            "--num-layers-in-first-pipeline-stage", "3", "--num-layers-in-last-pipeline-stage", "3"]


def uneven_pp1(root, fx):
    ds = cp(fx, "deepspeed", root)
    return ["convert", "ds2mcore", "--ds", ds, "--out", root / "out", "--num-layers-in-last-pipeline-stage", "2"]


def uneven_vpp(root, fx):
    return ["convert", "hf2mcore", "--hf", fx.hf(), "--out", root / "out", "--pp", "2", "--vpp", "2",
            "--num-layers-in-first-pipeline-stage", "1"]


def uneven_rest_does_not_divide(root, fx):
    return ["convert", "hf2mcore", "--hf", fx.hf(), "--out", root / "out", "--pp", "3",
            "--num-layers-in-first-pipeline-stage", "1"]


def uneven_train(root, fx, last=2):
    return ["train", fx.recipe(), "--output", root / "run", "--set", "parallel.pp=2",
            "--set", "parallel.num_layers_in_first_pipeline_stage=1",
            "--set", f"parallel.num_layers_in_last_pipeline_stage={last}"]


def trained_with_stages_1_3(root, out):
    return None if (root / "run" / "summary.json").is_file() else "the run did not finish"


# ---- 7 broken, foreign or incomplete checkpoints ---------------------------------------------------------------

def truncated_rank_file(root, fx):
    mc = cp(fx, "megatron", root)
    file = mc / "release" / "mp_rank_01_001" / "model_optim_rng.pt"
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    return ["convert", "mcore2hf", "--mcore", mc, "--out", root / "out"]


def missing_rank_folder(root, fx):
    mc = cp(fx, "megatron", root)
    shutil.rmtree(mc / "release" / "mp_rank_01_001")
    return ["convert", "mcore2ds", "--mcore", mc, "--out", root / "out"]


def not_a_checkpoint(root, fx):
    (root / "photos").mkdir()
    (root / "photos" / "cat.txt").write_text("meow")
    return ["convert", "mcore2hf", "--mcore", root / "photos", "--out", root / "out"]


def not_a_deepspeed_checkpoint(root, fx):
    (root / "empty").mkdir()
    return ["convert", "ds2hf", "--ds", root / "empty", "--out", root / "out"]


def inspect_not_a_checkpoint(root, fx):
    (root / "photos").mkdir()
    (root / "photos" / "cat.txt").write_text("meow")
    return ["convert", "inspect", root / "photos"]


def disallowed_pickle_class(root, fx):
    import datetime

    mc = cp(fx, "megatron", root)
    edit_megatron_files(mc, lambda state: state.update(when=datetime.timedelta(days=1)))
    return ["convert", "mcore2hf", "--mcore", mc, "--out", root / "out"]


def torch_dist_missing_distcp(root, fx):
    td = cp(fx, "torch_dist", root)
    next((td / "release").glob("*.distcp")).unlink()
    return ["convert", "mcore2hf", "--mcore", td, "--out", root / "out"]


def torch_dist_missing_metadata(root, fx):
    td = cp(fx, "torch_dist", root)
    (td / "release" / ".metadata").unlink()
    return ["convert", "mcore2mcore", "--mcore", td, "--out", root / "out"]


def torch_dist_truncated_common(root, fx):
    td = cp(fx, "torch_dist", root)
    common = td / "release" / "common.pt"
    if common.exists():
        common.write_bytes(common.read_bytes()[:100])
    else:  # newer layout: the common state lives in the .distcp files
        distcp = next((td / "release").glob("*.distcp"))
        distcp.write_bytes(distcp.read_bytes()[:100])
    return ["convert", "mcore2hf", "--mcore", td, "--out", root / "out"]


def deepspeed_truncated_optimizer(root, fx):
    ds = cp(fx, "deepspeed", root)
    file = ds / "global_step0" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    file.write_bytes(file.read_bytes()[:1000])
    return ["convert", "ds2hf", "--ds", ds, "--out", root / "out"]


T = "ckpt: "
CASES = [
    # not UTF-8 / malformed metadata
    Case("2 not utf-8", T + "hf config.json not utf-8", hf_config_not_utf8,
         check=nothing_at("out", "config.json", "UTF-8")),
    Case("2 not utf-8", T + "megatron latest_checkpointed_iteration.txt not utf-8", megatron_latest_not_utf8,
         check=says(LATEST, "UTF-8")),
    Case("2 not utf-8", T + "megatron hf/config.json not utf-8", megatron_side_config_not_utf8,
         check=says("config.json", "UTF-8")),
    Case("2 not utf-8", T + "deepspeed latest not utf-8", deepspeed_latest_not_utf8, check=says("latest", "UTF-8")),
    Case("2 not utf-8", T + "deepspeed config.json not utf-8", deepspeed_config_not_utf8,
         check=says("config.json", "UTF-8")),
    Case("2 not utf-8", T + "torch_dist metadata.json not utf-8", torch_dist_metadata_json_not_utf8,
         check=says("metadata.json", "UTF-8")),
    Case("2 not utf-8", T + "safetensors index not utf-8", index_not_utf8,
         check=says("model.safetensors.index.json", "UTF-8")),
    Case("2 not utf-8", T + "safetensors index malformed json", index_malformed,
         check=says("model.safetensors.index.json", "JSON")),
    Case("2 not utf-8", T + "hf config.json is a json list", hf_config_is_list, check=says("config.json", "list")),
    Case("2 not utf-8", T + "hf config.json size that is not an integer", hf_config_bad_sizes,
         check=says("num_attention_heads", "'four'")),
    Case("2 not utf-8", T + "megatron iteration text not an integer", megatron_latest_not_integer,
         check=says(LATEST, "12abc")),
    # files that lie
    Case("3 lies", T + "safetensors header length beyond the file", safetensors_header_too_long,
         check=says("model.safetensors", "header")),
    Case("3 lies", T + "safetensors header not a map", safetensors_header_not_a_map,
         check=says("model.safetensors", "header")),
    Case("3 lies", T + "safetensors tensor shape disagrees with its bytes", safetensors_shape_lies,
         check=says("model.norm.weight", "BF16", "256 bytes")),
    Case("3 lies", T + "num_hidden_layers disagrees with layer_types", layer_types_disagree,
         check=says("num_hidden_layers 3", "layer_types")),
    Case("3 lies", T + "config has fewer layers than the weights (old out kept)", config_fewer_layers_than_weights,
         check=old_kept("layers 3", "model.layers.3.")),
    Case("3 lies", T + "megatron args ffn_hidden_size contradict shards", megatron_args_wrong_ffn,
         check=says("linear_fc1.weight", "[96, 64]", "[128, 64]", "ffn_hidden_size")),
    Case("3 lies", T + "megatron args num_query_groups contradict shards", megatron_args_wrong_groups,
         check=says("linear_qkv", "num_query_groups")),
    Case("3 lies", T + "megatron hf/config.json intermediate_size lies", megatron_side_config_lies,
         check=says("hf/config.json", "ffn_hidden_size")),
    Case("3 lies", T + "megatron args tp larger than the rank folders", megatron_args_tp_beyond_folders,
         check=says("mp_rank_02", "TP 4")),
    Case("3 lies", T + "sharded hf lacks a shard", sharded_hf_lacks_a_shard,
         check=says("model-00002-of-", "index")),
    Case("3 lies", T + "deepspeed latest points outside the checkpoint", deepspeed_latest_outside,
         check=says("../elsewhere", "latest")),
    Case("3 lies", T + "deepspeed latest is an absolute path", deepspeed_latest_absolute, check=says("latest")),
    Case("3 lies", T + "ds2hf --tag outside the checkpoint", deepspeed_tag_outside,
         check=says("--tag", "../elsewhere")),
    Case("3 lies", T + "bf16 zero-2 without optimizer files refused", deepspeed_bf16_without_optimizer,
         check=says("bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", "--allow-bf16-weights")),
    Case("3 lies", T + "bf16 zero-2 without optimizer files, --allow-bf16-weights", deepspeed_bf16_allowed,
         check=warned_precision, expect_ok=True),
    # NaN in the source
    Case("4 nan", T + "NaN in source weights verifies with a warning", nan_weights, check=warned_nan,
         expect_ok=True),
    # outputs
    Case("5 output", T + "--out under a regular file", out_under_a_file, check=says("afile", "is a file")),
    Case("5 output", T + "--out in a read-only directory (EACCES)", out_read_only,
         check=says("ro/out", "Permission denied")),
    Case("5 output", T + "--out on a read-only file system (EROFS)", out_read_only_fs,
         check=says("ro/out", "Read-only file system")),
    Case("5 output", T + "disk full in torch.save (old out kept)", disk_full_torch_save,
         check=old_kept("No space left on device", "old")),
    Case("5 output", T + "disk full in safetensors save_file (old out kept)", disk_full_safetensors,
         check=old_kept("No space left on device", "old")),
    Case("5 output", T + "quota exceeded copying side files (old out kept)", disk_full_side_files,
         check=old_kept("quota", "old")),
    Case("5 output", T + "stale .partial directories of a killed run are removed", stale_partial,
         check=output_written, expect_ok=True),
    # uneven pipelines
    Case("6 uneven pp", T + "pp2 first1 last2 do not add up to the 4 layers (old out kept)", uneven_no_middle,
         check=old_kept("--num-layers-in-first-pipeline-stage 1", "--num-layers-in-last-pipeline-stage 2")),
    Case("6 uneven pp", T + "first+last exceed the layers", uneven_too_many, check=says("at most 3")),
    Case("6 uneven pp", T + "pp1 with last stage size", uneven_pp1,
         check=says("--num-layers-in-last-pipeline-stage 2", "--pp")),
    Case("6 uneven pp", T + "vpp with uneven stages", uneven_vpp, check=says("[1, 3]", "--vpp")),
    Case("6 uneven pp", T + "rest does not divide over middle stages", uneven_rest_does_not_divide,
         check=says("valid --num-layers-in-first-pipeline-stage")),
    Case("6 uneven pp", T + "train pp2 first1 last2 (4 layers)", uneven_train,
         check=says("num-layers-in-first-pipeline-stage 1", "add up to 4")),
    Case("6 uneven pp", T + "train pp2 first1 last3 trains (stages [1, 3], as Megatron accepts)",
         lambda root, fx: uneven_train(root, fx, last=3), check=trained_with_stages_1_3, expect_ok=True),
    # broken, foreign or incomplete
    Case("7 broken", T + "truncated rank file", truncated_rank_file,
         check=says("mp_rank_01_001", "truncated or corrupt")),
    Case("7 broken", T + "missing rank folder", missing_rank_folder, check=says("mp_rank_01_001")),
    Case("7 broken", T + "directory that is no checkpoint", not_a_checkpoint, check=says("photos")),
    Case("7 broken", T + "empty directory as deepspeed checkpoint", not_a_deepspeed_checkpoint, check=says("empty")),
    Case("7 broken", T + "inspect a directory that is no checkpoint", inspect_not_a_checkpoint, check=says("photos")),
    Case("7 broken", T + "pickle with a disallowed class stays refused", disallowed_pickle_class,
         check=says("datetime.timedelta")),
    Case("7 broken", T + "torch_dist missing a .distcp file", torch_dist_missing_distcp, check=says(".distcp")),
    Case("7 broken", T + "torch_dist missing .metadata", torch_dist_missing_metadata, check=says(".metadata")),
    Case("7 broken", T + "torch_dist truncated common state", torch_dist_truncated_common,
         check=says("truncated")),
    Case("7 broken", T + "deepspeed truncated optimizer file", deepspeed_truncated_optimizer,
         check=says("zero_pp_rank_0_mp_rank_00_optim_states.pt", "truncated")),
]
