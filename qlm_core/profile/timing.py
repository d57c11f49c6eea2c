"""Analytic step time of a layout: each kernel at its fitted rate, the communication that is not hidden, the
pipeline bubble, the optimizer step and a per-step overhead. The rates and their fit: profile/efficiency.py.

Per micro-batch on the slowest pipeline stage (T = mbs·seq/cp tokens per rank, e = bytes of the compute dtype):
  compute     the layer GEMMs (QKV, attention output, fc1, fc2; the last stage's logits), each at the efficiency of
              its shape on this rank; forward + backward = 3 x forward (a frozen LoRA base: 2 x, input gradients
              only); flash attention over the keys each token reads (its document, `mean_doc_len` for packed data,
              the sliding window; models/flops.py), forward and a 2.5x backward at their own rates; elementwise
              work (norms, rotary, SwiGLU, residuals) at HBM speed.
  recompute   one more forward of the recomputed layers (full), of the recompute_modules (selective: core_attn,
              mlp, layernorm), of everything but the matmuls and the attention kernel (op), and of the
              logits when the loss runs in chunks (its backward recomputes them; twice under zero-bubble, whose
              input- and weight-gradient passes each recompute them).
  tp_comm     per layer: with SP 4 collectives forward (2 all-gathers, 2 reduce-scatters) and 6 backward (the
              transposes plus the re-gather of the saved sequence shard), each moving (tp-1)/tp · e·h·T bytes per
              rank; without SP 2 + 2 all-reduces of twice that; full recompute repeats the forward's. Exposed
              (qlm's trainer), or hidden under the layer's GEMMs with `tp_comm_overlap` (Megatron's).
  cp_comm     p2p: cp-1 K/V hops forward, cp-1 K/V hops and cp fp32 dK/dV hops backward, each overlapped with one
              block of attention (only the excess is exposed); allgather: one all-gather forward, all-gather and
              fp32 reduce-scatter backward, exposed; a2a: four all-to-alls each way, exposed.
  reference   preference training's reference forward of each micro-batch (a frozen copy, or the policy with its
              adapters off; none with a precomputed table): its GEMMs, attention, a forward's elementwise work and
              logits, and its forward collectives, exposed; its own forward-only pipeline schedule adds
              (p-1)/v of it to the bubble (zero-bubble schedules recover none of that).
  MoE layers  their router, experts and shared expert, elementwise work and TP collectives: profile/moe_timing.py;
              a stage's layers are costed as their mean.
  ep_comm     expert parallelism: each MoE layer's all-to-alls (counts, dispatch, combine; forward, backward and
              recompute), exposed (moe_timing.ep_layer_bytes, topology.all_to_all_seconds).
  pp_p2p      one send forward and one backward per chunk and micro-batch (the SP shard under SP): exposed, or
              hidden under the chunk's compute with `p2p_overlap` (Megatron's --overlap-p2p-comm).
Per step: m micro-batches, plus the bubble (p-1)/v micro-batch times (1F1B, GPipe and interleaved: bubble fraction
(p-1)/(v·m + p-1); zero-bubble schedules recover about two thirds of it, as ZB-H1 does), plus data-parallel traffic
over dp·cp ranks (the routed experts' under EP over their edp ranks) of the gradients (in `grad_reduce_dtype`)
and parameters (in `param_gather_dtype`) (ZeRO 0 all-reduce; 1 reduce-scatter + all-gather; 2 reduce-scatter
every micro-batch; 3 FSDP all-gathers forward and backward and a reduce-scatter per micro-batch), hidden behind
backward/forward when overlap is on except what
exceeds the compute it overlaps (and, at least, the last bucket), plus AdamW over this rank's fp32 shard at HBM
speed (~28 + e bytes moved per element), plus the fitted per-step overhead, plus an RL step's weight sync, rollout
decoding and reward models (profile/rl_timing.py). Every collective's bandwidth follows where its group's ranks sit
(profile/topology.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from qlm_core.dtypes import DTYPES
from qlm_core.hardware import GpuSpec
from qlm_core.models.activations import activation_kind
from qlm_core.models.flops import (
    flops_per_sequence,
    mean_attention_flops_per_token,
    megatron_flops_per_sequence,
)
from qlm_core.parallel.cross_entropy import loss_is_chunked
from qlm_core.profile.case import ProfileCase
from qlm_core.profile.efficiency import ATTENTION_BACKWARD_FLOPS, Efficiency, KernelRates
from qlm_core.profile.moe_timing import (
    ep_layer_bytes,
    moe_elementwise_seconds,
    moe_layer_gemm_seconds,
    moe_layer_tp_bytes,
    moe_mlp_volumes,
)
from qlm_core.profile.rl_timing import RL_COMPONENTS, rl_times
from qlm_core.profile.states import model_state_bytes
from qlm_core.profile.topology import all_to_all_seconds, expert_bandwidth, group_bandwidth, p2p_bandwidth

# what microbatch_times returns (seconds of one micro-batch), then the per-step parts estimate_time adds
MICROBATCH_COMPONENTS = ("compute", "recompute", "reference", "tp_comm", "cp_comm", "ep_comm", "pp_p2p")
TIME_COMPONENTS = MICROBATCH_COMPONENTS + ("pp_bubble", "dp_comm", "optimizer", "overhead") + RL_COMPONENTS


@dataclass
class TimeEstimate:
    components: dict[str, float]  # seconds per step, keys TIME_COMPONENTS
    global_batch_size: int
    seq_len: int
    num_gpus: int
    model_flops_per_sample: float  # qlm's count: causal attention halved (models/flops.py)
    megatron_flops_per_sample: float  # Megatron-LM's num_floating_point_operations
    peak_tflops: float
    rates: KernelRates | None = None  # what was assumed

    @property
    def step_s(self) -> float:
        return sum(self.components.values())

    @property
    def s_per_sample(self) -> float:
        return self.step_s / self.global_batch_size

    @property
    def tokens_per_s_per_device(self) -> float:
        return self.global_batch_size * self.seq_len / self.step_s / self.num_gpus

    def _tflops(self, flops_per_sample: float) -> float:
        return flops_per_sample * self.global_batch_size / self.step_s / self.num_gpus / 1e12

    @property
    def tflops_per_device(self) -> float:
        return self._tflops(self.model_flops_per_sample)

    @property
    def mfu(self) -> float:
        """Model FLOPs utilisation by qlm's count (causal attention halved)."""
        return self.tflops_per_device / self.peak_tflops

    @property
    def megatron_tflops_per_device(self) -> float:
        return self._tflops(self.megatron_flops_per_sample)

    @property
    def megatron_mfu(self) -> float:
        """MFU by Megatron-LM's / NeMo's FLOP count: what their logs print for the same speed."""
        return self.megatron_tflops_per_device / self.peak_tflops


