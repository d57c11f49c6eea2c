"""qlm convert for Qwen3, Qwen2-MoE, Qwen3-MoE and Mixtral: HF <-> Megatron legacy and torch_dist round trips are
bit-exact (verify on), Megatron's args alone describe the model, torch_dist holds megatron-core 0.16.1's MoE keys
(the stacked [L, E, ...] experts under `mlp.experts.experts.`, per-layer keys for mixed dense/MoE models, the
experts' `_extra_state` objects), transformers-5's fused expert layout reads like the per-expert keys, and the
Transformer-Engine spellings (TEGroupedMLP `weight<e>`, `pre_mlp_layernorm.weight` in torch_dist) read too."""

import shutil

import pytest
import torch
import transformers
from conftest import QWEN3_MOE_KINDS, make_hf_model
from helpers import assert_clean_failure, assert_same_hf
from safetensors.torch import save_file

from qlm_core.checkpoint.convert.hf_megatron import hf_to_mcore, mcore_to_hf, mcore_to_mcore
from qlm_core.checkpoint.formats.hf.checkpoint import HFCheckpoint
from qlm_core.checkpoint.formats.megatron import torch_dist_write
from qlm_core.checkpoint.formats.megatron.args import make_args, spec_from_args
from qlm_core.checkpoint.formats.megatron.format import open_megatron
from qlm_core.checkpoint.formats.megatron.legacy import HF_SIDE_DIR
from qlm_core.checkpoint.formats.megatron.torch_dist import SafeFileSystemReader, dist_key
from qlm_core.checkpoint.io.safe_load import safe_torch_load
from qlm_core.errors import QlmError
from qlm_core.models.layout import HFTensorSource, ModelLayout, build_shard, read_range
from qlm_core.models.spec import ModelSpec

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
KINDS = list(QWEN3_MOE_KINDS)


def without_hf_side_dir(ckpt):
    """The checkpoint as Megatron-LM would leave it: no hf/ config beside it, only the args."""
    shutil.rmtree(ckpt / HF_SIDE_DIR)
    return ckpt


def same_architecture(a: ModelSpec, b: ModelSpec):
    assert a.replace(bos_token_id=None, eos_token_id=None) == b.replace(bos_token_id=None, eos_token_id=None)


def split(kind: str, **layout) -> dict:
    """`layout`, at expert-TP 1 for gpt-oss (expert biases: Megatron-Core's only expert-TP for them)."""
    return {**layout, "etp": 1} if kind == "gpt_oss" else layout


@pytest.mark.parametrize("kind", KINDS)
def test_hf_mcore_hf_at_tp2_pp2_is_bit_exact_from_the_args_alone(moe_models, tmp_path, kind):
    src = moe_models[kind]
    assert hf_to_mcore(src, tmp_path / "mcore", **split(kind, tp=2, pp=2), verify=True).verify.ok
    args = safe_torch_load(tmp_path / "mcore/release/mp_rank_01_001/model_optim_rng.pt")["args"]
    spec = ModelSpec.from_hf_dir(src)
    same_architecture(spec_from_args(args), spec)
    assert args.qk_layernorm == spec.qk_layernorm and args.moe_grouped_gemm is False
    if spec.moe is not None:
        assert (args.num_experts, args.moe_router_topk, args.moe_ffn_hidden_size) == (4, 2, 32)
    back = mcore_to_hf(without_hf_side_dir(tmp_path / "mcore"), tmp_path / "hf", verify=True)
    assert back.verify.ok and back.verify.tensors_checked == len(HFCheckpoint(src).names)
    assert_same_hf(src, tmp_path / "hf")
    same_architecture(ModelSpec.from_hf_dir(tmp_path / "hf"), spec)


@pytest.mark.parametrize("kind", KINDS)
def test_hf_torch_dist_hf_is_bit_exact_and_resharding_into_torch_too(moe_models, tmp_path, kind):
    src = moe_models[kind]
    assert hf_to_mcore(src, tmp_path / "dist", **split(kind, tp=2), format="torch_dist", verify=True).verify.ok
    mcore_to_hf(without_hf_side_dir(tmp_path / "dist"), tmp_path / "hf", verify=False)
    assert_same_hf(src, tmp_path / "hf")
    mcore_to_mcore(tmp_path / "dist", tmp_path / "torch", **split(kind, tp=2, pp=2), format="torch", verify=False)
    hf_to_mcore(src, tmp_path / "direct", **split(kind, tp=2, pp=2))
    for file in sorted((tmp_path / "direct/release").rglob("model_optim_rng.pt")):
        ours = safe_torch_load(tmp_path / "torch/release" / file.relative_to(tmp_path / "direct/release"))["model"]
        direct = safe_torch_load(file)["model"]
        assert list(ours) == list(direct)
        for key, tensor in direct.items():
            assert (tensor is None and ours[key] is None) or torch.equal(tensor, ours[key]), key


