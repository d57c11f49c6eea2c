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
Packed documents and sliding windows restrict what each (query chunk, key chunk) pair computes: the pieces where
they overlap run a mask-free kernel, and a pair that shares no document is skipped (the K/V still travel on).
With a group of None or size 1 every function is the plain single-process one and nothing is communicated.
"""

from __future__ import annotations

import bisect

import torch
import torch.distributed as dist
from torch.autograd import Function
from torch.distributed import ProcessGroup

from qlm_core.config import CpCommType, choices
from qlm_core.kernels.alibi import tiles
from qlm_core.kernels.attention import accumulation_dtype
from qlm_core.kernels.pieces import Documents, Piece, Span, band_pieces, coalesce, self_attention_pieces
from qlm_core.kernels.piecewise import (
    attend_pieces,
    attend_pieces_backward,
    empty_result,
    like_q,
    piecewise_attention,
)
from qlm_core.kernels.sinks import add_sinks, sinks_grad
from qlm_core.parallel.comm import all_gather_dim0, all_to_all_dim0, group_rank, group_size, reduce_scatter_dim0

CP_COMM_TYPES = choices(CpCommType)


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


def gather_sequence(x: torch.Tensor, group: ProcessGroup | None, dim: int) -> torch.Tensor:
    """All-gather the local slices along `dim` and put the full sequence in global order (not differentiable)."""
    gathered = all_gather_dim0(x.movedim(dim, 0), group).movedim(0, dim)
    return _reorder_chunks(gathered, group_size(group), dim, to_global=True)


class _GatherFromCP(Function):
    @staticmethod
    def forward(ctx, x, group: ProcessGroup | None, dim):
        ctx.group, ctx.dim = group, dim
        return gather_sequence(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return split_for_cp(grad, group_size(ctx.group), group_rank(ctx.group), ctx.dim), None, None


def gather_from_cp(x_local: torch.Tensor, group: ProcessGroup | None, dim: int) -> torch.Tensor:
    """The full sequence in global order from every rank's local slice; backward keeps this rank's slice of the
    gradient (every rank is expected to hold the same full gradient)."""
    return x_local if group_size(group) == 1 else _GatherFromCP.apply(x_local, group, dim)


# ---- pieces ----------------------------------------------------------------------------------------------------------
# What a rank's queries compute against a set of keys is a list of mask-free pieces (kernels/pieces.py), derived from
# the chunk layout and the micro-batch's documents alone, so nothing travels with the K/V. The lists are the same for
# every layer and for backward: the model computes them once per forward (cp_attention_plan).


def _chunk_spans(cp: int, rank: int, chunk: int) -> list[Span]:
    """A rank's two chunks as global spans at their local indices."""
    last = 2 * cp - 1 - rank
    return [Span(rank * chunk, (rank + 1) * chunk, 0), Span(last * chunk, (last + 1) * chunk, chunk)]


def _documents_of(docs: Documents | None, seq_len: int):
    """(row, [start, end) documents) per row; without documents one document per row, shared (row None)."""
    if docs is None:
        return [(None, ((0, seq_len),))]
    return list(enumerate(docs.rows))


def _cross_pieces(docs, seq_len, queries: list[Span], keys: list[Span], window, positional: bool) -> list[Piece]:
    pieces = []
    for row, documents in _documents_of(docs, seq_len):
        for start, end in documents:
            for q in queries:
                q_doc = q.clip(start, end)
                if q_doc is None:
                    continue
                for k in keys:
                    k_doc = k.clip(start, end)
                    if k_doc is not None:
                        pieces += band_pieces(q_doc, k_doc, window, row)
    return pieces if positional else coalesce(pieces)


