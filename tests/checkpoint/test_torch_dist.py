"""Megatron torch_dist: what qlm writes (megatron-core 0.16's layout), round trips through it, the 0.19+ layout with
the common state inside the DCP files, streaming reads, and one-line errors for damaged checkpoints.
Loading into real megatron-core is tests/checkpoint/test_torch_dist_peer.py."""

import io
import json
import pickle
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import make_hf_model
from helpers import assert_clean_failure, assert_same_hf
from torch.distributed.checkpoint import DefaultSavePlanner

from qlm_core.checkpoint.convert.hf_megatron import hf_to_mcore, mcore_to_hf, mcore_to_mcore
from qlm_core.checkpoint.formats.megatron.format import open_megatron
from qlm_core.checkpoint.formats.megatron.legacy import MegatronTorchCheckpoint
from qlm_core.checkpoint.formats.megatron.torch_dist import COMMON_STATE_KEY, SafeFileSystemReader, TorchDistCheckpoint
from qlm_core.checkpoint.io.safe_load import safe_torch_load
from qlm_core.models.layout import read_shard_tensor

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.mark.parametrize("kind,layout", [
    ("qwen2", dict(tp=2, pp=2)),
    ("qwen2_tied", dict(tp=2, pp=2)),
    ("llama3", dict(tp=4)),
    ("mistral", dict(pp=2, vpp=2)),
    ("qwen2_swa", dict(tp=2, pp=2)),
    ("glm4", dict(tp=2, pp=2)),
    ("gemma3", dict(tp=2, pp=2)),
    ("opt", dict(tp=2, pp=2)),
    ("bloom", dict(tp=2, pp=2)),
    ("mpt", dict(tp=2, pp=2)),
    ("gemma2", dict(tp=2, pp=2)),
])
def test_hf_torch_dist_hf_is_bit_exact(hf_models, tmp_path, kind, layout):
    result = hf_to_mcore(hf_models[kind], tmp_path / "dist", **layout, format="torch_dist", verify=True)
    assert result.verify.ok and result.verify.tensors_checked > 0
    assert isinstance(open_megatron(tmp_path / "dist"), TorchDistCheckpoint)
    back = mcore_to_hf(tmp_path / "dist", tmp_path / "hf", verify=True)
    assert back.verify.ok
    assert_same_hf(hf_models[kind], tmp_path / "hf")


def test_written_layout_is_megatron_cores(hf_models, tmp_path):
    """The facts docs/ARCHITECTURE.md §5 lists and a real megatron-core 0.16 save showed (same keys, shapes and
    chunks)."""
    hf_to_mcore(hf_models["qwen2"], tmp_path / "d", tp=2, pp=2, format="torch_dist")
    it = tmp_path / "d/release"
    assert (tmp_path / "d/latest_checkpointed_iteration.txt").read_text() == "release"
    assert json.loads((it / "metadata.json").read_text()) == {
        "sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
        "common_backend_version": 1}
    common = safe_torch_load(it / "common.pt")
    assert common["checkpoint_version"] == 3.0 and common["iteration"] == 0
    assert common["args"].ckpt_format == "torch_dist" and common["args"].tensor_model_parallel_size == 2
    assert sorted(p.name for p in it.iterdir()) == [".metadata", "__0_0.distcp", "common.pt", "metadata.json"]
    md = SafeFileSystemReader(str(it)).read_metadata().state_dict_metadata
    tensors = {k: (tuple(v.size), sorted((tuple(c.offsets), tuple(c.sizes)) for c in v.chunks))
               for k, v in md.items() if hasattr(v, "size")}
    objects = sorted(k for k in md if k not in tensors)
    L = 4
    assert tensors["decoder.layers.self_attention.linear_qkv.weight"][0] == (L, 128, 64)  # (4 + 2*2) heads x 16
    assert tensors["decoder.layers.self_attention.linear_qkv.bias"][0] == (L, 128)
    assert tensors["decoder.layers.self_attention.linear_qkv.layer_norm_weight"][0] == (L, 64)
    assert tensors["decoder.layers.mlp.linear_fc1.layer_norm_weight"][0] == (L, 64)
    assert tensors["decoder.layers.self_attention.linear_proj.weight"][0] == (L, 64, 64)
    assert tensors["decoder.layers.mlp.linear_fc2.weight"][0] == (L, 64, 96)
    assert tensors["embedding.word_embeddings.weight"][0] == tensors["output_layer.weight"][0] == (512, 64)
    assert tensors["decoder.final_layernorm.weight"][0] == (64,)
    # fc1 = [full gate; full up]; each TP rank's gate and up halves are separate chunks, one per layer
    fc1_shape, fc1_chunks = tensors["decoder.layers.mlp.linear_fc1.weight"]
    assert fc1_shape == (L, 192, 64) and len(fc1_chunks) == L * 4
    assert ((0, 96, 0), (1, 48, 64)) in fc1_chunks and ((3, 144, 0), (1, 48, 64)) in fc1_chunks
    assert ((1, 0, 32), (1, 64, 32)) in tensors["decoder.layers.self_attention.linear_proj.weight"][1]
    assert len(tensors) == 10
    linears = ["mlp.linear_fc1", "mlp.linear_fc2", "self_attention.linear_proj", "self_attention.linear_qkv"]
    assert objects == sorted(f"decoder.layers.{m}._extra_state/shard_{i}_{L}" for m in linears for i in range(L))
    # the output layer of a tied model is not stored (Megatron reuses the embedding)
    hf_to_mcore(hf_models["qwen2_tied"], tmp_path / "tied", pp=2, format="torch_dist")
    tied = SafeFileSystemReader(str(tmp_path / "tied/release")).read_metadata().state_dict_metadata
    assert "output_layer.weight" not in tied and "embedding.word_embeddings.weight" in tied