def _recomputed_layers(case: ProfileCase, layers: int) -> int:
    p = case.parallel
    if p.recompute != "full":
        return 0
    per_chunk = layers // p.vpp
    return p.vpp * (per_chunk if p.recompute_num_layers is None else min(per_chunk, p.recompute_num_layers))


def gemm_seconds(case: ProfileCase, rates: KernelRates, peak: float) -> dict[str, float]:
    """Forward seconds per token of each of one layer's GEMMs on this rank, each at the efficiency of its shape."""
    s, tp = case.spec, case.parallel.tp
    h, f, q = s.hidden_size, s.ffn_hidden_size, s.num_attention_heads * s.kv_channels
    fc1 = activation_kind(s).fc1_rows(f)
    seconds = {name: 2 * k * n / (peak * rates.gemm(k, n)) for name, (k, n) in {
        "linear_qkv": (h, s.qkv_rows / tp), "linear_proj": (q / tp, h), "linear_fc1": (h, fc1 / tp),
        "linear_fc2": (f / tp, h)}.items()}
    if s.mla is not None:  # multi-latent attention's q/kv projections stand in for linear_qkv
        m, heads = s.mla, s.num_attention_heads / tp
        q_shapes = [(h, heads * m.q_head_dim)] if m.q_lora_rank is None else \
            [(h, m.q_lora_rank / tp), (m.q_lora_rank, heads * m.q_head_dim)]
        shapes = [*q_shapes, (h, (m.kv_lora_rank + m.qk_rope_head_dim) / tp),
                  (m.kv_lora_rank, heads * (m.qk_nope_head_dim + m.v_head_dim))]
        seconds["linear_qkv"] = sum(2 * k * n / (peak * rates.gemm(k, n)) for k, n in shapes)
        v = heads * m.v_head_dim
        seconds["linear_proj"] = 2 * v * h / (peak * rates.gemm(v, h))
    return seconds


