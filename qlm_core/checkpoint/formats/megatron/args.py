"""The `args` Namespace Megatron-LM stores in every checkpoint, to and from a ModelSpec + ModelLayout.

Only primitives (and torch dtypes) go in, so Megatron reads it with torch.load(weights_only=True).
"""

from __future__ import annotations

import argparse

import torch

from qlm_core.errors import QlmError
from qlm_core.models.activations import ACTIVATION_KINDS, MEGATRON_DEFAULT_VALUES, activation_kind
from qlm_core.models.families import FAMILIES
from qlm_core.models.layout import ModelLayout
from qlm_core.models.mla_spec import MlaSpec
from qlm_core.models.moe_spec import MoeSpec
from qlm_core.models.norms import NORM_KINDS, norm_kind
from qlm_core.models.positions import POSITION_KINDS, position_kind
from qlm_core.models.spec import SUPPORTED_MODEL_TYPES, LinearRopeScaling, ModelSpec, RopeScaling, YarnScaling


def make_args(layout: ModelLayout, dtype: torch.dtype, ckpt_format: str = "torch", **extra) -> argparse.Namespace:
    s = layout.spec
    theta = int(s.rope_theta) if float(s.rope_theta).is_integer() else s.rope_theta
    args = argparse.Namespace(
        num_layers=s.num_layers,
        hidden_size=s.hidden_size,
        ffn_hidden_size=s.ffn_hidden_size,
        num_attention_heads=s.num_attention_heads,
        num_query_groups=s.num_query_groups,
        group_query_attention=s.num_query_groups != s.num_attention_heads,
        kv_channels=s.kv_channels,
        max_position_embeddings=s.max_position_embeddings,
        seq_length=min(s.max_position_embeddings, 4096),
        **dict(position_kind(s).megatron_args),
        # learned positions' rows before position 0 (OPT's 2; HF keeps them): qlm's own arg, as the table holds
        # max_position_embeddings + this many rows
        qlm_position_offset=FAMILIES[s.model_type].position_offset,
        rotary_base=theta,
        rotary_percent=s.rotary_percent,
        rotary_interleaved=s.rotary_interleaved,
        # GLM-4's sandwich norms (not in upstream Megatron-LM: the field names of the Megatron forks that build them)
        post_self_attn_layernorm=s.post_norms,
        post_mlp_layernorm=s.post_norms,
        use_rope_scaling=isinstance(s.rope_scaling, RopeScaling),
        rope_scaling_factor=s.rope_scaling.factor if s.rope_scaling else 8.0,
        add_bias_linear=s.linear_bias,  # every linear's bias (OPT); add_qkv_bias: linear_qkv's alone
        add_qkv_bias=s.qkv_bias,
        **dict(activation_kind(s).megatron_args),
        **dict(activation_kind(s).megatron_values),
        untie_embeddings_and_output_weights=not s.tie_word_embeddings,
        apply_layernorm_1p=norm_kind(s).zero_centered,  # Megatron's zero-centred gamma: Gemma's (1 + w)
        normalization=norm_kind(s).megatron_name,
        qlm_layernorm_no_bias=norm_kind(s).bias_free,  # MPT's LayerNorm: Megatron's always has a bias
        norm_epsilon=s.norm_epsilon,
        apply_query_key_layer_scaling=False,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        # Megatron's window (left, 0) lets a query see `left` earlier keys and itself: HF's sliding_window - 1
        window_size=(s.sliding_window - 1, 0) if s.sliding_window else None,
        window_attn_skip_freq=None if s.window_layers is None else [int(w) for w in s.window_layers],
        qlm_sliding_window=s.sliding_window,
        softmax_scale=s.softmax_scale,
        softmax_type="learnable" if s.attention_sinks else "vanilla",  # gpt-oss's sinks: core_attention.softmax_offset
        # Gemma 2's soft-caps: Megatron-LM has none; Megatron-Bridge's Gemma 2 provider names them so
        attn_logit_softcapping=s.attention_softcap,
        final_logit_softcapping=s.logit_softcap,
        # Gemma 3's global layers: linear RoPE scaling (Megatron's position interpolation); its windowed layers' own
        # base and its embedding scale have no Megatron-LM argument (Megatron-Bridge's rotary_base_local)
        rotary_seq_len_interpolation_factor=s.rope_scaling.factor if isinstance(s.rope_scaling, LinearRopeScaling)
        else None,
        qlm_local_rope_theta=s.local_rope_theta,
        qlm_scaled_embedding=s.scaled_embedding,
        embed_layernorm=s.embedding_norm,  # BLOOM's: Megatron-DeepSpeed's --embed-layernorm (word_embeddings.norm)
        sequence_parallel=False,
        transformer_impl="local",
        ckpt_format=ckpt_format,
        tokenizer_type="HuggingFaceTokenizer",
        iteration=0,
        consumed_train_samples=0,
        consumed_valid_samples=0,
        qlm_model_type=s.model_type,
        qlm_rope_scaling=None if s.rope_scaling is None else vars(s.rope_scaling).copy(),
        qk_layernorm=s.qk_layernorm or s.mla is not None,  # MLA's q and kv latent norms (Megatron's switch)
        qlm_head=s.head,
        qlm_pad_token_id=s.pad_token_id,
        **moe_args(s),
        **mla_args(s),
        mtp_num_layers=s.mtp_num_layers or None,  # Megatron's --mtp-num-layers (None: no MTP)
    )
    for key, value in yarn_gqa_args(s).items():
        setattr(args, key, value)
    set_layout_args(args, layout, dtype)
    for key, value in extra.items():
        setattr(args, key, value)
    return args