def ring_pieces(docs: Documents | None, seq_len: int, cp: int, rank: int, step: int, window,
                positional: bool = False) -> list[Piece]:
    """This rank's queries against the K/V block that started on rank (rank - step) % cp (`positional`: every
    piece at consecutive positions, with its shift, as self_attention_pieces)."""
    chunk = _chunk_len(seq_len, cp)
    if step == 0 and window is None and not positional:
        # Our own tokens, in ascending global order: causal within each document in local indices, since every key
        # of the first chunk precedes every query of the second.
        local = cp_token_indices(seq_len, cp, rank).tolist()
        pieces = []
        for row, documents in _documents_of(docs, seq_len):
            for start, end in documents:
                lo, hi = bisect.bisect_left(local, start), bisect.bisect_left(local, end)
                if lo < hi:  # in local indices: the two chunks' positions do not run on (no shift)
                    pieces += [piece._replace(shift=None)
                               for piece in band_pieces(Span(lo, hi, lo), Span(lo, hi, lo), None, row)]
        return pieces
    src = (rank - step) % cp
    return _cross_pieces(docs, seq_len, _chunk_spans(cp, rank, chunk), _chunk_spans(cp, src, chunk), window,
                         positional)


def allgather_pieces(docs: Documents | None, seq_len: int, cp: int, rank: int, window,
                     positional: bool = False) -> list[Piece]:
    """This rank's queries against the whole sequence in global order."""
    whole = [Span(0, seq_len, 0)]
    return _cross_pieces(docs, seq_len, _chunk_spans(cp, rank, _chunk_len(seq_len, cp)), whole, window, positional)


def cp_attention_plan(docs: Documents | None, seq_len: int, cp: int, rank: int, comm_type: str,
                      window: int | None, positional: bool = False,
                      tiled: bool | None = None) -> tuple[list[Piece], ...]:
    """What this rank computes in one attention call: the pieces of each ring step (p2p), of its queries against
    the gathered sequence (allgather), or of the whole sequence on its heads (a2a); `positional`: as
    self_attention_pieces; `tiled` (default: `positional`): cut into the tiles of kernels/alibi.py (ALiBi's, and the
    soft-capped math's of Gemma 2)."""
    if comm_type == "p2p":
        plan = tuple(ring_pieces(docs, seq_len, cp, rank, step, window, positional) for step in range(cp))
    elif comm_type == "allgather":
        plan = (allgather_pieces(docs, seq_len, cp, rank, window, positional),)
    else:
        plan = (self_attention_pieces(docs, seq_len, window, positional),)
    return tuple(tiles(pieces) for pieces in plan) if (positional if tiled is None else tiled) else plan


# ---- p2p: ring attention ---------------------------------------------------------------------------------------------


class _Ring:
    """Send to the next rank of the group and receive from the previous one, asynchronously."""

    # Different tags keep the K, V, dK and dV streams apart on gloo; NCCL matches by issue order, which is the same
    # on every rank. K and V travel as two tensors, so their head dims may differ (MLA: 192 and 128).
    K, V, GRAD_K, GRAD_V = 1, 2, 3, 4

    def __init__(self, group: ProcessGroup | None):
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
    def forward(ctx, q, k, v, group: ProcessGroup | None, scale, plan, sinks, slopes, softcap):
        cp = group_size(group)
        ring = _Ring(group)
        block_k, block_v = k, v
        out, lse = empty_result(q)
        for step in range(cp):
            if step + 1 < cp:
                pending = ring.start([(block_k, ring.K), (block_v, ring.V)])
            attend_pieces(q, block_k, block_v, plan[step], scale, out, lse, slopes, softcap)
            if step + 1 < cp:
                block_k, block_v = ring.finish(pending)
        add_sinks(out, lse, sinks)
        out = like_q(q).copy_(out)  # laid out like q: linear_proj reads it as a view
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.group, ctx.scale, ctx.plan, ctx.slopes, ctx.softcap = group, scale, plan, slopes, softcap
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        group = ctx.group
        cp = group_size(group)
        ring = _Ring(group)
        acc = accumulation_dtype(q.dtype)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        block_k, block_v = k, v
        grad_pending = None
        for step in range(cp):
            if step + 1 < cp:
                pending = ring.start([(block_k, ring.K), (block_v, ring.V)])
            # dK/dV of the block at hand: this rank's share, plus what the ranks it visited before have summed.
            dk = torch.zeros(block_k.shape, dtype=acc, device=q.device)
            dv = torch.zeros(block_v.shape, dtype=acc, device=q.device)
            attend_pieces_backward(grad_out, q, block_k, block_v, out, lse, ctx.plan[step], ctx.scale, dq, dk, dv,
                                   ctx.slopes, ctx.softcap)
            if grad_pending is not None:
                visited_k, visited_v = ring.finish(grad_pending)
                dk += visited_k
                dv += visited_v
            grad_pending = ring.start([(dk, ring.GRAD_K), (dv, ring.GRAD_V)])
            if step + 1 < cp:
                block_k, block_v = ring.finish(pending)
        # After cp hops every block's gradient has visited all ranks and come back to its owner.
        dk, dv = ring.finish(grad_pending)
        dsinks = sinks_grad(grad_out, out, lse, sinks)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, dsinks, None, None


