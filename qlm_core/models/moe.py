"""The Mixture-of-Experts layer of the one model, with Megatron-Core's local-spec names so that a rank's state_dict
is still the Megatron shard: `mlp.router.weight` [E, h], SequentialMLP's `mlp.experts.local_experts.<e>.linear_fc1`
([gate; up] rows) and `.linear_fc2`, and SharedExpertMLP's `mlp.shared_experts.linear_fc1 / linear_fc2 /
gate_weight`.

Without expert parallelism (ParallelOptions.experts None), under tensor parallelism every expert is split like the
dense MLP (fc1 by rows, fc2 by columns; Megatron's expert
TP = TP) and every TP rank runs every expert on all of the micro-batch's tokens: the router runs on this rank's
tokens (its sequence shard under SP), then tokens, probabilities and choices are all-gathered over TP (SP) — the
all-gather dispatcher — and the experts' partial sums are reduce-scattered (SP) or all-reduced back. With expert
parallelism each rank holds E/ep experts (named locally from 0, as Megatron does), each split over etp ranks, and
sends its own tokens to them by all-to-all (parallel/expert_dispatch.py).

Losses (the recipe's [moe], MoeConfig): the load-balancing loss E·Σᵢ fᵢ·Pᵢ per layer as Megatron computes it
(fᵢ the share of the top-k choices that went to expert i, Pᵢ its mean router probability over all experts, both
over the micro-batch's tokens on every sequence shard), or transformers' variant (one such loss over every layer's
router logits), and the router z-loss mean(logsumexp(logits)²). Their gradients enter backward through the layer's
output (Megatron's MoEAuxLossAutoScaler), scaled by MoeTracker.loss_scale, so they need no path through the pipeline.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd import Function

from qlm_core.config import MoeConfig
from qlm_core.models.activations import ACTIVATION_KINDS, ActivationKind
from qlm_core.models.mlp import MLP
from qlm_core.models.moe_spec import ERNIE_NORM_MIN, MoeSpec
from qlm_core.parallel import shape_inference
from qlm_core.parallel.comm import all_gather_dim0, all_reduce, group_rank, group_size
from qlm_core.parallel.expert_dispatch import ExpertParallel, all_to_all, inverse_permutation, plan_dispatch
from qlm_core.parallel.param_meta import mark
from qlm_core.parallel.tensor import (
    MegatronLinearState,
    copy_to_tp,
    gather_from_sp,
    reduce_from_tp,
    reduce_scatter_to_sp,
)


@dataclass
class MoeRecord:
    """One MoE layer's forward over one micro-batch (values detached; the losses with their coefficients)."""

    layer: int  # global layer index
    aux_loss: torch.Tensor  # this rank's part: summed over the sequence shards it is the layer's loss
    z_loss: torch.Tensor  # likewise
    tokens_per_expert: torch.Tensor  # [E] over every sequence shard of the micro-batch (before capacity drops)
    # routing replay: [this rank's tokens whose router chose other experts than the replayed ones, tokens replayed]
    route_mismatch: torch.Tensor | None = None


@dataclass
class MoeTracker:
    """The MoE records of one model chunk since the last `take_records`, and the scale the losses' gradients get
    (the engine sets it to its loss normalisation: one over the micro-batches of the global batch)."""

    loss_scale: float = 1.0
    records: list[MoeRecord] = field(default_factory=list)
    # transformers' variant: each MoE layer's (router probability sums with grad, token counts, tokens) since the
    # last transformers_aux_loss()
    pending: list[tuple[torch.Tensor, torch.Tensor, int]] = field(default_factory=list)
    # the global variant: per layer, the token counts over every data-parallel rank summed over the step's
    # micro-batches so far, and how many (reset_step at each step's start)
    step_counts: dict[int, tuple[torch.Tensor, int]] = field(default_factory=dict)
    # routing replay (R3): with routes handed to a forward, whether the layers use them (False: only compare them
    # with their own choices)
    replay: bool = True
    # while decoding records routes: each MoE layer's expert indices [s, b, k], in the order the layers ran
    recording: list[torch.Tensor] | None = None

    def reset_step(self) -> None:
        self.step_counts.clear()

    def running_mean_counts(self, layer: int, counts: torch.Tensor, record: bool) -> torch.Tensor:
        """The mean of `layer`'s counts over the step's micro-batches, this one included (`record`: count it)."""
        total, seen = self.step_counts.get(layer, (torch.zeros_like(counts), 0))
        if record:
            self.step_counts[layer] = (total + counts, seen + 1)
        return (total + counts) / (seen + 1)

    def take_records(self) -> list[MoeRecord]:
        records, self.records = self.records, []
        return records

    def transformers_aux_loss(self, num_experts: int, coeff: float) -> torch.Tensor | None:
        """transformers' load_balancing_loss_func over every MoE layer run since the last call (times `coeff`):
        E·Σᵢ (Σ_layers countᵢ / R)·(Σ_layers probᵢ / R), R the tokens over all layers (its counts are not divided
        by k: the loss is k times Megatron's for one layer)."""
        if not self.pending:
            return None
        prob_sums, counts, tokens = zip(*self.pending, strict=True)
        self.pending = []
        rows = float(sum(tokens))
        counts_total, probs_total = torch.stack(counts).sum(0), torch.stack(prob_sums).sum(0)
        return coeff * num_experts * (counts_total / rows * probs_total / rows).sum()


class _WeightedSum(Function):
    """Σ values · weights with the weights held by the node itself rather than saved for backward: recompute
    (torch's checkpoint re-creates saved tensors) must not replace them with values from a later state."""

    @staticmethod
    def forward(ctx, values: torch.Tensor, weights: torch.Tensor):
        ctx.weights = weights.detach()
        return (values * weights).sum()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.weights, None


class _AttachLoss(Function):
    """Forward: `output` unchanged. Backward: `output`'s gradient, and `scale` as the gradient of `loss` (a scalar
    added to the objective without flowing through the rest of the network)."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, loss: torch.Tensor, scale: float):
        ctx.scale = scale
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.full((), ctx.scale, dtype=torch.float32, device=grad.device), None


def route(logits: torch.Tensor, moe: MoeSpec,
          expert_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (probabilities [T, k] in the logits' dtype, expert indices [T, k]). `expert_bias`:
    added to the scores (sigmoid, or ERNIE's softmax over all experts) to choose the experts, not to weigh them."""
    if moe.score_function == "sigmoid":
        scores = torch.sigmoid(logits.float())
        choice = scores if expert_bias is None else scores + expert_bias
        if moe.num_groups > 1:
            choice = group_limited(choice, moe)
        # with groups, unsorted as transformers' DeepSeek-V3 router takes them (tied groups then pick the same
        # experts); else sorted, as Megatron-Core takes them
        indices = torch.topk(choice, moe.topk, dim=-1, sorted=moe.num_groups == 1).indices
        top = scores.gather(-1, indices)
        probs = (top / (top.sum(-1, keepdim=True) + 1e-20) if moe.topk > 1 else top) * moe.topk_scaling_factor
    elif moe.pre_softmax:
        probs, indices = torch.topk(torch.softmax(logits.float(), dim=-1), moe.topk, dim=-1)
    elif expert_bias is not None:  # ERNIE 4.5: the biased softmax chooses, the chosen probabilities renormalised
        scores = torch.softmax(logits.float(), dim=-1)
        indices = torch.topk(scores + expert_bias, moe.topk, dim=-1).indices
        top = scores.gather(-1, indices)
        probs = top / top.sum(-1, keepdim=True).clamp(min=ERNIE_NORM_MIN)
    else:  # topk's values, not a gather of the logits: a gather would keep the [T, E] logits for backward
        top, indices = torch.topk(logits, moe.topk, dim=-1)
        probs = torch.softmax(top.float(), dim=-1)
    if moe.score_function != "sigmoid" and moe.topk_scaling_factor != 1.0:
        probs = probs * moe.topk_scaling_factor
    return probs.to(logits.dtype), indices


