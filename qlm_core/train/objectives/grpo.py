"""Group-relative policy optimisation on the Objective seam: each micro-batch's loss is grpo_loss.py's over its
rows' completion tokens, from the policy's log-probs (the loss head's per-token losses, negated), the rollout
policy's (π_old) and, for a KL term, the reference's, with each row's advantage.

The step's rows come as a RolloutBatch: a Batch whose labels are the completion tokens (-100 on the prompt and
padding) with, aligned to them, `old_logps` and `ref_logps` [rows, seq] and `advantages` [rows]. They are split
over context-parallel ranks exactly as the labels are. Each micro-batch's loss is its share of the step's (the
normalisers count every micro-batch and data-parallel rank: StepCounts), so the reported losses and the gradients
add up over micro-batches and ranks as the language-model loss's do; a sequence's mean (loss_type grpo's token
mean, GSPO's ratio) spans its context-parallel parts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from qlm_core.parallel import shape_inference
from qlm_core.parallel.comm import all_reduce, group_size
from qlm_core.parallel.tensor import sum_across
from qlm_core.train.engine import Batch
from qlm_core.train.objectives.frozen import frozen_chunks
from qlm_core.train.objectives.grpo_loss import (
    GrpoLoss,
    StepCounts,
    grpo_metric_sums,
    grpo_token_loss,
    reduce_grpo_loss,
    rollout_correction_weights,
)
from qlm_core.train.objectives.microbatch import microbatch_index

ReferenceSource = Literal["batch", "frozen"]
METRICS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "kl")


@dataclass
class RolloutBatch(Batch):
    """A Batch of rollouts: per-token log-probs aligned with `labels` (the rollout's and the reference's; 0 where
    the label is -100) and each row's advantage."""

    old_logps: torch.Tensor | None = None
    ref_logps: torch.Tensor | None = None
    advantages: torch.Tensor | None = None


