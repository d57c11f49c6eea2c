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
from torch.utils.checkpoint import checkpoint

from qlm_core.config import MoeConfig, RecomputeMode, choices
from qlm_core.kernels.pieces import Documents
from qlm_core.models.activations import activation_kind
from qlm_core.models.attention import AttentionInputs, KVCache, attention_inputs
from qlm_core.models.attention_kinds import attention_kind
from qlm_core.models.families import FAMILIES
from qlm_core.models.mlp import MLP
from qlm_core.models.moe import MoELayer, MoeTracker
from qlm_core.models.mtp import MultiTokenPredictionBlock, MultiTokenPredictionLayer
from qlm_core.models.norms import NORM_WEIGHT_SUFFIXES, build_norm, norm_kind
from qlm_core.models.positions import position_kind
from qlm_core.models.runtime import ParallelOptions, allow_eager_regions, discard_output, outside_compile
from qlm_core.models.score_head import ScoreHead
from qlm_core.models.spec import ModelSpec, padded_vocab_size
from qlm_core.parallel import shape_inference
from qlm_core.parallel.comm import group_rank, group_size
from qlm_core.parallel.context_parallel import (
    CP_COMM_TYPES,
    cp_token_indices,
)
from qlm_core.parallel.cross_entropy import DEFAULT_CHUNK_TOKENS, OutputLayer, loss_is_chunked, soft_cap
from qlm_core.parallel.param_meta import mark
from qlm_core.parallel.tensor import (
    VocabParallelEmbedding,
    gather_last_dim,
    vocab_parallel_cross_entropy,
)

RECOMPUTE_MODES = choices(RecomputeMode)


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


def replicated_norm(spec: ModelSpec, parallel: ParallelOptions, dtype) -> nn.Module:
    """The spec's norm over hidden_size, whose tensors every TP rank holds whole. Under sequence parallelism each TP
    rank sees a different slice of tokens, so their gradients must be summed over the TP group."""
    norm = build_norm(spec, spec.hidden_size, dtype)
    for tensor in norm.parameters():
        mark(tensor, sequence_parallel=parallel.sp)
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
        self.window = spec.layer_window(global_layer)
        self.self_attention = attention_kind(spec).module(spec, parallel, dtype, layer_index, self.window)
        # GLM-4's sandwich norms: after each block, before its residual add (registered in Megatron's order)
        self.post_self_attn_layernorm = replicated_norm(spec, parallel, dtype) if spec.post_norms else None
        self.pre_mlp_layernorm = replicated_norm(spec, parallel, dtype)
        if spec.is_moe_layer(global_layer):
            moe = moe or MoeContext(MoeConfig(), MoeTracker())
            self.mlp = MoELayer(spec.hidden_size, spec.moe, parallel, moe.options, moe.tracker, global_layer, dtype,
                                activation_kind(spec), bias=spec.linear_bias)
            # its index among the model's MoE layers: its slot in a batch's recorded routes
            self.route_slot = spec.moe.num_moe_layers(global_layer)
        else:
            self.mlp = MLP(spec.hidden_size, spec.ffn_hidden_size, parallel, dtype, activation_kind(spec),
                           bias=spec.linear_bias)
        self.post_mlp_layernorm = replicated_norm(spec, parallel, dtype) if spec.post_norms else None
        self.parallel = parallel
        self._compiled = None

    def compile_forward(self, **options) -> None:
        """Regional compilation (torchtitan's): this layer's forward through torch.compile, used by the forwards
        that train (eval, decoding and torch pipelining's shape-finding forward stay eager, so they add no
        graphs). Only the forward is compiled, so module hooks (FSDP2's gathers, the optimizer's param-gather
        waits) and a checkpoint around the layer (recompute full / op) stay outside the graph. Parameters are graph
        inputs, so every layer of one type shares one graph. Left out, eagerly: the attention of packed documents,
        windows and context parallelism (outside_compile in the attention module), a routed MoE block, and whatever
        selective recompute wraps (its checkpoint and the layernorm's discarded output)."""
        allow_eager_regions()
        self._compiled = torch.compile(self._forward, **options)

    def _norm_then(self, norm: nn.Module, block, x: torch.Tensor, *args) -> torch.Tensor:
        """block(norm(x), *args); with the layernorm module recomputed, the norm keeps only its input and its output
        is discarded until block's backward (discard_output)."""
        if not self.parallel.recomputes("layernorm"):
            return block(norm(x), *args)
        return outside_compile(self._discarded_norm_then, norm, block, x, *args)

    def _discarded_norm_then(self, norm: nn.Module, block, x: torch.Tensor, *args) -> torch.Tensor:
        normed = checkpoint(norm, x, use_reentrant=False)
        out = block(normed, *args)
        discard_output(normed, out, lambda: norm(x))
        return out

    def _mlp(self, x: torch.Tensor, routes: torch.Tensor | None = None) -> torch.Tensor:
        args = (x,) if routes is None or not isinstance(self.mlp, MoELayer) else (x, routes[:, :, self.route_slot])
        if self.parallel.recomputes("mlp"):
            return outside_compile(self._recomputed_mlp, *args)
        if isinstance(self.mlp, MoELayer):  # data-dependent routing and dispatch: eager
            return outside_compile(self.mlp, *args)
        return self.mlp(x)

    def _recomputed_mlp(self, *args: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.mlp, *args, use_reentrant=False)

    def forward(self, x, positions: tuple[torch.Tensor, ...], inputs: AttentionInputs,
                routes: torch.Tensor | None = None):
        """`positions`: what the position scheme hands each layer (models/positions.py; RoPE: cos and sin).
        `routes` [b, s, MoE layers, k]: the experts recorded for the tokens, which an MoE layer replays."""
        if self._compiled is not None and torch.is_grad_enabled() and not shape_inference.active():
            return self._compiled(x, positions, inputs, routes)
        return self._forward(x, positions, inputs, routes)

    def _forward(self, x, positions, inputs: AttentionInputs, routes: torch.Tensor | None = None):
        if isinstance(positions, dict):  # RoPE by window (Gemma 3's local and global bases)
            positions = positions[self.window]
        attended = self._norm_then(self.input_layernorm, self.self_attention, x, positions, inputs)
        if self.post_self_attn_layernorm is not None:
            attended = self.post_self_attn_layernorm(attended)
        x = x + attended
        mixed = self._norm_then(self.pre_mlp_layernorm, self._mlp, x, routes)
        if self.post_mlp_layernorm is not None:
            mixed = self.post_mlp_layernorm(mixed)
        return x + mixed


