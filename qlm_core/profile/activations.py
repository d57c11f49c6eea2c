"""Activation bytes of qlm's decoder (models/gpt.py), derived from what each of its operations saves for backward.

Korthikanti et al. (2022) count sbh(34 + 5as/h) for a GPT layer with LayerNorm, GELU, dropout and materialised
attention scores. qlm's layer is different in every part, so the count below is re-derived for it: RMSNorm computed
in fp32, grouped-query attention with RoPE, SwiGLU, a flash / SDPA kernel that keeps no s x s tensor, no dropout.
Per layer and micro-batch, with T = mbs·seq/cp tokens on this rank, T_sp = T/tp under sequence parallelism (else T),
e = bytes of the compute dtype, hq/hk/d/f = heads, query groups, head dim, FFN size, all per TP rank (/tp):

  each RMSNorm (2)  its input e·h·T_sp and the fp32 1/rms 4·T_sp (kernels/norm.RMSNormFunction recomputes the
                    rest), and its output, which the next linear saves, e·h·T_sp (SP: ColumnParallelLinear keeps the
                    sequence shard, parallel/tensor.py)
  attention         q after RoPE e·hq·d·T, k after RoPE e·hk·d·T, and v, a view that keeps the whole linear_qkv output
                    alive: e·(hq+2hk)·d·T (with fewer query groups than TP ranks the gathered output, (hq+2hk)·d
                    unsplit); the kernel's output e·hq·d·T and log-sum-exp 4·hq·T (fp32)
  linear_proj input the kernel's output seen as [s, b, hq·d]: the same storage on CPU (torch's CPU flash kernel lays
                    its output out like q) and under CP's ring and all-gather kernels (they write it laid out like
                    q, kernels/piecewise.like_q), a copy on CUDA when mbs > 1 and under CP's all-to-all: + e·hq·d·T
  SwiGLU            linear_fc1 output e·2f·T (kernels/swiglu.SwiGLUFunction recomputes silu), and silu(gate)·up
                    (the linear_fc2 input) e·f·T
  q/k norm          (Qwen3) each keeps its input and fp32 1/rms 4·(hq+hk)·T; k's input is a view of linear_qkv's
                    output, q's too unless the rank's heads span several groups of several heads, when it is a copy
                    e·hq·d·T (qk_norm_terms)
  MoE layer         instead of SwiGLU: the router, the experts' sorted rows and the shared expert
                    (profile/moe_activations.py); the MLP input is the "linear_fc1 input" term
  recompute         selective, by Megatron's recompute_modules: core_attn, the checkpoint keeps q, k, v (already
                    counted) and the attention kernel's output and log-sum-exp are not saved; the projection still
                    keeps its input. mlp: the checkpoint keeps its input (the pre-MLP norm's output), none of the
                    SwiGLU terms nor linear_fc2's input. layernorm: each norm keeps only its input e·h·T_sp and its
                    output, which the next linear saved, is discarded until that block's backward
                    (models/gpt.discard_output), so neither norm terms nor linear_qkv / linear_fc1 inputs remain.
                    full: only the layer input, e·h·T_sp, per recomputed layer (`recompute_num_layers`: the first N
                    layers of each chunk). op (torchtitan's per-op policy): the layer input, the outputs of the
                    first and third matmul (linear_qkv e·(hq+2hk)·d·T, linear_fc1 e·2f·T) and the attention
                    kernel's output and log-sum-exp; with LoRA the adapters' matmuls shift which are kept and CP's
                    ring kernels keep one partial output per step (neither modelled). An MoE layer: the
                    router's logits (its 3rd matmul) and, with a shared expert, that expert's linear_fc2 output.
  CP a2a (Ulysses)  the kernel saves the all-to-all outputs instead of the local q/k/v (same bytes per token; k/v
                    heads are repeated up to cp when fewer), so neither the RoPE outputs nor linear_qkv's are kept.
  LoRA              a frozen linear keeps its input only when
                    an adapter reads it (or under SP, where the gather function always keeps the shard), and each
                    adapter adds its rank-r activation e·r·T (column-parallel, or row-parallel without SP) or
                    e·r·T_sp. Adapter dropout is taken as 0.

Per forward of a stage chunk (shared by its layers): RoPE cos and sin, 2·e·d·T; the embedding keeps the token ids
(8·T) and, with TP, its out-of-range mask (T). The loss region on the last stage (GPTModel.loss), with V/tp the
padded vocabulary per TP rank:
  whole logits      (T <= loss_chunk_tokens, or 0: cross_entropy.loss_is_chunked) the final norm as above, the
                    output layer's input, and the vocab-parallel cross entropy's fp32 softmax 4·(V/tp)·T plus
                    int64 targets and two masks (10·T);
                    while the loss runs the compute-dtype logits e·(V/tp)·T exist beside it (a transient, bf16 only)
  chunked           (T > loss_chunk_tokens = c) the final norm, the loss's input x e·h·T_sp (kept even with a frozen
                    output layer: backward recomputes the logits from it), the fp32 log-sum-exp 4·T and int64
                    targets 8·T (the per-token loss is returned, not saved); transient: one chunk's logits
                    (e + 4)·(V/tp)·c (4·(V/tp)·c in fp32), in backward dW accumulated in the weight's dtype
                    e·(V/tp)·h (with a trainable output layer; no fp32 copy), the full-sequence input gradient e·h·T
                    and under SP the re-gathered input e·h·T
Residual adds, RoPE's rotate-half and the TP/SP collectives save nothing. Packed documents and sliding windows
change none of this: their attention runs piece by piece (kernels/piecewise.py) and saves exactly what the fused
kernel saves (q, k, v, the output laid out like q, the fp32 log-sum-exp), and the documents are described by Python
ranges, not tensors (measured equal to the unpacked bytes: tests/profile/test_profile_packed.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from qlm_core.models.activations import activation_kind
from qlm_core.models.norms import norm_kind
from qlm_core.models.spec import ModelSpec
from qlm_core.parallel.cross_entropy import DEFAULT_CHUNK_TOKENS, loss_is_chunked
from qlm_core.profile.attention_terms import attention_terms
from qlm_core.profile.moe_activations import moe_backward_transient, moe_mlp_terms

COLUMN_PARALLEL = ("linear_qkv", "linear_fc1")


@dataclass(frozen=True)
class ActivationInputs:
    spec: ModelSpec
    seq_len: int
    micro_batch_size: int = 1
    tp: int = 1
    sp: bool = False
    cp: int = 1
    cp_comm_type: str = "p2p"
    dtype_bytes: int = 2
    padded_vocab: int = 0  # 0: the spec's vocabulary
    device: str = "cuda"  # where the attention kernel runs: decides whether linear_proj's input is a copy
    lora_rank: int = 0
    lora_targets: tuple[str, ...] = field(default=("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"))
    loss_chunk_tokens: int = DEFAULT_CHUNK_TOKENS  # 0: the loss takes the whole logits
    recompute_modules: tuple[str, ...] = ("core_attn",)  # what recompute = "selective" covers
    rotary: bool = True  # RoPE: q and k are rotated copies; without it they stay views of linear_qkv's output
    moe_losses: bool = False  # an MoE aux or z-loss coefficient is set: the losses' graphs stay until backward
    moe_capacity_factor: float | None = None  # None: drop-less routing
    ep: int = 1  # expert parallelism (moe_activations.py): the experts divided over ep ranks
    etp: int = 0  # their expert-TP size; 0: tp
    moe_load: float = 1.0  # under EP: the rows the busiest EP rank receives over the mean (case.load_factor)

    def __post_init__(self):
        if self.spec.position != "rope":  # learned positions (OPT): nothing rotates q and k
            object.__setattr__(self, "rotary", False)

    @property
    def expert_tp(self) -> int:
        return self.etp or self.tp

    @property
    def dispatches(self) -> bool:
        """Whether the routed experts get their rows by all-to-all (expert parallelism) instead of all-gather."""
        return self.spec.moe is not None and (self.ep > 1 or self.expert_tp != self.tp)

    def recomputes(self, recompute: str, module: str) -> bool:
        return recompute == "selective" and module in self.recompute_modules

    @property
    def tokens(self) -> int:
        """T: tokens of one micro-batch on this rank (before the SP split)."""
        return self.micro_batch_size * self.seq_len // self.cp

    @property
    def sp_tokens(self) -> float:
        return self.tokens / self.tp if self.sp and self.tp > 1 else self.tokens

    @property
    def chunked_loss(self) -> bool:
        """Whether GPTModel.loss runs chunk by chunk (it does when the rank's tokens exceed the chunk; a score head
        never does)."""
        return self.spec.head == "lm" and loss_is_chunked(self.loss_chunk_tokens, self.tokens)

    @property
    def frozen(self) -> bool:
        return self.lora_rank > 0

    def adapted(self, linear: str) -> bool:
        return self.lora_rank > 0 and linear in self.lora_targets

    def keeps_input(self, linear: str) -> bool:
        """Whether the linear's input is saved: it trains, an adapter reads it, or SP's gather function keeps it."""
        column_sp = linear in COLUMN_PARALLEL and self.sp and self.tp > 1
        return not self.frozen or self.adapted(linear) or column_sp


def _is_moe(x: ActivationInputs, moe_layer: bool | None) -> bool:
    """Whether the layer's `mlp` is an MoE layer (None: the model's kind, MoE when it has experts)."""
    return x.spec.moe is not None if moe_layer is None else moe_layer


def _ordinal(n: int) -> str:
    suffix = {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th") if n % 100 not in (11, 12, 13) else "th"
    return f"{n}{suffix}"


def _op_terms(x: ActivationInputs, moe: bool) -> dict[str, float]:
    """recompute = "op": the layer input, the attention's kept outputs and, of the MLP's matmuls, the odd-numbered
    ones of the layer (the policy keeps every other aten.mm, the first, third, ...)."""
    e, T, Tsp, h = x.dtype_bytes, x.tokens, x.sp_tokens, x.spec.hidden_size
    attention = attention_terms(x)
    terms = {"layer input (checkpoint)": e * h * Tsp, **attention.op(x)}
    first = attention.matmuls(x.spec) + 1  # the MLP's first aten.mm in the layer

    def kept(n: int) -> bool:
        return n % 2 == 1

    if not moe:
        if kept(first):
            fc1_rows = activation_kind(x.spec).fc1_rows(x.spec.ffn_hidden_size) / x.tp
            terms[f"linear_fc1 output ({_ordinal(first)} matmul)"] = e * fc1_rows * T
        if kept(first + 1):
            terms[f"linear_fc2 output ({_ordinal(first + 1)} matmul)"] = e * h * T
        return terms
    # MoE: the router, then the shared expert's linear_fc1 and linear_fc2 (the grouped expert GEMMs are no aten.mm)
    if kept(first):
        terms[f"router logits ({_ordinal(first)} matmul)"] = e * x.spec.moe.num_experts * Tsp
    if x.spec.moe.shared_expert_hidden_size:
        if kept(first + 1):
            rows = activation_kind(x.spec).fc1_rows(x.spec.moe.shared_expert_hidden_size) / x.tp
            terms[f"shared expert fc1 output ({_ordinal(first + 1)} matmul)"] = e * rows * T
        if kept(first + 2):
            terms[f"shared expert fc2 output ({_ordinal(first + 2)} matmul)"] = e * h * T
    return terms


def layer_terms(x: ActivationInputs, recompute: str = "none", moe_layer: bool | None = None) -> dict[str, float]:
    """Saved bytes of one transformer layer for one micro-batch, by what keeps them (see the module docstring).
    `moe_layer`: whether its MLP is an MoE layer (profile/moe_activations.py); None: the model's kind."""
    e, T, Tsp, h = x.dtype_bytes, x.tokens, x.sp_tokens, x.spec.hidden_size
    if recompute == "full":
        return {"layer input (checkpoint)": e * h * Tsp}
    moe = _is_moe(x, moe_layer)
    f = x.spec.ffn_hidden_size / x.tp
    if recompute == "op":
        return _op_terms(x, moe)
    norms_discarded = x.recomputes(recompute, "layernorm")
    if norms_discarded:  # each norm keeps its input; the linear inputs are discarded
        terms = {"rmsnorm inputs x2 (checkpoint)": 2 * e * h * Tsp, "linear_fc1 input": 0.0}
    else:
        norm = norm_kind(x.spec).saved_bytes(e, h, x.device) * Tsp
        terms = {"rmsnorm x2": 2 * norm, "linear_fc1 input": e * h * Tsp if x.keeps_input("linear_fc1") else 0.0}
    if x.spec.post_norms:  # GLM-4's norms after attention and MLP: outside every checkpoint but "full"'s
        terms["rmsnorm after attention and MLP x2"] = 2 * norm_kind(x.spec).saved_bytes(e, h, x.device) * Tsp
    terms.update(attention_terms(x).saved(x, recompute, norms_discarded))
    mlp = x.recomputes(recompute, "mlp")  # the checkpoint keeps only its input, the pre-MLP norm's output
    if moe:  # its input is "linear_fc1 input" (the router keeps it); LoRA on its shared expert is not modelled
        terms.update(moe_mlp_terms(x, recompute))
    else:
        activation = activation_kind(x.spec)
        if activation.saves_output:  # ReLU keeps its output, which is linear_fc2's input itself
            terms["relu output (linear_fc2 input)"] = 0.0 if mlp else e * f * T
        else:
            terms["swiglu (fc1 output)"] = 0.0 if mlp else e * activation.fc1_rows(x.spec.ffn_hidden_size) / x.tp * T
            terms["linear_fc2 input"] = e * f * T if x.keeps_input("linear_fc2") and not mlp else 0.0
    if x.lora_rank:
        for linear in x.lora_targets:
            if (mlp or moe) and linear in ("linear_fc1", "linear_fc2"):
                continue
            column = linear in COLUMN_PARALLEL
            terms[f"lora {linear}"] = e * x.lora_rank * (T if column or not (x.sp and x.tp > 1) else Tsp)
    return terms


