"""Architecture numbers of well-known models, copied from their published config.json files (numbers only)."""

from pathlib import Path

from qlm_core.errors import QlmError
from qlm_core.models.mla_spec import MlaSpec
from qlm_core.models.moe_spec import MoeSpec
from qlm_core.models.spec import ModelSpec, RopeScaling, YarnScaling


def _qwen2(hidden, ffn, layers, heads, groups, vocab, tied, max_pos=131072, eps=1e-6) -> ModelSpec:
    return ModelSpec(
        model_type="qwen2", vocab_size=vocab, hidden_size=hidden, ffn_hidden_size=ffn, num_layers=layers,
        num_attention_heads=heads, num_query_groups=groups, kv_channels=hidden // heads,
        max_position_embeddings=max_pos, rope_theta=1_000_000.0, norm_epsilon=eps, qkv_bias=True,
        tie_word_embeddings=tied, bos_token_id=151643, eos_token_id=151643,
    )


def _llama(hidden, ffn, layers, heads, groups, vocab, max_pos, theta, scaling=None, bos=128000, eos=128001):
    return ModelSpec(
        model_type="llama", vocab_size=vocab, hidden_size=hidden, ffn_hidden_size=ffn, num_layers=layers,
        num_attention_heads=heads, num_query_groups=groups, kv_channels=hidden // heads,
        max_position_embeddings=max_pos, rope_theta=theta, norm_epsilon=1e-5, qkv_bias=False,
        tie_word_embeddings=False, rope_scaling=scaling, bos_token_id=bos, eos_token_id=eos,
    )


def _qwen3(hidden, ffn, layers, heads, groups, tied, moe: MoeSpec | None = None) -> ModelSpec:
    return ModelSpec(
        model_type="qwen3_moe" if moe else "qwen3", vocab_size=151936, hidden_size=hidden, ffn_hidden_size=ffn,
        num_layers=layers, num_attention_heads=heads, num_query_groups=groups, kv_channels=128,
        max_position_embeddings=40960, rope_theta=1_000_000.0, norm_epsilon=1e-6, qkv_bias=False,
        tie_word_embeddings=tied, bos_token_id=151643, eos_token_id=151645, qk_layernorm=True, moe=moe,
    )


def _qwen2_moe(hidden, ffn, layers, heads, groups, experts, topk, expert_ffn, shared_ffn, max_pos) -> ModelSpec:
    return ModelSpec(
        model_type="qwen2_moe", vocab_size=151936, hidden_size=hidden, ffn_hidden_size=ffn, num_layers=layers,
        num_attention_heads=heads, num_query_groups=groups, kv_channels=hidden // heads,
        max_position_embeddings=max_pos, rope_theta=1_000_000.0, norm_epsilon=1e-6, qkv_bias=True,
        tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151643,
        moe=MoeSpec(experts, topk, expert_ffn, pre_softmax=True, shared_expert_hidden_size=shared_ffn,
                    shared_expert_gate=True),
    )


def _mixtral(hidden, ffn, layers, heads, max_pos) -> ModelSpec:
    return ModelSpec(
        model_type="mixtral", vocab_size=32000, hidden_size=hidden, ffn_hidden_size=ffn, num_layers=layers,
        num_attention_heads=heads, num_query_groups=8, kv_channels=128, max_position_embeddings=max_pos,
        rope_theta=1_000_000.0, norm_epsilon=1e-5, qkv_bias=False, tie_word_embeddings=False, bos_token_id=1,
        eos_token_id=2, moe=MoeSpec(8, 2, ffn),
    )


