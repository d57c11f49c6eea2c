"""Recipe checks that need no files, processes or model: run before any launch and again in every worker (a worker
started by srun or a user's torchrun never passed through the launcher's checks)."""

from __future__ import annotations

from qlm_core.checkpoint.formats.megatron import TORCH_DIST, check_format
from qlm_core.config import Recipe
from qlm_core.data.sft import FORMATS as SFT_FORMATS
from qlm_core.dtypes import dtype_named
from qlm_core.errors import QlmError
from qlm_core.train.schedule import SCHEDULES

TRAIN_DTYPES = ("bf16", "fp32")  # fp16 would need loss scaling, which qlm does not do


def check_recipe(recipe: Recipe):
    dtype_named(recipe.model.dtype, "model.dtype", TRAIN_DTYPES)
    if recipe.schedule.lr_schedule not in SCHEDULES:
        raise QlmError(f"schedule.lr_schedule {recipe.schedule.lr_schedule!r} is not one of {', '.join(SCHEDULES)}",
                       "set schedule.lr_schedule to one of them")
    check_format(recipe.checkpoint.format)
    if recipe.train.loss_chunk_tokens < 0:
        raise QlmError(f"train.loss_chunk_tokens must be >= 0, got {recipe.train.loss_chunk_tokens}",
                       "set it to a token count (e.g. 2048) or 0 to compute the loss over all logits at once")
    if recipe.data.mean_doc_len < 0:
        raise QlmError(f"data.mean_doc_len must be >= 0, got {recipe.data.mean_doc_len}",
                       "set it to the packed documents' token-weighted mean length E[L^2]/E[L], or 0 for one "
                       "document per sequence")
    if recipe.data.format not in ("auto", *SFT_FORMATS):
        raise QlmError(f"data.format {recipe.data.format!r} is not one of auto, {', '.join(SFT_FORMATS)}",
                       "set data.format to one of them")
    if recipe.lora.rank > 0:
        if not recipe.model.load:
            raise QlmError("LoRA needs pretrained weights to adapt", "set model.load (an HF model or a checkpoint)")
        if recipe.checkpoint.format == TORCH_DIST:
            raise QlmError("checkpoint.format torch_dist does not hold LoRA adapters",
                           "use checkpoint.format = \"torch\" for LoRA runs")