def test_torch_and_torch_dist_convert_into_each_other_bit_exactly(hf_models, tmp_path):
    src = hf_models["qwen2"]
    hf_to_mcore(src, tmp_path / "torch", tp=2, pp=2)
    to_dist = mcore_to_mcore(tmp_path / "torch", tmp_path / "dist", tp=1, format="torch_dist", verify=True)
    assert to_dist.verify.ok
    back = mcore_to_mcore(tmp_path / "dist", tmp_path / "torch2", tp=2, pp=2, format="torch", verify=True)
    assert back.verify.ok
    before = sorted((tmp_path / "torch").rglob("model_optim_rng.pt"))
    after = sorted((tmp_path / "torch2").rglob("model_optim_rng.pt"))
    assert len(before) == len(after) == 4
    for a, b in zip(before, after, strict=True):
        ours, theirs = safe_torch_load(a)["model"], safe_torch_load(b)["model"]
        assert list(ours) == list(theirs)
        for name, tensor in ours.items():
            assert (tensor is None and theirs[name] is None) or torch.equal(tensor, theirs[name]), name
    # torch_dist -> torch_dist (default: the source's format) with another dtype
    recast = mcore_to_mcore(tmp_path / "dist", tmp_path / "bf16", dtype="bf16", verify=True)
    assert recast.verify.ok and open_megatron(tmp_path / "bf16").dtype == torch.bfloat16
    mcore_to_hf(tmp_path / "torch2", tmp_path / "hf")
    assert_same_hf(src, tmp_path / "hf")


def to_megatron_019_layout(src_dir, dst_dir):
    """Re-save a 0.16-layout iteration directory the way megatron-core >= 0.19 does: no common.pt, the common dict
    as the DCP byte object common_state/shard_0_1 (torch.save([common]))."""
    reader = SafeFileSystemReader(str(src_dir))
    md = reader.read_metadata().state_dict_metadata
    state = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype) for k, v in md.items() if hasattr(v, "size")}
    dcp.load(state, storage_reader=reader, no_dist=True)
    state.update({k: [None] for k in md if k not in state})
    state[COMMON_STATE_KEY] = [safe_torch_load(src_dir / "common.pt")]
    dcp.save(state, checkpoint_id=str(dst_dir), planner=DefaultSavePlanner(flatten_state_dict=False), no_dist=True)
    shutil.copy(src_dir / "metadata.json", dst_dir / "metadata.json")