def layer_gemm_seconds(case: ProfileCase, rates: KernelRates, peak: float) -> float:
    """Forward seconds per token of one layer's GEMMs on this rank."""
    return sum(gemm_seconds(case, rates, peak).values())


def logits_gemm_seconds(case: ProfileCase, rates: KernelRates, peak: float) -> float:
    """Forward seconds per token of the output layer's GEMM on this rank."""
    h = case.spec.hidden_size
    v = 1 if case.spec.head == "score" else case.spec.vocab_size / case.parallel.tp
    return 2 * h * v / (peak * rates.gemm(h, v))


def elementwise_seconds(case: ProfileCase, rates: KernelRates, gpu: GpuSpec) -> dict[str, float]:
    """Forward + backward seconds per token of one layer's memory-bound work: "norms" (the norms and residuals,
    on the SP shard under SP) and "mlp" (SwiGLU)."""
    p, s = case.parallel, case.spec
    hidden = s.hidden_size / (p.tp if p.sp and p.tp > 1 else 1)
    rate = rates.elementwise * case.dtype_bytes / (gpu.hbm_gbps * 1e9)
    # GLM-4's norms after attention and MLP: two passes more beside the two norms and two residual adds
    norms = 1.5 if s.post_norms else 1.0
    return {"norms": rate * hidden * norms, "mlp": rate * s.ffn_hidden_size / p.tp}


def layer_elementwise_seconds(case: ProfileCase, rates: KernelRates, gpu: GpuSpec) -> float:
    """Forward + backward seconds per token of one layer's memory-bound work (norms, rotary, SwiGLU, residuals)."""
    return sum(elementwise_seconds(case, rates, gpu).values())


def recompute_per_layer(case: ProfileCase, gemm: dict[str, float], attention_s: float,
                        elementwise: dict[str, float], mlp_volumes: int = 2) -> tuple[float, float]:
    """(seconds per token, TP collective volumes) that recompute adds to one layer that `selective` or `op` covers:
    selective recomputes the modules of recompute_modules (core_attn: the attention kernel; mlp: fc1, SwiGLU, fc2
    and their collectives; layernorm: the norms), op re-runs every op but the matmuls and the attention kernel,
    whose outputs it keeps (linear_proj and linear_fc2 run again, with their output collectives). `attention_s`
    is per token too; the elementwise figures are forward + backward (a forward is a third)."""
    p = case.parallel
    if p.recompute == "op":
        return gemm["linear_proj"] + gemm["linear_fc2"] + sum(elementwise.values()) / 3, 2 if p.sp else 4
    if p.recompute != "selective":
        return 0.0, 0
    modules = set(p.recompute_modules)
    seconds, volumes = 0.0, 0
    if "core_attn" in modules:
        seconds += attention_s
    if "mlp" in modules:
        seconds += gemm["linear_fc1"] + gemm["linear_fc2"] + elementwise["mlp"] / 3
        volumes += mlp_volumes  # SP: the all-gather and reduce-scatter around the MLP; else its all-reduce
    if "layernorm" in modules:
        seconds += elementwise["norms"] / 3
    return seconds, volumes


