"""One training step of the hybrid-parallel model.

The engine builds this rank's stage models (its TP shard of its pipeline stage's chunks), fills them from any
TensorSource (random init, an HF or a Megatron checkpoint), and runs a step: split the rank's rows of the global
batch into microbatches and its context-parallel chunks, run them (through the pipeline schedule when pp > 1),
reduce gradients over data x context ranks (ZeRO 0-2: GradientBuffers; ZeRO 3: FSDP2), clip by the global norm
and update with AdamW on fp32 master weights.

The loss of a step is the mean over every non-ignored label of the global batch, whatever the layout: each
microbatch's summed token loss is divided by the global token count, and gradients are summed, never averaged.
MoE models add their load-balancing and z-losses (the recipe's [moe]) as the mean over the global batch's
micro-batches; the step's loss stays the language-model loss, and StepResult.moe reports the MoE terms.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from qlm_core.checkpoint.sources.random_init import RandomInitSource
from qlm_core.config import LoraConfig, MoeConfig, OptimConfig, ParallelConfig
from qlm_core.dtypes import DTYPES
from qlm_core.models.build import RankCoords, build_rank_model
from qlm_core.models.gpt import ParallelOptions
from qlm_core.models.layout import TensorSource, recipe_layout
from qlm_core.models.moe import MoELayer, updated_expert_bias
from qlm_core.models.spec import ModelSpec
from qlm_core.models.stage import StageModel
from qlm_core.parallel import shape_inference
from qlm_core.parallel.comm import all_reduce, group_size
from qlm_core.parallel.context_parallel import split_for_cp
from qlm_core.parallel.cross_entropy import DEFAULT_CHUNK_TOKENS
from qlm_core.parallel.expert_dispatch import ExpertParallel
from qlm_core.parallel.optimizer_api import TrainingOptimizer
from qlm_core.parallel.param_meta import mark
from qlm_core.parallel.state import Grid
from qlm_core.parallel.tensor import gather_from_sp_whole_grad, scatter_to_sp
from qlm_core.train.lora import apply_lora
from qlm_core.train.moe_stats import MoeStepStats
from qlm_core.train.mtp_targets import mtp_targets
from qlm_core.train.objective import Objective
from qlm_core.train.objectives.lm import LanguageModelObjective
from qlm_core.train.shared_prefix import pack_shared_prefixes
from qlm_core.train.validate import validate_grad_reduce_dtype, validate_layout, validate_moe


@dataclass
class Batch:
    """This data-parallel rank's rows of the global batch: [rows, seq]; labels -100 are ignored."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor | None = None
    segment_ids: torch.Tensor | None = None
    reference_logps: torch.Tensor | None = None  # preference, precomputed reference: per row [rows]
    # RL on an MoE model: the experts the rollout routed each input token to [rows, seq, MoE layers, k] (-1: none)
    routes: torch.Tensor | None = None


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    tokens: int
    skipped: bool = False
    moe: dict[str, float] | None = None  # MoE models: moe_aux_loss, moe_z_loss, moe_load_max, moe_load_min
    figures: dict[str, float] | None = None  # the objective's (preference training: TRL's rewards/... and logps/...)


def param_groups(params: list[torch.nn.Parameter], weight_decay: float) -> list[dict]:
    """No weight decay on biases and norm weights (every 1-D parameter)."""
    decay = [p for p in params if p.dim() > 1]
    no_decay = [p for p in params if p.dim() <= 1]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