def test_reads_the_megatron_019_layout(hf_models, run_qlm, tmp_path):
    hf_to_mcore(hf_models["llama3"], tmp_path / "d016", tp=2, format="torch_dist")
    new = tmp_path / "d019"
    (new / "iter_0000042").mkdir(parents=True)
    (new / "latest_checkpointed_iteration.txt").write_text("42")
    to_megatron_019_layout(tmp_path / "d016/release", new / "iter_0000042")
    shutil.copytree(tmp_path / "d016/hf", new / "hf")
    assert not (new / "iter_0000042/common.pt").exists()
    ckpt = open_megatron(new)
    assert isinstance(ckpt, TorchDistCheckpoint) and ckpt.iteration == 42 and ckpt.tp == 2
    code, stdout, _ = run_qlm("convert", "inspect", new, "--json")
    report = json.loads(stdout)
    assert code == 0 and report["format"] == "mcore-torch_dist" and report["layout"]["common_state"] == "dcp"
    assert report["args"]["num_query_groups"] == 2
    assert mcore_to_hf(new, tmp_path / "hf", verify=True).verify.ok
    assert_same_hf(hf_models["llama3"], tmp_path / "hf")


def test_reads_stream_only_the_chunks_a_shard_needs(hf_models, tmp_path):
    hf_to_mcore(hf_models["qwen2"], tmp_path / "d", tp=2, format="torch_dist")
    ckpt = TorchDistCheckpoint(tmp_path / "d")
    loaded, real_chunk = [], ckpt._chunk

    def counting_chunk(key, index):
        if index not in ckpt._cache:
            loaded.append((key, index))
        return real_chunk(key, index)

    ckpt._chunk = counting_chunk
    qkv = ckpt.layout.layer_tensors(1)[2]
    assert qkv.name == "decoder.layers.1.self_attention.linear_qkv.weight"
    shard = read_shard_tensor(qkv, 2, 1, ckpt)
    assert shard.shape == (64, 64) and len(loaded) == 1  # TP rank 1 of layer 1: one stored chunk
    hf_to_mcore(hf_models["qwen2"], tmp_path / "t", tp=2)  # the legacy writer at TP2 holds the same shard
    legacy = MegatronTorchCheckpoint(tmp_path / "t").chunk_state(1, 0, 0)
    assert torch.equal(shard, legacy["decoder.layers.1.self_attention.linear_qkv.weight"])


def test_inspect_torch_dist(run_qlm, hf_models, tmp_path):
    hf_to_mcore(hf_models["qwen2"], tmp_path / "d", tp=2, pp=2, format="torch_dist")
    code, stdout, _ = run_qlm("convert", "inspect", tmp_path / "d", "--json")
    report = json.loads(stdout)
    assert code == 0 and report["format"] == "mcore-torch_dist"
    assert report["layout"] == {"iteration": "release", "saved_tp": 2, "saved_pp": 2, "padded_vocab": 512,
                                "dtype": "float32", "common_state": "common.pt", "files": 1}
    assert {"name": "decoder.layers.mlp.linear_fc1.weight", "shape": [4, 192, 64], "dtype": "float32",
            "where": "dcp (16 chunks)"} in report["tensors"]


def test_cli_format_option(run_qlm, hf_models, tmp_path):
    code, stdout, stderr = run_qlm("convert", "hf2mcore", "--hf", hf_models["qwen2"], "--out", tmp_path / "d",
                                   "--tp", "2", "--format", "torch_dist")
    assert code == 0 and "verified" in stdout, stderr
    code, stdout, stderr = run_qlm("convert", "mcore2mcore", "--mcore", tmp_path / "d", "--out", tmp_path / "t",
                                   "--pp", "2", "--format", "torch")
    assert code == 0 and "verified" in stdout, stderr
    assert MegatronTorchCheckpoint(tmp_path / "t").pp == 2
    code, _, stderr = run_qlm("convert", "hf2mcore", "--hf", hf_models["qwen2"], "--out", tmp_path / "x",
                              "--format", "zarr")
    assert code == 2 and "zarr" in stderr and not (tmp_path / "x").exists()


# ---- damaged inputs ------------------------------------------------------------------------------------------


