"""What qlm's trainer stores in a Megatron checkpoint beside Megatron's own entries: the one description of that
schema, written by `qlm train` and carried through `qlm convert mcore2mcore`.

Per legacy `torch` rank file (mp_rank_TT[_PPP]/model_optim_rng.pt), next to args, checkpoint_version, iteration and
model / model0, model1, ...:
  qlm_optimizer        {"step": n, "master": [chunk dicts], "exp_avg": [...], "exp_avg_sq": [...]}: the fp32 master
                       weights and Adam moments per parameter, named and sharded exactly like the weights (one dict
                       per virtual chunk), so any reshard carries them like the weights. Frozen parameters have none;
                       LoRA runs hold the adapters' only.
  qlm_train_state      TrainState as a dict: iteration (optimizer steps done), consumed samples, skipped steps.
  opt_param_scheduler  Megatron's scheduler entry (the LR schedule's position).
  rng_state            a list, one RNG state per data/context-parallel rank of this file's TP/PP position.

torch_dist keeps the same: the optimizer views as DCP tensors under the weights' keys prefixed by
`qlm_optimizer.<view>.` and chunked like them (Megatron-LM ignores these extra keys when it loads the weights); the
step, train state and scheduler in common.pt; the RNG states of every position as {"TP_PP": list} in common.pt.

A reshard re-slices the optimizer views through the layout like the weights and copies step, train state and
scheduler; RNG states are carried only when TP, PP and VPP are unchanged (a new grid has other ranks).
"""

from __future__ import annotations

from qlm_core.parallel.optimizer_api import OPTIMIZER_VIEWS

OPTIMIZER_KEY = "qlm_optimizer"
TRAIN_STATE_KEY, SCHEDULER_KEY, RNG_KEY = "qlm_train_state", "opt_param_scheduler", "rng_state"
# Megatron entries of a run's file that a reshard copies as they are.
COPIED_KEYS = (TRAIN_STATE_KEY, SCHEDULER_KEY, "num_floating_point_operations_so_far")

__all__ = ["COPIED_KEYS", "OPTIMIZER_KEY", "OPTIMIZER_VIEWS", "RNG_KEY", "SCHEDULER_KEY", "TRAIN_STATE_KEY",
           "rng_position_key", "saved_rng_states", "view_prefix"]


def view_prefix(view: str) -> str:
    """torch_dist: the key prefix of a view's tensors ("" for the weights, view "model")."""
    return "" if view == "model" else f"{OPTIMIZER_KEY}.{view}."


def rng_position_key(tp_rank: int, pp_rank: int) -> str:
    return f"{tp_rank}_{pp_rank}"


def saved_rng_states(source, tp_rank: int, pp_rank: int) -> list | None:
    """The RNG states a checkpoint (either format) keeps for the data/context ranks of one TP/PP position."""
    saved = source.extra_state(RNG_KEY, tp_rank, pp_rank)
    return saved.get(rng_position_key(tp_rank, pp_rank)) if isinstance(saved, dict) else saved
