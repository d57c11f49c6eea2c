"""Megatron-Bridge's run_config.yaml: the architecture of a checkpoint that stores no Megatron-LM `args`.

Megatron-Bridge saves its whole ConfigContainer as YAML (run_config.yaml) in every iteration directory; its
`model:` section is the model provider, i.e. megatron-core's TransformerConfig fields (num_layers, hidden_size,
ffn_hidden_size, num_attention_heads, num_query_groups, kv_channels, layernorm_epsilon, normalization,
gated_linear_unit, activation_func, add_bias_linear, add_qkv_bias) plus the GPT provider's
(share_embeddings_and_output_weights, vocab_size, make_vocab_size_divisible_by, seq_length, rotary_base,
position_embedding_type, rotary_percent, ...), and for MoE models TransformerConfig's num_moe_experts,
moe_router_topk, moe_ffn_hidden_size, moe_shared_expert_intermediate_size, moe_shared_expert_gate,
moe_router_pre_softmax, moe_router_score_function, moe_router_enable_expert_bias, moe_router_num_groups,
moe_router_group_topk, moe_router_topk_scaling_factor, moe_layer_freq and qk_layernorm; DeepSeek-V3-class
providers add MLATransformerConfig's multi_latent_attention, q_lora_rank, kv_lora_rank, qk_head_dim,
qk_pos_emb_head_dim, v_head_dim and its yarn fields (rope_type, rotary_scaling_factor, original_max_position_embeddings,
beta_fast, beta_slow, mscale, mscale_all_dim), and mtp_num_layers; gpt-oss's provider position_embedding_type
"yarn" with its yarn_* fields, quick_gelu with glu_linear_offset and activation_func_clamp_value, softmax_type.
They are turned into the Megatron-LM-style args Namespace the rest of qlm reads (megatron_args.spec_from_args);
fields left out take TransformerConfig's (and MLATransformerConfig's) defaults.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from qlm_core.errors import QlmError
from qlm_core.models.activations import MEGATRON_SWITCHES

RUN_CONFIG_FILE = "run_config.yaml"
_REQUIRED = ("num_layers", "hidden_size", "num_attention_heads")


def find_run_config(root: Path, iteration_dir: Path) -> Path | None:
    """run_config.yaml in the iteration directory, the checkpoint root or the directory above it."""
    for directory in dict.fromkeys((Path(iteration_dir), Path(root), Path(root).parent)):
        if (directory / RUN_CONFIG_FILE).is_file():
            return directory / RUN_CONFIG_FILE
    return None


def _load_yaml(path: Path):
    try:
        import yaml
    except ImportError:
        raise QlmError(f"reading {path} needs PyYAML", "pip install pyyaml (transformers normally brings it)") from None
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise QlmError(f"cannot read {path} ({type(exc).__name__})", "restore the run's run_config.yaml") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        line = f" at line {where.line + 1}" if where is not None else ""
        raise QlmError(f"{path} is not valid YAML{line}",
                       "restore the run's run_config.yaml or pass --config") from None


def _target_text(value) -> str:
    """A serialized callable/class: `{_target_: torch.nn.functional.silu, ...}` or a plain string."""
    if isinstance(value, dict):
        value = value.get("_target_", "")
    return str(value or "")


def bridge_args(path: str | Path) -> argparse.Namespace:
    """Megatron-LM-style args from run_config.yaml's `model:` section."""
    path = Path(path)
    data = _load_yaml(path)
    model = data.get("model") if isinstance(data, dict) else None
    if not isinstance(model, dict):
        raise QlmError(f"{path} has no `model:` section", "point at a Megatron-Bridge run_config.yaml or pass --config")

    def integer(key: str, default=None, required: bool = False):
        value = model.get(key, default)
        if value is None:
            if required:
                raise QlmError(f"{path} lacks model.{key}", "restore the run's run_config.yaml or pass --config")
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise QlmError(f"{path}: model.{key} is {value!r}, not a positive integer",
                           "restore the run's run_config.yaml or pass --config")
        return value

    def number(key: str, default: float) -> float:
        value = model.get(key, default)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise QlmError(f"{path}: model.{key} is {value!r}, not a finite number",
                           "restore the run's run_config.yaml or pass --config")
        return float(value)

    def flag(key: str, default: bool) -> bool:
        value = model.get(key, default)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise QlmError(f"{path}: model.{key} is {value!r}, not true/false",
                           "restore the run's run_config.yaml or pass --config")
        return value

    for key in _REQUIRED:
        integer(key, required=True)
    heads, hidden = model["num_attention_heads"], model["hidden_size"]
    groups = integer("num_query_groups") or heads
    position = str(model.get("position_embedding_type", "learned_absolute"))
    if position not in ("rope", "yarn"):
        raise QlmError(f"{path}: the model uses {position} position embeddings", "qlm converts RoPE models only")
    yarn = {}
    if position == "yarn":  # YaRN on grouped-query attention (gpt-oss's provider), as Megatron-LM's args name it
        yarn = dict(rotary_scaling_factor=number("yarn_rotary_scaling_factor", 32.0),
                    yarn_original_max_position_embeddings=integer("yarn_original_max_position_embeddings", 4096),
                    yarn_beta_fast=number("yarn_beta_fast", 32.0), yarn_beta_slow=number("yarn_beta_slow", 1.0),
                    mscale=number("yarn_mscale", 1.0), mscale_all_dim=number("yarn_mscale_all_dim", 0.0),
                    yarn_correction_range_round_to_int=flag("yarn_correction_range_round_to_int", True))
    if model.get("seq_len_interpolation_factor") not in (None, 1, 1.0):
        raise QlmError(f"{path}: the model uses interpolated RoPE (seq_len_interpolation_factor)",
                       "qlm converts RoPE without position interpolation")
    activation = _target_text(model.get("activation_func"))
    gated = flag("gated_linear_unit", False)
    seq_length = integer("seq_length", 1024)
    target = _target_text(model.get("_target_")).lower()
    scale = model.get("scale_factor") if isinstance(model.get("scale_factor"), (int, float)) else None
    rope_scaling = None
    if scale is not None or flag("use_rope_scaling", False):
        rope_scaling = {
            "factor": float(scale if scale is not None else number("rope_scaling_factor", 8.0)),
            "low_freq_factor": number("low_freq_factor", 1.0),
            "high_freq_factor": number("high_freq_factor", 4.0),
            "original_max_position_embeddings": integer("old_context_len", 8192),
        }
    window = model.get("window_size")
    freq = model.get("moe_layer_freq", 1)
    if not (isinstance(freq, int) and not isinstance(freq, bool) and freq >= 1) and not (
            isinstance(freq, list) and all(v in (0, 1) for v in freq)):
        raise QlmError(f"{path}: model.moe_layer_freq is {freq!r}, not a positive integer or a 0/1 list",
                       "restore the run's run_config.yaml or pass --config")
    scaling_factor = model.get("moe_router_topk_scaling_factor")
    mla = {}
    if flag("multi_latent_attention", False):  # MLATransformerConfig's fields and defaults
        mla = dict(multi_latent_attention=True, q_lora_rank=integer("q_lora_rank", 512),  # null: no low rank
                   kv_lora_rank=integer("kv_lora_rank", 512), qk_head_dim=integer("qk_head_dim", 128),
                   qk_pos_emb_head_dim=integer("qk_pos_emb_head_dim", 64), v_head_dim=integer("v_head_dim", 128),
                   rope_type=str(model.get("rope_type") or "yarn"),
                   rotary_scaling_factor=number("rotary_scaling_factor", 40.0),
                   original_max_position_embeddings=integer("original_max_position_embeddings", 4096),
                   beta_fast=number("beta_fast", 32.0), beta_slow=number("beta_slow", 1.0),
                   mscale=number("mscale", 1.0), mscale_all_dim=number("mscale_all_dim", 0.0))
    return argparse.Namespace(
        **mla,
        **yarn,
        mtp_num_layers=integer("mtp_num_layers"),
        rotary_percent=number("rotary_percent", 1.0),
        moe_router_num_groups=integer("moe_router_num_groups"),
        moe_router_group_topk=integer("moe_router_group_topk"),
        qk_layernorm=flag("qk_layernorm", False),
        num_experts=integer("num_moe_experts"),
        moe_router_topk=integer("moe_router_topk", 2),
        moe_ffn_hidden_size=integer("moe_ffn_hidden_size"),
        moe_shared_expert_intermediate_size=integer("moe_shared_expert_intermediate_size"),
        moe_shared_expert_gate=flag("moe_shared_expert_gate", False),
        moe_router_pre_softmax=flag("moe_router_pre_softmax", False),
        moe_router_score_function=str(model.get("moe_router_score_function") or "softmax"),
        moe_router_enable_expert_bias=flag("moe_router_enable_expert_bias", False),
        moe_router_topk_scaling_factor=scaling_factor if isinstance(scaling_factor, (int, float)) else None,
        moe_layer_freq=freq,
        num_layers=model["num_layers"],
        hidden_size=hidden,
        ffn_hidden_size=integer("ffn_hidden_size") or 4 * hidden,
        num_attention_heads=heads,
        num_query_groups=groups,
        group_query_attention=groups != heads,
        kv_channels=integer("kv_channels") or hidden // heads,
        seq_length=seq_length,
        max_position_embeddings=integer("max_position_embeddings") or seq_length,
        position_embedding_type=position,
        rotary_base=number("rotary_base", 10000.0),
        use_rope_scaling=rope_scaling is not None,
        rope_scaling_factor=rope_scaling["factor"] if rope_scaling else 8.0,
        qlm_rope_scaling=rope_scaling,
        **_activation_flags(gated, activation, path),
        glu_linear_offset=number("glu_linear_offset", 0.0),
        activation_func_clamp_value=model.get("activation_func_clamp_value"),
        normalization=str(model.get("normalization", "LayerNorm")),
        norm_epsilon=number("layernorm_epsilon", 1e-5),
        add_bias_linear=flag("add_bias_linear", True),
        add_qkv_bias=flag("add_qkv_bias", False),
        untie_embeddings_and_output_weights=not flag("share_embeddings_and_output_weights", True),
        vocab_size=integer("vocab_size"),
        make_vocab_size_divisible_by=integer("make_vocab_size_divisible_by", 128),
        tensor_model_parallel_size=integer("tensor_model_parallel_size", 1),
        pipeline_model_parallel_size=integer("pipeline_model_parallel_size", 1),
        expert_model_parallel_size=integer("expert_model_parallel_size", 1),
        expert_tensor_parallel_size=integer("expert_tensor_parallel_size"),
        window_size=tuple(window) if isinstance(window, (list, tuple)) and len(window) == 2 else None,
        window_attn_skip_freq=model.get("window_attn_skip_freq"),
        softmax_type=str(model.get("softmax_type") or "vanilla"),  # "learnable": attention sinks
        bf16=flag("bf16", False),
        fp16=flag("fp16", False),
        qlm_model_type="mistral" if "mistral" in target else "mixtral" if "mixtral" in target else None,
        qlm_args_from=str(path),
    )


