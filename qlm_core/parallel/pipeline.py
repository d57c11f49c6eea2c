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
from torch.distributed.pipelining.schedules import BACKWARD_INPUT, FORWARD, FULL_BACKWARD, SEND_B, SEND_F

from qlm_core.config import PpSchedule, choices
from qlm_core.parallel import shape_inference
from qlm_core.parallel.pipeline_rules import MULTI_CHUNK_SCHEDULES, validate_recompute, validate_schedule

SCHEDULES = {
    "1f1b": Schedule1F1B,
    "gpipe": ScheduleGPipe,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "zero_bubble": ScheduleInterleavedZeroBubble,  # splits backward into input- and weight-gradient passes
}
assert tuple(SCHEDULES) == choices(PpSchedule), "SCHEDULES and config.PpSchedule name the same schedules"
_MULTI_STAGE = tuple(SCHEDULES[name] for name in MULTI_CHUNK_SCHEDULES)


class SendRelease:
    """When a send posted under the multi-chunk schedules is complete. Each of this rank's stages sends its input
    gradient to the previous rank and its output to the next (a stage's neighbours all live on those two ranks). A
    peer runs its schedule's actions in order and waits for what it receives before the computation that reads it;
    so once this rank has received something the peer sent after that computation, the send is complete and waiting
    for it returns at once. Works with any backend: gloo marks a send complete only when it is waited for, so
    polling the Work would hold every micro-batch's tensor until the step ends.

    gradients(): sends to the previous rank, read by its backward of stage - 1, proven by an input it sent after.
    outputs(): sends to the next rank, read by its forward of stage + 1, proven by a gradient it sent after."""

    def __init__(self, peer_actions: list, offset: int, reads: tuple, proof):
        self.offset = offset  # the peer's stage = this rank's stage + offset
        self.read_at: dict[tuple[int, int], int] = {}  # (peer stage, micro-batch) -> where the peer reads it
        self.proof_at: dict[tuple[int, int], int] = {}  # (peer stage, micro-batch) -> where the peer sends to us
        for index, action in enumerate(peer_actions):
            if action is None:
                continue
            key = (action.stage_index, action.microbatch_index)
            if action.computation_type in reads:
                self.read_at.setdefault(key, index)
            elif action.computation_type == proof:
                self.proof_at[key] = index
        self._pending: list[tuple[int, list, Callable | None]] = []  # (where it is read, works, when done)

    @classmethod
    def gradients(cls, previous_rank_actions: list) -> SendRelease:
        return cls(previous_rank_actions, -1, (FULL_BACKWARD, BACKWARD_INPUT), SEND_F)

    @classmethod
    def outputs(cls, next_rank_actions: list) -> SendRelease:
        return cls(next_rank_actions, +1, (FORWARD,), SEND_B)

    def posted(self, stage: int, microbatch: int, works: list, done: Callable | None = None) -> None:
        if works:
            self._pending.append((self.read_at[(stage + self.offset, microbatch)], works, done))

    def received(self, stage: int, microbatch: int) -> None:
        """What stage `stage` of this rank receives for `microbatch` from the peer has arrived."""
        proof = self.proof_at.get((stage + self.offset, microbatch))
        if proof is None:
            return
        complete = [entry for entry in self._pending if entry[0] < proof]
        self._pending = [entry for entry in self._pending if entry[0] >= proof]
        self._finish(complete)

    def wait_all(self) -> None:
        pending, self._pending = self._pending, []
        self._finish(pending)

    @staticmethod
    def _finish(entries) -> None:
        for _, works, done in entries:
            for work in works:
                work.wait()
            if done is not None:
                done()


def release_storage(output: torch.Tensor) -> None:
    """Free a sent output's storage and keep its autograd node, as Megatron's deallocate_output_tensor does: the
    stage's backward starts from it and reads only its shape (an expanded one-element tensor keeps the shape). Only
    for a residual sum, which no operation of the chunk saved for backward."""
    if output.grad_fn is not None and type(output.grad_fn).__name__ == "AddBackward0" and not output._is_view():
        output.data = torch.empty((), dtype=output.dtype, device=output.device).expand(output.shape)


