"""How a rank's model runs, shared by every part of a layer (attention kinds, MLPs, the layer itself): its parallel
groups and recompute choices (ParallelOptions), the regions torch.compile leaves eager, and Megatron's
output-discarding checkpoint."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed import ProcessGroup

from qlm_core.parallel.comm import group_size
from qlm_core.parallel.expert_dispatch import ExpertParallel

_eager_call = None  # torch.compiler.disable'd call, made by the first compile_forward (it imports dynamo: 1.5 s)


def allow_eager_regions() -> None:
    """Make outside_compile a graph break (once, when a layer is first compiled)."""
    global _eager_call
    if _eager_call is None:
        _eager_call = torch.compiler.disable(_call)


def outside_compile(fn, *args):
    """fn(*args), run eagerly where a compiled layer reaches it: a graph break torch.compile takes on purpose, for
    the regions compilation leaves out (TransformerLayer.compile_forward)."""
    return fn(*args) if _eager_call is None else _eager_call(fn, *args)


def _call(fn, *args):
    return fn(*args)


@dataclass(frozen=True)
class ParallelOptions:
    """How this rank's model is parallelised and recomputed. Groups of None mean size 1."""

    tp_group: ProcessGroup | None = None
    sequence_parallel: bool = False
    cp_group: ProcessGroup | None = None
    cp_comm_type: str = "p2p"
    recompute: str = "none"  # none | selective (recompute_modules) | full (whole layers) | op (per-op policy)
    recompute_num_layers: int | None = None  # with full: the first N layers of this module (None: all)
    recompute_modules: tuple[str, ...] = ("core_attn",)  # with selective: Megatron's --recompute-modules
    experts: ExpertParallel | None = None  # expert parallelism (None: the routed experts follow the TP split)
    dp_cp_group: ProcessGroup | None = None  # the data x context ranks (the global MoE load-balancing loss)

    @property
    def sp(self) -> bool:
        return self.sequence_parallel and group_size(self.tp_group) > 1

    def recomputes(self, module: str) -> bool:
        """Whether selective recompute covers `module` (one of config.RecomputeModule) in a forward that trains."""
        return self.recompute == "selective" and module in self.recompute_modules and torch.is_grad_enabled()


def discard_output(output: torch.Tensor, consumer_output: torch.Tensor, recompute) -> None:
    """Megatron's output-discarding checkpoint (CheckpointWithoutOutput): the ops after a recomputed norm save its
    output, so keeping it would save nothing. Free its storage now (forward has used it) and, when the gradient of
    `consumer_output` (the attention or MLP block after the norm) arrives, before any op of that block runs its
    backward, refill the same storage with `recompute()`. Storage-level, so no version counter moves."""
    if not consumer_output.requires_grad:
        return
    storage = output.untyped_storage()
    nbytes = storage.nbytes()
    storage.resize_(0)

    def refill(grad):
        if storage.nbytes() == 0:
            with torch.no_grad():
                value = recompute()
            storage.resize_(nbytes)
            storage.copy_(value.untyped_storage())
        return grad

    consumer_output.register_hook(refill)
