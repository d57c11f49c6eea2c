"""Step-time terms of an MoE layer (models/moe.py MoELayer) for timing.py, per token of the rank's T and forward.

  GEMMs        the router [h -> E] (and the shared expert's gate [h -> 1]) on the router's tokens (T/tp under SP);
               every expert's TP shard over its share of the T·k routed rows, fc1 [h -> 2F/tp] and fc2
               [F/tp -> h], each at the fitted efficiency of its own weight shape (as the dense GEMMs: the fit
               knows weight dimensions only; one grouped GEMM runs them all), but never faster than reading the
               rank's expert weights from HBM once per pass (a roofline floor: with few rows per expert, T·k/E,
               a grouped GEMM is bound by its weights' bytes, not its FLOPs — Qwen3-30B-A3B at 1024 tokens a rank
               reads 128 experts' 400 MB per layer for 26 GFLOP); the shared expert like the dense MLP.
               Keyed as the dense layer's (linear_fc1: the GEMMs before SwiGLU, the router's with them; linear_fc2:
               those after), so the recompute rules apply unchanged.
  elementwise  SwiGLU over the routed rows and the shared expert (k·F/tp + S/tp in the dense layer's units), and
               the permutation at HBM speed: the gather of the sorted rows, the probability multiply and
               index_add, forward and backward, about PERMUTE_PASSES passes over e·h bytes per routed row.
  TP comm      (volume = (tp-1)/tp · e·h·T bytes) SP: all-gather of the tokens and reduce-scatter of the output
               forward, their transposes backward: 4 volumes, 2 more when the layer is recomputed (the expert
               GEMMs keep the gathered rows they need, so there is no re-gather); the probabilities (e) and choices
               (int64) all-gathered forward, the probabilities' gradient reduce-scattered backward. Without SP an
               all-reduce of the output forward and of the tokens' and probabilities' gradients backward. The shared
               expert adds the dense MLP's collectives.
Expert parallelism (parallel/expert_dispatch.py; α = case.load_factor, the busiest EP rank's rows over the mean,
which every rank waits for at the all-to-all): a rank routes its own T_r tokens (T/tp under SP) and runs its E/ep
experts of F/etp over α·etp·T_r·k received rows:
  GEMMs        α·k·(T_r/T)·2h·2F (fc1) and α·k·(T_r/T)·2F·h (fc2) FLOPs per token of T, at the efficiency of the
               [h -> 2F/etp] and [F/etp -> h] weights, with the same floor over the E/ep experts' weights (what
               makes EP faster than every rank running every expert: each rank reads 1/ep of the weights for
               ep times the rows);
  elementwise  SwiGLU over the received rows; the permutation's PERMUTE_PASSES over the etp·T_r·k rows sent and
               RECEIVED_PASSES over the received ones (their expert-major index_select and its inverse, each a read
               and a write, forward and backward);
  TP comm      only attention's and the shared expert's: the routed experts' tokens never cross the TP group;
  EP comm      per layer and micro-batch (ep_layer_bytes): a counts all-to-all (8·E·etp bytes out), the dispatch
               and the combine all-to-alls forward and their transposes backward, each moving α·etp·T_r·k·e·h
               bytes on the busiest rank, again forward when the layer is recomputed; timed by
               topology.all_to_all_seconds (NVLink inside the ep·etp group's domain, the NIC across), exposed.
"""

from __future__ import annotations

from qlm_core.hardware import GpuSpec
from qlm_core.models.activations import activation_kind
from qlm_core.profile.case import ProfileCase
from qlm_core.profile.efficiency import KernelRates

PERMUTE_PASSES = 12  # reads and writes of e·h per routed row: gather, multiply, index_add, and their backward
RECEIVED_PASSES = 8  # EP: two index_selects over each received row (read + write), forward and backward
A2A_PER_FORWARD = 2  # EP: the dispatch and the combine all-to-all of one forward (backward: their transposes)


def _token_share(case: ProfileCase) -> float:
    """T_r / T: the tokens a rank routes over its T (its sequence shard under SP)."""
    p = case.parallel
    return 1 / p.tp if p.sp and p.tp > 1 else 1.0


def expert_rows_per_token(case: ProfileCase) -> float:
    """Routed rows this rank's experts run per token of its T: k (every TP rank runs all of them), or under EP the
    busiest rank's α·etp·k·T_r/T."""
    k = case.spec.moe.topk
    if not case.expert_parallel:
        return k
    return case.load_factor * case.sizes.etp * k * _token_share(case)


def expert_ffn(case: ProfileCase) -> float:
    return case.spec.moe.ffn_hidden_size / (case.sizes.etp if case.expert_parallel else case.parallel.tp)


def local_experts(case: ProfileCase) -> int:
    return case.spec.moe.num_experts // (case.sizes.ep if case.expert_parallel else 1)


