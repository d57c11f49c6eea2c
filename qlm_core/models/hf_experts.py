"""HF tensors that hold an MoE layer's routed experts packed, as views of the per-expert tensors the layout names.

"separate" families (models/families.py ExpertFiles): transformers >= 5 holds an MoE layer's experts fused
(`model.layers.N.mlp.experts.gate_up_proj` [E, 2F, H], rows gate then up, and `...down_proj` [E, H, F]), Mixtral's
router under `mlp.gate.weight` and ERNIE 4.5 MoE's correction bias under `mlp.gate.moe_statics`. Its saved files
hold the per-expert tensors again (qlm writes those too); some checkpoints, and a DeepSpeed module (transformers'
state_dict), hold the fused form. gpt-oss: its files hold only `experts.gate_up_proj` [E, H, 2F] (gate and up in
alternate columns), `down_proj` [E, F, H] and their biases [E, 2F] and [E, H]: read, and written packed (HFFiles).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from qlm_core.models.families import FAMILIES
from qlm_core.models.layout import ModelLayout, TensorSource, assemble_hf_tensor
from qlm_core.models.spec import ModelSpec


@dataclass(frozen=True)
class PackedView:
    """A per-expert HF tensor the layout names (`...experts.<e>.gate_proj.weight`, [rows, columns] or [rows]) held
    inside a packed HF tensor: `packed[expert]` (the whole packed tensor when expert is None), transposed when
    `transposed`, then its rows first, first + step, ... (as many as `shape` has)."""

    packed: str
    expert: int | None
    shape: tuple[int, ...]
    first: int = 0
    step: int = 1
    transposed: bool = False


class ExpertPacking(NamedTuple):
    views: dict[str, PackedView]  # per-expert HF name -> where it lies
    shapes: dict[str, tuple[int, ...]]  # packed HF name -> its shape


def packed_in_files(spec: ModelSpec) -> bool:
    """Whether the family's HF files hold its experts only packed (gpt-oss), so that writers pack them too."""
    return spec.moe is not None and FAMILIES[spec.model_type].expert_files != "separate"


def hf_packed_experts(spec: ModelSpec) -> ExpertPacking:
    """The per-expert HF tensors of an MoE model that its files may hold packed, and each packed tensor's shape."""
    if spec.moe is None:
        return ExpertPacking({}, {})
    family = FAMILIES[spec.model_type]
    gate, up, down = family.expert_projections
    h, ffn, experts = spec.hidden_size, spec.moe.ffn_hidden_size, spec.moe.num_experts
    views: dict[str, PackedView] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for layer in range(spec.num_layers + spec.mtp_num_layers):
        if not spec.is_moe_layer(layer):
            continue
        hf = f"model.layers.{layer}."
        disk, fused = hf + family.moe_block, hf + "mlp.experts."
        if family.expert_files == "gpt_oss":
            shapes.update({fused + "gate_up_proj": (experts, h, 2 * ffn), fused + "down_proj": (experts, ffn, h),
                           fused + "gate_up_proj_bias": (experts, 2 * ffn), fused + "down_proj_bias": (experts, h)})
            for e in range(experts):
                for kind, packed, shape, transposed in (("weight", "gate_up_proj", (ffn, h), True),
                                                        ("bias", "gate_up_proj_bias", (ffn,), False)):
                    views[f"{disk}experts.{e}.{gate}.{kind}"] = PackedView(fused + packed, e, shape, 0, 2, transposed)
                    views[f"{disk}experts.{e}.{up}.{kind}"] = PackedView(fused + packed, e, shape, 1, 2, transposed)
                views[f"{disk}experts.{e}.{down}.weight"] = PackedView(fused + "down_proj", e, (h, ffn),
                                                                       transposed=True)
                views[f"{disk}experts.{e}.{down}.bias"] = PackedView(fused + "down_proj_bias", e, (h,))
            continue
        shapes.update({fused + "gate_up_proj": (experts, 2 * ffn, h), fused + "down_proj": (experts, h, ffn)})
        if family.moe_block != "mlp.":  # the router too moved: transformers >= 5 holds it under mlp.gate
            views[disk + "gate.weight"] = PackedView(hf + "mlp.gate.weight", None, (experts, h))
            shapes[hf + "mlp.gate.weight"] = (experts, h)
        if spec.moe.expert_bias and family.expert_bias_name.startswith("moe_statics."):  # ERNIE's, under the gate
            held = hf + "mlp.gate." + family.expert_bias_name
            views[disk + family.expert_bias_name] = PackedView(held, None, (*family.expert_bias_leading, experts))
            shapes[held] = (*family.expert_bias_leading, experts)
        for e in range(experts):
            views[f"{disk}experts.{e}.{gate}.weight"] = PackedView(fused + "gate_up_proj", e, (ffn, h), 0)
            views[f"{disk}experts.{e}.{up}.weight"] = PackedView(fused + "gate_up_proj", e, (ffn, h), ffn)
            views[f"{disk}experts.{e}.{down}.weight"] = PackedView(fused + "down_proj", e, (h, ffn))
    return ExpertPacking(views, shapes)


def packed_expert_slab(slab: torch.Tensor, view: PackedView) -> torch.Tensor:
    """`view`'s tensor out of its expert's slab of the packed tensor (`packed[expert]`, the whole tensor when the
    view's expert is None); a view, not a copy."""
    slab = slab.t() if view.transposed else slab
    return slab[view.first: view.first + view.step * view.shape[0]: view.step]


class HFFiles:
    """The tensors an HF model's files hold, in HF order: the layout's, with a family whose experts only exist packed
    (gpt-oss) holding each packed tensor in place of its per-expert views. `state_dict`: as transformers' model
    holds them in memory instead (what DeepSpeed saves): every MoE family's experts packed (transformers >= 5 fuses
    them) and Mixtral's router under mlp.gate."""

    def __init__(self, layout: ModelLayout, state_dict: bool = False):
        self.layout = layout
        pack = packed_in_files(layout.spec) or (state_dict and layout.spec.moe is not None)
        packed = hf_packed_experts(layout.spec) if pack else ExpertPacking({}, {})
        self.views: dict[str, list[tuple[str, PackedView]]] = {}  # packed name -> its views
        for name, view in packed.views.items():
            self.views.setdefault(view.packed, []).append((name, view))
        self.shapes: dict[str, tuple[int, ...]] = {}
        for name in layout.hf_tensors:
            view = packed.views.get(name)
            if view is None:
                self.shapes[name] = layout.hf_shape(name)
            elif view.packed not in self.shapes:
                self.shapes[view.packed] = packed.shapes[view.packed]

    def assemble(self, name: str, source: TensorSource, dtype: torch.dtype | None = None) -> torch.Tensor:
        """One of `shapes`' tensors read from `source`: a layout tensor, or a packed one put together from its
        per-expert views."""
        if name not in self.views:
            return assemble_hf_tensor(self.layout, name, source, dtype)
        out = None
        for view_name, view in self.views[name]:
            part = assemble_hf_tensor(self.layout, view_name, source, dtype)
            if out is None:
                out = torch.empty(self.shapes[name], dtype=part.dtype)
            packed_expert_slab(out if view.expert is None else out[view.expert], view).copy_(part)
        return out
