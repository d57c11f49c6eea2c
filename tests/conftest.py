"""Shared fixtures: tiny random HF models built with transformers (nothing is downloaded)."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# Wide, fixed terminal for every console created by the CLI (rich reads COLUMNS when a Console is made).
os.environ["COLUMNS"] = "200"
os.environ["TERMINAL_WIDTH"] = "200"
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TINY = dict(
    vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256,
)
LLAMA3_ROPE = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
MODEL_KINDS = {
    "qwen2": ("qwen2", dict(tie_word_embeddings=False)),
    "qwen2_tied": ("qwen2", dict(tie_word_embeddings=True)),
    "llama3": ("llama", dict(rope_scaling=LLAMA3_ROPE, rope_theta=500000.0)),
    "mistral": ("mistral", dict(sliding_window=8)),
    # Qwen2 with use_sliding_window: layers 0-1 attend to every key, 2-3 within 8 (max_window_layers 2)
    "qwen2_swa": ("qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=2,
                                tie_word_embeddings=False)),
    # GLM-4-9B and GLM-4-0414: q/k/v biases, half of each head rotated in interleaved pairs, gate_up_proj; glm4's
    # norms after attention and MLP
    "glm": ("glm", dict(head_dim=16, attention_bias=True, partial_rotary_factor=0.5, tie_word_embeddings=False,
                        pad_token_id=0, eos_token_id=1)),
    "glm4": ("glm4", dict(head_dim=16, attention_bias=True, partial_rotary_factor=0.5, tie_word_embeddings=False,
                          pad_token_id=0, eos_token_id=1)),
    # ERNIE 4.5 (0.3B's layout): the whole head rotated in interleaved pairs, tied embeddings
    "ernie4_5": ("ernie4_5", dict(head_dim=16, tie_word_embeddings=True)),
    # OPT / Galactica: LayerNorms with biases, biases on every linear, a ReLU MLP, learned positions offset by 2
    "opt": ("opt", dict(ffn_dim=96, word_embed_proj_dim=64, pad_token_id=1, bos_token_id=2, eos_token_id=2)),
    # ... with a GELU MLP and no biases on its linears (enable_bias false; its LayerNorms keep theirs)
    "opt_gelu": ("opt", dict(ffn_dim=96, word_embed_proj_dim=64, activation_function="gelu", enable_bias=False,
                             pad_token_id=1, bos_token_id=2, eos_token_id=2)),
    # BLOOM: ALiBi over 12 heads (slopes of a head count that is not a power of two), LayerNorms with biases (one
    # after the embedding), biases on every linear, q/k/v fused head by head, a tanh-GELU MLP of 4 h, tied
    "bloom": ("bloom", dict(hidden_size=96, num_attention_heads=12)),
    # MPT: ALiBi over 4 heads, LayerNorms without biases, no linear biases, Wqkv as [q; k; v], an exact-GELU MLP of 4 h
    "mpt": ("mpt", dict(d_model=64, n_heads=4, n_layers=4, max_seq_len=256)),
    # Gemma 2: windowed (8) and global layers in turn, attention scores soft-capped at 0.02 and logits at 3 (caps
    # that bind on a tiny random model, whose scores are ~0.01: without them its logits move by ~1e-2), a
    # query_pre_attn_scalar other than head_dim, GeGLU, (1 + w) norms, tied
    "gemma2": ("gemma2", dict(head_dim=16, sliding_window=8, query_pre_attn_scalar=24, pad_token_id=0, eos_token_id=1,
                              bos_token_id=2, attn_logit_softcapping=0.02, final_logit_softcapping=3.0)),
    # Gemma 3 (text): windowed layers 0-2 (window 8, RoPE base 10000), a global layer 3 (base 1e6, linear x8), a
    # query_pre_attn_scalar other than head_dim, GeGLU, (1 + w) norms, four a layer, tied embeddings
    "gemma3": ("gemma3_text", dict(head_dim=16, sliding_window=8, query_pre_attn_scalar=24, pad_token_id=0,
                                   layer_types=["sliding_attention"] * 3 + ["full_attention"],
                                   eos_token_id=1, bos_token_id=2, rope_parameters={
                                       "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                       "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
}
GPT_OSS_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32.0,
                "beta_slow": 1.0, "truncate": False, "rope_theta": 150000.0}
# Qwen3 (q/k norms, head_dim 24 independent of hidden / heads) and the MoE models: 4 experts, top 2; Qwen2-MoE with
# a gated shared expert, pre-softmax routing and a dense layer among its MoE layers; expert sizes multiples of 8
QWEN3_MOE_KINDS = {
    "qwen3": ("qwen3", dict(head_dim=24, tie_word_embeddings=False)),
    "qwen2_moe": ("qwen2_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                    shared_expert_intermediate_size=48, norm_topk_prob=False, mlp_only_layers=[2])),
    "qwen3_moe": ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                    norm_topk_prob=True, head_dim=24)),
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32)),
    # ERNIE 4.5 MoE: softmax routing whose correction bias (randomised here) chooses, a shared expert, a dense
    # first layer, RoPE in interleaved pairs, tied embeddings
    "ernie4_5_moe": ("ernie4_5_moe", dict(moe_num_experts=4, moe_k=2, moe_intermediate_size=32,
                                          moe_num_shared_experts=1, moe_layer_start_index=1, head_dim=16)),
    # gpt-oss: q/k/v/o biases, sinks, windowed (8) and full layers alternating, yarn RoPE without truncation, a
    # router and experts with biases, the clamped SwiGLU (make_hf_model scales the experts' gate_up_proj so that its
    # clamps bind)
    "gpt_oss": ("gpt_oss", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, head_dim=16,
                                sliding_window=8, tie_word_embeddings=False, rope_parameters=GPT_OSS_YARN)),
}
_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
         "mscale": 1.0, "mscale_all_dim": 0.8, "rope_theta": 10000.0}
_V3 = dict(num_key_value_heads=4, moe_intermediate_size=32, n_shared_experts=1, kv_lora_rank=16, qk_nope_head_dim=8,
           qk_rope_head_dim=4, v_head_dim=8, tie_word_embeddings=False)  # values narrower than keys
# GLM-4.5: grouped-query attention with half its head rotated, q/k/v biases and q/k norms, DeepSeek-V3's router (8
# experts in 2 groups, 1 kept), a shared expert and a dense first layer
GLM4_MOE = ("glm4_moe", dict(num_key_value_heads=2, head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
                             moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1, n_group=2,
                             topk_group=1, routed_scaling_factor=2.5, attention_bias=True, use_qk_norm=True,
                             partial_rotary_factor=0.5, tie_word_embeddings=False))
# DeepSeek-V3-class models (multi-latent attention, sigmoid group-limited routing with a correction bias, shared and
# dense first layers): "deepseek_v3" with q's low rank, yarn and interleaved rotary rows; "deepseek_v3_lite" without
# q's low rank (V2-Lite's attention), rotary rows in halves and no groups
MLA_KINDS = {
    # 16 experts in 4 groups, 2 groups kept, top 4 (so a group's score is its top-2 sum in Megatron-Core too)
    "deepseek_v3": ("deepseek_v3", dict(_V3, n_routed_experts=16, num_experts_per_tok=4, q_lora_rank=24, n_group=4,
                                        topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5,
                                        rope_parameters=_YARN, rope_interleave=True)),
    "deepseek_v3_lite": ("deepseek_v3", dict(_V3, n_routed_experts=8, num_experts_per_tok=2, q_lora_rank=None,
                                             n_group=1, topk_group=1, first_k_dense_replace=2,
                                             routed_scaling_factor=1.0, rope_interleave=False)),
    # DeepSeek-V2-Lite: no q low rank, yarn, softmax over every expert (no renormalisation, no correction bias),
    # scaled, a shared expert and a dense first layer
    "deepseek_v2_lite": ("deepseek_v2", dict(_V3, n_routed_experts=8, num_experts_per_tok=2, q_lora_rank=None,
                                             first_k_dense_replace=1, routed_scaling_factor=1.5,
                                             rope_parameters=_YARN)),
    # GLM-4.7-Flash: the same layer, dense and MoE layers listed (here dense, MoE, dense, MoE)
    "glm4_moe_lite": ("glm4_moe_lite", dict(_V3, n_routed_experts=8, num_experts_per_tok=2, q_lora_rank=24,
                                            mlp_layer_types=["dense", "sparse", "dense", "sparse"],
                                            routed_scaling_factor=1.8)),
}


def make_tokenizer(path: Path, vocab_size: int = 280):
    """A small byte-level BPE trained on a few sentences, saved as an HF fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(path)