# ---- allgather -------------------------------------------------------------------------------------------------------


def _gather_kv(k, v, group: ProcessGroup | None) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the whole sequence, gathered in one collective: joined along the head dim (theirs may differ)."""
    joined = gather_sequence(torch.cat((k, v), dim=3), group, dim=2)
    return joined[..., :k.shape[3]].contiguous(), joined[..., k.shape[3]:].contiguous()


class _AllGatherAttention(Function):
    @staticmethod
    def forward(ctx, q, k, v, group: ProcessGroup | None, scale, plan, sinks, slopes, softcap):
        full_k, full_v = _gather_kv(k, v, group)
        out, lse = empty_result(q)
        attend_pieces(q, full_k, full_v, plan[0], scale, out, lse, slopes, softcap)
        add_sinks(out, lse, sinks)
        out = like_q(q).copy_(out)  # laid out like q: linear_proj reads it as a view
        ctx.save_for_backward(q, k, v, out, lse, sinks)  # not the gathered K/V: backward gathers them again
        ctx.group, ctx.scale, ctx.plan, ctx.slopes, ctx.softcap = group, scale, plan, slopes, softcap
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        group = ctx.group
        cp = group_size(group)
        full_k, full_v = _gather_kv(k, v, group)
        acc = accumulation_dtype(q.dtype)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dk = torch.zeros(full_k.shape, dtype=acc, device=q.device)
        dv = torch.zeros(full_v.shape, dtype=acc, device=q.device)
        attend_pieces_backward(grad_out, q, full_k, full_v, out, lse, ctx.plan[0], ctx.scale, dq, dk, dv, ctx.slopes,
                               ctx.softcap)
        # Every rank holds partial gradients for all keys: sum them onto the owners (dK and dV in one collective).
        joined = _reorder_chunks(torch.cat((dk, dv), dim=3), cp, 2, to_global=False)
        joined = reduce_scatter_dim0(joined.movedim(2, 0), group).movedim(0, 2)
        dsinks = sinks_grad(grad_out, out, lse, sinks)
        return dq.to(q.dtype), joined[..., :k.shape[3]].to(k.dtype), joined[..., k.shape[3]:].to(v.dtype), None, \
            None, None, dsinks, None, None


# ---- a2a: Ulysses ----------------------------------------------------------------------------------------------------


class _AllToAll(Function):
    @staticmethod
    def forward(ctx, x, group: ProcessGroup | None):
        ctx.group = group
        return all_to_all_dim0(x, group)

    @staticmethod
    def backward(ctx, grad):  # an equal-split all-to-all is its own adjoint
        return all_to_all_dim0(grad, ctx.group), None


def _seq_to_heads(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """[b, h, s_local, d] -> [b, h/cp, S, d]: this rank's head group over the full sequence, in global order."""
    cp = group_size(group)
    parts = x.unflatten(1, (cp, -1)).movedim(1, 0)  # part j (head group j) goes to rank j
    full = _AllToAll.apply(parts, group).movedim(0, 2).flatten(2, 3)  # slot j: rank j's tokens
    return _reorder_chunks(full, cp, 2, to_global=True)