class InFlightStage(PipelineStage):
    """A PipelineStage whose receive buffers exist only while their micro-batch is in flight (module docstring).
    The schedule's tensors (autograd's saved inputs, a zero-bubble weight pass's state, a send in progress) keep
    their own references, so dropping the stage's changes nothing they read.

    Under the multi-chunk schedules (release_sends_with): torch's _PipelineScheduleRuntime keeps every send's Work,
    and with it the sent tensor, until the step ends. This stage posts those sends itself, at the same moment and one
    by one as the runtime would; a sent output (its storage too: its backward needs only its autograd node) or input
    gradient goes once something the peer sent later proves it was received (SendRelease), and the rest are waited
    for when the step ends (finish_sends)."""

    def _forward_metadata_inference(self, *args, **kwargs):
        with shape_inference.inferring():
            return super()._forward_metadata_inference(*args, **kwargs)

    def _prepare_backward_infra(self, *args, **kwargs):
        # the last stage runs the loss function once on the placeholder output to learn the gradient shapes
        with shape_inference.inferring():
            return super()._prepare_backward_infra(*args, **kwargs)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._output_sends: SendRelease | None = None  # None: torch's runtime posts and keeps this stage's sends
        self._grad_sends: SendRelease | None = None

    def release_sends_with(self, gradients: SendRelease, outputs: SendRelease) -> None:
        """Post this stage's sends itself and release them by the schedule's action orders (multi-chunk schedules;
        the orders exist only once the schedule is built from the stages)."""
        self._grad_sends, self._output_sends = gradients, outputs

    def _post(self, ops) -> list:
        return [dist.isend(op.tensor, op.peer, group=op.group, tag=op.tag) for op in ops]

    def get_fwd_send_ops(self, fwd_chunk_id: int):
        ops = super().get_fwd_send_ops(fwd_chunk_id)
        if self._output_sends is None:
            return ops
        outputs = self.fwd_cache[fwd_chunk_id][0]
        self._output_sends.posted(self.stage_index, fwd_chunk_id, self._post(ops),
                                  lambda: [release_storage(t) for t in outputs if isinstance(t, torch.Tensor)])
        return []

    def get_bwd_send_ops(self, bwd_chunk_id: int):
        ops = super().get_bwd_send_ops(bwd_chunk_id)
        if self._grad_sends is None:
            return ops
        self._grad_sends.posted(self.stage_index, bwd_chunk_id, self._post(ops))
        return []

    def forward_one_chunk(self, fwd_chunk_id: int, *args, **kwargs):
        if self._grad_sends is not None and not self.is_first:  # the runtime has waited for this input
            self._grad_sends.received(self.stage_index, fwd_chunk_id)
        return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    def finish_sends(self) -> None:
        """Wait for every send this stage posted (the end of a step)."""
        for release in (self._output_sends, self._grad_sends):
            if release is not None:
                release.wait_all()

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
        if self._output_sends is not None and self.has_backward and not self.is_last:  # its gradient has arrived
            self._output_sends.received(self.stage_index, bwd_chunk_id)
        super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward, last_backward=last_backward)
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
        multi = cls in _MULTI_STAGE
        self.stages = [
            InFlightStage(chunk, c * pp_size + pp_rank, num_stages, device, group=pp_group)
            for c, chunk in enumerate(chunks)
        ]
        # The loss is already normalised by the step's token count, so the schedule must not rescale gradients.
        target = self.stages if multi else self.stages[0]
        self.schedule = cls(target, num_microbatches, loss_fn=loss_fn, scale_grads=False)
        if multi:
            orders = self.schedule.pipeline_order_with_comms
            gradients = SendRelease.gradients(orders[(pp_rank - 1) % pp_size])
            outputs = SendRelease.outputs(orders[(pp_rank + 1) % pp_size])
            for stage in self.stages:
                stage.release_sends_with(gradients, outputs)
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