def microbatch_times(case: ProfileCase, gpu: GpuSpec, eff: Efficiency | KernelRates, stage: int) -> dict[str, float]:
    """Seconds one micro-batch costs stage `stage` (all its chunks): compute, recompute, tp/cp/pp communication."""
    rates = eff.rates(gpu) if isinstance(eff, Efficiency) else eff
    p, s = case.parallel, case.spec
    layers = case.layout().stage_layer_counts[stage]
    tokens = case.micro_batch_size * case.seq_len  # of one micro-batch, before the CP split
    T = tokens / p.cp
    peak = gpu.peak_tflops * 1e12
    attention_flops = mean_attention_flops_per_token(s, case.seq_len, case.mean_doc_len)
    per_gemm = gemm_seconds(case, rates, peak)
    per_elementwise = elementwise_seconds(case, rates, gpu)
    attention = T * attention_flops / p.tp / (peak * rates.attn_fwd)  # forward, one layer
    attention_backward = ATTENTION_BACKWARD_FLOPS * attention * rates.attn_fwd / rates.attn_bwd
    recomputed = _recomputed_layers(case, layers)
    moe_layers = stage_moe_layers(case, stage)
    dense_layers = layers - moe_layers
    # multi-token prediction on the last stage: each depth a layer of the decoder's last layer's kind, its eh_proj
    # and its own pass through the output layer
    depths = s.mtp_num_layers if stage == p.pp - 1 and case.trains_mtp else 0
    mtp_moe = depths > 0 and s.is_moe_layer(s.num_layers)
    layer_gemm, layer_elementwise = sum(per_gemm.values()), sum(per_elementwise.values())
    mtp_gemm, mtp_elementwise = layer_gemm, layer_elementwise
    partial_s, partial_volumes = recompute_per_layer(case, per_gemm, attention / T, per_elementwise)
    if moe_layers or mtp_moe:  # the stage's mean layer; its MoE layers' MLPs (profile/moe_timing.py)
        moe_gemm = moe_layer_gemm_seconds(case, rates, peak, per_gemm, gpu.hbm_gbps * 1e9, T)
        moe_elementwise = moe_elementwise_seconds(case, rates, gpu, per_elementwise)
        if mtp_moe:
            mtp_gemm, mtp_elementwise = sum(moe_gemm.values()), sum(moe_elementwise.values())
        layer_gemm = (dense_layers * layer_gemm + moe_layers * sum(moe_gemm.values())) / layers
        layer_elementwise = (dense_layers * layer_elementwise + moe_layers * sum(moe_elementwise.values())) / layers
        moe_partial_s, moe_partial_volumes = recompute_per_layer(case, moe_gemm, attention / T, moe_elementwise,
                                                                 moe_mlp_volumes(case))
        partial_s = (dense_layers * partial_s + moe_layers * moe_partial_s) / layers
    gemm = T * layers * layer_gemm  # forward
    elementwise = T * layers * layer_elementwise
    backward = 1 if case.lora_rank else 2  # a frozen base computes input gradients only
    compute = (1 + backward) * gemm + layers * (attention + attention_backward) + elementwise
    extra = recomputed / layers * (gemm + elementwise / 3) + recomputed * attention
    extra += T * layers * partial_s
    if stage == p.pp - 1:
        logits = T * logits_gemm_seconds(case, rates, peak) * (1 + depths)
        compute += (1 + backward) * logits
        if loss_is_chunked(case.loss_chunk_tokens, T):  # the chunked loss recomputes each chunk's logits,
            # once per backward pass that runs it: twice when zero-bubble splits dx from dW (a trainable output layer)
            passes = 2 if p.pp_schedule == "zero_bubble" and not case.lora_rank else 1
            extra += passes * logits
    if depths:
        h = s.hidden_size
        eh_proj = 2 * 2 * h * (h / p.tp) / (peak * rates.gemm(2 * h, h / p.tp))
        depth_gemm, depth_elementwise = T * (mtp_gemm + eh_proj), T * mtp_elementwise
        compute += depths * ((1 + backward) * depth_gemm + attention + attention_backward + depth_elementwise)
        if p.recompute == "full":  # each depth is one checkpoint
            extra += depths * (depth_gemm + depth_elementwise / 3 + attention)
    times = {**dict.fromkeys(MICROBATCH_COMPONENTS, 0.0), "compute": compute, "recompute": extra}
    if case.reference_forward:
        times["reference"] = _reference_forward_seconds(case, gpu, rates, stage, T, gemm, elementwise, attention,
                                                        attention_backward)
    if (moe_layers or mtp_moe) and case.expert_parallel:
        mtp_routed = depths if mtp_moe else 0
        times["ep_comm"] = _ep_seconds(case, gpu, rates, T, moe_layers + mtp_routed,
                                       round(moe_layers * recomputed / layers)
                                       + (mtp_routed if p.recompute == "full" else 0))
    sizes = case.sizes
    if p.tp > 1:
        volume = _tp_volume(case, T)
        qkv_gather = 2 * _qkv_gather_bytes(case, T)  # all-gather forward, reduce-scatter back
        per_layer = (10 + 4 * (recomputed > 0)) * volume if p.sp else (4 + 2 * (recomputed > 0)) * 2 * volume
        per_layer += partial_volumes * volume + qkv_gather
        tp_bytes = layers * per_layer
        if moe_layers or mtp_moe:
            moe_layer = moe_layer_tp_bytes(case, T, recomputed > 0) + moe_partial_volumes * volume + qkv_gather
            tp_bytes = dense_layers * per_layer + moe_layers * moe_layer
        tp_bytes += depths * ((moe_layer if mtp_moe else per_layer) + 2 * volume)  # and eh_proj's gather
        tp_s = tp_bytes / group_bandwidth(gpu, sizes, ("tp",), rates.comm)
        times["tp_comm"] = rates.overlapped(tp_s, (1 + backward) * gemm) if case.tp_comm_overlap else tp_s
    if p.cp > 1:
        cp_s = _cp_layer_exposed(case, gpu, rates, T, attention, attention_backward)
        times["cp_comm"] = (layers + depths) * cp_s
        if recomputed or (p.recompute == "selective" and "core_attn" in p.recompute_modules):  # redone in backward
            again = recomputed if recomputed else layers
            times["cp_comm"] += again * _cp_layer_exposed(case, gpu, rates, T, attention, attention_backward,
                                                          forward_only=True)
    if p.pp > 1:
        p2p_s = 2 * _p2p_seconds(case, gpu, rates, T)  # one send forward and one backward
        times["pp_p2p"] = rates.overlapped(p2p_s, compute) if case.p2p_overlap else p2p_s
    return times