class TransformerBlock(nn.Module):
    def __init__(self, spec, num_layers, post_process, parallel: ParallelOptions, dtype, layer_offset: int = 0,
                 moe: MoeContext | None = None):
        super().__init__()
        self.parallel = parallel
        self.layers = nn.ModuleList(TransformerLayer(spec, parallel, dtype, index, layer_offset + index, moe)
                                    for index in range(num_layers))
        self.final_layernorm = replicated_norm(spec, parallel, dtype) if post_process else None

    def forward(self, x, positions, inputs: AttentionInputs, routes: torch.Tensor | None = None):
        full = len(self.layers) if self.parallel.recompute_num_layers is None else self.parallel.recompute_num_layers
        for index, layer in enumerate(self.layers):
            if self.parallel.recompute == "full" and index < full and torch.is_grad_enabled():
                x = checkpoint(layer, x, positions, inputs, routes, use_reentrant=False)
            elif self.parallel.recompute == "op" and torch.is_grad_enabled():
                x = checkpoint(layer, x, positions, inputs, routes, use_reentrant=False,
                               context_fn=op_policy_contexts)
            else:
                x = layer(x, positions, inputs, routes)
        return self.final_layernorm(x) if self.final_layernorm is not None else x


class LanguageModelEmbedding(nn.Module):
    def __init__(self, spec, padded_vocab, parallel: ParallelOptions, dtype):
        super().__init__()
        self.word_embeddings = VocabParallelEmbedding(
            padded_vocab, spec.hidden_size, tp_group=parallel.tp_group, sequence_parallel=parallel.sequence_parallel,
            dtype=dtype,
        )

        # BLOOM: a norm of the word embedding (Megatron-DeepSpeed's word_embeddings.norm under --embed-layernorm),
        # whole on every TP rank
        if spec.embedding_norm:
            self.word_embeddings.norm = replicated_norm(spec, parallel, dtype)
        self.embedding_norm = spec.embedding_norm
        # Gemma: the embedding's output times sqrt(hidden_size), that factor rounded to the weights' dtype first
        self.scale = spec.hidden_size ** 0.5 if spec.scaled_embedding else None
        # learned absolute positions (Megatron's position_embeddings; OPT's rows start `offset` before position 0):
        # whole on every TP rank; under SP each rank adds its own tokens' rows, so their gradients are summed
        self.position_offset = FAMILIES[spec.model_type].position_offset
        self.position_embeddings = None
        if spec.position == "learned_absolute":
            self.position_embeddings = nn.Embedding(spec.max_position_embeddings + self.position_offset,
                                                    spec.hidden_size, dtype=dtype)
            mark(self.position_embeddings.weight, sequence_parallel=parallel.sp)
        self.tp_group, self.sequence_parallel = parallel.tp_group, parallel.sequence_parallel

    def forward(self, input_ids, position_ids: torch.Tensor | None = None):
        """Token ids [b, s] (and with learned positions their position_ids [b, s]) -> [s, b, h], this rank's
        sequence shard under SP."""
        embedded = self.word_embeddings(input_ids)
        if self.embedding_norm:
            embedded = self.word_embeddings.norm(embedded)
        if self.position_embeddings is not None:
            if position_ids is None:
                raise ValueError("learned positions need the tokens' position_ids")
            if self.sequence_parallel and group_size(self.tp_group) > 1:  # this rank's tokens only
                shard = embedded.shape[0]
                position_ids = position_ids.narrow(1, group_rank(self.tp_group) * shard, shard)
            embedded = embedded + self.position_embeddings(position_ids + self.position_offset).transpose(0, 1)
        if self.scale is None:
            return embedded
        return embedded * torch.tensor(self.scale, dtype=embedded.dtype, device=embedded.device)


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
        # multi-token prediction runs on the last stage, which then holds a copy of the embedding (Megatron's)
        mtp = spec.mtp_num_layers if post_process else 0
        if pre_process or mtp:
            self.embedding = LanguageModelEmbedding(spec, self.padded_vocab, parallel, dtype)
        # MoE layers record their losses and loads here (one tracker per model chunk)
        self.moe = MoeContext(moe_options or MoeConfig(), MoeTracker())
        self.decoder = TransformerBlock(spec, num_layers, post_process, parallel, dtype, layer_offset, self.moe)
        self.mtp = None
        if mtp:
            self.mtp = MultiTokenPredictionBlock([MultiTokenPredictionLayer(
                spec.hidden_size, lambda: replicated_norm(spec, parallel, dtype),
                TransformerLayer(spec, parallel, dtype, num_layers + depth, spec.num_layers + depth, self.moe),
                parallel, dtype) for depth in range(mtp)], parallel)
        # the sliding windows of this module's layers (None: full attention), each layer's attention inputs
        self.windows = tuple(dict.fromkeys(layer.window for layer in self.transformer_layers())) or (None,)
        if post_process:
            # With tied embeddings the output layer borrows the embedding weight when both live in this stage;
            # a last stage without the embedding keeps its own copy (synchronised by the pipeline code).
            if spec.head == "score":
                self.output_layer = ScoreHead(spec.hidden_size, tp_group=tp_group, dtype=dtype,
                                              sequence_parallel=parallel.sequence_parallel)
            else:
                self.output_layer = OutputLayer(
                    spec.hidden_size, self.padded_vocab, vocab_size=spec.vocab_size, tp_group=tp_group,
                    sequence_parallel=parallel.sequence_parallel, skip_weight=self.tied_in_stage, dtype=dtype,
                )
        self.positions = position_kind(spec).scheme(spec)  # holds no parameters of RoPE's
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02, generator: torch.Generator | None = None):
        """Megatron's default init: N(0, std) for weights, std/sqrt(2L) for the layers feeding the residual."""
        out_std = std / math.sqrt(2.0 * self.spec.num_layers)
        norm_init = norm_kind(self.spec).init
        for name, param in self.named_parameters():
            if name.endswith(NORM_WEIGHT_SUFFIXES):
                param.fill_(norm_init)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                scale = out_std if name.endswith(("linear_proj.weight", "linear_fc2.weight")) else std
                param.copy_(torch.randn(param.shape, generator=generator, dtype=torch.float32) * scale)

    def compile_layers(self, **options) -> None:
        """Compile each decoder layer (TransformerLayer.compile_forward); never the whole model."""
        for layer in self.decoder.layers:
            layer.compile_forward(**options)

    def transformer_layers(self, mtp: bool = True) -> list[TransformerLayer]:
        """The decoder's layers, then (with `mtp`, on the last stage) each multi-token prediction layer's."""
        extra = [layer.transformer_layer for layer in self.mtp.layers] if mtp and self.mtp is not None else []
        return [*self.decoder.layers, *extra]

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
        routes: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """hidden_states() and, on the last stage, the output layer: the per-token loss [b, s] when `labels` are
        given (label -100 = ignored, loss 0), else logits [b, s, vocab_size]. Other stages return the hidden states.
        """
        hidden = self.hidden_states(input_ids, position_ids, segment_ids=segment_ids, cache=cache,
                                    attention_mask=attention_mask, routes=routes)
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
        routes: torch.Tensor | None = None,
        mtp_tokens: torch.Tensor | None = None,
        documents: Documents | None = None,
    ) -> torch.Tensor:
        """One pass over this module's layers: `x` the token ids [b, s] on the first stage, else the previous
        stage's hidden states [s, b, h]. Returns the hidden states [s, b, h] (the last stage: the final norm's).

        Inputs are this rank's tokens: with context parallelism, its two load-balanced chunks of each sequence
        (qlm_core.parallel.context_parallel.split_for_cp). `position_ids` [b, s] are the positions (default: the
        tokens' global indices; packed sequences restart them per document) and `segment_ids` [b, s] the document
        of each token in a packed sequence (attention stays within a document); or `documents` already described
        (kernels/pieces.Documents: documents that continue a shared prefix; one process along the sequence).

        Incremental decoding: pass a `cache` (KVCache.empty(num_layers)) that this call extends, the new tokens'
        position_ids, and for padded batches `attention_mask` [b, cached + new] (True = a real token).

        Routing replay: `routes` [b, s, the model's MoE layers, k] are the experts recorded for these tokens (-1:
        none); the MoE layers take them instead of their routers' choice (MoeTracker.replay) and count where they
        differ.

        Multi-token prediction (the last stage of a model with mtp_num_layers, training): `mtp_tokens` [b, s, depths]
        are the tokens each depth embeds (models/mtp.py); the result is then the final norm's output followed by
        each depth's output along the sequence, [(1 + depths) s, b, h], as Megatron-Core hands them to its loss.
        """
        if self.pre_process:  # token ids [b, s]
            local_tokens = x.shape[1]
        else:  # the previous stage's [s, b, h] (its sequence shard under SP)
            local_tokens = x.shape[0] * (group_size(self.tp_group) if self.sequence_parallel else 1)
        batch = x.shape[0] if self.pre_process else x.shape[1]
        cp_group = self.parallel.cp_group
        token_index = None
        if group_size(cp_group) > 1:
            cp = group_size(cp_group)
            token_index = cp_token_indices(local_tokens * cp, cp, group_rank(cp_group), device=x.device)
        if position_ids is None:
            index = token_index if token_index is not None else torch.arange(local_tokens, device=x.device)
            position_ids = index[None, :].expand(batch, local_tokens)
        if self.pre_process:
            x = self.embedding(x, position_ids)
        positions = self.positions.layer_inputs(position_ids, x.dtype)
        inputs = attention_inputs(local_tokens=local_tokens, batch=x.shape[1], windows=self.windows,
                                  parallel=self.parallel, segment_ids=segment_ids, cache=cache,
                                  attention_mask=attention_mask, documents=documents,
                                  positional=self.spec.position == "alibi",
                                  tiled=self.spec.position == "alibi" or self.spec.attention_softcap is not None)
        hidden = self.decoder(x, positions, inputs, routes)
        if mtp_tokens is None or self.mtp is None:
            return hidden
        return torch.cat([hidden, *self.mtp(hidden, self.embedding, mtp_tokens, positions, inputs)], dim=0)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The final norm's output [s, b, h] -> logits [b, s, vocab_size], gathered over TP, padding removed (a
        score head: every token's score [b, s, 1])."""
        if self.spec.head == "score":
            return self.output_layer(hidden)[..., None]
        logits = self.output_layer(hidden, self.output_weight())
        logits = gather_last_dim(logits, self.tp_group)[..., : self.spec.vocab_size].transpose(0, 1)
        return logits if self.spec.logit_softcap is None else soft_cap(logits, self.spec.logit_softcap)

    def loss(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The loss head: the final norm's output [s, b, h] (this rank's sequence shard under SP), labels [b, s] ->
        per-token loss [b, s] (fp32), zero where the label is negative. When the rank's tokens exceed
        `loss_chunk_tokens` the projection and the cross entropy run chunk by chunk (never [s, b, V/tp] logits);
        otherwise through the whole logits, as token_loss. A score head: each labelled token's score [b, s]
        (fp32), zero elsewhere."""
        if self.spec.head == "score":
            return self.output_layer(hidden) * (labels >= 0)
        if loss_is_chunked(self.loss_chunk_tokens, labels.numel()):
            return self.output_layer(hidden, self.output_weight(), labels=labels, chunk_tokens=self.loss_chunk_tokens,
                                     softcap=self.spec.logit_softcap)
        logits = self.output_layer(hidden, self.output_weight())
        if self.spec.logit_softcap is not None:  # Gemma 2's final soft-capping, on each TP rank's columns, in fp32
            logits = soft_cap(logits.float(), self.spec.logit_softcap)  # as the chunked loss (the loss is fp32)
        return self.token_loss(logits, labels)

    def token_loss(self, local_logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel cross entropy: local logits [s, b, V_padded/tp], labels [b, s] -> loss [b, s] (fp32),
        zero where the label is negative (ignored)."""
        keep = labels >= 0
        loss = vocab_parallel_cross_entropy(
            local_logits, labels.clamp(min=0).transpose(0, 1), self.tp_group, self.spec.vocab_size
        ).transpose(0, 1)
        return loss * keep
