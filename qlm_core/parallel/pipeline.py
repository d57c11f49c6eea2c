"""Pipeline parallelism: run the stages this rank holds with a torch.distributed.pipelining schedule.

The model side (models/stage.py) builds the stage modules; this file only wires them to the pipeline group and
a schedule. Virtual stage c of rank r is global stage c * pp + r (Megatron's interleaved placement).

torch's PipelineStage allocates an activation receive buffer and a gradient receive buffer for every micro-batch
once and keeps them (and, on the activation buffer, the input gradient) for the whole run, so a stage's memory grows
with the number of micro-batches although 1F1B has at most pp - rank of them in flight. InFlightStage allocates a
buffer when its receive is posted and drops it once its micro-batch's backward has run (Megatron allocates its p2p
receive tensors per micro-batch too), so what a stage holds is set by the schedule's in-flight count alone.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.distributed as dist
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


class InFlightStage(PipelineStage):
    """A PipelineStage whose receive buffers exist only while their micro-batch is in flight (module docstring).
    The schedule's tensors (autograd's saved inputs, a zero-bubble weight pass's state, a send in progress) keep
    their own references, so dropping the stage's changes nothing they read.

    `own_sends` (the multi-chunk schedules): torch's _PipelineScheduleRuntime keeps every send's Work, and with it the
    sent tensor, until the step ends. This stage posts those sends itself, at the same moment and one by one as the
    runtime would, and lets a micro-batch's sent output go once its gradient has come back (the next stage cannot
    have sent it before receiving the output, so that send is complete); sent input gradients have no such proof and
    are waited for when the step ends (finish_sends)."""

    def __init__(self, *args, own_sends: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.own_sends = own_sends
        self._output_sends: dict[int, list] = {}
        self._grad_sends: list = []

    def _post(self, ops) -> list:
        return [dist.isend(op.tensor, op.peer, group=op.group, tag=op.tag) for op in ops]

    def get_fwd_send_ops(self, fwd_chunk_id: int):
        ops = super().get_fwd_send_ops(fwd_chunk_id)
        if not self.own_sends:
            return ops
        self._output_sends[fwd_chunk_id] = self._post(ops)
        return []

    def get_bwd_send_ops(self, bwd_chunk_id: int):
        ops = super().get_bwd_send_ops(bwd_chunk_id)
        if not self.own_sends:
            return ops
        self._grad_sends += self._post(ops)
        return []

    def finish_sends(self) -> None:
        """Wait for every send this stage posted (the end of a step)."""
        for work in [w for works in self._output_sends.values() for w in works] + self._grad_sends:
            work.wait()
        self._output_sends, self._grad_sends = {}, []

    def _setup_forward_recv_info(self, num_microbatches: int, has_backward: bool) -> None:
        super()._setup_forward_recv_info(1, has_backward)  # torch would allocate all of them at once
        template = self.args_recv_info[0]
        for chunk in range(num_microbatches):
            self.args_recv_info[chunk] = tuple(copy.copy(info) for info in template)

    def _prepare_forward_infra(self, *args, **kwargs):
        result = super()._prepare_forward_infra(*args, **kwargs)
        self._drop(self.args_recv_info.values())  # received into fresh buffers when their micro-batch comes
        return result

    def _create_grad_recv_info(self, *args, **kwargs):
        infos = super()._create_grad_recv_info(*args, **kwargs)
        self._drop([infos])
        return infos

    def _allocate(self, infos) -> None:
        for info in infos:
            if not info.is_root_arg and info.buffer is None and info.tensor_meta is not None:
                meta = info.tensor_meta
                info.buffer = torch.empty_strided(meta.shape, meta.stride, dtype=meta.dtype, device=self.device)

    @staticmethod
    def _drop(groups) -> None:
        for infos in groups:
            for info in infos:
                if not info.is_root_arg:
                    info.buffer = None

    def get_fwd_recv_ops(self, fwd_chunk_id: int):
        self._allocate(self.args_recv_info[fwd_chunk_id])
        return super().get_fwd_recv_ops(fwd_chunk_id)

    def get_bwd_recv_ops(self, bwd_chunk_id: int):
        if self.has_backward and not self.is_last:
            self._allocate(self.grad_recv_info[bwd_chunk_id])
        return super().get_bwd_recv_ops(bwd_chunk_id)

    @staticmethod
    def _cut(loss) -> None:
        """The schedule keeps every micro-batch's loss until the step ends; once its backward has run, its graph
        would keep the stage's input (the leaf its AccumulateGrad holds) alive for nothing."""
        for t in loss if isinstance(loss, tuple) else (loss,):
            if isinstance(t, torch.Tensor) and t.grad_fn is not None and not t._is_view():
                t.detach_()

    def backward_one_chunk(self, bwd_chunk_id: int, loss=None, full_backward: bool = True,
                           last_backward: bool = False):
        super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward, last_backward=last_backward)
        if self.has_backward:  # the output's gradient has been received: its send is complete
            for work in self._output_sends.pop(bwd_chunk_id, []):
                work.wait()
        if not self.has_backward:  # forward only: nothing reads this micro-batch's inputs and outputs any more
            self.fwd_cache.pop(bwd_chunk_id, None)
        elif full_backward:
            self._cut(loss)
        self._drop([self.args_recv_info[bwd_chunk_id], self.grad_recv_info.get(bwd_chunk_id, ())])

    def backward_weight_one_chunk(self, bwd_chunk_id: int, *args, **kwargs):
        state = self.backward_state.get(bwd_chunk_id)  # (inputs, param groups, stage output, output grads)
        super().backward_weight_one_chunk(bwd_chunk_id, *args, **kwargs)
        if state is not None and self.is_last:
            self._cut(state[2])


def validate_schedule(name: str, pp: int, vpp: int, num_microbatches: int) -> None:
    assert name in SCHEDULES, f"pp_schedule {name!r}"  # the recipe's schema checked it (config.py)
    if vpp > 1 and SCHEDULES[name] not in _MULTI_STAGE:
        raise ValueError(f"vpp {vpp} needs an interleaved schedule (interleaved_1f1b or zero_bubble), not {name}")
    if name == "interleaved_1f1b" and vpp < 2:
        raise ValueError("interleaved_1f1b needs vpp >= 2")
    if SCHEDULES[name] in _MULTI_STAGE and num_microbatches % pp:
        raise ValueError(f"{name} needs the number of microbatches ({num_microbatches}) to be a multiple of pp ({pp})")


def validate_recompute(schedule: str, pp: int, recompute: str) -> None:
    """torch's selective checkpointing (recompute = "op") lets a region be recomputed once; zero-bubble's weight pass
    would recompute each layer a second time after the input-gradient pass."""
    if pp > 1 and schedule == "zero_bubble" and recompute == "op":
        raise ValueError('recompute "op" cannot run under pp_schedule zero_bubble (its weight pass recomputes each '
                         "layer a second time, which torch's selective checkpointing refuses)")


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
        recompute: str = "none",
    ):
        vpp = len(chunks)
        validate_schedule(schedule, pp_size, vpp, num_microbatches)
        validate_recompute(schedule, pp_size, recompute)
        num_stages = pp_size * vpp
        cls = SCHEDULES[schedule]
        self.stages = [
            InFlightStage(chunk, c * pp_size + pp_rank, num_stages, device, group=pp_group,
                          own_sends=cls in _MULTI_STAGE)
            for c, chunk in enumerate(chunks)
        ]
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
        try:
            self.schedule.step(*args, target=labels if self.has_last else None, losses=losses, return_outputs=False)
        finally:
            for stage in self.stages:
                stage.finish_sends()
        return losses

    @torch.no_grad()
    def evaluate(self, inputs: tuple[torch.Tensor, ...], labels: torch.Tensor) -> list[torch.Tensor]:
        """Forward only, same conventions as step()."""
        losses: list[torch.Tensor] = []
        args = inputs if self.has_first else ()
        try:
            self.schedule.eval(*args, target=labels if self.has_last else None, losses=losses, return_outputs=False)
        finally:
            for stage in self.stages:
                stage.finish_sends()
        return losses
