"""The one decoder definition used by every verb (train, eval, convert --verify, profile --probe).

Parameter names and layouts are Megatron-Core's local spec exactly (docs/ARCHITECTURE.md §4), and a model built for
TP rank r and pipeline stage p holds exactly Megatron's shard for (r, p). So a legacy Megatron checkpoint shard IS this
module's state_dict, and no verb ever translates names.

Activations are [seq, batch, hidden] as in Megatron; under sequence parallelism the seq dim is this rank's shard.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.utils.checkpoint import checkpoint

from qlm_core.config import MoeConfig, RecomputeMode, choices
from qlm_core.kernels.attention import core_attention, masked_attention
from qlm_core.kernels.norm import RMSNorm
from qlm_core.kernels.pieces import Documents, Piece, decoding_pieces, self_attention_pieces
from qlm_core.kernels.piecewise import piecewise_attention
from qlm_core.kernels.rope import apply_rope, rope_cos_sin, rope_inv_freq
from qlm_core.models.mlp import MLP
from qlm_core.models.moe import MoELayer, MoeTracker
from qlm_core.models.spec import ModelSpec, padded_vocab_size
from qlm_core.parallel import shape_inference
from qlm_core.parallel.comm import group_rank, group_size
from qlm_core.parallel.context_parallel import (
    CP_COMM_TYPES,
    context_parallel_attention,
    cp_attention_plan,
    cp_token_indices,
    gather_sequence,
)
from qlm_core.parallel.cross_entropy import DEFAULT_CHUNK_TOKENS, OutputLayer, loss_is_chunked
from qlm_core.parallel.expert_dispatch import ExpertParallel
from qlm_core.parallel.param_meta import mark
from qlm_core.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    gather_last_dim,
    gather_last_dim_sum_grad,
    vocab_parallel_cross_entropy,
)

RECOMPUTE_MODES = choices(RecomputeMode)


_eager_call = None  # torch.compiler.disable'd call, made by the first compile_forward (it imports dynamo: 1.5 s)


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


# torchtitan's op-level selective checkpointing: the outputs of these ops are saved, and of aten.mm every other one
# (the first, third, ... of a layer's forward), the rest is recomputed in backward.
_SAVED_OPS = tuple(op for op in (
    getattr(torch.ops.aten, name, None) for name in (
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
) if op is not None)


def op_policy_contexts():
    """A fresh (forward, recompute) context pair for one checkpointed layer under recompute = "op"."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    counts = {False: 0, True: 0}  # matmuls seen in forward / in the recomputation

    def policy(ctx, op, *args, **kwargs):
        if op is torch.ops.aten.mm.default:
            counts[ctx.is_recompute] += 1
            save = counts[ctx.is_recompute] % 2 == 1
        else:
            save = op.overloadpacket in _SAVED_OPS or "flash_attn" in str(op)
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


@dataclass
class AttentionInputs:
    """Per-forward facts every attention layer needs besides q, k, v, worked out once per forward."""

    documents: Documents | None = None  # packed documents in global positions (None: one per row)
    cache: KVCache | None = None  # incremental decoding: keys/values of earlier tokens
    # a decoding step of one token a row: the keys it sees [b, 1, 1, keys] (bool; O(keys), one kernel call)
    key_mask: torch.Tensor | None = None
    pieces: list[Piece] | None = None  # what one process computes, when not plain causal attention over each row
    cp_plan: tuple[list[Piece], ...] | None = None  # under context parallelism: what this rank computes


@dataclass
class KVCache:
    """Keys and values (after RoPE) of the tokens already decoded, per layer: [b, groups, tokens, head_dim].

    extend() concatenates, unless reserve() made room: then each layer's keys and values are views of a buffer the
    new tokens are written into, so a decoding step copies only its own token (not the whole cache)."""

    keys: list
    values: list
    buffers: list | None = None  # per layer (keys buffer, values buffer) [b, groups, capacity, head_dim]

    @classmethod
    def empty(cls, num_layers: int) -> KVCache:
        return cls([None] * num_layers, [None] * num_layers)

    @property
    def length(self) -> int:
        return 0 if self.keys[0] is None else self.keys[0].shape[2]

    def reserve(self, tokens: int) -> None:
        """Room for `tokens` more per layer (after at least one extend)."""
        self.buffers = []
        for layer, (k, v) in enumerate(zip(self.keys, self.values, strict=True)):
            shape = (*k.shape[:2], k.shape[2] + tokens, k.shape[3])
            buffer_k, buffer_v = k.new_empty(shape), v.new_empty(shape)
            buffer_k[:, :, :k.shape[2]], buffer_v[:, :, :v.shape[2]] = k, v
            self.buffers.append((buffer_k, buffer_v))
            self.keys[layer], self.values[layer] = buffer_k[:, :, :k.shape[2]], buffer_v[:, :, :v.shape[2]]

    def select(self, rows: torch.Tensor) -> None:
        """Keep only these rows (index tensor) of every layer: decoding drops the rows that have finished."""
        if self.buffers is None:
            self.keys = [k.index_select(0, rows) for k in self.keys]
            self.values = [v.index_select(0, rows) for v in self.values]
            return
        length = self.length
        self.buffers = [(bk.index_select(0, rows), bv.index_select(0, rows)) for bk, bv in self.buffers]
        self.keys = [bk[:, :, :length] for bk, _ in self.buffers]
        self.values = [bv[:, :, :length] for _, bv in self.buffers]

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        past = 0 if self.keys[layer] is None else self.keys[layer].shape[2]
        if self.buffers is not None and past + k.shape[2] <= self.buffers[layer][0].shape[2]:
            buffer_k, buffer_v = self.buffers[layer]
            buffer_k[:, :, past:past + k.shape[2]], buffer_v[:, :, past:past + v.shape[2]] = k, v
            k, v = buffer_k[:, :, :past + k.shape[2]], buffer_v[:, :, :past + v.shape[2]]
        elif self.keys[layer] is not None:
            k, v = torch.cat((self.keys[layer], k), dim=2), torch.cat((self.values[layer], v), dim=2)
        self.keys[layer], self.values[layer] = k, v
        return k, v


def attention_inputs(*, local_tokens: int, batch: int, window: int | None, parallel: ParallelOptions,
                     segment_ids: torch.Tensor | None, cache: KVCache | None,
                     attention_mask: torch.Tensor | None) -> AttentionInputs:
    """Describe the micro-batch's attention once for every layer: its documents (under context parallelism from the
    whole sequence, gathered once) and the pieces this rank computes, for packed rows, a sliding window shorter than
    the row, decoding with a cache, or context parallelism."""
    cp_group = parallel.cp_group
    cp = group_size(cp_group)
    if cache is not None or attention_mask is not None:
        if cp > 1 or segment_ids is not None:
            raise ValueError("decoding with a cache or an attention_mask takes neither context parallelism nor "
                             "segment_ids")
        past = 0 if cache is None else cache.length
        if attention_mask is not None and tuple(attention_mask.shape) != (batch, past + local_tokens):
            raise ValueError(f"attention_mask must be [batch, cached + new] = [{batch}, {past + local_tokens}], "
                             f"got {tuple(attention_mask.shape)}")
        valid = (torch.ones(batch, past + local_tokens, dtype=torch.bool) if attention_mask is None
                 else attention_mask.bool())
        if local_tokens == 1 and past > 0:  # the query is the row's newest token: it sees every real key
            keys = valid.to(cache.keys[0].device, copy=True)  # made once, on the device, for every layer
            keys[:, past] = True  # itself, always (a padding query's output is never read, but stays finite)
            if window is not None:
                keys[:, :max(past + 1 - window, 0)] = False
            return AttentionInputs(cache=cache, key_mask=keys[:, None, None, :])
        return AttentionInputs(cache=cache, pieces=decoding_pieces(valid, past, local_tokens, window))
    documents = None
    if segment_ids is not None:
        if cp > 1:
            segment_ids = gather_sequence(segment_ids, cp_group, dim=1)
        documents = Documents.from_segment_ids(segment_ids)
    if cp > 1:
        plan = cp_attention_plan(documents, local_tokens * cp, cp, group_rank(cp_group), parallel.cp_comm_type,
                                 window)
        return AttentionInputs(documents=documents, cp_plan=plan)
    pieces = None
    if documents is not None or (window is not None and local_tokens > window):
        pieces = self_attention_pieces(documents, local_tokens, window)
    return AttentionInputs(documents=documents, pieces=pieces)