def _heads_to_seq(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Inverse of _seq_to_heads."""
    cp = group_size(group)
    parts = _reorder_chunks(x, cp, 2, to_global=False).unflatten(2, (cp, -1)).movedim(2, 0)
    return _AllToAll.apply(parts, group).movedim(0, 1).flatten(1, 2)


def _ulysses_attention(q, k, v, group: ProcessGroup | None, scale, plan, sinks, slopes, softcap):
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
    heads = slice(group_rank(group) * (hq // cp), (group_rank(group) + 1) * (hq // cp))
    if sinks is not None:  # this rank's head group's (the others' gradients stay 0 here: the cp reduce sums them)
        sinks = sinks[heads]
    # The sequence is in global order now: plain one-process attention over the documents.
    slopes = None if slopes is None else slopes[heads]
    return _heads_to_seq(piecewise_attention(q, k, v, plan[0], scale, sinks, slopes, softcap), group)


# ---- entry point -----------------------------------------------------------------------------------------------------


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: ProcessGroup | None,
    comm_type: str,
    scale: float,
    documents: Documents | None = None,
    window: int | None = None,
    plan: tuple[list[Piece], ...] | None = None,
    sinks: torch.Tensor | None = None,
    slopes: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of this rank's queries against the whole sequence spread over the CP `group`.

    q and k [b, hq or hk, s_local, d], v [b, hk, s_local, dv] (hq a multiple of hk; v's head dim may differ), the
    rank's two chunks in the layout
    above; `documents` None or the micro-batch's documents in global positions (attention stays within a document);
    `window` Mistral's sliding window (None: unbounded); `plan` cp_attention_plan of these, when the caller has
    it already (the model computes it once per forward); `sinks` [hq] gpt-oss's learned sink logit per head
    (kernels/sinks.py); `slopes` [hq] ALiBi's (kernels/alibi.py), with a `plan` built positional and cut into
    tiles; `softcap` Gemma 2's attention soft-capping, with a plan cut into tiles. Returns [b, hq, s_local, d].
    """
    assert comm_type in CP_COMM_TYPES, f"comm_type {comm_type!r}"  # the recipe's schema checked it (config.py)
    if k.shape[:3] != v.shape[:3] or q.shape[2] != k.shape[2] or q.shape[1] % k.shape[1] or q.shape[3] != k.shape[3]:
        raise ValueError(f"bad attention shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    cp = group_size(group)
    if documents is not None and (len(documents.rows) != q.shape[0] or documents.seq_len != q.shape[2] * cp):
        raise ValueError(f"documents describe {len(documents.rows)} rows of {documents.seq_len} tokens, not "
                         f"{q.shape[0]} of {q.shape[2] * cp}")
    positional, tiled = slopes is not None, slopes is not None or softcap is not None
    if cp == 1:
        pieces = self_attention_pieces(documents, q.shape[2], window, positional)
        return piecewise_attention(q, k, v, tiles(pieces) if tiled else pieces, scale, sinks, slopes, softcap)
    if q.shape[2] % 2:
        raise ValueError(f"each CP rank holds two equal chunks; its local length {q.shape[2]} is odd")
    if plan is None:
        plan = cp_attention_plan(documents, q.shape[2] * cp, cp, group_rank(group), comm_type, window, positional,
                                 tiled)
    if comm_type == "p2p":
        return _RingAttention.apply(q, k, v, group, scale, plan, sinks, slopes, softcap)
    if comm_type == "allgather":
        return _AllGatherAttention.apply(q, k, v, group, scale, plan, sinks, slopes, softcap)
    return _ulysses_attention(q, k, v, group, scale, plan, sinks, slopes, softcap)
