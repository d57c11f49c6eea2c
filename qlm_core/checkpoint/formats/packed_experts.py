"""A reader of whole HF-named tensors (a DeepSpeed module: transformers' state_dict) holding an MoE model's experts
packed (gpt-oss's always, every MoE family's under transformers >= 5): the per-expert tensors the layout names read
as views of the packed ones (models/hf_experts.py). HFCheckpoint resolves the same views itself, reading only an
expert's bytes."""

from __future__ import annotations

import re

import torch

from qlm_core.models.hf_experts import hf_packed_experts, packed_expert_slab
from qlm_core.models.spec import ModelSpec


class PackedExperts:
    """`reader` offers has(name), dtype(name), read(name) (the whole tensor) and read_into(name, axis, start, stop,
    out). A per-expert tensor the reader lacks is read from its packed tensor where the reader has that. The packed
    tensors of the layer being read are kept: its experts are read one after another, each from all of them."""

    def __init__(self, reader, spec: ModelSpec):
        self.reader = reader
        self.views = {name: view for name, view in hf_packed_experts(spec).views.items()
                      if not reader.has(name) and reader.has(view.packed)}
        self._held: dict[str, torch.Tensor] = {}

    def dtype(self, name: str) -> torch.dtype:
        view = self.views.get(name)
        return self.reader.dtype(name if view is None else view.packed)

    def read_into(self, name: str, axis: int, start: int, stop: int, out: torch.Tensor):
        view = self.views.get(name)
        if view is None:
            self.reader.read_into(name, axis, start, stop, out)
            return
        if view.packed not in self._held:
            layer = re.match(r"model\.layers\.\d+\.", view.packed)
            self._held = {held: t for held, t in self._held.items() if layer and held.startswith(layer.group())}
            self._held[view.packed] = self.reader.read(view.packed)
        held = self._held[view.packed]
        slab = held if view.expert is None else held[view.expert]
        out.copy_(packed_expert_slab(slab, view).narrow(axis, start, stop - start))
