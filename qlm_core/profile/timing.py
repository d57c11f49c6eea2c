"""Analytic step time of a layout: compute at an efficiency of the device peak, plus the communication that the
trainer does not hide, plus the pipeline bubble and the optimizer step.

Per micro-batch on the slowest pipeline stage (T = mbs·seq/cp tokens per rank, e = bytes of the compute dtype):
  compute     model FLOPs of the stage's layers (dense matmuls + causal attention over the keys each token reads:
              its document, `mean_doc_len` for packed data, and the sliding window; models/flops.py's count) and,
              on the last stage, the logits; forward + backward = 3 x forward, split over tp·cp ranks; recompute
              adds one forward of the recomputed layers (full) or of core attention (selective), and of the logits
              when the loss runs in chunks (its backward recomputes them; twice under the zero-bubble schedule,
              whose input- and weight-gradient passes each recompute them, computing only dx, then only dW);
              divided by peak x efficiency.
  tp_comm     per layer, never overlapped (qlm's TP collectives are synchronous): with SP 4 collectives forward
              (2 all-gathers, 2 reduce-scatters) and 6 backward (the transposes plus the re-gather of the saved
              sequence shard), each moving (tp-1)/tp · e·h·T bytes per rank; without SP 2 + 2 all-reduces of twice
              that. Full recompute repeats the forward's. NVLink when the TP group fits in a node, else inter-node.
  cp_comm     p2p: cp-1 K/V hops forward, cp-1 K/V hops and cp fp32 dK/dV hops backward, each overlapped with one
              block of attention (only the excess is exposed); allgather: one all-gather forward, all-gather and
              fp32 reduce-scatter backward, exposed; a2a: four all-to-alls each way, exposed.
  pp_p2p      one send forward and one backward per chunk and micro-batch (the SP shard under SP), exposed.
Per step: m micro-batches, plus the bubble (p-1)/v micro-batch times (1F1B, GPipe and interleaved: bubble fraction
(p-1)/(v·m + p-1); zero-bubble schedules recover about two thirds of it, as ZB-H1 does), plus data-parallel traffic
over dp·cp ranks of fp32 gradients and compute-dtype parameters (ZeRO 0 all-reduce; 1 reduce-scatter + all-gather;
2 reduce-scatter every micro-batch; 3 FSDP all-gathers forward and backward and a reduce-scatter per micro-batch),
hidden behind backward/forward when overlap is on except what exceeds the compute it overlaps (and, at least, the
last bucket), plus AdamW over this rank's fp32 shard at HBM speed (~28 + e bytes moved per element).
Collectives move data at `comm_efficiency` (default 0.8) of the link bandwidth, the NCCL bus-bandwidth fraction
large messages reach. Hidden communication is not free: it adds `overlap_penalty` (0.1) of its own duration, for
the SMs NCCL's kernels take from the compute they overlap (a few to ~10% slow-down is what overlapped training
typically shows); this also breaks ties in favour of layouts that communicate less.
"""

from __future__ import annotations

from dataclasses import dataclass

from qlm_core.hardware import GpuSpec
from qlm_core.models.flops import flops_per_sequence, layer_flops_per_token, logits_flops_per_token
from qlm_core.parallel.cross_entropy import loss_is_chunked
from qlm_core.profile.case import ProfileCase
from qlm_core.profile.states import model_state_bytes

TIME_COMPONENTS = ("compute", "recompute", "tp_comm", "cp_comm", "pp_p2p", "pp_bubble", "dp_comm", "optimizer")


@dataclass(frozen=True)
class Efficiency:
    compute: float = 0.5  # fraction of the bf16 peak that large GEMMs and flash attention sustain in training
    comm: float = 0.8
    overlap_penalty: float = 0.1  # hidden communication still slows the compute under it (NCCL kernels take SMs)

    def overlapped(self, comm_s: float, compute_s: float) -> float:
        """Seconds that `comm_s` of communication adds when it runs under `compute_s` of compute."""
        return max(0.0, comm_s - compute_s) + self.overlap_penalty * min(comm_s, compute_s)