def make_hf_model(path: Path, kind: str, dtype=torch.float32, seed: int = 0, **overrides):
    """Save a tiny random HF model of `kind` (see MODEL_KINDS) with a tokenizer; returns the model (eval)."""
    import transformers

    model_type, extra = {**MODEL_KINDS, **QWEN3_MOE_KINDS, **MLA_KINDS, "glm4_moe": GLM4_MOE}[kind]
    config = transformers.AutoConfig.for_model(model_type, **{**TINY, **extra, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # HF zero-inits biases; give them values so a misplaced bias shows
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
            if name.endswith(("mlp.gate.weight", "mlp.router.weight")):  # MoE routers: distinct logits, no ties
                param.copy_(torch.randn_like(param))
            if name.endswith("self_attn.sinks"):  # gpt-oss's sinks: a share of each softmax worth seeing
                param.copy_(torch.randn_like(param))
            if model_type == "gpt_oss" and name.endswith("experts.gate_up_proj"):  # past the SwiGLU's clamp of 7
                param.mul_(100)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek's routers: a bias that changes the choice
                buffer.copy_(torch.randn_like(buffer) * 0.1)
    model.to(dtype).save_pretrained(path)
    make_tokenizer(path)
    return model


def add_mtp_layers(path: Path, depths: int = 1, seed: int = 1) -> None:
    """Give a saved tiny DeepSeek-V3-class model `depths` multi-token prediction layers, as DeepSeek-V3's release
    holds them (transformers saves none): decoder layers num_layers + k, each with enorm, hnorm, eh_proj,
    shared_head.norm and copies of the embedding (embed_tokens) and output layer (shared_head.head)."""
    import json

    import transformers
    from safetensors.torch import load_file, save_file

    config = json.loads((path / "config.json").read_text())
    layers, hidden = config["num_hidden_layers"], config["hidden_size"]
    extra = {"num_hidden_layers": layers + depths}
    if config.get("mlp_layer_types"):  # GLM-4.7-Flash lists each layer's kind: the extra ones are the last's
        extra["mlp_layer_types"] = config["mlp_layer_types"] + config["mlp_layer_types"][-1:] * depths
    longer = transformers.AutoConfig.from_pretrained(path, **extra)
    torch.manual_seed(seed)
    donor = transformers.AutoModelForCausalLM.from_config(longer).state_dict()
    tensors = load_file(path / "model.safetensors")
    generator = torch.Generator().manual_seed(seed)
    for layer in range(layers, layers + depths):
        prefix = f"model.layers.{layer}."
        for name, value in donor.items():
            if not name.startswith(prefix):
                continue
            if name.endswith("experts.gate_up_proj"):  # transformers' fused experts, per expert as released
                ffn = value.shape[1] // 2
                for e, rows in enumerate(value):
                    tensors[f"{name[:-len('gate_up_proj')]}{e}.gate_proj.weight"] = rows[:ffn].clone()
                    tensors[f"{name[:-len('gate_up_proj')]}{e}.up_proj.weight"] = rows[ffn:].clone()
            elif name.endswith("experts.down_proj"):
                for e, matrix in enumerate(value):
                    tensors[f"{name[:-len('down_proj')]}{e}.down_proj.weight"] = matrix.clone()
            else:
                tensors[name] = value.clone().contiguous()
        for norm in ("enorm", "hnorm", "shared_head.norm"):
            tensors[f"{prefix}{norm}.weight"] = 1 + 0.1 * torch.randn(hidden, generator=generator)
        tensors[f"{prefix}eh_proj.weight"] = 0.05 * torch.randn(hidden, 2 * hidden, generator=generator)
        tensors[f"{prefix}embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
        tensors[f"{prefix}shared_head.head.weight"] = tensors["lm_head.weight"].clone()
        bias = f"{prefix}mlp.gate.e_score_correction_bias"
        if bias in tensors:  # a correction bias that changes the choice, as make_hf_model gives the decoder's
            tensors[bias] = 0.1 * torch.randn(tensors[bias].shape, generator=generator)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config["num_nextn_predict_layers"] = depths
    (path / "config.json").write_text(json.dumps(config, indent=2))


def make_chat_hf_model(path: Path, demo_dir: Path, chat_template: str | None = None, kind: str = "qwen2") -> Path:
    """A tiny random model of `kind` (a Qwen2) with qlm's demo tokenizer (vocabulary 512, chatml; eos <|im_end|>,
    pad <|endoftext|>), optionally another chat template; returns the demo's paths (its data sets go with the
    tokenizer)."""
    from transformers import AutoTokenizer

    from qlm_core.data.demo import build_demo

    demo = build_demo(demo_dir, seed=0, num_train=30, num_eval=3, corpus_paragraphs=5, preference_pairs=64)
    make_hf_model(path, kind, vocab_size=512)
    tokenizer = AutoTokenizer.from_pretrained(demo.tokenizer)  # replaces make_hf_model's tiny one
    tokenizer.eos_token, tokenizer.pad_token = "<|im_end|>", "<|endoftext|>"
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(path)
    return demo


TESTS_DIR = Path(__file__).resolve().parent


def worker_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """os.environ for a torchrun child: OMP_NUM_THREADS=1, tests/ first on PYTHONPATH (the children do not read the
    pytest config's `pythonpath`, and the workers import `workers.harness`, `parallel_cases`), then `env`."""
    python_path = os.pathsep.join(filter(None, [str(TESTS_DIR), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": python_path, **(env or {})}


_RUNNING: dict[str, pytest.Item] = {}  # the test being set up or run


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    _RUNNING["item"] = item  # before its fixtures: a module fixture that launches torchrun sees its first test


def launch_torchrun(worker: Path, nproc: int, *args, timeout: float = 600,
                    env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run `worker` on `nproc` local ranks (torchrun --standalone, in worker_env(env)); output captured as text. The
    caller checks the return code and reads what the worker wrote. The test that launches must be marked
    `distributed` (the fast tier, -m "not distributed and not slow", leaves those out)."""
    item = _RUNNING.get("item")
    assert item is None or item.get_closest_marker("distributed"), f"{item.nodeid} launches torchrun: mark it"
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), str(worker),
         *map(str, args)],
        check=False, capture_output=True, text=True, timeout=timeout, env=worker_env(env),
    )


def run_worker_jobs(worker_name: str, nproc: int, out: Path, timeout: float = 600) -> tuple[Path, int, str]:
    """Launch tests/workers/WORKER_NAME (a harness.run_jobs worker) into `out`: (out, exit code, the tracebacks the
    failing jobs left, else the tail of stderr)."""
    proc = launch_torchrun(TESTS_DIR / "workers" / worker_name, nproc, out, timeout=timeout)
    errors = "\n".join(p.read_text() for p in out.glob("*.error"))
    return out, proc.returncode, errors or proc.stderr[-3000:]


@pytest.fixture(scope="session")
def moe_models(tmp_path_factory) -> dict[str, Path]:
    """One saved tiny model per QWEN3_MOE_KINDS entry (fp32)."""
    root = tmp_path_factory.mktemp("hf_moe")
    for kind in QWEN3_MOE_KINDS:
        make_hf_model(root / kind, kind)
    return {kind: root / kind for kind in QWEN3_MOE_KINDS}


@pytest.fixture(scope="session")
def mla_models(tmp_path_factory) -> dict[str, Path]:
    """One saved tiny model per MLA_KINDS entry (fp32)."""
    root = tmp_path_factory.mktemp("hf_mla")
    for kind in MLA_KINDS:
        make_hf_model(root / kind, kind)
    return {kind: root / kind for kind in MLA_KINDS}


# the DeepSeek-V3 class with multi-token prediction layers (add_mtp_layers): kind -> (MLA_KINDS / GLM4_MOE kind, depths)
MTP_KINDS = {"deepseek_v3": ("deepseek_v3", 2), "deepseek_v3_lite": ("deepseek_v3_lite", 1),
             "glm4_moe_lite": ("glm4_moe_lite", 1), "glm4_moe": ("glm4_moe", 1)}


@pytest.fixture(scope="session")
def mtp_models(tmp_path_factory) -> dict[str, Path]:
    """One saved tiny model per MTP_KINDS entry (fp32), its multi-token prediction layers as DeepSeek releases
    them."""
    root = tmp_path_factory.mktemp("hf_mtp")
    for name, (kind, depths) in MTP_KINDS.items():
        make_hf_model(root / name, kind)
        add_mtp_layers(root / name, depths)
    return {name: root / name for name in MTP_KINDS}


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory) -> dict[str, Path]:
    """One saved tiny model per MODEL_KINDS entry (fp32)."""
    root = tmp_path_factory.mktemp("hf")
    paths = {}
    for kind in MODEL_KINDS:
        make_hf_model(root / kind, kind)
        paths[kind] = root / kind
    return paths


def call_qlm(*args) -> tuple[int, str, str]:
    """The `qlm` console entry point in this process: (exit code, stdout, stderr); argv and COLUMNS restored."""
    from qlm_cli.main import main

    out, err = io.StringIO(), io.StringIO()
    saved_argv, saved_columns = sys.argv, os.environ.get("COLUMNS")
    sys.argv, os.environ["COLUMNS"] = ["qlm", *map(str, args)], "200"
    code = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            main()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        sys.argv = saved_argv
        if saved_columns is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = saved_columns
    return code, out.getvalue(), err.getvalue()


@pytest.fixture
def run_qlm():
    """call_qlm as a fixture."""
    return call_qlm


def load_safetensors_dir(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors
