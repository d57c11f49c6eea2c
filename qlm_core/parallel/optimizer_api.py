"""The interface of a training back-end: gradient synchronisation and the optimizer, as one object.

Two back-ends implement it: DistributedOptimizer over GradientBuffers (ZeRO 0-2, parallel/optimizer.py) and
FullyShardedState (ZeRO 3, FSDP2, parallel/fsdp.py). The engine and checkpointing call only these.

One step: zero_grad(); forward and backward over every microbatch; finish_grad_sync(); clip_grad_norm(); step().
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn

# The fp32 state kept per parameter, in this order (checkpoints store each as a view named like the weights): what a
# checkpoint format needs of the optimizer, without importing it.
OPTIMIZER_VIEWS = ("master", "exp_avg", "exp_avg_sq")

# (param index, its shape) -> the fp32 host tensors its master, exp_avg and exp_avg_sq go into (an asynchronous
# save's reused buffers)
HostTarget = Callable[[int, tuple[int, ...]], list[torch.Tensor]]


class TrainingOptimizer(Protocol):
    # The trainable parameters as the model now holds them (FSDP2 replaces the originals by DTensors), in the
    # order of full_param_states and load_full_param_states.
    params: list[nn.Parameter]

    def zero_grad(self) -> None:
        """Start of a step: drop the previous step's gradients."""
        ...

    def finish_grad_sync(self) -> None:
        """After the last backward of a step: reduce whatever backward did not, and wait for every reduction.
        Afterwards the gradients are final."""
        ...

    def clip_grad_norm(self, max_norm: float) -> float:
        """The global gradient norm (a collective over every rank); the gradients are scaled down to `max_norm`
        when above it (> 0; 0 only measures). A non-finite norm is returned unclipped: skip step()."""
        ...

    def step(self) -> None:
        """AdamW on the fp32 masters; the model parameters then hold the updated values."""
        ...

    def set_lr(self, lr: float) -> None: ...

    def wait_param_gather(self) -> None:
        """Wait for the parameter all-gathers the last step() left in flight, before anything reads the parameters
        outside a forward (evaluation, checkpoints)."""
        ...

    def full_grad(self, param: nn.Parameter) -> torch.Tensor:
        """This rank's whole (TP-local) reduced gradient of `param`, for inspection after finish_grad_sync; may be
        a collective over the data ranks."""
        ...

    def full_param_states(self, into: HostTarget | None = None) -> tuple[list[dict[str, torch.Tensor]], int]:
        """Per entry of `params`: its whole fp32 master, exp_avg and exp_avg_sq on the CPU, shaped like the
        parameter (a collective over the data ranks); and the step count. `into`: the host tensors
        to fill per entry (reused across saves) instead of fresh ones."""
        ...

    def load_full_param_states(self, states: list[dict[str, torch.Tensor]], step: int) -> None:
        """Inverse of full_param_states: each rank keeps its part, and the model parameters take the masters."""
        ...