def layer_bytes(x: ActivationInputs, recompute: str = "none", moe_layer: bool | None = None) -> float:
    return sum(layer_terms(x, recompute, moe_layer).values())


def forward_terms(x: ActivationInputs, embedding: bool) -> dict[str, float]:
    """Saved once per forward of a stage chunk, not per layer."""
    T = x.tokens
    terms = attention_terms(x).per_forward(x)
    if x.cp > 1:
        terms["cp token index"] = 8 * x.seq_len / x.cp
    if embedding and not x.frozen:
        terms["embedding ids"] = 8 * T + (T if x.tp > 1 else 0)
        if x.spec.position == "learned_absolute":  # the offset positions the table looks up (SP: the rank's)
            terms["position ids"] = 8 * x.sp_tokens
        if x.spec.embedding_norm:  # BLOOM's norm of the word embedding keeps its input (SP: the rank's tokens)
            terms["embedding norm"] = norm_kind(x.spec).saved_bytes(x.dtype_bytes, x.spec.hidden_size,
                                                                     x.device) * x.sp_tokens
    return terms


def vocab_per_rank(x: ActivationInputs) -> float:
    """The head's outputs per token on this rank: the padded vocabulary's TP share (a score head: its one score)."""
    if x.spec.head == "score":
        return 1.0
    return (x.padded_vocab or x.spec.vocab_size) / x.tp