@dataclass
class TimeEstimate:
    components: dict[str, float]  # seconds per step, keys TIME_COMPONENTS
    global_batch_size: int
    seq_len: int
    num_gpus: int
    model_flops_per_sample: float
    peak_tflops: float

    @property
    def step_s(self) -> float:
        return sum(self.components.values())

    @property
    def s_per_sample(self) -> float:
        return self.step_s / self.global_batch_size

    @property
    def tokens_per_s_per_device(self) -> float:
        return self.global_batch_size * self.seq_len / self.step_s / self.num_gpus

    @property
    def tflops_per_device(self) -> float:
        return self.model_flops_per_sample * self.global_batch_size / self.step_s / self.num_gpus / 1e12

    @property
    def mfu(self) -> float:
        return self.tflops_per_device / self.peak_tflops


def _bandwidth(gpu: GpuSpec, span: int, eff: Efficiency) -> float:
    """Bytes/s of a group whose members lie within `span` consecutive ranks."""
    link = gpu.nvlink_gbps if span <= gpu.gpus_per_node else gpu.internode_gbps
    return link * 1e9 * eff.comm


def _recomputed_layers(case: ProfileCase, layers: int) -> int:
    p = case.parallel
    if p.recompute != "full":
        return 0
    per_chunk = layers // p.vpp
    return p.vpp * (per_chunk if p.recompute_num_layers is None else min(per_chunk, p.recompute_num_layers))


def microbatch_times(case: ProfileCase, gpu: GpuSpec, eff: Efficiency, stage: int) -> dict[str, float]:
    """Seconds one micro-batch costs stage `stage` (all its chunks): compute, recompute, tp/cp/pp communication."""
    p, s = case.parallel, case.spec
    layout = case.layout()
    layers = layout.stage_layer_counts[stage]
    tokens = case.micro_batch_size * case.seq_len  # of one micro-batch, before the CP split
    T = tokens / p.cp
    e, h = case.dtype_bytes, s.hidden_size
    rate = gpu.peak_tflops * 1e12 * eff.compute
    dense, attention = layer_flops_per_token(s, case.seq_len, case.mean_doc_len)
    split = p.tp * p.cp
    forward = tokens * layers * (dense + attention) / split
    recomputed = _recomputed_layers(case, layers)
    extra = tokens * recomputed * (dense + attention) / split
    if p.recompute == "selective":
        extra = tokens * layers * attention / split
    if stage == p.pp - 1:
        forward += tokens * logits_flops_per_token(s) / split
        if loss_is_chunked(case.loss_chunk_tokens, T):  # the chunked loss recomputes each chunk's logits,
            # once per backward pass that runs it: twice when zero-bubble splits dx from dW (a trainable output layer)
            passes = 2 if p.pp_schedule == "zero_bubble" and not case.lora_rank else 1
            extra += passes * tokens * logits_flops_per_token(s) / split
    backward = 1 if case.lora_rank else 2  # a frozen base computes input gradients only
    times = {"compute": (1 + backward) * forward / rate, "recompute": extra / rate,
             "tp_comm": 0.0, "cp_comm": 0.0, "pp_p2p": 0.0}
    if p.tp > 1:
        volume = (p.tp - 1) / p.tp * e * h * T
        per_layer = (10 + 4 * (recomputed > 0)) * volume if p.sp else (4 + 2 * (recomputed > 0)) * 2 * volume
        if s.num_query_groups < p.tp:  # the gathered linear_qkv output: all-gather forward, reduce-scatter back
            per_layer += 2 * (p.tp - 1) / p.tp * e * s.qkv_rows * T
        times["tp_comm"] = layers * per_layer / _bandwidth(gpu, p.tp, eff)
    if p.cp > 1:
        times["cp_comm"] = layers * _cp_layer_exposed(case, gpu, eff, T, attention * T / p.tp / rate)
        if recomputed or p.recompute == "selective":  # the forward's exchange is redone in backward
            again = recomputed if recomputed else layers
            times["cp_comm"] += again * _cp_layer_exposed(case, gpu, eff, T, attention * T / p.tp / rate,
                                                          forward_only=True)
    if p.pp > 1:
        shard = e * h * (T / p.tp if p.sp and p.tp > 1 else T)
        times["pp_p2p"] = 2 * p.vpp * shard / _bandwidth(gpu, p.tp * p.cp * p.pp, eff)
    return times


