"""AdamW over fp32 master weights with Megatron-style ZeRO sharding (the "distributed optimizer") and a global
gradient-norm clip. Works on the buckets of a GradientBuffers (parallel/grad_buffers.py).

Master weights and Adam states:
  ZeRO 0  one master per param: the param itself when it is fp32, an fp32 copy otherwise (bf16 params);
          its gradient is `param.main_grad`.
  ZeRO 1/2  one master per FRAGMENT = the part of a param inside this dp rank's shard of its bucket (so a param
          has at most one fragment per rank, and its fragments may be spread over several ranks); an fp32 copy
          whose gradient is a view into the bucket's reduced grad shard.
Gradients in bf16/fp16 (GradientBuffers.grad_dtype, recipe parallel.grad_reduce_dtype) are not used as they are:
the first of grad_norm / clip_grad_norm / step of a step copies each bucket's reduced gradient (ZeRO 0: the whole
bucket, ZeRO 1/2: this rank's shard) into an fp32 tensor that the norm, the clip and AdamW read, and step() (or
zero_grad(), when a step is skipped) frees it: no fp32 gradient outlives the update.
After the AdamW update each rank casts its masters into its slices of the bucket param buffers and all-gathers
every bucket over the dp group, so every rank again holds the full params.

Bytes per param element (bf16 params; fp32 params add 2 to the param and, under ZeRO 0, need no master copy;
G = 4 with fp32 gradients, 2 with bf16 ones):
  ZeRO 0  2 param + G grad + 12 master/exp_avg/exp_avg_sq
  ZeRO 1  2 param + G grad + 12/dp
  ZeRO 2  2 param + G/dp grad shard + 12/dp, plus a few transient buckets (parallel/grad_buffers.py)
  with G = 2, while the optimizer steps: + 4 (ZeRO 0) or 4/dp (ZeRO 1/2) for the fp32 copy of the gradients

Param all-gather overlap (`overlap_param_gather`): step() launches one async all-gather per bucket, in forward
order, and returns. A forward pre-hook on each module that owns params (register_param_gather_hooks) waits for
just the buckets holding that module's own params, so gathering overlaps the next forward. A param must be read
first by its owning module (or after it runs). Anything reading params before the next forward (checkpoint save,
eval) calls wait_param_gather() first; step(), state_dict() and load_state_dict() do so themselves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn
from torch.distributed import ProcessGroup

from qlm_core.parallel.comm import all_reduce, group_rank, group_size, start_all_gather, wait
from qlm_core.parallel.grad_buffers import GradientBuffers
from qlm_core.parallel.optimizer_api import OPTIMIZER_VIEWS, HostTarget, TrainingOptimizer
from qlm_core.parallel.param_meta import counts_in_grad_norm

_IMPLEMENTATION_FLAGS = ("foreach", "fused", "capturable", "differentiable")


def has_fused_adamw(device: torch.device) -> bool:
    """Whether torch has a fused AdamW kernel for `device` (CUDA and, since torch 2.4, CPU: one kernel per tensor
    instead of foreach's chain of ops, several times faster on CPU; it equals foreach to fp32 rounding)."""
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    return device.type in _get_fused_kernels_supported_devices()


@dataclass
class _Fragment:
    param_index: int  # position of the param in GradientBuffers.params
    param: nn.Parameter
    start: int  # [start, end) of the param's flattened elements held by this fragment
    end: int
    master: torch.Tensor  # fp32; the param itself for an fp32 param under ZeRO 0
    grad: torch.Tensor  # what the norm, clip and update read: model_grad, or its fp32 copy at step time
    counts_in_norm: bool  # param_meta.counts_in_grad_norm
    model_grad: torch.Tensor  # the reduced gradient in GradientBuffers.grad_dtype, same shape as master
    bucket_index: int
    grad_range: tuple[int, int]  # [lo, hi) of model_grad in the bucket's reduced gradient (see _reduced_grad)

    @property
    def master_is_param(self) -> bool:
        return self.master is self.param


class DistributedOptimizer(TrainingOptimizer):
    """torch.optim.AdamW (decoupled weight decay) over fp32 masters of the params in `grad_buffers`, and the
    gradient synchronisation of `grad_buffers` (the ZeRO 0-2 TrainingOptimizer).

    `param_groups`: [{"params": [...], "weight_decay": wd, ...}] covering every param of grad_buffers exactly
    once; extra keys go to torch's param group as they are. With `overlap_param_gather`, pass `model_chunks` (or
    call register_param_gather_hooks once) so that forward waits for the gathered params.
    """

    def __init__(
        self,
        param_groups,
        grad_buffers: GradientBuffers,
        *,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        overlap_param_gather: bool = False,
        tp_group: ProcessGroup | None = None,
        pp_group: ProcessGroup | None = None,
        model_chunks=None,
        expert_group: ProcessGroup | None = None,
    ):
        """`expert_group`: with expert parallelism, the ep x etp ranks the experts' gradient norm is summed over
        (their data-parallel group is grad_buffers.expert_dp_group)."""
        self.buffers = grad_buffers
        self.params = grad_buffers.params
        self.zero_stage = grad_buffers.zero_stage
        self.dp_group, self.tp_group, self.pp_group = grad_buffers.dp_group, tp_group, pp_group
        self.expert_group, self.expert_dp_group = expert_group, grad_buffers.expert_dp_group
        self.overlap_param_gather = overlap_param_gather and self.zero_stage >= 1
        self.copy_grads = grad_buffers.grad_dtype != torch.float32  # fp32 copies at step time (module docstring)
        self._grads_copied = False
        self._gather_work: dict[int, object] = {}
        self._gather_hooks: list = []
        index_of = {id(p): i for i, p in enumerate(grad_buffers.params)}
        seen: set[int] = set()
        torch_groups, self._fragments = [], []
        for group in param_groups:
            group = dict(group)
            params = list(group.pop("params"))
            masters = []
            for p in params:
                if id(p) not in index_of:
                    raise ValueError(f"a param of shape {tuple(p.shape)} is in param_groups, not in GradientBuffers")
                if id(p) in seen:
                    raise ValueError(f"param {index_of[id(p)]} appears in two param groups")
                seen.add(id(p))
                for fragment in self._make_fragments(index_of[id(p)], p):
                    self._fragments.append(fragment)
                    masters.append(fragment.master)
            torch_groups.append({"params": masters, **group})
        if len(seen) != len(index_of):
            missing = sorted(i for i, p in enumerate(grad_buffers.params) if id(p) not in seen)
            raise ValueError(f"params {missing} of GradientBuffers are in no param group")
        fused = has_fused_adamw(grad_buffers.device)
        self.optimizer = torch.optim.AdamW(
            torch_groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
            fused=True if fused else None, foreach=None if fused else True,
        )
        if self.overlap_param_gather and model_chunks is not None:
            self.register_param_gather_hooks(model_chunks)

    def _make_fragments(self, index: int, param: nn.Parameter) -> list[_Fragment]:
        counts = counts_in_grad_norm(param, group_rank(self.tp_group))
        bucket = self.buffers.bucket_of[id(param)]
        lo, hi = bucket.param_range(param)
        if self.zero_stage == 0:
            if param.dtype == torch.float32:
                master = param
            else:
                master = param.detach().float().clone()
                if not self.copy_grads:  # else step() lends it the fp32 copy
                    master.grad = param.main_grad
            return [_Fragment(index, param, 0, param.numel(), master, param.main_grad, counts, param.main_grad,
                              bucket.index, (lo, hi))]
        shard_lo, shard_hi = bucket.layout.shard_range(bucket.dp_rank, bucket.dp_size)
        start, end = max(lo, shard_lo), min(hi, shard_hi)
        if start >= end:
            return []
        master = param.detach().reshape(-1)[start - lo : end - lo].float().clone()
        grad = bucket.grad_shard[start - shard_lo : end - shard_lo]
        if not self.copy_grads:
            master.grad = grad
        return [_Fragment(index, param, start - lo, end - lo, master, grad, counts, grad, bucket.index,
                          (start - shard_lo, end - shard_lo))]

    def _reduced_grad(self, bucket) -> torch.Tensor:
        """The flat reduced gradient this rank updates from: the whole bucket (ZeRO 0) or its shard (ZeRO 1/2)."""
        return bucket.grad_data if self.zero_stage == 0 else bucket.grad_shard

    @torch.no_grad()
    def _copy_grads_to_fp32(self):
        """Non-fp32 gradients: point every fragment's `grad` at an fp32 copy of its reduced gradient, one copy per
        bucket, once per step (the norm, the clip and the update then all read the same fp32 values)."""
        if not self.copy_grads or self._grads_copied:
            return
        copies = {}
        for f in self._fragments:
            if f.bucket_index not in copies:
                copies[f.bucket_index] = self._reduced_grad(self.buffers.buckets[f.bucket_index]).float()
            lo, hi = f.grad_range
            f.grad = copies[f.bucket_index][lo:hi].view_as(f.master)
        self._grads_copied = True

    def _free_fp32_grads(self):
        if self._grads_copied:
            for f in self._fragments:
                f.grad = f.model_grad
            self._grads_copied = False

    # ---- gradient norm -----------------------------------------------------------------------------------------------

    @torch.no_grad()
    def grad_norm(self) -> float:
        """L2 norm over every unique gradient element of the model (all dp/tp/pp ranks), in fp32. Dense params sum
        over (ZeRO: dp and) tp, the routed experts' under expert parallelism over (ZeRO: edp and) ep x etp."""
        self._copy_grads_to_fp32()
        squares = torch.zeros(2, dtype=torch.float32, device=self.buffers.device)  # dense, experts
        for domain in (0, 1):
            grads = [f.grad for f in self._fragments
                     if f.counts_in_norm and self.buffers.buckets[f.bucket_index].layout.expert == bool(domain)]
            if grads:
                squares[domain] = torch.stack(torch._foreach_norm(grads)).square().sum()
        if self.expert_dp_group is None:
            total = squares.sum()
            if self.zero_stage >= 1:
                all_reduce(total, self.dp_group)
            all_reduce(total, self.tp_group)
        else:
            dense, experts = squares[0].clone(), squares[1].clone()
            if self.zero_stage >= 1:
                all_reduce(dense, self.dp_group)
                all_reduce(experts, self.expert_dp_group)
            all_reduce(dense, self.tp_group)
            all_reduce(experts, self.expert_group)
            total = dense + experts
        all_reduce(total, self.pp_group)
        return total.sqrt().item()

    @torch.no_grad()
    def clip_grad_norm(self, max_norm: float) -> float:
        """Scale every held gradient by max_norm / (norm + 1e-6) when the global norm exceeds max_norm (> 0; 0
        only measures); returns the norm before clipping. A non-finite norm is returned unclipped: skip step()
        and call zero_grad()."""
        norm = self.grad_norm()
        if math.isfinite(norm) and 0 < max_norm < norm:
            torch._foreach_mul_([f.grad for f in self._fragments], max_norm / (norm + 1e-6))
        return norm

    # ---- update ------------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self):
        """AdamW on the masters, then the updated values go into the model params (and are all-gathered)."""
        if self.overlap_param_gather and not self._gather_hooks:
            raise RuntimeError(
                "overlap_param_gather needs forward pre-hooks that wait for the gathered params: pass "
                "model_chunks= to DistributedOptimizer or call register_param_gather_hooks(model_chunks) once"
            )
        self.wait_param_gather()
        self._copy_grads_to_fp32()
        lent = [f for f in self._fragments if f.master_is_param or self.copy_grads]
        for f in lent:
            f.master.grad = f.grad
        self.optimizer.step()
        for f in lent:
            f.master.grad = None
        self._free_fp32_grads()
        self._copy_masters_to_params(async_gather=self.overlap_param_gather)

    def _copy_masters_to_params(self, async_gather: bool):
        for f in self._fragments:
            if not f.master_is_param:
                f.param.detach().view(-1)[f.start : f.end].copy_(f.master.view(-1))
        if self.zero_stage == 0:
            return
        for bucket in reversed(self.buffers.buckets):  # forward order: the last bucket holds the first params
            lo, hi = bucket.layout.shard_range(bucket.dp_rank, bucket.dp_size)
            work = start_all_gather(bucket.param_data, bucket.param_data[lo:hi], bucket.group)
            if work is not None:
                self._gather_work[bucket.index] = work
        if not async_gather:
            self.wait_param_gather()

    def wait_param_gather(self, bucket_indices=None):
        """Wait for the all-gathers of these buckets (default: all) launched by the last step()."""
        for index in list(self._gather_work) if bucket_indices is None else bucket_indices:
            wait(self._gather_work.pop(index, None))

    def register_param_gather_hooks(self, model_chunks) -> list:
        """Forward pre-hooks that wait, module by module, for the buckets holding the module's own params.
        `model_chunks`: a module or a list of them (virtual pipeline chunks). Returns the hook handles."""
        chunks = [model_chunks] if isinstance(model_chunks, nn.Module) else list(model_chunks)
        for chunk in chunks:
            for module in chunk.modules():
                owned = {self.buffers.bucket_of[id(p)].index for p in module.parameters(recurse=False)
                         if id(p) in self.buffers.bucket_of}
                if owned:
                    hook = partial(self._wait_before_forward, tuple(sorted(owned)))
                    self._gather_hooks.append(module.register_forward_pre_hook(hook))
        return self._gather_hooks

    @property
    def pending_param_gathers(self) -> int:
        """Buckets whose all-gather was launched by step() and not yet waited for."""
        return len(self._gather_work)

    def _wait_before_forward(self, bucket_indices, module, args):
        if self._gather_work:
            self.wait_param_gather(bucket_indices)

    def set_lr(self, lr: float):
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def zero_grad(self):
        self._free_fp32_grads()
        self.buffers.zero_grad()

    def finish_grad_sync(self):
        self.buffers.finish_grad_sync()

    def full_grad(self, param: nn.Parameter) -> torch.Tensor:
        return self.buffers.full_grad(param)

    # ---- checkpoint --------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def full_param_states(self, into: HostTarget | None = None) -> tuple[list[dict[str, torch.Tensor]], int]:
        """Per param of GradientBuffers.params: its whole fp32 master, exp_avg and exp_avg_sq (OPTIMIZER_VIEWS),
        shaped like the param, on the CPU (ZeRO 1/2: assembled over the dp group, a collective every dp rank must
        call), and the step count. Layout-independent: a checkpoint of it can be re-sharded to any TP/PP/DP.
        One param at a time is whole on the device (collectives per param). `into`: the host tensors each
        param's views go into (reused buffers of an asynchronous save), else fresh tensors."""
        self.wait_param_gather()
        device = self.buffers.device
        fragments = [[] for _ in self.buffers.params]
        step = 0
        for f in self._fragments:
            fragments[f.param_index].append(f)
            if state := self.optimizer.state.get(f.master):
                step = int(state["step"])
        if self.zero_stage >= 1:
            step_tensor = torch.tensor(float(step), device=device)
            all_reduce(step_tensor, self.dp_group, op=torch.distributed.ReduceOp.MAX)
            all_reduce(step_tensor, self.expert_dp_group, op=torch.distributed.ReduceOp.MAX)
            step = int(step_tensor.item())
        states = []
        for param, own in zip(self.buffers.params, fragments, strict=True):
            if into is not None and device.type == "cpu":  # assembled in the host buffers themselves
                views = [view.zero_() for view in into(len(states), tuple(param.shape))]
            else:
                views = list(torch.zeros(len(OPTIMIZER_VIEWS), *param.shape, dtype=torch.float32, device=device))
            for f in own:
                state = self.optimizer.state.get(f.master, {})
                for row, value in enumerate((f.master, state.get("exp_avg"), state.get("exp_avg_sq"))):
                    if value is not None:
                        views[row].view(-1)[f.start:f.end] = value.reshape(-1)
            if self.zero_stage >= 1:  # fragments are disjoint across dp ranks: a sum assembles them
                for view in views:
                    all_reduce(view, self.buffers.bucket_of[id(param)].group)
            if into is None:
                views = [view.cpu() for view in views]
            elif device.type != "cpu":
                views = [host.copy_(view, non_blocking=True)
                         for host, view in zip(into(len(states), tuple(param.shape)), views, strict=True)]
            states.append(dict(zip(OPTIMIZER_VIEWS, views, strict=True)))
        return states, step

    @torch.no_grad()
    def load_full_param_states(self, states: list[dict[str, torch.Tensor]], step: int):
        """Inverse of full_param_states (whole tensors per param, in GradientBuffers.params order): each rank
        keeps its fragments, and the masters are written into the model params (gathered over dp)."""
        self.wait_param_gather()
        step_device = None if self.optimizer.defaults.get("fused") else torch.device("cpu")  # torch's convention

        def piece(f, tensor):
            return tensor.reshape(-1)[f.start:f.end].to(f.master.device).clone().view_as(f.master)

        for f in self._fragments:
            entry = states[f.param_index]
            f.master.view(-1).copy_(entry["master"].reshape(-1)[f.start:f.end])
            if step > 0:
                state = self.optimizer.state[f.master]
                state["step"] = torch.tensor(float(step), device=step_device or f.master.device)
                state["exp_avg"], state["exp_avg_sq"] = piece(f, entry["exp_avg"]), piece(f, entry["exp_avg_sq"])
        self._copy_masters_to_params(async_gather=False)

    def state_dict(self) -> dict:
        """This rank's masters and Adam states, one entry per fragment, keyed by the param's index in
        GradientBuffers.params and the [start, end) range of its flattened elements. Tensors are references
        (save them before the next step)."""
        self.wait_param_gather()
        fragments = []
        for f in self._fragments:
            entry = {"param_index": f.param_index, "param_shape": tuple(f.param.shape), "start": f.start,
                     "end": f.end, "master": f.master.detach().reshape(-1)}
            state = self.optimizer.state.get(f.master, {})
            if state:
                entry.update(step=state["step"], exp_avg=state["exp_avg"].reshape(-1),
                             exp_avg_sq=state["exp_avg_sq"].reshape(-1))
            fragments.append(entry)
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        return {"format": "qlm-distributed-optimizer-1", "zero_stage": self.zero_stage,
                "dp_rank": self.buffers.dp_rank, "dp_size": self.buffers.dp_size,
                "expert_dp_size": group_size(self.expert_dp_group),
                "param_groups": groups, "fragments": fragments}

    @torch.no_grad()
    def load_state_dict(self, state: dict):
        """Restore masters and Adam states saved by state_dict() with the same layout, and write the masters into
        the model params (an all-gather over dp under ZeRO 1/2: every dp rank must call it)."""
        self.wait_param_gather()
        mine = [(f.param_index, f.start, f.end) for f in self._fragments]
        saved = [(e["param_index"], e["start"], e["end"]) for e in state["fragments"]]
        saved_layout = (state["zero_stage"], state["dp_size"], state.get("expert_dp_size", 1))
        if saved_layout != (self.zero_stage, self.buffers.dp_size, group_size(self.expert_dp_group)) or mine != saved:
            raise ValueError(
                f"optimizer state layout differs (saved ZeRO {state['zero_stage']} dp {state['dp_size']}, "
                f"{len(saved)} fragments; here ZeRO {self.zero_stage} dp {self.buffers.dp_size}, {len(mine)}): "
                "re-shard it offline from the saved param_index/start/end ranges"
            )
        torch_state = {}
        for k, (f, entry) in enumerate(zip(self._fragments, state["fragments"], strict=True)):
            f.master.detach().copy_(entry["master"].view_as(f.master))
            if "exp_avg" in entry:
                torch_state[k] = {"step": entry["step"], "exp_avg": entry["exp_avg"].view_as(f.master),
                                  "exp_avg_sq": entry["exp_avg_sq"].view_as(f.master)}
        sizes = [len(g["params"]) for g in self.optimizer.param_groups]
        if len(state["param_groups"]) != len(sizes):
            raise ValueError(f"saved {len(state['param_groups'])} param groups, this optimizer has {len(sizes)}")
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        groups = [  # hyperparameters from the file, implementation flags (fused/foreach) from this device
            {**stored, **{k: live[k] for k in _IMPLEMENTATION_FLAGS if k in live}, "params": list(range(s, s + n))}
            for stored, live, s, n in zip(state["param_groups"], self.optimizer.param_groups, starts, sizes,
                                          strict=True)
        ]
        self.optimizer.load_state_dict({"state": torch_state, "param_groups": groups})
        self._copy_masters_to_params(async_gather=False)
