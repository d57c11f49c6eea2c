"""What multi-token prediction trains on: for depth k (1-based) of mtp_num_layers, position i embeds token i + k and
predicts label i + k (the token k + 1 places on), both within i's document; where there is no such token the
embedded id is 0 and the label ignored, as Megatron-Core's roll_tensor fills them. Made on whole rows, before the
context-parallel split, so the shifted values of a rank's tokens may come from another rank's chunk."""

from __future__ import annotations

import torch

IGNORED = -100


def shifted(values: torch.Tensor, depth: int, segment_ids: torch.Tensor | None, fill: int) -> torch.Tensor:
    """values [rows, s] moved left by `depth` within each document (segment_ids [rows, s]; None: one per row),
    `fill` where position i + depth is past the row or in another document."""
    out = torch.full_like(values, fill)
    if depth >= values.shape[1]:
        return out
    moved = values[:, depth:]
    if segment_ids is not None:
        moved = torch.where(segment_ids[:, depth:] == segment_ids[:, :-depth], moved, fill)
    out[:, :-depth] = moved
    return out


def mtp_targets(input_ids: torch.Tensor, labels: torch.Tensor, segment_ids: torch.Tensor | None,
                depths: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, labels), each [rows, s, depths]: what depth k + 1 embeds and predicts at every position."""
    tokens = torch.stack([shifted(input_ids, k, segment_ids, 0) for k in range(1, depths + 1)], dim=-1)
    targets = torch.stack([shifted(labels, k, segment_ids, IGNORED) for k in range(1, depths + 1)], dim=-1)
    return tokens, targets
