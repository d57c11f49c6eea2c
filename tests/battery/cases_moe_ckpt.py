"""Mixture-of-Experts models, expert parallelism and Megatron checkpoints whose config or args lie.

HF MoE checkpoints (Qwen3-MoE, Qwen2-MoE, Mixtral) in the per-expert layout save_pretrained writes and in
transformers' FUSED layout (model.layers.N.mlp.experts.gate_up_proj [E, 2F, H] / down_proj [E, H, F], as
model.state_dict() gives it), with tensors or config.json numbers that disagree; recipes/tiny-moe.toml with [moe]
and [parallel] settings no run can take; Megatron checkpoints (legacy `torch` with EP folders, `torch_dist`,
Megatron-Bridge style: no args, a run_config.yaml) whose args / run_config.yaml deny what is stored. Each must be
one line before anything is written or trained, never a traceback or a silent wrong result; the honest versions
(expect_ok) still convert, verify and dry-run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from battery.case import Case
from battery.fixtures import qlm

REPO = Path(__file__).resolve().parents[2]
TINY_MOE = REPO / "recipes" / "tiny-moe.toml"
TINY_DPO = REPO / "recipes" / "tiny-dpo.toml"
L = "model.layers.{}.mlp.experts."  # fused / qwen per-expert names


# ---- fixtures (built once per battery run under the cache) --------------------------------------------------------

def hf_moe(fx, kind: str, **overrides) -> Path:
    """A tiny random HF MoE model of `kind` (conftest's QWEN3_MOE_KINDS: 4 experts, top 2) in the per-expert layout."""
    from conftest import make_hf_model

    tag = "".join(f"_{k}{v}" for k, v in sorted(overrides.items()))
    return fx._built(f"moe_hf_{kind}{tag}", lambda p: make_hf_model(p, kind, **overrides))


def hf_fused(fx, kind: str) -> Path:
    """The same model saved in transformers' fused expert layout (model.state_dict())."""
    def build(path: Path):
        import torch
        import transformers
        from safetensors.torch import save_file

        src = hf_moe(fx, kind)
        model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
        shutil.copytree(src, path)
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path / "model.safetensors"),
                  metadata={"format": "pt"})
    return fx._built(f"moe_fused_{kind}", build)


def mcore(fx, kind: str, *flags: str, **overrides) -> Path:
    """hf_moe(kind) converted with `qlm convert hf2mcore FLAGS --no-verify`."""
    tag = "".join(f"_{k}{v}" for k, v in sorted(overrides.items()))
    name = f"moe_mc_{kind}{tag}_" + "_".join(f.strip("-") for f in flags)
    return fx._built(name, lambda p: qlm("convert", "hf2mcore", "--hf", hf_moe(fx, kind, **overrides), "--out", p,
                                         *flags, "--no-verify"))


def copy(src: Path, root: Path, name: str) -> Path:
    dst = root / name
    shutil.copytree(src, dst)
    return dst


def edit_config(hf: Path, change):
    config = json.loads((hf / "config.json").read_text())
    change(config)
    (hf / "config.json").write_text(json.dumps(config))


def hf_config_lie(kind: str, change, fused: bool = False):
    """A private copy of the HF MoE model with config.json changed."""
    def make(root, fx):
        hf = copy(hf_fused(fx, kind) if fused else hf_moe(fx, kind), root, "hf")
        edit_config(hf, change)
        return hf
    return make


def hf_tensor_lie(kind: str, change, fused: bool = True):
    """A private copy of the HF MoE model (fused layout unless fused=False) with its tensors changed."""
    def make(root, fx):
        from safetensors.torch import load_file, save_file

        hf = copy(hf_fused(fx, kind) if fused else hf_moe(fx, kind), root, "hf")
        state = load_file(hf / "model.safetensors")
        change(state)
        save_file(state, str(hf / "model.safetensors"), metadata={"format": "pt"})
        return hf
    return make


def legacy_files(mc: Path) -> list[Path]:
    return sorted(mc.glob("*/mp_rank_*/model_optim_rng.pt"))


def edit_legacy(mc: Path, change):
    """change(state, file) on every rank file of a legacy Megatron checkpoint."""
    import torch

    from qlm_core.checkpoint.io.safe_load import safe_torch_load

    for file in legacy_files(mc):
        state = safe_torch_load(file)
        change(state, file)
        torch.save(state, file)


def set_args(**values):
    def change(state, file):
        for key, value in values.items():
            if value is _DELETE:
                if hasattr(state["args"], key):
                    delattr(state["args"], key)
            else:
                setattr(state["args"], key, value)
    return change


_DELETE = object()


def args_lie(kind: str, flags: tuple[str, ...], keep_hf: bool = False, **values):
    """The legacy checkpoint with its args changed (hf/ removed, so the args are all that describes it)."""
    def make(root, fx):
        mc = copy(mcore(fx, kind, *flags), root, "mc")
        if not keep_hf:
            shutil.rmtree(mc / "hf")
        edit_legacy(mc, set_args(**values))
        return mc
    return make


def stored_lie(kind: str, flags: tuple[str, ...], change, keep_hf: bool = True, **overrides):
    """The legacy checkpoint with change(model_state_dict, file) applied to every rank file."""
    def make(root, fx):
        mc = copy(mcore(fx, kind, *flags, **overrides), root, "mc")
        if not keep_hf:
            shutil.rmtree(mc / "hf")
        edit_legacy(mc, lambda state, file: change(state["model"], file))
        return mc
    return make


