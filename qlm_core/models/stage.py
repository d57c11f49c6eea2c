"""The model as pipeline stages: GPTModel with torch.distributed.pipelining's positional I/O.

A stage receives (input_ids or hidden states, position_ids[, segment_ids][, routes][, mtp_tokens]) and, unless it
is the last stage, returns the hidden states followed by the same position_ids[, segment_ids][, routes][,
mtp_tokens], so that every stage knows the RoPE positions, documents, (routing replay) recorded expert routes and
(multi-token prediction, run by the last stage) shifted tokens of the microbatch it is running.
The last stage returns the final norm's output; the schedule's loss function hands it to the loss head
(GPTModel.loss), which projects it onto the vocabulary (chunk by chunk on long sequences), so no stage output is
ever [s, b, V/tp] logits.
"""

from __future__ import annotations

import torch

from qlm_core.kernels.pieces import Documents
from qlm_core.models.gpt import GPTModel


class StageModel(GPTModel):
    """Same parameters and state_dict as GPTModel (it adds no modules), pipeline-friendly forward: the stage's
    hidden states (on the last stage the final norm's output; the schedule's loss_fn takes the loss).
    `replays_routes`: its inputs end with the recorded routes [b, s, MoE layers, k] (the engine sets it)."""

    replays_routes = False
    # its inputs end with the tokens multi-token prediction embeds [b, s, depths] (the engine sets it), which the
    # last stage runs (its output is then GPTModel.hidden_states' [(1 + depths) s, b, h])
    carries_mtp_tokens = False

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, *extras: torch.Tensor,
                documents: Documents | None = None):
        """`documents`: described by the caller instead of segment_ids (a whole model only: shared prefixes)."""
        rest = list(extras)
        mtp_tokens = rest.pop() if self.carries_mtp_tokens else None
        routes = rest.pop() if self.replays_routes else None
        segment_ids = rest[0] if rest else None
        out = self.hidden_states(x, position_ids, segment_ids=segment_ids, routes=routes, mtp_tokens=mtp_tokens,
                                 documents=documents)
        if self.post_process:
            return out
        return (out, position_ids, *extras)