def group_limited(choice: torch.Tensor, moe: MoeSpec) -> torch.Tensor:
    """Choice scores [T, E] with every expert outside the token's `group_topk` best groups at -inf; a group's score
    is the sum of its two best experts' (transformers' DeepSeek-V3 router, unsorted topk as it takes them)."""
    tokens = choice.shape[0]
    grouped = choice.view(tokens, moe.num_groups, -1)
    best = torch.topk(torch.topk(grouped, 2, dim=-1).values.sum(-1), moe.group_topk, dim=-1, sorted=False).indices
    keep = torch.zeros(tokens, moe.num_groups, dtype=torch.bool, device=choice.device).scatter_(1, best, True)
    return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(tokens, -1)


def expert_weights(logits: torch.Tensor, moe: MoeSpec, indices: torch.Tensor) -> torch.Tensor:
    """The probabilities [T, k] (logits' dtype) that weigh the experts `indices` [T, k] (replayed ones) — as route()
    weighs its own choice: the scores of the chosen, renormalised (sigmoid, k > 1), the full softmax's (pre_softmax),
    the full softmax's renormalised (an expert bias: ERNIE's), or the softmax over the chosen logits (whose gather
    keeps the logits for backward)."""
    if moe.score_function == "sigmoid":
        top = torch.sigmoid(logits.float()).gather(-1, indices)
        probs = (top / (top.sum(-1, keepdim=True) + 1e-20) if moe.topk > 1 else top) * moe.topk_scaling_factor
    elif moe.pre_softmax:
        probs = torch.softmax(logits.float(), dim=-1).gather(-1, indices)
    elif moe.expert_bias:
        top = torch.softmax(logits.float(), dim=-1).gather(-1, indices)
        probs = top / top.sum(-1, keepdim=True).clamp(min=ERNIE_NORM_MIN)
    else:
        probs = torch.softmax(logits.gather(-1, indices).float(), dim=-1)
    if moe.score_function != "sigmoid" and moe.topk_scaling_factor != 1.0:
        probs = probs * moe.topk_scaling_factor
    return probs.to(logits.dtype)


def replayed_experts(own: torch.Tensor, replay: torch.Tensor) -> torch.Tensor:
    """Routing replay (R3): the recorded experts [T, k] where a token has them, the router's own (`own`) where its
    row is -1 (a token the rollout never fed, such as padding)."""
    return torch.where(replay[:, :1] >= 0, replay.to(own.dtype), own)


def route_mismatch(own: torch.Tensor, replayed: torch.Tensor) -> torch.Tensor:
    """[tokens whose own top-k set differs from the replayed one, tokens replayed] (rows of -1 are not replayed)."""
    replayed_rows = replayed[:, 0] >= 0
    differ = (own.sort(dim=-1).values != replayed.to(own.dtype).sort(dim=-1).values).any(dim=-1) & replayed_rows
    return torch.stack([differ.sum(), replayed_rows.sum()]).float()


def updated_expert_bias(tokens_per_expert: torch.Tensor, expert_bias: torch.Tensor, rate: float) -> torch.Tensor:
    """Aux-loss-free balancing's step (Loss-Free Balancing, arXiv 2408.15664): each expert's bias moves by `rate`
    up when it got fewer than the mean of its layer's choices, down when more. [..., E] counts and biases."""
    return expert_bias + torch.sign(tokens_per_expert.mean(dim=-1, keepdim=True) - tokens_per_expert) * rate


def aux_loss_scores(logits: torch.Tensor, moe: MoeSpec) -> torch.Tensor:
    """The per-expert probabilities Pᵢ averages: softmax over all experts (sigmoid scores normalised to sum 1)."""
    if moe.score_function == "sigmoid":
        scores = torch.sigmoid(logits.float())
        return scores / (scores.sum(-1, keepdim=True) + 1e-20)
    return torch.softmax(logits.float(), dim=-1)


