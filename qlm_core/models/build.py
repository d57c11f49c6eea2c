"""Build one rank's model (its TP shard of one pipeline chunk) and fill it from any TensorSource: the one way
train, eval and convert --verify get a model."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qlm_core.config import MoeConfig
from qlm_core.models.gpt import GPTModel, ParallelOptions
from qlm_core.models.layout import ModelLayout, TensorSource, build_shard
from qlm_core.parallel.cross_entropy import DEFAULT_CHUNK_TOKENS


@dataclass(frozen=True)
class RankCoords:
    """Which shard of a ModelLayout a model holds."""

    tp_rank: int = 0
    pp_rank: int = 0
    chunk: int = 0  # virtual pipeline chunk of the stage
    ep_rank: int = 0  # whose routed experts (expert parallelism)
    etp_rank: int | None = None  # which expert-TP part of them; None: tp_rank


def build_rank_model(
    layout: ModelLayout,
    coords: RankCoords,
    source: TensorSource,
    *,
    parallel: ParallelOptions | None = None,
    dtype: torch.dtype = torch.float32,
    read_dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    loss_chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    model_class: type[GPTModel] = GPTModel,
    moe_options: MoeConfig | None = None,
) -> GPTModel:
    """The model of shard `coords` of `layout`, its parameters in `dtype` on `device`, holding `source`'s values
    read as `read_dtype` (default `dtype`; a narrower one rounds the weights to it first). `parallel` must have
    groups of `layout`'s TP size; `model_class` GPTModel or a subclass with the same parameters (StageModel);
    `moe_options` how its MoE layers train (the recipe's [moe])."""
    layers = layout.chunk_layers(coords.pp_rank, coords.chunk)
    model = model_class(
        layout.spec, parallel=parallel, pre_process=layout.is_first(coords.pp_rank, coords.chunk),
        post_process=layout.is_last(coords.pp_rank, coords.chunk), layer_offset=layers.start,
        num_layers=len(layers), padded_vocab=layout.padded_vocab, dtype=dtype, loss_chunk_tokens=loss_chunk_tokens,
        moe_options=moe_options,
    )
    if device is not None:
        model.to(device)
    state = build_shard(layout, coords.tp_rank, coords.pp_rank, coords.chunk, source, read_dtype or dtype,
                        ep_rank=coords.ep_rank, etp_rank=coords.etp_rank)
    target = next(model.parameters()).device
    model.load_state_dict({k: v if v is None else v.to(target) for k, v in state.items()}, strict=True)
    return model
