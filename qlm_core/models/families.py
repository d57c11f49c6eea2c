"""What each model family (an HF `model_type`) is, beyond its numbers: its HF class, which optional tensors it has
and where its MoE block lives. One row per family, read by spec.py (config.json in and out) and layout.py (HF names);
a new family is a row here, its numbers in ModelSpec.from_hf_config and a test against transformers' logits."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from qlm_core.errors import QlmError

# qkv_bias: "always" (Qwen2), "never", "config" (Qwen2-MoE's own `qkv_bias` key, default true) or
# "attention_bias" (GLM-4.5: config.json's attention_bias puts biases on q, k and v, none on o_proj)
# "enable_bias" (OPT: config.json's enable_bias, default true, puts biases on every linear)
QkvBias = Literal["always", "never", "config", "attention_bias", "enable_bias"]
# sliding_window: "applied" (Mistral: config.json's sliding_window holds for every layer), "gated" (Qwen3-MoE: for
# every layer, only with use_sliding_window), "gated_layers" (Qwen2, Qwen3, Qwen2-MoE: only with use_sliding_window,
# for the layers config.json's layer_types marks "sliding_attention"), "layers" (Gemma 3: always, for the layers
# layer_types marks), "none" (Llama: no such key)
SlidingWindow = Literal["applied", "gated", "gated_layers", "layers", "none"]

# The per-family choices of the decoder, each built in one place: the attention kind of every layer
# (models/attention_kinds.py), the norm (models/norms.py), the MLP activation (models/activations.py) and the position
# scheme (models/positions.py). A new choice is a value here and one row in its module; ModelSpec holds them.
# "mla": multi-latent attention (DeepSeek-V2/V3), models/attention_mla.py
AttentionName = Literal["gqa", "mla"]
NormName = Literal["rmsnorm", "gemma_rmsnorm", "layernorm", "layernorm_no_bias"]
# "gelu_tanh": GELU's tanh approximation (BLOOM's bloom_gelu; Megatron-LM's --openai-gelu)
ActivationName = Literal["swiglu", "geglu", "relu", "gelu", "clamped_swiglu", "gelu_tanh"]
# "learned_absolute": a learned embedding per position added to the token embedding (OPT's, Megatron's)
# "alibi": a bias by distance in each head's scores (BLOOM's, MPT's; kernels/alibi.py)
PositionName = Literal["rope", "learned_absolute", "alibi"]
# how an MoE layer's routed experts lie in the HF files: "separate" (a tensor per expert and projection; transformers
# 5's fused [E, 2F, H] gate_up_proj and [E, H, F] down_proj are read too), "gpt_oss" (the only form gpt-oss's
# files have: experts.gate_up_proj [E, H, 2F] with gate and up in alternate columns, experts.down_proj [E, F, H],
# their biases gate_up_proj_bias [E, 2F] and down_proj_bias [E, H]); both: models/hf_experts.py
ExpertFiles = Literal["separate", "gpt_oss"]
# the last stage's head: "lm" the vocabulary projection (HF *ForCausalLM), "score" one scalar per token, read at a
# sequence's last token (a Bradley-Terry reward model; HF *ForSequenceClassification with num_labels 1)
HeadName = Literal["lm", "score"]
# config.json's hidden_act of each MLP activation (a gated one names its gate's function)
HF_ACTIVATIONS: dict[str, str] = {"swiglu": "silu", "geglu": "gelu_pytorch_tanh", "relu": "relu", "gelu": "gelu",
                                  "clamped_swiglu": "silu",  # gpt-oss says silu; its swiglu_alpha / limit the rest
                                  "gelu_tanh": "gelu_pytorch_tanh"}  # BLOOM's config.json names none

GATE_UP_DOWN = ("gate_proj", "up_proj", "down_proj")
W1_W3_W2 = ("w1", "w3", "w2")  # Mixtral's experts: w1 the gate, w3 the up and w2 the down projection
# OPT's HF names, from the Llama-style names the layout states (applied in order, each once)
OPT_HF_NAMES = (
    (r"^model\.(layers|embed_tokens|embed_positions)\.", r"model.decoder.\1."),
    (r"^model\.norm\.", "model.decoder.final_layer_norm."),
    (r"\.self_attn\.o_proj\.", ".self_attn.out_proj."),
    (r"\.input_layernorm\.", ".self_attn_layer_norm."),
    (r"\.mlp\.up_proj\.", ".fc1."),
    (r"\.mlp\.down_proj\.", ".fc2."),
)

# BLOOM's HF names, from the Llama-style names the layout states (its fused q/k/v: models/attention_gqa.py)
BLOOM_HF_NAMES = (
    (r"^model\.embed_tokens\.", "transformer.word_embeddings."),
    (r"^model\.embed_norm\.", "transformer.word_embeddings_layernorm."),
    (r"^model\.layers\.", "transformer.h."),
    (r"^model\.norm\.", "transformer.ln_f."),
    (r"\.self_attn\.qkv_proj\.", ".self_attention.query_key_value."),
    (r"\.self_attn\.o_proj\.", ".self_attention.dense."),
    (r"\.mlp\.up_proj\.", ".mlp.dense_h_to_4h."),
    (r"\.mlp\.down_proj\.", ".mlp.dense_4h_to_h."),
)
# MPT's HF names, from the Llama-style names the layout states
MPT_HF_NAMES = (
    (r"^model\.embed_tokens\.", "transformer.wte."),
    (r"^model\.layers\.", "transformer.blocks."),
    (r"^model\.norm\.", "transformer.norm_f."),
    (r"\.input_layernorm\.", ".norm_1."),
    (r"\.post_attention_layernorm\.", ".norm_2."),
    (r"\.self_attn\.qkv_proj\.", ".attn.Wqkv."),
    (r"\.self_attn\.o_proj\.", ".attn.out_proj."),
    (r"\.mlp\.", ".ffn."),
)
# how q, k and v lie in the HF files: "separate" (q_proj, k_proj, v_proj), "per_head" (one qkv_proj, [q; k; v] head by
# head: BLOOM's query_key_value, Megatron's own linear_qkv rows for multi-head attention) or "stacked" (one qkv_proj,
# [every q; every k; every v]: MPT's Wqkv)
QkvFiles = Literal["separate", "per_head", "stacked"]
# config.json keys of the RoPE-era families that OPT's, BLOOM's and MPT's config classes never read
NO_ROPE_CONFIG = ("num_key_value_heads", "head_dim", "rope_theta", "rope_scaling", "rope_parameters", "sliding_window",
                  "use_sliding_window", "layer_types", "partial_rotary_factor")


@dataclass(frozen=True)
class Family:
    architecture: str  # transformers' *ForCausalLM class (a score head's class: *ForSequenceClassification)
    qkv_bias: QkvBias = "never"
    qk_norm: bool = False  # RMSNorm over head_dim on each q and k head, before RoPE (Qwen3)
    qk_norm_key: str | None = None  # ... or as config.json's switch of this name says (GLM-4.5's use_qk_norm)
    rotary_percent: float = 1.0  # partial_rotary_factor when config.json has none (transformers' default: GLM's 0.5)
    sliding_window: SlidingWindow = "none"
    declares_no_bias: bool = False  # config.json says attention_bias / mlp_bias = false
    moe: bool = False
    moe_block: str = "mlp."  # where an MoE layer's router and experts live under model.layers.N.
    expert_projections: tuple[str, str, str] = GATE_UP_DOWN  # an expert's gate, up and down projections
    shared_expert_block: str = "shared_expert."  # the shared expert's module under the MoE block
    # the router's correction bias under the MoE block, and its HF shape's leading axes (ERNIE's is [1, E])
    expert_bias_name: str = "gate.e_score_correction_bias"
    expert_bias_leading: tuple[int, ...] = ()
    # config.json's count of multi-token prediction layers (DeepSeek-V3's num_nextn_predict_layers); None: none
    mtp_key: str | None = None
    # RoPE rotates the pairs (x0, x1), (x2, x3), ... of each head's rotated part (GLM's layout; Megatron's
    # rotary_interleaved), not its two halves
    rotary_interleaved: bool = False
    fused_gate_up: bool = False  # a dense MLP's gate and up projections are one HF tensor, mlp.gate_up_proj [2f, h]
    pre_mlp_norm: str = "post_attention_layernorm"  # the HF name of the norm before the MLP
    # the HF names of the norms after the attention and after the MLP, before each residual add (GLM-4's sandwich
    # norms; Megatron: post_self_attn_layernorm, post_mlp_layernorm); None: the layer has none
    post_norms: tuple[str, str] | None = None
    activation_key: str = "hidden_act"  # config.json's key naming the MLP's activation (Gemma: hidden_activation)
    # (pattern, replacement) rules from the Llama-style HF names the layout states to the family's own (OPT's)
    hf_names: tuple[tuple[str, str], ...] = ()
    # config.json's key for ModelSpec's size keys where the family names them otherwise (OPT's ffn_dim)
    config_aliases: tuple[tuple[str, str], ...] = ()
    norm_epsilon: float | None = None  # a fixed norm epsilon config.json does not state (OPT's nn.LayerNorm 1e-5)
    norm_epsilon_default: float = 1e-6  # the norm epsilon when config.json leaves it out (the config class's default)
    max_positions_default: int = 4096  # max_position_embeddings when config.json has none (BLOOM's trained 2048)
    # (ours, theirs): an older spelling of one of ModelSpec's size keys, read where the current key is absent and
    # never written (BLOOM-176B's n_embed, which BloomConfig still reads as hidden_size)
    read_aliases: tuple[tuple[str, str], ...] = ()
    other_activations: tuple[str, ...] = ()  # activations config.json may name besides `activation` (OPT: gelu)
    # learned positions: the embedding's rows before position 0 (OPT's offset of 2; HF keeps and stores them)
    position_offset: int = 0
    fixed_config: tuple[tuple[str, Any], ...] = ()  # config.json keys the family's one supported layout fixes
    # config.json keys the family's config class never reads (ignored on read, left out on write: OPT's have no
    # rotary base, norm epsilon or key/value heads of their own)
    unread_config: tuple[str, ...] = ()
    # multi-head attention of hidden_size / heads wide only (OPT's config has no key for other heads)
    plain_heads: bool = False
    # a config.json key that must equal hidden_size (OPT's word_embed_proj_dim: OPT-350M projects its narrower
    # embedding in and out, which qlm does not build); written as hidden_size
    embedding_width_key: str | None = None
    tied_default: bool = False  # transformers' tie_word_embeddings when config.json leaves it out
    # config.json has no intermediate_size: the MLP is this many times hidden_size wide (BLOOM's 4)
    ffn_ratio: int | None = None
    embedding_norm: bool = False  # a norm after the word embedding (BLOOM's word_embeddings_layernorm)
    qkv_files: QkvFiles = "separate"
    # (section, key, value) of a nested config.json object the family's one supported layout fixes (MPT's attn_config)
    fixed_nested: tuple[tuple[str, str, Any], ...] = ()
    scaled_embedding: bool = False  # the embedding's output is multiplied by sqrt(hidden_size) (Gemma)
    # the softmax scale is query_pre_attn_scalar^-0.5, not head_dim^-0.5, and windowed layers have their own RoPE
    # base (Gemma 3's rope_parameters per layer type)
    gemma_attention: bool = False
    # Gemma 2: the softmax scale is query_pre_attn_scalar^-0.5 and config.json's attn_logit_softcapping /
    # final_logit_softcapping soft-cap the attention scores and the output logits
    softcapping: bool = False
    # biases on the attention's output projection, the router and the routed experts' linears whatever config.json
    # says (gpt-oss; Megatron's add_bias_linear)
    linear_bias: bool = False
    sinks: bool = False  # a learned sink logit per attention head (gpt-oss's self_attn.sinks)
    router_name: str = "gate."  # the router's module under the MoE block (gpt-oss: router.)
    expert_files: ExpertFiles = "separate"
    attention: AttentionName = "gqa"
    norm: NormName = "rmsnorm"
    activation: ActivationName = "swiglu"
    position: PositionName = "rope"


FAMILIES: dict[str, Family] = {
    "qwen2": Family("Qwen2ForCausalLM", qkv_bias="always", sliding_window="gated_layers"),
    "llama": Family("LlamaForCausalLM", declares_no_bias=True),
    "mistral": Family("MistralForCausalLM", sliding_window="applied"),
    "qwen3": Family("Qwen3ForCausalLM", qk_norm=True, sliding_window="gated_layers", declares_no_bias=True),
    "qwen2_moe": Family("Qwen2MoeForCausalLM", qkv_bias="config", sliding_window="gated_layers", moe=True),
    "qwen3_moe": Family("Qwen3MoeForCausalLM", qk_norm=True, sliding_window="gated", declares_no_bias=True,
                        moe=True),
    "mixtral": Family("MixtralForCausalLM", sliding_window="applied", moe=True, moe_block="block_sparse_moe.",
                      expert_projections=W1_W3_W2),
    # DeepSeek-V3 / R1, Kimi-K2, Moonlight: multi-latent attention, sigmoid group-limited routing with a correction
    # bias, shared experts, dense first layers
    "deepseek_v3": Family("DeepseekV3ForCausalLM", declares_no_bias=True, moe=True,
                          shared_expert_block="shared_experts.", attention="mla",
                          mtp_key="num_nextn_predict_layers"),
    # DeepSeek-V2-Lite: the same layer (transformers always rotates its rotary rows as interleaved pairs), softmax
    # routing without renormalisation or a correction bias, scaled
    "deepseek_v2": Family("DeepseekV2ForCausalLM", declares_no_bias=True, moe=True,
                          shared_expert_block="shared_experts.", attention="mla"),
    # GLM-4.5 / 4.6 / Air: grouped-query attention with partial RoPE (partial_rotary_factor), q/k/v biases and q/k
    # norms as config.json says, DeepSeek-V3's router, shared experts and dense first layers
    "glm4_moe": Family("Glm4MoeForCausalLM", qkv_bias="attention_bias", qk_norm_key="use_qk_norm", moe=True,
                       shared_expert_block="shared_experts.", rotary_percent=0.5, mtp_key="num_nextn_predict_layers"),
    # GLM-4-9B (glm) and GLM-4-0414 (glm4): q/k/v biases, half of each head rotated in interleaved pairs, the MLP's
    # gate and up in one tensor; glm4 adds a norm after the attention and one after the MLP
    "glm": Family("GlmForCausalLM", qkv_bias="attention_bias", rotary_percent=0.5, rotary_interleaved=True,
                  fused_gate_up=True),
    "glm4": Family("Glm4ForCausalLM", qkv_bias="attention_bias", rotary_percent=0.5, rotary_interleaved=True,
                   fused_gate_up=True, post_norms=("post_self_attn_layernorm", "post_mlp_layernorm")),
    # Gemma 3 (text): (1 + w) RMSNorm, four norms a layer, GeGLU, q/k norms, embeddings scaled by sqrt(h), local
    # (windowed) and global layers with their own RoPE bases, query_pre_attn_scalar, tied embeddings
    "gemma3_text": Family("Gemma3ForCausalLM", qk_norm=True, sliding_window="layers",
                          pre_mlp_norm="pre_feedforward_layernorm",
                          post_norms=("post_attention_layernorm", "post_feedforward_layernorm"),
                          activation_key="hidden_activation", scaled_embedding=True, gemma_attention=True,
                          norm="gemma_rmsnorm", activation="geglu", tied_default=True),
    # Gemma 2: Gemma 3's layer without q/k norms, one RoPE base, windowed and global layers in turn, the attention
    # scores and the output logits soft-capped (cap · tanh(x / cap))
    "gemma2": Family("Gemma2ForCausalLM", sliding_window="layers", pre_mlp_norm="pre_feedforward_layernorm",
                     post_norms=("post_attention_layernorm", "post_feedforward_layernorm"),
                     activation_key="hidden_activation", scaled_embedding=True, softcapping=True,
                     norm="gemma_rmsnorm", activation="geglu", tied_default=True),
    # ERNIE 4.5 (dense): Llama's layer with RoPE over the whole head in interleaved pairs (GLM's layout), tied
    # embeddings by default; config.json's use_bias would put biases on every linear
    "ernie4_5": Family("Ernie4_5ForCausalLM", rotary_interleaved=True, tied_default=True),
    # ERNIE 4.5 MoE (21B-A3B, 300B-A47B): the same layer with softmax routing whose correction bias chooses the top
    # k (renormalised), ungated shared experts, MoE layers from moe_layer_start_index every moe_layer_interval-th
    "ernie4_5_moe": Family("Ernie4_5_MoeForCausalLM", rotary_interleaved=True, moe=True,
                           shared_expert_block="shared_experts.",
                           expert_bias_name="moe_statics.e_score_correction_bias", expert_bias_leading=(1,),
                           tied_default=True),
    # OPT / Galactica: LayerNorm with biases, biases on every linear (enable_bias), a ReLU (or GELU) MLP (fc1, fc2),
    # learned absolute positions offset by 2, multi-head attention, tied embeddings; the pre-norm layout only
    "opt": Family("OPTForCausalLM", qkv_bias="enable_bias", pre_mlp_norm="final_layer_norm",
                  activation_key="activation_function", hf_names=OPT_HF_NAMES,
                  config_aliases=(("intermediate_size", "ffn_dim"),), norm_epsilon=1e-5, position_offset=2,
                  norm="layernorm", activation="relu", other_activations=("gelu",), position="learned_absolute",
                  fixed_config=(("do_layer_norm_before", True), ("layer_norm_elementwise_affine", True),
                                ("_remove_final_layer_norm", False)), tied_default=True,
                  unread_config=(*NO_ROPE_CONFIG, "rms_norm_eps"),
                  plain_heads=True, embedding_width_key="word_embed_proj_dim"),
    # BLOOM: ALiBi, LayerNorms with biases (one after the embedding), biases on every linear, q/k/v fused head by
    # head, a tanh-GELU MLP four times hidden_size wide, multi-head attention, tied embeddings
    "bloom": Family("BloomForCausalLM", qkv_bias="always", linear_bias=True, hf_names=BLOOM_HF_NAMES,
                    config_aliases=(("num_hidden_layers", "n_layer"), ("num_attention_heads", "n_head"),
                                    ("rms_norm_eps", "layer_norm_epsilon")),
                    read_aliases=(("hidden_size", "n_embed"),), norm_epsilon_default=1e-5, max_positions_default=2048,
                    norm="layernorm", activation="gelu_tanh", position="alibi", tied_default=True, ffn_ratio=4,
                    embedding_norm=True, qkv_files="per_head", plain_heads=True,
                    fixed_config=(("apply_residual_connection_post_layernorm", False),),
                    unread_config=(*NO_ROPE_CONFIG, "max_position_embeddings", "hidden_act", "intermediate_size")),
    # MPT: ALiBi, LayerNorms without biases, no biases on any linear, q/k/v in one tensor ([q; k; v]), an exact-GELU MLP
    # four times d_model wide, multi-head attention, tied embeddings (transformers' MptForCausalLM)
    "mpt": Family("MptForCausalLM", hf_names=MPT_HF_NAMES,
                  config_aliases=(("hidden_size", "d_model"), ("num_attention_heads", "n_heads"),
                                  ("num_hidden_layers", "n_layers"), ("max_position_embeddings", "max_seq_len"),
                                  ("rms_norm_eps", "layer_norm_epsilon")),
                  norm="layernorm_no_bias", activation="gelu", position="alibi", tied_default=True, ffn_ratio=4,
                  norm_epsilon_default=1e-5, max_positions_default=2048, qkv_files="stacked", plain_heads=True,
                  fixed_config=(("expansion_ratio", 4), ("no_bias", True), ("logit_scale", None)),
                  # what transformers' MPT runs whatever attn_config says (multi-head, ALiBi of bias_max 8, no q/k
                  # norms, no clipping, 1/sqrt(head_dim)): another value would be a model it does not build
                  fixed_nested=(("attn_config", "attn_type", "multihead_attention"), ("attn_config", "alibi", True),
                                ("attn_config", "alibi_bias_max", 8), ("attn_config", "qk_ln", False),
                                ("attn_config", "clip_qkv", None), ("attn_config", "softmax_scale", None)),
                  unread_config=(*NO_ROPE_CONFIG, "hidden_act", "intermediate_size")),
    # GLM-4.7-Flash: DeepSeek-V3's layer, its dense and MoE layers listed in mlp_layer_types
    "glm4_moe_lite": Family("Glm4MoeLiteForCausalLM", declares_no_bias=True, moe=True,
                            shared_expert_block="shared_experts.", attention="mla",
                            mtp_key="num_nextn_predict_layers"),
    # gpt-oss: q/k/v/o biases, a sink logit per head, alternating windowed and full layers, yarn RoPE, an MoE whose
    # router and experts have biases and whose experts run the clamped SwiGLU (kernels/clamped_swiglu.py's ALPHA and
    # LIMIT, written here as numbers: the CLI reads this table without importing torch)
    "gpt_oss": Family("GptOssForCausalLM", qkv_bias="always", sliding_window="layers", moe=True, linear_bias=True,
                      sinks=True, router_name="router.", expert_files="gpt_oss", activation="clamped_swiglu",
                      fixed_config=(("attention_bias", True), ("swiglu_alpha", 1.702), ("swiglu_limit", 7.0))),
}


SCORE_ARCHITECTURE = ("ForCausalLM", "ForSequenceClassification")


def hf_name(model_type: str, name: str) -> str:
    """The family's HF name of a tensor the layout states in Llama's names (OPT: model.decoder..., fc1, ...)."""
    for pattern, replacement in FAMILIES[model_type].hf_names:
        name = re.sub(pattern, replacement, name, count=1)
    return name


def hf_architecture(model_type: str, head: str) -> str:
    """transformers' class of a family's model with this head."""
    causal = FAMILIES[model_type].architecture
    return causal.replace(*SCORE_ARCHITECTURE) if head == "score" else causal


Kind = TypeVar("Kind")


def chosen_kind(table: dict[str, Kind], name: str, what: str) -> Kind:
    """The row of a choice's table (attention_kinds.py, norms.py, activations.py, positions.py) a spec names."""
    kind = table.get(name)
    if kind is None:
        raise QlmError(f"{what} {name!r} is not one qlm builds", f"use one of {', '.join(sorted(table))}")
    return kind