def dist_metadata(root):
    md = SafeFileSystemReader(str(root / "release")).read_metadata().state_dict_metadata
    tensors = {k: (tuple(v.size), len(v.chunks)) for k, v in md.items() if hasattr(v, "size")}
    return tensors, sorted(k for k in md if k not in tensors)


def test_torch_dist_holds_megatron_cores_moe_keys(moe_models, tmp_path):
    """What a megatron-core 0.16.1 local-spec GPTModel's sharded_state_dict() names (SequentialMLP experts)."""
    hf_to_mcore(moe_models["qwen3_moe"], tmp_path / "q3", tp=2, format="torch_dist")
    tensors, objects = dist_metadata(tmp_path / "q3")
    L, E = 4, 4
    assert tensors["decoder.layers.mlp.experts.experts.linear_fc1.weight"] == ((L, E, 64, 64), L * E * 4)
    assert tensors["decoder.layers.mlp.experts.experts.linear_fc2.weight"] == ((L, E, 64, 32), L * E * 2)
    assert tensors["decoder.layers.mlp.router.weight"] == ((L, E, 64), L)
    assert tensors["decoder.layers.mlp.linear_fc1.layer_norm_weight"][0] == (L, 64)  # local spec, even for MoE
    assert tensors["decoder.layers.pre_mlp_layernorm.weight"][0] == (L, 64)  # and where the TE spec looks
    assert tensors["decoder.layers.self_attention.q_layernorm.weight"][0] == (L, 24)
    experts = [f"decoder.layers.mlp.experts.experts.{fc}._extra_state/shard_{i}.{e}_{L}.{E}"
               for fc in ("linear_fc1", "linear_fc2") for i in range(L) for e in range(E)]
    attention = [f"decoder.layers.self_attention.{m}._extra_state/shard_{i}_{L}"
                 for m in ("linear_proj", "linear_qkv") for i in range(L)]
    assert objects == sorted(experts + attention)

    # mlp_only_layers: the model is not homogeneous, so every layer keeps its own keys
    hf_to_mcore(moe_models["qwen2_moe"], tmp_path / "q2", format="torch_dist")
    tensors, objects = dist_metadata(tmp_path / "q2")
    assert not any(k.startswith("decoder.layers.") and not k[len("decoder.layers."):][0].isdigit() for k in tensors)
    assert tensors["decoder.layers.0.mlp.experts.experts.linear_fc1.weight"][0] == (E, 64, 64)
    assert tensors["decoder.layers.0.mlp.shared_experts.gate_weight"][0] == (1, 64)
    assert tensors["decoder.layers.2.mlp.linear_fc1.weight"][0] == (192, 64)  # the dense layer
    assert "decoder.layers.1.pre_mlp_layernorm.weight" in tensors  # an MoE layer's norm: the TE spec's key too
    assert "decoder.layers.2.pre_mlp_layernorm.weight" not in tensors  # a dense layer's: fused in both specs
    assert "decoder.layers.2.mlp.router.weight" not in tensors
    assert "decoder.layers.1.mlp.experts.experts.linear_fc2._extra_state/shard_3_4" in objects
    assert "decoder.layers.1.mlp.shared_experts.linear_fc1._extra_state/shard_0_1" in objects
    assert "decoder.layers.2.mlp.linear_fc1._extra_state/shard_0_1" in objects