def _activation_flags(gated: bool, activation: str | None, path) -> dict:
    """Megatron-LM's activation flags (and qlm's) of the provider's gated_linear_unit and activation_func: SwiGLU
    (gated silu, the default when gated), gpt-oss's gated quick GELU, GeGLU (gated tanh GELU), ReLU, or Megatron's
    default GELU; others refused."""
    name = (activation or ("silu" if gated else "gelu")).lower()
    flags = dict.fromkeys(MEGATRON_SWITCHES, False)
    if gated and "quick_gelu" in name:  # gpt-oss's, with glu_linear_offset and activation_func_clamp_value
        flags["quick_geglu"] = True
    elif gated and "silu" in name:
        flags["swiglu"] = True
    elif gated and "gelu" in name and ("tanh" in name or "fast" in name or "openai" in name):
        flags["qlm_geglu"] = True
    elif not gated and "squared_relu" in name:
        flags["squared_relu"] = True
    elif not gated and name.rsplit(".", 1)[-1] == "relu":
        flags["qlm_relu"] = True
    elif gated or "gelu" not in name or "tanh" in name or "fast" in name or "openai" in name:
        raise QlmError(f"{path}: activation_func {activation or '(none)'} with gated_linear_unit {gated} is not an "
                       "MLP qlm builds", "qlm builds SwiGLU, GeGLU (tanh GELU), ReLU and GELU MLPs")
    return flags