def _tp_volume(case: ProfileCase, T: float) -> float:
    """Bytes one TP collective of a layer's hidden states moves per rank ((tp-1)/tp of e*h*T)."""
    p = case.parallel
    return (p.tp - 1) / p.tp * case.dtype_bytes * case.spec.hidden_size * T


def _qkv_gather_bytes(case: ProfileCase, T: float) -> float:
    """One direction of the gathered linear_qkv output (fewer query groups than TP ranks), else 0; with
    multi-latent attention the gathered latents (its down projections' outputs)."""
    p, s = case.parallel, case.spec
    if s.mla is not None:
        latents = (s.mla.q_lora_rank or 0) + s.mla.kv_lora_rank + s.mla.qk_rope_head_dim
        return (p.tp - 1) / p.tp * case.dtype_bytes * latents * T
    return (p.tp - 1) / p.tp * case.dtype_bytes * s.qkv_rows * T if s.num_query_groups < p.tp else 0.0


def _p2p_seconds(case: ProfileCase, gpu: GpuSpec, rates: KernelRates, T: float) -> float:
    """One PP send of every chunk of a micro-batch (the SP shard under SP)."""
    p = case.parallel
    shard = case.dtype_bytes * case.spec.hidden_size * (T / p.tp if p.sp and p.tp > 1 else T)
    return p.vpp * shard / p2p_bandwidth(gpu, case.sizes, rates.comm)


