"""ModelSpec: the architecture numbers of one decoder, from an HF config.json or a preset name.

Only numbers live here. How the numbers become tensors is gpt.py; how tensors are named and sharded on disk is
models/layout.py.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qlm_core.errors import QlmError
from qlm_core.models.families import (
    FAMILIES,
    HF_ACTIVATIONS,
    SCORE_ARCHITECTURE,
    ActivationName,
    AttentionName,
    HeadName,
    NormName,
    PositionName,
    hf_architecture,
)
from qlm_core.models.mla_spec import MlaSpec, mla_from_hf, mla_to_hf
from qlm_core.models.moe_spec import MOE_MODEL_TYPES, MoeSpec, moe_from_hf, moe_to_hf

SUPPORTED_MODEL_TYPES = tuple(FAMILIES)
# derived from the family table (families.py), for the messages that list them
QK_NORM_MODEL_TYPES = tuple(t for t, f in FAMILIES.items() if f.qk_norm or f.qk_norm_key)
QKV_BIAS_MODEL_TYPES = tuple(t for t, f in FAMILIES.items() if f.qkv_bias != "never")
SLIDING_WINDOW_MODEL_TYPES = tuple(t for t, f in FAMILIES.items() if f.sliding_window == "applied")


@dataclass(frozen=True)
class LinearRopeScaling:
    """Linear frequency scaling (`rope_type: linear`, Gemma 3's global layers): every frequency divided by `factor`,
    Megatron's rotary_seq_len_interpolation_factor."""

    factor: float
    kind: str = "linear"


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1-style frequency scaling (`rope_type: llama3`), the one scaling Megatron-Core also implements."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature 0.1·mscale·ln(factor) + 1 (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class YarnScaling:
    """YaRN (`rope_type: yarn`), as transformers and Megatron-Core's YarnRotaryEmbedding compute it. cos and sin are
    multiplied by `cos_sin_factor`; multi-latent attention also multiplies its softmax scale by
    `softmax_scale_factor` (DeepSeek's mscale_all_dim)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None  # given outright (else from factor, mscale and mscale_all_dim)
    truncate: bool = True

    @property
    def cos_sin_factor(self) -> float:
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)

    @property
    def softmax_scale_factor(self) -> float:
        return yarn_mscale(self.factor, self.mscale_all_dim) ** 2 if self.mscale_all_dim else 1.0

    def to_hf(self) -> dict[str, Any]:
        keys = {"rope_type": "yarn", "factor": self.factor,
                "original_max_position_embeddings": self.original_max_position_embeddings,
                "beta_fast": self.beta_fast, "beta_slow": self.beta_slow}
        keys.update({key: value for key in ("mscale", "mscale_all_dim", "attention_factor")
                     if (value := getattr(self, key)) is not None})
        if not self.truncate:
            keys["truncate"] = False
        return keys


@dataclass(frozen=True)
class ModelSpec:
    model_type: str
    vocab_size: int  # rows of the HF embedding (unpadded); Megatron pads further, see models/layout.py
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int  # head dim
    max_position_embeddings: int
    rope_theta: float
    norm_epsilon: float
    qkv_bias: bool
    tie_word_embeddings: bool
    rope_scaling: RopeScaling | YarnScaling | LinearRopeScaling | None = None
    sliding_window: int | None = None
    # which layers attend within sliding_window (True) and which to every earlier key (Megatron's
    # window_attn_skip_freq list, HF's layer_types); None: every layer when sliding_window is set
    window_layers: tuple[bool, ...] | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    qk_layernorm: bool = False  # Qwen3: q_layernorm / k_layernorm [head_dim] on each head before RoPE
    rotary_percent: float = 1.0  # the share of each head RoPE rotates, its first dims (GLM's partial_rotary_factor)
    rotary_interleaved: bool = False  # RoPE's pairs are (x0, x1), (x2, x3), ... (GLM's; Megatron's same-named flag)
    post_norms: bool = False  # a norm after the attention and one after the MLP, before each residual add (GLM-4)
    scaled_embedding: bool = False  # the embedding's output times sqrt(hidden_size) (Gemma)
    embedding_norm: bool = False  # a norm of the spec's kind after the embedding (BLOOM's word_embeddings_layernorm)
    linear_bias: bool = False  # biases on linear_proj, linear_fc1 and linear_fc2 too (OPT; Megatron's add_bias_linear)
    softmax_scale: float | None = None  # softmax scale (None: kv_channels^-0.5); Gemma: query_pre_attn_scalar^-0.5
    # a learned logit per head in every softmax, with no value (gpt-oss's sinks; Megatron's softmax_type "learnable")
    attention_sinks: bool = False
    # Gemma 2's soft-capping: cap · tanh(x / cap) on each attention score (before its mask) and on each output logit
    attention_softcap: float | None = None
    logit_softcap: float | None = None
    local_rope_theta: float | None = None  # the RoPE base of the windowed layers, unscaled (Gemma 3); None: rope_theta
    moe: MoeSpec | None = None  # Mixture of Experts (None: every layer a dense MLP of ffn_hidden_size)
    mla: MlaSpec | None = None  # multi-latent attention's sizes (attention "mla"); kv_channels is then its q/k head
    # multi-token prediction layers after the decoder (DeepSeek-V3's num_nextn_predict_layers; Megatron's
    # --mtp-num-layers): each predicts one token further, on the last pipeline stage
    mtp_num_layers: int = 0
    # the per-family choices (families.py), each built in one place: models/attention_kinds.py, norms.py,
    # activations.py, positions.py; None: the family's (a preset, a Megatron checkpoint's args)
    attention: AttentionName | None = None
    norm: NormName | None = None
    activation: ActivationName | None = None
    position: PositionName | None = None
    head: HeadName = "lm"  # "score": a reward model's scalar head (families.HeadName); never tied
    # a score head's: transformers' *ForSequenceClassification reads a row's score at its last token before padding
    pad_token_id: int | None = None

    def __post_init__(self):
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise QlmError(
                f"unsupported model_type {self.model_type!r}",
                f"qlm supports {', '.join(SUPPORTED_MODEL_TYPES)}",
            )
        family = FAMILIES[self.model_type]
        for choice in ("attention", "norm", "activation", "position"):
            if getattr(self, choice) is None:
                object.__setattr__(self, choice, getattr(family, choice))
        if (self.moe is not None) != (self.model_type in MOE_MODEL_TYPES):
            raise QlmError(f"model_type {self.model_type!r} {'needs' if self.moe is None else 'takes no'} MoE numbers",
                           f"MoE model types are {', '.join(MOE_MODEL_TYPES)}")
        if self.linear_bias and self.moe is not None and self.moe.shared_expert_hidden_size:
            raise QlmError("biases on the linears of an MoE model with shared experts (qlm's shared experts have "
                           "none)", "drop the biases (add_bias_linear) or the shared experts")
        for name in ("attention_softcap", "logit_softcap"):
            cap = getattr(self, name)
            if cap is not None and not (isinstance(cap, (int, float)) and math.isfinite(cap) and cap > 0):
                raise QlmError(f"{name} {cap!r} is not a positive number", f"set {name} > 0, or None (off)")
        if self.attention_softcap is not None and self.attention != "gqa":
            raise QlmError(f"attention soft-capping with {self.attention!r} attention",
                           "soft-capping goes with grouped-query attention")
        if self.attention_sinks and self.attention != "gqa":
            raise QlmError(f"attention sinks with {self.attention!r} attention",
                           "sinks go with grouped-query attention")
        if not 0 < self.rotary_percent <= 1 or int(self.kv_channels * self.rotary_percent) % 2:
            raise QlmError(f"rotary_percent {self.rotary_percent} of a {self.kv_channels}-wide head",
                           "rotate a share in (0, 1] giving an even number of dims")
        if (self.mla is not None) != (self.attention == "mla"):
            raise QlmError(f"attention {self.attention!r} {'takes no' if self.mla is not None else 'needs'} "
                           "multi-latent attention sizes", "give kv_lora_rank and the head sizes with attention 'mla'")
        if isinstance(self.mtp_num_layers, bool) or not isinstance(self.mtp_num_layers, int) \
                or self.mtp_num_layers < 0:
            raise QlmError(f"mtp_num_layers {self.mtp_num_layers!r} is not a count", "give 0 or more layers")
        if self.mtp_num_layers and self.tie_word_embeddings:
            raise QlmError("multi-token prediction layers with tied embeddings (DeepSeek-V3 and GLM tie none)",
                           "set tie_word_embeddings = false or mtp_num_layers = 0")
        if self.mtp_num_layers and (family.mtp_key is None or self.head == "score"):
            with_mtp = ", ".join(t for t, f in FAMILIES.items() if f.mtp_key)
            raise QlmError(f"multi-token prediction layers in a {self.model_type}"
                           f"{' score' if self.head == 'score' else ''} model",
                           f"they go with the language models of {with_mtp}")
        if self.head == "score" and self.tie_word_embeddings:
            raise QlmError("a score head is never tied to the embedding", "set tie_word_embeddings = false")
        self._settle_windows()
        if self.num_attention_heads % self.num_query_groups:
            raise QlmError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_query_groups}",
                "fix the config",
            )

    def _settle_windows(self):
        """window_layers checked and kept only where it says something: all windowed -> None; none -> no window."""
        if self.window_layers is None:
            return
        layers = tuple(self.window_layers)
        if len(layers) != self.num_layers or any(not isinstance(x, bool) for x in layers):
            raise QlmError(f"window_layers {list(layers)!r} is not one true/false per layer of a "
                           f"{self.num_layers}-layer model", "give one true (windowed) or false (full) per layer")
        if self.sliding_window is None:
            raise QlmError("window_layers without a sliding_window", "set sliding_window or drop window_layers")
        if all(layers):
            layers = None
        elif not any(layers):
            layers = None
            object.__setattr__(self, "sliding_window", None)
        object.__setattr__(self, "window_layers", layers)

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer `layer` (0-based; a multi-token prediction layer takes the last layer's);
        None: the layer attends to every earlier key."""
        if self.sliding_window is None or self.window_layers is None:
            return self.sliding_window
        return self.sliding_window if self.window_layers[min(layer, self.num_layers - 1)] else None

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Every layer's window, layer by layer."""
        return tuple(self.layer_window(layer) for layer in range(self.num_layers))

    @property
    def head_outputs(self) -> int:
        """The last stage's outputs per token: the vocabulary's logits, or a score head's one score."""
        return 1 if self.head == "score" else self.vocab_size

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups

    @property
    def rope_dim(self) -> int:
        """The size RoPE rotates per head: the whole head, or multi-latent attention's rotary part."""
        if self.mla is not None:
            return self.mla.qk_rope_head_dim
        return int(self.kv_channels * self.rotary_percent)

    @property
    def qkv_rows(self) -> int:
        return (self.num_attention_heads + 2 * self.num_query_groups) * self.kv_channels

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and self.moe.is_moe_layer(layer)

    def replace(self, **changes) -> ModelSpec:
        return dataclasses.replace(self, **changes)

    # ---- Hugging Face config.json ---------------------------------------------------------------------------------

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> ModelSpec:
        model_type = config.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise QlmError(
                f"unsupported model_type {model_type!r} in config.json",
                f"qlm supports {', '.join(SUPPORTED_MODEL_TYPES)}",
            )
        family = FAMILIES[model_type]
        config = _family_config(config, model_type)
        act = config.get(family.activation_key, HF_ACTIVATIONS[family.activation])
        named = {HF_ACTIVATIONS[kind]: kind for kind in (family.activation, *family.other_activations)}
        if act not in named:
            raise QlmError(f"{family.activation_key} {act!r} is not supported for {model_type}",
                           f"{model_type}'s MLP is {' or '.join(map(repr, named))}")
        for flag in ("attention_bias", "mlp_bias", "use_bias"):  # use_bias: ERNIE 4.5's, on every linear
            if (family.qkv_bias == "never" or (flag == "mlp_bias" and family.qkv_bias == "attention_bias")) \
                    and config.get(flag):
                raise QlmError(f"{flag}=true is not supported for {model_type}", "use a checkpoint without biases")
        sizes = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        missing = [key for key in sizes if key not in config]
        wrong = [f"{key} is {config[key]!r}" for key in sizes if key in config and (
            isinstance(config[key], bool) or not isinstance(config[key], int) or config[key] < 1)]
        if missing or wrong:
            found = "; ".join(([f"has no {', '.join(missing)}"] if missing else [])
                              + ([f"{', '.join(wrong)}, not a positive integer"] if wrong else []))
            raise QlmError(f"config.json ({model_type}): {found}",
                           "use a complete config.json from transformers (save_pretrained writes one)")
        _check_optional_numbers(config, model_type)
        heads = config["num_attention_heads"]
        theta, scaling = _read_rope(config)
        gemma = _read_gemma(config, model_type) if family.gemma_attention else {}
        gemma.update(_read_softcaps(config, model_type) if family.softcapping else {})
        if "rope" in gemma:  # Gemma 3's per layer type
            theta, scaling = gemma.pop("rope")
        sliding, window_layers = _read_windows(config, model_type)
        linear_bias = family.linear_bias or (family.qkv_bias == "enable_bias" and bool(config.get("enable_bias", True)))
        qkv_bias = family.qkv_bias == "always" or (family.qkv_bias == "config" and bool(config.get("qkv_bias", True))) \
            or (family.qkv_bias == "attention_bias" and bool(config.get("attention_bias", False))) or linear_bias
        rotary_percent = _rotary_percent(config, model_type)
        moe = moe_from_hf(config, model_type, config["num_hidden_layers"]) if family.moe else None
        mla = mla_from_hf(config, model_type) if family.attention == "mla" else None
        if mla is not None and config.get("attention_bias"):
            raise QlmError(f"attention_bias=true is not supported for {model_type}", "use a checkpoint without biases")
        head = _read_head(config, model_type)
        mtp = 0
        if family.mtp_key and head == "lm":
            mtp = config.get(family.mtp_key) or 0
            if isinstance(mtp, bool) or not isinstance(mtp, int) or mtp < 0:
                raise QlmError(f"config.json ({model_type}): {family.mtp_key} is {mtp!r}, not a count of layers",
                               "set it as transformers writes it (0 or more)")
        return cls(
            model_type=model_type,
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            ffn_hidden_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_attention_heads=heads,
            # multi-latent attention: every head its own keys and values, of its own sizes
            num_query_groups=heads if mla else config.get("num_key_value_heads") or heads,
            kv_channels=mla.q_head_dim if mla else config.get("head_dim") or config["hidden_size"] // heads,
            max_position_embeddings=config.get("max_position_embeddings", family.max_positions_default),
            rope_theta=theta,
            norm_epsilon=family.norm_epsilon or config.get("rms_norm_eps", family.norm_epsilon_default),
            qkv_bias=qkv_bias,
            tie_word_embeddings=head == "lm" and bool(config.get("tie_word_embeddings", family.tied_default)),
            rope_scaling=scaling,
            sliding_window=sliding,
            window_layers=window_layers,
            bos_token_id=config.get("bos_token_id"),
            eos_token_id=config.get("eos_token_id"),
            qk_layernorm=family.qk_norm or bool(family.qk_norm_key and config.get(family.qk_norm_key)),
            rotary_percent=rotary_percent,
            rotary_interleaved=family.rotary_interleaved,
            post_norms=family.post_norms is not None,
            scaled_embedding=family.scaled_embedding,
            embedding_norm=family.embedding_norm,
            linear_bias=linear_bias,
            attention_sinks=family.sinks,
            activation=named[act],
            **gemma,
            moe=moe,
            mla=mla,
            mtp_num_layers=mtp,
            head=head,
            pad_token_id=config.get("pad_token_id") if head == "score" else None,
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> ModelSpec:
        return cls.from_hf_config(read_hf_config(path))

    def to_hf_config(self, torch_dtype: str = "bfloat16") -> dict[str, Any]:
        """A config.json transformers loads (4.x `rope_theta`/`rope_scaling` keys, which 5.x also reads)."""
        family = FAMILIES[self.model_type]
        self._check_hf_choices(family)
        switched = {"qk_layernorm": family.qk_norm_key is not None,  # config.json says either way
                    "qkv_bias": family.qkv_bias in ("config", "attention_bias", "enable_bias")}
        if self.linear_bias != (family.linear_bias or (family.qkv_bias == "enable_bias" and self.qkv_bias)) \
                or (family.qkv_bias == "enable_bias" and self.qkv_bias != self.linear_bias):
            raise QlmError(f"a {self.model_type} model with{'' if self.linear_bias else 'out'} biases on its other "
                           f"linears{'' if self.qkv_bias else ', not on q/k/v'} has no Hugging Face config",
                           "biases on every linear go with OPT (enable_bias) and gpt-oss, and on q, k and v alike")
        for flag, held in (("rotary_interleaved", family.rotary_interleaved),
                           ("post_norms", family.post_norms is not None)):
            if getattr(self, flag) != held:  # HF's class of the family fixes it
                with_it = ", ".join(t for t, f in FAMILIES.items()
                                    if (f.rotary_interleaved if flag == "rotary_interleaved" else f.post_norms))
                raise QlmError(f"a {self.model_type} model {'with' if getattr(self, flag) else 'without'} {flag} "
                               "has no Hugging Face config", f"{flag} goes with model types {with_it}")
        for flag, types in (("qk_layernorm", QK_NORM_MODEL_TYPES), ("qkv_bias", QKV_BIAS_MODEL_TYPES)):
            if not switched[flag] and getattr(self, flag) != (self.model_type in types):  # HF would lack them
                raise QlmError(f"a {self.model_type} model {'with' if getattr(self, flag) else 'without'} {flag} "
                               "has no Hugging Face config", f"{flag} goes with model types {', '.join(types)}")
        config: dict[str, Any] = {
            "architectures": [hf_architecture(self.model_type, self.head)],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.ffn_hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_query_groups,
            "head_dim": self.kv_channels,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.norm_epsilon,
            family.activation_key: HF_ACTIVATIONS[self.activation],
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": torch_dtype,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
        }
        if isinstance(self.rope_scaling, YarnScaling):
            config["rope_scaling"] = self.rope_scaling.to_hf()
        elif self.rope_scaling is not None:
            config["rope_scaling"] = {"rope_type": "llama3", **dataclasses.asdict(self.rope_scaling)}
        if self.mla is not None:
            config.update(mla_to_hf(self.mla), head_dim=self.mla.qk_rope_head_dim,
                          num_key_value_heads=self.num_attention_heads)
        config.update(_windows_to_hf(self))
        if family.declares_no_bias:
            config.update(attention_bias=False, mlp_bias=False)
        if family.qkv_bias == "config":
            config["qkv_bias"] = self.qkv_bias
        if family.qkv_bias == "enable_bias":
            config["enable_bias"] = self.linear_bias
        if family.qkv_bias == "attention_bias":
            config["attention_bias"] = self.qkv_bias
        if family.qk_norm_key:
            config[family.qk_norm_key] = self.qk_layernorm
        if self.rotary_percent != family.rotary_percent or self.rotary_percent != 1.0:
            config["partial_rotary_factor"] = self.rotary_percent  # written wherever the family's default differs
        if self.moe is not None:
            config.update(moe_to_hf(self.moe, self.model_type, self.num_layers))
        if family.mtp_key:
            config[family.mtp_key] = self.mtp_num_layers
        if family.gemma_attention:  # its RoPE per layer type replaces rope_theta / rope_scaling
            config.pop("rope_theta", None)
            config.pop("rope_scaling", None)
            config.update(_gemma_to_hf(self))
        if family.softcapping:  # Gemma 2
            config.update(query_pre_attn_scalar=_pre_attn_scalar(self), attn_logit_softcapping=self.attention_softcap,
                          final_logit_softcapping=self.logit_softcap)
        config.update(family.fixed_config)
        for ours, theirs in family.config_aliases:
            config[theirs] = config.pop(ours)
        if family.plain_heads and (self.num_query_groups != self.num_attention_heads
                                   or self.kv_channels * self.num_attention_heads != self.hidden_size):
            raise QlmError(f"an {self.model_type} model with grouped queries or heads not hidden_size / heads wide "
                           "has no Hugging Face config", "keep it in a Megatron format")
        if family.embedding_width_key:
            config[family.embedding_width_key] = self.hidden_size
        for key in family.unread_config:
            config.pop(key, None)
        if self.pad_token_id is not None:
            config["pad_token_id"] = self.pad_token_id
        if self.head == "score":  # num_labels 1, as transformers writes it
            config.update(id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
        return config

    def _check_hf_choices(self, family) -> None:
        """The choices transformers' class of the family fixes: another one (a Megatron checkpoint's LayerNorm on a
        Llama, say) has no Hugging Face config, and writing one would change the model."""
        allowed = {"attention": (family.attention,), "norm": (family.norm,), "position": (family.position,),
                   "activation": (family.activation, *family.other_activations)}
        for choice, values in allowed.items():
            if getattr(self, choice) not in values:
                raise QlmError(f"a {self.model_type} model with {choice} {getattr(self, choice)!r} has no Hugging "
                               f"Face config ({self.model_type}'s is {' or '.join(map(repr, values))})",
                               "keep it in a Megatron format")
        fixed = {"scaled_embedding": self.scaled_embedding != family.scaled_embedding,
                      "embedding_norm": self.embedding_norm != family.embedding_norm,
                      "MLP width": family.ffn_ratio is not None
                      and self.ffn_hidden_size != family.ffn_ratio * self.hidden_size,
                      "softmax_scale": self.softmax_scale is not None
                      and not (family.gemma_attention or family.softcapping),
                      "soft-capping": (self.attention_softcap is not None or self.logit_softcap is not None)
                      and not family.softcapping,
                      "local_rope_theta": self.local_rope_theta is not None and not family.gemma_attention,
                      "linear rope scaling": isinstance(self.rope_scaling, LinearRopeScaling)
                      and not family.gemma_attention,
                      "norm_epsilon": family.norm_epsilon is not None and self.norm_epsilon != family.norm_epsilon,
                      # transformers' class of the family has them or not (gpt-oss's self_attn.sinks)
                      "attention_sinks": self.attention_sinks != family.sinks}
        for what, differs in fixed.items():
            if differs:
                raise QlmError(f"a {self.model_type} model with this {what} has no Hugging Face config",
                               "keep it in a Megatron format")

    def check_positions(self, seq_length: int, what: str = "data.seq_length") -> None:
        """Learned positions (OPT) have no row past max_position_embeddings: a longer sequence cannot run."""
        if self.position == "learned_absolute" and seq_length > self.max_position_embeddings:
            raise QlmError(f"{what} = {seq_length} is longer than the model's {self.max_position_embeddings} "
                           "learned positions", f"lower {what} to {self.max_position_embeddings} or less")

    def as_reward_model(self) -> ModelSpec:
        """This decoder with a score head (a reward model started from a language model: the head is new)."""
        return self.replace(head="score", tie_word_embeddings=False, mtp_num_layers=0)  # a score needs no MTP


# optional config.json numbers: key -> (kind, least); None is always allowed (the key's default)
_OPTIONAL_NUMBERS = {"num_key_value_heads": (int, 1), "head_dim": (int, 1), "max_position_embeddings": (int, 1),
                     "rope_theta": (float, 0.0), "rms_norm_eps": (float, 0.0)}


def _rotary_percent(config: dict[str, Any], model_type: str) -> float:
    """partial_rotary_factor (transformers 5 keeps it in rope_parameters), 1.0 when absent."""
    params = config.get("rope_parameters") if isinstance(config.get("rope_parameters"), dict) else {}
    value = params.get("partial_rotary_factor", config.get("partial_rotary_factor"))
    if value is None:
        return FAMILIES[model_type].rotary_percent
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise QlmError(f"config.json ({model_type}): partial_rotary_factor is {value!r}, not in (0, 1]",
                       "set it as transformers writes it")
    head = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    if int(head * value) % 2:
        raise QlmError(f"config.json ({model_type}): partial_rotary_factor {value} rotates an odd {head * value} "
                       f"of {head} head dims", "RoPE rotates pairs: use a factor giving an even size")
    return float(value)


def _read_head(config: dict[str, Any], model_type: str) -> str:
    """"score" for a *ForSequenceClassification model with one label, "lm" otherwise."""
    architectures = config.get("architectures") or []
    if not any(isinstance(a, str) and a.endswith(SCORE_ARCHITECTURE[1]) for a in architectures):
        return "lm"
    labels = config.get("num_labels", len(config.get("id2label") or {"0": None}))
    if labels != 1:
        raise QlmError(f"config.json ({model_type}): a sequence classifier with {labels} labels",
                       "qlm reads one-label classifiers (reward models, num_labels = 1)")
    return "score"


_LAYER_TYPES = {"sliding_attention": True, "full_attention": False}


def _read_windows(config: dict[str, Any], model_type: str) -> tuple[int | None, tuple[bool, ...] | None]:
    """(sliding_window, window_layers) as transformers reads config.json: Mistral's window holds for every layer;
    the Qwens' only with use_sliding_window, and then for the layers their config class's layer_types marks (each
    family has its own default rule, so transformers' config class works it out)."""
    family = FAMILIES[model_type]
    if family.sliding_window == "applied":
        return config.get("sliding_window"), None
    if family.sliding_window == "none" or (family.sliding_window != "layers" and not config.get("use_sliding_window")):
        return None, None
    window = config.get("sliding_window")
    if window is None or window == 0:
        return None, None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise QlmError(f"config.json ({model_type}): sliding_window is {window!r}, not a positive integer",
                       "set it to a positive token count, or use_sliding_window to false")
    if family.sliding_window == "gated":
        return window, None
    from transformers import AutoConfig  # only here: each family's own rule for the layers it windows

    layer_types = getattr(AutoConfig.for_model(**config), "layer_types", None) or []
    unknown = sorted({t for t in layer_types if t not in _LAYER_TYPES})
    if unknown or len(layer_types) != config["num_hidden_layers"]:
        raise QlmError(f"config.json ({model_type}): layer_types {layer_types!r} is not one of "
                       f"{', '.join(_LAYER_TYPES)} per layer", "set it as transformers writes it, or drop it")
    return window, tuple(_LAYER_TYPES[t] for t in layer_types)


def _windows_to_hf(spec: ModelSpec) -> dict[str, Any]:
    """config.json's keys for the spec's windows, as _read_windows reads them back."""
    family = FAMILIES[spec.model_type]
    if spec.sliding_window is None:
        if family.sliding_window == "layers":  # Gemma 2 / 3, gpt-oss: their config classes window by layer_types
            return {"sliding_window": None, "layer_types": ["full_attention"] * spec.num_layers}
        return {"sliding_window": None} if family.sliding_window == "applied" else (
            {} if family.sliding_window == "none" else {"use_sliding_window": False})
    per_layer_families = ("gated_layers", "layers")
    if family.sliding_window == "none" or (spec.window_layers is not None
                                           and family.sliding_window not in per_layer_families):
        per_layer = ", ".join(t for t, f in FAMILIES.items() if f.sliding_window in per_layer_families)
        raise QlmError(f"a {spec.model_type} model with a sliding window on "
                       f"{'some of its layers' if spec.window_layers else 'its layers'} has no Hugging Face config",
                       f"windows on some layers go with {per_layer}" if spec.window_layers else
                       "export a model without a window")
    if family.sliding_window == "applied":
        return {"sliding_window": spec.sliding_window}
    if family.sliding_window == "layers":
        return {"sliding_window": spec.sliding_window, "layer_types": [
            next(t for t, w in _LAYER_TYPES.items() if w == (spec.layer_window(layer) is not None))
            for layer in range(spec.num_layers)]}
    hf = {"use_sliding_window": True, "sliding_window": spec.sliding_window}
    if family.sliding_window == "gated_layers":
        windowed = [spec.layer_window(layer) is not None for layer in range(spec.num_layers)]
        first = windowed.index(True)
        hf["layer_types"] = [next(t for t, w in _LAYER_TYPES.items() if w == x) for x in windowed]
        # transformers 4.x reads max_window_layers instead (Qwen2: layers from it on are windowed)
        hf["max_window_layers"] = first if all(windowed[first:]) else spec.num_layers
    return hf


def _read_gemma(config: dict[str, Any], model_type: str) -> dict[str, Any]:
    """Gemma 3's attention: query_pre_attn_scalar's softmax scale, and its RoPE per layer type (transformers 5's
    rope_parameters {"full_attention": ..., "sliding_attention": ...}; 4.x's rope_theta, rope_scaling and
    rope_local_base_freq), read through transformers' own config class. Softcapping is refused."""
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if config.get(key) is not None:
            raise QlmError(f"config.json ({model_type}): {key} = {config[key]!r} (Gemma 2's soft-capping)",
                           "qlm builds Gemma 3, whose configs set it to null")
    if config.get("use_bidirectional_attention"):
        raise QlmError(f"config.json ({model_type}): use_bidirectional_attention = true (an encoder)",
                       "qlm builds causal decoders")
    from transformers import AutoConfig  # only here: transformers fills each layer type's RoPE defaults

    params = AutoConfig.for_model(**config).rope_parameters
    full, local = params["full_attention"], params["sliding_attention"]
    if local.get("rope_type", "default") != "default":
        raise QlmError(f"config.json ({model_type}): the sliding layers' RoPE is {local['rope_type']!r}",
                       "Gemma 3's sliding layers use plain RoPE")
    kind = full.get("rope_type", "default")
    if kind not in ("default", "linear"):
        raise QlmError(f"config.json ({model_type}): rope_type {kind!r} on the global layers",
                       "qlm reads Gemma 3's default and linear RoPE")
    scaling = LinearRopeScaling(float(full["factor"])) if kind == "linear" else None
    return {"rope": (_positive_theta(full["rope_theta"]), scaling),
            "softmax_scale": _read_pre_attn_scalar(config, model_type) ** -0.5,
            "local_rope_theta": _positive_theta(local["rope_theta"])}


def _read_softcaps(config: dict[str, Any], model_type: str) -> dict[str, Any]:
    """Gemma 2's query_pre_attn_scalar (its softmax scale) and its two soft-caps (each a positive number or null)."""
    out = {}
    for key, field in (("attn_logit_softcapping", "attention_softcap"), ("final_logit_softcapping", "logit_softcap")):
        cap = config.get(key)
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or not math.isfinite(cap)
                                or cap <= 0):
            raise QlmError(f"config.json ({model_type}): {key} is {cap!r}", "set a positive number, or null (off)")
        out[field] = None if cap is None else float(cap)
    if config.get("use_bidirectional_attention"):
        raise QlmError(f"config.json ({model_type}): use_bidirectional_attention = true (an encoder)",
                       "qlm builds causal decoders")
    return {**out, "softmax_scale": _read_pre_attn_scalar(config, model_type) ** -0.5}


def _read_pre_attn_scalar(config: dict[str, Any], model_type: str) -> float:
    """Gemma's query_pre_attn_scalar (default 256), whose -1/2 power is the softmax scale."""
    scalar = config.get("query_pre_attn_scalar", 256)
    if isinstance(scalar, bool) or not isinstance(scalar, (int, float)) or scalar <= 0:
        raise QlmError(f"config.json ({model_type}): query_pre_attn_scalar is {scalar!r}", "set a positive number")
    return scalar


def _pre_attn_scalar(spec: ModelSpec) -> float:
    """query_pre_attn_scalar of the spec's softmax scale (an integer where it is one)."""
    scalar = (spec.softmax_scale or spec.kv_channels ** -0.5) ** -2
    return round(scalar) if abs(scalar - round(scalar)) < 1e-6 else scalar


def _gemma_to_hf(spec: ModelSpec) -> dict[str, Any]:
    full = {"rope_type": "default", "rope_theta": spec.rope_theta}
    if isinstance(spec.rope_scaling, LinearRopeScaling):
        full.update(rope_type="linear", factor=spec.rope_scaling.factor)
    elif spec.rope_scaling is not None:
        raise QlmError(f"a {spec.model_type} model with {type(spec.rope_scaling).__name__} has no Hugging Face config",
                       "Gemma 3's global layers take default or linear RoPE")
    local = {"rope_type": "default", "rope_theta": spec.local_rope_theta or spec.rope_theta}
    return {"query_pre_attn_scalar": _pre_attn_scalar(spec),
            "rope_parameters": {"full_attention": full, "sliding_attention": local},
            "attn_logit_softcapping": None, "final_logit_softcapping": None}


def _family_config(config: dict[str, Any], model_type: str) -> dict[str, Any]:
    """config.json with the family's own size keys under ModelSpec's names (OPT's ffn_dim as intermediate_size),
    after checking the switches its one supported layout fixes (OPT: pre-norm, biases, affine norms)."""
    family = FAMILIES[model_type]
    for key, value in family.fixed_config:
        if key in config and config[key] != value:
            raise QlmError(f"config.json ({model_type}): {key} is {config[key]!r}; qlm builds {model_type} with "
                           f"{key} = {value!r}", f"use a {model_type} model with {key} = {value!r}")
    if family.softcapping:  # Gemma 2: keys config.json leaves out take Gemma2Config's defaults (a window, both caps)
        from transformers import AutoConfig  # only here: transformers' own defaults

        defaults = AutoConfig.for_model(**config)
        config = {**config, **{key: getattr(defaults, key) for key in (
            "sliding_window", "attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar")
            if key not in config}}
    for section, key, value in family.fixed_nested:  # MPT's attn_config: what transformers' MPT runs
        held = config.get(section) if isinstance(config.get(section), dict) else {}
        if held.get(key, value) != value:
            raise QlmError(f"config.json ({model_type}): {section}.{key} is {held[key]!r}; qlm builds {model_type} "
                           f"with {section}.{key} = {value!r}", f"use a {model_type} model with {key} = {value!r}")
    width = family.embedding_width_key
    if width and config.get(width, config.get("hidden_size")) != config.get("hidden_size"):
        raise QlmError(f"config.json ({model_type}): {width} {config[width]} differs from hidden_size "
                       f"{config.get('hidden_size')} (projected embeddings)",
                       "use a model whose embedding is hidden_size wide (every OPT but 350M)")
    aliased = {ours: config[theirs] for ours, theirs in family.config_aliases if theirs in config}
    config = {**config, **aliased}
    for ours, theirs in family.read_aliases:  # older spellings, read where the current key is absent (BLOOM's n_embed)
        if ours not in config and theirs in config:
            config[ours] = config[theirs]
    # keys the family's config class never reads (a config.json built with them keeps them as plain attributes):
    # OPT is multi-head attention of hidden_size / heads, whatever other keys its config.json holds
    config = {key: value for key, value in config.items() if key not in family.unread_config}
    if family.ffn_ratio is not None and isinstance(config.get("hidden_size"), int):  # BLOOM's MLP: 4 h
        config["intermediate_size"] = family.ffn_ratio * config["hidden_size"]
    return config


def _check_optional_numbers(config: dict[str, Any], model_type: str):
    """The optional sizes of config.json, each a number in its range when present (transformers refuses the same
    configs; a string or a zero would otherwise surface as a traceback deep in a conversion or a decode)."""
    sliding = {"sliding_window": (int, 1)} if model_type in SLIDING_WINDOW_MODEL_TYPES else {}  # else ungated
    for key, (kind, least) in {**_OPTIONAL_NUMBERS, **sliding}.items():
        value = config.get(key)
        if value is None:
            continue
        number = not isinstance(value, bool) and (isinstance(value, int) if kind is int
                                                  else isinstance(value, (int, float)))
        if not number or (value < least if kind is int else not (math.isfinite(value) and value > least)):
            what = "a positive integer" if kind is int else "a positive number"
            fix = ("set it to null (no window) or a positive token count" if key == "sliding_window"
                   else f"set {key} to {what}, as transformers writes it")
            raise QlmError(f"config.json ({model_type}): {key} is {value!r}, not {what}", fix)


def _read_rope(config: dict[str, Any]) -> tuple[float, RopeScaling | YarnScaling | None]:
    """transformers 4.x keeps `rope_theta` + `rope_scaling`; 5.x folds both into `rope_parameters`."""
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or {}
    for key, value in (("rope_parameters", params), ("rope_scaling", scaling)):
        if not isinstance(value, dict):
            raise QlmError(f"config.json: {key} is {value!r}, not an object", f"set {key} as transformers writes it")
    if "rope_type" in params or "type" in params:
        scaling = params
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind == "default":
        return _positive_theta(theta), None
    if kind == "yarn":
        return _positive_theta(theta), _read_yarn(config, scaling)
    if kind != "llama3":
        raise QlmError(f"rope scaling type {kind!r} is not supported", "qlm supports no scaling, 'llama3' or 'yarn'")
    try:
        numbers = (float(theta), float(scaling["factor"]), float(scaling.get("low_freq_factor", 1.0)),
                   float(scaling.get("high_freq_factor", 4.0)),
                   int(scaling.get("original_max_position_embeddings", 8192)))
    except (KeyError, TypeError, ValueError) as exc:
        raise QlmError(f"config.json: the llama3 rope scaling {scaling!r} is incomplete or not numeric ({exc!r})",
                       "give rope_theta and rope_scaling's factor, low_freq_factor, high_freq_factor and "
                       "original_max_position_embeddings as numbers") from None
    if not all(math.isfinite(n) and n > 0 for n in numbers):
        raise QlmError(f"config.json: the llama3 rope scaling {scaling!r} holds a number that is not positive",
                       "give positive numbers, as transformers writes them")
    return numbers[0], RopeScaling(*numbers[1:])


def _positive_theta(theta) -> float:
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not (math.isfinite(theta) and theta > 0):
        raise QlmError(f"config.json: rope_theta is {theta!r}, not a positive number",
                       "set rope_theta as transformers writes it (e.g. 10000.0)")
    return float(theta)


def _read_yarn(config: dict[str, Any], scaling: dict[str, Any]) -> YarnScaling:
    """transformers' yarn keys; a null factor is max_position_embeddings over the original (as transformers reads
    it)."""
    def number(key, default=None, kind=float):
        value = scaling.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
            raise QlmError(f"config.json: yarn rope scaling's {key} is {value!r}, not a positive number",
                           f"set {key} as transformers writes it")
        return kind(value)

    original = number("original_max_position_embeddings")
    if original is not None and not float(original).is_integer():
        raise QlmError(f"config.json: yarn rope scaling's original_max_position_embeddings is {original!r}, not a "
                       "whole number of tokens", "set it as transformers writes it")
    original = None if original is None else int(original)
    if original is None:
        raise QlmError("config.json: yarn rope scaling without original_max_position_embeddings",
                       "give the context the model was pretrained at, as transformers writes it")
    factor = number("factor")
    if factor is None:
        factor = float(config.get("max_position_embeddings", original)) / original
    return YarnScaling(factor=factor, original_max_position_embeddings=original,
                       beta_fast=number("beta_fast", 32.0), beta_slow=number("beta_slow", 1.0),
                       mscale=number("mscale"), mscale_all_dim=number("mscale_all_dim"),
                       attention_factor=number("attention_factor"), truncate=_truncate(scaling))


def _truncate(scaling: dict[str, Any]) -> bool:
    value = scaling.get("truncate", True)
    if not isinstance(value, bool):
        raise QlmError(f"config.json: yarn rope scaling's truncate is {value!r}, not true or false",
                       "set truncate as transformers writes it")
    return value


def read_hf_config(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.exists():
        raise QlmError(f"no config.json in {path}", "point at a Hugging Face model directory")
    try:
        config = json.loads(file.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise QlmError(f"{file} is not UTF-8 text (offset {exc.start})", "restore a valid config.json") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise QlmError(f"cannot read {file}: {exc}", "restore a valid config.json") from None
    if not isinstance(config, dict):
        raise QlmError(f"{file} holds a JSON {type(config).__name__}, not an object", "restore a valid config.json")
    return config


def parameters_text(total: int, active: int | None = None) -> str:
    """A parameter count as people write it ("1.12M", "30.53B"); an MoE model's as "30.53B total, 3.35B active"."""
    def count(n: int) -> str:
        return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"

    return count(total) if active is None or active == total else f"{count(total)} total, {count(active)} active"


def padded_vocab_size(vocab_size: int, divisible_by: int = 128, tp: int = 1) -> int:
    """Megatron's rule: round the vocabulary up to a multiple of divisible_by * TP (pad rows go at the end)."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple
