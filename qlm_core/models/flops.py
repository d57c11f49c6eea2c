"""Model FLOPs of a training step (for TFLOP/s and MFU)."""

from __future__ import annotations

from qlm_core.models.activations import activation_kind
from qlm_core.models.attention_kinds import attention_kind
from qlm_core.models.spec import ModelSpec


def attended_keys_per_token(seq_length: int, mean_doc_len: int = 0, window: int | None = None) -> float:
    """Mean number of keys a token's causal attention reads: documents packed into the sequence (0: one document
    per sequence), each key at most `window` back. A document of m tokens costs m^2/2 score pairs, m*w - w^2/2 with
    a window w < m; attention confined to documents is sum(L^2)/2, not s^2/2. `mean_doc_len` is the token-weighted
    mean document length E[L^2]/E[L] (a token's document, not a document, on average), which makes sum(L^2)/2
    over sum(L) tokens exactly mean_doc_len/2 keys per token without a window (with one, an approximation)."""
    m = min(mean_doc_len or seq_length, seq_length)
    if window is None or window >= m:
        return m / 2
    return window - window * window / (2 * m)


def layer_flops_per_token(spec: ModelSpec, seq_length: int, mean_doc_len: int = 0,
                          keys: float | None = None, layer: int = 0) -> tuple[float, float]:
    """Forward FLOPs per token of dense layer `layer`: (dense matmuls, causal attention over the keys each token
    reads within the layer's window; `keys`: that many instead, as a decoding step's token reads every cached key
    its window reaches)."""
    window = spec.layer_window(layer)
    if keys is None:
        keys = attended_keys_per_token(seq_length, mean_doc_len, window)
    elif window is not None:
        keys = min(keys, window)
    projections, attention = attention_kind(spec).flops_per_token(spec, keys)
    return projections + dense_mlp_flops_per_token(spec), attention


def mean_attention_flops_per_token(spec: ModelSpec, seq_length: int, mean_doc_len: int = 0) -> float:
    """The attention part of layer_flops_per_token, averaged over the layers (their windows differ)."""
    windows = spec.windows
    return sum(layer_flops_per_token(spec, seq_length, mean_doc_len, layer=layer)[1]
               for layer in range(len(windows))) / len(windows)


def dense_mlp_flops_per_token(spec: ModelSpec) -> float:
    return 2 * activation_kind(spec).matrices * spec.hidden_size * spec.ffn_hidden_size


def moe_mlp_flops_per_token(spec: ModelSpec) -> float:
    """Forward FLOPs per token of an MoE layer's MLP, from its active parameters: the router GEMM [h -> E], top-k
    experts, the shared expert and its gate [h -> 1] (the routing's softmax and sort are not counted)."""
    moe, h = spec.moe, spec.hidden_size
    active = moe.topk * moe.ffn_hidden_size + moe.shared_expert_hidden_size
    matrices = activation_kind(spec).matrices
    return 2 * (h * moe.num_experts + matrices * h * active + (h if moe.shared_expert_gate else 0))


def model_layer_flops_per_token(spec: ModelSpec, seq_length: int, mean_doc_len: int = 0,
                                keys: float | None = None) -> float:
    """Forward FLOPs per token of all layers (matmuls and attention), each MoE layer at its active parameters."""
    moe_mlp = moe_mlp_flops_per_token(spec) - dense_mlp_flops_per_token(spec) if spec.moe is not None else 0.0
    total = 0.0
    for layer in range(spec.num_layers):
        dense, attention = layer_flops_per_token(spec, seq_length, mean_doc_len, keys, layer)
        total += dense + attention + (moe_mlp if spec.is_moe_layer(layer) else 0.0)
    return total


def logits_flops_per_token(spec: ModelSpec) -> float:
    return 2 * spec.hidden_size * spec.head_outputs


def mtp_flops_per_token(spec: ModelSpec, seq_length: int, mean_doc_len: int = 0) -> float:
    """Forward FLOPs per token of the multi-token prediction layers: each depth's eh_proj [2h -> h], a layer of the
    decoder's last layer's kind and its own logits."""
    if not spec.mtp_num_layers:
        return 0.0
    dense, attention = layer_flops_per_token(spec, seq_length, mean_doc_len, layer=spec.num_layers)
    if spec.is_moe_layer(spec.num_layers):
        dense += moe_mlp_flops_per_token(spec) - dense_mlp_flops_per_token(spec)
    h = spec.hidden_size
    return spec.mtp_num_layers * (2 * 2 * h * h + dense + attention + logits_flops_per_token(spec))


def flops_per_sequence(spec: ModelSpec, seq_length: int, mean_doc_len: int = 0, mtp: bool = True) -> float:
    """Forward + backward model FLOPs (3x forward, recomputation not counted) of one sequence: the layers, the
    logits and (`mtp`: when they train) the multi-token prediction layers."""
    per_token = (model_layer_flops_per_token(spec, seq_length, mean_doc_len) + logits_flops_per_token(spec)
                 + (mtp_flops_per_token(spec, seq_length, mean_doc_len) if mtp else 0.0))
    return 3.0 * per_token * seq_length


def megatron_flops_per_sequence(spec: ModelSpec, seq_length: int) -> float:
    """Megatron-LM's num_floating_point_operations for one sequence (dense models; what NeMo and Megatron report
    TFLOP/s and MFU with): 12·s·L·h²·((1 + g/a + s/h)·q/h + 1.5·f/h) + 6·s·h·V, with q = a·d. It counts every
    query-key pair (no causal halving), so the same speed reads as more TFLOP/s than qlm's count
    (flops_per_sequence); V is the model's vocabulary (Megatron's padded one differs by well under 1%). MoE (as
    Megatron-LM's num_floating_point_operations with num_experts, moe_router_topk, moe_ffn_hidden_size,
    moe_shared_expert_intermediate_size and moe_layer_freq): an MoE layer's f is k·F + S, its top-k experts and
    shared expert; the router is not counted."""
    h, a, g = spec.hidden_size, spec.num_attention_heads, spec.num_query_groups
    q = a * spec.kv_channels
    attention = (1 + g / a + seq_length / h) * q / h
    half_matrices = activation_kind(spec).matrices / 2  # SwiGLU: three h x f matrices, 1.5
    mlp = half_matrices * spec.ffn_hidden_size / h
    if spec.moe is not None:  # per-layer mean: dense layers' f, MoE layers' top-k experts and shared expert
        moe_layers = spec.moe.num_moe_layers(spec.num_layers)
        routed = spec.moe.topk * spec.moe.ffn_hidden_size + spec.moe.shared_expert_hidden_size
        mlp = half_matrices * ((spec.num_layers - moe_layers) * spec.ffn_hidden_size + moe_layers * routed) / (
            spec.num_layers * h)
    return (12 * seq_length * spec.num_layers * h * h * (attention + mlp)
            + 6 * seq_length * h * spec.head_outputs)