def bridge_model(hf: Path, **model) -> dict:
    """run_config.yaml's `model:` section for the HF model at `hf` (as Megatron-Bridge's GPT provider writes it)."""
    from qlm_core.models.spec import ModelSpec

    spec = ModelSpec.from_hf_dir(hf)
    config = {"num_layers": spec.num_layers, "hidden_size": spec.hidden_size, "ffn_hidden_size": spec.ffn_hidden_size,
              "num_attention_heads": spec.num_attention_heads, "num_query_groups": spec.num_query_groups,
              "kv_channels": spec.kv_channels, "vocab_size": spec.vocab_size, "position_embedding_type": "rope",
              "normalization": "RMSNorm", "gated_linear_unit": True, "add_bias_linear": False,
              "add_qkv_bias": spec.qkv_bias, "share_embeddings_and_output_weights": spec.tie_word_embeddings,
              "rotary_base": spec.rope_theta, "layernorm_epsilon": spec.norm_epsilon,
              "qk_layernorm": spec.qk_layernorm, "max_position_embeddings": spec.max_position_embeddings}
    moe = spec.moe
    if moe is not None:
        config.update(num_moe_experts=moe.num_experts, moe_router_topk=moe.topk,
                      moe_ffn_hidden_size=moe.ffn_hidden_size, moe_router_pre_softmax=moe.pre_softmax)
        if moe.shared_expert_hidden_size:
            config.update(moe_shared_expert_intermediate_size=moe.shared_expert_hidden_size,
                          moe_shared_expert_gate=moe.shared_expert_gate)
        if moe.layer_pattern:
            config["moe_layer_freq"] = list(moe.layer_pattern)
    for key, value in model.items():
        if value is _DELETE:
            config.pop(key, None)
        else:
            config[key] = value
    return config


def bridge(kind: str, flags: tuple[str, ...] = (), text: str | None = None, **model):
    """A Megatron-Bridge style checkpoint: the conversion of hf_moe(kind) with FLAGS, its args removed (legacy rank
    files or torch_dist common.pt), hf/ removed, and release/run_config.yaml (`model:` section, changed by MODEL;
    or TEXT written as it is)."""
    def make(root, fx):
        import torch
        import yaml

        from qlm_core.checkpoint.io.safe_load import safe_torch_load

        mc = copy(mcore(fx, kind, *flags), root, "bridge")
        shutil.rmtree(mc / "hf")
        for file in [*legacy_files(mc), *mc.glob("*/common.pt")]:
            state = safe_torch_load(file)
            state.pop("args")
            torch.save(state, file)
        tp = int(flags[flags.index("--tp") + 1]) if "--tp" in flags else 1
        config = bridge_model(hf_moe(fx, kind), **{"tensor_model_parallel_size": tp, **model})
        run_config = mc / "release" / "run_config.yaml"
        if text is not None:
            run_config.write_text(text)
        else:
            run_config.write_text(yaml.safe_dump({"model": config}))
        return mc
    return make


def sigmoid_ckpt(root, fx) -> Path:
    """A Megatron checkpoint of a sigmoid-routed MoE with the aux-loss-free expert bias (DeepSeek-V3 style): the
    Qwen3-MoE conversion, its args saying so and a router.expert_bias in every MoE layer; no hf/ (it has no HF
    form)."""
    import torch

    mc = copy(mcore(fx, "qwen3_moe"), root, "sigmoid")
    shutil.rmtree(mc / "hf")

    def change(state, file):
        set_args(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)(state, file)
        for layer in range(4):
            state["model"][f"decoder.layers.{layer}.mlp.router.expert_bias"] = torch.zeros(4)
    edit_legacy(mc, change)
    return mc


def sft_recipe(root: Path, fx, load: Path, tokenizer: Path | None = None, extra: str = "") -> Path:
    """A 4-step SFT recipe training from model.load (no model.spec: the weights' own config)."""
    tok = f'tokenizer = "{tokenizer}"\n' if tokenizer else ""
    path = root / "recipe.toml"
    path.write_text(f"""[model]
load = "{load}"
{tok}dtype = "fp32"

[data]
kind = "sft"
train = ["{fx.sft_jsonl() / 'chat.jsonl'}"]
seq_length = 64
chat_template = "chatml"

[train]
micro_batch_size = 2
global_batch_size = 4
train_iters = 4
eval_iters = 1

[checkpoint]
save_interval = 2

[logging]
plot = false
tensorboard = false
{extra}""")
    return path


# ---- argv builders ----------------------------------------------------------------------------------------------

def convert_hf(make, *flags):
    def setup(root, fx):
        return ["convert", "hf2mcore", "--hf", make(root, fx), "--out", root / "out", *flags]
    return setup


def convert_mc(make, *flags, command="mcore2hf"):
    def setup(root, fx):
        return ["convert", command, "--mcore", make(root, fx), "--out", root / "out", *flags]
    return setup


def generate(make, *flags):
    def setup(root, fx):
        return ["generate", make(root, fx), "-p", "the fox", "--raw", "--max-new-tokens", "3", *flags]
    return setup


def train_from(make, *sets, dry_run=True, tokenizer=None):
    """`qlm train` of a 4-step SFT recipe with model.load = make(root, fx)."""
    def setup(root, fx):
        load = make(root, fx)
        tok = tokenizer(fx) if tokenizer else None
        argv = ["train", sft_recipe(root, fx, load, tok), "--output", root / "run"]
        for s in sets:
            argv += ["--set", s]
        return argv + (["--dry-run"] if dry_run else [])
    return setup


def tiny_moe(*sets, dry_run=True, recipe=TINY_MOE):
    def setup(root, fx):
        argv = ["train", recipe, "--output", root / "run"]
        for s in sets:
            argv += ["--set", s]
        return argv + (["--dry-run"] if dry_run else [])
    return setup


# ---- checks -----------------------------------------------------------------------------------------------------

def error_line(out) -> str:
    return next((line for line in out.stderr.splitlines() if line.startswith("error:")), "")


