"""Activation bytes of multi-token prediction (models/mtp.py) on the last stage, per micro-batch, as its operations
save them (measured equal: tests/profile/test_profile_mtp.py). With T tokens of a micro-batch on this rank, T_sp its
sequence-parallel share, e the compute dtype's bytes, h the hidden size, for each depth:

  embedding         the shifted token ids, int64 8·T, and with TP the out-of-range mask T (as the embedding's own)
  norms             enorm, hnorm and final_layernorm, each its input and the fp32 1/rms (norm kind's saved bytes)
  eh_proj           its input, the joined normed embedding and hidden state, e·2h·T_sp
  transformer layer as a decoder layer of the decoder's last layer's kind (activations.layer_terms), recomputed as
                    the recipe's selective modules say; recompute "op" leaves it whole (no per-op policy around it)
  recompute full    the depth is one checkpoint: only its inputs, the hidden state and the embedding, 2·e·h·T_sp
  loss              the engine's loss head again (activations.head_terms less the final norm), the depths' outputs
                    and the main one joined into one (1 + depths)·e·h·T_sp tensor the heads read (its depths' share
                    counted here when the loss keeps its input), and the 4-byte token count each depth divides by
"""

from __future__ import annotations

from qlm_core.models.norms import norm_kind
from qlm_core.profile.activations import ActivationInputs, head_terms, layer_bytes, loss_keeps_input


def mtp_layer_bytes(x: ActivationInputs, recompute: str) -> float:
    """The multi-token prediction layers' bytes, every depth (the `mtp` region and their embeddings')."""
    spec = x.spec
    e, T, Tsp, h = x.dtype_bytes, x.tokens, x.sp_tokens, spec.hidden_size
    embedding = 8 * T + (T if x.tp > 1 else 0)
    if recompute == "full":
        per_depth = 2 * e * h * Tsp
    else:
        norms = 3 * norm_kind(spec).saved_bytes(e, h, x.device) * Tsp
        mode = "none" if recompute == "op" else recompute
        per_depth = norms + e * 2 * h * Tsp + layer_bytes(x, mode, spec.is_moe_layer(spec.num_layers))
    return spec.mtp_num_layers * (embedding + per_depth)


def mtp_head_bytes(x: ActivationInputs) -> float:
    """What the depths' loss heads keep (the `head` region beside the main head's)."""
    e, h = x.dtype_bytes, x.spec.hidden_size
    terms = head_terms(x)
    loss = sum(terms.values()) - terms["final rmsnorm"] - terms.get("output layer input", 0.0) \
        - terms.get("loss input", 0.0)
    joined = e * h * x.sp_tokens if loss_keeps_input(x) else 0.0
    return x.spec.mtp_num_layers * (loss + joined + 4)
