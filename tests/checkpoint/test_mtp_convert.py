"""qlm convert keeps multi-token prediction layers: HF (DeepSeek-V3's release layout, model.layers.<N + k>.* with
enorm, hnorm, eh_proj, shared_head.norm and copies of the embedding and output layer) -> Megatron legacy at TP2 x
PP2 x EP2 (megatron-core's mtp.layers.<k>.* on the last stage, beside its copy of the embedding) -> HF and HF ->
torch_dist -> HF are bit-exact, from Megatron's args alone; a release without the copies gains them."""

import json
import shutil

import pytest
import torch
from conftest import MTP_KINDS, load_safetensors_dir
from helpers import assert_same_hf
from safetensors.torch import save_file

from qlm_core.checkpoint.convert.hf_megatron import hf_to_mcore, mcore_to_hf, mcore_to_mcore
from qlm_core.checkpoint.formats.megatron.args import spec_from_args
from qlm_core.checkpoint.formats.megatron.legacy import HF_SIDE_DIR
from qlm_core.checkpoint.formats.megatron.torch_dist import SafeFileSystemReader
from qlm_core.checkpoint.io.safe_load import safe_torch_load

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.mark.parametrize("kind", list(MTP_KINDS))
def test_hf_tp2_pp2_ep2_hf_keeps_the_mtp_layers_bit_exact(mtp_models, tmp_path, kind):
    src = mtp_models[kind]
    depths = MTP_KINDS[kind][1]
    assert hf_to_mcore(src, tmp_path / "mcore", tp=2, pp=2, ep=2, verify=True).verify.ok
    last = safe_torch_load(tmp_path / "mcore/release/mp_rank_01_001_001/model_optim_rng.pt")
    assert spec_from_args(last["args"]).mtp_num_layers == depths == last["args"].mtp_num_layers
    names = last["model"].keys()
    assert "embedding.word_embeddings.weight" in names  # the last stage embeds the shifted tokens
    for k in range(depths):
        assert {f"mtp.layers.{k}.eh_proj.weight", f"mtp.layers.{k}.final_layernorm.weight",
                f"mtp.layers.{k}.transformer_layer.mlp.router.expert_bias"} <= names
    assert not any(n.startswith("mtp.") for n in safe_torch_load(
        tmp_path / "mcore/release/mp_rank_01_000_001/model_optim_rng.pt")["model"])
    shutil.rmtree(tmp_path / "mcore" / HF_SIDE_DIR)
    mcore_to_mcore(tmp_path / "mcore", tmp_path / "tp1", verify=True)
    assert mcore_to_hf(tmp_path / "tp1", tmp_path / "hf", verify=True).verify.ok
    assert_same_hf(tmp_path / "hf", src)  # the MTP layers, their correction biases and copies among them
    assert json.loads((tmp_path / "hf/config.json").read_text())["num_nextn_predict_layers"] == depths


def test_hf_torch_dist_hf_keeps_the_mtp_layers_under_megatron_cores_keys(mtp_models, tmp_path):
    src = mtp_models["deepseek_v3"]
    assert hf_to_mcore(src, tmp_path / "dist", tp=2, pp=2, format="torch_dist", verify=True).verify.ok
    md = SafeFileSystemReader(str(tmp_path / "dist/release")).read_metadata().state_dict_metadata
    expert = "mtp.layers.1.transformer_layer.mlp.experts.experts.linear_fc1.weight"
    assert md[expert].size[0] == 16 and "mtp.layers.1.transformer_layer.mlp.experts.local_experts.0." \
        "linear_fc1.weight" not in md  # one key over the expert axis, no layer axis
    assert "mtp.layers.0.eh_proj._extra_state/shard_0_1" in md
    shutil.rmtree(tmp_path / "dist" / HF_SIDE_DIR)
    assert mcore_to_hf(tmp_path / "dist", tmp_path / "hf", verify=True).verify.ok
    assert_same_hf(tmp_path / "hf", src)


def test_a_release_without_the_embedding_and_head_copies_reads_and_exports_them(mtp_models, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(mtp_models["deepseek_v3_lite"], src)
    tensors = load_safetensors_dir(src)
    copies = {n for n in tensors if n.endswith(("layers.4.embed_tokens.weight", "layers.4.shared_head.head.weight"))}
    assert len(copies) == 2
    save_file({n: t for n, t in tensors.items() if n not in copies}, src / "model.safetensors",
              metadata={"format": "pt"})
    assert hf_to_mcore(src, tmp_path / "mcore", tp=2, verify=True).verify.ok
    assert mcore_to_hf(tmp_path / "mcore", tmp_path / "hf", verify=True).verify.ok
    out = load_safetensors_dir(tmp_path / "hf")
    assert torch.equal(out["model.layers.4.embed_tokens.weight"], tensors["model.embed_tokens.weight"])
    assert torch.equal(out["model.layers.4.shared_head.head.weight"], tensors["lm_head.weight"])
