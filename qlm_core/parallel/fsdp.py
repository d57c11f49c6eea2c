"""ZeRO-3: FSDP2 `fully_shard` over the data x context group, composed with qlm's hand-written TP (FSDP only
sees each TP rank's local shards) and with pipelining (torch's schedules drive FSDP's gradient sync). Under expert
parallelism the routed experts of each layer are a unit of their own, sharded over the expert-data-parallel group
(their replicas) instead of dp x cp, as torchtitan shards them.

The ZeRO 3 TrainingOptimizer (parallel/optimizer_api.py), as DistributedOptimizer over GradientBuffers is for
ZeRO 0-2.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from qlm_core.parallel.comm import all_reduce, group_rank, group_size
from qlm_core.parallel.optimizer_api import HostTarget, TrainingOptimizer
from qlm_core.parallel.param_meta import copy_meta, counts_in_grad_norm, meta_of
from qlm_core.parallel.sharded_tensors import local_part, local_shard_like, whole


class FullyShardedState(TrainingOptimizer):
    def __init__(
        self,
        chunks: list[nn.Module],
        units: list[list[nn.Module]],
        param_groups: list[dict],
        *,
        dp_cp_group: ProcessGroup | None,
        tp_group: ProcessGroup | None,
        pp_group: ProcessGroup | None,
        embedding_group: ProcessGroup | None,
        device: torch.device,
        compute_dtype: torch.dtype,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        reduce_dtype: torch.dtype = torch.float32,
        expert_units: list[nn.Module] = (),
        expert_dp_group: ProcessGroup | None = None,
        expert_group: ProcessGroup | None = None,
    ):
        """`units`: per chunk, the submodules to shard separately (the transformer layers); each chunk itself is
        the root unit. `param_groups`: [{"params": [...], "weight_decay": wd}, ...] over the chunks' params.
        `reduce_dtype`: the gradient reduce-scatter's dtype (FSDP casts the reduced shards back to the fp32
        parameters' dtype, so the clip and AdamW see fp32 gradients either way). `expert_units`: with expert
        parallelism, the routed experts' modules (inside `units`), sharded over `expert_dp_group`; their gradient
        norm is summed over `expert_group` (ep x etp)."""
        originals = {id(p): p for c in chunks for p in c.parameters()}
        group_of = {id(p): i for i, g in enumerate(param_groups) for p in g["params"]}
        names = [(c, n, id(p)) for c in chunks for n, p in c.named_parameters()]
        mesh = DeviceMesh.from_group(dp_cp_group, device.type)
        policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=reduce_dtype)
        if expert_units:
            expert_mesh = DeviceMesh.from_group(expert_dp_group, device.type)
            for unit in expert_units:  # before their layers: a layer's unit then leaves their params alone
                fully_shard(unit, mesh=expert_mesh, mp_policy=policy)
        for chunk, chunk_units in zip(chunks, units, strict=True):
            for unit in chunk_units:
                fully_shard(unit, mesh=mesh, mp_policy=policy)
            fully_shard(chunk, mesh=mesh, mp_policy=policy)
        # FSDP averages over its mesh; qlm's loss is pre-normalised so gradients must be summed. (Setting FSDP's
        # divide factor to 1 would need ReduceOp.PREMUL_SUM, which gloo lacks: rescale after the reduction.)
        self.dp_cp_size = mesh.size()
        self.expert_dp_size = group_size(expert_dp_group) if expert_units else self.dp_cp_size
        self.expert_dp_group, self.expert_group = (expert_dp_group, expert_group) if expert_units else (None, None)
        # fully_shard replaces parameters by DTensor parameters: carry qlm's marks and optimizer groups over. Only
        # the trainable ones (those in param_groups) are `params`: frozen LoRA base weights have no optimizer state.
        self.params: list[nn.Parameter] = []
        groups: list[list[nn.Parameter]] = [[] for _ in param_groups]
        for chunk, name, old_id in names:
            param = chunk.get_parameter(name)
            copy_meta(originals[old_id], param)
            if old_id in group_of:
                groups[group_of[old_id]].append(param)
                self.params.append(param)
        self.tp_group, self.pp_group, self.dp_cp_group = tp_group, pp_group, dp_cp_group
        self.embedding_group = embedding_group
        self.optimizer = torch.optim.AdamW(
            [{"params": ps, "weight_decay": g["weight_decay"]} for ps, g in zip(groups, param_groups, strict=True)],
            lr=lr, betas=betas, eps=eps, fused=device.type == "cuda", foreach=device.type != "cuda" or None,
        )

    def zero_grad(self):
        self.optimizer.zero_grad(set_to_none=True)

    def finish_grad_sync(self):
        """FSDP has reduce-scattered over dp x cp; add the TP sum for sequence-parallel replicated params and the
        first/last-stage sum for tied embeddings (local shards correspond: same shapes, same sharding)."""
        for param in self.params:
            meta = meta_of(param)
            if param.grad is None:
                if not meta.shared_embedding:
                    continue
                # a stage's embedding copy that no loss read this step (multi-token prediction not trained) still
                # joins the other stage's all-reduce, and takes its gradient
                param.grad = torch.zeros_like(param)
            replicas = self.expert_dp_size if meta.expert else self.dp_cp_size
            if replicas > 1:
                local_part(param.grad).mul_(replicas)
            if meta.sequence_parallel:
                all_reduce(local_part(param.grad), self.tp_group)
            if meta.shared_embedding:
                all_reduce(local_part(param.grad), self.embedding_group)

    def full_grad(self, param: torch.nn.Parameter) -> torch.Tensor:
        """This rank's whole (TP-local) gradient of `param`, gathered over the data ranks (for inspection)."""
        return whole(param.grad)

    def clip_grad_norm(self, max_norm: float) -> float:
        device = self.params[0].device if self.params else "cpu"
        dense, experts = (torch.zeros((), dtype=torch.float32, device=device) for _ in range(2))
        tp_rank = group_rank(self.tp_group)
        for param in self.params:
            if param.grad is None or not counts_in_grad_norm(param, tp_rank):
                continue
            square = local_part(param.grad).float().pow(2).sum()
            if meta_of(param).expert:
                experts += square
            else:
                dense += square
        for group in (self.dp_cp_group, self.tp_group):
            all_reduce(dense, group)
        for group in (self.expert_dp_group, self.expert_group):
            all_reduce(experts, group)
        total = all_reduce(dense + experts, self.pp_group)
        norm = math.sqrt(total.item())
        if math.isfinite(norm) and max_norm > 0 and norm > max_norm:
            scale = max_norm / (norm + 1e-6)
            for param in self.params:
                if param.grad is not None:
                    local_part(param.grad).mul_(scale)
        return norm

    def step(self):
        self.optimizer.step()

    def wait_param_gather(self):
        """Nothing to wait for: FSDP2 gathers each unit's parameters in its own forward pre-hook."""

    def set_lr(self, lr: float):
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    @torch.no_grad()
    def full_param_states(self, into: HostTarget | None = None) -> tuple[list[dict[str, torch.Tensor]], int]:
        """Per param: whole fp32 master / exp_avg / exp_avg_sq on the CPU (gathered over dp x cp: a collective; one
        param at a time is whole on the device), and the step. `into`: the host tensors to fill, per param."""
        states, step = [], 0
        for index, param in enumerate(self.params):
            state = self.optimizer.state.get(param, {})
            views = [whole(param.detach()).float()]
            views += [whole(state[key]).float() if key in state else None for key in ("exp_avg", "exp_avg_sq")]
            if into is None:
                full = [v.cpu() if v is not None else torch.zeros_like(views[0], device="cpu") for v in views]
            else:
                full = [host.zero_() if value is None else host.copy_(value, non_blocking=True)
                        for host, value in zip(into(index, tuple(views[0].shape)), views, strict=True)]
            if state:
                step = int(state["step"])
            states.append(dict(zip(("master", "exp_avg", "exp_avg_sq"), full, strict=True)))
        return states, step

    @torch.no_grad()
    def load_full_param_states(self, states: list[dict[str, torch.Tensor]], step: int):
        for param, entry in zip(self.params, states, strict=True):
            local_part(param).copy_(local_shard_like(param, entry["master"]))
            if step > 0:
                state = self.optimizer.state[param]
                fused = self.optimizer.defaults.get("fused")
                state["step"] = torch.tensor(float(step), device=local_part(param).device if fused else "cpu")
                state["exp_avg"] = _dtensor_like(param, entry["exp_avg"])
                state["exp_avg_sq"] = _dtensor_like(param, entry["exp_avg_sq"])


def _dtensor_like(param, full: torch.Tensor):
    from torch.distributed.tensor import distribute_tensor

    if not hasattr(param, "device_mesh"):
        return full.to(param.device).clone()
    return distribute_tensor(full.to(param.device).float(), param.device_mesh, param.placements)