@pytest.fixture
def dist_ckpt(hf_models, tmp_path):
    path = tmp_path / "dist"
    hf_to_mcore(hf_models["qwen2"], path, tp=2, format="torch_dist", verify=False)
    return path


def test_missing_rank_file(run_qlm, dist_ckpt, tmp_path):
    (dist_ckpt / "release/__0_0.distcp").unlink()
    out = tmp_path / "hf"
    assert_clean_failure(run_qlm("convert", "mcore2hf", "--mcore", dist_ckpt, "--out", out), out, "__0_0.distcp")


def test_truncated_distcp(run_qlm, dist_ckpt, tmp_path):
    file = dist_ckpt / "release/__0_0.distcp"
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    out = tmp_path / "out"
    assert_clean_failure(run_qlm("convert", "mcore2mcore", "--mcore", dist_ckpt, "--out", out, "--format", "torch"),
                         out, "truncated")


def test_corrupt_chunk_inside_distcp(run_qlm, dist_ckpt, tmp_path):
    file = dist_ckpt / "release/__0_0.distcp"
    storage = SafeFileSystemReader(str(file.parent)).read_metadata().storage_data
    item = next(info for index, info in storage.items() if index.fqn == "embedding.word_embeddings.weight")
    data = bytearray(file.read_bytes())
    data[item.offset: item.offset + 64] = b"\0" * 64  # that chunk's zip header; the file keeps its length
    file.write_bytes(bytes(data))
    out = tmp_path / "hf"
    assert_clean_failure(run_qlm("convert", "mcore2hf", "--mcore", dist_ckpt, "--out", out), out, "corrupt")


def test_missing_iteration_and_bad_latest(run_qlm, dist_ckpt, tmp_path):
    out = tmp_path / "hf"
    assert_clean_failure(run_qlm("convert", "mcore2hf", "--mcore", dist_ckpt, "--out", out, "--iteration", "7"),
                         out, "no iteration 7")
    (dist_ckpt / "latest_checkpointed_iteration.txt").write_text("500")
    assert_clean_failure(run_qlm("convert", "mcore2hf", "--mcore", dist_ckpt, "--out", out), out, "iter_0000500")


def test_unfinished_save(run_qlm, dist_ckpt, tmp_path):
    (dist_ckpt / "release/.metadata").unlink()
    out = tmp_path / "hf"
    assert_clean_failure(run_qlm("convert", "mcore2hf", "--mcore", dist_ckpt, "--out", out), out, ".metadata")
    code, _, stderr = run_qlm("convert", "inspect", dist_ckpt)
    assert code == 2 and ".metadata" in stderr


def test_metadata_pickle_cannot_run_code(run_qlm, dist_ckpt, tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    metadata_file = dist_ckpt / "release/.metadata"
    metadata = pickle.loads(metadata_file.read_bytes())
    metadata.planner_data = Evil()
    metadata_file.write_bytes(pickle.dumps(metadata))
    out = tmp_path / "hf"
    result = run_qlm("convert", "mcore2hf", "--mcore", dist_ckpt, "--out", out)
    assert "pwned" not in result[1]
    assert_clean_failure(result, out, "builtins.print")


def test_common_state_with_foreign_objects_is_refused(run_qlm, dist_ckpt, tmp_path):
    common = dist_ckpt / "release/common.pt"
    state = safe_torch_load(common)
    state["payload"] = io.StringIO("not a tensor")
    torch.save(state, common)
    out = tmp_path / "hf"
    assert_clean_failure(run_qlm("convert", "mcore2hf", "--mcore", dist_ckpt, "--out", out), out, "StringIO")


def test_bf16_source_writes_bf16(tmp_path):
    make_hf_model(tmp_path / "bf16", "qwen2", dtype=torch.bfloat16)
    result = hf_to_mcore(tmp_path / "bf16", tmp_path / "d", tp=2, format="torch_dist")
    assert result.verify.ok and open_megatron(tmp_path / "d").dtype == torch.bfloat16
    mcore_to_hf(tmp_path / "d", tmp_path / "back")
    assert_same_hf(tmp_path / "bf16", tmp_path / "back")
