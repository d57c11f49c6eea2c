"""Context parallelism (CP): causal self-attention over a sequence spread across the CP group.

Layout (Megatron's load balancing): a sequence of S tokens is cut into 2*cp chunks of c = S / (2*cp) tokens and CP
rank r holds chunks r and 2*cp-1-r, in that order, so that every rank has the same amount of causal work. A rank's
local tokens are thus in ascending global order: its first half-chunk precedes its second.

Three ways to attend across ranks (`comm_type`):
  p2p        ring attention: K/V blocks travel round the ring while each rank attends to the block it holds; partial
             outputs merge by log-sum-exp. Backward recomputes block by block and sends dK/dV round the ring behind
             the K/V, so that each block's gradient ends on its owner.
  allgather  all-gather K/V, attend, keep only the local K/V; backward re-gathers and reduce-scatters dK/dV.
  a2a        Ulysses: all-to-all trades the sequence for heads, plain attention over the full sequence on hq/cp heads,
             all-to-all back. Autograd runs through the all-to-alls.
With a group of None or size 1 every function is the plain single-process one and nothing is communicated.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.autograd import Function

from ..kernels.attention import accumulation_dtype, attention, attention_backward, attention_forward_with_lse
from .comm import all_gather_dim0, all_to_all_dim0, group_rank, group_size, reduce_scatter_dim0

CP_COMM_TYPES = ("p2p", "allgather", "a2a")


# ---- layout ----------------------------------------------------------------------------------------------------------


def _chunk_len(seq_len: int, cp_size: int) -> int:
    if seq_len % (2 * cp_size):
        raise ValueError(f"context parallelism cuts the sequence into 2*cp = {2 * cp_size} equal chunks; "
                         f"the sequence length {seq_len} is not divisible by it")
    return seq_len // (2 * cp_size)


def cp_token_indices(seq_len: int, cp_size: int, cp_rank: int, device=None) -> torch.Tensor:
    """Global positions of the tokens this CP rank holds, in local order."""
    if cp_size == 1:
        return torch.arange(seq_len, device=device)
    c = _chunk_len(seq_len, cp_size)
    last = 2 * cp_size - 1 - cp_rank
    return torch.cat([torch.arange(cp_rank * c, (cp_rank + 1) * c, device=device),
                      torch.arange(last * c, (last + 1) * c, device=device)])


def split_for_cp(x: torch.Tensor, cp_size: int, cp_rank: int, dim: int) -> torch.Tensor:
    """This CP rank's slice of a full sequence along `dim` (no communication)."""
    if cp_size == 1:
        return x
    c = _chunk_len(x.shape[dim], cp_size)
    last = 2 * cp_size - 1 - cp_rank
    return torch.cat([x.narrow(dim, cp_rank * c, c), x.narrow(dim, last * c, c)], dim=dim)


