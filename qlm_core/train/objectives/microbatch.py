"""Which micro-batch the loss function is handed: the engine's micro-batches are views of the step's labels (every
schedule slices them in rows of micro_batch_size), so a view's offset names it. Objectives that keep per-row data for
the step (reference log-probs, advantages) find their rows with it."""

from __future__ import annotations

import torch


def microbatch_index(step_labels: torch.Tensor, labels: torch.Tensor, micro_rows: int) -> int:
    """Which micro-batch `labels` (a view of `step_labels`, this rank's [rows, s_local]) is."""
    offset = labels.data_ptr() - step_labels.data_ptr()
    row_bytes = step_labels.stride(0) * step_labels.element_size()
    if labels.shape[1:] != step_labels.shape[1:] or offset % (row_bytes * micro_rows):
        raise RuntimeError("the loss function was handed labels that are not a micro-batch of the step's")
    return offset // (row_bytes * micro_rows)