class Engine:
    """This rank's stage models and their optimizer, and the steps that train or evaluate them on a global batch.

    `source` fills the weights (default: random init from `seed`); `lora` with rank > 0 trains only adapters on
    the frozen loaded weights; `loss_chunk_tokens` is the loss head's chunk (GPTModel.loss; 0: whole logits);
    `moe` how MoE layers train; `compile` compiles each decoder layer (GPTModel.compile_layers: the first step pays
    the compile cost). `objective` turns each micro-batch's per-token losses into its loss (train/objective.py;
    default: next-token prediction, objectives/lm.py; preference pairs: objectives/preference.py).
    """

    def __init__(
        self,
        spec: ModelSpec,
        config: ParallelConfig,
        grid: Grid,
        micro_batch_size: int,
        global_batch_size: int,
        seq_length: int,
        dtype: torch.dtype = torch.float32,
        optim: OptimConfig | None = None,
        source: TensorSource | None = None,
        seed: int = 1234,
        lora: LoraConfig | None = None,
        loss_chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
        moe: MoeConfig | None = None,
        compile: bool = False,
        objective: Objective | None = None,
        mtp_loss_scaling_factor: float = 0.1,
    ):
        self.spec, self.config, self.grid = spec, config, grid
        self.moe = MoeConfig() if moe is None else moe
        self.micro_batch_size, self.global_batch_size, self.seq_length = micro_batch_size, global_batch_size, seq_length
        self.dtype = dtype
        self.optim = OptimConfig() if optim is None else optim
        self.source, self.seed, self.lora, self.loss_chunk_tokens = source, seed, lora, loss_chunk_tokens
        c, g = self.config, self.grid
        validate_layout(self.spec, c, g.sizes, self.seq_length, self.micro_batch_size, self.global_batch_size)
        validate_grad_reduce_dtype(c.grad_reduce_dtype, next(n for n, t in DTYPES.items() if t == self.dtype))
        validate_moe(self.spec, self.moe, c, self.lora.rank if self.lora is not None else 0)
        self.layout = recipe_layout(self.spec, c)
        self.num_microbatches = self.global_batch_size // (self.micro_batch_size * g.sizes.dp)
        self.objective: Objective = LanguageModelObjective() if objective is None else objective
        # multi-token prediction trains beside next-token prediction only (as in Megatron); with another objective
        # or a zero scale its layers stay as loaded
        self.mtp_scale = mtp_loss_scaling_factor
        trains_mtp = mtp_loss_scaling_factor > 0 and isinstance(self.objective, LanguageModelObjective)
        self.mtp_depths = self.spec.mtp_num_layers if trains_mtp else 0
        weights = self.source or RandomInitSource(self.layout, seed=self.seed)  # not kept: it may cache tensors
        self.chunks = self.build_chunks(weights)
        for chunk in self.chunks:
            chunk.carries_mtp_tokens = bool(self.mtp_depths)
            if chunk.mtp is not None and not self.mtp_depths:
                chunk.mtp.requires_grad_(False)
        # routing replay: an RL objective's batches carry the rollout's MoE routes, replayed or only compared
        routing_replay = getattr(self.objective, "routing_replay", None)
        self.route_inputs = self.spec.moe is not None and routing_replay is not None
        for chunk in self.chunks:
            chunk.replays_routes = self.route_inputs
            chunk.moe.tracker.replay = bool(routing_replay)
        # an MoE loss enters each micro-batch's backward as a mean over the global batch's micro-batches
        self.moe_loss_scale = 1.0 / (self.num_microbatches * g.sizes.dp)
        for chunk in self.chunks:
            chunk.moe.tracker.loss_scale = self.moe_loss_scale
        self._moe_stats = MoeStepStats(self.spec, self.moe, self.grid, c.sp, self.num_microbatches)
        if self.lora is not None and self.lora.rank > 0:
            apply_lora(self.chunks, self.lora, self.chunks[0].parallel, self.seed)
        self.compiled = compile
        if compile:  # after LoRA (the adapters are in the graph), before FSDP2 shards the layers
            for chunk in self.chunks:
                chunk.compile_layers()
        trainable = [p for chunk in self.chunks for p in chunk.parameters() if p.requires_grad]
        self.optimizer = self._build_optimizer(trainable)
        self.params = self.optimizer.params  # FSDP2 replaces the parameters: the optimizer's are the live ones
        self.runner = self.make_runner(self.chunks, self.loss_fn)
        # an objective whose rows share prefixes (a rollout group's prompt) runs each prefix once where the layout
        # keeps the sequence in one process (train/shared_prefix.py)
        self.shares_prefixes = (getattr(self.objective, "shares_prefixes", False) and c.pp == 1 and c.cp == 1
                                and not self.mtp_depths and self.spec.moe is None and not compile
                                and all(window is None for window in self.chunks[0].windows))
        self.saved_tokens = 0  # this rank's positions shared-prefix packing did not run in the last forward_backward
        self._num_tokens = 1.0
        self._mtp_tokens, self._mtp_loss_sum = None, None  # multi-token prediction's, per step (_run_microbatches)
        self.objective.bind(self, weights)  # after the policy's schedule: a reference's schedule comes second

    # ---- construction ----------------------------------------------------------------------------------------------

    def make_runner(self, chunks: list[StageModel], loss_fn):
        """The pipeline schedule of `chunks` with `loss_fn` on the last stage (None when pp = 1)."""
        c, g = self.config, self.grid
        if c.pp == 1:
            return None
        from qlm_core.parallel.pipeline import PipelineRunner  # imports torch's pipelining (and dynamo)

        return PipelineRunner(
            chunks, pp_rank=g.pp_rank, pp_size=c.pp, pp_group=g.pp_group, device=g.device, schedule=c.pp_schedule,
            num_microbatches=self.num_microbatches, loss_fn=loss_fn, recompute=c.recompute,
        )

    def build_chunks(self, source: TensorSource, param_dtype: torch.dtype | None = None) -> list[StageModel]:
        """This rank's chunks of its pipeline stage, filled from `source` (an objective's frozen reference too)."""
        c, g = self.config, self.grid
        options = ParallelOptions(
            tp_group=g.tp_group, sequence_parallel=c.sp, cp_group=g.cp_group, cp_comm_type=c.cp_comm_type,
            recompute=c.recompute, recompute_num_layers=c.recompute_num_layers,
            recompute_modules=tuple(c.recompute_modules), experts=self._expert_parallel(),
            dp_cp_group=g.dp_cp_group,
        )
        # ZeRO-3 keeps fp32 parameters (FSDP's sharded master weights) and computes in self.dtype.
        if param_dtype is None:
            param_dtype = torch.float32 if c.zero_stage == 3 else self.dtype
        chunks = [
            build_rank_model(self.layout, RankCoords(g.tp_rank, g.pp_rank, chunk, g.ep_rank, g.etp_rank), source,
                             parallel=options,
                             dtype=param_dtype, device=g.device, loss_chunk_tokens=self.loss_chunk_tokens,
                             model_class=StageModel, moe_options=self.moe)
            for chunk in range(c.vpp)
        ]
        # the last stage's copy of the embedding (a tied output layer's, or the one multi-token prediction embeds
        # with) takes the sum of both stages' gradients, as Megatron's embedding group does
        if (self.spec.tie_word_embeddings or self.spec.mtp_num_layers) and c.pp > 1:
            if g.is_first_stage:
                mark(chunks[0].embedding.word_embeddings.weight, shared_embedding=True)
            if g.is_last_stage:
                last = chunks[-1]
                copy = last.output_layer if self.spec.tie_word_embeddings else last.embedding.word_embeddings
                mark(copy.weight, shared_embedding=True, tied_copy=True)
        return chunks

    def _expert_parallel(self) -> ExpertParallel | None:
        s = self.grid.sizes
        if not s.expert_parallel:
            return None
        return ExpertParallel(s.ep, s.etp, self.grid.expert_group)

    def _expert_units(self) -> list[torch.nn.Module]:
        """Under expert parallelism, each MoE layer's routed experts (ZeRO 3 shards them over their own group)."""
        if not self.grid.sizes.expert_parallel:
            return []
        return [layer.mlp.experts for chunk in self.chunks for layer in chunk.transformer_layers()
                if isinstance(layer.mlp, MoELayer)]

    def _build_optimizer(self, trainable: list[torch.nn.Parameter]) -> TrainingOptimizer:
        """ZeRO 3: FSDP2; ZeRO 0-2: bucketed gradient buffers under the distributed optimizer."""
        c, g, o = self.config, self.grid, self.optim
        groups = param_groups(trainable, o.weight_decay)
        if c.zero_stage == 3:
            from qlm_core.parallel.fsdp import FullyShardedState

            return FullyShardedState(
                self.chunks, [[*chunk.decoder.layers, *(chunk.mtp.layers if chunk.mtp is not None else ())]
                              for chunk in self.chunks], groups,
                dp_cp_group=g.dp_cp_group, tp_group=g.tp_group, pp_group=g.pp_group,
                embedding_group=g.embedding_group, device=g.device, compute_dtype=self.dtype, lr=o.lr,
                betas=(o.beta1, o.beta2), eps=o.eps, reduce_dtype=DTYPES[c.grad_reduce_dtype],
                expert_units=self._expert_units(), expert_dp_group=g.expert_dp_group, expert_group=g.expert_group,
            )
        from qlm_core.parallel.grad_buffers import GradientBuffers
        from qlm_core.parallel.optimizer import DistributedOptimizer

        buffers = GradientBuffers(
            trainable, dp_group=g.dp_cp_group, zero_stage=c.zero_stage, bucket_size_mb=c.bucket_size_mb,
            overlap_grad_reduce=c.overlap_grad_reduce, num_microbatches=self.num_microbatches,
            tp_group=g.tp_group, embedding_group=g.embedding_group, grad_dtype=DTYPES[c.grad_reduce_dtype],
            expert_dp_group=g.expert_dp_group if g.sizes.expert_parallel else None,
        )
        return DistributedOptimizer(
            groups, buffers, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay,
            overlap_param_gather=c.overlap_param_gather, tp_group=g.tp_group, pp_group=g.pp_group,
            model_chunks=self.chunks, expert_group=g.expert_group,
        )

    # ---- the step --------------------------------------------------------------------------------------------------

    def loss_fn(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The last stage's output (the final norm's) through the loss head, then the objective's loss of the
        micro-batch. With multi-token prediction the output and the labels are the main ones followed by each
        depth's (GPTModel.hidden_states, local_inputs): the depths' loss adds its gradient, not its value (the step
        reports the language-model loss; StepResult.figures the multi-token prediction loss)."""
        mtp = None
        if self.mtp_depths:
            parts, label_parts = hidden.chunk(1 + self.mtp_depths, dim=0), labels.chunk(1 + self.mtp_depths, dim=1)
            hidden, labels = parts[0], label_parts[0]
            mtp = self._mtp_loss(parts[1:], label_parts[1:])
        scale = getattr(self.objective, "logit_scale", 1.0)  # an RL objective's 1 / sampling temperature
        if scale != 1.0:
            hidden = hidden * scale  # logits are linear in the final norm's output: logits / temperature
        loss = self.objective.loss(self.chunks[-1].loss(hidden, labels), labels)
        return loss if mtp is None else loss + (mtp - mtp.detach())

    def _mtp_loss(self, outputs, labels) -> torch.Tensor:
        """Megatron's multi-token prediction loss: mtp_loss_scaling_factor times the mean over depths of each
        depth's mean token loss, here over the global batch's labelled tokens of that depth (as the main loss)."""
        total = sum(self.chunks[-1].loss(hidden, depth_labels).sum() / tokens
                    for hidden, depth_labels, tokens in zip(outputs, labels, self._mtp_tokens, strict=True))
        if not shape_inference.active():  # not the pipeline's placeholder forward
            self._mtp_loss_sum += total.detach()
        return total * (self.mtp_scale / self.mtp_depths)

    def local_tokens(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's part of a per-token tensor of its rows [rows, seq] (its context-parallel chunks), on its
        device: what the labels and inputs become, and an objective's per-token data with them."""
        t = t.to(self.grid.device)
        cp = self.config.cp
        return split_for_cp(t, cp, self.grid.cp_rank, dim=1).contiguous() if cp > 1 else t.contiguous()

    def local_inputs(self, batch: Batch) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """(the model's inputs: input_ids, position_ids[, segment_ids][, routes]; labels) of this rank's rows, split
        into its context-parallel chunks; positions default to global token indices, routes (route_inputs) to none
        recorded (-1)."""
        rows, seq = batch.input_ids.shape
        position_ids = batch.position_ids
        if position_ids is None:
            position_ids = torch.arange(seq)[None, :].expand(rows, seq)
        local = self.local_tokens
        inputs = (local(batch.input_ids), local(position_ids))
        if batch.segment_ids is not None:
            inputs += (local(batch.segment_ids),)
        if self.route_inputs:
            routes = batch.routes
            if routes is None:
                moe = self.spec.moe
                routes = torch.full((rows, seq, moe.num_moe_layers(self.spec.num_layers), moe.topk), -1,
                                    dtype=torch.int32)
            inputs += (local(routes),)
        labels = local(batch.labels)
        if self.mtp_depths:  # the shifted tokens ride to the last stage; the depths' labels follow the main ones
            tokens, targets = mtp_targets(batch.input_ids, batch.labels, batch.segment_ids, self.mtp_depths)
            inputs += (local(tokens),)
            labels = torch.cat([labels, *local(targets).unbind(-1)], dim=1)
        return inputs, labels

    def main_labels(self, labels: torch.Tensor) -> torch.Tensor:
        """local_inputs' labels less multi-token prediction's."""
        return labels[:, : labels.shape[1] // (1 + self.mtp_depths)]

    def without_routes(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """local_inputs' inputs less the routes (for a model that routes by its own routers: a frozen reference)."""
        return inputs[:-1] if self.route_inputs else inputs

    def _run_microbatches(self, batch: Batch, *, backward: bool) -> torch.Tensor:
        """Forward (and, with `backward`, backward) over every microbatch of this rank's rows, through the
        pipeline schedule when pp > 1. Returns this rank's share of the batch loss as the objective reports it (the
        language-model loss: normalised by the global token count); the sum over ranks is the global mean."""
        g = self.grid
        inputs, labels = self.local_inputs(batch)
        counts = torch.stack([(part >= 0).sum() for part in labels.chunk(1 + self.mtp_depths, dim=1)]).float()
        all_reduce(counts, g.dp_cp_group)
        self._num_tokens = max(counts[0].item(), 1.0)
        self._mtp_tokens = counts[1:].clamp(min=1.0)  # multi-token prediction's labelled tokens per depth
        self._mtp_loss_sum = torch.zeros((), device=g.device)
        self.objective.start(batch, inputs, self.main_labels(labels), self._num_tokens)
        losses = self.forward_backward_chunks(self.chunks, self.runner, self.loss_fn, inputs, labels, backward)
        loss_sum = torch.zeros((), device=g.device)
        for loss in losses:
            loss_sum += self.objective.reported(loss)
        return loss_sum

    def forward_backward_chunks(self, chunks, runner, loss_fn, inputs, labels, backward: bool) -> list[torch.Tensor]:
        """The micro-batch losses of `chunks` over this rank's rows (backward too with `backward`); through
        `runner` when pp > 1 (losses on the last stage only)."""
        for chunk in chunks:
            chunk.train(backward)
        if runner is not None:
            return (runner.step if backward else runner.evaluate)(inputs, labels)
        model, mbs, losses = chunks[0], self.micro_batch_size, []
        for i in range(self.num_microbatches):
            rows_i = slice(i * mbs, (i + 1) * mbs)
            microbatch = tuple(t[rows_i] for t in inputs)
            hidden = self._shared_prefix_forward(model, microbatch, labels[rows_i]) if self.shares_prefixes else None
            loss = loss_fn(model(*microbatch) if hidden is None else hidden, labels[rows_i])
            if backward:
                (loss + self._transformers_aux_loss()).backward()
            losses.append(loss)
        return losses

    def _shared_prefix_forward(self, model: StageModel, inputs: tuple[torch.Tensor, ...],
                               labels: torch.Tensor) -> torch.Tensor | None:
        """The final norm's output [s(/tp), b, h] of a micro-batch whose rows share prefixes, each prefix run once
        (train/shared_prefix.py); None when the rows share none (or come packed with segment_ids)."""
        if len(inputs) != 2:
            return None
        tp_group, sp = self.grid.tp_group, self.config.sp
        packed = pack_shared_prefixes(inputs[0], inputs[1], labels, multiple=group_size(tp_group) if sp else 1)
        if packed is None:
            return None
        if model is self.chunks[0]:  # the policy's (a frozen reference runs the same packing)
            self.saved_tokens += packed.saved_tokens
        hidden = model(packed.input_ids, packed.position_ids, documents=packed.documents)  # FSDP2's hooks too
        if sp:  # every TP rank unpacks the whole row, then keeps its sequence shard of the rows
            return scatter_to_sp(packed.unpack(gather_from_sp_whole_grad(hidden, tp_group)), tp_group)
        return packed.unpack(hidden)

    def _transformers_aux_loss(self) -> torch.Tensor | float:
        """moe.aux_loss_type = transformers: the micro-batch's one load-balancing loss over every layer (pp = 1, so
        this chunk ran them all), scaled like the per-layer losses; 0 otherwise."""
        if self.spec.moe is None or self.moe.aux_loss_type != "transformers":
            return 0.0
        aux = self.chunks[0].moe.tracker.transformers_aux_loss(self.spec.moe.num_experts, self.moe.aux_loss_coeff)
        if aux is None:
            return 0.0
        self._moe_stats.add_transformers_aux(aux.detach())
        return aux * self.moe_loss_scale

    def forward_backward(self, batch: Batch) -> torch.Tensor:
        """Forward and backward over every microbatch; gradients are reduced and final when this returns.
        Returns this rank's share of the step loss (the sum over ranks is the global mean)."""
        rows = batch.input_ids.shape[0]
        if rows != self.micro_batch_size * self.num_microbatches:
            raise ValueError(f"expected {self.micro_batch_size * self.num_microbatches} rows, got {rows}")
        self.optimizer.zero_grad()
        self.saved_tokens = 0
        self._moe_stats.start(self.chunks)
        loss_sum = self._run_microbatches(batch, backward=True)
        self.optimizer.finish_grad_sync()
        self._update_expert_bias()
        return loss_sum

    @torch.no_grad()
    def _update_expert_bias(self) -> None:
        """Aux-loss-free balancing (Megatron-Core's finalize_model_grads): each router's expert bias moves by
        moe.router_bias_update_rate toward an even load, the step's routed choices summed over every rank of the
        stage (TP's shards, data and context ranks; copies scale every count alike and leave the signs alone)."""
        routers = [layer.mlp.router for chunk in self.chunks for layer in chunk.transformer_layers()
                   if isinstance(layer.mlp, MoELayer) and layer.mlp.router.expert_bias is not None]
        if not routers:
            return
        counts = torch.stack([router.local_tokens_per_expert for router in routers])
        all_reduce(counts, self.grid.tp_group)
        all_reduce(counts, self.grid.dp_cp_group)
        biases = updated_expert_bias(counts, torch.stack([router.expert_bias for router in routers]),
                                     self.moe.router_bias_update_rate)
        for router, bias in zip(routers, biases, strict=True):
            router.expert_bias.copy_(bias)
            router.local_tokens_per_expert.zero_()

    def update(self, lr: float | None = None) -> tuple[float, bool]:
        """Clip by the global gradient norm and apply AdamW; a non-finite norm skips the update.
        Returns (norm before clipping, skipped)."""
        if lr is not None:
            self.optimizer.set_lr(lr)
        grad_norm = self.optimizer.clip_grad_norm(self.optim.clip_grad)
        skipped = not math.isfinite(grad_norm)
        if not skipped:
            self.optimizer.step()
        return grad_norm, skipped

    def global_loss(self, loss_sum: torch.Tensor) -> float:
        g = self.grid
        loss_sum = loss_sum.clone()
        all_reduce(loss_sum, g.dp_cp_group)
        if group_size(g.pp_group) > 1:  # only the rank holding the last stage computed it
            all_reduce(loss_sum, g.pp_group)
        return loss_sum.item()

    def train_step(self, batch: Batch, lr: float | None = None) -> StepResult:
        loss_sum = self.forward_backward(batch)
        grad_norm, skipped = self.update(lr)
        figures = self.objective.figures()
        if self.mtp_depths:
            figures = {**(figures or {}), "mtp_loss": self.mtp_step_loss()}
        return StepResult(self.global_loss(loss_sum), grad_norm, int(self._num_tokens), skipped,
                          self.moe_step_figures(), figures)

    def mtp_step_loss(self) -> float:
        """The last forward_backward's multi-token prediction loss: the mean over depths of their mean token loss
        over the global batch (unscaled); every rank calls it (a collective)."""
        return self.global_loss(self._mtp_loss_sum) / self.mtp_depths

    def moe_step_figures(self) -> dict[str, float] | None:
        """An MoE model's figures of the last forward_backward (StepResult.moe); every rank calls it (collectives).
        None for a dense model."""
        return self._moe_stats.finish(self.chunks, self.moe_loss_scale)

    @torch.no_grad()
    def evaluate(self, batch: Batch) -> float:
        """Mean loss over the non-ignored labels of this global batch (every rank's rows), forward only; preference
        training: the preference loss over its pairs (objective.figures() then has the metrics)."""
        self.optimizer.wait_param_gather()
        return self.global_loss(self._run_microbatches(batch, backward=False))
