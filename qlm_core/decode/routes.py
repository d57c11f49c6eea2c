"""Routing replay's record (R3): the experts an MoE model's layers choose for every token decoding feeds it, one
table of [rows, prompt + new tokens, MoE layers, k] written once per forward, int16 (an expert index; -1: none)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from qlm_core.models.gpt import GPTModel


class RouteRecorder:
    """The routes of a decode batch of `rows` whose prompts are `prompt_width` wide (left-padded) and that get at most
    `max_new` tokens; a model without MoE layers (or `enabled` False) records nothing."""

    def __init__(self, model: GPTModel, rows: int, prompt_width: int, max_new: int, enabled: bool):
        spec = model.spec
        self.tracker = model.moe.tracker if enabled and spec.moe is not None else None
        if self.tracker is not None:
            layers = spec.moe.num_moe_layers(spec.num_layers)
            self.table = torch.full((rows, prompt_width + max_new, layers, spec.moe.topk), -1, dtype=torch.int16)
            self.lengths = torch.zeros(rows, dtype=torch.long)

    def run(self, forward: Callable[..., torch.Tensor], *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """forward(*args, **kwargs) and the routes its MoE layers chose, [s, b, MoE layers, k] (None: not
        recording)."""
        if self.tracker is None:
            return forward(*args, **kwargs), None
        self.tracker.recording = []
        try:
            out = forward(*args, **kwargs)
            return out, torch.stack(self.tracker.recording, dim=2).to(device="cpu", dtype=torch.int16)
        finally:
            self.tracker.recording = None

    def keep_prompts(self, routes: torch.Tensor, prompt_lengths: Sequence[int]) -> None:
        """The prefill's routes [width, rows, ...]: each row's prompt is its last tokens (left padding)."""
        width = routes.shape[0]
        for row, length in enumerate(prompt_lengths):
            self.table[row, :length] = routes[width - length:, row]
            self.lengths[row] = length

    def keep_step(self, routes: torch.Tensor, slots: Sequence[int], rows: Sequence[int]) -> None:
        """A decode step's routes [1, batch, ...]: those of `slots`, the token each of `rows` was fed."""
        if not rows:
            return
        rows_index = torch.tensor(rows, dtype=torch.long)
        self.table[rows_index, self.lengths[rows_index]] = routes[0, torch.tensor(slots, dtype=torch.long)]
        self.lengths[rows_index] += 1

    def routes(self, row: int) -> torch.Tensor | None:
        return self.table[row, :self.lengths[row]].clone() if self.tracker is not None else None