def test_reads_the_te_spec_pre_mlp_layernorm_in_torch_dist(moe_models, tmp_path, monkeypatch):
    """Transformer-Engine-spec MoE checkpoints (Megatron-Bridge, Pai) store `decoder.layers.pre_mlp_layernorm
    .weight` where the local spec stores `decoder.layers.mlp.linear_fc1.layer_norm_weight`."""
    monkeypatch.setattr(torch_dist_write, "primary_key", lambda name, spec, stacked=True: dist_key(
        name, stacked, te_norms=not name.endswith("pre_mlp_layernorm.weight")))
    for kind in ("mixtral", "qwen2_moe"):
        hf_to_mcore(moe_models[kind], tmp_path / kind, format="torch_dist", verify=False)
        tensors, _ = dist_metadata(tmp_path / kind)
        assert "decoder.layers.pre_mlp_layernorm.weight" in tensors or "decoder.layers.0.pre_mlp_layernorm.weight" \
            in tensors
        assert mcore_to_hf(tmp_path / kind, tmp_path / f"{kind}.hf", verify=True).verify.ok
        assert_same_hf(moe_models[kind], tmp_path / f"{kind}.hf")


def te_renamed(name: str, moe_layer: bool) -> str:
    """A local-spec name as Megatron-LM's Transformer-Engine spec names it (TEGroupedMLP experts)."""
    name = name.replace("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight")
    if not moe_layer:  # an MoE layer keeps its own pre_mlp_layernorm module
        name = name.replace("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight")
    for fc in ("linear_fc1", "linear_fc2"):
        for e in range(4):
            name = name.replace(f"mlp.experts.local_experts.{e}.{fc}.weight", f"mlp.experts.{fc}.weight{e}")
    return name


@pytest.mark.parametrize("kind", ["qwen2_moe", "mixtral"])
def test_reads_transformer_engine_moe_names_in_legacy_files(moe_models, tmp_path, kind):
    hf_to_mcore(moe_models[kind], tmp_path / "local", tp=2, pp=2)
    shutil.copytree(tmp_path / "local", tmp_path / "te")
    spec, written = ModelSpec.from_hf_dir(moe_models[kind]), set()
    for file in (tmp_path / "te").rglob("model_optim_rng.pt"):
        state = safe_torch_load(file)
        offset = 2 * int(file.parent.name.endswith("_001"))
        renamed = {}
        for name, value in state["model"].items():
            layer = int(name.split(".")[2]) + offset if name.startswith("decoder.layers.") else None
            if name.endswith("._extra_state") and ".local_experts." in name:
                continue  # TEGroupedMLP has one _extra_state per fc, not per expert
            renamed[te_renamed(name, layer is not None and spec.is_moe_layer(layer))] = value
        state["model"] = renamed
        written |= set(renamed)
        torch.save(state, file)
    assert "decoder.layers.0.mlp.experts.linear_fc1.weight3" in written
    assert mcore_to_mcore(tmp_path / "te", tmp_path / "resharded", tp=1, verify=True).verify.ok
    mcore_to_hf(tmp_path / "resharded", tmp_path / "hf")
    assert_same_hf(moe_models[kind], tmp_path / "hf")


@pytest.mark.parametrize("kind", ["qwen2_moe", "qwen3_moe", "mixtral"])
def test_fused_expert_layout_reads_as_the_per_expert_keys(moe_models, tmp_path, kind):
    """transformers >= 5 holds experts as [E, 2F, H] gate_up_proj and [E, H, F] down_proj (Mixtral's too, under
    mlp.); a safetensors file of that state_dict gives the same shards and converts back to per-expert keys."""
    src = moe_models[kind]
    fused = tmp_path / "fused"
    shutil.copytree(src, fused)
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state and "model.layers.0.mlp.gate.weight" in state
    save_file(state, str(fused / "model.safetensors"), metadata={"format": "pt"})
    layout = ModelLayout(ModelSpec.from_hf_dir(src), tp=2, pp=2)
    per_expert, from_fused = HFTensorSource(HFCheckpoint(src)), HFTensorSource(HFCheckpoint(fused))
    for tp_rank in range(2):
        for pp_rank in range(2):
            a = build_shard(layout, tp_rank, pp_rank, 0, per_expert)
            b = build_shard(layout, tp_rank, pp_rank, 0, from_fused)
            assert list(a) == list(b)
            for name, tensor in a.items():
                assert (tensor is None and b[name] is None) or torch.equal(tensor, b[name]), name
    assert hf_to_mcore(fused, tmp_path / "mcore", tp=2, verify=True).verify.ok
    mcore_to_hf(tmp_path / "mcore", tmp_path / "hf")
    assert_same_hf(tmp_path / "hf", src)  # written per expert, as transformers saves


