"""The rollout side of an RL step (data.kind = "rl"): seconds per step on each model replica's leader, while the
replica's other ranks wait (train/rollout_batches.py). The training pass, the frozen reference's forward (beta > 0:
`reference`) and the rest are profile/timing.py's; π_old is the sampler's own log-probs, so no extra forward computes
them.

  rl_sync      weight sync: under ZeRO 3 the parameters gathered whole first (an all-gather over dp·cp), then each
               trainer shard once, point to point, to the replica's rank 0 (the whole model in the compute dtype over
               the replica's slowest link), a broadcast of it to the other leaders over the data-parallel group, and
               the copy into the rollout model (read and written at HBM speed).
  rl_generate  KV-cache decoding of the leader's completions (global batch / dp of them, rl.rollout_batch_size at a
               time) by the whole model at TP 1: the prefill of the prompts (the longest a prompt may be, seq_len -
               max_completion_length; once a group when the decode batches hold whole groups) at the GEMM rate,
               then max_completion_length steps, each the larger of reading
               the weights (an MoE layer's experts that the batch's tokens can reach) and the batch's KV cache at HBM
               speed, and its FLOPs. Every completion is taken to run to the length limit, an upper bound (an eos ends
               one sooner); the host's per-step launch work is not counted (qlm decodes eagerly: `--probe` measures it).
  rl_reward    the reward models' forward over every completion (2 FLOPs per parameter and token at the GEMM rate);
               reward functions are Python on the host and not counted.
"""

from __future__ import annotations

from qlm_core.hardware import GpuSpec
from qlm_core.models.flops import logits_flops_per_token, model_layer_flops_per_token
from qlm_core.models.parameters import num_parameters
from qlm_core.profile.attention_terms import kv_cache_entries
from qlm_core.profile.case import ProfileCase
from qlm_core.profile.efficiency import KernelRates
from qlm_core.profile.topology import group_bandwidth

RL_COMPONENTS = ("rl_sync", "rl_generate", "rl_reward")
DECODE_SAMPLES = 16  # decode steps evaluated per batch (the rest by the midpoint rule)


def rl_times(case: ProfileCase, gpu: GpuSpec, rates: KernelRates) -> dict[str, float]:
    """Seconds per step of RL_COMPONENTS (zero for a case that is not RL)."""
    if not case.rl:
        return dict.fromkeys(RL_COMPONENTS, 0.0)
    return {"rl_sync": sync_seconds(case, gpu, rates), "rl_generate": generate_seconds(case, gpu, rates),
            "rl_reward": reward_model_seconds(case, gpu, rates)}


def sync_seconds(case: ProfileCase, gpu: GpuSpec, rates: KernelRates) -> float:
    sizes, model = case.sizes, case.dtype_bytes * num_parameters(case.spec)
    seconds = 2 * model / (gpu.hbm_gbps * 1e9)
    if case.parallel.zero_stage == 3 and sizes.dp * sizes.cp > 1:  # the shards gathered whole first
        seconds += model * (1 - 1 / (sizes.dp * sizes.cp)) / group_bandwidth(gpu, sizes, ("dp", "cp"), rates.comm)
    if sizes.tp * sizes.pp * sizes.cp > 1:
        seconds += model / group_bandwidth(gpu, sizes, ("tp", "cp", "pp"), rates.comm)
    if sizes.dp > 1:
        seconds += model / group_bandwidth(gpu, sizes, ("dp",), rates.comm)
    return seconds


def _weights_read(case: ProfileCase, rows: int) -> float:
    """Bytes of weights one decode step reads: every dense parameter, and of an MoE layer's routed experts those
    that `rows` tokens can reach (rows · top-k of them, at most all)."""
    spec, total = case.spec, num_parameters(case.spec)
    if spec.moe is None:
        return case.dtype_bytes * total
    active = num_parameters(spec, active=True)
    per_expert = (total - active) / max(spec.moe.num_experts - spec.moe.topk, 1)  # one expert's, over the MoE layers
    reached = min(spec.moe.num_experts, rows * spec.moe.topk)
    return case.dtype_bytes * (active + (reached - spec.moe.topk) * per_expert)


def generate_seconds(case: ProfileCase, gpu: GpuSpec, rates: KernelRates) -> float:
    spec, e = case.spec, case.dtype_bytes
    share = case.global_batch_size // case.sizes.dp
    batch = min(share, case.rl_batch_rows) if case.rl_batch_rows else share
    completion = min(case.rl_completion_tokens, case.seq_len - 1)
    prompt = case.seq_len - completion
    peak, hbm = gpu.peak_tflops * 1e12, gpu.hbm_gbps * 1e9
    gemm_rate = peak * rates.gemm(spec.hidden_size, spec.ffn_hidden_size)
    kv_per_token = spec.num_layers * kv_cache_entries(spec) * e
    seconds = 0.0
    for first in range(0, share, batch):
        rows = min(batch, share - first)
        prompts = case.rl_prefill_rows(rows, share)  # a group's prompt prefilled once, its cache copied
        prefill = prompts * (prompt * model_layer_flops_per_token(spec, prompt) + logits_flops_per_token(spec))
        seconds += prefill / gemm_rate
        weights = _weights_read(case, rows)
        steps = completion - 1  # the first token came from the prefill's logits
        samples = min(steps, DECODE_SAMPLES)  # each step's cost is near linear in its context: a midpoint sum
        for index in range(samples):
            context = prompt + 0.5 + (index + 0.5) * steps / samples  # step t attends to prompt + t tokens
            read = weights + rows * context * kv_per_token
            # a new token reads every cached key its layer's window reaches
            flops = rows * (model_layer_flops_per_token(spec, round(context), keys=context)
                            + logits_flops_per_token(spec))
            seconds += steps / samples * max(read / hbm, flops / gemm_rate)
    return seconds


def reward_model_seconds(case: ProfileCase, gpu: GpuSpec, rates: KernelRates) -> float:
    if not case.rl_reward_model_params:
        return 0.0
    rows = case.global_batch_size // case.sizes.dp
    flops = 2.0 * case.rl_reward_model_params * rows * case.seq_len
    return flops / (gpu.peak_tflops * 1e12 * rates.gemm_max)
