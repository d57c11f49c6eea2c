"""Activation bytes of an MoE layer's `mlp` (models/moe.py MoELayer), derived from what each of its operations saves
for backward, as activations.py does for the dense layer (whose norms and attention an MoE layer shares).

Per micro-batch, T the rank's tokens, T_r the router's (T/tp under SP, else T), k experts per token, E experts,
R = T·k routed rows (with a capacity factor at most E·capacity), F' = expert FFN / tp, S' = shared FFN / tp:

  router and routing  the MLP input (the pre-MLP norm's output, which F.linear keeps: e·h·T_r, activations.py's
                      "linear_fc1 input"), the int64 top-k choices 8·k·T_r, and the fp32 scores: top-k then
                      softmax keeps the k probabilities 4·k·T_r; pre-softmax the softmax over all experts 4·E·T_r;
                      sigmoid its E scores and the top-k normalisation's top k and sum 4·(E + k + 1)·T_r
  aux / z losses      only while a coefficient is set (their graphs are attached to the output; else freed at the
                      end of the layer's forward): aux's fp32 softmax 4·E·T_r (sigmoid: + its sum 4·T_r) (the
                      expert counts, 4·E, are held by the loss's node, not saved), z-loss's fp32 logits 4·E·T_r
                      and log-sum-exp 4·T_r
  dispatch            the token of each sorted row (int64, kept by the gather `tokens[rows]` and by index_add) 8·R;
                      under TP the all-gathered tokens are not kept (the gather keeps only the row index)
  experts             kernels/grouped_mlp.py keeps the sorted tokens e·h·R and linear_fc1's output e·2F'·R'; its
                      output e·h·R' is kept by the weighted unpermute (models/moe.py _Unpermute), with the
                      sorted probabilities e·R and their order (int64) 8·R. R' is R rounded up to 8 rows where the
                      grouped GEMM runs (its padding rows share the storage). Experts with biases (gpt-oss's) run
                      the per-expert loop instead: it pads nothing and also keeps linear_fc2's input e·F'·R
  shared expert       a dense SwiGLU MLP: linear_fc1's output e·2S'·T, linear_fc2's input e·S'·T; gated, its output
                      e·h·T_r and the sigmoid gate e·T_r (both kept by the multiply)
Selective recompute of `mlp` keeps only the MLP input; full keeps the layer input (activations.py).

Under expert parallelism (parallel/expert_dispatch.py) a rank routes only its own tokens (T_r: its sequence shard
under SP) and holds E/ep experts of F_e = expert FFN / etp. R = T_r·k pairs (capacity: per rank), S = etp·R rows
sent (each pair to every etp rank of its destination), V = α·etp·R rows received, α the busiest EP rank's load over
the mean (ActivationInputs.moe_load: the case's allowance, or a probe's measured load). Saved instead of the
"dispatch" and "experts" terms above:
  routing indices     the pairs' order 8·R (weight[order]), the rows sent (int64, kept by the gather
                      `tokens[sent]` and by the unpermute) 8·S and their positions among the pairs 8·S
  received rows       the expert-major permutation of the received rows and its inverse, 8·V each (kept by the
                      two index_selects); the permuted rows, the grouped kernel's input e·h·V
  experts             linear_fc1's output e·2F_e·V' (V' padded to ROW_PAD where the grouped GEMM runs); the
                      kernel's output is not kept (it is permuted back and sent), the returned rows are: e·h·S, with
                      the sorted probabilities of the rows sent e·S (kept by the weighted unpermute)
The all-to-all buffers keep nothing for backward (its autograd twin keeps only the split sizes).
"""

from __future__ import annotations

import math

import torch

from qlm_core.kernels.grouped_mlp import ROW_PAD, grouped_mm_fits
from qlm_core.models.activations import activation_kind

DTYPE_OF_BYTES = {2: torch.bfloat16, 4: torch.float32}


def routed_rows(x) -> int:
    """R: the (token, expert) pairs this rank's experts run (all TP ranks run every expert on all T tokens), or
    under expert parallelism the pairs of this rank's own tokens, which it dispatches."""
    moe, T = x.spec.moe, (x.sp_tokens if x.dispatches else x.tokens)
    rows = int(T * moe.topk)
    if x.moe_capacity_factor is not None:  # each expert takes at most ceil(T·k/E·cf): a bound, not the drops
        rows = min(rows, moe.num_experts * math.ceil(rows / moe.num_experts * x.moe_capacity_factor))
    return rows


def sent_rows(x) -> int:
    """S: rows a rank sends under expert parallelism (every pair once per etp rank of its destination)."""
    return x.expert_tp * routed_rows(x)


def received_rows(x) -> int:
    """V: rows the busiest rank receives under expert parallelism, α·S (S on average: every rank sends S)."""
    return math.ceil(x.moe_load * sent_rows(x) - 1e-6)


def expert_ffn(x) -> float:
    """An expert's FFN on one rank: split over etp under expert parallelism, else over tp."""
    return x.spec.moe.ffn_hidden_size / (x.expert_tp if x.dispatches else x.tp)


def runs_grouped_kernel(x) -> bool:
    """Whether the routed experts run the grouped kernel (else the per-expert loop: experts with biases, gpt-oss's,
    or an activation without a grouped kernel)."""
    return activation_kind(x.spec).runs_grouped_kernel(x.spec.linear_bias)


