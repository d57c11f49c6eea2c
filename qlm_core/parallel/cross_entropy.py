"""The output projection and the vocab-parallel cross entropy fused chunk by chunk, so that the loss never holds the
[tokens, V_padded/tp] logits (the idea of Liger's fused linear cross entropy, on plain torch ops).

Forward takes `chunk_tokens` tokens at a time: their logits x_c @ W^T (compute dtype), an fp32 copy with Megatron's
padding columns at -inf, and the cross entropy of _VocabParallelCrossEntropy (max, target logit and sum of exp
all-reduced over TP); it keeps only each token's fp32 log-sum-exp. Backward recomputes each chunk's logits and
turns them into the gradient grad_loss · (exp(logits - lse) - onehot): dx_c = grad_c @ W, dW += grad_c^T @ x_c
(accumulated in the weight's dtype with addmm_, as _SPGatherLinear does: each chunk's product would be rounded to
that dtype anyway). Saved for backward: x (its sequence shard under SP, like _SPGatherLinear), W, the log-sum-exp
and the targets; besides them only one chunk's logits (compute dtype + fp32) exist at a time, and in backward dW.

Backward computes only the gradients the autograd engine will use (_engine_wants): under the zero-bubble schedule
torch runs this backward twice, once for the stage input (dx only) and once for the weights (dW only), so each pass
recomputes the logits but neither repeats the other's matmul.

The TP collectives stay where ColumnParallelLinear has them: without SP the input passes copy_to_tp (its backward
all-reduces dx); under SP the function gathers the sequence itself and reduce-scatters dx.
"""

from __future__ import annotations

import torch
from torch.autograd import Function
from torch.distributed import ProcessGroup

from qlm_core.parallel.comm import all_gather_dim0, all_reduce, group_rank, reduce_scatter_dim0
from qlm_core.parallel.tensor import ColumnParallelLinear, copy_to_tp

DEFAULT_CHUNK_TOKENS = 2048  # train.loss_chunk_tokens' default


def loss_is_chunked(chunk_tokens: int, tokens: float) -> bool:
    """Whether the loss head runs chunk by chunk (GPTModel.loss): a chunk is set (0: off) and the rank's tokens of
    one micro-batch exceed it; otherwise it takes the whole logits."""
    return 0 < chunk_tokens < tokens


def _engine_wants(ctx, index: int) -> bool:
    """Whether the running backward pass will use the gradient of forward input `index` (a tensor input of a
    Function whose inputs that need gradients come first). torch._C._will_engine_execute_node answers for the node
    that gradient flows into; it raises where it cannot tell (outside the engine, or for a leaf's AccumulateGrad
    that autograd.grad captures, which then does want it), and then the gradient is computed."""
    if not ctx.needs_input_grad[index]:
        return False
    node = ctx.next_functions[index][0]
    if node is None:
        return False
    try:
        return bool(torch._C._will_engine_execute_node(node))
    except (RuntimeError, TypeError):
        return True