def says(*needles, any_of: tuple[str, ...] = ()):
    """The error line names every needle (and one of any_of, when given)."""
    def check(root, out):
        line = error_line(out)
        missing = [n for n in needles if n not in line]
        if any_of and not any(a in line for a in any_of):
            missing.append(" or ".join(any_of))
        return f"message lacks {missing}: {line[:400]}" if missing else None
    return check


def refused(*needles, any_of: tuple[str, ...] = ()):
    """says(...), nothing written at out/, and no claim of a verified result."""
    def check(root, out):
        if (root / "out").exists():
            return "out/ was written"
        if "bit-exact" in out.stdout + out.stderr:
            return "reported bit-exact on a lying checkpoint"
        return says(*needles, any_of=any_of)(root, out)
    return check


def not_trained(*needles, run_dir_absent=False, any_of: tuple[str, ...] = ()):
    """says(...) and no step was taken: no metrics.jsonl (nor, with run_dir_absent, any run directory)."""
    def check(root, out):
        if run_dir_absent and (root / "run").exists():
            return "the run directory was created before the refusal"
        if (root / "run" / "metrics.jsonl").exists():
            return "training started (run/metrics.jsonl written)"
        return says(*needles, any_of=any_of)(root, out)
    return check


def printed(*needles, stream="both"):
    def check(root, out):
        text = {"stdout": out.stdout, "stderr": out.stderr, "both": out.stdout + out.stderr}[stream]
        missing = [n for n in needles if n not in text]
        return f"output lacks {missing}: {text[-400:]}" if missing else None
    return check


def converted(*needles):
    """An expect_ok conversion: out/ written, and the output names needles (e.g. 'bit-exact')."""
    def check(root, out):
        if not (root / "out").is_dir() or not any((root / "out").iterdir()):
            return "no output written"
        return printed(*needles)(root, out)
    return check


# ---- tensor edits -----------------------------------------------------------------------------------------------

def _cat(name: str, dim: int):
    def change(s):
        import torch

        s[name] = torch.cat([s[name], s[name].narrow(dim, 0, 1)], dim)
    return change


def _five_experts(s):
    import torch

    for part in ("gate_up_proj", "down_proj"):
        name = L.format(0) + part
        s[name] = torch.cat([s[name], s[name][:1]], 0)


def _also_per_expert(scale: float):
    def change(s):
        s[L.format(1) + "3.down_proj.weight"] = s[L.format(1) + "down_proj"][3].clone() * scale
    return change


def _pop(name: str):
    return lambda s: s.pop(name)


def _put(name: str, make):
    def change(s):
        s[name] = make(s)
    return change


def _mixed_layers(root, fx):
    """Layer 0 in the fused layout, the other layers per expert (a file written in two halves)."""
    from safetensors.torch import load_file, save_file

    hf = copy(hf_moe(fx, "qwen3_moe"), root, "hf")
    state = load_file(hf / "model.safetensors")
    fused = load_file(hf_fused(fx, "qwen3_moe") / "model.safetensors")
    for name in [n for n in state if n.startswith(L.format(0))]:
        state.pop(name)
    for part in ("gate_up_proj", "down_proj"):
        state[L.format(0) + part] = fused[L.format(0) + part]
    save_file(state, str(hf / "model.safetensors"), metadata={"format": "pt"})
    return hf


def _nan_in_fused(s):
    s[L.format(0) + "gate_up_proj"][1, 3, :4] = float("nan")


# ---- Megatron edits ---------------------------------------------------------------------------------------------

def _stray_ep(src: str, copy_from: str, flags=("--ep", "2")):
    def make(root, fx):
        mc = copy(mcore(fx, "qwen3_moe", *flags), root, "mc")
        shutil.copytree(mc / "release" / copy_from, mc / "release" / src)
        return mc
    return make


def _missing_ep(folder: str, flags=("--ep", "2")):
    def make(root, fx):
        mc = copy(mcore(fx, "qwen3_moe", *flags), root, "mc")
        shutil.rmtree(mc / "release" / folder)
        return mc
    return make


def _qkv_bias(model, file):
    import torch

    weight = model["decoder.layers.0.self_attention.linear_qkv.weight"]
    model["decoder.layers.0.self_attention.linear_qkv.bias"] = torch.ones(weight.shape[0])


def _untied_output(model, file):
    model["output_layer.weight"] = model["embedding.word_embeddings.weight"] * 2


def _third_local_expert(model, file):
    src = "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"
    model[src.replace(".0.linear_fc1", ".2.linear_fc1")] = model[src].clone()


def _expert_bias(model, file):
    import torch

    model["decoder.layers.0.mlp.router.expert_bias"] = torch.zeros(4)


def _torch_dist_extra_key(root, fx):
    """A torch_dist checkpoint re-saved (dcp -> torch -> dcp) with one more key: a qkv bias the model has not."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp

    mc = copy(mcore(fx, "qwen3_moe", "--format", "torch_dist"), root, "dist")
    release = mc / "release"
    whole = root / "whole.pt"
    dcp_to_torch_save(release, whole)
    state = torch.load(whole, weights_only=False)
    state["decoder.layers.self_attention.linear_qkv.bias"] = torch.ones(4, 192)
    torch.save(state, whole)
    for file in [*release.glob("*.distcp"), release / ".metadata"]:
        file.unlink()
    torch_save_to_dcp(whole, release)
    whole.unlink()
    return mc


def _torch_dist_args(**values):
    def make(root, fx):
        import torch

        from qlm_core.checkpoint.io.safe_load import safe_torch_load

        mc = copy(mcore(fx, "qwen3_moe", "--format", "torch_dist"), root, "dist")
        shutil.rmtree(mc / "hf")
        common = mc / "release" / "common.pt"
        state = safe_torch_load(common)
        for key, value in values.items():
            setattr(state["args"], key, value)
        torch.save(state, common)
        return mc
    return make


def _tied_moe_with_output(root, fx):
    mc = stored_lie("qwen3_moe", (), _untied_output, tie_word_embeddings=True)(root, fx)
    return mc


BRIDGE_3D = ("--tp", "2", "--pp", "2", "--ep", "2")
BRIDGE_3D_MODEL = dict(pipeline_model_parallel_size=2, expert_model_parallel_size=2, expert_tensor_parallel_size=2)


def _bridge_stray_ep(root, fx):
    """An honest Bridge checkpoint at TP2 PP2 EP2 (three-number folders, unambiguous) plus a copy of one rank
    folder as EP rank 2."""
    mc = bridge("qwen3_moe", BRIDGE_3D, **BRIDGE_3D_MODEL)(root, fx)
    shutil.copytree(mc / "release" / "mp_rank_01_001_001", mc / "release" / "mp_rank_01_001_002")
    return mc


# ---- the cases --------------------------------------------------------------------------------------------------

H, R, M = "moe hf", "moe recipe", "megatron lies"
Q3, Q2, MX = "qwen3_moe", "qwen2_moe", "mixtral"
EP2 = ("--ep", "2")
NO_VERIFY = "--no-verify"


def _q3(fx):
    return hf_moe(fx, Q3)


def generate_tok(make):
    """generate on a Megatron checkpoint without hf/: the tokenizer is the HF model's."""
    def setup(root, fx):
        return [*generate(make)(root, fx), "--tokenizer", _q3(fx)]
    return setup