class Router(nn.Module):
    """Megatron's TopKRouter weight [E, h] and, with `bias` (add_bias_linear: gpt-oss's), its logits' bias [E], both
    replicated over TP (under SP each rank's gradient is partial), and with MoeSpec.expert_bias its `expert_bias`
    [E] (saved) and `local_tokens_per_expert` [E] (this rank's routed choices since the last bias update; not
    saved), both fp32 whatever the model's dtype, as Megatron keeps them."""

    _FP32_BUFFERS = ("expert_bias", "local_tokens_per_expert")

    def __init__(self, hidden: int, moe: MoeSpec, sequence_parallel: bool, dtype, bias: bool = False):
        super().__init__()
        self.weight = mark(nn.Parameter(torch.empty(moe.num_experts, hidden, dtype=dtype)),
                           sequence_parallel=sequence_parallel)
        self.bias = mark(nn.Parameter(torch.empty(moe.num_experts, dtype=dtype)),
                         sequence_parallel=sequence_parallel) if bias else None
        zeros = torch.zeros(moe.num_experts, dtype=torch.float32) if moe.expert_bias else None
        self.register_buffer("expert_bias", zeros)
        self.register_buffer("local_tokens_per_expert", None if zeros is None else zeros.clone(), persistent=False)

    def _apply(self, fn, recurse=True):
        """Moves (and casts) like any module, except that the bias buffers keep fp32 values: a bf16 bias would
        move by its update rate in steps bf16 cannot resolve."""
        kept = {name: self._buffers.pop(name) for name in self._FP32_BUFFERS if self._buffers.get(name) is not None}
        super()._apply(fn, recurse)
        for name, value in kept.items():
            self._buffers[name] = value.to(fn(value).device)
        return self

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.linear(tokens, self.weight, self.bias)


class ExpertLinear(MegatronLinearState, nn.Module):
    """One expert's (expert-)TP shard of a linear (no collectives of its own: the MoE layer moves the tokens).
    `expert_parallel`: its gradient is reduced over the expert-data-parallel group (ParamMeta.expert). `bias`
    (gpt-oss's): the layouts allow expert biases at expert-TP 1 only, as Megatron-Core does, so it is the expert's
    whole bias (linear_fc2's too), marked as its weight is (that mark only decides the gradient norm's count)."""

    def __init__(self, out_features: int, in_features: int, dtype, expert_parallel: bool = False,
                 bias: bool = False):
        super().__init__()
        self.weight = mark(nn.Parameter(torch.empty(out_features, in_features, dtype=dtype)), tp_split=True,
                           expert=expert_parallel)
        self.bias = mark(nn.Parameter(torch.empty(out_features, dtype=dtype)), tp_split=True,
                         expert=expert_parallel) if bias else None


class ExpertMLP(nn.Module):
    def __init__(self, hidden: int, local_ffn: int, dtype, expert_parallel: bool, activation: ActivationKind,
                 bias: bool = False):
        super().__init__()
        self.linear_fc1 = ExpertLinear(activation.fc1_rows(local_ffn), hidden, dtype, expert_parallel, bias)
        self.linear_fc2 = ExpertLinear(hidden, local_ffn, dtype, expert_parallel, bias)