def _deepseek_v3(vocab, hidden, ffn, layers, heads, q_lora, experts, topk, expert_ffn, shared, groups, group_topk,
                 scaling_factor, dense, max_pos, theta, yarn, eps, bos, eos, model_type="deepseek_v3",
                 nope=128, values=128) -> ModelSpec:
    """DeepSeek-V3's layout (Kimi-K2 and Moonlight are configs of it, GLM-4.7-Flash its own family of the same
    layer): multi-latent attention with a 512 latent, a 64-wide rotary part; sigmoid routing with the correction
    bias."""
    mla = MlaSpec(kv_lora_rank=512, qk_nope_head_dim=nope, qk_rope_head_dim=64, v_head_dim=values, q_lora_rank=q_lora)
    return ModelSpec(
        model_type=model_type, vocab_size=vocab, hidden_size=hidden, ffn_hidden_size=ffn, num_layers=layers,
        num_attention_heads=heads, num_query_groups=heads, kv_channels=mla.q_head_dim, max_position_embeddings=max_pos,
        rope_theta=theta, norm_epsilon=eps, qkv_bias=False, tie_word_embeddings=False, rope_scaling=yarn,
        bos_token_id=bos, eos_token_id=eos, mla=mla, attention="mla",
        moe=MoeSpec(experts, topk, expert_ffn, score_function="sigmoid", expert_bias=True,
                    shared_expert_hidden_size=shared * expert_ffn, layer_pattern=(0,) * dense + (1,) * (layers - dense),
                    num_groups=groups, group_topk=group_topk, topk_scaling_factor=scaling_factor),
    )


def _glm4_moe(hidden, ffn, layers, heads, experts, expert_ffn, dense, scaling_factor, qk_norm) -> ModelSpec:
    """GLM-4.5's layout: 96 query heads and 8 KV groups of 128, half of each rotated, q/k/v biases, DeepSeek-V3's
    router over `experts` (top 8) with one shared expert."""
    return ModelSpec(
        model_type="glm4_moe", vocab_size=151552, hidden_size=hidden, ffn_hidden_size=ffn, num_layers=layers,
        num_attention_heads=heads, num_query_groups=8, kv_channels=128, max_position_embeddings=131072,
        rope_theta=1_000_000.0, norm_epsilon=1e-5, qkv_bias=True, tie_word_embeddings=False, qk_layernorm=qk_norm,
        rotary_percent=0.5, bos_token_id=None, eos_token_id=[151329, 151336, 151338],
        moe=MoeSpec(experts, 8, expert_ffn, score_function="sigmoid", expert_bias=True,
                    shared_expert_hidden_size=expert_ffn, layer_pattern=(0,) * dense + (1,) * (layers - dense),
                    topk_scaling_factor=scaling_factor),
    )


_LLAMA31 = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)

def _glm(context: int, eps: float, post_norms: bool) -> ModelSpec:
    """GLM-4-9B's sizes: 40 layers of hidden 4096, 32 heads in 2 query groups with q/k/v biases, half of each
    128-wide head rotated in interleaved pairs, an MLP of 13696."""
    return ModelSpec(model_type="glm4" if post_norms else "glm", vocab_size=151552, hidden_size=4096,
                     ffn_hidden_size=13696, num_layers=40, num_attention_heads=32, num_query_groups=2, kv_channels=128,
                     max_position_embeddings=context, rope_theta=10000.0, norm_epsilon=eps, qkv_bias=True,
                     tie_word_embeddings=False, rotary_percent=0.5, rotary_interleaved=True, post_norms=post_norms,
                     eos_token_id=[151329, 151336, 151338])


def _gpt_oss(layers: int, experts: int) -> ModelSpec:
    return ModelSpec(
        model_type="gpt_oss", vocab_size=201088, hidden_size=2880, ffn_hidden_size=2880, num_layers=layers,
        num_attention_heads=64, num_query_groups=8, kv_channels=64, max_position_embeddings=131072,
        rope_theta=150000.0, norm_epsilon=1e-5, qkv_bias=True, tie_word_embeddings=False, linear_bias=True,
        attention_sinks=True, sliding_window=128, window_layers=tuple(layer % 2 == 0 for layer in range(layers)),
        rope_scaling=YarnScaling(factor=32.0, original_max_position_embeddings=4096, truncate=False),
        activation="clamped_swiglu", moe=MoeSpec(experts, 4, 2880), bos_token_id=199998, eos_token_id=200002,
    )