def moe_args(spec: ModelSpec) -> dict:
    """Megatron-LM's MoE arguments (num_experts None: a dense model). The experts are SequentialMLPs (no grouped
    GEMM), so their weights are `mlp.experts.local_experts.<e>.*`; moe_layer_freq is 1 or the per-layer list."""
    moe = spec.moe
    if moe is None:
        return {"num_experts": None, "moe_grouped_gemm": False}
    return {
        "num_experts": moe.num_experts,
        "moe_router_topk": moe.topk,
        "moe_ffn_hidden_size": moe.ffn_hidden_size,
        "moe_shared_expert_intermediate_size": moe.shared_expert_hidden_size or None,
        "moe_shared_expert_gate": moe.shared_expert_gate,
        "moe_router_pre_softmax": moe.pre_softmax,
        "moe_router_score_function": moe.score_function,
        "moe_layer_freq": [int(moe.is_moe_layer(i)) for i in range(spec.num_layers)] if moe.layer_pattern else 1,
        "moe_grouped_gemm": False,
        "moe_token_dispatcher_type": "allgather",
        "moe_router_load_balancing_type": "aux_loss",
        "moe_router_topk_scaling_factor": None if moe.topk_scaling_factor == 1.0 else moe.topk_scaling_factor,
        "moe_router_enable_expert_bias": moe.expert_bias,
        "moe_router_num_groups": moe.num_groups if moe.num_groups > 1 else None,
        "moe_router_group_topk": moe.group_topk if moe.num_groups > 1 else None,
    }


def mla_args(spec: ModelSpec) -> dict:
    """Megatron-LM's multi-latent attention arguments (its MLATransformerConfig) and its YaRN's (grouped-query
    attention's: yarn_gqa_args); `qlm_mla` keeps how HF laid out the rotary rows."""
    mla, yarn = spec.mla, spec.rope_scaling if isinstance(spec.rope_scaling, YarnScaling) else None
    args = {"multi_latent_attention": mla is not None}
    if mla is not None:
        args.update(q_lora_rank=mla.q_lora_rank, kv_lora_rank=mla.kv_lora_rank, qk_head_dim=mla.qk_nope_head_dim,
                    qk_pos_emb_head_dim=mla.qk_rope_head_dim, v_head_dim=mla.v_head_dim,
                    qlm_mla=vars(mla).copy())
    if yarn is not None and mla is not None:
        args.update(rope_type="yarn", rotary_scaling_factor=yarn.factor,
                    original_max_position_embeddings=yarn.original_max_position_embeddings,
                    beta_fast=yarn.beta_fast, beta_slow=yarn.beta_slow, mscale=yarn.mscale or 1.0,
                    mscale_all_dim=yarn.mscale_all_dim or 0.0)
    elif mla is not None:
        args["rope_type"] = "rope"
    return args