def _reference_forward_seconds(case: ProfileCase, gpu: GpuSpec, rates: KernelRates, stage: int, T: float,
                               gemm: float, elementwise: float, attention: float, attention_backward: float) -> float:
    """Preference training's reference forward of one micro-batch on `stage` (no backward, nothing recomputed):
    its GEMMs, attention and the forward's third of the elementwise work, the last stage's logits, and the forward's
    collectives (TP: 4 x volume a layer, as SP's 2 all-gathers + 2 reduce-scatters or the 2 all-reduces of twice
    it; CP's forward hops; one PP send a chunk), all exposed. MoE models train no preference loss."""
    p = case.parallel
    layers = case.layout().stage_layer_counts[stage]
    seconds = gemm + layers * attention + elementwise / 3
    if stage == p.pp - 1:
        seconds += T * logits_gemm_seconds(case, rates, gpu.peak_tflops * 1e12)
    if p.tp > 1:
        per_layer = 4 * _tp_volume(case, T) + _qkv_gather_bytes(case, T)
        seconds += layers * per_layer / group_bandwidth(gpu, case.sizes, ("tp",), rates.comm)
    if p.cp > 1:
        seconds += layers * _cp_layer_exposed(case, gpu, rates, T, attention, attention_backward, forward_only=True)
    if p.pp > 1:
        seconds += _p2p_seconds(case, gpu, rates, T)
    return seconds


def _ep_seconds(case: ProfileCase, gpu: GpuSpec, rates: KernelRates, T: float, moe_layers: int,
                recomputed: int) -> float:
    """Exposed all-to-all seconds of a stage's MoE layers for one micro-batch (`recomputed` of them under full
    recompute; selective `mlp` and `op` re-run every layer's dispatch)."""
    p = case.parallel
    again = p.recompute == "op" or (p.recompute == "selective" and "mlp" in p.recompute_modules)
    total = 0.0
    for layers, forwards in ((moe_layers - recomputed, 1 + again), (recomputed, 2)):
        if layers:
            token_bytes, counts = ep_layer_bytes(case, T, forwards)  # the time is linear in the bytes
            total += layers * all_to_all_seconds(gpu, case.sizes, token_bytes + counts, rates.comm)
    return total


def stage_moe_layers(case: ProfileCase, stage: int) -> int:
    """MoE layers among stage `stage`'s (all its chunks)."""
    if case.spec.moe is None:
        return 0
    layout = case.layout()
    return sum(case.spec.is_moe_layer(i) for c in range(case.parallel.vpp) for i in layout.chunk_layers(stage, c))


def _cp_layer_exposed(case: ProfileCase, gpu: GpuSpec, rates: KernelRates, T: float, attention_s: float,
                      attention_backward_s: float, forward_only: bool = False) -> float:
    """Exposed CP communication of one layer and micro-batch; `attention_s` is its forward attention time."""
    p, s = case.parallel, case.spec
    e, d, cp = case.dtype_bytes, s.kv_channels, p.cp
    hk = max(1.0, s.num_query_groups / p.tp)
    hq = s.num_attention_heads / p.tp
    bw = group_bandwidth(gpu, case.sizes, ("cp",), rates.comm)
    kv = 2 * hk * d * T * e
    if p.cp_comm_type == "p2p":
        exposed = (cp - 1) * rates.overlapped(kv / bw, attention_s / cp)
        if not forward_only:  # K/V and their fp32 gradients
            exposed += cp * rates.overlapped(kv * (1 + 4 / e) / bw, attention_backward_s / cp)
        return exposed
    if p.cp_comm_type == "allgather":
        gathered = (cp - 1) * kv
        return gathered / bw * (1 if forward_only else 1 + 1 + 4 / e)
    qkvo = (2 * hq + 2 * hk) * d * T * e * (cp - 1) / cp
    return qkvo / bw * (1 if forward_only else 2)