class GrpoObjective:
    def __init__(self, loss: GrpoLoss, temperature: float = 1.0, reference: ReferenceSource = "batch",
                 routing_replay: bool | None = None, shared_prefix: bool = True):
        """`temperature`: the rollout's sampling temperature; the policy's and the reference's log-probs are
        log_softmax(logits / T), the distribution the rollout drew from (as TRL computes them). `reference` (a KL
        term, beta > 0): "batch" — the RolloutBatch brings ref_logps —, or "frozen" — a frozen copy of the starting
        weights, run forward on each step's rows (routed by its own routers). `routing_replay` (an MoE policy): the
        batches bring the rollout's routes, which the policy's MoE layers replay (True, R3) or only compare with
        their own choices (False); None: the batches bring none. `shared_prefix`: a group's rows run their prompt
        once where the layout allows (Engine.shares_prefixes, train/shared_prefix.py)."""
        self.config = loss
        self.routing_replay = routing_replay
        self.shares_prefixes = shared_prefix
        self.logit_scale = 1.0 / temperature if temperature > 0 else 1.0
        self.reference = reference
        self.reference_chunks = self.reference_runner = None

    def bind(self, engine, weights) -> None:
        self.engine = engine
        self.grid = engine.grid
        self.micro_rows = engine.micro_batch_size
        self.dp = engine.grid.sizes.dp
        if self.reference == "frozen" and self.config.beta != 0.0:
            self.reference_chunks = frozen_chunks(engine, weights)
            self.reference_runner = engine.make_runner(self.reference_chunks, self._reference_loss_fn())

    def _reference_loss_fn(self):
        def record(hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                token_loss = self.reference_chunks[-1].loss(hidden * self.logit_scale, labels)
                if not shape_inference.active():  # not the pipeline's placeholder forward
                    first = microbatch_index(self.labels, labels, self.micro_rows) * self.micro_rows
                    self.ref[first:first + self.micro_rows] = -token_loss.float()
                return token_loss.sum()
        return record

    def start(self, batch: RolloutBatch, inputs, labels: torch.Tensor, tokens: float) -> None:
        if batch.old_logps is None or batch.advantages is None:
            raise ValueError("a GRPO step needs a RolloutBatch with old_logps and advantages")
        if self.config.beta != 0.0 and batch.ref_logps is None and self.reference_chunks is None:
            raise ValueError("a KL term (rl.beta > 0) needs the reference's log-probs in the batch or a frozen "
                             "reference")
        self.labels = labels
        self.old = self.engine.local_tokens(batch.old_logps.float())
        self.ref = None if batch.ref_logps is None else self.engine.local_tokens(batch.ref_logps.float())
        if self.reference_chunks is not None:  # the frozen starting weights' log-probs of these rows
            self.ref = torch.zeros(labels.shape, dtype=torch.float32, device=labels.device)
            with torch.no_grad():  # it routes by its own routers
                self.engine.forward_backward_chunks(self.reference_chunks, self.reference_runner,
                                                    self._reference_loss_fn(), self.engine.without_routes(inputs),
                                                    labels, backward=False)
        self.advantages = batch.advantages.float().to(self.grid.device)
        self.step = StepCounts(sequences=labels.shape[0] * self.dp, tokens=int(tokens))
        self.sums = torch.zeros(2 * len(METRICS), dtype=torch.float64, device=labels.device)
        # |log π_train - log π_rollout| over the completion tokens: (sum, count), and the largest
        self.drift = torch.zeros(2, dtype=torch.float64, device=labels.device)
        self.drift_max = torch.zeros((), dtype=torch.float64, device=labels.device)

    def loss(self, token_loss: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if shape_inference.active():  # the pipeline's placeholder forward: a loss of the right graph, nothing kept
            return token_loss.sum() * 0.0
        first = microbatch_index(self.labels, labels, self.micro_rows) * self.micro_rows
        rows = slice(first, first + self.micro_rows)
        mask = labels >= 0
        cp_group = self.grid.cp_group
        spans = group_size(cp_group) > 1

        def row_sum(x: torch.Tensor) -> torch.Tensor:
            return sum_across(x.sum(-1), cp_group) if spans else x.sum(-1)

        row_tokens = None
        if spans:
            row_tokens = all_reduce(mask.sum(-1).to(torch.float32), cp_group)
        logps = -token_loss.float()
        old, correction = self.old[rows], None
        if self.config.rollout_correction != "none":
            # π_old is the trainer's own at the rollout's weights (this step's forward, before its update); the
            # rollout's log-probs only weigh each token by how far they are from it (TIS / masked IS)
            correction = rollout_correction_weights(self.config, logps.detach(), old, mask, row_sum)
            old = logps.detach()
        per_token, stats = grpo_token_loss(self.config, logps, old, self.advantages[rows], mask,
                                           None if self.ref is None else self.ref[rows], row_sum=row_sum,
                                           correction=correction)
        drift = (logps.detach() - self.old[rows]).abs().double() * mask
        self.drift += torch.stack([drift.sum(), mask.sum().double()])
        self.drift_max = torch.maximum(self.drift_max, drift.max())
        sums = grpo_metric_sums(stats, mask)
        for index, name in enumerate(METRICS):
            total, count = sums.get(name, (0.0, 0.0))
            self.sums[2 * index] += total
            self.sums[2 * index + 1] += count
        return reduce_grpo_loss(self.config, per_token, mask, self.step, row_tokens)

    def reported(self, loss: torch.Tensor) -> torch.Tensor:
        return loss.detach().float()

    def figures(self) -> dict[str, float]:
        """TRL's metrics over the step's completion tokens, every rank's (a collective)."""
        sums = all_reduce(self.sums.clone(), self.grid.dp_cp_group)
        if group_size(self.grid.pp_group) > 1:  # only the last stage computed them
            all_reduce(sums, self.grid.pp_group)
        out = {}
        for index, name in enumerate(METRICS):
            total, count = sums[2 * index].item(), sums[2 * index + 1].item()
            if count > 0 and (name != "kl" or self.config.beta != 0.0):
                out[name] = total / count
        drift = all_reduce(self.drift.clone(), self.grid.dp_cp_group)
        largest = all_reduce(self.drift_max.clone(), self.grid.dp_cp_group, op=dist.ReduceOp.MAX)
        if group_size(self.grid.pp_group) > 1:
            all_reduce(drift, self.grid.pp_group)
            all_reduce(largest, self.grid.pp_group, op=dist.ReduceOp.MAX)
        if drift[1] > 0:  # slime's and NeMo-RL's check: the trainer's log-probs of the rollout's own tokens
            out["train_rollout_logprob_abs_diff/mean"] = (drift[0] / drift[1]).item()
            out["train_rollout_logprob_abs_diff/max"] = largest.item()
        return out
