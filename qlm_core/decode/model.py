"""qlm's model of a checkpoint, built for decoding and scoring (eval mode): the one builder `qlm eval`, `qlm
generate` and a rollout use, over any checkpoint qlm reads, optionally as this rank's tensor-parallel slice."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.distributed import ProcessGroup

from qlm_core.checkpoint.sources.open import OpenedCheckpoint, open_checkpoint
from qlm_core.data.tokenizer import load_tokenizer
from qlm_core.errors import QlmError
from qlm_core.models.build import RankCoords, build_rank_model
from qlm_core.models.gpt import GPTModel, ParallelOptions
from qlm_core.models.layout import ModelLayout
from qlm_core.parallel.comm import group_rank, group_size


def load_model(path: str | Path, dtype: torch.dtype, device: torch.device,
               tp_group: ProcessGroup | None = None, iteration: int | None = None) -> tuple[GPTModel, object, str]:
    """qlm's model (this rank's tensor-parallel slice when `tp_group` is given) and the checkpoint's tokenizer;
    `iteration` of a Megatron root or a qlm run (default: its latest)."""
    opened = open_checkpoint(path, iteration)
    if opened.tokenizer_dir is None:
        raise QlmError(f"no tokenizer found with {path}", "keep the tokenizer files beside the checkpoint")
    require_language_model(opened, path)
    return build_model(opened, dtype, device, tp_group), load_tokenizer(opened.tokenizer_dir), opened.description


def require_language_model(opened: OpenedCheckpoint, path: str | Path):
    """One line for a reward model (a score head) given where text is decoded or scored."""
    if opened.spec.head != "lm":
        raise QlmError(f"{path} is a reward model (a score head, no vocabulary to decode or score text with)",
                       "give a language model: the one it was trained from, or a language model run's checkpoint")


def build_model(opened: OpenedCheckpoint, dtype: torch.dtype, device: torch.device,
                tp_group: ProcessGroup | None = None) -> GPTModel:
    """qlm's model (in eval mode) of an opened checkpoint: this rank's tensor-parallel slice with `tp_group`."""
    layout = ModelLayout(opened.spec, tp=group_size(tp_group),
                         make_vocab_size_divisible_by=opened.make_vocab_size_divisible_by)
    model = build_rank_model(layout, RankCoords(tp_rank=group_rank(tp_group)), opened.weights,
                             parallel=ParallelOptions(tp_group=tp_group), dtype=dtype, device=device)
    return model.eval()