def test_sparse_step_pattern_round_trips_through_the_args(tmp_path):
    """decoder_sparse_step 2 (MoE on layers 1 and 3) is no megatron moe_layer_freq integer (that puts MoE on
    layers 0 and 2): the args hold the list, and the checkpoint without hf/ converts back exactly."""
    make_hf_model(tmp_path / "src", "qwen3_moe", decoder_sparse_step=2)
    hf_to_mcore(tmp_path / "src", tmp_path / "mcore", pp=2, format="torch_dist")
    args = safe_torch_load(tmp_path / "mcore/release/common.pt")["args"]
    assert args.moe_layer_freq == [0, 1, 0, 1]
    assert mcore_to_hf(without_hf_side_dir(tmp_path / "mcore"), tmp_path / "hf", verify=True).verify.ok
    assert_same_hf(tmp_path / "src", tmp_path / "hf")


def test_megatron_lm_moe_args_without_qlm_names_give_the_family():
    for kind in KINDS:
        spec = ModelSpec.from_hf_config(transformers.AutoConfig.for_model(
            QWEN3_MOE_KINDS[kind][0], **{"vocab_size": 300, "hidden_size": 64, "intermediate_size": 96,
                                         "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
                                         **QWEN3_MOE_KINDS[kind][1]}).to_dict())
        args = make_args(ModelLayout(spec), torch.float32)
        del args.qlm_model_type
        assert spec_from_args(args).model_type == kind
        assert spec_from_args(args).moe == spec.moe


def test_tp_not_dividing_the_expert_size_is_one_line(run_qlm, tmp_path):
    make_hf_model(tmp_path / "src", "qwen3_moe", moe_intermediate_size=30)
    out = tmp_path / "out"
    assert_clean_failure(run_qlm("convert", "hf2mcore", "--hf", tmp_path / "src", "--out", out, "--tp", "4"), out,
                         "moe_intermediate_size 30", "--tp 4")


def test_legacy_grouped_mlp_weights_are_one_line(run_qlm, moe_models, tmp_path):
    hf_to_mcore(moe_models["mixtral"], tmp_path / "m")
    file = tmp_path / "m/release/mp_rank_00/model_optim_rng.pt"
    state = safe_torch_load(file)
    state["model"] = {name.replace("mlp.experts.local_experts.0.linear_fc1.weight", "mlp.experts.weight1"): value
                      for name, value in state["model"].items()}
    torch.save(state, file)
    out = tmp_path / "hf"
    assert_clean_failure(run_qlm("convert", "mcore2hf", "--mcore", tmp_path / "m", "--out", out), out,
                         "mlp.experts.weight1", "GroupedMLP")


EP_LAYOUTS = {"ep2": dict(ep=2), "tp2_ep2_etp1": dict(tp=2, ep=2, etp=1), "tp2_pp2_ep4": dict(tp=2, pp=2, ep=4),
              "tp4_ep2_etp1": dict(tp=4, ep=2, etp=1)}


def rank_folders(root) -> list[str]:
    return sorted(p.name for p in (root / "release").iterdir() if p.name.startswith("mp_rank_"))


@pytest.mark.parametrize("name", EP_LAYOUTS)
def test_expert_parallel_hf_mcore_mcore_hf_is_bit_exact(moe_models, tmp_path, name):
    """hf2mcore --ep/--etp writes Megatron's folders (mp_rank_TT[_PPP]_EEE of the expert-data-parallel rank 0
    ranks, plus the dense TP shards those miss), mcore2mcore across EP in both formats, mcore2hf gives back the
    same HF files."""
    src = moe_models["qwen3_moe"]
    assert hf_to_mcore(src, tmp_path / "ep", verify=True, **EP_LAYOUTS[name]).verify.ok
    folders = {"ep2": ["mp_rank_00_000", "mp_rank_00_001"], "tp2_ep2_etp1": ["mp_rank_00_000", "mp_rank_01_001"],
               "tp4_ep2_etp1": ["mp_rank_00_000", "mp_rank_01_001", "mp_rank_02_000", "mp_rank_03_001"],
               "tp2_pp2_ep4": [f"mp_rank_{t:02d}_{p:03d}_{e:03d}" for t in range(2) for p in range(2)
                               for e in range(4)]}[name]
    assert rank_folders(tmp_path / "ep") == folders
    args = safe_torch_load(tmp_path / "ep/release" / folders[-1] / "model_optim_rng.pt")["args"]
    layout = EP_LAYOUTS[name]
    assert (args.expert_model_parallel_size, args.expert_tensor_parallel_size) == (
        layout["ep"], layout.get("etp", layout.get("tp", 1)))
    assert mcore_to_mcore(tmp_path / "ep", tmp_path / "ep4", ep=4, verify=True).verify.ok
    assert rank_folders(tmp_path / "ep4") == [f"mp_rank_00_{e:03d}" for e in range(4)]
    assert mcore_to_mcore(tmp_path / "ep4", tmp_path / "dist", tp=2, ep=2, etp=1, format="torch_dist",
                          verify=True).verify.ok
    assert mcore_to_mcore(tmp_path / "dist", tmp_path / "back", tp=2, ep=2, format="torch", verify=True).verify.ok
    mcore_to_hf(without_hf_side_dir(tmp_path / "back"), tmp_path / "hf", verify=True)
    assert_same_hf(src, tmp_path / "hf")


