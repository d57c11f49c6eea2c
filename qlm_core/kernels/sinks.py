"""Attention sinks (gpt-oss; Megatron-Core's softmax_type "learnable", its `softmax_offset`): a learned logit per
head that joins every query's softmax with no value, so a query may give part of its weight to nothing.

With the sink, p_j = exp(s_j) / (Z + exp(sink)) where Z = exp(lse) is the plain attention's normaliser; hence the
output is the plain one times exp(lse - lse') and the log-sum-exp is lse' = logaddexp(lse, sink). Both apply after
every piece (and every context-parallel block) is merged, to whatever kernel computed them. The backward of the
keys' scores is the plain kernels' own when they are handed (out', lse'): they recompute p_j = exp(s_j - lse') and
take D = rowsum(dO * out'), which is dL/ds_j = p_j (dP_j - D) with the sink's zero value in D. The sink's gradient
is -Σ p_sink · D over the head's queries, p_sink = exp(sink - lse').
"""

from __future__ import annotations

import torch


def add_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor | None) -> None:
    """In place: out [b, h, s, d] and lse [b, h, s] of plain attention (both in the accumulation dtype, before
    the output's one rounding) become those with one sink logit per head (sinks [h]; None: no sinks, nothing to
    do). A query that saw no key keeps out 0 and gets lse = its sink."""
    if sinks is None:
        return
    sink = sinks.detach().to(lse.dtype)[None, :, None]
    new = torch.logaddexp(lse, sink)
    out.mul_(torch.exp(lse - new)[..., None])
    lse.copy_(new)


def sinks_grad(grad_out: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
               sinks: torch.Tensor | None) -> torch.Tensor | None:
    """dL/dsinks [h] given the sinked out and lse (add_sinks) and dL/dout (None without sinks)."""
    if sinks is None:
        return None
    rowsum = (grad_out.to(lse.dtype) * out.to(lse.dtype)).sum(dim=-1)  # D of every query [b, h, s]
    p_sink = torch.exp(sinks.detach().to(lse.dtype)[None, :, None] - lse)
    return -(p_sink * rowsum).sum(dim=(0, 2)).to(sinks.dtype)


def sink_probabilities(scores: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """softmax over [scores, sink] without the sink's column: scores [..., keys] (fp32, -inf where masked), `sink`
    broadcastable to scores[..., :1]; for the one-query decoding step, whose scores are small."""
    lse = torch.logaddexp(scores.logsumexp(dim=-1, keepdim=True), sink.to(scores.dtype))
    return torch.exp(scores - lse)
