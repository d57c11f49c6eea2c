"""Measure what a model really keeps: activation bytes saved for backward, and model-state bytes.

Activations (any device) are counted with torch.autograd.graph.saved_tensors_hooks, each storage once
(docs/ARCHITECTURE.md §3), parameters skipped. Recomputation hides a checkpointed region's tensors from outer hooks
(torch's non-reentrant checkpoint keeps its own), so the meter also wraps models.gpt's and models.mtp's `checkpoint`
to count the inputs a checkpoint keeps instead (and, under a per-op policy, the outputs it caches), and
`discard_output` to drop what an output-discarding checkpoint frees. A saved tensor stays live until autograd releases
it; the meter tracks live bytes over time and records the peak (which is what pipeline schedules and gradient
accumulation decide), split by region: `layers` (labelled per transformer layer), `embedding`, `mtp` (multi-token
prediction's layers) and `head` (final norm, output layer, loss: every depth's).

AllocationMeter measures everything else too (receive buffers, gradients, transients): the peak bytes of tensors
allocated on a device while it is entered, beyond what was allocated when it was entered. CUDA:
torch.cuda.max_memory_allocated(); CPU: the allocation and free events of torch's profiler (profile_memory), summed
in time order. LargestTensor: the most elements of any one tensor an op returns (nothing of s^2 on a long row).
"""

from __future__ import annotations

import gc
import weakref
from collections import defaultdict
from contextlib import contextmanager

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode


def _storage(t: torch.Tensor) -> tuple[int, int]:
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


