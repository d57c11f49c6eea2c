"""Measure what a model really keeps: activation bytes saved for backward, and model-state bytes.

Activations (any device) are counted with torch.autograd.graph.saved_tensors_hooks, each storage once
(docs/ARCHITECTURE.md §3), parameters skipped. Recomputation hides a checkpointed region's tensors from outer hooks
(torch's non-reentrant checkpoint keeps its own), so the meter also wraps models.gpt's `checkpoint` to count the
inputs a checkpoint keeps instead. A saved tensor stays live until autograd releases it; the meter tracks live bytes
over time and records the peak (which is what pipeline schedules and gradient accumulation decide), split by region:
`layers` (labelled per transformer layer), `embedding` and `head` (final norm, output layer, loss).
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from contextlib import contextmanager

import torch
from torch import nn


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

    # ---- counting ----------------------------------------------------------------------------------------------------

    def _param_storages(self) -> set[int]:
        params = (p for m in self.modules for p in m.parameters())
        return {(p.to_local() if hasattr(p, "to_local") else p).untyped_storage().data_ptr() for p in params}

    def _release(self, ptr: int):
        entry = self.live.get(ptr)
        if entry is None:
            return
        entry[2] -= 1
        if entry[2] == 0:
            self.live_bytes -= entry[0]
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
        weakref.finalize(tensor, self._release, ptr)

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

    @contextmanager
    def _checkpoint_counted(self):
        from qlm_core.models import gpt

        original = gpt.checkpoint

        def counted(fn, *args, **kwargs):
            label = self.labels.get(id(fn), self.label)
            for arg in args:
                if isinstance(arg, torch.Tensor) and torch.is_grad_enabled():
                    self._register(arg, label)
            return original(fn, *args, **kwargs)

        gpt.checkpoint = counted
        try:
            yield
        finally:
            gpt.checkpoint = original

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
    """The tensors behind an Engine's weights, gradients and optimizer state on this rank (after a step)."""
    params = [p for chunk in engine.chunks for p in chunk.parameters()]
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
