"""LoRA on the tensor-parallel linears: y = base(x) + (alpha / r) * B(A(dropout(x))), with the base frozen.

Each targeted linear gains `lora_A` / `lora_B` children (state_dict `<linear>.lora_A.weight`), sharded as in
ModelLayout.lora_tensors, and only rank-sized activations cross the TP group:
  column-parallel (linear_qkv, linear_fc1; W [out/t, in]): A [r, in] replicated, B [out/t, r].
      SP: A on the local sequence shard, then all-gather the [s/t, b, r] result (bwd: reduce-scatter).
      no SP: A reads the same copy_to_tp(x) as W, so the one backward all-reduce of the input gradient covers
      both paths and nothing else is sent.
      Either way A's gradient is a partial sum per TP rank (of the sequence shards, or of the output slices):
      A is marked `sequence_parallel` (parallel/param_meta.py) so that GradientBuffers sums it over TP.
  row-parallel (linear_proj, linear_fc2; W [out, in/t]): A [r, in/t] split like W's columns, B [out, r]
      replicated. A(x) is a partial sum: all-reduce it (SP: reduce-scatter to sequence shards) before B. B's
      gradient needs the TP sum only under SP (each rank then saw only its sequence shard).
Dropout masks are drawn per rank. Without SP a column-parallel layer's TP ranks thus drop different entries of
the same input, each for its own output slice: a different draw than one process makes, but A's summed gradient
is still exact for it, so A's replicas stay identical.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from qlm_core.checkpoint.formats.megatron.lora_args import LoraSettings, check_targets, is_adapter_name, lora_scale
from qlm_core.checkpoint.sources.lora import LoraInitSource
from qlm_core.errors import QlmError
from qlm_core.models.gpt import GPTModel, ParallelOptions
from qlm_core.models.layout import (
    LORA_TARGETS,
    ModelLayout,
    TensorSource,
    read_shard_tensor,
)
from qlm_core.parallel.comm import group_rank, group_size
from qlm_core.parallel.param_meta import mark
from qlm_core.parallel.sharded_tensors import local_part, local_shard_like, whole
from qlm_core.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    copy_to_tp,
    gather_from_sp,
    reduce_from_tp,
    reduce_scatter_to_sp,
)


class LoraColumnParallelLinear(ColumnParallelLinear):
    def local_forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's output columns with the adapter's (ColumnParallelLinear.forward gathers them when it
        gathers its output: multi-latent attention's down projections)."""
        if not self.lora_scale:  # adapters_disabled: the frozen base alone
            return super().local_forward(x, weight)
        if self.sequence_parallel:
            low = gather_from_sp(self.lora_A(self.lora_dropout(x)), self.tp_group)
            return super().local_forward(x, weight) + self.lora_scale * self.lora_B(low)
        x = copy_to_tp(x, self.tp_group)  # shared by W and A: its backward all-reduce serves both
        out = F.linear(x, self.weight if weight is None else weight)
        out = out + self.lora_scale * self.lora_B(self.lora_A(self.lora_dropout(x)))
        return out + self.bias if self.bias is not None else out