def _not_utf8_bridge(root, fx):
    mc = bridge(Q3)(root, fx)
    (mc / "release" / "run_config.yaml").write_bytes(b"\xff\xfe model: {num_layers: 4}")
    return ["convert", "mcore2hf", "--mcore", mc, "--out", root / "out"]


CASES = [
    # ---- HF MoE tensors that disagree with config.json (fused and per-expert layouts) ----
    Case(H, "moe: fused gate_up_proj with 2F+1 rows",
         convert_hf(hf_tensor_lie(Q3, _cat(L.format(0) + "gate_up_proj", 1))),
         check=refused("gate_up_proj", "[4, 65, 64]", "[4, 64, 64]")),
    Case(H, "moe: fused experts for 5 experts under a 4-expert config.json (mixtral)",
         convert_hf(hf_tensor_lie(MX, _five_experts)), check=refused("[5, 64, 64]", "[4, 64, 64]")),
    Case(H, "moe: an expert stored fused and per expert with different values",
         convert_hf(hf_tensor_lie(Q3, _also_per_expert(2.0))),
         check=refused(L.format(1) + "3.down_proj.weight", "twice")),
    Case(H, "moe: mixtral expert stored fused and per expert (same values)",
         convert_hf(hf_tensor_lie(MX, _also_per_expert(1.0))), check=refused(L.format(1) + "3.down_proj.weight")),
    Case(H, "moe: router tensor missing", convert_hf(hf_tensor_lie(Q3, _pop("model.layers.2.mlp.gate.weight"), False)),
         check=refused("model.layers.2.mlp.gate.weight", "missing")),
    Case(H, "moe: router misshapen [5, 64] (qwen2_moe)",
         convert_hf(hf_tensor_lie(Q2, _put("model.layers.1.mlp.gate.weight",
                                           lambda s: s["model.layers.1.mlp.gate.weight"][[0, 1, 2, 3, 0]]), False)),
         check=refused("mlp.gate.weight", "[5, 64]", "[4, 64]")),
    Case(H, "moe: router transposed in a fused mixtral",
         convert_hf(hf_tensor_lie(MX, _put("model.layers.2.mlp.gate.weight",
                                           lambda s: s["model.layers.2.mlp.gate.weight"].T.contiguous()))),
         check=refused("layers.2.", "gate.weight", "[64, 4]")),
    Case(H, "moe: a per-expert tensor missing (mixtral w3 of expert 2)",
         convert_hf(hf_tensor_lie(MX, _pop("model.layers.1.block_sparse_moe.experts.2.w3.weight"), False)),
         check=refused("model.layers.1.block_sparse_moe.experts.2.w3.weight", "missing")),
    Case(H, "moe: an extra per-expert expert 4",
         convert_hf(hf_tensor_lie(Q3, lambda s: s.update({
             f"{L.format(1)}4.{p}.weight": s[f"{L.format(1)}0.{p}.weight"].clone()
             for p in ("gate_proj", "up_proj", "down_proj")}), False)),
         check=refused(L.format(1) + "4.")),
    Case(H, "moe: fused down_proj stored transposed [E, F, H]",
         convert_hf(hf_tensor_lie(Q3, _put(L.format(0) + "down_proj",
                                           lambda s: s[L.format(0) + "down_proj"].transpose(1, 2).contiguous()))),
         check=refused("down_proj", "[4, 32, 64]", "[4, 64, 32]")),
    Case(H, "moe: fused gate_up_proj flattened to 2-D",
         convert_hf(hf_tensor_lie(Q3, _put(L.format(0) + "gate_up_proj",
                                           lambda s: s[L.format(0) + "gate_up_proj"].reshape(-1, 64)))),
         check=refused("gate_up_proj", "[256, 64]")),
    Case(H, "moe: fused gate_up_proj missing from the last layer",
         convert_hf(hf_tensor_lie(Q3, _pop(L.format(3) + "gate_up_proj"))),
         check=refused("model.layers.3.", "missing")),
    Case(H, "moe: shared_expert_intermediate_size 0 while the shared expert is stored (qwen2_moe)",
         convert_hf(hf_config_lie(Q2, lambda c: c.update(shared_expert_intermediate_size=0))),
         check=refused("shared_expert")),
    Case(H, "moe: decoder_sparse_step 2 while every layer holds experts",
         convert_hf(hf_config_lie(Q3, lambda c: c.update(decoder_sparse_step=2))), check=refused("missing")),
    # ---- HF MoE config.json numbers that are wrong or ill-typed ----
    Case(H, "moe: num_experts_per_tok above num_experts",
         convert_hf(hf_config_lie(Q3, lambda c: c.update(num_experts_per_tok=5))),
         check=refused("num_experts_per_tok 5", "4 experts")),
    Case(H, "moe: num_experts 0", convert_hf(hf_config_lie(Q3, lambda c: c.update(num_experts=0))),
         check=refused("0 experts")),
    Case(H, "moe: num_experts a string", convert_hf(hf_config_lie(Q3, lambda c: c.update(num_experts="4"))),
         check=refused("num_experts")),
    Case(H, "moe: moe_intermediate_size missing",
         convert_hf(hf_config_lie(Q3, lambda c: c.pop("moe_intermediate_size"))),
         check=refused("moe_intermediate_size")),
    Case(H, "moe: moe_intermediate_size a string",
         convert_hf(hf_config_lie(Q3, lambda c: c.update(moe_intermediate_size="32"))),
         check=refused("moe_intermediate_size", "'32'")),
    Case(H, "moe: moe_intermediate_size a float 32.0",
         convert_hf(hf_config_lie(Q3, lambda c: c.update(moe_intermediate_size=32.0))),
         check=refused("moe_intermediate_size")),
    Case(H, "moe: decoder_sparse_step a string",
         convert_hf(hf_config_lie(Q3, lambda c: c.update(decoder_sparse_step="2"))),
         check=refused("decoder_sparse_step")),
    Case(H, "moe: decoder_sparse_step 0 (transformers divides by it)",
         convert_hf(hf_config_lie(Q3, lambda c: c.update(decoder_sparse_step=0))),
         check=refused("decoder_sparse_step")),
    Case(H, "moe: mlp_only_layers an integer",
         convert_hf(hf_config_lie(Q3, lambda c: c.update(mlp_only_layers=2))), check=refused("mlp_only_layers")),
    Case(H, "moe: mlp_only_layers a string",
         convert_hf(hf_config_lie(Q3, lambda c: c.update(mlp_only_layers="2"))), check=refused("mlp_only_layers")),
    Case(H, "moe: shared_expert_intermediate_size a string (qwen2_moe)",
         convert_hf(hf_config_lie(Q2, lambda c: c.update(shared_expert_intermediate_size="48"))),
         check=refused("shared_expert_intermediate_size")),
    Case(H, "moe: norm_topk_prob a string 'false' (qwen2_moe)",
         convert_hf(hf_config_lie(Q2, lambda c: c.update(norm_topk_prob="false"))), check=refused("norm_topk_prob")),
    Case(H, "moe: generate reads norm_topk_prob 'false' (a string) as true",
         lambda root, fx: [*generate(hf_config_lie(Q2, lambda c: c.update(norm_topk_prob="false")))(root, fx),
                           "--tokenizer", fx.tokenizer()],  # a separate tokenizer: qlm's own reading of config.json
         check=says("norm_topk_prob")),
    Case(H, "moe: mixtral router_jitter_noise set",
         convert_hf(hf_config_lie(MX, lambda c: c.update(router_jitter_noise=0.1))),
         check=refused("router_jitter_noise")),
    Case(H, "moe: mixtral sliding_window 0 (convert)",
         convert_hf(hf_config_lie(MX, lambda c: c.update(sliding_window=0))), check=refused("sliding_window", "0")),
    Case(H, "moe: mixtral sliding_window -1 (convert, fused layout)",
         convert_hf(hf_config_lie(MX, lambda c: c.update(sliding_window=-1), fused=True)),
         check=refused("sliding_window", "-1")),
    Case(H, "moe: mixtral sliding_window '4096' (convert)",
         convert_hf(hf_config_lie(MX, lambda c: c.update(sliding_window="4096"))),
         check=refused("sliding_window", "'4096'")),
    Case(H, "moe: mixtral sliding_window 2.5 (convert)",
         convert_hf(hf_config_lie(MX, lambda c: c.update(sliding_window=2.5))), check=refused("sliding_window", "2.5")),
    Case(H, "moe: mixtral sliding_window 0 (generate)",
         generate(hf_config_lie(MX, lambda c: c.update(sliding_window=0))), check=says("sliding_window")),
    Case(H, "moe: mixtral sliding_window 2.5 (generate)",
         generate(hf_config_lie(MX, lambda c: c.update(sliding_window=2.5))), check=says("sliding_window", "2.5")),
    Case(H, "moe: mixtral sliding_window '4096' (train --dry-run, model.load)",
         train_from(hf_config_lie(MX, lambda c: c.update(sliding_window="4096"))),
         check=not_trained("sliding_window", "'4096'")),
    Case(H, "moe: mixtral sliding_window -1 (train, a real start)",
         train_from(hf_config_lie(MX, lambda c: c.update(sliding_window=-1)), dry_run=False),
         check=not_trained("sliding_window", "-1")),
    Case(H, "moe: convert flags --ep 3 on 4 experts", lambda root, fx: [
        "convert", "hf2mcore", "--hf", _q3(fx), "--out", root / "out", "--ep", "3"], check=refused("--ep 3", "4")),
    Case(H, "moe: convert flags --etp 3 (torch_dist) not dividing the expert ffn 32", lambda root, fx: [
        "convert", "hf2mcore", "--hf", _q3(fx), "--out", root / "out", "--etp", "3", "--format", "torch_dist"],
         check=refused("--etp 3", "32")),
    Case(H, "moe: mcore2mcore --ep 3 of an EP2 checkpoint", convert_mc(lambda root, fx: copy(
        mcore(fx, Q3, *EP2), root, "mc"), "--ep", "3", command="mcore2mcore"), check=refused("--ep 3")),
    # honest versions
    Case(H, "moe: fused-layout qwen3_moe converts with --verify at --ep 2",
         convert_hf(lambda root, fx: hf_fused(fx, Q3), "--ep", "2", "--verify"), check=converted("bit-exact"),
         expect_ok=True),
    Case(H, "moe: fused-layout qwen2_moe converts with --verify at --tp 2 --ep 2 (torch_dist)",
         convert_hf(lambda root, fx: hf_fused(fx, Q2), "--tp", "2", "--ep", "2", "--format", "torch_dist",
                    "--verify"), check=converted("bit-exact"), expect_ok=True),
    Case(H, "moe: fused layer 0, per-expert layers 1-3 converts with --verify", convert_hf(_mixed_layers, "--verify"),
         check=converted("bit-exact"), expect_ok=True),
    Case(H, "moe: fused-layout qwen3_moe converts to DeepSpeed (hf2ds)", lambda root, fx: [
        "convert", "hf2ds", "--hf", hf_fused(fx, Q3), "--out", root / "out"], check=converted(), expect_ok=True),
    Case(H, "moe: NaN inside a fused expert tensor is warned about", convert_hf(hf_tensor_lie(Q3, _nan_in_fused),
                                                                               "--verify"),
         check=converted("NaN", "4 NaN"), expect_ok=True),

    # ---- tiny-moe recipes: layouts and [moe] numbers no run can take ----
    Case(R, "moe: parallel.ep=3 does not divide the 8 experts", tiny_moe("parallel.ep=3"),
         check=not_trained("parallel.ep 3", "8")),
    Case(R, "moe: parallel.ep=16 above the 8 experts", tiny_moe("parallel.ep=16"), check=not_trained("16", "8")),
    Case(R, "moe: parallel.etp=3 does not divide the expert ffn 64 (torch_dist)",
         tiny_moe("parallel.etp=3", 'checkpoint.format="torch_dist"'), check=not_trained("etp", "3", "64")),
    Case(R, "moe: parallel.ep=2 with tp=2 without sp", tiny_moe("parallel.ep=2", "parallel.tp=2"),
         check=not_trained("parallel.sp")),
    Case(R, "moe: parallel.ep=2 does not divide dp=3", tiny_moe("parallel.ep=2", "parallel.dp=3"),
         check=not_trained("ep*etp = 2*1", "3")),
    Case(R, "moe: moe.aux_loss_coeff=inf", tiny_moe("moe.aux_loss_coeff=inf"), check=not_trained("moe.aux_loss_coeff")),
    Case(R, "moe: moe.aux_loss_coeff=nan", tiny_moe("moe.aux_loss_coeff=nan"), check=not_trained("moe.aux_loss_coeff")),
    Case(R, "moe: moe.aux_loss_coeff=-1", tiny_moe("moe.aux_loss_coeff=-1"), check=not_trained("moe.aux_loss_coeff")),
    Case(R, "moe: moe.aux_loss_coeff=1e300 (a real start: it overflows fp32)",
         tiny_moe("moe.aux_loss_coeff=1e300", "train.train_iters=8", "train.eval_interval=0", "data.seq_length=64",
                  dry_run=False), check=says("aux_loss_coeff")),
    Case(R, "moe: moe.capacity_factor=0", tiny_moe("moe.capacity_factor=0"), check=not_trained("moe.capacity_factor")),
    Case(R, "moe: moe.capacity_factor=nan", tiny_moe("moe.capacity_factor=nan"),
         check=not_trained("moe.capacity_factor")),
    Case(R, "moe: moe.capacity_factor with ep=2 under tp=2 sp", tiny_moe(
        "moe.capacity_factor=1.0", "parallel.ep=2", "parallel.tp=2", "parallel.sp=true"),
         check=not_trained("capacity_factor", "tp")),
    Case(R, "moe: moe.aux_loss_type transformers with pp=2",
         tiny_moe('moe.aux_loss_type="transformers"', "parallel.pp=2", "train.global_batch_size=32"),
         check=not_trained("aux_loss_type", "parallel.pp = 1")),
    Case(R, "moe: the issue's layout ep=2 pp=2 dp=2 (a real start)",
         tiny_moe("parallel.ep=2", "parallel.pp=2", "parallel.dp=2", dry_run=False),
         check=not_trained("2 micro-batches", "this layout has 1", "train.micro_batch_size 8",
                           "train.global_batch_size 16", run_dir_absent=True)),
    Case(R, "moe: the issue's layout ep=2 pp=2 dp=2 (--dry-run)",
         tiny_moe("parallel.ep=2", "parallel.pp=2", "parallel.dp=2"),
         check=not_trained("2 micro-batches", "this layout has 1", "train.global_batch_size 16")),
    Case(R, "moe: moe.router_score_function sigmoid with a loaded softmax model",
         train_from(lambda root, fx: _q3(fx), 'moe.router_score_function="sigmoid"'),
         check=not_trained("router_score_function", "model.load")),
    Case(R, "moe: moe.router_expert_bias with a loaded softmax model",
         train_from(lambda root, fx: _q3(fx), "moe.router_expert_bias=true"),
         check=not_trained("router_expert_bias", "model.load")),
    Case(R, "moe: router_bias_update_rate with LoRA on an expert-bias checkpoint",
         train_from(sigmoid_ckpt, "lora.rank=4", tokenizer=_q3), check=not_trained("router_bias_update_rate", "LoRA")),
    Case(R, "moe: a preference (DPO) recipe with an MoE model", lambda root, fx: [
        "train", TINY_DPO, "--output", root / "run", "--set", f'model.load="{_q3(fx)}"', "--set", 'model.spec=""'],
         check=not_trained("preference", "dense")),
    Case(R, "moe: aux_loss_type transformers with pp=2 on a loaded MoE",
         train_from(lambda root, fx: _q3(fx), 'moe.aux_loss_type="transformers"', "parallel.pp=2",
                    "train.global_batch_size=8"), check=not_trained("aux_loss_type")),
    # honest versions
    Case(R, "moe: parallel.ep=2 without parallel.dp picks dp=2 (--dry-run)", tiny_moe("parallel.ep=2"),
         check=printed("starting dp = 2", "dp2 x pp1 x cp1 x tp1"), expect_ok=True),
    Case(R, "moe: an expert-bias checkpoint with LoRA and router_bias_update_rate 0 (--dry-run)",
         train_from(sigmoid_ckpt, "lora.rank=4", "moe.router_bias_update_rate=0", tokenizer=_q3), expect_ok=True),

    # ---- Megatron checkpoints whose folders, args or run_config.yaml lie ----
    Case(M, "mlies: a stray extra EP folder mp_rank_00_002", convert_mc(_stray_ep("mp_rank_00_002", "mp_rank_00_001")),
         check=refused("mp_rank_00_002", "expert_model_parallel_size")),
    Case(M, "mlies: a missing EP folder mp_rank_00_001", convert_mc(_missing_ep("mp_rank_00_001")),
         check=refused("mp_rank_00_001")),
    Case(M, "mlies: a stray EP folder at tp2 pp2 ep2 (mp_rank_01_001_002)",
         convert_mc(_stray_ep("mp_rank_01_001_002", "mp_rank_01_001_001", ("--tp", "2", "--pp", "2", "--ep", "2"))),
         check=refused("mp_rank_01_001_002")),
    Case(M, "mlies: args expert_model_parallel_size 4 with 2 EP folders",
         convert_mc(args_lie(Q3, EP2, keep_hf=True, expert_model_parallel_size=4)), check=refused("mp_rank_00_002")),
    Case(M, "mlies: args expert_model_parallel_size 1 beside EP folders",
         convert_mc(args_lie(Q3, EP2, keep_hf=True, expert_model_parallel_size=1)), check=refused("mp_rank_00_001")),
    Case(M, "mlies: args num_experts 8 for 4 stored experts",
         convert_mc(args_lie(Q3, EP2, num_experts=8), "--verify"),
         check=refused("router.weight", "[4, 64]", "[8, 64]")),
    Case(M, "mlies: args moe_router_topk above num_experts", convert_mc(args_lie(Q3, (), moe_router_topk=6)),
         check=refused("moe_router_topk 6", "4 experts")),
    Case(M, "mlies: args moe_ffn_hidden_size 64 for experts of 32",
         convert_mc(args_lie(Q3, (), moe_ffn_hidden_size=64)), check=refused("linear_fc1", "moe_ffn_hidden_size")),
    Case(M, "mlies: args without num_experts (a dense model) while experts are stored",
         convert_mc(args_lie(Q3, (), num_experts=None, qlm_model_type=_DELETE), "--verify"),
         check=refused("local_experts", "num_moe_experts")),
    Case(M, "mlies: args moe_layer_freq a list of 3 for 4 layers",
         convert_mc(args_lie(Q3, (), moe_layer_freq=[1, 1, 1])),
         check=refused("moe_layer_freq")),
    Case(M, "mlies: args moe_layer_freq 2 while every layer holds experts",
         convert_mc(args_lie(Q3, (), moe_layer_freq=2)), check=refused("moe_layer_freq")),
    Case(M, "mlies: args deny the stored shared-expert gate (qwen2_moe)",
         convert_mc(args_lie(Q2, (), moe_shared_expert_gate=False)), check=refused("shared_experts", "gate")),
    Case(M, "mlies: args enable an expert bias under softmax routing",
         convert_mc(args_lie(Q3, (), moe_router_enable_expert_bias=True)),
         check=refused("moe_router_enable_expert_bias")),
    Case(M, "mlies: args sigmoid + expert bias but no expert_bias stored",
         convert_mc(args_lie(Q3, (), moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)),
         check=refused("expert_bias")),
    Case(M, "mlies: args add_qkv_bias False while a qkv bias is stored (no hf/)",
         convert_mc(stored_lie(Q3, EP2, _qkv_bias, keep_hf=False), "--verify"),
         check=refused("linear_qkv.bias", "add_qkv_bias")),
    Case(M, "mlies: hf/config.json denies a stored qkv bias (mcore2hf --verify)",
         convert_mc(stored_lie(Q3, (), _qkv_bias), "--verify"), check=refused("linear_qkv.bias", "hf/config.json")),
    Case(M, "mlies: an output_layer.weight added to a tied MoE model", convert_mc(_tied_moe_with_output, "--verify"),
         check=refused("output_layer.weight", "share_embeddings_and_output_weights")),
    Case(M, "mlies: a third local expert in an EP2 rank file", convert_mc(stored_lie(Q3, EP2, _third_local_expert)),
         check=refused("local_experts.2")),
    Case(M, "mlies: a router expert_bias stored in a softmax model", convert_mc(stored_lie(Q3, (), _expert_bias)),
         check=refused("expert_bias")),
    Case(M, "mlies: torch_dist with an extra tensor key (a qkv bias)", convert_mc(_torch_dist_extra_key, "--verify"),
         check=refused("linear_qkv.bias")),
    Case(M, "mlies: torch_dist args num_experts 8 for 4 stored", convert_mc(_torch_dist_args(num_experts=8)),
         check=refused("router", "8")),
    Case(M, "mlies: torch_dist Bridge run_config add_qkv_bias false while the bias is stored (qwen2_moe)",
         convert_mc(bridge(Q2, ("--format", "torch_dist"), add_qkv_bias=False), "--verify"),
         check=refused("linear_qkv.bias", "run_config.yaml")),
    Case(M, "mlies: Bridge run_config add_qkv_bias false while the bias is stored (legacy tp2)",
         convert_mc(bridge(Q2, ("--tp", "2"), add_qkv_bias=False), "--verify"),
         check=refused("linear_qkv.bias", "run_config.yaml", "add_qkv_bias")),
    Case(M, "mlies: Bridge share_embeddings_and_output_weights true while output_layer.weight is stored",
         convert_mc(bridge(Q3, share_embeddings_and_output_weights=True), "--verify"),
         check=refused("output_layer.weight", "run_config.yaml", "share_embeddings_and_output_weights")),
    Case(M, "mlies: Bridge moe_router_topk above num_moe_experts",
         convert_mc(bridge(Q3, moe_router_topk=6), "--verify"),
         check=refused("moe_router_topk 6", "run_config.yaml")),
    Case(M, "mlies: Bridge malformed YAML", convert_mc(bridge(Q3, text="model:\n  num_layers: [4\n  hidden: {\n")),
         check=refused("run_config.yaml", "YAML")),
    Case(M, "mlies: Bridge model: a list", convert_mc(bridge(Q3, text="model:\n  - 1\n  - 2\n")),
         check=refused("run_config.yaml", "model:")),
    Case(M, "mlies: Bridge run_config.yaml not UTF-8", _not_utf8_bridge, check=refused("run_config.yaml")),
    Case(M, "mlies: Bridge num_layers 3 for 4 stored layers", convert_mc(bridge(Q3, num_layers=3), "--verify"),
         check=refused("num_layers", "3")),
    Case(M, "mlies: Bridge hidden_size a string", convert_mc(bridge(Q3, hidden_size="64")),
         check=refused("hidden_size", "'64'")),
    Case(M, "mlies: Bridge num_moe_experts 8 for 4 stored", convert_mc(bridge(Q3, num_moe_experts=8), "--verify"),
         check=refused("router.weight", "run_config.yaml")),
    Case(M, "mlies: Bridge without num_moe_experts while experts are stored",
         convert_mc(bridge(Q3, num_moe_experts=_DELETE), "--verify"),
         check=refused("num_moe_experts", "run_config.yaml")),
    Case(M, "mlies: Bridge moe_ffn_hidden_size 64 for experts of 32",
         convert_mc(bridge(Q3, moe_ffn_hidden_size=64), "--verify"), check=refused("linear_fc1", "run_config.yaml")),
    Case(M, "mlies: Bridge qk_layernorm false while q/k norms are stored",
         convert_mc(bridge(Q3, qk_layernorm=False), "--verify"), check=refused("qk_layernorm", "run_config.yaml")),
    Case(M, "mlies: Bridge vocab_size 400 above the 384 embedding rows",
         convert_mc(bridge(Q3, vocab_size=400), "--verify"), check=refused("vocab_size", "400")),
    Case(M, "mlies: Bridge rotary_base nan", convert_mc(bridge(Q3, rotary_base=float("nan"))),
         check=refused("rotary_base", "run_config.yaml")),
    Case(M, "mlies: Bridge moe_router_score_function 'banana'",
         convert_mc(bridge(Q3, moe_router_score_function="banana")), check=refused("banana")),
    Case(M, "mlies: Bridge tensor_model_parallel_size 4 with TP1 folders",
         convert_mc(bridge(Q3, tensor_model_parallel_size=4)), check=refused("TP 4")),
    Case(M, "mlies: Bridge checkpoint (tp2 pp2 ep2) with a stray EP folder mp_rank_01_001_002",
         convert_mc(_bridge_stray_ep, "--verify"), check=refused("mp_rank_01_001_002")),
    Case(M, "mlies: mcore2hf of a sigmoid-routed checkpoint (no HF form)", convert_mc(sigmoid_ckpt),
         check=refused("sigmoid")),
    # the same lies reached through train and generate
    Case(M, "mlies: train model.load on a Bridge checkpoint denying its qkv bias (a real start)",
         train_from(bridge(Q2, ("--tp", "2"), add_qkv_bias=False), dry_run=False, tokenizer=lambda fx: hf_moe(fx, Q2)),
         check=not_trained("linear_qkv.bias", "run_config.yaml")),
    Case(M, "mlies: train --dry-run model.load on a checkpoint with a stray EP folder",
         train_from(_stray_ep("mp_rank_00_002", "mp_rank_00_001")), check=not_trained("mp_rank_00_002")),
    Case(M, "mlies: train model.load on a Bridge topk above the experts (a real start)",
         train_from(bridge(Q3, moe_router_topk=6), dry_run=False, tokenizer=_q3),
         check=not_trained("moe_router_topk 6")),
    Case(M, "mlies: generate on a Bridge checkpoint whose num_moe_experts lies",
         generate_tok(bridge(Q3, num_moe_experts=8)), check=says("router.weight")),
    Case(M, "mlies: generate on a legacy checkpoint whose args deny its qkv bias",
         generate_tok(stored_lie(Q3, EP2, _qkv_bias, keep_hf=False)),
         check=says("linear_qkv.bias", "add_qkv_bias")),
    # honest versions
    Case(M, "mlies: an honest Bridge MoE checkpoint converts with --verify", convert_mc(bridge(Q3), "--verify"),
         check=converted("bit-exact"), expect_ok=True),
    Case(M, "mlies: an honest Bridge MoE checkpoint saved at EP2 (run_config says ep 2) converts",
         convert_mc(bridge(Q3, EP2, expert_model_parallel_size=2, expert_tensor_parallel_size=1), "--verify"),
         check=converted("bit-exact"), expect_ok=True),
    Case(M, "mlies: an honest Bridge MoE checkpoint saved at tp2 pp2 ep2 converts",
         convert_mc(bridge(Q3, BRIDGE_3D, **BRIDGE_3D_MODEL), "--verify"), check=converted("bit-exact"),
         expect_ok=True),
    Case(M, "mlies: an honest torch_dist Bridge MoE checkpoint converts",
         convert_mc(bridge(Q3, ("--format", "torch_dist")), "--verify"), check=converted("bit-exact"), expect_ok=True),
]

