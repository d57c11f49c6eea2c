"""qlm convert: HF <-> Megatron legacy torch round trips are bit-exact; reshards are bit-exact; verify runs."""

import filecmp
import json

import pytest
import torch
import transformers
from conftest import make_hf_model
from helpers import assert_same_hf

from qlm_core.checkpoint.convert.hf_megatron import hf_to_mcore, mcore_to_hf, mcore_to_mcore
from qlm_core.checkpoint.formats.megatron.legacy import MegatronTorchCheckpoint
from qlm_core.checkpoint.io.safe_load import safe_torch_load

LAYOUTS = {
    "tp2_pp2": dict(tp=2, pp=2),
    "tp4_2groups": dict(tp=4),
    "pp2_vpp2": dict(pp=2, vpp=2),
    "uneven_pp": dict(pp=3, first_stage_layers=2),
    "uneven_last": dict(pp=2, last_stage_layers=1),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", ["qwen2", "qwen2_tied", "llama3", "mistral", "qwen2_swa", "glm", "glm4",
                                  "ernie4_5", "gemma3", "opt", "opt_gelu", "bloom", "mpt", "gemma2"])
def test_hf_mcore_hf_is_bit_exact(hf_models, tmp_path, kind, layout):
    src = hf_models[kind]
    result = hf_to_mcore(src, tmp_path / "mcore", **LAYOUTS[layout], verify=True)
    assert result.verify.ok and result.verify.tensors_checked > 0
    ckpt = MegatronTorchCheckpoint(tmp_path / "mcore")
    expected = LAYOUTS[layout]
    assert (ckpt.tp, ckpt.pp, ckpt.vpp) == (expected.get("tp", 1), expected.get("pp", 1), expected.get("vpp", 1))
    back = mcore_to_hf(tmp_path / "mcore", tmp_path / "hf", verify=True)
    assert back.verify.ok
    assert_same_hf(src, tmp_path / "hf")
    for side_file in ("tokenizer.json", "tokenizer_config.json"):
        assert filecmp.cmp(src / side_file, tmp_path / "hf" / side_file, shallow=False)
    if json.loads((src / "config.json").read_text()).get("eos_token_id") is None:  # the tokenizer's is filled in
        generation = json.loads((src / "generation_config.json").read_text())
        assert json.loads((tmp_path / "hf" / "generation_config.json").read_text()) == {**generation, "eos_token_id": 0}
    else:  # named: the file comes back as it was
        assert filecmp.cmp(src / "generation_config.json", tmp_path / "hf" / "generation_config.json", shallow=False)


def test_reshard_chain_is_bit_exact(hf_models, tmp_path):
    src = hf_models["qwen2"]
    hf_to_mcore(src, tmp_path / "a", tp=2, pp=2)
    mcore_to_mcore(tmp_path / "a", tmp_path / "b", tp=4, pp=1, verify=True)
    mcore_to_mcore(tmp_path / "b", tmp_path / "c", tp=1, pp=1, verify=True)
    hf_to_mcore(src, tmp_path / "direct", tp=1, pp=1)
    for rank_file in ["release/mp_rank_00/model_optim_rng.pt"]:
        ours = safe_torch_load(tmp_path / "c" / rank_file)["model"]
        direct = safe_torch_load(tmp_path / "direct" / rank_file)["model"]
        assert list(ours) == list(direct)
        for name, tensor in ours.items():
            assert (tensor is None and direct[name] is None) or torch.equal(tensor, direct[name]), name
    mcore_to_hf(tmp_path / "c", tmp_path / "hf")
    assert_same_hf(src, tmp_path / "hf")