def loss_keeps_input(x: ActivationInputs) -> bool:
    """Whether the loss head saves its input (the final norm's output): the chunked loss always does; the whole-logits
    path when the output layer trains or SP's gather function keeps the shard."""
    return x.chunked_loss or not x.frozen or (x.sp and x.tp > 1)


def head_terms(x: ActivationInputs) -> dict[str, float]:
    """The last stage's final norm, output layer and loss, for one micro-batch."""
    e, T, Tsp, h = x.dtype_bytes, x.tokens, x.sp_tokens, x.spec.hidden_size
    terms = {"final rmsnorm": norm_kind(x.spec).saved_bytes(e, h, x.device) * Tsp}
    if x.chunked_loss:
        terms.update({"loss input": e * h * Tsp, "log-sum-exp (fp32)": 4 * T, "targets": 8 * T})
        return terms
    terms.update({
        "output layer input": e * h * Tsp if loss_keeps_input(x) else 0.0,
        "softmax (fp32)": 4 * vocab_per_rank(x) * T,
        "targets and masks": 8 * T + 2 * T,
    })
    if x.spec.logit_softcap is not None and x.spec.head == "lm":  # Gemma 2: the soft-cap's tanh keeps its (fp32) output
        terms["soft-capped logits (tanh output, fp32)"] = 4 * vocab_per_rank(x) * T
    return terms


