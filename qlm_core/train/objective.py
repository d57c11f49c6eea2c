"""The objective seam: what a training objective gives the Engine (train/engine.py), which runs the forward and
backward of every micro-batch through whatever parallel layout the recipe asks for and knows nothing of the loss.

An objective is told the step's rows once (`start`), turns the last stage's per-token losses of each micro-batch into
that micro-batch's loss (`loss`; the sum over micro-batches and data/context ranks is the step's loss, as for the
language-model loss), says what of it to report (`reported`) and which figures the step logs (`figures`, a collective:
every rank calls it). `bind` hands it the engine once, for what it builds beside the policy: a reference model and its
pipeline schedule (train/objectives/preference.py). Today's objectives: next-token prediction
(objectives/lm.py) and preference pairs, the DPO family (objectives/preference.py)."""

from __future__ import annotations

from typing import Any, Protocol

import torch


class Objective(Protocol):
    # optional: the loss head's logits are multiplied by it (an RL objective's 1 / sampling temperature, so that the
    # policy's log-probs are those of the distribution the rollout sampled from); absent: 1
    logit_scale: float
    # optional, an RL objective's: its batches carry the rollout's MoE routes (Batch.routes), which an MoE model's
    # layers replay (True) or only compare with their own choices (False); absent or None: no routes
    routing_replay: bool | None

    def bind(self, engine: Any, weights: Any) -> None:
        """Called once by the Engine, after the policy's chunks and pipeline schedule are built; `weights` the
        TensorSource they were filled from (for a reference copy; not to be kept)."""
        ...

    def start(self, batch: Any, inputs: tuple[torch.Tensor, ...], labels: torch.Tensor, tokens: float) -> None:
        """Before the micro-batches of a step or an evaluation: this rank's inputs and labels [rows, s_local] (the
        micro-batches are views of them) and the global count of labelled tokens."""
        ...

    def loss(self, token_loss: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """A micro-batch's loss (what backward starts from) from the loss head's per-token losses [rows, s]."""
        ...

    def reported(self, loss: torch.Tensor) -> torch.Tensor:
        """This rank's share of the step's reported loss from a micro-batch's loss (detached, fp32)."""
        ...

    def figures(self) -> dict[str, float] | None:
        """The last step's figures beside the loss (None: none); every rank calls it."""
        ...