class SavedTensorMeter:
    """Use as a context manager around forward (and backward) passes of `modules` (one or more model chunks)."""

    def __init__(self, modules: list[nn.Module] | nn.Module):
        self.modules = [modules] if isinstance(modules, nn.Module) else list(modules)
        self.label = "other"
        self.labels: dict[int, str] = {}  # id(module) -> label, for the checkpoint wrapper
        self.first_seen: dict[str, int] = defaultdict(int)  # bytes by the label active when a storage was first saved
        self.live: dict[int, list] = {}  # storage ptr -> [bytes, label, live references]
        self.live_bytes = 0
        self.peak_bytes = 0
        self.peak_by_region: dict[str, int] = {}
        self._handles = []

    # ---- labels ------------------------------------------------------------------------------------------------------

    def _set(self, label):
        def hook(module, args, *rest):
            self.label = label
        return hook

    def _attach(self):
        for c, chunk in enumerate(self.modules):
            prefix = f"c{c}." if len(self.modules) > 1 else ""
            embedding = getattr(chunk, "embedding", None)
            if embedding is not None:
                self._handles.append(embedding.register_forward_pre_hook(self._set("embedding")))
            for i, layer in enumerate(chunk.decoder.layers):
                label = f"{prefix}layer{i}"
                self.labels[id(layer)] = label
                self._handles.append(layer.register_forward_pre_hook(self._set(label)))
                self._handles.append(layer.register_forward_hook(self._set("other")))
            for name in ("final_layernorm",):
                module = getattr(chunk.decoder, name, None)
                if module is not None:
                    self._handles.append(module.register_forward_pre_hook(self._set("head")))
            mtp = getattr(chunk, "mtp", None)
            if mtp is not None:  # multi-token prediction's layers ("mtp"; their embedding "embedding"), then the loss
                for layer in mtp.layers:
                    self.labels[id(layer)] = f"{prefix}mtp"
                    self._handles.append(layer.register_forward_pre_hook(self._set(f"{prefix}mtp")))
                self._handles.append(mtp.register_forward_hook(self._set("head")))

    # ---- counting ----------------------------------------------------------------------------------------------------

    def _param_storages(self) -> set[int]:
        params = (p for m in self.modules for p in m.parameters())
        return {(p.to_local() if hasattr(p, "to_local") else p).untyped_storage().data_ptr() for p in params}

    def _release(self, ptr: int, entry: list):
        entry[2] -= 1
        if entry[2] == 0:
            self.live_bytes -= entry[0]
            if self.live.get(ptr) is entry:
                del self.live[ptr]

    def _register(self, tensor: torch.Tensor, label: str):
        if isinstance(tensor, nn.Parameter) or tensor.device.type == "meta":
            return
        ptr, nbytes = _storage(tensor)
        if ptr in self._params or nbytes == 0:
            return
        entry = self.live.get(ptr)
        if entry is None:
            entry = self.live[ptr] = [nbytes, label, 0]
            self.live_bytes += nbytes
            self.first_seen[label] += nbytes
            if self.live_bytes > self.peak_bytes:
                self.peak_bytes = self.live_bytes
                self.peak_by_region = self.by_region()
        entry[2] += 1
        weakref.finalize(tensor, self._release, ptr, entry)

    def _pack(self, tensor: torch.Tensor):
        alias = tensor.detach()  # what autograd keeps; holding the alias (not the output itself) avoids a cycle
        if tensor.is_leaf and tensor.requires_grad and _storage(tensor)[0] not in self._params:
            # FSDP2 swaps in freshly gathered parameters for each forward: look again before counting a leaf
            self._params = self._param_storages()
        self._register(alias, self.label)
        return alias

    def by_region(self) -> dict[str, int]:
        regions = defaultdict(int)
        for nbytes, label, _ in self.live.values():
            regions["layers" if "layer" in label else label] += nbytes
        return dict(regions)

    def layer_bytes(self) -> dict[str, int]:
        """Bytes first saved inside each transformer layer (a forward without backward: what each layer keeps)."""
        return {k: v for k, v in self.first_seen.items() if "layer" in k}

    def _discard(self, tensor: torch.Tensor):
        """models.gpt.discard_output freed this storage: it no longer counts (its bytes come back in backward)."""
        ptr = _storage(tensor)[0]
        entry = self.live.pop(ptr, None)  # its address may be reused before the tensors that held it die
        if entry is not None:
            self.live_bytes -= entry[0]
            self.first_seen[entry[1]] -= entry[0]
            entry[0] = 0

    @contextmanager
    def _checkpoint_counted(self):
        """A checkpoint keeps its inputs and, under a selective-checkpointing policy (recompute = "op"), the op
        outputs its forward context caches; both are hidden from the outer hooks, so count them here."""
        from torch.utils._pytree import tree_leaves

        from qlm_core.models import gpt, mtp

        original, original_discard = gpt.checkpoint, gpt.discard_output

        def counted(fn, *args, **kwargs):
            label = self.labels.get(id(fn), self.label)
            grad = torch.is_grad_enabled()
            for arg in tree_leaves(list(args)):  # a layer's positions come as a tuple
                if isinstance(arg, torch.Tensor) and grad:
                    self._register(arg, label)
            contexts = []
            if "context_fn" in kwargs:
                make = kwargs["context_fn"]

                def context_fn():
                    contexts.append(make())
                    return contexts[-1]
                kwargs = {**kwargs, "context_fn": context_fn}
            out = original(fn, *args, **kwargs)
            for forward_context, _ in contexts:
                for entries in forward_context.storage.values():
                    for leaf in tree_leaves(list(entries.values()) if isinstance(entries, dict) else entries):
                        value = getattr(leaf, "val", None)
                        if isinstance(value, torch.Tensor):
                            self._register(value, label)
            return out

        def discard(output, consumer_output, recompute):
            if consumer_output.requires_grad:
                self._discard(output)
            return original_discard(output, consumer_output, recompute)

        gpt.checkpoint, gpt.discard_output, mtp.checkpoint = counted, discard, counted
        try:
            yield
        finally:
            gpt.checkpoint, gpt.discard_output, mtp.checkpoint = original, original_discard, original

    def __enter__(self):
        self._params = self._param_storages()
        self._attach()
        self._checkpoint = self._checkpoint_counted()
        self._checkpoint.__enter__()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda alias: alias)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        self._checkpoint.__exit__(*exc)
        for handle in self._handles:
            handle.remove()
        self._handles = []
        return False