class SelfAttention(nn.Module):
    def __init__(self, spec: ModelSpec, parallel: ParallelOptions, dtype, layer_index: int = 0):
        """`layer_index`: the layer's position in its module (numbered from 0), its slot in a KVCache."""
        super().__init__()
        tp_group, sequence_parallel = parallel.tp_group, parallel.sequence_parallel
        self.parallel = parallel
        self.layer_index = layer_index
        tp = group_size(tp_group)
        if spec.num_query_groups % tp and tp % spec.num_query_groups:
            raise ValueError(
                f"tensor-parallel size {tp} must divide, or be a multiple of, num_query_groups {spec.num_query_groups}"
            )
        if spec.num_attention_heads % tp:
            raise ValueError(f"tensor-parallel size {tp} must divide num_attention_heads {spec.num_attention_heads}")
        self.spec = spec
        self.tp_group = tp_group
        # Registration order matches Megatron-Core's SelfAttention (linear_proj before linear_qkv).
        self.linear_proj = RowParallelLinear(
            spec.num_attention_heads * spec.kv_channels, spec.hidden_size,
            tp_group=tp_group, sequence_parallel=sequence_parallel, dtype=dtype,
        )
        self.linear_qkv = ColumnParallelLinear(
            spec.hidden_size, spec.qkv_rows, bias=spec.qkv_bias,
            tp_group=tp_group, sequence_parallel=sequence_parallel, dtype=dtype,
        )
        self.q_layernorm = self.k_layernorm = None
        if spec.qk_layernorm:  # on each head; every TP rank holds other heads, so their gradients are summed
            self.q_layernorm = RMSNorm(spec.kv_channels, spec.norm_epsilon, dtype)
            self.k_layernorm = RMSNorm(spec.kv_channels, spec.norm_epsilon, dtype)
            for norm in (self.q_layernorm, self.k_layernorm):
                mark(norm.weight, sequence_parallel=group_size(tp_group) > 1)

    def _split_qkv(self, mixed: torch.Tensor):
        """mixed [s, b, local qkv rows] -> q [s, b, local heads, d], k and v [s, b, local groups, d]."""
        spec, tp, d = self.spec, group_size(self.tp_group), self.spec.kv_channels
        per_group = spec.heads_per_group
        if spec.num_query_groups >= tp:
            groups = spec.num_query_groups // tp
        else:
            # Fewer query groups than TP ranks: each rank's qkv rows are a contiguous chunk of the grouped layout
            # that does not align with groups. Gather the whole projection, keep this rank's group, and then only
            # this rank's query heads of it (Megatron-Core does the same).
            mixed = gather_last_dim_sum_grad(mixed, self.tp_group)
            ranks_per_group = tp // spec.num_query_groups
            group = group_rank(self.tp_group) // ranks_per_group
            size = mixed.shape[-1] // spec.num_query_groups
            mixed = mixed[..., group * size : (group + 1) * size]
            groups = 1
        s, b = mixed.shape[:2]
        mixed = mixed.view(s, b, groups, (per_group + 2) * d)
        q, k, v = torch.split(mixed, [per_group * d, d, d], dim=-1)
        q = q.reshape(s, b, groups * per_group, d)
        if spec.num_query_groups < tp:
            heads = spec.num_attention_heads // tp
            first = (group_rank(self.tp_group) % (tp // spec.num_query_groups)) * heads
            q = q[:, :, first : first + heads]
        return q, k, v

    def _core_attention(self, q, k, v, inputs: AttentionInputs) -> torch.Tensor:
        scale = 1.0 / math.sqrt(self.spec.kv_channels)
        if group_size(self.parallel.cp_group) > 1:
            return context_parallel_attention(
                q, k, v, group=self.parallel.cp_group, comm_type=self.parallel.cp_comm_type, scale=scale,
                documents=inputs.documents, window=self.spec.sliding_window, plan=inputs.cp_plan,
            )
        if inputs.pieces is not None:
            return piecewise_attention(q, k, v, inputs.pieces, scale)
        if inputs.key_mask is not None:
            return masked_attention(q, k, v, inputs.key_mask, scale)
        return core_attention(q, k, v, causal=True, softmax_scale=scale)

    def _recomputed_attention(self, q, k, v, inputs: AttentionInputs) -> torch.Tensor:
        return checkpoint(self._core_attention, q, k, v, inputs, use_reentrant=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inputs: AttentionInputs) -> torch.Tensor:
        q, k, v = self._split_qkv(self.linear_qkv(x))
        if self.q_layernorm is not None:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # [s, b, heads, d] -> [b, heads, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        if inputs.cache is not None:
            k, v = inputs.cache.extend(self.layer_index, k, v)
        plain = inputs.pieces is None and inputs.cp_plan is None and group_size(self.parallel.cp_group) == 1
        if self.parallel.recomputes("core_attn"):
            out = outside_compile(self._recomputed_attention, q, k, v, inputs)
        elif plain:
            out = self._core_attention(q, k, v, inputs)
        else:  # packed documents, windows, context parallelism: the pieces are Python data, computed eagerly
            out = outside_compile(self._core_attention, q, k, v, inputs)
        s, b = out.shape[2], out.shape[0]
        return self.linear_proj(out.permute(2, 0, 1, 3).reshape(s, b, -1))


def replicated_norm(spec: ModelSpec, parallel: ParallelOptions, dtype) -> RMSNorm:
    """An RMSNorm, whose weight every TP rank holds whole. Under sequence parallelism each TP rank sees a different
    slice of tokens, so the weight's gradient must be summed over the TP group."""
    norm = RMSNorm(spec.hidden_size, spec.norm_epsilon, dtype)
    mark(norm.weight, sequence_parallel=parallel.sp)
    return norm


@dataclass
class MoeContext:
    """What a model's MoE layers share: how they train and where they record their losses."""

    options: MoeConfig
    tracker: MoeTracker


class TransformerLayer(nn.Module):
    def __init__(self, spec: ModelSpec, parallel: ParallelOptions, dtype, layer_index: int = 0,
                 global_layer: int = 0, moe: MoeContext | None = None):
        """`layer_index`: its slot in this module's KVCache; `global_layer`: its index in the whole model."""
        super().__init__()
        self.input_layernorm = replicated_norm(spec, parallel, dtype)
        self.self_attention = SelfAttention(spec, parallel, dtype, layer_index)
        self.pre_mlp_layernorm = replicated_norm(spec, parallel, dtype)
        if spec.is_moe_layer(global_layer):
            moe = moe or MoeContext(MoeConfig(), MoeTracker())
            self.mlp = MoELayer(spec.hidden_size, spec.moe, parallel, moe.options, moe.tracker, global_layer, dtype)
        else:
            self.mlp = MLP(spec.hidden_size, spec.ffn_hidden_size, parallel, dtype)
        self.parallel = parallel
        self._compiled = None

    def compile_forward(self, **options) -> None:
        """Regional compilation (torchtitan's): this layer's forward through torch.compile, used by the forwards
        that train (eval, decoding and torch pipelining's shape-finding forward stay eager, so they add no
        graphs). Only the forward is compiled, so module hooks (FSDP2's gathers, the optimizer's param-gather
        waits) and a checkpoint around the layer (recompute full / op) stay outside the graph. Parameters are graph
        inputs, so every layer of one type shares one graph. Left out, eagerly: the attention of packed documents,
        windows and context parallelism (outside_compile in SelfAttention), a routed MoE block, and whatever
        selective recompute wraps (its checkpoint and the layernorm's discarded output)."""
        global _eager_call
        if _eager_call is None:
            _eager_call = torch.compiler.disable(_call)
        self._compiled = torch.compile(self._forward, **options)

    def _norm_then(self, norm: RMSNorm, block, x: torch.Tensor, *args) -> torch.Tensor:
        """block(norm(x), *args); with the layernorm module recomputed, the norm keeps only its input and its output
        is discarded until block's backward (discard_output)."""
        if not self.parallel.recomputes("layernorm"):
            return block(norm(x), *args)
        return outside_compile(self._discarded_norm_then, norm, block, x, *args)

    def _discarded_norm_then(self, norm: RMSNorm, block, x: torch.Tensor, *args) -> torch.Tensor:
        normed = checkpoint(norm, x, use_reentrant=False)
        out = block(normed, *args)
        discard_output(normed, out, lambda: norm(x))
        return out

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        if self.parallel.recomputes("mlp"):
            return outside_compile(self._recomputed_mlp, x)
        if isinstance(self.mlp, MoELayer):  # data-dependent routing and dispatch: eager
            return outside_compile(self.mlp, x)
        return self.mlp(x)

    def _recomputed_mlp(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.mlp, x, use_reentrant=False)

    def forward(self, x, cos, sin, inputs: AttentionInputs):
        if self._compiled is not None and torch.is_grad_enabled() and not shape_inference.active():
            return self._compiled(x, cos, sin, inputs)
        return self._forward(x, cos, sin, inputs)

    def _forward(self, x, cos, sin, inputs: AttentionInputs):
        x = x + self._norm_then(self.input_layernorm, self.self_attention, x, cos, sin, inputs)
        return x + self._norm_then(self.pre_mlp_layernorm, self._mlp, x)


class TransformerBlock(nn.Module):
    def __init__(self, spec, num_layers, post_process, parallel: ParallelOptions, dtype, layer_offset: int = 0,
                 moe: MoeContext | None = None):
        super().__init__()
        self.parallel = parallel
        self.layers = nn.ModuleList(TransformerLayer(spec, parallel, dtype, index, layer_offset + index, moe)
                                    for index in range(num_layers))
        self.final_layernorm = replicated_norm(spec, parallel, dtype) if post_process else None

    def forward(self, x, cos, sin, inputs: AttentionInputs):
        full = len(self.layers) if self.parallel.recompute_num_layers is None else self.parallel.recompute_num_layers
        for index, layer in enumerate(self.layers):
            if self.parallel.recompute == "full" and index < full and torch.is_grad_enabled():
                x = checkpoint(layer, x, cos, sin, inputs, use_reentrant=False)
            elif self.parallel.recompute == "op" and torch.is_grad_enabled():
                x = checkpoint(layer, x, cos, sin, inputs, use_reentrant=False, context_fn=op_policy_contexts)
            else:
                x = layer(x, cos, sin, inputs)
        return self.final_layernorm(x) if self.final_layernorm is not None else x


class LanguageModelEmbedding(nn.Module):
    def __init__(self, spec, padded_vocab, parallel: ParallelOptions, dtype):
        super().__init__()
        self.word_embeddings = VocabParallelEmbedding(
            padded_vocab, spec.hidden_size, tp_group=parallel.tp_group, sequence_parallel=parallel.sequence_parallel,
            dtype=dtype,
        )

    def forward(self, input_ids):
        return self.word_embeddings(input_ids)


class GPTModel(nn.Module):
    """One pipeline stage (or the whole model) of a decoder-only LM.

    `layer_offset`/`num_layers` select the global layers this module holds (numbered locally from 0, as in
    Megatron's per-stage files); `pre_process` adds the embedding, `post_process` the final norm and output layer.

    hidden_states() runs the stage; the last stage's output goes through the output layer: loss() (training, chunk
    by chunk on long sequences) or logits(). forward() is the three together for a whole model.
    """

    def __init__(
        self,
        spec: ModelSpec,
        *,
        parallel: ParallelOptions | None = None,
        pre_process: bool = True,
        post_process: bool = True,
        layer_offset: int = 0,
        num_layers: int | None = None,
        padded_vocab: int | None = None,
        dtype: torch.dtype = torch.float32,
        loss_chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
        moe_options: MoeConfig | None = None,
    ):
        super().__init__()
        parallel = parallel or ParallelOptions()
        if loss_chunk_tokens < 0:
            raise ValueError(f"loss_chunk_tokens must be >= 0 (0: off), not {loss_chunk_tokens}")
        # the recipe's schema checked these (config.py); a wrong one here is a bug in the caller
        assert parallel.recompute in RECOMPUTE_MODES, parallel.recompute
        assert parallel.cp_comm_type in CP_COMM_TYPES, parallel.cp_comm_type
        tp_group = parallel.tp_group
        self.spec = spec
        self.parallel = parallel
        self.tp_group = tp_group
        self.sequence_parallel = parallel.sp
        self.pre_process, self.post_process = pre_process, post_process
        self.layer_offset = layer_offset
        self.loss_chunk_tokens = loss_chunk_tokens  # loss(): project and take the loss this many tokens at a time
        self.padded_vocab = padded_vocab or padded_vocab_size(spec.vocab_size, 128, group_size(tp_group))
        num_layers = spec.num_layers - layer_offset if num_layers is None else num_layers
        self.tied_in_stage = spec.tie_word_embeddings and pre_process
        if pre_process:
            self.embedding = LanguageModelEmbedding(spec, self.padded_vocab, parallel, dtype)
        # MoE layers record their losses and loads here (one tracker per model chunk)
        self.moe = MoeContext(moe_options or MoeConfig(), MoeTracker())
        self.decoder = TransformerBlock(spec, num_layers, post_process, parallel, dtype, layer_offset, self.moe)
        if post_process:
            # With tied embeddings the output layer borrows the embedding weight when both live in this stage;
            # a last stage without the embedding keeps its own copy (synchronised by the pipeline code).
            self.output_layer = OutputLayer(
                spec.hidden_size, self.padded_vocab, vocab_size=spec.vocab_size, tp_group=tp_group,
                sequence_parallel=parallel.sequence_parallel, skip_weight=self.tied_in_stage, dtype=dtype,
            )
        self._inv_freq = rope_inv_freq(spec.kv_channels, spec.rope_theta, spec.rope_scaling)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02, generator: torch.Generator | None = None):
        """Megatron's default init: N(0, std) for weights, std/sqrt(2L) for the layers feeding the residual."""
        out_std = std / math.sqrt(2.0 * self.spec.num_layers)
        for name, param in self.named_parameters():
            if name.endswith("layernorm.weight"):
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                scale = out_std if name.endswith(("linear_proj.weight", "linear_fc2.weight")) else std
                param.copy_(torch.randn(param.shape, generator=generator, dtype=torch.float32) * scale)

    def compile_layers(self, **options) -> None:
        """Compile each decoder layer (TransformerLayer.compile_forward); never the whole model."""
        for layer in self.decoder.layers:
            layer.compile_forward(**options)

    def output_weight(self) -> torch.Tensor:
        if self.tied_in_stage:
            return self.embedding.word_embeddings.weight
        return self.output_layer.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        *,
        labels: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
        cache: KVCache | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """hidden_states() and, on the last stage, the output layer: the per-token loss [b, s] when `labels` are
        given (label -100 = ignored, loss 0), else logits [b, s, vocab_size]. Other stages return the hidden states.
        """
        hidden = self.hidden_states(input_ids, position_ids, segment_ids=segment_ids, cache=cache,
                                    attention_mask=attention_mask)
        if not self.post_process:
            return hidden
        return self.logits(hidden) if labels is None else self.loss(hidden, labels)

    def hidden_states(
        self,
        x: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        *,
        segment_ids: torch.Tensor | None = None,
        cache: KVCache | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One pass over this module's layers: `x` the token ids [b, s] on the first stage, else the previous
        stage's hidden states [s, b, h]. Returns the hidden states [s, b, h] (the last stage: the final norm's).

        Inputs are this rank's tokens: with context parallelism, its two load-balanced chunks of each sequence
        (qlm_core.parallel.context_parallel.split_for_cp). `position_ids` [b, s] are RoPE positions (default: the
        tokens' global indices; packed sequences restart them per document) and `segment_ids` [b, s] the document
        of each token in a packed sequence (attention stays within a document).

        Incremental decoding: pass a `cache` (KVCache.empty(num_layers)) that this call extends, the new tokens'
        position_ids, and for padded batches `attention_mask` [b, cached + new] (True = a real token).
        """
        if self.pre_process:
            x = self.embedding(x)
        local_tokens = x.shape[0] * (group_size(self.tp_group) if self.sequence_parallel else 1)
        cp_group = self.parallel.cp_group
        token_index = None
        if group_size(cp_group) > 1:
            cp = group_size(cp_group)
            token_index = cp_token_indices(local_tokens * cp, cp, group_rank(cp_group), device=x.device)
        if position_ids is None:
            index = token_index if token_index is not None else torch.arange(local_tokens, device=x.device)
            position_ids = index[None, :].expand(x.shape[1], local_tokens)
        self._inv_freq = self._inv_freq.to(x.device)
        cos, sin = rope_cos_sin(position_ids, self._inv_freq, x.dtype)
        inputs = attention_inputs(local_tokens=local_tokens, batch=x.shape[1], window=self.spec.sliding_window,
                                  parallel=self.parallel, segment_ids=segment_ids, cache=cache,
                                  attention_mask=attention_mask)
        return self.decoder(x, cos, sin, inputs)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The final norm's output [s, b, h] -> logits [b, s, vocab_size], gathered over TP, padding removed."""
        logits = self.output_layer(hidden, self.output_weight())
        return gather_last_dim(logits, self.tp_group)[..., : self.spec.vocab_size].transpose(0, 1)

    def loss(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The loss head: the final norm's output [s, b, h] (this rank's sequence shard under SP), labels [b, s] ->
        per-token loss [b, s] (fp32), zero where the label is negative. When the rank's tokens exceed
        `loss_chunk_tokens` the projection and the cross entropy run chunk by chunk (never [s, b, V/tp] logits);
        otherwise through the whole logits, as token_loss."""
        if loss_is_chunked(self.loss_chunk_tokens, labels.numel()):
            return self.output_layer(hidden, self.output_weight(), labels=labels, chunk_tokens=self.loss_chunk_tokens)
        return self.token_loss(self.output_layer(hidden, self.output_weight()), labels)

    def token_loss(self, local_logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel cross entropy: local logits [s, b, V_padded/tp], labels [b, s] -> loss [b, s] (fp32),
        zero where the label is negative (ignored)."""
        keep = labels >= 0
        loss = vocab_parallel_cross_entropy(
            local_logits, labels.clamp(min=0).transpose(0, 1), self.tp_group, self.spec.vocab_size
        ).transpose(0, 1)
        return loss * keep