def test_bf16_checkpoint_keeps_dtype_and_fp32_source_casts(tmp_path):
    make_hf_model(tmp_path / "bf16", "qwen2", dtype=torch.bfloat16)
    result = hf_to_mcore(tmp_path / "bf16", tmp_path / "mcore", tp=2)
    assert MegatronTorchCheckpoint(tmp_path / "mcore").dtype == torch.bfloat16 and result.verify.ok
    mcore_to_hf(tmp_path / "mcore", tmp_path / "back")
    assert_same_hf(tmp_path / "bf16", tmp_path / "back")
    make_hf_model(tmp_path / "fp32", "qwen2")
    cast = hf_to_mcore(tmp_path / "fp32", tmp_path / "cast", dtype="bf16", verify=True)
    assert cast.verify.ok
    shard = safe_torch_load(tmp_path / "cast/release/mp_rank_00/model_optim_rng.pt")
    assert shard["args"].params_dtype == torch.bfloat16 and shard["args"].bf16
    assert shard["model"]["decoder.final_layernorm.weight"].dtype == torch.bfloat16


def test_sharded_hf_output_has_an_index_and_loads(hf_models, tmp_path):
    hf_to_mcore(hf_models["llama3"], tmp_path / "mcore", pp=2)
    mcore_to_hf(tmp_path / "mcore", tmp_path / "hf", max_shard_size_gb=40_000 / 2**30)
    index = json.loads((tmp_path / "hf/model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    reference = transformers.AutoModelForCausalLM.from_pretrained(hf_models["llama3"], dtype=torch.float32)
    ids = torch.arange(20)[None]
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)


def test_megatron_args_describe_the_layout(hf_models, tmp_path):
    hf_to_mcore(hf_models["qwen2"], tmp_path / "m", tp=2, pp=2, make_vocab_size_divisible_by=64)
    state = safe_torch_load(tmp_path / "m/release/mp_rank_01_001/model_optim_rng.pt")
    args = state["args"]
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (2, 2)
    assert args.padded_vocab_size == 384 and args.vocab_size == 300  # ceil(300 / (64*2)) * 128
    assert args.num_query_groups == 2 and args.group_query_attention and args.add_qkv_bias
    assert args.untie_embeddings_and_output_weights and args.swiglu and args.normalization == "RMSNorm"
    assert state["checkpoint_version"] == 3.0
    assert state["model"]["output_layer.weight"].shape == (192, 64)
    assert (tmp_path / "m/latest_checkpointed_iteration.txt").read_text() == "release"


def test_reads_transformer_engine_names(hf_models, tmp_path):
    """Megatron-LM's TE spec fuses the norms into linear_qkv / linear_fc1 and adds core_attention._extra_state."""
    hf_to_mcore(hf_models["qwen2"], tmp_path / "local", tp=2)
    te_root = tmp_path / "te"
    for path in (tmp_path / "local").rglob("*"):
        target = te_root / path.relative_to(tmp_path / "local")
        if path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
        elif path.name != "model_optim_rng.pt":
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(path.read_bytes())
        else:
            state = safe_torch_load(path)
            renamed = {}
            for name, value in state["model"].items():
                name = name.replace("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight")
                name = name.replace("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight")
                renamed[name] = value
                if name.endswith("linear_proj._extra_state"):
                    renamed[name.replace("linear_proj", "core_attention")] = None
            state["model"] = renamed
            target.parent.mkdir(parents=True, exist_ok=True)
            torch.save(state, target)
    mcore_to_mcore(te_root, tmp_path / "resharded", tp=1, verify=True)
    mcore_to_hf(tmp_path / "resharded", tmp_path / "hf")
    assert_same_hf(hf_models["qwen2"], tmp_path / "hf")


def test_shard_files_hold_only_their_slices(hf_models, tmp_path):
    """A slice must not drag its whole source tensor into torch.save (views keep the full storage)."""
    hf_to_mcore(hf_models["qwen2"], tmp_path / "m", tp=4, pp=2)
    for file in (tmp_path / "m/release").rglob("model_optim_rng.pt"):
        tensors = [t for t in safe_torch_load(file)["model"].values() if t is not None]
        payload = sum(t.numel() * t.element_size() for t in tensors)
        storage = sum(t.untyped_storage().nbytes() for t in tensors)
        assert storage == payload, file
        assert file.stat().st_size < payload + 64 * 1024 + 1024 * len(tensors), file