def yarn_gqa_args(spec: ModelSpec) -> dict:
    """YaRN on grouped-query attention (gpt-oss's), as Megatron-LM's args say it: --position-embedding-type yarn,
    --rotary-scaling-factor, --yarn-original-max-position-embeddings, --yarn-beta-fast / -slow, --mscale,
    --mscale-all-dim and --[no-]yarn-correction-range-round-to-int (transformers' truncate)."""
    yarn = spec.rope_scaling
    if spec.mla is not None or not isinstance(yarn, YarnScaling):
        return {}
    return {"position_embedding_type": "yarn", "rotary_scaling_factor": yarn.factor,
            "yarn_original_max_position_embeddings": yarn.original_max_position_embeddings,
            "yarn_beta_fast": yarn.beta_fast, "yarn_beta_slow": yarn.beta_slow, "mscale": yarn.mscale or 1.0,
            "mscale_all_dim": yarn.mscale_all_dim or 0.0, "yarn_correction_range_round_to_int": yarn.truncate}


def mla_from_args(args) -> MlaSpec | None:
    if not getattr(args, "multi_latent_attention", False):
        return None
    stored = getattr(args, "qlm_mla", None)
    if stored:
        return MlaSpec(**stored)
    return MlaSpec(kv_lora_rank=getattr(args, "kv_lora_rank", 512), qk_nope_head_dim=getattr(args, "qk_head_dim", 128),
                   qk_rope_head_dim=getattr(args, "qk_pos_emb_head_dim", 64),
                   v_head_dim=getattr(args, "v_head_dim", 128), q_lora_rank=getattr(args, "q_lora_rank", None))


def _rope_scaling_from_args(args) -> RopeScaling | YarnScaling | LinearRopeScaling | None:
    stored = getattr(args, "qlm_rope_scaling", None)
    # Megatron-LM's multi-latent attention uses yarn unless told otherwise (MLATransformerConfig.rope_type)
    rope_type = getattr(args, "rope_type", None) or ("yarn" if getattr(args, "multi_latent_attention", False)
                                                     else "rope")
    if getattr(args, "position_embedding_type", None) == "yarn":  # grouped-query attention's YaRN (yarn_gqa_args)
        if stored:
            return YarnScaling(**stored)
        mscale_all_dim = float(getattr(args, "mscale_all_dim", 0.0) or 0.0)
        original = int(need_arg(args, "yarn_original_max_position_embeddings"))
        return YarnScaling(factor=float(need_arg(args, "rotary_scaling_factor")),
                           original_max_position_embeddings=original,
                           beta_fast=float(getattr(args, "yarn_beta_fast", 32.0)),
                           beta_slow=float(getattr(args, "yarn_beta_slow", 1.0)),
                           mscale=float(getattr(args, "mscale", 1.0) or 1.0), mscale_all_dim=mscale_all_dim or None,
                           truncate=bool(getattr(args, "yarn_correction_range_round_to_int", True)))
    if rope_type == "yarn":
        if stored:
            return YarnScaling(**stored)
        return YarnScaling(factor=float(getattr(args, "rotary_scaling_factor", 40.0)),
                           original_max_position_embeddings=int(getattr(args, "original_max_position_embeddings",
                                                                        4096)),
                           beta_fast=float(getattr(args, "beta_fast", 32.0)),
                           beta_slow=float(getattr(args, "beta_slow", 1.0)),
                           mscale=float(getattr(args, "mscale", 1.0)),
                           mscale_all_dim=float(getattr(args, "mscale_all_dim", 0.0)) or None)
    if getattr(args, "use_rope_scaling", False):
        factor = float(getattr(args, "rope_scaling_factor", 8.0))
        return RopeScaling(**stored) if stored else RopeScaling(factor=factor)
    interpolation = getattr(args, "rotary_seq_len_interpolation_factor", None)
    if interpolation:
        return LinearRopeScaling(float(interpolation))
    return None


