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


def test_a_megatron_bridge_checkpoint_of_a_deepseek_v3_model_reads_from_its_run_config(mtp_models, tmp_path):
    """Megatron-Bridge stores no Megatron-LM args: its run_config.yaml's model section (MLATransformerConfig's
    multi-latent attention and yarn fields, the group-limited sigmoid router, mtp_num_layers) describes the
    model, and HF -> legacy TP2 x PP2 -> (args and hf/ removed) -> HF is bit-exact."""
    import yaml

    from qlm_core.checkpoint.formats.hf.checkpoint import HFCheckpoint

    src = mtp_models["deepseek_v3"]
    spec = HFCheckpoint(src).spec
    hf_to_mcore(src, tmp_path / "bridge", tp=2, pp=2, verify=False)
    shutil.rmtree(tmp_path / "bridge" / HF_SIDE_DIR)
    for file in (tmp_path / "bridge").rglob("model_optim_rng.pt"):
        state = safe_torch_load(file)
        state.pop("args")
        torch.save(state, file)
    mla, moe, yarn = spec.mla, spec.moe, spec.rope_scaling
    model = {
        "num_layers": spec.num_layers, "hidden_size": spec.hidden_size, "ffn_hidden_size": spec.ffn_hidden_size,
        "num_attention_heads": spec.num_attention_heads, "num_query_groups": spec.num_attention_heads,
        "kv_channels": spec.kv_channels, "vocab_size": spec.vocab_size, "position_embedding_type": "rope",
        "normalization": "RMSNorm", "gated_linear_unit": True, "add_bias_linear": False, "add_qkv_bias": False,
        "share_embeddings_and_output_weights": False, "rotary_base": spec.rope_theta,
        "layernorm_epsilon": spec.norm_epsilon, "qk_layernorm": True,
        "max_position_embeddings": spec.max_position_embeddings, "tensor_model_parallel_size": 2,
        "pipeline_model_parallel_size": 2, "multi_latent_attention": True, "q_lora_rank": mla.q_lora_rank,
        "kv_lora_rank": mla.kv_lora_rank, "qk_head_dim": mla.qk_nope_head_dim,
        "qk_pos_emb_head_dim": mla.qk_rope_head_dim, "v_head_dim": mla.v_head_dim, "rope_type": "yarn",
        "rotary_scaling_factor": yarn.factor, "original_max_position_embeddings": yarn.original_max_position_embeddings,
        "beta_fast": yarn.beta_fast, "beta_slow": yarn.beta_slow, "mscale": yarn.mscale,
        "mscale_all_dim": yarn.mscale_all_dim, "num_moe_experts": moe.num_experts, "moe_router_topk": moe.topk,
        "moe_ffn_hidden_size": moe.ffn_hidden_size,
        "moe_shared_expert_intermediate_size": moe.shared_expert_hidden_size,
        "moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
        "moe_router_num_groups": moe.num_groups, "moe_router_group_topk": moe.group_topk,
        "moe_router_topk_scaling_factor": moe.topk_scaling_factor, "moe_layer_freq": list(moe.layer_pattern),
        "mtp_num_layers": spec.mtp_num_layers, "_target_": "megatron.bridge.models.DeepSeekV3ModelProvider"}
    (tmp_path / "bridge/release/run_config.yaml").write_text(yaml.safe_dump({"model": model}))
    assert mcore_to_hf(tmp_path / "bridge", tmp_path / "hf", verify=True).verify.ok
    assert_same_hf(tmp_path / "hf", src)
