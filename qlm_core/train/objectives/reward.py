"""A Bradley-Terry reward model (data.kind = "reward") on the Objective seam: the model's score head
(models/score_head.py) scores every token; a row's reward is its score at the sequence's last token, the one
position its labels mark (reward_labels). Rows are laid out as the preference objective's: a micro-batch of P pairs
is the chosen rows of its pairs, then their rejected rows.

    loss = Σ_pairs -log σ(r_chosen - r_rejected) / pairs of the global batch
           (+ center_rewards_coefficient · Σ_pairs (r_chosen + r_rejected)² / pairs)

TRL 1.16's RewardTrainer (its compute_loss), checked against it in tests/train/test_reward_model.py. Under context
parallelism the marked token lives on one CP rank: the row's reward is summed over the CP group (identity
backward), so every CP rank computes the same loss and the reported loss is divided by the CP size, as for the
preference losses. Metrics, TRL's names: accuracy, margin, min_reward, mean_reward, max_reward (over the global
batch's rows)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from qlm_core.parallel import shape_inference
from qlm_core.parallel.comm import all_reduce, group_size
from qlm_core.parallel.tensor import reduce_from_tp

SUM_KEYS = ("accuracy", "margin", "mean_reward")


def reward_labels(labels: torch.Tensor) -> torch.Tensor:
    """Preference rows' labels [rows, seq] (labels[t] = the response token at t + 1, data/preference.py) -> the
    reward objective's: 0 at each row's last token (the position after its last label), -100 elsewhere."""
    labelled = labels >= 0
    if not bool(labelled.any(dim=1).all()):
        raise ValueError("a reward row has no response token")
    last = labels.shape[1] - 1 - labelled.flip(1).int().argmax(dim=1)  # predicts the row's last token
    out = torch.full_like(labels, -100)
    out[torch.arange(labels.shape[0]), last + 1] = 0
    return out


class RewardObjective:
    def __init__(self, center_rewards_coefficient: float | None = None):
        self.center = center_rewards_coefficient

    def bind(self, engine, weights) -> None:
        if engine.spec.head != "score":
            raise ValueError("a reward objective needs a model with a score head")
        if engine.micro_batch_size % 2:
            raise ValueError(f"a reward micro-batch holds pairs: {engine.micro_batch_size} rows is odd")
        self.grid = engine.grid
        self.global_pairs = engine.global_batch_size // 2

    def start(self, batch, inputs, labels: torch.Tensor, tokens: float) -> None:
        device = labels.device
        self.sums = torch.zeros(len(SUM_KEYS), device=device, dtype=torch.float64)
        self.low = torch.full((1,), float("inf"), device=device, dtype=torch.float64)
        self.high = torch.full((1,), float("-inf"), device=device, dtype=torch.float64)

    def loss(self, token_scores: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """A micro-batch's share of the step's loss from its per-token scores [2P, s_local] (0 off the marks)."""
        if shape_inference.active():  # the pipeline's placeholder forward: a loss of the right graph, nothing kept
            return token_scores.sum() * 0.0
        rewards = reduce_from_tp(token_scores.sum(-1), self.grid.cp_group)  # whole rows under CP
        chosen, rejected = rewards.chunk(2)
        loss = -F.logsigmoid(chosen - rejected).sum() / self.global_pairs
        if self.center is not None:
            loss = loss + self.center * ((chosen + rejected) ** 2).sum() / self.global_pairs
        with torch.no_grad():
            margin = (chosen - rejected).double()
            self.sums += torch.stack([(margin > 0).double().sum(), margin.sum(), rewards.double().sum() / 2])
            self.low = torch.minimum(self.low, rewards.double().min().reshape(1))
            self.high = torch.maximum(self.high, rewards.double().max().reshape(1))
        return loss

    def reported(self, loss: torch.Tensor) -> torch.Tensor:
        return loss.detach().float() / group_size(self.grid.cp_group)

    def figures(self) -> dict[str, float]:
        """The step's metrics over the global batch (every rank calls it: collectives)."""
        g = self.grid
        sums, low, high = self.sums.clone(), self.low.clone(), self.high.clone()
        all_reduce(sums, g.dp_cp_group)
        sums /= group_size(g.cp_group)  # every CP rank holds the same sums
        all_reduce(low, g.dp_cp_group, op=dist.ReduceOp.MIN)  # CP ranks hold the same rewards
        all_reduce(high, g.dp_cp_group, op=dist.ReduceOp.MAX)
        if group_size(g.pp_group) > 1:  # only the last stage computed them
            all_reduce(sums, g.pp_group)
            all_reduce(low, g.pp_group, op=dist.ReduceOp.MIN)
            all_reduce(high, g.pp_group, op=dist.ReduceOp.MAX)
        out = {key: (sums[i] / self.global_pairs).item() for i, key in enumerate(SUM_KEYS)}
        return {**out, "min_reward": low.item(), "max_reward": high.item()}