def logits_transient(x: ActivationInputs) -> float:
    """What exists only while the loss runs. Whole logits: the compute-dtype logits beside the fp32 softmax (and
    their gradient in backward). Chunked: the larger of forward's and backward's transients (module docstring)."""
    e, V = x.dtype_bytes, vocab_per_rank(x)
    if not x.chunked_loss:
        return 0.0 if e == 4 else e * V * x.tokens
    chunk_logits = (4 if e == 4 else e + 4) * V * x.loss_chunk_tokens
    if x.spec.logit_softcap is not None:  # Gemma 2: backward keeps the chunk's tanh beside its logits (fp32)
        chunk_logits += 4 * V * x.loss_chunk_tokens
    h, T = x.spec.hidden_size, x.tokens
    gathered = e * h * T if x.sp and x.tp > 1 else 0.0
    weight_gradient = 0.0 if x.frozen else e * V * h  # dW, accumulated in the weight's dtype (addmm_)
    return chunk_logits + gathered + e * h * T + weight_gradient


def cp_buffers(x: ActivationInputs) -> float:
    """K/V (and dK/dV) that the CP kernel holds while one layer's attention backward runs (a transient)."""
    return attention_terms(x).cp_buffers(x)


def layer_workspace(x: ActivationInputs, recompute: str, moe_layer: bool | None = None) -> float:
    """Transient bytes while one layer's backward runs: the recomputed activations (full: the whole layer;
    selective: the attention kernel's output and log-sum-exp), the CP buffers, SP's all-gathered linear input, and
    the layer's largest gradients (the fc1 output's and two hidden-size ones; an MoE layer's: moe_activations)."""
    e, T = x.dtype_bytes, x.tokens
    f, h = x.spec.ffn_hidden_size / x.tp, x.spec.hidden_size
    fc1_rows = activation_kind(x.spec).fc1_rows(x.spec.ffn_hidden_size) / x.tp
    moe = _is_moe(x, moe_layer)
    recomputed = 0.0
    if recompute in ("full", "op"):  # op: all but what the policy saved, while the layer's backward runs
        recomputed = layer_bytes(x, "none", moe) - (layer_bytes(x, "op", moe) if recompute == "op" else 0.0)
    if x.recomputes(recompute, "core_attn"):
        recomputed += attention_terms(x).recomputed_core(x)
    if moe:
        if x.recomputes(recompute, "mlp"):
            recomputed += sum(moe_mlp_terms(x, "none").values())
        gathered = e * h * T if x.sp and x.tp > 1 and not x.dispatches else 0.0
        return recomputed + cp_buffers(x) + gathered + moe_backward_transient(x) + 2 * e * h * x.sp_tokens
    if x.recomputes(recompute, "mlp"):
        recomputed += e * (fc1_rows + f) * T  # fc1 output and the activation's output
    if x.recomputes(recompute, "layernorm"):
        recomputed += x.dtype_bytes * h * x.sp_tokens + 4 * h * x.sp_tokens  # one norm's output and fp32 input
    gathered = e * h * T if x.sp and x.tp > 1 else 0.0  # SP: a linear's all-gathered input
    return recomputed + cp_buffers(x) + gathered + e * fc1_rows * T + 2 * e * h * x.sp_tokens