class AllocationMeter:
    """`with AllocationMeter(device) as meter: ...`, then `meter.peak`: peak bytes allocated on `device` inside the
    block above what was allocated on entering it (see the module docstring)."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.peak = 0

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.device.type == "cpu":
            from torch.profiler import ProfilerActivity, profile

            # torch's CPU reporter remembers blocks allocated while any profiler ran: one of an earlier meter's that
            # is collected in this one would count as a free here
            gc.collect()
            self._profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self._profiler.__enter__()
        else:
            raise ValueError(f"AllocationMeter measures cuda or cpu tensors, not {self.device.type}")
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device) - self._start
            return False
        self._profiler.__exit__(*exc)
        events = [e for e in self._profiler.profiler.kineto_results.events()
                  if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU]
        live = 0
        for event in sorted(events, key=lambda e: e.start_ns()):
            live += event.nbytes()
            self.peak = max(self.peak, live)
        return False


class ExpertLoadMeter:
    """Rows each expert-parallel MoE layer of `modules` sends and receives on this rank, per forward outside
    backward (a recompute re-runs the same dispatch): `with ExpertLoadMeter(chunks) as meter: step`, then
    meter.load, the rows received over the rows sent (1.0 when every rank receives what it sends: balanced).
    A pair routed to EP rank d is received once by each of d's etp ranks, so this rank receives what every rank
    of its expert group routed to its EP rank; one all-reduce of ep counts per layer and forward finds it (every
    rank of the group runs the layer's dispatch at the same point, so this collective cannot deadlock)."""

    def __init__(self, modules: list[nn.Module] | nn.Module):
        from qlm_core.models.moe import SequentialExperts

        chunks = [modules] if isinstance(modules, nn.Module) else list(modules)
        self.experts = [m for chunk in chunks for m in chunk.modules()
                        if isinstance(m, SequentialExperts) and m.parallel is not None]
        self.sent = self.received = 0
        self.calls: list[tuple[int, int]] = []  # (sent, received) per layer forward
        self._handles = []

    def _hook(self, module, args):
        import torch.distributed as dist

        if torch._C._current_graph_task_id() != -1:  # recomputation inside backward
            return
        indices, p = args[2], module.parallel
        counts = torch.bincount(indices.reshape(-1), minlength=module.moe.num_experts).view(p.ep, -1).sum(1)
        if p.group is not None and dist.get_world_size(p.group) > 1:
            dist.all_reduce(counts, group=p.group)
        totals = counts.tolist()
        ep_rank = dist.get_rank(p.group) // p.etp if p.group is not None else 0  # group rank d·etp + j
        sent, received = p.etp * indices.numel(), int(totals[ep_rank])
        if p.group is None or dist.get_world_size(p.group) == 1:  # one rank: it receives what it sends
            received = sent
        self.calls.append((sent, received))
        self.sent += sent
        self.received += received

    @property
    def load(self) -> float | None:
        return self.received / self.sent if self.sent else None

    def __enter__(self):
        self._handles = [m.register_forward_pre_hook(self._hook) for m in self.experts]
        return self

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()
        self._handles = []
        return False


def unique_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (DTensors by their local shard)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        if hasattr(t, "to_local"):
            t = t.to_local()
        ptr, nbytes = _storage(t)
        seen[ptr] = nbytes
    return sum(seen.values())


def model_state_tensors(engine) -> dict[str, list[torch.Tensor]]:
    """The tensors behind an Engine's weights (a preference run's frozen reference copy included; with the modules'
    buffers), gradients and optimizer state on this rank (after a step)."""
    reference = getattr(engine.objective, "reference_chunks", None) or []
    params = [p for chunk in [*engine.chunks, *reference] for p in chunk.parameters()]
    params += [b for chunk in [*engine.chunks, *reference] for b in chunk.buffers()]  # the routers' expert bias
    optimizer = engine.optimizer
    if engine.config.zero_stage == 3:
        grads = [p.grad for p in optimizer.params if p.grad is not None]
        states = [s[k] for s in optimizer.optimizer.state.values() for k in ("exp_avg", "exp_avg_sq") if k in s]
        return {"weights": params, "grads": grads, "optimizer": states}
    buffers = optimizer.buffers
    grads = list(buffers.grad_buffers.values()) + list(buffers.shard_buffers.values())
    grads += [b.grad_data for b in buffers.buckets if b.layout.deferred and b.grad_data is not None]
    fragments = optimizer._fragments
    masters = [f.master for f in fragments if not f.master_is_param]
    states = [s[k] for s in optimizer.optimizer.state.values() for k in ("exp_avg", "exp_avg_sq") if k in s]
    return {"weights": params, "grads": grads, "optimizer": masters + states}


def measure_model_states(engine) -> dict[str, int]:
    return {key: unique_bytes(tensors) for key, tensors in model_state_tensors(engine).items()}


class LargestTensor(TorchDispatchMode):
    """Use as a context manager: `largest` is the most elements of any tensor an op returned while it was entered."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor):
                self.largest = max(self.largest, tensor.numel())
        return out
