"""MlaSpec: the numbers of multi-latent attention (DeepSeek-V2/V3, Kimi-K2, GLM-4.7-Flash), and their Hugging Face
config keys.

q goes through a low-rank down-projection, its RMSNorm and an up-projection (a plain projection when q_lora_rank is
null); keys and values share one compressed latent of kv_lora_rank with its RMSNorm and up-projection, plus one
rotary key part shared by every head. HF's `qk_nope_head_dim` is Megatron-Core's `qk_head_dim` and HF's
`qk_rope_head_dim` its `qk_pos_emb_head_dim`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from qlm_core.errors import QlmError


@dataclass(frozen=True)
class MlaSpec:
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None  # None: q is one projection of the hidden state (DeepSeek-V2-Lite)
    # how HF's tensors lay out the rotary rows: True, in pairs (x0, x1), (x2, x3) ... (DeepSeek's own weights, and
    # Megatron-Core's layout always); False, in halves (the layout module reorders them into pairs)
    rope_interleave: bool = True

    def __post_init__(self):
        sizes = {"kv_lora_rank": self.kv_lora_rank, "qk_nope_head_dim": self.qk_nope_head_dim,
                 "qk_rope_head_dim": self.qk_rope_head_dim, "v_head_dim": self.v_head_dim}
        if self.q_lora_rank is not None:
            sizes["q_lora_rank"] = self.q_lora_rank
        wrong = [f"{key} is {value!r}" for key, value in sizes.items()
                 if isinstance(value, bool) or not isinstance(value, int) or value < 1]
        if wrong:
            raise QlmError(f"multi-latent attention: {', '.join(wrong)}, not a positive integer",
                           "set the sizes as transformers writes them")
        if self.qk_rope_head_dim % 2:
            raise QlmError(f"qk_rope_head_dim {self.qk_rope_head_dim} is odd", "RoPE rotates pairs: use an even size")
        if self.v_head_dim > self.q_head_dim:  # the kernels take one head size: values are padded up to the keys'
            raise QlmError(f"v_head_dim {self.v_head_dim} is wider than the q/k head ({self.q_head_dim})",
                           "qlm builds multi-latent attention with values no wider than keys, as every released "
                           "model has them")

    @property
    def q_head_dim(self) -> int:
        """A query's (and a key's) size per head: its no-position part and its rotary part."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim


def mla_from_hf(config: dict[str, Any], model_type: str) -> MlaSpec:
    def size(key: str, required: bool = True):
        value = config.get(key)
        if value is None and not required:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise QlmError(f"config.json ({model_type}): {key} is {value!r}, not a positive integer",
                           f"set {key} as transformers writes it")
        return value

    # transformers' DeepseekV2 rotates the rotary rows as complex pairs whatever rope_interleave says
    interleave = True if model_type == "deepseek_v2" else config.get("rope_interleave", True)
    if not isinstance(interleave, bool):
        raise QlmError(f"config.json ({model_type}): rope_interleave is {interleave!r}, not true or false",
                       "set rope_interleave as transformers writes it")
    return MlaSpec(kv_lora_rank=size("kv_lora_rank"), qk_nope_head_dim=size("qk_nope_head_dim"),
                   qk_rope_head_dim=size("qk_rope_head_dim"), v_head_dim=size("v_head_dim"),
                   q_lora_rank=size("q_lora_rank", required=False), rope_interleave=interleave)


def mla_to_hf(mla: MlaSpec) -> dict[str, Any]:
    return {"kv_lora_rank": mla.kv_lora_rank, "q_lora_rank": mla.q_lora_rank,
            "qk_nope_head_dim": mla.qk_nope_head_dim, "qk_rope_head_dim": mla.qk_rope_head_dim,
            "v_head_dim": mla.v_head_dim, "rope_interleave": mla.rope_interleave, "attention_bias": False}
