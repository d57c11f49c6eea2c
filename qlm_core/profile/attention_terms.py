"""The profile's side of the attention seam: what each attention kind (ModelSpec.attention, models/attention_kinds.py)
saves for backward. A new kind adds its module of terms and one row here (tests/models/test_seams.py checks that
every kind the model builds has one)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from qlm_core.errors import QlmError
from qlm_core.profile import attention_gqa_terms as gqa
from qlm_core.profile import attention_mla_terms as mla


@dataclass(frozen=True)
class AttentionTerms:
    """Each takes an ActivationInputs. saved(x, recompute, input_discarded): its saved bytes by name (recompute none,
    selective); op(x): what torchtitan's per-op policy keeps of it; matmuls(spec): its aten.mm calls per forward
    (which of the MLP's the op policy keeps follows from them); recomputed_core(x): what recomputing core_attn
    rebuilds in backward; cp_buffers(x): the context-parallel kernel's transient; per_forward(x): saved once per
    stage chunk (position tensors); kv_cache(spec): the entries a token keeps in one layer's decoding cache (a
    rollout's KV cache, the whole model on one rank)."""

    saved: Callable[..., dict[str, float]]
    op: Callable[..., dict[str, float]]
    matmuls: Callable[..., int]
    recomputed_core: Callable[..., float]
    cp_buffers: Callable[..., float]
    per_forward: Callable[..., dict[str, float]]
    kv_cache: Callable[..., float]


ATTENTION_TERMS: dict[str, AttentionTerms] = {
    "gqa": AttentionTerms(saved=gqa.saved_terms, op=gqa.op_terms, matmuls=lambda spec: 2,
                          recomputed_core=gqa.recomputed_core, cp_buffers=gqa.cp_buffers,
                          per_forward=gqa.position_terms, kv_cache=gqa.kv_cache_entries),
    "mla": AttentionTerms(saved=mla.saved_terms, op=mla.op_terms, matmuls=mla.matmuls,
                          recomputed_core=mla.recomputed_core, cp_buffers=mla.cp_buffers,
                          per_forward=mla.position_terms, kv_cache=mla.kv_cache_entries),
}


def attention_terms(x) -> AttentionTerms:
    return spec_terms(x.spec)


def spec_terms(spec) -> AttentionTerms:
    terms = ATTENTION_TERMS.get(spec.attention)
    if terms is None:
        raise QlmError(f"the profile has no activation model of attention {spec.attention!r}",
                       f"profile a model with attention {', '.join(sorted(ATTENTION_TERMS))}")
    return terms


def kv_cache_entries(spec) -> float:
    """The entries a token keeps in one layer's decoding cache."""
    return spec_terms(spec).kv_cache(spec)