def _bloom(hidden: int, layers: int, heads: int) -> ModelSpec:
    return ModelSpec(
        model_type="bloom", vocab_size=250880, hidden_size=hidden, ffn_hidden_size=4 * hidden, num_layers=layers,
        num_attention_heads=heads, num_query_groups=heads, kv_channels=hidden // heads, max_position_embeddings=2048,
        rope_theta=10000.0, norm_epsilon=1e-5, qkv_bias=True, tie_word_embeddings=True, linear_bias=True,
        embedding_norm=True, bos_token_id=1, eos_token_id=2,
    )



def _mpt(hidden: int, layers: int, heads: int, context: int) -> ModelSpec:
    return ModelSpec(
        model_type="mpt", vocab_size=50432, hidden_size=hidden, ffn_hidden_size=4 * hidden, num_layers=layers,
        num_attention_heads=heads, num_query_groups=heads, kv_channels=hidden // heads,
        max_position_embeddings=context, rope_theta=10000.0, norm_epsilon=1e-5, qkv_bias=False,
        tie_word_embeddings=True, bos_token_id=0, eos_token_id=0,
    )



def _gemma2(hidden: int, ffn: int, layers: int, heads: int, groups: int, head_dim: int, scalar: int) -> ModelSpec:
    return ModelSpec(
        model_type="gemma2", vocab_size=256000, hidden_size=hidden, ffn_hidden_size=ffn, num_layers=layers,
        num_attention_heads=heads, num_query_groups=groups, kv_channels=head_dim, max_position_embeddings=8192,
        rope_theta=10000.0, norm_epsilon=1e-6, qkv_bias=False, tie_word_embeddings=True, post_norms=True,
        scaled_embedding=True, softmax_scale=scalar ** -0.5, sliding_window=4096,
        window_layers=tuple(layer % 2 == 0 for layer in range(layers)), attention_softcap=50.0, logit_softcap=30.0,
        bos_token_id=2, eos_token_id=1,
    )


