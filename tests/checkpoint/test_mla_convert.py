"""qlm convert for DeepSeek-V3-class models: HF -> Megatron legacy at TP2 x PP2 x EP2 -> HF and HF -> torch_dist ->
HF are bit-exact (the routers' correction bias included) from Megatron's args alone; torch_dist holds the local
spec's names of multi-latent attention's norms and the Transformer Engine spec's beside them; legacy files of the
Transformer Engine spec (norms fused into the up projections, down projections whole on every TP rank) read too."""

import shutil

import pytest
import torch
from conftest import MLA_KINDS
from helpers import assert_same_hf

from qlm_core.checkpoint.convert.hf_megatron import hf_to_mcore, mcore_to_hf, mcore_to_mcore
from qlm_core.checkpoint.formats.hf.checkpoint import HFCheckpoint
from qlm_core.checkpoint.formats.megatron.args import spec_from_args
from qlm_core.checkpoint.formats.megatron.legacy import HF_SIDE_DIR
from qlm_core.checkpoint.formats.megatron.torch_dist import SafeFileSystemReader
from qlm_core.checkpoint.io.safe_load import safe_torch_load
from qlm_core.models.spec import ModelSpec

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def without_hf_side_dir(ckpt):
    shutil.rmtree(ckpt / HF_SIDE_DIR)
    return ckpt


def same_architecture(a: ModelSpec, b: ModelSpec):
    assert a.replace(bos_token_id=None, eos_token_id=None) == b.replace(bos_token_id=None, eos_token_id=None)


@pytest.mark.parametrize("kind", list(MLA_KINDS))
def test_hf_tp2_pp2_ep2_hf_is_bit_exact_from_the_args_alone(mla_models, tmp_path, kind):
    src = mla_models[kind]
    assert hf_to_mcore(src, tmp_path / "mcore", tp=2, pp=2, ep=2, verify=True).verify.ok
    args = safe_torch_load(tmp_path / "mcore/release/mp_rank_01_001_001/model_optim_rng.pt")["args"]
    spec = HFCheckpoint(src).spec  # DeepSeek-V3's config.json counts a multi-token prediction layer, unsaved
    assert spec.mtp_num_layers == 0
    same_architecture(spec_from_args(args), spec)
    assert args.multi_latent_attention and args.qk_layernorm
    assert args.moe_router_enable_expert_bias != (spec.model_type == "deepseek_v2")  # V2: softmax, no bias
    assert args.moe_router_pre_softmax == (spec.model_type == "deepseek_v2")
    assert (args.kv_lora_rank, args.qk_head_dim, args.qk_pos_emb_head_dim, args.v_head_dim) == (16, 8, 4, 8)
    mcore_to_mcore(tmp_path / "mcore", tmp_path / "tp1", verify=True)
    back = mcore_to_hf(without_hf_side_dir(tmp_path / "tp1"), tmp_path / "hf", verify=True)
    assert back.verify.ok and back.verify.tensors_checked == len(HFCheckpoint(src).names)
    assert_same_hf(src, tmp_path / "hf")  # every tensor, e_score_correction_bias among them
    assert any(name.endswith("e_score_correction_bias") for name in HFCheckpoint(src).names) \
        != (spec.model_type == "deepseek_v2")
    same_architecture(ModelSpec.from_hf_dir(tmp_path / "hf"), spec)


@pytest.mark.parametrize("kind", list(MLA_KINDS))
def test_hf_torch_dist_hf_is_bit_exact_with_both_specs_norm_names(mla_models, tmp_path, kind):
    src = mla_models[kind]
    assert hf_to_mcore(src, tmp_path / "dist", tp=2, format="torch_dist", verify=True).verify.ok
    md = SafeFileSystemReader(str(tmp_path / "dist/release")).read_metadata().state_dict_metadata
    layer0 = "decoder.layers.0."  # dense first layers: per-layer keys
    assert f"{layer0}input_layernorm.weight" in md and f"{layer0}self_attention.kv_layernorm.weight" in md
    assert f"{layer0}self_attention.linear_kv_up_proj.layer_norm_weight" in md  # the TE spec's, beside
    assert f"{layer0}pre_mlp_layernorm.weight" in md and f"{layer0}mlp.linear_fc1.layer_norm_weight" in md
    assert f"{layer0}self_attention.linear_qkv.layer_norm_weight" not in md
    assert (f"{layer0}self_attention.q_layernorm.weight" in md) == (HFCheckpoint(src).spec.mla.q_lora_rank is not None)
    assert ("decoder.layers.3.mlp.router.expert_bias" in md) == (kind != "deepseek_v2_lite")
    mcore_to_hf(without_hf_side_dir(tmp_path / "dist"), tmp_path / "hf", verify=True)
    assert_same_hf(src, tmp_path / "hf")


def test_reads_transformer_engine_spec_legacy_files(mla_models, tmp_path):
    """Under the Transformer Engine spec the q and kv latents' norms are `linear_q_up_proj.layer_norm_weight` /
    `linear_kv_up_proj.layer_norm_weight`, and the down projections are whole on every TP rank."""
    src = mla_models["deepseek_v3"]
    hf_to_mcore(src, tmp_path / "local", tp=2)
    whole = safe_torch_load(next((tmp_path / "local").rglob("model_optim_rng.pt")))["model"]  # rank 0
    hf_to_mcore(src, tmp_path / "tp1")
    full = safe_torch_load(next((tmp_path / "tp1").rglob("model_optim_rng.pt")))["model"]
    shutil.copytree(tmp_path / "local", tmp_path / "te")
    for file in (tmp_path / "te").rglob("model_optim_rng.pt"):
        state = safe_torch_load(file)
        renamed = {}
        for name, value in state["model"].items():
            if name.endswith(("linear_q_down_proj.weight", "linear_kv_down_proj.weight")):
                value = full[name].clone()
            name = name.replace("self_attention.q_layernorm.weight",
                                "self_attention.linear_q_up_proj.layer_norm_weight")
            name = name.replace("self_attention.kv_layernorm.weight",
                                "self_attention.linear_kv_up_proj.layer_norm_weight")
            renamed[name] = value
        state["model"] = renamed
        torch.save(state, file)
    assert whole["decoder.layers.0.self_attention.linear_kv_down_proj.weight"].shape[0] == 10  # local: split
    assert mcore_to_mcore(tmp_path / "te", tmp_path / "resharded", tp=1, verify=True).verify.ok
    mcore_to_hf(tmp_path / "resharded", tmp_path / "hf")
    assert_same_hf(src, tmp_path / "hf")
