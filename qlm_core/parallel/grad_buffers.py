"""Data parallelism: gradient buckets reduced over the data(×context)-parallel group while backward runs.

Gradients are accumulated and reduced in `grad_dtype` (G bytes per element): fp32 by default, or the params' own
bf16/fp16 (recipe parallel.grad_reduce_dtype), which halves the gradient memory and the reduction's bytes; the
optimizer still updates fp32 masters (parallel/optimizer.py).

Layout. Parameters are grouped by dtype; each group is walked in REVERSE parameter order (the order backward
produces gradients) and cut into buckets of about `bucket_size_mb` MB counted as fp32 gradient (whatever
`grad_dtype` is, so the layout does not depend on it); a parameter is never split between buckets. Parameters
marked `shared_embedding` go to one extra bucket per dtype (see below). Under ZeRO 1/2 every bucket is padded at its
end to a multiple of dp·shard_alignment, and dp rank r owns the contiguous slice [r·n/dp, (r+1)·n/dp) of every
bucket: a shard may split a parameter anywhere.

Storage per stage (P = elements of this rank's params, B = bucket size):
  ZeRO 0  one grad buffer per dtype (G·P bytes); buckets are all-reduced (SUM).
  ZeRO 1  the same grad buffer, reduce-scattered in place (each rank's slice of a bucket ends up holding the
          reduced sum); the params' .data become views into a per-dtype param buffer with the same layout, so the
          optimizer can all-gather updated slices bucket by bucket (parallel/optimizer.py).
  ZeRO 2  no full grad buffer: a bucket gets storage when its first gradient of a microbatch arrives; when all
          its params have accumulated it is reduce-scattered into a per-rank shard (G·P/dp bytes in all) and
          the storage is freed. Peak gradient memory: G·P/dp + G·B·(buckets being filled + reductions in flight,
          at most `max_reductions_in_flight`), plus the shared-embedding bucket, which must stay whole until
          finish_grad_sync. `peak_transient_grad_numel` records what a run really used.

Completion. Each param's post-accumulate-grad hook adds .grad into `param.main_grad` (a grad_dtype view into its
bucket) and drops .grad. A param fires its hook exactly `num_microbatches` times per step, so a bucket is complete
when it has seen len(params)·num_microbatches hooks (ZeRO 2: every len(params) hooks, i.e. every microbatch; the
reductions are linear, so an interleaved order still sums every contribution exactly once). Gradients that skip
the hook (torch 2.13's zero-bubble weight pass, stage_backward_weight, assigns .grad directly) are found in .grad
by finish_grad_sync, which adds them in and reduces their buckets there: correct, but not overlapped, and such
grads accumulate across microbatches in the param dtype (torch does that, not us).

Overlap. With `overlap_grad_reduce` the dp reduction of a complete bucket is launched async from inside the
hook, so it runs while backward computes the next buckets. ZeRO 0/1 wait for all of them in finish_grad_sync.
ZeRO 2 folds a reduction into its shard (wait, add, free the storage) as soon as it has completed, when more than
`max_reductions_in_flight` are pending, when the same bucket's next gradient arrives, or in finish_grad_sync.
Without overlap, ZeRO 0/1 issue every reduction in finish_grad_sync and ZeRO 2 reduces synchronously in the hook
(it must still reduce every microbatch to free the storage). Under ZeRO 2 `param.main_grad` exists only while its
bucket has storage (None outside backward).

Special params. `sequence_parallel` grads are all-reduced (SUM) over the TP group right before their bucket's dp
reduction (TP ranks run backward in lockstep). `shared_embedding` grads (the tied embedding on the first and last
pipeline stage) are all-reduced over the embedding group inside finish_grad_sync only: the stages are not in
lockstep during backward, so doing it there could deadlock.

Expert parallelism. Given an `expert_dp_group`, the routed experts' params (marked `expert`) get buckets of their
own, after the dense ones of each dtype, reduced (and, under ZeRO 1/2, sharded) over that group instead of the dp
group: each bucket carries its group, size and rank.

The dp reduction is always a SUM: the caller normalises the loss by the global token count of the step.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from torch.distributed import ProcessGroup

from qlm_core.parallel.comm import (
    all_reduce,
    group_rank,
    group_size,
    start_all_gather,
    start_all_reduce,
    start_reduce_scatter,
    wait,
)
from qlm_core.parallel.param_meta import meta_of


@dataclass(frozen=True)
class BucketLayout:
    param_indices: tuple[int, ...]  # indices into the params list, in bucket order (reverse parameter order)
    param_ranges: tuple[tuple[int, int], ...]  # [start, end) of each param's elements within the bucket
    numel: int  # padded size
    dtype: torch.dtype  # the params' dtype (gradients are in GradientBuffers.grad_dtype)
    deferred: bool = False  # shared-embedding bucket: reduced only in finish_grad_sync
    expert: bool = False  # routed experts' params: reduced over the expert-data-parallel group

    @property
    def numel_unpadded(self) -> int:
        return self.param_ranges[-1][1] if self.param_ranges else 0

    def shard_range(self, rank: int, world: int) -> tuple[int, int]:
        size = self.numel // world
        return rank * size, (rank + 1) * size


def plan_buckets(params, bucket_numel: int | None, pad_multiple: int = 1,
                 expert_pad_multiple: int | None = None) -> list[BucketLayout]:
    """Bucket layouts for `params` (see the module docstring). `bucket_numel` None = one bucket per dtype (and
    domain). `expert_pad_multiple` not None: the `expert` params get buckets of their own, padded to it."""
    dtypes = list(dict.fromkeys(p.dtype for p in params))
    metas = [meta_of(p) for p in params]
    numels = [p.numel() for p in params]
    expert = [expert_pad_multiple is not None and m.expert for m in metas]
    layouts = []
    for dtype in dtypes:
        indices = [i for i in reversed(range(len(params))) if params[i].dtype == dtype]
        shared = [i for i in indices if metas[i].shared_embedding]
        for in_expert_domain in (False, True):
            regular = [i for i in indices if not metas[i].shared_embedding and expert[i] == in_expert_domain]
            pad = expert_pad_multiple if in_expert_domain else pad_multiple
            current: list[int] = []
            filled = 0
            for i in regular:
                current.append(i)
                filled += numels[i]
                if bucket_numel is not None and filled >= bucket_numel:
                    layouts.append(_layout(numels, current, dtype, pad, False, in_expert_domain))
                    current, filled = [], 0
            if current:
                layouts.append(_layout(numels, current, dtype, pad, False, in_expert_domain))
        if shared:
            layouts.append(_layout(numels, shared, dtype, pad_multiple, True))
    return layouts


def _layout(numels: list[int], indices, dtype, pad_multiple, deferred, expert=False) -> BucketLayout:
    ranges, start = [], 0
    for i in indices:
        ranges.append((start, start + numels[i]))
        start += numels[i]
    padded = -(-start // pad_multiple) * pad_multiple
    return BucketLayout(tuple(indices), tuple(ranges), padded, dtype, deferred, expert)


class Bucket:
    """One bucket's live state. `grad_data` is the full-size gradient (None between microbatches under ZeRO 2),
    `param_data` the param-dtype storage its params' .data view (ZeRO 1/2), `grad_shard` this rank's reduced slice
    (ZeRO 1/2); gradients are in GradientBuffers.grad_dtype."""

    def __init__(self, index: int, layout: BucketLayout, params: list[torch.nn.Parameter],
                 group: ProcessGroup | None):
        self.index = index
        self.layout = layout
        self.group, self.dp_size, self.dp_rank = group, group_size(group), group_rank(group)  # its reduction's
        self.params = [params[i] for i in layout.param_indices]
        self.grad_data: torch.Tensor | None = None
        self.param_data: torch.Tensor | None = None
        self.grad_shard: torch.Tensor | None = None
        self.grads_seen = 0  # hooks fired since zero_grad
        self.reduce_started = False  # ZeRO 0/1: the step's dp reduction has been issued
        self.work = None  # the dp reduction in flight

    @property
    def numel(self) -> int:
        return self.layout.numel

    def param_range(self, param) -> tuple[int, int]:
        """[start, end) of `param` within the bucket."""
        for p, span in zip(self.params, self.layout.param_ranges, strict=True):
            if p is param:
                return span
        raise KeyError("param is not in this bucket")

    def views(self, flat: torch.Tensor):
        """(param, view of `flat` shaped like the param) for each param of the bucket."""
        return [(p, flat[lo:hi].view_as(p)) for p, (lo, hi) in zip(self.params, self.layout.param_ranges, strict=True)]


class GradientBuffers:
    """Gradient accumulation and bucketed data-parallel reduction for `params` (see the module docstring).

    Call zero_grad() at the start of a step and finish_grad_sync() after the last backward; after it, the reduced
    gradients are in `param.main_grad` (ZeRO 0) or in each bucket's `grad_shard` (ZeRO 1/2).

    params: trainable params in model.parameters() order (several model chunks may be concatenated), all on one
        device; build this after the model has its final device and dtype (ZeRO 1/2 re-point their .data).
    bucket_size_mb: MB of fp32 gradient per bucket (elements = MB·2^20/4, whatever grad_dtype is); None = one
        bucket per dtype.
    num_microbatches: how many times each param's gradient is accumulated per step (settable between steps).
    shard_alignment: ZeRO 1/2 pad buckets to a multiple of dp·shard_alignment elements, so every rank's shard
        starts aligned (64 elements: 256 bytes in fp32, 128 in bf16).
    max_reductions_in_flight: ZeRO 2 with overlap: pending reduce-scatters (each holds a bucket's storage).
    grad_dtype: the dtype gradients are accumulated and reduced in (fp32, or the params' bf16/fp16).
    expert_dp_group: with expert parallelism, the group the `expert` params' gradients are reduced over.
    """

    def __init__(
        self,
        params,
        *,
        dp_group: ProcessGroup | None = None,
        zero_stage: int = 0,
        bucket_size_mb: float | None = 40,
        overlap_grad_reduce: bool = True,
        num_microbatches: int = 1,
        tp_group: ProcessGroup | None = None,
        embedding_group: ProcessGroup | None = None,
        shard_alignment: int = 64,
        max_reductions_in_flight: int = 2,
        grad_dtype: torch.dtype = torch.float32,
        expert_dp_group: ProcessGroup | None = None,
    ):
        self.params = list(params)
        if zero_stage not in (0, 1, 2):
            raise ValueError(f"zero_stage must be 0, 1 or 2 (ZeRO-3 is FSDP2), got {zero_stage}")
        if not self.params:
            raise ValueError("GradientBuffers got no parameters")
        if len({id(p) for p in self.params}) != len(self.params):
            raise ValueError("a parameter is listed twice")
        if any(not p.requires_grad for p in self.params):
            raise ValueError("frozen parameters (requires_grad=False) must not be passed to GradientBuffers")
        devices = {p.device for p in self.params}
        if len(devices) > 1:
            raise ValueError(f"all parameters must live on one device, got {sorted(map(str, devices))}")
        self.device = devices.pop()
        self.dp_group, self.tp_group, self.embedding_group = dp_group, tp_group, embedding_group
        self.dp_size, self.dp_rank = group_size(dp_group), group_rank(dp_group)
        self.expert_dp_group = expert_dp_group
        self.zero_stage = zero_stage
        self.overlap_grad_reduce = overlap_grad_reduce
        self.num_microbatches = num_microbatches
        self.max_reductions_in_flight = max_reductions_in_flight
        self.grad_dtype = grad_dtype
        bucket_numel = None if bucket_size_mb is None else max(1, int(bucket_size_mb * 2**20) // 4)
        pad = self.dp_size * shard_alignment if zero_stage else 1
        expert_pad = None
        if expert_dp_group is not None:
            expert_pad = group_size(expert_dp_group) * shard_alignment if zero_stage else 1
        layouts = plan_buckets(self.params, bucket_numel, pad, expert_pad)
        self.buckets = [Bucket(i, layout, self.params, expert_dp_group if layout.expert else dp_group)
                        for i, layout in enumerate(layouts)]
        self.bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._allocate()
        self._in_flight: list[Bucket] = []  # ZeRO 2: reductions issued but not yet folded into their shard
        self._transient_numel = 0
        # Params whose persistent main_grad holds this step's values: the first gradient is copied in, so the
        # buffers need no zero-fill per step (unwritten ones are zeroed in finish_grad_sync).
        self._written: set[int] = set()
        self.peak_transient_grad_numel = 0
        self._hooks = [p.register_post_accumulate_grad_hook(partial(self._on_grad, self.bucket_of[id(p)]))
                       for p in self.params]

    # ---- storage -----------------------------------------------------------------------------------------------------

    def _allocate(self):
        """Per dtype: one grad buffer (ZeRO 0/1) or one shard buffer (ZeRO 2), in grad_dtype, and one param
        buffer (ZeRO 1/2). Buckets are consecutive views into them."""
        grad = dict(dtype=self.grad_dtype, device=self.device)
        self.grad_buffers, self.param_buffers, self.shard_buffers = {}, {}, {}
        for dtype in dict.fromkeys(b.layout.dtype for b in self.buckets):
            buckets = [b for b in self.buckets if b.layout.dtype == dtype]
            total = sum(b.numel for b in buckets)
            if self.zero_stage < 2:
                self.grad_buffers[dtype] = torch.zeros(total, **grad)
            else:
                sharded = sum(b.numel // b.dp_size for b in buckets if self._sharded_accumulation(b))
                self.shard_buffers[dtype] = torch.zeros(sharded, **grad)
            if self.zero_stage >= 1:
                self.param_buffers[dtype] = torch.zeros(total, dtype=dtype, device=self.device)
            offset = shard_offset = 0
            for b in buckets:
                if self.zero_stage < 2:
                    b.grad_data = self.grad_buffers[dtype][offset : offset + b.numel]
                elif b.layout.deferred:  # must stay whole until finish_grad_sync
                    b.grad_data = torch.zeros(b.numel, **grad)
                if self._sharded_accumulation(b):
                    size = b.numel // b.dp_size
                    b.grad_shard = self.shard_buffers[dtype][shard_offset : shard_offset + size]
                    shard_offset += size
                elif self.zero_stage >= 1:  # reduce-scattered in place: the owned slice holds the sum
                    lo, hi = b.layout.shard_range(b.dp_rank, b.dp_size)
                    b.grad_shard = b.grad_data[lo:hi]
                if self.zero_stage >= 1:
                    b.param_data = self.param_buffers[dtype][offset : offset + b.numel]
                    with torch.no_grad():
                        for p, view in b.views(b.param_data):
                            view.copy_(p.detach())
                            p.data = view
                if b.grad_data is not None:
                    for p, view in b.views(b.grad_data):
                        p.main_grad = view
                offset += b.numel

    def _sharded_accumulation(self, bucket: Bucket) -> bool:
        return self.zero_stage == 2 and not bucket.layout.deferred

    def _acquire_grad_storage(self, bucket: Bucket):
        if bucket in self._in_flight:  # last microbatch's reduction still reads the storage
            self._fold_microbatch(bucket)
        if bucket.grad_data is None:
            bucket.grad_data = torch.zeros(bucket.numel, dtype=self.grad_dtype, device=self.device)
            for p, view in bucket.views(bucket.grad_data):
                p.main_grad = view
            self._transient_numel += bucket.numel
            self.peak_transient_grad_numel = max(self.peak_transient_grad_numel, self._transient_numel)

    def _fold_microbatch(self, bucket: Bucket):
        """ZeRO 2: wait for the bucket's reduce-scatter, add this rank's slice into the shard, free the storage."""
        wait(bucket.work)
        bucket.work = None
        self._in_flight.remove(bucket)
        lo, hi = bucket.layout.shard_range(bucket.dp_rank, bucket.dp_size)
        bucket.grad_shard.add_(bucket.grad_data[lo:hi])
        bucket.grad_data = None
        for p in bucket.params:
            p.main_grad = None
        self._transient_numel -= bucket.numel

    # ---- backward ----------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def _on_grad(self, bucket: Bucket, param: torch.nn.Parameter):
        if param.grad is None:
            return
        if self._sharded_accumulation(bucket):
            self._acquire_grad_storage(bucket)
        self._accumulate(bucket, param)
        bucket.grads_seen += 1
        if bucket.layout.deferred:
            return
        if self.zero_stage == 2:
            if bucket.grads_seen % len(bucket.params) == 0:
                self._start_reduction(bucket, async_op=self.overlap_grad_reduce)
                self._in_flight.append(bucket)
                for done in [b for b in self._in_flight if b.work is None or b.work.is_completed()]:
                    self._fold_microbatch(done)
                limit = self.max_reductions_in_flight if self.overlap_grad_reduce else 0
                while len(self._in_flight) > limit:
                    self._fold_microbatch(self._in_flight[0])
        elif self.overlap_grad_reduce and bucket.grads_seen == len(bucket.params) * self.num_microbatches:
            self._start_reduction(bucket, async_op=True)

    def _accumulate(self, bucket: Bucket, param: torch.nn.Parameter):
        if self._sharded_accumulation(bucket) or id(param) in self._written:
            param.main_grad.add_(param.grad)
        else:
            param.main_grad.copy_(param.grad)
            self._written.add(id(param))
        param.grad = None

    def _zero_unwritten(self, bucket: Bucket):
        if not self._sharded_accumulation(bucket):
            for p in bucket.params:
                if id(p) not in self._written:
                    p.main_grad.zero_()
                    self._written.add(id(p))

    def _start_reduction(self, bucket: Bucket, async_op: bool):
        self._all_reduce_sequence_parallel_grads(bucket)
        if self.zero_stage == 0:
            bucket.work = start_all_reduce(bucket.grad_data, bucket.group, async_op)
        else:
            lo, hi = bucket.layout.shard_range(bucket.dp_rank, bucket.dp_size)
            bucket.work = start_reduce_scatter(bucket.grad_data[lo:hi], bucket.grad_data, bucket.group, async_op)
        bucket.reduce_started = True

    def _all_reduce_sequence_parallel_grads(self, bucket: Bucket):
        """One synchronous TP all-reduce for all the bucket's replicated sequence-parallel grads."""
        grads = [p.main_grad for p in bucket.params if meta_of(p).sequence_parallel]
        if not grads or group_size(self.tp_group) == 1:
            return
        flat = all_reduce(torch.cat([g.reshape(-1) for g in grads]), self.tp_group)
        for grad, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
            grad.copy_(part.view_as(grad))

    # ---- step boundaries ---------------------------------------------------------------------------------------------

    def _check_complete(self, bucket: Bucket):
        expected = len(bucket.params) * self.num_microbatches
        if bucket.grads_seen != expected:
            raise RuntimeError(
                f"bucket {bucket.index} saw {bucket.grads_seen} gradient accumulations, expected {expected} "
                f"({len(bucket.params)} params x {self.num_microbatches} microbatches): a parameter got no gradient "
                "or num_microbatches is wrong (unused parameters need overlap_grad_reduce=False and ZeRO 0/1)"
            )

    def _collect_unhooked_grads(self) -> set[int]:
        """Fold in gradients that reached .grad without the post-accumulate hook (torch.distributed.pipelining's
        zero-bubble weight pass assigns `weight.grad = dw` / `+= dw` directly). Returns the indices of the buckets
        that got some: they are reduced here, not during backward."""
        late_buckets = set()
        for bucket in self.buckets:
            late = [p for p in bucket.params if p.grad is not None]
            if not late:
                continue
            if bucket.reduce_started and not self._sharded_accumulation(bucket):
                raise RuntimeError(f"bucket {bucket.index} was reduced before all its gradients had arrived")
            if self._sharded_accumulation(bucket):
                self._acquire_grad_storage(bucket)
            for p in late:
                self._accumulate(bucket, p)
            late_buckets.add(bucket.index)
        return late_buckets

    @torch.no_grad()
    def finish_grad_sync(self):
        """Issue what backward did not, then wait for every reduction. Afterwards the gradients are final."""
        late_buckets = self._collect_unhooked_grads()
        for bucket in self.buckets:
            if not bucket.reduce_started:
                self._zero_unwritten(bucket)
        for bucket in self.buckets:
            if bucket.layout.deferred:
                continue
            sharded = self._sharded_accumulation(bucket)
            if bucket.index in late_buckets:
                self._start_reduction(bucket, async_op=True)
                if sharded:
                    self._in_flight.append(bucket)
                continue
            if sharded or self.overlap_grad_reduce:
                self._check_complete(bucket)
            if not sharded and not bucket.reduce_started:
                self._start_reduction(bucket, async_op=True)
        for bucket in self.buckets:
            if bucket.layout.deferred and not bucket.reduce_started:
                if group_size(self.embedding_group) > 1:
                    for p in bucket.params:
                        all_reduce(p.main_grad, self.embedding_group)
                self._start_reduction(bucket, async_op=True)
        while self._in_flight:
            self._fold_microbatch(self._in_flight[0])
        for bucket in self.buckets:
            wait(bucket.work)
            bucket.work = None

    @torch.no_grad()
    def zero_grad(self):
        """Start of a step: zero the accumulators and the completion counts."""
        for bucket in self.buckets:
            if bucket.work is not None:  # a step abandoned mid-way; never expected in normal training
                wait(bucket.work)
                bucket.work = None
            if self._sharded_accumulation(bucket) and bucket.grad_data is not None:
                bucket.grad_data = None
                for p in bucket.params:
                    p.main_grad = None
                self._transient_numel -= bucket.numel
            bucket.grads_seen = 0
            bucket.reduce_started = False
        self._in_flight.clear()
        self._written.clear()
        for buffer in self.shard_buffers.values():  # ZeRO 2 accumulates into these: they must start at zero
            buffer.zero_()
        for bucket in self.buckets:
            if bucket.layout.deferred and self.zero_stage == 2:
                bucket.grad_data.zero_()
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def full_grad(self, param) -> torch.Tensor:
        """The reduced gradient of `param` in grad_dtype, whole (for inspection, after finish_grad_sync). Under
        ZeRO 1/2 it all-gathers the param's bucket over the dp group: a collective every dp rank must call."""
        if self.zero_stage == 0:
            return param.main_grad
        bucket = self.bucket_of[id(param)]
        full = bucket.grad_shard
        if bucket.dp_size > 1:
            full = torch.empty(bucket.numel, dtype=self.grad_dtype, device=self.device)
            start_all_gather(full, bucket.grad_shard, bucket.group, async_op=False)
        lo, hi = bucket.param_range(param)
        return full[lo:hi].view_as(param)
