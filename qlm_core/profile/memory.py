"""Analytic memory per rank, for every pipeline stage; the answer is the heaviest stage (not an average).

  weights, grads, optimizer  exact tensor bytes of the trainer's allocation (states.py)
  activations   saved for backward by the layers this stage holds, times the chunk forwards in flight at the
                schedule's peak (inflight_chunk_forwards, which mirrors torch.distributed.pipelining's warm-up counts:
                1F1B keeps p - r micro-batches on stage r, interleaved 1F1B (v chunks) keeps (v-1)·p + 2(p-1-r) + 1
                chunk forwards, i.e. 1 + (p-1)/(p·v) times 1F1B's on stage 0, zero-bubble (v-1)·p + (p-r) plus r
                deferred weight passes, GPipe all m); per-layer bytes from activations.py
  logits_loss   the last stage's final norm and loss head: the output layer input and fp32 softmax, or with the
                chunked loss its input, log-sum-exp and targets (one micro-batch; GPipe: all m)
  workspace     the largest transient at once: either the loss's logits (whole: compute dtype beside the softmax;
                chunked: one chunk's, plus its backward's dW accumulator and input gradient), or one layer's
                backward (what recompute re-materialises, the CP K/V buffers, the SP-gathered input and the layer's
                largest gradients), or, with grad_reduce_dtype bf16, the optimizer's fp32 gradient copies beyond the
                activations freed before the step
  pp_buffers    the pipeline stages' receive buffers of the micro-batches in flight (allocated per micro-batch,
                dropped after its backward), the backward at hand's gradients, the outputs of the chunk forwards in
                flight; under interleaved_1f1b / zero_bubble only the few sends not yet proven received
                (held_sends; the last rank: all its outputs in flight)
  comm_buffers  ZeRO 2: storage (grad_reduce_dtype) of the buckets being filled and reduced (1 + 2 in flight
                with overlap);
                ZeRO 3: FSDP's unsharded parameters (the root's embedding/output and two layers, prefetch) in the
                compute dtype plus one layer's reduce-scatter input (grad_reduce_dtype); ZeRO 0/1 reduce in place (0)
  rollout       RL (data.kind = "rl"), on the stage of each model replica's leader (stage 0): the whole rollout model
                and any reward model rl.reward_funcs names in the compute dtype (kept between steps), plus what
                the rollout holds only while it runs — the KV cache of the completions it decodes at once
                (global batch / dp, or rl.rollout_batch_size, rows of seq_len tokens), one bucket of the synced
                weights before it is copied in (under ZeRO 3 twice: its parameters are gathered whole to be sent),
                the last position's fp32 logits, and the prefill's working set (one layer's forward over the
                prompts of those rows — one a group when the decode batches hold whole groups, whose cache the
                group's rows then copy —, seq_len - max_completion_length tokens each: the residual stream, the norm's
                output and the hidden state handed on, the MLP's fc1 output with its activation's outputs, the new
                K and V with their RoPE copies; an MoE layer's k routed copies of each token through an expert)
                — beyond the training step's transient memory (activations, loss, workspace, pipeline and
                communication buffers), which is freed by then
  allocator     an allowance, not a measurement: `fraction` of the above for the caching allocator's rounding and
                fragmentation (PyTorch's reserved/allocated ratio is typically 1.03-1.10 in steady training;
                0.08 by default) plus `context_gib` for the CUDA context, cuBLAS workspaces and NCCL buffers
                (about 0.5 GiB of context and 0.3-0.6 GiB of NCCL channels per GPU; 1.0 GiB by default). Neither
                is in torch.cuda.max_memory_allocated().
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qlm_core.config import Recipe
from qlm_core.dtypes import DTYPES
from qlm_core.hardware import GPUS
from qlm_core.models.activations import activation_kind
from qlm_core.models.parameters import num_parameters
from qlm_core.parallel.pipeline_rules import MULTI_CHUNK_SCHEDULES
from qlm_core.profile.activations import (
    ActivationInputs,
    forward_terms,
    head_terms,
    layer_bytes,
    layer_workspace,
    logits_transient,
    loss_keeps_input,
)
from qlm_core.profile.attention_terms import attention_terms, kv_cache_entries
from qlm_core.profile.case import ProfileCase, case_from_recipe
from qlm_core.profile.mtp_terms import mtp_head_bytes, mtp_layer_bytes
from qlm_core.profile.states import model_state_bytes, stage_params
from qlm_core.train.plan import RunPlan
from qlm_core.train.weight_sync import BUCKET_BYTES

COMPONENTS = ("weights", "grads", "optimizer", "activations", "logits_loss", "workspace", "pp_buffers",
              "comm_buffers", "rollout", "allocator")
GIB = 2**30


@dataclass(frozen=True)
class Allowance:
    fraction: float = 0.08
    context_gib: float = 1.0


@dataclass
class StageMemory:
    stage: int
    components: dict[str, float]  # bytes, keys COMPONENTS
    layers: int
    chunk_forwards: int  # chunk forwards whose activations are held at the schedule's peak
    activation_per_layer: float  # bytes, one micro-batch, this stage's recompute mode for its first layer
    vpp: int = 1

    @property
    def total(self) -> float:
        return sum(self.components.values())

    @property
    def inflight_microbatches(self) -> float:
        """Chunk forwards in stage-equivalents: p on stage 0 under 1F1B, p(1 + (p-1)/(p·v)) interleaved."""
        return self.chunk_forwards / self.vpp


@dataclass
class MemoryEstimate:
    stages: list[StageMemory]
    capacity_gib: float

    @property
    def heaviest(self) -> StageMemory:
        return max(self.stages, key=lambda s: s.total)

    @property
    def total_gib(self) -> float:
        return self.heaviest.total / GIB

    @property
    def headroom_gib(self) -> float:
        return self.capacity_gib - self.total_gib

    @property
    def fits(self) -> bool:
        return self.headroom_gib >= 0


def inflight_chunk_forwards(schedule: str, pp: int, vpp: int, microbatches: int, rank: int) -> int:
    """Chunk forwards whose activations stage `rank` holds at its peak (torch.distributed.pipelining's schedules)."""
    if pp == 1:
        return 1  # micro-batches run forward then backward one after another
    if schedule == "1f1b":
        return min(microbatches, pp - rank)
    if schedule == "gpipe":
        return microbatches
    rounds = max(1, microbatches // pp)
    per_round = microbatches // rounds
    factor = 2 if schedule == "interleaved_1f1b" else 1
    total = microbatches * vpp
    warmup = min((vpp - 1) * per_round + factor * (pp - 1 - rank), total)
    return min(warmup + 1, total) + deferred_weight_passes(schedule, pp, vpp, microbatches, rank)


def deferred_weight_passes(schedule: str, pp: int, vpp: int, microbatches: int, rank: int) -> int:
    """Zero-bubble: rank r runs r weight-gradient passes late; their graphs stay alive meanwhile."""
    if pp == 1 or schedule != "zero_bubble":
        return 0
    rounds = max(1, microbatches // pp)
    total = microbatches * vpp
    warmup = min((vpp - 1) * (microbatches // rounds) + (pp - 1 - rank), total)
    return min(rank, total - min(warmup + 1, total))


def activation_inputs(case: ProfileCase, device: str = "cuda") -> ActivationInputs:
    p = case.parallel
    return ActivationInputs(
        spec=case.spec, seq_len=case.seq_len, micro_batch_size=case.micro_batch_size, tp=p.tp, sp=p.sp, cp=p.cp,
        cp_comm_type=p.cp_comm_type, dtype_bytes=case.dtype_bytes, padded_vocab=case.layout().padded_vocab,
        device=device, lora_rank=case.lora_rank, lora_targets=tuple(case.lora_targets),
        loss_chunk_tokens=case.loss_chunk_tokens, recompute_modules=tuple(p.recompute_modules), rotary=case.rotary,
        moe_losses=bool(case.moe.aux_loss_coeff or case.moe.z_loss_coeff), moe_capacity_factor=case.moe.capacity_factor,
        ep=p.ep, etp=p.etp or 0, moe_load=case.load_factor,
    )


def chunk_layer_modes(case: ProfileCase, layers: int) -> list[str]:
    """The recompute mode of each layer of one chunk (full: the first recompute_num_layers, the rest none)."""
    p = case.parallel
    if p.recompute != "full":
        return [p.recompute] * layers
    full = layers if p.recompute_num_layers is None else min(layers, p.recompute_num_layers)
    return ["full"] * full + ["none"] * (layers - full)


def comm_buffer_bytes(case: ProfileCase, layout, stage: int, states) -> float:
    p = case.parallel
    grad_bytes = float(DTYPES[case.grad_reduce_dtype].itemsize)
    if p.zero_stage == 2:  # GradientBuffers' max_reductions_in_flight = 2 with overlap
        return grad_bytes * states.bucket_numel * min(states.num_buckets, 1 + (2 if p.overlap_grad_reduce else 0))
    if p.zero_stage != 3:
        return 0.0
    params = stage_params(layout, stage, case.lora_rank, case.lora_targets, case.trains_mtp)
    layers = layout.stage_layer_counts[stage]
    matrices, root = _matrix_numels(params, layout.padded_vocab // layout.tp)
    layer_numel = matrices / max(1, layers)
    return case.dtype_bytes * (root + 2 * layer_numel) + grad_bytes * layer_numel


def _matrix_numels(params, vocab_rows: int) -> tuple[int, int]:
    """(elements of the 2-D parameters, of those with vocab_rows rows) of a stage list that stage_params caches
    (the search asks for each stage many times; an MoE stage has thousands of expert matrices)."""
    key = (id(params), vocab_rows)
    if key not in _MATRIX_NUMELS or _MATRIX_NUMELS[key][0] is not params:
        matrices = sum(q.numel for q in params if q.shape and len(q.shape) == 2)
        root = sum(q.numel for q in params if q.shape and q.shape[0] == vocab_rows)
        _MATRIX_NUMELS[key] = (params, (matrices, root))
    return _MATRIX_NUMELS[key][1]


_MATRIX_NUMELS: dict[tuple, tuple[list, tuple[int, int]]] = {}


def held_sends(schedule: str, pp: int, rank: int, in_flight: int) -> tuple[int, int]:
    """(sent input gradients, sent outputs) that rank `rank` still holds at its activation peak under a multi-chunk
    schedule (parallel/pipeline.SendRelease), from torch's own action orders replayed for pp 2-35, vpp 2-8 and up to
    280 micro-batches (tests/parallel/test_send_release.py): they do not depend on the number of micro-batches. The last
    rank's outputs go to rank 0, whose gradients for them come last: it keeps those of all its forwards in flight;
    under zero-bubble rank 0's gradients go to the last rank, which reads them last."""
    outputs = in_flight if rank == pp - 1 else (3 if schedule == "interleaved_1f1b" else 2)
    gradients = 2 if schedule == "interleaved_1f1b" else (pp + 1 if rank == 0 else 1)
    return gradients, outputs


def pipeline_buffer_bytes(case: ProfileCase, x: ActivationInputs, stage: int, chunks: int) -> float:
    """What the trainer's pipeline stages (parallel/pipeline.py InFlightStage) keep besides autograd. A receive
    buffer exists only while its micro-batch is in flight: the int64 positions of each chunk forward in flight on a
    chunk that receives (its hidden states are the first norm's saved input, or the checkpoint's around it, so they
    are counted as activations); one gradient receive buffer and one input gradient at a time (the backward at
    hand); the outputs of the chunk forwards in flight (fwd_cache). The last chunk's output is the final norm's,
    which the loss head (GPTModel.loss, run by the schedule's loss function) saves, except beside a frozen output
    layer without chunks. Under the multi-chunk schedules (interleaved_1f1b, zero_bubble) a sent input gradient,
    and a sent output's storage, stay until something the peer sent later proves it was received: held_sends."""
    p = case.parallel
    if p.pp == 1:
        return 0.0
    m, v = case.num_microbatches, p.vpp
    hidden = x.dtype_bytes * case.spec.hidden_size * x.sp_tokens
    receiving = v - 1 if stage == 0 else v  # chunk 0 of stage 0 reads the tokens
    sending = v - 1 if stage == p.pp - 1 else v  # the model's last chunk computes the loss
    total = chunks * 8 * x.tokens * receiving / v
    total += hidden * ((sending > 0) + (receiving > 0))  # the backward at hand: its output and input gradients
    if p.pp_schedule in MULTI_CHUNK_SCHEDULES and stage < p.pp - 1:
        gradients, outputs = held_sends(p.pp_schedule, p.pp, stage, chunks)
        total += (min(m, gradients) * (receiving > 0) + min(chunks, outputs)) * hidden
    else:
        if p.pp_schedule in MULTI_CHUNK_SCHEDULES:
            total += min(m, held_sends(p.pp_schedule, p.pp, stage, chunks)[0]) * hidden
        total += chunks * hidden * sending / v  # outputs in fwd_cache (the last rank: all of them)
    if stage == p.pp - 1 and not loss_keeps_input(x):
        total += chunks * hidden / v  # the last chunk's outputs, which a frozen output layer does not save
    return total


def stage_memory(case: ProfileCase, stage: int, device: str = "cuda",
                 allowance: Allowance = Allowance()) -> StageMemory:
    p, layout = case.parallel, case.layout()
    x = activation_inputs(case, device)
    shards = case.sizes.dp * p.cp
    states = model_state_bytes(layout, stage, dtype=case.torch_dtype, zero_stage=p.zero_stage, shards=shards,
                               bucket_size_mb=p.bucket_size_mb, lora_rank=case.lora_rank,
                               lora_targets=case.lora_targets, grad_dtype=DTYPES[case.grad_reduce_dtype],
                               mtp_trainable=case.trains_mtp)
    layers = layout.stage_layer_counts[stage]
    chunk_layers = layers // p.vpp
    modes = chunk_layer_modes(case, chunk_layers)
    m = case.num_microbatches
    chunks = inflight_chunk_forwards(p.pp_schedule, p.pp, p.vpp, m, stage)
    first, last = stage == 0, stage == p.pp - 1
    kinds = [[case.spec.is_moe_layer(i) for i in layout.chunk_layers(stage, c)] for c in range(p.vpp)]
    if case.spec.moe is None:
        chunk_bytes = sum(modes.count(mode) * layer_bytes(x, mode) for mode in set(modes))
    else:  # the heaviest chunk: an MoE layer pattern can mix dense layers in
        chunk_bytes = max(sum(layer_bytes(x, mode, moe) for mode, moe in zip(modes, chunk, strict=True))
                          for chunk in kinds)
    chunk_bytes += sum(forward_terms(x, embedding=first).values())
    logits_count = m if (p.pp > 1 and p.pp_schedule == "gpipe") else 1
    head = mtp = 0.0
    if last:  # a deferred weight pass keeps what the output layer's weight gradient reads: without chunks not the
        # softmax; the chunked loss recomputes the logits for it, so all it saved
        terms = head_terms(x)
        kept = sum(terms.values()) if x.chunked_loss else terms["final rmsnorm"] + terms["output layer input"]
        head = sum(terms.values()) * logits_count + kept * deferred_weight_passes(p.pp_schedule, p.pp, p.vpp, m, stage)
        if case.trains_mtp:  # the last chunk's multi-token prediction layers, per forward of it in flight
            mtp = mtp_layer_bytes(x, p.recompute) * chunks / p.vpp
            head += mtp_head_bytes(x) * logits_count
    layer_kinds = {moe for chunk in kinds for moe in chunk}
    workspace = max(logits_transient(x) if last else 0.0,
                    max(layer_workspace(x, mode, moe) for mode in set(modes) for moe in layer_kinds))
    pp_buffers = pipeline_buffer_bytes(case, x, stage, chunks)
    # With gradients kept in the compute dtype the optimizer steps on fp32 copies of what this rank updates; by then
    # the step's activations, loss and pipeline buffers are gone, so the copies raise the peak only beyond them.
    if case.grad_reduce_dtype != "fp32" and p.zero_stage < 3:
        copies = 4.0 * (states.owned_numel(shards, case.sizes.edp if case.expert_parallel else None)
                        if p.zero_stage else states.trainable_numel)
        workspace = max(workspace, copies - (chunk_bytes * chunks + mtp + head + pp_buffers))
    weights = float(states.weights)
    if case.reference_copy:  # preference training's frozen reference: this stage's TP shard, compute dtype
        weights += case.dtype_bytes * sum(param.numel for param in stage_params(layout, stage))
    components = {
        "weights": weights, "grads": float(states.grads), "optimizer": float(states.optimizer),
        "activations": chunk_bytes * chunks + mtp, "logits_loss": head, "workspace": workspace,
        "pp_buffers": pp_buffers,
        "comm_buffers": comm_buffer_bytes(case, layout, stage, states),
    }
    training_transient = sum(components[k] for k in ("activations", "logits_loss", "workspace", "pp_buffers",
                                                     "comm_buffers"))
    components["rollout"] = rollout_bytes(case, x, training_transient) if case.rl and stage == 0 else 0.0
    components["allocator"] = allowance.fraction * sum(components.values()) + allowance.context_gib * GIB
    return StageMemory(stage, components, layers, chunks, layer_bytes(x, modes[0], kinds[0][0]), p.vpp)


def rollout_bytes(case: ProfileCase, x: ActivationInputs, training_transient: float) -> float:
    """An RL leader's rollout memory (the module docstring's `rollout`)."""
    spec, width = case.spec, case.dtype_bytes
    model = width * num_parameters(spec)
    reward_models = width * case.rl_reward_model_params
    share = case.global_batch_size // case.sizes.dp
    rows = min(share, case.rl_batch_rows) if case.rl_batch_rows else share
    kv_cache = rows * case.seq_len * spec.num_layers * attention_terms(x).kv_cache(spec) * width
    logits = 4.0 * rows * spec.vocab_size
    prompt = case.seq_len - min(case.rl_completion_tokens, case.seq_len - 1)
    prefill = case.rl_prefill_rows(rows, share) * prompt * width * prefill_values_per_token(spec)
    bucket = min(float(BUCKET_BYTES), model)  # the sync fills the rollout model a bucket at a time
    synced = bucket * (2 if case.parallel.zero_stage == 3 else 1)  # ZeRO 3: the bucket's shards gathered whole too
    return model + reward_models + max(0.0, kv_cache + synced + logits + prefill - training_transient)


def prefill_values_per_token(spec) -> float:
    """Values one prompt token holds at the peak of a layer's forward without gradients (the module docstring's
    prefill working set): the residual stream and the norm's output, the MLP's fc1 output with the activation's
    outputs (a gated one: the activation of the gate and the product), the hidden state handed on, and the layer's
    new K and V with their RoPE copies."""
    h, activation = spec.hidden_size, activation_kind(spec)

    def mlp(ffn: int) -> float:
        return activation.fc1_rows(ffn) + (activation.matrices - 1) * ffn

    if spec.moe is None:
        working = mlp(spec.ffn_hidden_size)
    else:
        moe = spec.moe
        working = moe.topk * (h + mlp(moe.ffn_hidden_size)) + mlp(moe.shared_expert_hidden_size)
    return 3 * h + working + 2 * kv_cache_entries(spec)


def estimate_memory(case: ProfileCase, capacity_gib: float, device: str = "cuda",
                    allowance: Allowance = Allowance()) -> MemoryEstimate:
    return MemoryEstimate([stage_memory(case, s, device, allowance) for s in range(case.parallel.pp)], capacity_gib)


PLANNED_PRESET = "a100-80g"  # what `qlm train --dry-run` sizes against on a machine without a GPU


def planned_memory(recipe: Recipe, plan: RunPlan):
    """The profile's memory estimate of this run per rank (heaviest stage), against this machine's GPU or, without
    one, the a100-80g preset, named as such; and the device's description."""
    if torch.cuda.is_available():
        properties = torch.cuda.get_device_properties(torch.cuda.current_device())
        capacity = properties.total_memory / 2**30
        device = f"this GPU ({properties.name}, {capacity:.0f} GiB)"
    else:
        capacity = GPUS[PLANNED_PRESET].memory_gib
        device = (f"the {PLANNED_PRESET} preset, {capacity:g} GiB (no GPU on this machine; qlm profile RECIPE "
                  f"--gpu NAME for another)")
    case = case_from_recipe(recipe, plan.sizes.world, spec=plan.spec)
    return estimate_memory(case, capacity_gib=capacity), device