def moe_layer_gemm_seconds(case: ProfileCase, rates: KernelRates, peak: float, attention: dict[str, float],
                           hbm_bytes_per_s: float, tokens: float) -> dict[str, float]:
    """Forward seconds per token of an MoE layer's GEMMs on this rank; `attention`: the dense layer's linear_qkv
    and linear_proj figures (timing.gemm_seconds); `tokens`: the rank's T of one micro-batch."""
    s, p = case.spec, case.parallel
    moe, h, tp = s.moe, s.hidden_size, p.tp
    router_share = 1 / tp if p.sp and tp > 1 else 1.0  # the router runs on the rank's sequence shard under SP
    router_n = moe.num_experts + (1 if moe.shared_expert_gate else 0)
    router = router_share * 2 * h * router_n / (peak * rates.gemm(h, router_n))
    ffn, rows = expert_ffn(case), expert_rows_per_token(case)
    weight_read = local_experts(case) * h * ffn * case.dtype_bytes / (hbm_bytes_per_s * tokens)  # per token, F x h
    fc1_rows = activation_kind(case.spec).fc1_rows(ffn)
    fc1 = max(rows * 2 * h * fc1_rows / (peak * rates.gemm(h, fc1_rows)), (fc1_rows / ffn) * weight_read)
    fc2 = max(rows * 2 * ffn * h / (peak * rates.gemm(ffn, h)), weight_read)
    shared = moe.shared_expert_hidden_size / tp
    if shared:
        shared_rows = activation_kind(case.spec).fc1_rows(shared)
        fc1 += 2 * h * shared_rows / (peak * rates.gemm(h, shared_rows))
        fc2 += 2 * shared * h / (peak * rates.gemm(shared, h))
    return {"linear_qkv": attention["linear_qkv"], "linear_proj": attention["linear_proj"],
            "linear_fc1": router + fc1, "linear_fc2": fc2}


def moe_elementwise_seconds(case: ProfileCase, rates: KernelRates, gpu: GpuSpec,
                            dense: dict[str, float]) -> dict[str, float]:
    """Forward + backward seconds per token of an MoE layer's memory-bound work; `dense`: the dense layer's
    (timing.elementwise_seconds), whose norms it shares. "mlp" holds SwiGLU and the permutation."""
    s, p = case.spec, case.parallel
    moe = s.moe
    rate = rates.elementwise * case.dtype_bytes / (gpu.hbm_gbps * 1e9)
    rows = expert_rows_per_token(case)
    swiglu = rate * (rows * expert_ffn(case) + moe.shared_expert_hidden_size / p.tp)
    passes = PERMUTE_PASSES * moe.topk
    if case.expert_parallel:
        passes = PERMUTE_PASSES * case.sizes.etp * moe.topk * _token_share(case) + RECEIVED_PASSES * rows
    permute = passes * case.dtype_bytes * s.hidden_size / (gpu.hbm_gbps * 1e9)
    return {"norms": dense["norms"], "mlp": swiglu + (permute if rates.elementwise else 0.0)}


def moe_mlp_volumes(case: ProfileCase) -> int:
    """TP volumes (see the module docstring) of one forward of the MoE layer's MLP, as timing.py counts a forward
    of the dense MLP's (2: SP's all-gather and reduce-scatter, or one all-reduce of two volumes); under EP the
    shared expert's only."""
    return (0 if case.expert_parallel else 2) + (2 if case.spec.moe.shared_expert_hidden_size else 0)


def moe_layer_tp_bytes(case: ProfileCase, tokens: float, recomputed: bool) -> float:
    """TP bytes per rank of one MoE layer and micro-batch (attention's and the MLP's)."""
    p, s = case.parallel, case.spec
    e, k = case.dtype_bytes, s.moe.topk
    frac = (p.tp - 1) / p.tp
    volume = frac * e * s.hidden_size * tokens
    shared = bool(s.moe.shared_expert_hidden_size)
    if case.expert_parallel:  # SP (validate_experts): attention's and the shared expert's collectives only
        return (5 + (5 if shared else 0) + recomputed * (2 + (2 if shared else 0))) * volume
    if p.sp:
        volumes = 5 + 4 + (5 if shared else 0) + recomputed * (2 + 2 + (2 if shared else 0))
        routing = frac * k * tokens * ((2 * e + 8) + recomputed * (e + 8))
    else:
        volumes = 2 * (2 + 2 + (2 if shared else 0) + recomputed * (1 + 1 + (1 if shared else 0)))
        routing = 2 * frac * e * k * tokens
    return volumes * volume + routing


def ep_layer_bytes(case: ProfileCase, tokens: float, forwards: int) -> tuple[float, float]:
    """(token bytes the busiest rank sends through the all-to-alls, counts bytes) of one MoE layer and micro-batch
    under EP, `tokens` = T, `forwards` 1, or 2 when the layer's MLP is recomputed in backward (whose transposes
    run once)."""
    s = case.spec
    rows = expert_rows_per_token(case) * tokens
    token_bytes = A2A_PER_FORWARD * (forwards + 1) * rows * case.dtype_bytes * s.hidden_size
    counts = forwards * 8 * s.moe.num_experts * case.sizes.etp
    return token_bytes, counts