PRESETS: dict[str, ModelSpec] = {
    "qwen2-0.5b": _qwen2(896, 4864, 24, 14, 2, 151936, tied=True),
    "qwen2-1.5b": _qwen2(1536, 8960, 28, 12, 2, 151936, tied=True),
    "qwen2-7b": _qwen2(3584, 18944, 28, 28, 4, 152064, tied=False),
    "qwen2-72b": _qwen2(8192, 29568, 80, 64, 8, 152064, tied=False),
    "qwen2.5-0.5b": _qwen2(896, 4864, 24, 14, 2, 151936, tied=True, max_pos=32768),
    "qwen2.5-7b": _qwen2(3584, 18944, 28, 28, 4, 152064, tied=False),
    "qwen2.5-72b": _qwen2(8192, 29568, 80, 64, 8, 152064, tied=False),
    "llama2-7b": _llama(4096, 11008, 32, 32, 32, 32000, 4096, 10000.0, bos=1, eos=2),
    "llama2-13b": _llama(5120, 13824, 40, 40, 40, 32000, 4096, 10000.0, bos=1, eos=2),
    "llama2-70b": _llama(8192, 28672, 80, 64, 8, 32000, 4096, 10000.0, bos=1, eos=2),
    "llama3-8b": _llama(4096, 14336, 32, 32, 8, 128256, 8192, 500000.0),
    "llama3-70b": _llama(8192, 28672, 80, 64, 8, 128256, 8192, 500000.0),
    "llama3.1-8b": _llama(4096, 14336, 32, 32, 8, 128256, 131072, 500000.0, _LLAMA31),
    "llama3.1-70b": _llama(8192, 28672, 80, 64, 8, 128256, 131072, 500000.0, _LLAMA31),
    "qwen3-0.6b": _qwen3(1024, 3072, 28, 16, 8, tied=True),
    "qwen3-1.7b": _qwen3(2048, 6144, 28, 16, 8, tied=True),
    "qwen3-4b": _qwen3(2560, 9728, 36, 32, 8, tied=True),
    "qwen3-8b": _qwen3(4096, 12288, 36, 32, 8, tied=False),
    "qwen3-14b": _qwen3(5120, 17408, 40, 40, 8, tied=False),
    "qwen3-32b": _qwen3(5120, 25600, 64, 64, 8, tied=False),
    "qwen3-30b-a3b": _qwen3(2048, 6144, 48, 32, 4, tied=False, moe=MoeSpec(128, 8, 768)),
    "qwen3-235b-a22b": _qwen3(4096, 12288, 94, 64, 4, tied=False, moe=MoeSpec(128, 8, 1536)),
    "qwen1.5-moe-a2.7b": _qwen2_moe(2048, 5632, 24, 16, 16, 60, 4, 1408, 5632, max_pos=8192),
    "qwen2-57b-a14b": _qwen2_moe(3584, 18944, 28, 28, 4, 64, 8, 2560, 20480, max_pos=131072),
    # DeepSeek-V3 / R1 (671B total, 37B active, without its multi-token prediction module), Kimi-K2 (1.04T total,
    # 32B active) and Moonlight-16B-A3B (16B total, 3B active)
    "deepseek-v3": _deepseek_v3(129280, 7168, 18432, 61, 128, 1536, 256, 8, 2048, 1, 8, 4, 2.5, 3, 163840, 10000.0,
                                YarnScaling(40.0, 4096, mscale=1.0, mscale_all_dim=1.0), 1e-6, 0, 1).replace(
                                    mtp_num_layers=1),
    "kimi-k2": _deepseek_v3(163840, 7168, 18432, 61, 64, 1536, 384, 8, 2048, 1, 1, 1, 2.827, 1, 131072, 50000.0,
                            YarnScaling(32.0, 4096, beta_fast=1.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
                            1e-6, 163584, 163585),
    "moonlight-16b-a3b": _deepseek_v3(163840, 2048, 11264, 27, 16, None, 64, 6, 1408, 2, 1, 1, 2.446, 1, 8192,
                                      50000.0, None, 1e-5, 163584, 163585),
    # DeepSeek-V2-Lite (15.7B total, 2.4B active): no q low rank, softmax routing over 64 experts without the bias
    "deepseek-v2-lite": _deepseek_v3(102400, 2048, 10944, 27, 16, None, 64, 6, 1408, 2, 1, 1, 1.0, 1, 163840,
                                     10000.0, YarnScaling(40.0, 4096, mscale=0.707, mscale_all_dim=0.707), 1e-6,
                                     100000, 100001, model_type="deepseek_v2").replace(
        moe=MoeSpec(64, 6, 1408, pre_softmax=True, shared_expert_hidden_size=2 * 1408, layer_pattern=(0,) + (1,) * 26)),
    # GLM-4.5-Air (106B total, 12B active) and GLM-4.5 (355B total, 32B active); each, as DeepSeek-V3, with one
    # multi-token prediction layer (num_nextn_predict_layers), which the published totals leave out
    "glm-4.5-air": _glm4_moe(4096, 10944, 46, 96, 128, 1408, 1, 1.0, qk_norm=False).replace(mtp_num_layers=1),
    "glm-4.5": _glm4_moe(5120, 12288, 92, 96, 160, 1536, 3, 2.5, qk_norm=True).replace(mtp_num_layers=1),
    # GLM-4.7-Flash (30B total, 3B active: transformers' Glm4MoeLiteConfig defaults, which are the released model's)
    "glm-4.7-flash": _deepseek_v3(154880, 2048, 10240, 47, 20, 768, 64, 4, 1536, 1, 1, 1, 1.8, 1, 202752, 10000.0,
                                  None, 1e-5, 0, 1, model_type="glm4_moe_lite", nope=192, values=256),
    "mixtral-8x7b": _mixtral(4096, 14336, 32, 32, max_pos=32768),
    "mixtral-8x22b": _mixtral(6144, 16384, 56, 48, max_pos=65536),
    # For CPU demos and tests: a Qwen2-style model of ~0.9M parameters (vocabulary 512 fits qlm's demo tokenizer).
    "qlm-tiny": ModelSpec(
        model_type="qwen2", vocab_size=512, hidden_size=128, ffn_hidden_size=352, num_layers=4,
        num_attention_heads=4, num_query_groups=2, kv_channels=32, max_position_embeddings=4096,
        rope_theta=10000.0, norm_epsilon=1e-6, qkv_bias=True, tie_word_embeddings=False,
    ),
    # For CPU demos and tests: qlm-tiny's attention with Qwen3-MoE's layer (q/k norms, 8 experts, top 2), ~1.4M
    # parameters of which ~0.6M active
    "qlm-tiny-moe": ModelSpec(
        model_type="qwen3_moe", vocab_size=512, hidden_size=128, ffn_hidden_size=352, num_layers=4,
        num_attention_heads=4, num_query_groups=2, kv_channels=32, max_position_embeddings=4096,
        rope_theta=10000.0, norm_epsilon=1e-6, qkv_bias=False, tie_word_embeddings=False, qk_layernorm=True,
        moe=MoeSpec(num_experts=8, topk=2, ffn_hidden_size=64),
    ),
    # For CPU demos and tests: DeepSeek-V3's layer at qlm-tiny's size (multi-latent attention with q's low rank,
    # 8 experts in 4 groups of which 2 are kept, top 2, a shared expert, a dense first layer, one multi-token
    # prediction layer)
    "qlm-tiny-mla": _deepseek_v3(512, 128, 352, 4, 4, 48, 8, 2, 64, 1, 4, 2, 2.5, 1, 4096, 10000.0, None, 1e-6,
                                 None, None).replace(mla=MlaSpec(kv_lora_rank=32, qk_nope_head_dim=32,
                                                                 qk_rope_head_dim=16, v_head_dim=32, q_lora_rank=48),
                                                     kv_channels=48, mtp_num_layers=1),
    # GLM-4-9B (the -hf release, 9.40B) and GLM-4-9B-0414 (its norms after attention and MLP, 9.40B)
    "glm-4-9b": _glm(131072, 1.5625e-07, post_norms=False),
    "glm-4-9b-0414": _glm(32768, 1e-5, post_norms=True),
    # ERNIE-4.5-0.3B (0.36B): tied embeddings, the whole 128-wide head rotated in interleaved pairs
    "ernie-4.5-0.3b": ModelSpec(
        model_type="ernie4_5", vocab_size=103424, hidden_size=1024, ffn_hidden_size=3072, num_layers=18,
        num_attention_heads=16, num_query_groups=2, kv_channels=128, max_position_embeddings=131072,
        rope_theta=500000.0, norm_epsilon=1e-5, qkv_bias=False, tie_word_embeddings=True, rotary_interleaved=True,
        bos_token_id=1, eos_token_id=2,
    ),
    # ERNIE-4.5-21B-A3B (21.83B total, 3.35B active): 64 experts of 1536, top 6, two shared ones, a dense first layer
    "ernie-4.5-21b-a3b": ModelSpec(
        model_type="ernie4_5_moe", vocab_size=103424, hidden_size=2560, ffn_hidden_size=12288, num_layers=28,
        num_attention_heads=20, num_query_groups=4, kv_channels=128, max_position_embeddings=131072,
        rope_theta=500000.0, norm_epsilon=1e-5, qkv_bias=False, tie_word_embeddings=True, rotary_interleaved=True,
        bos_token_id=1, eos_token_id=2, moe=MoeSpec(64, 6, 1536, expert_bias=True, shared_expert_hidden_size=3072,
                                                    layer_pattern=(0,) + (1,) * 27),
    ),
    # OPT-1.3B (1,315,758,080): LayerNorms and biases, ReLU, 2048 learned positions (+ OPT's 2), tied embeddings
    "opt-1.3b": ModelSpec(
        model_type="opt", vocab_size=50272, hidden_size=2048, ffn_hidden_size=8192, num_layers=24,
        num_attention_heads=32, num_query_groups=32, kv_channels=64, max_position_embeddings=2048,
        rope_theta=10000.0, norm_epsilon=1e-5, qkv_bias=True, tie_word_embeddings=True, linear_bias=True,
        bos_token_id=2, eos_token_id=2,
    ),
    # BLOOM-560M (559,214,592), BLOOM-7B1 (7,069,016,064) and BLOOM (176,247,271,424): ALiBi, LayerNorms with biases
    # (one after the embedding), biases on every linear, a tanh-GELU MLP of 4 h, multi-head attention, tied
    "bloom-560m": _bloom(1024, 24, 16),
    "bloom-7b1": _bloom(4096, 30, 32),
    "bloom-176b": _bloom(14336, 70, 112),
    # MPT-7B (6,649,286,656) and MPT-30B (29,957,200,896): ALiBi, LayerNorms without biases, no linear biases, an
    # exact-GELU MLP of 4 h, multi-head attention, tied embeddings
    "mpt-7b": _mpt(4096, 32, 32, 2048),
    "mpt-30b": _mpt(7168, 48, 64, 8192),
    # Gemma-2-2B (2,614,341,888), 9B (9,241,705,984) and 27B (27,227,128,320): windowed (4096) and global layers in
    # turn, attention scores soft-capped at 50 and logits at 30, query_pre_attn_scalar (27B: 144), tied
    "gemma-2-2b": _gemma2(2304, 9216, 26, 8, 4, 256, 256),
    "gemma-2-9b": _gemma2(3584, 14336, 42, 16, 8, 256, 256),
    "gemma-2-27b": _gemma2(4608, 36864, 46, 32, 16, 128, 144),
    # Gemma-3-1B (text, 999,885,952): 26 layers, every 6th global (RoPE base 1e6), the rest windowed to 512 tokens
    # (base 10000); one 256-wide key/value head for 4 query heads; tied embeddings scaled by sqrt(1152)
    "gemma-3-1b": ModelSpec(
        model_type="gemma3_text", vocab_size=262144, hidden_size=1152, ffn_hidden_size=6912, num_layers=26,
        num_attention_heads=4, num_query_groups=1, kv_channels=256, max_position_embeddings=32768,
        rope_theta=1000000.0, norm_epsilon=1e-6, qkv_bias=False, tie_word_embeddings=True, qk_layernorm=True,
        sliding_window=512, window_layers=tuple((layer + 1) % 6 != 0 for layer in range(26)), post_norms=True,
        scaled_embedding=True, softmax_scale=256 ** -0.5, local_rope_theta=10000.0, bos_token_id=2,
        eos_token_id=1,
    ),
    # gpt-oss-20b (20.91B; 3.61B active without the input embedding) and gpt-oss-120b (116.83B; 5.13B), the model
    # card's counts: 32 / 128 experts of 2880, top 4, layers windowed to 128 tokens and full in turn, yarn x32 from
    # 4096, sinks, biases
    "gpt-oss-20b": _gpt_oss(24, 32),
    "gpt-oss-120b": _gpt_oss(36, 128),
    "mistral-7b": ModelSpec(
        model_type="mistral", vocab_size=32000, hidden_size=4096, ffn_hidden_size=14336, num_layers=32,
        num_attention_heads=32, num_query_groups=8, kv_channels=128, max_position_embeddings=32768,
        rope_theta=10000.0, norm_epsilon=1e-5, qkv_bias=False, tie_word_embeddings=False, sliding_window=4096,
        bos_token_id=1, eos_token_id=2,
    ),
}


def load_model_spec(name_or_path: str | Path) -> ModelSpec:
    """A preset name (see presets.py) or an HF model directory / config.json path."""
    key = str(name_or_path).lower()
    if key in PRESETS:
        return PRESETS[key]
    if Path(name_or_path).exists():
        return ModelSpec.from_hf_dir(name_or_path)
    raise QlmError(
        f"{name_or_path!r} is neither a model preset nor a directory",
        f"use one of {', '.join(sorted(PRESETS))} or a path to an HF config",
    )
