"""Carry a training run's state through a reshard (`mcore2mcore`), so that a resumed run continues as if the layout had
never changed; from and to either format. What is carried, and how: checkpoint/formats/megatron/trainer_state.py (the
Adam views are re-sliced through the layout like the weights; step, train state and scheduler are copied; RNG states
only when TP, PP and VPP are unchanged — qlm train restores them only when its dp x cp also matches)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from qlm_core.checkpoint.formats.megatron.format import TORCH_DIST, open_megatron
from qlm_core.checkpoint.formats.megatron.legacy import MegatronTorchCheckpoint
from qlm_core.checkpoint.formats.megatron.trainer_state import (
    COPIED_KEYS,
    OPTIMIZER_KEY,
    OPTIMIZER_VIEWS,
    RNG_KEY,
    rng_position_key,
    saved_rng_states,
    view_prefix,
)
from qlm_core.errors import QlmError
from qlm_core.models.layout import ModelLayout, TensorLayout, read_range, read_shard_tensor

if TYPE_CHECKING:
    from qlm_core.checkpoint.formats.megatron.torch_dist import TorchDistCheckpoint
    from qlm_core.checkpoint.formats.megatron.torch_dist_write import DistPart


class TrainStateCarrier:
    """What each output rank file holds beside its weights: extra_for(tp_rank, pp_rank, ep_rank) -> top-level
    entries."""

    def __init__(self, src: MegatronTorchCheckpoint | TorchDistCheckpoint, layout: ModelLayout):
        self.src, self.layout, self.notes = src, layout, []
        self.same_grid = (src.tp, src.pp, src.vpp) == (layout.tp, layout.pp, layout.vpp)  # RNG: per TP/PP rank
        optimizer = src.extra_state(OPTIMIZER_KEY)
        self.views: dict[str, MegatronTorchCheckpoint | TorchDistCheckpoint] = {}
        if optimizer is not None:
            self.step = optimizer["step"]
            self.views = {view: open_megatron(src.root, src.iteration, spec=src.spec, view=view)
                          for view in OPTIMIZER_VIEWS}
            self.with_state = self._names_with_state(self.views["master"])
        self.copied = {key: value for key in COPIED_KEYS if (value := src.extra_state(key)) is not None}
        if src.extra_state(RNG_KEY) is not None and not self.same_grid:
            self.notes.append("RNG states dropped: they belong to ranks of the old TP/PP grid (a resumed run draws "
                              "fresh ones)")
        if src.extra_state("optimizer") is not None:
            self.notes.append("Megatron-LM's own optimizer state (`optimizer`, indexed by parameter order) was not "
                              "carried; qlm carries only the per-parameter Adam states its trainer writes")

    def _names_with_state(self, view: MegatronTorchCheckpoint | TorchDistCheckpoint) -> set[str]:
        """Global names of the tensors the optimizer holds state for (trainable parameters)."""
        if view.ckpt_format == TORCH_DIST:
            return {tensor.name for tensor in view.layout.global_tensors if view.holds(tensor)}
        names = set()
        for (tp_rank, pp_rank, ep_rank), file in view.rank_files.items():
            if tp_rank != 0 and ep_rank == 0:
                continue  # the other TP ranks hold the same parameters; each EP rank its own experts
            for chunk in range(view.vpp):
                local = dict(view.layout.stored_tensors(pp_rank, chunk, view.lora, ep_rank))
                for name in view.chunk_state(tp_rank, pp_rank, chunk, ep_rank):
                    if name not in local:
                        raise QlmError(f"optimizer state for unknown parameter {name} in {file}",
                                       "the checkpoint's optimizer state does not match its model")
                    names.add(local[name].name)
        return names

    def _has_state(self, tensor: TensorLayout) -> bool:
        # A tied output layer on the last stage is a trainable copy of the embedding with the same Adam state.
        return tensor.stored_name in self.with_state

    def common_extra(self) -> dict:
        """torch_dist output: what goes into common.pt beside args (RNG states of every position on the same grid)."""
        extra = dict(self.copied)
        if self.same_grid and self.src.extra_state(RNG_KEY) is not None:
            extra[RNG_KEY] = {rng_position_key(t, p): saved_rng_states(self.src, t, p)
                              for t in range(self.layout.tp) for p in range(self.layout.pp)}
        if self.views:
            extra[OPTIMIZER_KEY] = {"step": self.step}
        return extra

    def dist_parts(self) -> list[DistPart]:
        """torch_dist output: the Adam views, stored like the weights under their prefixes."""
        from qlm_core.checkpoint.formats.megatron.torch_dist_write import (
            DistPart,  # imports DCP: only for torch_dist output
        )

        return [DistPart(view_prefix(name), view, torch.float32, lambda chunk: self._has_state(chunk.tensor))
                for name, view in self.views.items()]

    def extra_for(self, tp_rank: int, pp_rank: int, ep_rank: int = 0) -> dict:
        """The optimizer views follow the weights of that file: its dense TP shard and EP rank `ep_rank`'s experts,
        expert-TP part tp_rank % etp (megatron_legacy.legacy_shard_ranks)."""
        extra = dict(self.copied)
        if self.same_grid and (rng := saved_rng_states(self.src, tp_rank, pp_rank)) is not None:
            extra[RNG_KEY] = rng
        if self.views:
            optimizer = {"step": self.step}
            layout = self.layout
            for view_name, view in self.views.items():
                optimizer[view_name] = [
                    {name: read_shard_tensor(tensor, layout.split_size(tensor),
                                             tp_rank % layout.etp if tensor.expert else tp_rank, view)
                     for name, tensor in layout.stored_tensors(pp_rank, chunk, self.src.lora, ep_rank)
                     if self._has_state(tensor)}
                    for chunk in range(layout.vpp)
                ]
            extra[OPTIMIZER_KEY] = optimizer
        return extra

    def verify(self, report, written_root):
        """Every carried Adam tensor, assembled whole from the written checkpoint, equals the source's (the
        VerifyReport counts them with the weights; names are prefixed with their view)."""
        if not self.views:
            return
        tensors = {}
        for pp_rank in range(self.layout.pp):
            for chunk in range(self.layout.vpp):
                for ep_rank in range(self.layout.ep):
                    for _, tensor in self.layout.stored_tensors(pp_rank, chunk, self.src.lora, ep_rank):
                        if tensor.hf_primary and self._has_state(tensor):
                            tensors.setdefault(tensor.name, tensor)
        for view_name, view in self.views.items():
            written = open_megatron(written_root, self.src.iteration, spec=self.src.spec, view=view_name)
            for name, tensor in tensors.items():
                expected = read_range(view, tensor, 0, tensor.real_extent)
                actual = read_range(written, tensor, 0, tensor.real_extent)
                report.tensors_checked += 1
                if actual.dtype != expected.dtype or not torch.equal(actual, expected):
                    report.mismatched.append(f"{view_name}:{name}")