def test_ernie_moe_through_tp2_pp2_ep2_is_bit_exact(moe_models, tmp_path):
    """ERNIE 4.5 MoE: its router bias ([1, E] in HF, Megatron's expert_bias [E]) and experts through TP2·PP2·EP2 in
    both formats and back to the same HF files."""
    src = moe_models["ernie4_5_moe"]
    assert hf_to_mcore(src, tmp_path / "ep", tp=2, pp=2, ep=2, verify=True).verify.ok
    model = safe_torch_load(tmp_path / "ep/release/mp_rank_00_000_000/model_optim_rng.pt")["model"]
    bias = HFCheckpoint(src).read("model.layers.1.mlp.moe_statics.e_score_correction_bias", 0, 0, 1)
    assert bias.shape == (1, 4) and torch.equal(model["decoder.layers.1.mlp.router.expert_bias"], bias[0])
    assert mcore_to_mcore(tmp_path / "ep", tmp_path / "dist", tp=2, ep=2, format="torch_dist", verify=True).verify.ok
    mcore_to_hf(without_hf_side_dir(tmp_path / "dist"), tmp_path / "hf", verify=True)
    assert_same_hf(src, tmp_path / "hf")


def test_expert_parallel_file_holds_its_ep_ranks_experts_split_by_etp(moe_models, tmp_path):
    """tp2 ep2 etp1: mp_rank_01_001 holds TP shard 1 of the dense tensors and EP rank 1's experts whole (global
    experts 2 and 3, numbered 0 and 1), exactly the state_dict of the model built for that rank."""
    src = moe_models["qwen3_moe"]
    hf_to_mcore(src, tmp_path / "m", tp=2, ep=2, etp=1)
    model = safe_torch_load(tmp_path / "m/release/mp_rank_01_001/model_optim_rng.pt")["model"]
    layout = ModelLayout(ModelSpec.from_hf_dir(src), tp=2, ep=2, etp=1)
    expected = build_shard(layout, 1, 0, 0, HFTensorSource(HFCheckpoint(src)), torch.float32, ep_rank=1, etp_rank=0)
    assert list(model) == list(expected)
    for key, tensor in expected.items():
        assert (tensor is None and model[key] is None) or torch.equal(tensor, model[key]), key
    assert model["decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight"].shape == (64, 64)  # 2F whole
    assert model["decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight"].shape == (64, 32)
    assert model["decoder.layers.0.self_attention.linear_proj.weight"].shape[1] * 2 == \
        layout.spec.num_attention_heads * layout.spec.kv_channels  # dense: TP 2
    assert "decoder.layers.0.mlp.experts.local_experts.2.linear_fc1.weight" not in model


def test_torch_dist_chunks_experts_by_the_expert_tp_size(moe_models, tmp_path):
    hf_to_mcore(moe_models["qwen3_moe"], tmp_path / "d", tp=2, ep=2, etp=1, format="torch_dist")
    tensors, _ = dist_metadata(tmp_path / "d")
    L, E = 4, 4
    assert tensors["decoder.layers.mlp.experts.experts.linear_fc1.weight"] == ((L, E, 64, 64), L * E * 2)  # gate, up
    assert tensors["decoder.layers.mlp.experts.experts.linear_fc2.weight"] == ((L, E, 64, 32), L * E)
    assert tensors["decoder.layers.self_attention.linear_proj.weight"][1] == L * 2  # dense: TP 2