def soft_cap(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """Gemma 2's cap · tanh(logits / cap) (differentiable)."""
    return torch.tanh(logits / cap) * cap


def _chunk_logits(x: torch.Tensor, weight: torch.Tensor, padding_from: int | None, softcap: float | None = None,
                  keep_tanh: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp32 logits [c, V_padded/tp] of the tokens x [c, h], soft-capped with `softcap` (in place; with `keep_tanh`
    also tanh(raw / cap), its derivative's term, a second fp32 copy; else None); padding columns at -inf. Only the
    fp32 copies outlive this call (the compute-dtype product is freed on return)."""
    logits = torch.mm(x, weight.t()).float()
    capped = None
    if softcap is not None:
        logits.div_(softcap).tanh_()
        if keep_tanh:
            capped = logits.clone()
        logits.mul_(softcap)
    if padding_from is not None:
        logits[:, padding_from:] = float("-inf")
    return logits, capped


def _vocab_slice(target: torch.Tensor, part: int, group: ProcessGroup | None, vocab_size: int):
    """This TP rank's view of the vocabulary: (its first padding column or None, each target's column here, 0 where
    the target is on another rank, and whether it is here). Ignored targets (< 0) are on no rank."""
    start = group_rank(group) * part
    padding_from = max(0, vocab_size - start) if vocab_size < start + part else None
    local_target = target - start
    here = (local_target >= 0) & (local_target < part)
    return padding_from, local_target.masked_fill(~here, 0), here


class _ChunkedVocabParallelCrossEntropy(Function):
    @staticmethod
    def forward(ctx, hidden, weight, target, group: ProcessGroup | None, vocab_size, chunk_tokens, sequence_parallel,
                softcap):
        full = all_gather_dim0(hidden, group) if sequence_parallel else hidden
        x = full.reshape(-1, full.shape[-1])
        padding_from, local_target, here = _vocab_slice(target, weight.shape[0], group, vocab_size)
        tokens = x.shape[0]
        loss = torch.empty(tokens, dtype=torch.float32, device=x.device)
        lse = torch.empty_like(loss)
        for first in range(0, tokens, chunk_tokens):
            rows = slice(first, first + chunk_tokens)
            logits, _ = _chunk_logits(x[rows], weight, padding_from, softcap)
            logits_max = all_reduce(logits.max(dim=-1).values, group, op=torch.distributed.ReduceOp.MAX)
            logits.sub_(logits_max[:, None])
            target_logit = logits.gather(-1, local_target[rows, None]).squeeze(-1).masked_fill(~here[rows], 0.0)
            sums = all_reduce(torch.stack((target_logit, logits.exp_().sum(dim=-1))), group)
            del logits
            log_sum_exp = torch.log(sums[1])
            loss[rows] = log_sum_exp - sums[0]
            lse[rows] = logits_max + log_sum_exp
        loss.masked_fill_(target < 0, 0.0)
        ctx.group, ctx.vocab_size, ctx.chunk_tokens, ctx.softcap = group, vocab_size, chunk_tokens, softcap
        ctx.sequence_parallel = sequence_parallel
        ctx.save_for_backward(hidden, weight, lse, target)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, lse, target = ctx.saved_tensors
        group, chunk_tokens = ctx.group, ctx.chunk_tokens
        want_input, want_weight = _engine_wants(ctx, 0), _engine_wants(ctx, 1)
        if not (want_input or want_weight):
            return None, None, None, None, None, None, None, None
        full = all_gather_dim0(hidden, group) if ctx.sequence_parallel else hidden
        x = full.reshape(-1, full.shape[-1])
        padding_from, local_target, here = _vocab_slice(target, weight.shape[0], group, ctx.vocab_size)
        scale = grad_loss.float().masked_fill(target < 0, 0.0)
        tokens = x.shape[0]
        grad_x = torch.empty_like(x) if want_input else None
        grad_weight = None
        for first in range(0, tokens, chunk_tokens):
            rows = slice(first, first + chunk_tokens)
            grad, capped = _chunk_logits(x[rows], weight, padding_from, ctx.softcap, keep_tanh=True)
            grad.sub_(lse[rows, None]).exp_()  # the softmax
            grad.scatter_add_(-1, local_target[rows, None], -here[rows, None].to(grad.dtype))
            grad.mul_(scale[rows, None])
            if capped is not None:  # through the soft-cap: d(cap tanh(x / cap)) / dx = 1 - tanh^2
                grad.mul_(capped.square_().neg_().add_(1))
            del capped
            grad = grad.to(x.dtype)
            if want_input:
                torch.mm(grad, weight, out=grad_x[rows])
            if want_weight:  # in the weight's dtype: no fp32 [V/tp, h] accumulator beside it
                if grad_weight is None:
                    grad_weight = torch.mm(grad.t(), x[rows])
                else:
                    grad_weight.addmm_(grad.t(), x[rows])
            del grad
        if want_weight and grad_weight is None:  # no tokens
            grad_weight = torch.zeros_like(weight)
        if want_input:
            grad_x = grad_x.view(full.shape)
            if ctx.sequence_parallel:
                grad_x = reduce_scatter_dim0(grad_x, group)
        return grad_x, grad_weight, None, None, None, None, None, None


def chunked_vocab_parallel_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                                         tp_group: ProcessGroup | None, vocab_size: int, chunk_tokens: int,
                                         sequence_parallel: bool = False, softcap: float | None = None) -> torch.Tensor:
    """hidden [s, b, h] (this rank's sequence shard under SP), this TP rank's output weight W [V_padded/tp, h], labels
    [b, s] -> per-token loss [b, s] in fp32, zero where the label is negative (ignored). Columns at or past
    `vocab_size` are padding. Same loss and gradients as the output layer (soft-capped with `softcap`, Gemma 2's) +
    vocab_parallel_cross_entropy."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be at least 1, not {chunk_tokens}")
    target = labels.transpose(0, 1).reshape(-1).clone()  # [s, b] order, as the hidden states; its own storage
    if not sequence_parallel:
        hidden = copy_to_tp(hidden, tp_group)
    loss = _ChunkedVocabParallelCrossEntropy.apply(hidden, weight, target, tp_group, vocab_size, chunk_tokens,
                                                   sequence_parallel, softcap)
    return loss.view(labels.shape[1], labels.shape[0]).transpose(0, 1)


class OutputLayer(ColumnParallelLinear):
    """The last stage's vocabulary projection (Megatron's output_layer: the same parameter and state_dict). Called
    with `labels` it returns the per-token loss of chunked_vocab_parallel_cross_entropy instead of logits: a module
    call like the plain projection, so that forward pre-hooks that wait for this layer's weight (the distributed
    optimizer's overlapped parameter gather) run before the weight is read."""

    def __init__(self, in_features, padded_vocab, *, vocab_size: int, **kwargs):
        super().__init__(in_features, padded_vocab, **kwargs)
        self.vocab_size = vocab_size

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                chunk_tokens: int = DEFAULT_CHUNK_TOKENS, softcap: float | None = None) -> torch.Tensor:
        if labels is None:
            return super().forward(x, weight)
        if self.bias is not None or self.gather_output:
            raise ValueError("the chunked loss takes an output layer without bias or gathered output")
        return chunked_vocab_parallel_cross_entropy(
            x, self.weight if weight is None else weight, labels, self.tp_group, self.vocab_size, chunk_tokens,
            self.sequence_parallel, softcap,
        )
