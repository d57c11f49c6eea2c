"""The RL step the GRPO parity checks run (shared by the pytest module and its torchrun worker): a fixed rollout
batch of the parity suite's tiny model and the layouts with the loss each runs."""

import math

import torch
from parallel_cases import GLOBAL_BATCH, SEQ, SPEC, case_moe, case_spec

from qlm_core.train.objectives.grpo import RolloutBatch
from qlm_core.train.objectives.grpo_loss import GrpoLoss

STEPS, MICRO = 2, 2
GRPO = GrpoLoss(loss_type="grpo", beta=0.04, max_completion_length=SEQ)
DAPO = GrpoLoss(loss_type="dapo", epsilon_high=0.28, max_completion_length=SEQ)
GSPO = GrpoLoss(loss_type="dr_grpo", importance_sampling_level="sequence", beta=0.04, max_completion_length=SEQ)

# name -> (ParallelConfig fields, loss, where the reference's log-probs come from[, the model's data kind of
# parallel_cases: "moe" for the MoE model with its router losses[, routing replay: True replays the batch's recorded
# routes (default for the MoE cases), False only compares them]]); every case runs on 2 ranks. The MoE cases' batch
# brings routes unlike the router's own (random experts), so a layout that lost them would train another model
CASES = {
    "tp2_sp": (dict(tp=2, sp=True), GRPO, "batch"),
    "cp2_grpo": (dict(cp=2, cp_comm_type="p2p"), GRPO, "batch"),
    "cp2_gspo": (dict(cp=2, cp_comm_type="allgather"), GSPO, "batch"),
    "pp2": (dict(pp=2, pp_schedule="1f1b"), DAPO, "batch"),
    "dp2_zero1": (dict(zero_stage=1), DAPO, "batch"),
    "dp2_zero3": (dict(zero_stage=3), GSPO, "batch"),
    "pp2_frozen_reference": (dict(pp=2, pp_schedule="1f1b"), GRPO, "frozen"),
    "cp2_frozen_reference": (dict(cp=2, cp_comm_type="p2p"), GSPO, "frozen"),
    "moe_ep2": (dict(ep=2), DAPO, "batch", "moe"),
    "moe_tp2_ep2": (dict(tp=2, sp=True, ep=2, etp=1), GRPO, "frozen", "moe"),
    "moe_pp2": (dict(pp=2, pp_schedule="1f1b"), DAPO, "batch", "moe"),
    "moe_cp2_compare": (dict(cp=2, cp_comm_type="p2p"), GSPO, "batch", "moe", False),
}


def case_parts(name: str):
    """(ParallelConfig fields, loss, reference, model spec, MoE training options, routing replay) of a case."""
    fields, loss, reference, *rest = CASES[name]
    data = rest[0] if rest else "plain"
    replay = (rest[1] if len(rest) > 1 else True) if data == "moe" else None
    return fields, loss, reference, case_spec(data), case_moe(data), replay


def random_routes(spec, g: torch.Generator) -> torch.Tensor:
    """k different random experts for every token and MoE layer [rows, seq, layers, k], none (-1) on the last two
    positions of each row (tokens a rollout never fed: the router's own choice)."""
    layers = sum(spec.is_moe_layer(index) for index in range(spec.num_layers))
    scores = torch.rand(GLOBAL_BATCH, SEQ, layers, spec.moe.num_experts, generator=g)
    routes = scores.argsort(dim=-1)[..., :spec.moe.topk].to(torch.int32)
    routes[:, -2:] = -1
    return routes


def rollout_batch(spec=SPEC) -> RolloutBatch:
    """Prompts and completions of different lengths (labels -100 on prompt and padding), each prompt answered twice
    (adjacent rows: a group, whose prompt the one-process layouts run once); the rollout's log-probs near a
    random-init model's (-log V), so the ratios fall on both sides of the clip; a reference nearby."""
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, SPEC.vocab_size, (GLOBAL_BATCH, SEQ + 1), generator=g)
    for row in range(1, GLOBAL_BATCH, 2):
        tokens[row, :4 + row] = tokens[row - 1, :4 + row]  # its group's prompt
    input_ids, labels = tokens[:, :-1].clone(), tokens[:, 1:].clone()
    for row in range(GLOBAL_BATCH):
        labels[row, :3 + row - row % 2] = -100
        labels[row, SEQ - 2 * row:] = -100
    mask = labels >= 0
    base = -math.log(SPEC.vocab_size)  # per token and per row apart: GSPO's sequence ratios reach the clip too
    noise = 0.3 * torch.randn(GLOBAL_BATCH, SEQ, generator=g) + 0.3 * torch.randn(GLOBAL_BATCH, 1, generator=g)
    old = torch.where(mask, base + noise, torch.zeros(()))
    ref = torch.where(mask, base + 0.3 * torch.randn(GLOBAL_BATCH, SEQ, generator=g), torch.zeros(()))
    routes = random_routes(spec, g) if spec.moe is not None else None
    return RolloutBatch(input_ids, labels, old_logps=old, ref_logps=ref,
                        advantages=torch.randn(GLOBAL_BATCH, generator=g), routes=routes)


def rank_rows(batch: RolloutBatch, dp_rank: int, dp: int) -> RolloutBatch:
    rows = GLOBAL_BATCH // dp
    mine = slice(dp_rank * rows, (dp_rank + 1) * rows)
    return RolloutBatch(batch.input_ids[mine], batch.labels[mine], old_logps=batch.old_logps[mine],
                        ref_logps=batch.ref_logps[mine], advantages=batch.advantages[mine],
                        routes=None if batch.routes is None else batch.routes[mine])
