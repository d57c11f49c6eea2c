"""Pipeline parallelism: run the stages this rank holds with a torch.distributed.pipelining schedule.

The model side (models/stage.py) builds the stage modules; this file only wires them to the pipeline group and
a schedule. Virtual stage c of rank r is global stage c * pp + r (Megatron's interleaved placement).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)

from qlm_core.config import PpSchedule, choices

SCHEDULES = {
    "1f1b": Schedule1F1B,
    "gpipe": ScheduleGPipe,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "zero_bubble": ScheduleInterleavedZeroBubble,  # splits backward into input- and weight-gradient passes
}
assert tuple(SCHEDULES) == choices(PpSchedule), "SCHEDULES and config.PpSchedule name the same schedules"
_MULTI_STAGE = (ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble)


def validate_schedule(name: str, pp: int, vpp: int, num_microbatches: int) -> None:
    assert name in SCHEDULES, f"pp_schedule {name!r}"  # the recipe's schema checked it (config.py)
    if vpp > 1 and SCHEDULES[name] not in _MULTI_STAGE:
        raise ValueError(f"vpp {vpp} needs an interleaved schedule (interleaved_1f1b or zero_bubble), not {name}")
    if name == "interleaved_1f1b" and vpp < 2:
        raise ValueError("interleaved_1f1b needs vpp >= 2")
    if SCHEDULES[name] in _MULTI_STAGE and num_microbatches % pp:
        raise ValueError(f"{name} needs the number of microbatches ({num_microbatches}) to be a multiple of pp ({pp})")


class PipelineRunner:
    """One training step's forward and backward over `num_microbatches` microbatches."""

    def __init__(
        self,
        chunks: list[nn.Module],
        *,
        pp_rank: int,
        pp_size: int,
        pp_group: ProcessGroup | None,
        device: torch.device,
        schedule: str,
        num_microbatches: int,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ):
        vpp = len(chunks)
        validate_schedule(schedule, pp_size, vpp, num_microbatches)
        num_stages = pp_size * vpp
        self.stages = [
            PipelineStage(chunk, c * pp_size + pp_rank, num_stages, device, group=pp_group)
            for c, chunk in enumerate(chunks)
        ]
        cls = SCHEDULES[schedule]
        # The loss is already normalised by the step's token count, so the schedule must not rescale gradients.
        target = self.stages if cls in _MULTI_STAGE else self.stages[0]
        self.schedule = cls(target, num_microbatches, loss_fn=loss_fn, scale_grads=False)
        self.has_first = pp_rank == 0
        self.has_last = any(stage.is_last for stage in self.stages)

    def step(self, inputs: tuple[torch.Tensor, ...], labels: torch.Tensor) -> list[torch.Tensor]:
        """inputs: the first stage's arguments for all microbatches stacked on dim 0 (ignored on other ranks);
        labels likewise (used on the last stage). Returns the microbatch losses on the last stage, else []."""
        losses: list[torch.Tensor] = []
        args = inputs if self.has_first else ()
        self.schedule.step(*args, target=labels if self.has_last else None, losses=losses, return_outputs=False)
        return losses

    @torch.no_grad()
    def evaluate(self, inputs: tuple[torch.Tensor, ...], labels: torch.Tensor) -> list[torch.Tensor]:
        """Forward only, same conventions as step()."""
        losses: list[torch.Tensor] = []
        args = inputs if self.has_first else ()
        self.schedule.eval(*args, target=labels if self.has_last else None, losses=losses, return_outputs=False)
        return losses