def moe_from_args(args, num_layers: int) -> MoeSpec | None:
    """The MoeSpec of Megatron-LM args (None without num_experts)."""
    experts = getattr(args, "num_experts", None)
    if not experts:
        return None
    freq = getattr(args, "moe_layer_freq", 1)
    if isinstance(freq, int):
        pattern = tuple(int(i % freq == 0) for i in range(num_layers))
    elif isinstance(freq, (list, tuple)) and len(freq) == num_layers and set(freq) <= {0, 1}:
        pattern = tuple(int(v) for v in freq)
    else:
        raise QlmError(f"the checkpoint's moe_layer_freq {freq!r} is neither an integer nor a 0/1 list of "
                       f"{num_layers} layers", "fix moe_layer_freq in the args or pass --config")
    score = getattr(args, "moe_router_score_function", None) or "softmax"
    groups = getattr(args, "moe_router_num_groups", None) or 1
    topk = getattr(args, "moe_router_topk", None) or 2
    where = getattr(args, "qlm_args_from", None) or "the checkpoint's args"
    for key, value in (("num_experts", experts), ("moe_router_topk", topk)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise QlmError(f"{key} is {value!r} in {where}, not a positive integer", f"fix {key} there or pass "
                           "--config with the model's HF config")
    if topk > experts:
        raise QlmError(f"moe_router_topk {topk} in {where} is more than its {experts} experts (num_moe_experts)",
                       "fix moe_router_topk there (at most the expert count) or pass --config with the model's HF "
                       "config")
    return MoeSpec(
        num_experts=experts,
        topk=topk,
        ffn_hidden_size=getattr(args, "moe_ffn_hidden_size", None) or args.ffn_hidden_size,
        pre_softmax=bool(getattr(args, "moe_router_pre_softmax", False)),
        score_function=score,
        expert_bias=bool(getattr(args, "moe_router_enable_expert_bias", False)),
        shared_expert_hidden_size=getattr(args, "moe_shared_expert_intermediate_size", None) or 0,
        shared_expert_gate=bool(getattr(args, "moe_shared_expert_gate", False)),
        layer_pattern=() if all(pattern) else pattern,
        num_groups=groups,
        group_topk=(getattr(args, "moe_router_group_topk", None) or 1) if groups > 1 else 1,
        topk_scaling_factor=float(getattr(args, "moe_router_topk_scaling_factor", None) or 1.0),
    )


def _post_norms_from_args(args: argparse.Namespace) -> bool:
    after_attention = bool(getattr(args, "post_self_attn_layernorm", False))
    if after_attention != bool(getattr(args, "post_mlp_layernorm", False)):
        raise QlmError("the checkpoint's args put a norm after only one of attention and MLP "
                       "(post_self_attn_layernorm / post_mlp_layernorm)", "qlm builds both (GLM-4) or neither")
    return after_attention


def _windows_from_args(args: argparse.Namespace, num_layers: int) -> tuple[int | None, tuple[bool, ...] | None]:
    """(sliding_window, window_layers) from Megatron's window_size (left, right) and window_attn_skip_freq (N: every
    N-th layer full; a list: 1 = windowed), as megatron.core.transformer.utils.is_layer_window_attention reads them."""
    window = getattr(args, "window_size", None)
    if not window or window[0] is None or window[0] < 0:
        return None, None
    if window[1] not in (0, None):
        raise QlmError(f"window_size {tuple(window)} lets a query see {window[1]} later keys",
                       "qlm's windows are causal: (left, 0)")
    if hasattr(args, "qlm_sliding_window"):
        size = args.qlm_sliding_window
    else:  # qlm before it kept the HF size wrote the size itself as `left`
        size = window[0] if hasattr(args, "qlm_model_type") else window[0] + 1
    skip = getattr(args, "window_attn_skip_freq", None)
    if skip is None:
        return size, None
    if isinstance(skip, int) and not isinstance(skip, bool) and skip >= 1:
        return size, tuple((layer + 1) % skip != 0 for layer in range(num_layers))
    if isinstance(skip, (list, tuple)) and len(skip) == num_layers and all(v in (0, 1) for v in skip):
        return size, tuple(bool(v) for v in skip)
    raise QlmError(f"window_attn_skip_freq {skip!r} is neither a positive count nor one 0/1 per layer of "
                   f"{num_layers}", "fix the checkpoint's args")


def need_arg(args, name: str):
    """args.<name>, which must be there (not None)."""
    value = getattr(args, name, None)
    if value is None:
        raise QlmError(f"the checkpoint's args lack {name}",
                       "pass --config with the model's HF directory or a preset name")
    return value


def _position_from_args(args, model: str, model_type: str) -> str:
    """The position scheme of the args' position_embedding_type (absent: RoPE, as every qlm file says), which must
    be the family's: learned positions need the family's table offset (OPT's 2), so only qlm's own args name it."""
    kind = getattr(args, "position_embedding_type", None) or "rope"
    kind = "rope" if kind == "yarn" else kind  # RoPE with YaRN's frequencies (_rope_scaling_from_args)
    position = next((name for name, row in POSITION_KINDS.items()
                     if dict(row.megatron_args)["position_embedding_type"] == kind), None)
    if position is None:
        raise QlmError(f"{model} uses {kind} positions", f"qlm builds {', '.join(POSITION_KINDS)} positions")
    if position != FAMILIES[model_type].position:
        raise QlmError(f"{model} uses {kind} positions but its model type {model_type} has "
                       f"{FAMILIES[model_type].position}", "pass --config with the model's HF directory")
    return position


def _guess_model_type(args, moe: MoeSpec | None) -> str:
    """The HF family of args Megatron-LM wrote (qlm's own name it in qlm_model_type)."""
    if getattr(args, "multi_latent_attention", False):  # DeepSeek-V2's router: softmax before the top k
        return "deepseek_v2" if moe is not None and moe.pre_softmax and not moe.expert_bias else "deepseek_v3"
    qk_norm, bias = bool(getattr(args, "qk_layernorm", False)), bool(getattr(args, "add_qkv_bias", False))
    if moe is None:
        if getattr(args, "rotary_interleaved", False):  # GLM's pair layout (its sandwich norms: GLM-4), or ERNIE's
            return "glm4" if getattr(args, "post_self_attn_layernorm", False) else "glm" if bias else "ernie4_5"
        return "qwen3" if qk_norm else "qwen2" if bias else "llama"
    if getattr(args, "quick_geglu", False) or getattr(args, "softmax_type", None) == "learnable":
        return "gpt_oss"  # its clamped SwiGLU experts, its attention sinks
    if moe.expert_bias:  # DeepSeek-V3's sigmoid router with grouped-query attention: GLM-4.5; softmax: ERNIE 4.5
        return "ernie4_5_moe" if moe.score_function == "softmax" else "glm4_moe"
    if qk_norm and not moe.shared_expert_hidden_size:
        return "qwen3_moe"
    if moe.shared_expert_hidden_size or moe.pre_softmax or moe.layer_pattern or bias:
        return "qwen2_moe"
    return "mixtral"


def set_layout_args(args: argparse.Namespace, layout: ModelLayout, dtype: torch.dtype) -> argparse.Namespace:
    """The fields that change when a checkpoint is resharded or recast (everything else is kept)."""
    counts = layout.stage_layer_counts
    uneven = layout.first_stage_layers is not None or layout.last_stage_layers is not None
    args.vocab_size = layout.spec.vocab_size
    args.padded_vocab_size = layout.padded_vocab
    args.make_vocab_size_divisible_by = layout.make_vocab_size_divisible_by
    args.tensor_model_parallel_size = layout.tp
    args.expert_model_parallel_size = layout.ep
    args.expert_tensor_parallel_size = layout.etp
    args.pipeline_model_parallel_size = layout.pp
    args.virtual_pipeline_model_parallel_size = layout.vpp if layout.vpp > 1 else None
    args.num_layers_per_virtual_pipeline_stage = counts[0] // layout.vpp if layout.vpp > 1 and not uneven else None
    args.decoder_first_pipeline_num_layers = layout.first_stage_layers
    args.decoder_last_pipeline_num_layers = layout.last_stage_layers
    args.bf16 = dtype == torch.bfloat16
    args.fp16 = dtype == torch.float16
    args.params_dtype = dtype
    return args


def spec_from_args(args) -> ModelSpec:
    """Rebuild the architecture from a Megatron `args` (written by qlm or by Megatron-LM itself)."""
    where = getattr(args, "qlm_args_from", None)  # a Megatron-Bridge run_config.yaml (bridge_config.py)
    model = f"the model of {where}" if where else "the checkpoint's model"
    activation = next((name for name, kind in ACTIVATION_KINDS.items()
                       if all(bool(getattr(args, key, False)) == value for key, value in kind.megatron_args)), None)
    if activation is None:
        raise QlmError(f"{model} uses an MLP activation qlm does not build",
                       f"qlm builds {', '.join(ACTIVATION_KINDS)} (Megatron's --swiglu)")
    for key, value in ACTIVATION_KINDS[activation].megatron_values:  # absent: Megatron-LM's default (qlm_: ours)
        held = getattr(args, key, dict(MEGATRON_DEFAULT_VALUES).get(key, value))
        if held != value:
            raise QlmError(f"{model}'s {activation} MLP has {key} {held!r}, which qlm's {activation} does not "
                           f"build (it has {value!r})", f"convert a model with {key} {value!r}")
    normalization = getattr(args, "normalization", "LayerNorm")
    zero_centered = bool(getattr(args, "apply_layernorm_1p", False))
    bias_free = bool(getattr(args, "qlm_layernorm_no_bias", False))
    norm = next((name for name, kind in NORM_KINDS.items() if kind.megatron_name == normalization
                 and kind.zero_centered == zero_centered and kind.bias_free == bias_free), None)
    if norm is None:
        raise QlmError(f"{model} uses {normalization}",
                       f"qlm builds {', '.join(dict.fromkeys(k.megatron_name for k in NORM_KINDS.values()))}")
    moe = moe_from_args(args, need_arg(args, "num_layers"))
    model_type = getattr(args, "qlm_model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        model_type = _guess_model_type(args, moe)
    position = _position_from_args(args, model, model_type)
    heads = need_arg(args, "num_attention_heads")
    groups = getattr(args, "num_query_groups", None) if getattr(args, "group_query_attention", False) else None
    scaling = _rope_scaling_from_args(args)
    mla = mla_from_args(args)
    sliding_window, window_layers = _windows_from_args(args, need_arg(args, "num_layers"))
    return ModelSpec(
        model_type=model_type,
        vocab_size=getattr(args, "vocab_size", None) or need_arg(args, "padded_vocab_size"),
        hidden_size=need_arg(args, "hidden_size"),
        ffn_hidden_size=need_arg(args, "ffn_hidden_size"),
        num_layers=need_arg(args, "num_layers"),
        num_attention_heads=heads,
        num_query_groups=heads if mla else groups or heads,
        kv_channels=mla.q_head_dim if mla else getattr(args, "kv_channels", None) or args.hidden_size // heads,
        max_position_embeddings=getattr(args, "max_position_embeddings", None) or getattr(args, "seq_length", 4096),
        rope_theta=float(getattr(args, "rotary_base", 10000)),
        norm_epsilon=float(getattr(args, "norm_epsilon", 1e-5)),
        qkv_bias=bool(getattr(args, "add_qkv_bias", False)) or bool(getattr(args, "add_bias_linear", False)),
        linear_bias=bool(getattr(args, "add_bias_linear", False)),
        tie_word_embeddings=not getattr(args, "untie_embeddings_and_output_weights", False),
        rope_scaling=scaling,
        sliding_window=sliding_window,
        window_layers=window_layers,
        qk_layernorm=bool(getattr(args, "qk_layernorm", False)) and mla is None,
        rotary_percent=float(getattr(args, "rotary_percent", 1.0) or 1.0),
        # multi-latent attention reads its rotary rows as DeepSeek lays them out (mla_spec.rope_interleave)
        rotary_interleaved=bool(getattr(args, "rotary_interleaved", False)) and mla is None,
        post_norms=_post_norms_from_args(args),
        scaled_embedding=bool(getattr(args, "qlm_scaled_embedding", False)),
        embedding_norm=bool(getattr(args, "embed_layernorm", False)),
        softmax_scale=getattr(args, "softmax_scale", None),
        attention_sinks=_sinks_from_args(args),
        attention_softcap=getattr(args, "attn_logit_softcapping", None),
        logit_softcap=getattr(args, "final_logit_softcapping", None),
        local_rope_theta=getattr(args, "qlm_local_rope_theta", None),
        moe=moe,
        mla=mla,
        mtp_num_layers=int(getattr(args, "mtp_num_layers", None) or 0),
        attention="mla" if mla else None,
        norm=norm,
        activation=activation,
        position=position,
        head=getattr(args, "qlm_head", None) or "lm",
        pad_token_id=getattr(args, "qlm_pad_token_id", None),
    )


def _sinks_from_args(args) -> bool:
    """Megatron's softmax_type: "learnable" is a sink logit per head; "off-by-one" (a fixed sink of 0) qlm lacks."""
    kind = getattr(args, "softmax_type", None) or "vanilla"
    if kind not in ("vanilla", "learnable"):
        raise QlmError(f"softmax_type {kind!r} is not one qlm builds", "qlm reads softmax_type vanilla or learnable")
    return kind == "learnable"


def dtype_from_args(args) -> torch.dtype:
    if getattr(args, "bf16", False):
        return torch.bfloat16
    if getattr(args, "fp16", False):
        return torch.float16
    return torch.float32
