"""One training step's MoE figures for metrics.jsonl, from the records every MoE layer leaves in its chunk's
MoeTracker: the load-balancing and z-losses as they entered the objective (coefficients included, the mean over the
global batch's micro-batches, summed over layers), and the spread of tokens per expert (an expert's share of its
layer's top-k choices over the step, relative to an even split: the largest and the smallest over every layer and
expert), and with an RL batch's recorded routes (routing replay) the share of (token, MoE layer) routes where the
trainer's router chose other experts than the rollout did (`moe_route_mismatch`; their count: `moe_routes_differed`).

A layer's loss is split over the ranks that hold shards of its tokens (SP's TP ranks, CP ranks): those parts are
summed; TP ranks without SP each hold the whole value. Token counts are already whole over the sequence shards.
Only the step's own micro-batches count: torch's pipelining runs one more forward of each stage in its first step
to infer shapes (through the real modules), and its records, which come first, are left out.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from qlm_core.config import MoeConfig
from qlm_core.models.moe import MoELayer
from qlm_core.models.spec import ModelSpec
from qlm_core.parallel.comm import all_reduce, group_size
from qlm_core.parallel.state import Grid


class MoeStepStats:
    def __init__(self, spec: ModelSpec, moe: MoeConfig, grid: Grid, sequence_parallel: bool, num_microbatches: int):
        self.spec, self.moe, self.grid, self.num_microbatches = spec, moe, grid, num_microbatches
        self.sequence_parallel = sequence_parallel and group_size(grid.tp_group) > 1
        self._transformers_aux = torch.zeros((), device=grid.device)

    def start(self, chunks) -> None:
        """Drop what earlier forwards recorded (evaluation records nothing, but a caller may have run forwards)."""
        for chunk in chunks:
            chunk.moe.tracker.take_records()
            chunk.moe.tracker.pending.clear()
            chunk.moe.tracker.reset_step()
        self._transformers_aux = torch.zeros((), device=self.grid.device)

    def add_transformers_aux(self, value: torch.Tensor) -> None:
        self._transformers_aux = self._transformers_aux + value.float()

    def finish(self, chunks, loss_scale: float) -> dict[str, float] | None:
        """The step's figures, the same on every rank (collectives over the data, TP, CP and pipeline groups)."""
        if self.spec.moe is None:
            return None
        g, device = self.grid, self.grid.device
        records = [record for chunk in chunks for record in self._step_records(chunk)]
        aux = (self._transformers_aux if self.moe.aux_loss_type == "transformers"
               else sum((r.aux_loss.float() for r in records), torch.zeros((), device=device)))
        z = sum((r.z_loss.float() for r in records), torch.zeros((), device=device))
        # routing replay: [routes the trainer's routers chose otherwise, routes replayed] — summed over the same
        # ranks as the losses' parts (TP ranks without SP each saw every token: counted once), in the same reduce
        routes = [r.route_mismatch.float() for r in records if r.route_mismatch is not None]
        mismatch = torch.stack(routes).sum(0) if routes else torch.zeros(2, device=device)
        losses = torch.cat([torch.stack([aux, z]) * loss_scale, mismatch])
        all_reduce(losses, g.dp_cp_group)
        if self.sequence_parallel:
            all_reduce(losses, g.tp_group)
        all_reduce(losses, g.pp_group)
        counts: dict[int, torch.Tensor] = {}
        for record in records:
            counts[record.layer] = counts.get(record.layer, 0) + record.tokens_per_expert.float()
        spread = torch.tensor([0.0, -float("inf")], device=device)  # (largest, -smallest) share over even
        if counts:
            layers = torch.stack([counts[layer] for layer in sorted(counts)])
            # every rank of the group holds the same layers; CP ranks hold the same counts (whole over the
            # sequence), so this sums them cp times: only the shares below are reported
            all_reduce(layers, g.dp_cp_group)
            share = layers / layers.mean(dim=1, keepdim=True).clamp(min=1e-12)
            spread = torch.stack([share.max(), -share.min()])
        all_reduce(spread, g.pp_group, op=dist.ReduceOp.MAX)
        figures = {"moe_aux_loss": losses[0].item(), "moe_z_loss": losses[1].item(),
                   "moe_load_max": spread[0].item(), "moe_load_min": -spread[1].item()}
        if losses[3] > 0:  # the step's batch carried routes
            figures.update(moe_route_mismatch=(losses[2] / losses[3]).item(), moe_routes_differed=losses[2].item())
        return figures

    def _step_records(self, chunk) -> list:
        """The chunk's records of this step's micro-batches: one per MoE layer and micro-batch, the last ones."""
        records = chunk.moe.tracker.take_records()
        layers = chunk.transformer_layers(mtp=chunk.carries_mtp_tokens)  # multi-token prediction's when they ran
        moe_layers = sum(isinstance(layer.mlp, MoELayer) for layer in layers)
        return records[len(records) - moe_layers * self.num_microbatches:] if moe_layers else []
