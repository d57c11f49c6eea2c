"""The model as pipeline stages: GPTModel with torch.distributed.pipelining's positional I/O.

A stage receives (input_ids or hidden states, position_ids[, segment_ids][, routes]) and, unless it is the last
stage, returns the hidden states followed by the same position_ids[, segment_ids][, routes], so that every stage
knows the RoPE positions, documents and (routing replay) recorded expert routes of the microbatch it is running.
The last stage returns the final norm's output; the schedule's loss function hands it to the loss head
(GPTModel.loss), which projects it onto the vocabulary (chunk by chunk on long sequences), so no stage output is
ever [s, b, V/tp] logits.
"""

from __future__ import annotations

import torch

from qlm_core.models.gpt import GPTModel


class StageModel(GPTModel):
    """Same parameters and state_dict as GPTModel (it adds no modules), pipeline-friendly forward: the stage's
    hidden states (on the last stage the final norm's output; the schedule's loss_fn takes the loss).
    `replays_routes`: its inputs end with the recorded routes [b, s, MoE layers, k] (the engine sets it)."""

    replays_routes = False

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, *extras: torch.Tensor):
        routes = extras[-1] if self.replays_routes else None
        segment_ids = extras[0] if len(extras) > (1 if self.replays_routes else 0) else None
        out = self.hidden_states(x, position_ids, segment_ids=segment_ids, routes=routes)
        if self.post_process:
            return out
        return (out, position_ids, *extras)