def padded_rows(x, rows: int) -> int:
    """Rows of the grouped kernel's fc1 output and output storage (it pads to ROW_PAD where it runs)."""
    h, ffn = x.spec.hidden_size, int(expert_ffn(x))
    dtype = DTYPE_OF_BYTES.get(x.dtype_bytes, torch.bfloat16)
    return -(-rows // ROW_PAD) * ROW_PAD if runs_grouped_kernel(x) and grouped_mm_fits(dtype, h, ffn) else rows


def looped_terms(x, rows: int) -> dict[str, float]:
    """The per-expert loop's linear_fc2 input (the activation's output), which the grouped kernel recomputes."""
    if runs_grouped_kernel(x) or activation_kind(x.spec).saves_output:  # ReLU's output is fc2's input, counted
        return {}
    return {"expert fc2 input (per-expert loop)": x.dtype_bytes * expert_ffn(x) * rows}


def router_terms(x) -> dict[str, float]:
    moe, Tr = x.spec.moe, x.sp_tokens
    E, k = moe.num_experts, moe.topk
    if moe.score_function == "sigmoid":
        scores = 4 * E * Tr + (4 * (k + 1) * Tr if k > 1 else 0.0)
    elif moe.pre_softmax:
        scores = 4 * E * Tr
    elif moe.expert_bias:  # ERNIE's: the softmax over all, the chosen probabilities and their clamped sum (twice)
        scores = 4 * E * Tr + 4 * (k + 2) * Tr
    else:
        scores = 4 * k * Tr
    terms = {"router scores (fp32)": scores, "router choices (int64)": 8 * k * Tr}
    if x.moe_losses:
        aux = 4 * E * Tr + (4 * Tr if moe.score_function == "sigmoid" else 0.0)
        # the expert counts (4·E) are held by the aux loss's node (models/moe.py _WeightedSum), not saved: left out
        terms["aux / z-loss graphs (fp32)"] = aux + 4 * E * Tr + 4 * Tr
    return terms


def dispatch_terms(x) -> dict[str, float]:
    """The expert-parallel dispatch's and experts' saved bytes (module docstring)."""
    e, h = x.dtype_bytes, x.spec.hidden_size
    R, S, V = routed_rows(x), sent_rows(x), received_rows(x)
    return {
        "routing indices (int64)": 8 * R + 16 * S,
        "received-row permutations (int64)": 16 * V,
        "received rows (expert fc1 input)": e * h * V,
        "expert fc1 output": e * activation_kind(x.spec).fc1_rows(expert_ffn(x)) * padded_rows(x, V),
        "returned rows and probabilities (weighted unpermute)": e * h * S + e * S,
        **looped_terms(x, V),
    }


def expert_terms(x) -> dict[str, float]:
    if x.dispatches:
        return dispatch_terms(x)
    e, h = x.dtype_bytes, x.spec.hidden_size
    R = routed_rows(x)
    padded = padded_rows(x, R)
    ffn = x.spec.moe.ffn_hidden_size / x.tp
    return {
        "token rows (int64)": 8 * R,
        "sorted tokens (expert fc1 input)": e * h * R,
        "expert fc1 output": e * activation_kind(x.spec).fc1_rows(ffn) * padded,
        "expert output (weighted unpermute)": e * h * padded,
        "sorted probabilities and order": e * R + 8 * R,
        **looped_terms(x, R),
    }


def shared_expert_terms(x) -> dict[str, float]:
    moe = x.spec.moe
    if not moe.shared_expert_hidden_size:
        return {}
    e, T, Tr = x.dtype_bytes, x.tokens, x.sp_tokens
    s = moe.shared_expert_hidden_size / x.tp
    terms = {"shared expert fc1 output": e * activation_kind(x.spec).fc1_rows(s) * T,
             "shared expert fc2 input": e * s * T}
    if moe.shared_expert_gate:
        terms["shared expert output and gate"] = e * x.spec.hidden_size * Tr + e * Tr
    return terms


def moe_mlp_terms(x, recompute: str) -> dict[str, float]:
    """What the MoE layer's `mlp` saves besides its input (0 when selective recompute covers `mlp`)."""
    if x.recomputes(recompute, "mlp"):
        return {}
    return {**router_terms(x), **expert_terms(x), **shared_expert_terms(x)}


def moe_backward_transient(x) -> float:
    """Bytes that exist only while one MoE layer's backward runs (not measured; the larger terms): the grouped
    kernel stacks every expert's weights (torch.stack copies them, e·3F'·h·E) and returns their gradients in the
    compute dtype (as many again) beside the rows' gradients: fc1 output's e·2F'·R', SwiGLU's e·F'·R' and the
    input's e·h·R'. Under expert parallelism the rank's E/ep experts of F_e over its V received rows, and the
    gradients of the S returned rows and of the V rows sent back by the reverse all-to-all, e·h·(S + V). The
    per-expert loop (experts with biases) stacks nothing: one expert's weight gradients at a time, e·3F'·h, and the
    rows' gradients unpadded."""
    moe, e, h = x.spec.moe, x.dtype_bytes, x.spec.hidden_size
    ffn = expert_ffn(x)
    if x.dispatches:
        rows, experts = received_rows(x), moe.num_experts // x.ep
        exchanged = e * h * (sent_rows(x) + rows)
    else:
        rows, experts, exchanged = routed_rows(x), moe.num_experts, 0.0
    activation = activation_kind(x.spec)
    one_expert = e * activation.matrices * ffn * h
    weights = 2 * one_expert * experts if runs_grouped_kernel(x) else one_expert  # stacked + grads, or one's grads
    return weights + e * (activation.fc1_rows(ffn) + ffn + h) * padded_rows(x, rows) + exchanged
