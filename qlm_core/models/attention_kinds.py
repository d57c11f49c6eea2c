"""Every attention kind qlm builds, by ModelSpec.attention (a new kind: its module and one entry here)."""

from __future__ import annotations

from qlm_core.models.attention import AttentionKind
from qlm_core.models.attention_gqa import GQA
from qlm_core.models.attention_mla import MLA
from qlm_core.models.families import chosen_kind
from qlm_core.models.spec import ModelSpec

ATTENTION_KINDS: dict[str, AttentionKind] = {"gqa": GQA, "mla": MLA}


def attention_kind(spec: ModelSpec) -> AttentionKind:
    """The attention kind a spec names."""
    return chosen_kind(ATTENTION_KINDS, spec.attention, "attention kind")
