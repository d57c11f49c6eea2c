"""Next-token prediction: the loss head's per-token losses summed over the micro-batch and divided by the global
batch's labelled tokens, so that the sum over micro-batches and ranks is the mean over every labelled token."""

from __future__ import annotations

import torch


class LanguageModelObjective:
    def __init__(self):
        self.tokens = 1.0

    def bind(self, engine, weights) -> None:
        pass

    def start(self, batch, inputs, labels: torch.Tensor, tokens: float) -> None:
        self.tokens = tokens

    def loss(self, token_loss: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return token_loss.sum() / self.tokens

    def reported(self, loss: torch.Tensor) -> torch.Tensor:
        return loss.detach().float()

    def figures(self) -> None:
        return None