class LoraRowParallelLinear(RowParallelLinear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.lora_scale:  # adapters_disabled: the frozen base alone
            return super().forward(x)
        low = self.lora_A(self.lora_dropout(x))
        low = reduce_scatter_to_sp(low, self.tp_group) if self.sequence_parallel else reduce_from_tp(low, self.tp_group)
        return super().forward(x) + self.lora_scale * self.lora_B(low)


@contextmanager
def adapters_disabled(chunks: list[nn.Module]):
    """Inside: every LoRA linear of `chunks` computes its frozen base alone (the reference model of preference
    training, with no second copy of the weights)."""
    linears = [m for chunk in chunks for m in chunk.modules()
               if isinstance(m, (LoraColumnParallelLinear, LoraRowParallelLinear))]
    scales = [m.lora_scale for m in linears]
    for m in linears:
        m.lora_scale = 0.0
    try:
        yield
    finally:
        for m, scale in zip(linears, scales, strict=True):
            m.lora_scale = scale


def _factor(weight: torch.Tensor) -> nn.Linear:
    """An nn.Linear holding `weight` [out, in] (no bias)."""
    holder = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta", dtype=weight.dtype)
    holder.weight = nn.Parameter(weight)
    return holder


def _add_adapter(linear: nn.Module, a: torch.Tensor, b: torch.Tensor, settings: LoraSettings):
    """Turn `linear` into its LoRA subclass in place: same parameters (and anything holding the module), plus A, B."""
    column = isinstance(linear, ColumnParallelLinear)
    if not column and not isinstance(linear, RowParallelLinear):
        raise TypeError(f"LoRA targets tensor-parallel linears, not {type(linear).__name__}")
    linear.__class__ = LoraColumnParallelLinear if column else LoraRowParallelLinear
    linear.lora_A, linear.lora_B = _factor(a), _factor(b)
    linear.lora_dropout = nn.Dropout(settings.dropout) if settings.dropout > 0 else nn.Identity()
    linear.lora_scale = lora_scale(settings)
    if column:
        mark(linear.lora_A.weight, sequence_parallel=True)
        mark(linear.lora_B.weight, tp_split=True)
    else:
        mark(linear.lora_A.weight, tp_split=True)
        mark(linear.lora_B.weight, sequence_parallel=linear.sequence_parallel)


def adapted_linears(chunk: GPTModel, targets) -> list[tuple[int, str, nn.Module]]:
    """(global layer, target, module) for each targeted linear of `chunk`, in state_dict order (an MoE layer's MLP
    targets are its shared expert's linears, ModelLayout.lora_linear)."""
    layout = ModelLayout(chunk.spec, padded_vocab=chunk.padded_vocab)
    out = []
    for local, layer in enumerate(chunk.decoder.layers):
        for target in LORA_TARGETS:
            linear = layout.lora_linear(chunk.layer_offset + local, target) if target in targets else None
            if linear is not None:
                out.append((chunk.layer_offset + local, target, layer.get_submodule(linear)))
    return out


def apply_lora(chunks: list[GPTModel], config: LoraSettings, parallel_options: ParallelOptions,
               seed: int = 1234) -> list[nn.Parameter]:
    """Freeze every parameter of `chunks`, add adapters (initialised as LoraInitSource(seed), this rank's shards)
    to the target linears, and return the adapter parameters in the chunks' parameter order."""
    targets = check_targets(config)
    if chunks:
        spec = chunks[0].spec
        whole = ModelLayout(spec)
        if not any(whole.lora_linear(layer, t) for layer in range(spec.num_layers) for t in targets):
            raise QlmError(f"the LoRA target modules {targets} adapt no linear of this {spec.model_type} model",
                           "choose from the linears it has (multi-latent attention: linear_q_down_proj, "
                           "linear_q_up_proj, linear_kv_down_proj, linear_kv_up_proj, linear_proj; else "
                           "linear_qkv, linear_proj; and linear_fc1, linear_fc2)")
    tp, tp_rank = group_size(parallel_options.tp_group), group_rank(parallel_options.tp_group)
    init = LoraInitSource(seed)
    for chunk in chunks:
        chunk.requires_grad_(False)
        layout = ModelLayout(chunk.spec, tp=tp, padded_vocab=chunk.padded_vocab)
        for layer, target, linear in adapted_linears(chunk, targets):
            a, b = layout.lora_tensors(layer, config.rank, [target])
            base = linear.weight
            shards = [read_shard_tensor(t, tp, tp_rank, init, base.dtype).to(base.device) for t in (a, b)]
            _add_adapter(linear, *shards, config)
    return [p for chunk in chunks for p in chunk.parameters() if p.requires_grad]


def lora_state_dict(chunk: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's adapter shards of one chunk under their state_dict names (what a LoRA run's checkpoint holds).
    Under ZeRO-3 the parameters are gathered over the data ranks: a collective, every rank calls it."""
    return {
        name: whole(value)
        for name, value in chunk.state_dict().items()
        if is_adapter_name(name)
    }


@torch.no_grad()
def load_lora_state(chunks: list[GPTModel], source: TensorSource):
    """Fill the adapters of `chunks` (built by apply_lora) with this rank's shards of `source`'s global adapter
    tensors, whatever TP/PP layout `source` was saved with. This sets the parameters only: an optimizer with
    separate fp32 masters (ZeRO 1/2, or bf16 parameters) built before keeps its old masters."""
    for chunk in chunks:
        tp, tp_rank = group_size(chunk.tp_group), group_rank(chunk.tp_group)
        layout = ModelLayout(chunk.spec, tp=tp, padded_vocab=chunk.padded_vocab)
        for layer, target, linear in adapted_linears(chunk, list(LORA_TARGETS)):
            if not hasattr(linear, "lora_A"):
                continue
            for tensor, factor in zip(layout.lora_tensors(layer, linear.lora_A.weight.shape[0], [target]),
                                      (linear.lora_A, linear.lora_B), strict=True):
                _copy_into(factor.weight, read_shard_tensor(tensor, tp, tp_rank, source, factor.weight.dtype))


def _copy_into(param: torch.Tensor, value: torch.Tensor):
    local_part(param).copy_(local_shard_like(param, value))  # ZeRO-3: this data rank's part of the DTensor
