"""Reading and writing FSDP2's DTensor parameters as plain tensors, duck-typed so that code that only may meet a
DTensor (checkpoints, LoRA) does not import FSDP or DTensor (and their seconds of start-up) to handle plain ones."""

from __future__ import annotations

import torch


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of an FSDP2 DTensor (any other tensor as it is)."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of an FSDP2 DTensor, gathered over its mesh (a collective); any other tensor as it is."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def local_shard_like(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """This rank's local shard of `full`, sharded as the DTensor `param` is."""
    if not hasattr(param, "device_mesh"):
        return full.to(param.device)
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full.to(param.device), param.device_mesh, param.placements).to_local()
