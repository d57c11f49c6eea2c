"""A reward model's head (ModelSpec.head = "score"): one scalar per token, w · h_t, from the final norm's output; the
objective reads it at each sequence's last token (train/objectives/reward.py). The weight [1, h] is whole on every
tensor-parallel rank (transformers' `score.weight` of a one-label *ForSequenceClassification, no bias); it is
Megatron's `output_layer.weight` in qlm's files, as the vocabulary projection it replaces.

Under sequence parallelism each TP rank scores its sequence shard and the scores (not the hidden states) are
gathered; the weight's gradient is then partial per rank and summed over TP like a norm's (marked so)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qlm_core.parallel.param_meta import mark
from qlm_core.parallel.tensor import MegatronLinearState, gather_from_sp_whole_grad


class ScoreHead(MegatronLinearState, nn.Module):
    def __init__(self, hidden_size: int, *, tp_group, sequence_parallel: bool, dtype: torch.dtype):
        super().__init__()
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        self.weight = mark(nn.Parameter(torch.empty(1, hidden_size, dtype=dtype)),
                           sequence_parallel=sequence_parallel)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """The final norm's output [s_local, b, h] (this rank's shard under SP) -> scores [b, s] in fp32."""
        scores = F.linear(hidden, self.weight)
        if self.sequence_parallel:
            scores = gather_from_sp_whole_grad(scores, self.tp_group)
        return scores.squeeze(-1).transpose(0, 1).float()
