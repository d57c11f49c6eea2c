"""Parameter counts of a ModelSpec (HF's count: the embedding once when tied), from the same choices the model is
built from: the attention kind's own tensors (its layout entries), the norm's tensors and the MLP activation's
matrices."""

from __future__ import annotations

import math

from qlm_core.models.activations import activation_kind
from qlm_core.models.attention_kinds import attention_kind
from qlm_core.models.families import FAMILIES
from qlm_core.models.norms import norm_kind
from qlm_core.models.spec import ModelSpec


def attention_parameters(spec: ModelSpec, layer: int) -> int:
    """Every tensor the attention kind stores for `layer` (its projections, biases and per-head norms)."""
    return sum(math.prod(tensor.shape) for _, tensor in attention_kind(spec).layer_entries(spec, layer)
               if tensor is not None)


def layer_parameters(spec: ModelSpec, layer: int, active: bool = False) -> int:
    """One decoder layer's parameters; `active`: an MoE layer's routed experts counted top-k times."""
    h = spec.hidden_size
    matrices = activation_kind(spec).matrices
    norms = (4 if spec.post_norms else 2) * len(norm_kind(spec).tensors) * h  # GLM-4: a norm after each block too
    attention = attention_parameters(spec, layer)
    if not spec.is_moe_layer(layer):
        biases = activation_kind(spec).fc1_rows(spec.ffn_hidden_size) + h if spec.linear_bias else 0  # fc1, fc2
        return attention + matrices * h * spec.ffn_hidden_size + biases + norms
    moe = spec.moe
    experts = moe.topk if active else moe.num_experts
    mlp = moe.num_experts * h + experts * matrices * h * moe.ffn_hidden_size  # router + experts
    mlp += matrices * h * moe.shared_expert_hidden_size + (h if moe.shared_expert_gate else 0)
    if spec.linear_bias:  # the router's bias and each routed expert's fc1 and fc2 biases (gpt-oss)
        mlp += moe.num_experts + experts * (activation_kind(spec).fc1_rows(moe.ffn_hidden_size) + h)
    return attention + mlp + norms


def position_parameters(spec: ModelSpec) -> int:
    """Learned absolute positions' table (OPT's with its rows before position 0); RoPE has none."""
    if spec.position != "learned_absolute":
        return 0
    return (spec.max_position_embeddings + FAMILIES[spec.model_type].position_offset) * spec.hidden_size


def num_parameters(spec: ModelSpec, active: bool = False) -> int:
    """Every parameter (HF's count: the embedding once when tied); `active`: those one token computes with, the
    routed experts counted top-k times instead of num_experts."""
    head = 0 if spec.tie_word_embeddings else spec.head_outputs * spec.hidden_size  # a score head: one row
    embed = spec.vocab_size * spec.hidden_size + head + position_parameters(spec)
    final_norm = (2 if spec.embedding_norm else 1) * len(norm_kind(spec).tensors) * spec.hidden_size  # BLOOM's too
    return sum(layer_parameters(spec, i, active) for i in range(spec.num_layers)) + embed + final_norm


def mtp_parameters(spec: ModelSpec, active: bool = False) -> int:
    """The multi-token prediction layers' own parameters (left out of num_parameters, as the model cards count):
    each depth's enorm, hnorm and final norm, eh_proj [h, 2h] and a layer of the decoder's last layer's kind (the
    embedding and output layer are shared; DeepSeek-V3's release also stores copies of them)."""
    h = spec.hidden_size
    per_depth = 3 * len(norm_kind(spec).tensors) * h + 2 * h * h + layer_parameters(spec, spec.num_layers, active)
    return spec.mtp_num_layers * per_depth
