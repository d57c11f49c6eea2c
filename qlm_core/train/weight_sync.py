"""Weight sync for rollouts: the trainer's weights, wherever its layout put them (TP / PP / EP shards, ZeRO-3
parts), as whole tensors on every rank, from which a rollout model of another layout is built with the layout
module `qlm convert` uses (models/layout.build_shard), in memory: no checkpoint is written or read.

Each rank contributes the shards no other rank of its kind already sends (a dense shard from data- and
context-parallel rank 0, a routed expert's from expert-data-parallel rank 0); every rank receives every
contribution (one all-gather of their tensors) and puts each global tensor together by its TP split rule
(TensorLayout.tp_ranges), as the Megatron checkpoint reader does from rank files."""

from __future__ import annotations

import torch
import torch.distributed as dist

from qlm_core.models.build import RankCoords, build_rank_model
from qlm_core.models.gpt import GPTModel
from qlm_core.models.layout import ModelLayout, fill_shard
from qlm_core.models.tensor_layout import REPLICATED, TensorLayout
from qlm_core.train.checkpointing import model_states
from qlm_core.train.engine import Engine


def _contributions(engine: Engine) -> list[tuple[str, int, torch.Tensor]]:
    """(global tensor name, its TP / expert-TP part index, this rank's part) of the shards this rank sends."""
    if engine.lora is not None and engine.lora.rank > 0:
        raise ValueError("weight sync of a LoRA run: merge the adapters first")
    g, layout = engine.grid, engine.layout
    dense_sender = g.dp_rank == 0 and g.cp_rank == 0
    expert_sender = g.expert_coords["edp"] == 0
    out = []
    for chunk, state in enumerate(model_states(engine)):
        for local, tensor in layout.shard_entries(g.pp_rank, chunk, g.ep_rank):
            if tensor is None or not (expert_sender if tensor.expert else dense_sender):
                continue
            out.append((tensor.name, g.etp_rank if tensor.expert else g.tp_rank, state[local].detach().cpu()))
    return out


class WholeTensors:
    """Whole global tensors as a TensorSource (build_shard reads any layout's shards from it)."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def stored_dtype(self, tensor: TensorLayout) -> torch.dtype:
        return self.tensors[tensor.name].dtype

    def read_into(self, tensor: TensorLayout, start: int, stop: int, out: torch.Tensor) -> None:
        out.copy_(self.tensors[tensor.name].narrow(tensor.axis, start, stop - start))


def gather_weights(engine: Engine) -> WholeTensors:
    """Every global tensor of the trainer's model, whole, on every rank (a collective: every rank calls it). The
    shards travel in one all-gather of pickled tensors and every rank holds the whole model on the host: sized for
    models that fit one device (the rollout layout here is TP 1); per-tensor collectives on the device are the way
    to the large ones."""
    engine.optimizer.wait_param_gather()  # ZeRO 1/2 with overlap_param_gather: the step's gathers land first
    mine = _contributions(engine)
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    else:
        everyone = [mine]
    parts: dict[str, dict[int, torch.Tensor]] = {}
    for contribution in everyone:
        for name, part, tensor in contribution:
            parts.setdefault(name, {})[part] = tensor
    layout = engine.layout
    whole = {}
    for tensor in layout.global_tensors:
        held = parts[tensor.name]
        size = layout.split_size(tensor)
        if tensor.split == REPLICATED or size == 1:  # one part: the whole tensor already
            whole[tensor.name] = next(iter(held.values()))
            continue
        first = held[0]
        shape = list(first.shape)
        shape[tensor.axis] = tensor.shape[tensor.axis]
        full = first.new_empty(shape)
        for rank in range(size):
            offset = 0
            for begin, end in tensor.tp_ranges(size, rank):
                full.narrow(tensor.axis, begin, end - begin).copy_(
                    held[rank].narrow(tensor.axis, offset, end - begin))
                offset += end - begin
        whole[tensor.name] = full
    return WholeTensors(whole)


def rollout_layout(engine: Engine) -> ModelLayout:
    """The rollout's layout: the trainer's model whole (TP 1, PP 1)."""
    return ModelLayout(engine.spec, make_vocab_size_divisible_by=engine.layout.make_vocab_size_divisible_by)


def fill_rollout_model(engine: Engine, weights: WholeTensors, model: GPTModel | None = None,
                       dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> GPTModel:
    """`weights` (gather_weights) as one whole model (the rollout layout of a model that fits one device), built by
    the layout module on `device` (default the trainer's), routing as the trainer does (its [moe] options); `model`
    an earlier one to refill in place (no modules built again)."""
    layout = rollout_layout(engine)
    if model is None:
        return build_rank_model(layout, RankCoords(), weights, dtype=dtype or engine.dtype,
                                device=device or engine.grid.device, moe_options=engine.moe).eval()
    fill_shard(layout, 0, 0, 0, weights, model.state_dict(keep_vars=True))
    return model


def rollout_model(engine: Engine, dtype: torch.dtype | None = None,
                  device: torch.device | str | None = None) -> GPTModel:
    """The trainer's current weights as one whole model on this rank (a collective: gather_weights)."""
    return fill_rollout_model(engine, gather_weights(engine), dtype=dtype, device=device)