def _cp_layer_exposed(case: ProfileCase, gpu: GpuSpec, eff: Efficiency, T: float, attention_s: float,
                      forward_only: bool = False) -> float:
    """Exposed CP communication of one layer and micro-batch; `attention_s` is its forward attention time."""
    p, s = case.parallel, case.spec
    e, d, cp = case.dtype_bytes, s.kv_channels, p.cp
    hk = max(1.0, s.num_query_groups / p.tp)
    hq = s.num_attention_heads / p.tp
    bw = _bandwidth(gpu, p.tp * cp, eff)
    kv = 2 * hk * d * T * e
    if p.cp_comm_type == "p2p":
        block = attention_s / cp
        exposed = (cp - 1) * eff.overlapped(kv / bw, block)
        if not forward_only:
            exposed += cp * eff.overlapped(kv * (1 + 4 / e) / bw, 2 * block)  # K/V and their fp32 gradients
        return exposed
    if p.cp_comm_type == "allgather":
        gathered = (cp - 1) * kv
        return gathered / bw * (1 if forward_only else 1 + 1 + 4 / e)
    qkvo = (2 * hq + 2 * hk) * d * T * e * (cp - 1) / cp
    return qkvo / bw * (1 if forward_only else 2)


def dp_times(case: ProfileCase, gpu: GpuSpec, eff: Efficiency, stage: int, forward_s: float,
             backward_s: float) -> tuple[float, float]:
    """(exposed data-parallel communication, optimizer step) per step on `stage`; forward_s / backward_s are one
    micro-batch's forward and backward compute."""
    p = case.parallel
    n = case.sizes.dp * p.cp
    states = model_state_bytes(case.layout(), stage, dtype=case.torch_dtype, zero_stage=p.zero_stage, shards=n,
                               bucket_size_mb=p.bucket_size_mb, lora_rank=case.lora_rank,
                               lora_targets=case.lora_targets)
    owned = states.trainable_numel / (n if p.zero_stage else 1)
    optimizer = owned * (28 + case.dtype_bytes) / (gpu.hbm_gbps * 1e9)
    if n == 1:
        return 0.0, optimizer
    world = p.tp * p.cp * p.pp * case.sizes.dp
    bw = _bandwidth(gpu, world, eff)
    P, e, m, frac = states.trainable_numel, case.dtype_bytes, case.num_microbatches, (n - 1) / n
    bucket = min(P, p.bucket_size_mb * 2**20 / 4) * 4 * frac / bw
    if p.zero_stage == 3:
        per_mb = frac * (2 * e + 4) * P / bw
        return m * eff.overlapped(per_mb, forward_s + backward_s), optimizer
    if p.zero_stage == 0:
        reduce = 2 * frac * 4 * P / bw
        gather = 0.0
    else:
        reduce = frac * 4 * P / bw
        gather = frac * e * P / bw
    hidden = lambda comm, compute: max(bucket, eff.overlapped(comm, compute))  # noqa: E731 - the last bucket waits
    if p.zero_stage == 2:
        exposed = m * (hidden(reduce, backward_s) if p.overlap_grad_reduce else reduce)
    else:
        exposed = hidden(reduce, backward_s) if p.overlap_grad_reduce else reduce
    exposed += eff.overlapped(gather, forward_s) if p.overlap_param_gather else gather
    return exposed, optimizer


def estimate_time(case: ProfileCase, gpu: GpuSpec, eff: Efficiency = Efficiency()) -> TimeEstimate:
    p = case.parallel
    m = case.num_microbatches
    per_stage = [microbatch_times(case, gpu, eff, stage) for stage in range(p.pp)]
    slowest = max(range(p.pp), key=lambda i: sum(per_stage[i].values()))
    mb = per_stage[slowest]
    mb_total = sum(mb.values())
    bubble = mb_total * (p.pp - 1) / p.vpp
    if p.pp_schedule == "zero_bubble":
        bubble /= 3
    forward_s = mb["compute"] / (2 if case.lora_rank else 3)
    dp, optimizer = dp_times(case, gpu, eff, slowest, forward_s, mb["compute"] - forward_s + mb["recompute"])
    components = {key: m * mb[key] for key in ("compute", "recompute", "tp_comm", "cp_comm", "pp_p2p")}
    components.update(pp_bubble=bubble, dp_comm=dp, optimizer=optimizer)
    return TimeEstimate(components, case.global_batch_size, case.seq_len, case.num_gpus,
                        flops_per_sequence(case.spec, case.seq_len, case.mean_doc_len), gpu.peak_tflops)
