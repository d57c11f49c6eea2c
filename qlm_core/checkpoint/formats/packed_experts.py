"""A reader of whole HF-named tensors (a DeepSpeed module) for a family whose files hold its experts packed
(gpt-oss): the per-expert tensors the layout names read as views of the packed ones (models/layout.py's
hf_packed_experts). HFCheckpoint resolves the same views itself, reading only an expert's bytes."""

from __future__ import annotations

import torch

from qlm_core.models.families import FAMILIES
from qlm_core.models.layout import hf_packed_experts, packed_expert_slab
from qlm_core.models.spec import ModelSpec


class PackedExperts:
    """`reader` offers dtype(name), read(name) (the whole tensor) and read_into(name, axis, start, stop, out)."""

    def __init__(self, reader, spec: ModelSpec):
        self.reader = reader
        packed = FAMILIES[spec.model_type].expert_files != "separate"
        self.views = hf_packed_experts(spec)[0] if packed else {}

    def dtype(self, name: str) -> torch.dtype:
        view = self.views.get(name)
        return self.reader.dtype(name if view is None else view.packed)

    def read_into(self, name: str, axis: int, start: int, stop: int, out: torch.Tensor):
        view = self.views.get(name)
        if view is None:
            self.reader.read_into(name, axis, start, stop, out)
            return
        slab = self.reader.read(view.packed)[view.expert]
        out.copy_(packed_expert_slab(slab, view).narrow(axis, start, stop - start))