def dp_times(case: ProfileCase, gpu: GpuSpec, rates: KernelRates, stage: int, forward_s: float,
             backward_s: float) -> tuple[float, float]:
    """(exposed data-parallel communication, optimizer step) per step on `stage`; forward_s / backward_s are one
    micro-batch's forward and backward compute."""
    p = case.parallel
    n = case.sizes.dp * p.cp
    edp = case.sizes.edp if case.expert_parallel else None
    states = model_state_bytes(case.layout(), stage, dtype=case.torch_dtype, zero_stage=p.zero_stage, shards=n,
                               bucket_size_mb=p.bucket_size_mb, lora_rank=case.lora_rank,
                               lora_targets=case.lora_targets, mtp_trainable=case.trains_mtp)
    owned = states.owned_numel(n, edp) if p.zero_stage else states.trainable_numel
    optimizer = owned * (28 + case.dtype_bytes) / (gpu.hbm_gbps * 1e9)
    # seconds per byte-per-element of traffic: (n-1)/n of each domain's elements over its group's bandwidth
    domains = [(states.trainable_numel - states.expert_numel, n, group_bandwidth(gpu, case.sizes, ("dp", "cp"),
                                                                                 rates.comm))]
    if edp is not None:
        domains.append((states.expert_numel, edp, expert_bandwidth(gpu, case.sizes, ("edp",), rates.comm)))
    unit = sum(numel * (size - 1) / size / bw for numel, size, bw in domains if size > 1)
    if unit == 0:
        return 0.0, optimizer
    bw = group_bandwidth(gpu, case.sizes, ("dp", "cp"), rates.comm) if n > 1 else domains[-1][2]
    frac = (n - 1) / n if n > 1 else (edp - 1) / edp
    P, m = states.trainable_numel, case.num_microbatches
    r = DTYPES[case.grad_reduce_dtype].itemsize
    g = DTYPES[case.param_gather_dtype].itemsize if case.param_gather_dtype else case.dtype_bytes
    bucket = min(P, p.bucket_size_mb * 2**20 / r) * r * frac / bw
    if p.zero_stage == 3:
        per_mb = (2 * g + r) * unit
        return m * rates.overlapped(per_mb, forward_s + backward_s), optimizer
    if p.zero_stage == 0:
        reduce = 2 * r * unit
        gather = 0.0
    else:
        reduce = r * unit
        gather = g * unit
    hidden = lambda comm, compute: max(bucket, rates.overlapped(comm, compute))  # noqa: E731 - the last bucket waits
    if p.zero_stage == 2:
        exposed = m * (hidden(reduce, backward_s) if p.overlap_grad_reduce else reduce)
    else:
        exposed = hidden(reduce, backward_s) if p.overlap_grad_reduce else reduce
    exposed += rates.overlapped(gather, forward_s) if p.overlap_param_gather else gather
    return exposed, optimizer


def estimate_time(case: ProfileCase, gpu: GpuSpec, eff: Efficiency = Efficiency()) -> TimeEstimate:
    rates = eff.rates(gpu)
    p = case.parallel
    m = case.num_microbatches
    per_stage = [microbatch_times(case, gpu, rates, stage) for stage in range(p.pp)]
    slowest = max(range(p.pp), key=lambda i: sum(per_stage[i].values()))
    mb = per_stage[slowest]
    training = sum(mb.values()) - mb["reference"]
    bubble = training * (p.pp - 1) / p.vpp
    if p.pp_schedule == "zero_bubble":
        bubble /= 3
    # the reference forward runs a forward-only schedule of its own: no weight-gradient work fills its bubble
    bubble += mb["reference"] * (p.pp - 1) / p.vpp
    forward_s = mb["compute"] / (2 if case.lora_rank else 3)
    dp, optimizer = dp_times(case, gpu, rates, slowest, forward_s, mb["compute"] - forward_s + mb["recompute"])
    components = {key: m * mb[key] for key in MICROBATCH_COMPONENTS}
    components.update(pp_bubble=bubble, dp_comm=dp, optimizer=optimizer, overhead=rates.step_overhead_s)
    components.update(rl_times(case, gpu, rates))
    return TimeEstimate(components, case.global_batch_size, case.seq_len, case.num_gpus,
                        flops_per_sequence(case.spec, case.seq_len, case.mean_doc_len, case.trains_mtp),
                        megatron_flops_per_sequence(case.spec, case.seq_len), gpu.peak_tflops, rates)