def _reorder_chunks(x: torch.Tensor, cp_size: int, dim: int, to_global: bool) -> torch.Tensor:
    """Permute the 2*cp chunks along `dim` between rank-major order (what an all-gather of local slices gives:
    rank 0's two chunks, then rank 1's, ...) and global order."""
    n = 2 * cp_size
    if to_global:  # global chunk g sits at rank-major slot 2g (g < cp) or 2(2cp-1-g)+1
        order = [2 * g if g < cp_size else 2 * (n - 1 - g) + 1 for g in range(n)]
    else:  # rank-major slot 2j+h holds global chunk j (h = 0) or 2cp-1-j (h = 1)
        order = [j // 2 if j % 2 == 0 else n - 1 - j // 2 for j in range(n)]
    chunks = x.chunk(n, dim)  # slices, not an index tensor: no host-to-device copy per call
    return torch.cat([chunks[i] for i in order], dim=dim)


def _gather_seq(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """All-gather the local slices along `dim` and put the full sequence in global order (not differentiable)."""
    gathered = all_gather_dim0(x.movedim(dim, 0), group).movedim(0, dim)
    return _reorder_chunks(gathered, group_size(group), dim, to_global=True)


class _GatherFromCP(Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _gather_seq(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return split_for_cp(grad, group_size(ctx.group), group_rank(ctx.group), ctx.dim), None, None


def gather_from_cp(x_local: torch.Tensor, group, dim: int) -> torch.Tensor:
    """The full sequence in global order from every rank's local slice; backward keeps this rank's slice of the
    gradient (every rank is expected to hold the same full gradient)."""
    return x_local if group_size(group) == 1 else _GatherFromCP.apply(x_local, group, dim)


# ---- blocks ----------------------------------------------------------------------------------------------------------
# A block is a rectangle of the attention matrix: local query rows against a slice of the K/V at hand. Without
# segment ids a block is either entirely visible (no mask) or a diagonal block (causal); with segment ids each block
# gets a bool mask from positions and documents. Accumulators are float32 (float64 for float64 inputs).


class _Block(NamedTuple):
    rows: slice
    cols: slice
    diagonal: bool


def _meta(positions: torch.Tensor, segment_ids: torch.Tensor | None) -> torch.Tensor | None:
    """[1 + b, s] int64: row 0 the positions, then each sequence's document ids. None when no mask is needed."""
    if segment_ids is None:
        return None
    return torch.cat([positions[None].to(segment_ids.device, torch.long), segment_ids.to(torch.long)])


def _block_mask(q_meta, k_meta, block: _Block) -> torch.Tensor | None:
    """True where the key is not later than the query and in the same document: [b, 1, rows, cols]."""
    if q_meta is None:
        return None
    q, k = q_meta[:, block.rows], k_meta[:, block.cols]
    causal = k[0][None, :] <= q[0][:, None]
    return (causal & (q[1:, :, None] == k[1:, None, :]))[:, None]


def _attend(q, kv, block: _Block, q_meta, k_meta, scale, out, lse):
    mask = _block_mask(q_meta, k_meta, block)
    blk_out, blk_lse = attention_forward_with_lse(
        q[:, :, block.rows], kv[0][:, :, block.cols], kv[1][:, :, block.cols],
        scale=scale, causal=block.diagonal and mask is None, mask=mask,
    )
    _merge(out[:, :, block.rows], lse[:, :, block.rows], blk_out, blk_lse)


def _merge(out, lse, blk_out, blk_lse):
    """In place: (out, lse) <- softmax-weighted combination of two partial results over disjoint keys."""
    new = torch.logaddexp(lse, blk_lse)
    base = new.masked_fill(torch.isneginf(new), 0.0)  # both -inf: weights exp(-inf) = 0, not NaN
    out.mul_(torch.exp(lse - base)[..., None]).add_(blk_out.to(out.dtype) * torch.exp(blk_lse - base)[..., None])
    lse.copy_(new)


def _attend_backward(grad_out, q, kv, out, lse, block: _Block, q_meta, k_meta, scale, dq, dkv):
    mask = _block_mask(q_meta, k_meta, block)
    r, c = block.rows, block.cols
    bq, bk, bv = attention_backward(
        grad_out[:, :, r], q[:, :, r], kv[0][:, :, c], kv[1][:, :, c], out[:, :, r], lse[:, :, r],
        scale=scale, causal=block.diagonal and mask is None, mask=mask,
    )
    dq[:, :, r] += bq
    dkv[0][:, :, c] += bk
    dkv[1][:, :, c] += bv


def _empty_result(q):
    out = torch.zeros(q.shape, dtype=accumulation_dtype(q.dtype), device=q.device)
    return out, torch.full(q.shape[:3], float("-inf"), dtype=out.dtype, device=q.device)


# ---- p2p: ring attention ---------------------------------------------------------------------------------------------


def _ring_block(step: int, rank: int, cp: int, half: int) -> _Block:
    """What this rank's queries may see of the K/V block that started on rank (rank - step) % cp."""
    if step == 0:  # our own tokens, in ascending global order
        return _Block(slice(None), slice(None), True)
    src = (rank - step) % cp
    if src < rank:  # its first chunk precedes both of ours; its second follows both
        return _Block(slice(None), slice(0, half), False)
    return _Block(slice(half, None), slice(None), False)  # both its chunks lie between our first and second


class _Ring:
    """Send to the next rank of the group and receive from the previous one, asynchronously."""

    # Different tags keep the K/V, metadata and dK/dV streams apart on gloo; NCCL matches by issue order, which is the
    # same on every rank.
    KV, META, GRAD = 1, 2, 3

    def __init__(self, group):
        cp, rank = group_size(group), group_rank(group)
        self.group = group
        self.next = dist.get_global_rank(group, (rank + 1) % cp)
        self.prev = dist.get_global_rank(group, (rank - 1) % cp)

    def start(self, tensors_and_tags):
        ops, received = [], []
        for tensor, tag in tensors_and_tags:
            tensor = tensor.contiguous()
            buffer = torch.empty_like(tensor)
            ops.append(dist.P2POp(dist.isend, tensor, self.next, self.group, tag))
            ops.append(dist.P2POp(dist.irecv, buffer, self.prev, self.group, tag))
            received.append(buffer)
        return dist.batch_isend_irecv(ops), ops, received

    @staticmethod
    def finish(pending):
        works, _, received = pending  # the ops keep the send buffers alive until here
        for work in works:
            work.wait()
        return received


class _RingAttention(Function):
    @staticmethod
    def forward(ctx, q, k, v, group, scale, positions, segment_ids):
        cp, rank, half = group_size(group), group_rank(group), q.shape[2] // 2
        ring = _Ring(group)
        meta = _meta(positions, segment_ids)
        kv, k_meta = torch.stack((k, v)), meta
        out, lse = _empty_result(q)
        for step in range(cp):
            if step + 1 < cp:
                pending = ring.start(_with_meta((kv, ring.KV), k_meta, ring.META))
            _attend(q, kv, _ring_block(step, rank, cp, half), meta, k_meta, scale, out, lse)
            if step + 1 < cp:
                kv, k_meta = _split_meta(ring.finish(pending), meta is not None)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, meta)
        ctx.group, ctx.scale = group, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, meta = ctx.saved_tensors
        group = ctx.group
        cp, rank, half = group_size(group), group_rank(group), q.shape[2] // 2
        ring = _Ring(group)
        acc = accumulation_dtype(q.dtype)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        kv, k_meta = torch.stack((k, v)), meta
        grad_pending = None
        for step in range(cp):
            if step + 1 < cp:
                pending = ring.start(_with_meta((kv, ring.KV), k_meta, ring.META))
            # dK/dV of the block at hand: this rank's share, plus what the ranks it visited before have summed.
            dkv = torch.zeros(kv.shape, dtype=acc, device=q.device)
            _attend_backward(grad_out, q, kv, out, lse, _ring_block(step, rank, cp, half), meta, k_meta, ctx.scale,
                             dq, dkv)
            if grad_pending is not None:
                dkv += ring.finish(grad_pending)[0]
            grad_pending = ring.start([(dkv, ring.GRAD)])
            if step + 1 < cp:
                kv, k_meta = _split_meta(ring.finish(pending), meta is not None)
        # After cp hops every block's gradient has visited all ranks and come back to its owner.
        dkv = ring.finish(grad_pending)[0]
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None


def _with_meta(kv_and_tag, meta, meta_tag):
    return [kv_and_tag] if meta is None else [kv_and_tag, (meta, meta_tag)]


def _split_meta(received, has_meta):
    return received[0], (received[1] if has_meta else None)


# ---- allgather -------------------------------------------------------------------------------------------------------


def _allgather_blocks(rank: int, cp: int, half: int) -> list[_Block]:
    """Local query halves against the K/V in global order: the keys of all earlier chunks (fully visible) and
    the query's own chunk (diagonal); later chunks are never touched."""
    blocks = []
    for h, chunk in enumerate((rank, 2 * cp - 1 - rank)):
        rows = slice(h * half, (h + 1) * half)
        if chunk > 0:
            blocks.append(_Block(rows, slice(0, chunk * half), False))
        blocks.append(_Block(rows, slice(chunk * half, (chunk + 1) * half), True))
    return blocks


def _gather_kv(k, v, meta, group):
    kv = _gather_seq(torch.stack((k, v)), group, dim=3)
    return kv, (None if meta is None else _gather_seq(meta, group, dim=1))


class _AllGatherAttention(Function):
    @staticmethod
    def forward(ctx, q, k, v, group, scale, positions, segment_ids):
        meta = _meta(positions, segment_ids)
        kv, k_meta = _gather_kv(k, v, meta, group)
        out, lse = _empty_result(q)
        for block in _allgather_blocks(group_rank(group), group_size(group), q.shape[2] // 2):
            _attend(q, kv, block, meta, k_meta, scale, out, lse)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, meta)  # not the gathered K/V: backward gathers them again
        ctx.group, ctx.scale = group, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, meta = ctx.saved_tensors
        group = ctx.group
        kv, k_meta = _gather_kv(k, v, meta, group)
        acc = accumulation_dtype(q.dtype)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dkv = torch.zeros(kv.shape, dtype=acc, device=q.device)
        for block in _allgather_blocks(group_rank(group), group_size(group), q.shape[2] // 2):
            _attend_backward(grad_out, q, kv, out, lse, block, meta, k_meta, ctx.scale, dq, dkv)
        # Every rank holds partial gradients for all keys: sum them onto the owners.
        dkv = _reorder_chunks(dkv, group_size(group), 3, to_global=False)
        dkv = reduce_scatter_dim0(dkv.movedim(3, 0), group).movedim(0, 3)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None


# ---- a2a: Ulysses ----------------------------------------------------------------------------------------------------


class _AllToAll(Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_to_all_dim0(x, group)

    @staticmethod
    def backward(ctx, grad):  # an equal-split all-to-all is its own adjoint
        return all_to_all_dim0(grad, ctx.group), None


def _seq_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """[b, h, s_local, d] -> [b, h/cp, S, d]: this rank's head group over the full sequence, in global order."""
    cp = group_size(group)
    parts = x.unflatten(1, (cp, -1)).movedim(1, 0)  # part j (head group j) goes to rank j
    full = _AllToAll.apply(parts, group).movedim(0, 2).flatten(2, 3)  # slot j: rank j's tokens
    return _reorder_chunks(full, cp, 2, to_global=True)


def _heads_to_seq(x: torch.Tensor, group) -> torch.Tensor:
    """Inverse of _seq_to_heads."""
    cp = group_size(group)
    parts = _reorder_chunks(x, cp, 2, to_global=False).unflatten(2, (cp, -1)).movedim(2, 0)
    return _AllToAll.apply(parts, group).movedim(0, 1).flatten(1, 2)


def _ulysses_attention(q, k, v, group, scale, segment_ids):
    cp, hq, hk = group_size(group), q.shape[1], k.shape[1]
    if hq % cp:
        raise ValueError(f"a2a context parallelism needs the query heads per rank ({hq}) divisible by cp ({cp})")
    if hk % cp:
        if cp % hk:
            raise ValueError(f"a2a context parallelism needs the key/value heads per rank ({hk}) to divide, or be "
                             f"divisible by, cp ({cp})")
        # Fewer kv heads than ranks: give each rank a copy of the one kv head its query heads use.
        k, v = k.repeat_interleave(cp // hk, dim=1), v.repeat_interleave(cp // hk, dim=1)
    q, k, v = (_seq_to_heads(t, group) for t in (q, k, v))
    mask = None
    if segment_ids is not None:  # the sequence is in global order now: causal by index, within a document
        docs = _gather_seq(segment_ids, group, dim=1)
        mask = (docs[:, :, None] == docs[:, None, :])[:, None]
    return _heads_to_seq(attention(q, k, v, scale=scale, causal=True, mask=mask), group)


# ---- entry point -----------------------------------------------------------------------------------------------------


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group,
    comm_type: str,
    scale: float,
    positions: torch.Tensor,
    segment_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of this rank's queries against the whole sequence spread over the CP `group`.

    q [b, hq, s_local, d], k and v [b, hk, s_local, d] (hq a multiple of hk); `positions` [s_local] the global
    position of each local token (cp_token_indices: the layout above); `segment_ids` None or [b, s_local] document
    ids of a packed sequence (attention stays within a document). Returns [b, hq, s_local, d].
    """
    if comm_type not in CP_COMM_TYPES:
        raise ValueError(f"comm_type must be one of {CP_COMM_TYPES}, not {comm_type!r}")
    if k.shape != v.shape or q.shape[2] != k.shape[2] or q.shape[1] % k.shape[1]:
        raise ValueError(f"bad attention shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if positions.shape != (q.shape[2],):
        raise ValueError(f"positions must be [s_local] = [{q.shape[2]}], got {tuple(positions.shape)}")
    if segment_ids is not None and segment_ids.shape != (q.shape[0], q.shape[2]):
        raise ValueError(f"segment_ids must be [b, s_local] = [{q.shape[0]}, {q.shape[2]}], "
                         f"got {tuple(segment_ids.shape)}")
    cp = group_size(group)
    if cp == 1:
        meta = _meta(positions, segment_ids)
        mask = _block_mask(meta, meta, _Block(slice(None), slice(None), True))
        return attention(q, k, v, scale=scale, causal=mask is None, mask=mask)
    if q.shape[2] % 2:
        raise ValueError(f"each CP rank holds two equal chunks; its local length {q.shape[2]} is odd")
    if comm_type == "p2p":
        return _RingAttention.apply(q, k, v, group, scale, positions, segment_ids)
    if comm_type == "allgather":
        return _AllGatherAttention.apply(q, k, v, group, scale, positions, segment_ids)
    return _ulysses_attention(q, k, v, group, scale, segment_ids)