def fake_training_state(root):
    """Give every rank file of a converted checkpoint qlm's optimizer views, named like its weights: master = w,
    exp_avg = 2w, exp_avg_sq = 3w (as a training run at that layout would have stored them)."""
    for file in (root / "release").rglob("model_optim_rng.pt"):
        state = safe_torch_load(file)
        weights = {k: v for k, v in state["model"].items() if v is not None}
        state["qlm_optimizer"] = {"step": 7, **{view: [{k: v.float() * factor for k, v in weights.items()}]
                                                 for view, factor in (("master", 1), ("exp_avg", 2),
                                                                      ("exp_avg_sq", 3))}}
        torch.save(state, file)


def test_adam_states_follow_their_experts_across_ep(moe_models, tmp_path):
    src = moe_models["qwen3_moe"]
    hf_to_mcore(src, tmp_path / "a", tp=2, ep=2)
    fake_training_state(tmp_path / "a")
    for name, kw in {"b": dict(ep=4), "c": dict(tp=2, ep=2, etp=1, format="torch_dist"), "d": dict(tp=2, ep=4)}.items():
        source = {"b": "a", "c": "b", "d": "c"}[name]
        result = mcore_to_mcore(tmp_path / source, tmp_path / name, verify=True, **kw)
        # 87 HF weights + 3 Adam views x 63 global tensors, every expert's among them
        assert result.verify.ok and result.verify.tensors_checked == 87 + 3 * 63, result.verify.summary()
    weights = open_megatron(tmp_path / "d")
    exp_avg = open_megatron(tmp_path / "d", view="exp_avg")
    assert exp_avg.extra_state("qlm_optimizer")["step"] == 7
    for tensor in weights.layout.global_tensors:
        want = read_range(weights, tensor, 0, tensor.real_extent).float() * 2
        assert torch.equal(read_range(exp_avg, tensor, 0, tensor.real_extent), want), tensor.name


def test_a_missing_expert_parallel_folder_is_named(moe_models, tmp_path):
    hf_to_mcore(moe_models["qwen3_moe"], tmp_path / "m", tp=2, ep=2, etp=1)
    shutil.rmtree(tmp_path / "m/release/mp_rank_01_001")
    with pytest.raises(QlmError, match=r"no mp_rank_01_001\)"):  # its dense TP shard is missing too
        open_megatron(tmp_path / "m")
    hf_to_mcore(moe_models["qwen3_moe"], tmp_path / "n", tp=2, ep=2, etp=1, force=True)
    shutil.copytree(tmp_path / "n/release/mp_rank_01_001", tmp_path / "n/release/mp_rank_01_000")
    shutil.rmtree(tmp_path / "n/release/mp_rank_01_001")  # TP shard 1 is there, EP rank 1's experts are not
    with pytest.raises(QlmError, match=r"lacks mp_rank_00_001/model_optim_rng.pt \(the experts of EP rank 1"):
        open_megatron(tmp_path / "n")


def test_ep_flags_get_one_line_errors(run_qlm, moe_models, tmp_path):
    out = tmp_path / "out"
    assert_clean_failure(run_qlm("convert", "hf2mcore", "--hf", moe_models["qwen3"], "--out", out, "--ep", "2"),
                         out, "--ep 2", "Mixture-of-Experts")
    assert_clean_failure(run_qlm("convert", "hf2mcore", "--hf", moe_models["qwen3"], "--out", out, "--etp", "1"),
                         out, "--etp 1", "drop --ep and --etp")
    assert_clean_failure(run_qlm("convert", "hf2mcore", "--hf", moe_models["qwen3_moe"], "--out", out, "--ep", "3"),
                         out, "--ep 3", "num_experts 4")
    assert_clean_failure(run_qlm("convert", "hf2mcore", "--hf", moe_models["qwen3_moe"], "--out", out, "--etp", "2"),
                         out, "expert TP size 2 does not divide TP 1", "torch_dist")
    code, stdout, stderr = run_qlm("convert", "hf2mcore", "--hf", moe_models["qwen3_moe"], "--out", out, "--ep", "2",
                                   "--etp", "2", "--format", "torch_dist")
    assert code == 0, stderr