def capacity_keep(indices: torch.Tensor, probs: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """Which (token, choice) pairs each expert takes when it takes at most `capacity`: those of highest
    probability (Megatron's drop policy "probs"). Flat boolean mask over indices.reshape(-1)."""
    flat, weight = indices.reshape(-1), probs.reshape(-1).float()
    by_prob = torch.argsort(weight, descending=True, stable=True)
    order = by_prob[torch.argsort(flat[by_prob], stable=True)]  # by expert, then by falling probability
    counts = torch.bincount(flat, minlength=num_experts)
    starts = torch.cumsum(counts, 0) - counts
    position = torch.arange(flat.numel(), device=flat.device) - starts[flat[order]]
    keep = torch.zeros_like(flat, dtype=torch.bool)
    keep[order] = position < capacity
    return keep


class _Unpermute(Function):
    """out[t] = Σ over the rows r routed from token t of weight[r] · expert_out[r]. Keeps expert_out, the weights
    and the row index; index_add on the weighted rows would keep that weighted copy too (e·h a routed row)."""

    @staticmethod
    def forward(ctx, expert_out: torch.Tensor, weight: torch.Tensor, rows: torch.Tensor, num_tokens: int):
        ctx.save_for_backward(expert_out, weight, rows)
        out = expert_out.new_zeros(num_tokens, expert_out.shape[1])
        return out.index_add_(0, rows, expert_out * weight.unsqueeze(-1))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        expert_out, weight, rows = ctx.saved_tensors
        routed = grad.index_select(0, rows)
        return routed * weight.unsqueeze(-1), (routed * expert_out).sum(-1), None, None


class SequentialExperts(nn.Module):
    """SequentialMLP's names (`local_experts.<e>`); computes its experts through the activation's routed_mlp (the
    grouped MLP kernel, or the per-expert loop of experts with biases). Holds every expert split over TP, or under
    expert parallelism (`parallel`) the E/ep of its EP rank split over etp."""

    def __init__(self, hidden: int, moe: MoeSpec, tp: int, dtype, parallel: ExpertParallel | None = None,
                 activation: ActivationKind = ACTIVATION_KINDS["swiglu"], bias: bool = False):
        super().__init__()
        self.moe, self.parallel, self.activation = moe, parallel, activation
        count, split = (moe.num_experts, tp) if parallel is None else (moe.num_experts // parallel.ep, parallel.etp)
        self.local_experts = nn.ModuleList(ExpertMLP(hidden, moe.ffn_hidden_size // split, dtype, parallel is not None,
                                                     activation, bias) for _ in range(count))

    def _mlp(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        fc1 = [expert.linear_fc1 for expert in self.local_experts]
        fc2 = [expert.linear_fc2 for expert in self.local_experts]
        biases = ([f.bias for f in fc1], [f.bias for f in fc2]) if fc1[0].bias is not None else (None, None)
        return self.activation.routed_mlp(rows, counts, [f.weight for f in fc1], [f.weight for f in fc2], *biases)

    def forward(self, tokens: torch.Tensor, probs: torch.Tensor, indices: torch.Tensor,
                capacity_factor: float | None) -> torch.Tensor:
        """tokens [T, h], probs and indices [T, k] -> [T, h]: Σ over each token's experts of prob · expert(token)."""
        T, k = indices.shape
        experts = self.moe.num_experts
        flat, weight = indices.reshape(-1), probs.reshape(-1)
        token_of = torch.arange(T * k, device=tokens.device) // k
        if capacity_factor is not None:
            keep = capacity_keep(indices, probs, experts, math.ceil(T * k / experts * capacity_factor))
            flat, weight, token_of = flat[keep], weight[keep], token_of[keep]
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=experts)
        rows = token_of[order]
        if self.parallel is None:
            return _Unpermute.apply(self._mlp(tokens[rows], counts.tolist()), weight[order], rows, T)
        plan = plan_dispatch(counts, self.parallel)
        sent_rows = rows[plan.send_positions]
        received = all_to_all(tokens[sent_rows], plan.output_splits, plan.input_splits, self.parallel.group)
        out = self._mlp(received[plan.to_expert_major], plan.expert_counts)
        returned = all_to_all(out[inverse_permutation(plan.to_expert_major)], plan.input_splits, plan.output_splits,
                              self.parallel.group)
        return _Unpermute.apply(returned, weight[order][plan.send_positions], sent_rows, T)


class SharedExpertMLP(MLP):
    """Megatron's SharedExpertMLP: a dense MLP of the spec's activation (TP-split like the layer's MLP) and, when
    gated, its output scaled by sigmoid(x · gate_weight) (Qwen2-MoE's shared_expert_gate)."""

    def __init__(self, hidden: int, moe: MoeSpec, parallel, dtype, activation: ActivationKind):
        super().__init__(hidden, moe.shared_expert_hidden_size, parallel, dtype, activation)
        self.gate_weight = None
        if moe.shared_expert_gate:
            self.gate_weight = mark(nn.Parameter(torch.empty(1, hidden, dtype=dtype)), sequence_parallel=parallel.sp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if self.gate_weight is not None:
            out = out * torch.sigmoid(F.linear(x, self.gate_weight))
        return out


class MoELayer(nn.Module):
    """Router, routed experts and optional shared expert of one layer; input and output [s, b, h] (this rank's
    sequence shard under SP)."""

    def __init__(self, hidden: int, moe: MoeSpec, parallel, options: MoeConfig, tracker: MoeTracker, layer: int,
                 dtype, activation: ActivationKind = ACTIVATION_KINDS["swiglu"], bias: bool = False):
        """`bias`: the router's and the routed experts' (Megatron's add_bias_linear; gpt-oss's)."""
        super().__init__()
        self.moe, self.options, self.tracker, self.layer = moe, options, tracker, layer
        self.tp_group, self.cp_group, self.sp = parallel.tp_group, parallel.cp_group, parallel.sp
        self.dp_cp_group = parallel.dp_cp_group
        self.expert_parallel = parallel.experts
        self.router = Router(hidden, moe, self.sp, dtype, bias)
        self.experts = SequentialExperts(hidden, moe, group_size(self.tp_group), dtype, parallel.experts, activation,
                                         bias)
        self.shared_experts = (SharedExpertMLP(hidden, moe, parallel, dtype, activation)
                               if moe.shared_expert_hidden_size else None)

    def forward(self, x: torch.Tensor, replay: torch.Tensor | None = None) -> torch.Tensor:
        """`replay` [b, s, k]: the experts recorded for the micro-batch's tokens (this context-parallel rank's
        chunks; -1 where none were), replayed when the tracker says so and compared with the router's own choice."""
        s, b, h = x.shape
        tokens = x.reshape(-1, h)
        logits = self.router(tokens)
        probs, indices = route(logits, self.moe, self.router.expert_bias)
        mismatch = None
        if replay is not None and not shape_inference.active():  # pipelining's shape pass: placeholder routes
            recorded = self._local_replay(replay, s)
            mismatch = route_mismatch(indices, recorded)
            if self.tracker.replay:
                indices = replayed_experts(indices, recorded)
                probs = expert_weights(logits, self.moe, indices)
        if self.tracker.recording is not None:
            self.tracker.recording.append(indices.view(s, b, -1))
        # training forwards only
        losses = self._losses(logits, indices, b, mismatch) if torch.is_grad_enabled() else None
        tp = group_size(self.tp_group)
        if self.expert_parallel is not None:  # each rank dispatches its own tokens (validate: SP under TP)
            out = self.experts(tokens, probs, indices, self.options.capacity_factor)
        else:
            if tp > 1 and self.sp:
                all_tokens, all_probs = gather_from_sp(tokens, self.tp_group), gather_from_sp(probs, self.tp_group)
                all_indices = all_gather_dim0(indices, self.tp_group)
            else:
                all_tokens, all_probs = copy_to_tp(tokens, self.tp_group), copy_to_tp(probs, self.tp_group)
                all_indices = indices
            out = self.experts(all_tokens, all_probs, all_indices, self.options.capacity_factor)
            if tp > 1:
                out = reduce_scatter_to_sp(out, self.tp_group) if self.sp else reduce_from_tp(out, self.tp_group)
        out = out.view(s, b, h)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        if losses is not None and losses.requires_grad:
            out = _AttachLoss.apply(out, losses, self.tracker.loss_scale)
        return out

    def _local_replay(self, replay: torch.Tensor, s: int) -> torch.Tensor:
        """[b, s', k] -> this rank's tokens' rows [s·b, k] in the order of x.reshape(-1, h) (under SP its part of
        the sequence)."""
        by_position = replay.transpose(0, 1)
        if self.sp and group_size(self.tp_group) > 1:
            by_position = by_position.narrow(0, group_rank(self.tp_group) * s, s)
        return by_position.reshape(-1, by_position.shape[-1])

    def _sequence_groups(self):
        """The groups over which this rank's tokens are a shard of the micro-batch's."""
        return [g for g in ((self.tp_group if self.sp else None), self.cp_group) if group_size(g) > 1]

    def _losses(self, logits: torch.Tensor, indices: torch.Tensor, rows: int,
                mismatch: torch.Tensor | None = None) -> torch.Tensor | None:
        """This rank's part of the layer's aux loss (Megatron's variants) plus z-loss, both with their
        coefficients (None when neither is set: nothing to attach), recorded with the token counts (not while
        backward recomputes the layer). `rows`: the micro-batch's rows (token t is in row t % rows)."""
        o, moe = self.options, self.moe
        experts = moe.num_experts
        per_row = o.aux_loss_type == "sequence"
        # inside backward a checkpoint re-runs the layer; torch pipelining's first step runs a shape-finding forward
        recomputing = torch._C._current_graph_task_id() != -1 or shape_inference.active()
        routed_counts = None  # with an expert bias: the experts chosen with it (the load the bias balances)
        if self.router.expert_bias is not None:
            routed_counts = torch.bincount(indices.reshape(-1), minlength=experts).float()
            if not recomputing:
                self.router.local_tokens_per_expert += routed_counts
            for group in self._sequence_groups():
                all_reduce(routed_counts, group)
            # fᵢ counts the choices the unbiased scores make (Megatron-Core's aux-loss routing map)
            indices = torch.topk(logits, moe.topk, dim=-1).indices
        flat = indices.reshape(-1)
        if per_row:  # counts per (row, expert)
            row_of = torch.arange(flat.numel(), device=flat.device) // moe.topk % rows
            flat = row_of * experts + flat
        counts = torch.bincount(flat, minlength=experts * (rows if per_row else 1)).float()
        tokens = logits.shape[0] // (rows if per_row else 1)  # over the micro-batch, or one row
        for group in self._sequence_groups():
            all_reduce(counts, group)
            tokens *= group_size(group)
        layer_counts = counts.view(rows, experts).sum(0) if per_row else counts
        if routed_counts is not None:
            layer_counts = routed_counts
        balance_counts = counts
        if o.aux_loss_type == "global":  # every data-parallel rank's micro-batch (the cp ranks' counts are whole)
            cp = group_size(self.cp_group)
            balance_counts = all_reduce(counts.clone(), self.dp_cp_group) / cp
            tokens *= group_size(self.dp_cp_group) // cp
            balance_counts = self.tracker.running_mean_counts(self.layer, balance_counts, record=not recomputing)
        if not (o.aux_loss_coeff or o.z_loss_coeff):
            if not recomputing:
                zero = counts.new_zeros(())
                self.tracker.records.append(MoeRecord(self.layer, zero, zero, layer_counts, mismatch))
            return None
        scores = aux_loss_scores(logits, moe)
        prob_sum = scores.view(-1, rows, experts).sum(0).reshape(-1) if per_row else scores.sum(0)
        aux = o.aux_loss_coeff * experts / (moe.topk * tokens * tokens) * _WeightedSum.apply(prob_sum, balance_counts)
        if per_row:
            aux = aux / rows
        z = o.z_loss_coeff * torch.logsumexp(logits.float(), dim=-1).square().sum() / (logits.shape[0] * self._shards())
        if not recomputing:
            self.tracker.records.append(MoeRecord(self.layer, aux.detach(), z.detach(), layer_counts, mismatch))
            if o.aux_loss_type == "transformers" and o.aux_loss_coeff:
                self.tracker.pending.append((prob_sum, counts, tokens))
        return z if o.aux_loss_type == "transformers" else aux + z

    def _shards(self) -> int:
        """How many ranks hold a shard of this micro-batch's tokens."""
        return math.prod(group_size(g) for g in self._sequence_groups())
