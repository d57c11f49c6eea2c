"""Shared-prefix packing: rows that begin with the same tokens (a rollout group's prompt, answered n times) run the
transformer over those tokens once.

A micro-batch [b, s] becomes one packed row: for each group of adjacent rows sharing a prefix, the prefix once, then
each row's own tokens after it as a document that continues the prefix (it sees every prefix key and its own,
causally: kernels/pieces.Documents.prefixes), at the positions the row gives them. Causal attention makes each row's
hidden states those of its unpacked forward, so the final norm's output is gathered back into [s, b, h] rows for the
loss head and the objective, unchanged: the gradient of a prefix token sums over the rows that share it, as it would
over its copies. A row's tokens after its last label reach no labelled token and are not run (zeros there); a prefix
ends where the rows' inputs first differ, at most at the position of the group's first label (the prompt's last
token, whose hidden state the rows share while their labels differ), so that a group's rows agree on where it ends.

One process along the sequence (no pipeline or context parallelism, no packed segment_ids or sliding windows, no
MoE: its routers would see the prefix once, which changes their load-balancing statistics; no torch.compile: the
packed length changes every step); under sequence parallelism the packed row is padded to a multiple of the TP size
and gathered whole before it is unpacked, so each TP rank holds the micro-batch's final hidden states whole for a
moment (about 3 b s h values, against b s h / tp for SP's own shard)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qlm_core.kernels.pieces import Documents


@dataclass(frozen=True)
class SharedPrefixes:
    """A micro-batch packed into one row: input_ids and position_ids [1, T] and their documents, and `source`
    [b * s]: for each position of the rows, the packed index it is read from (T: a zero vector)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    documents: Documents
    source: torch.Tensor
    rows: int
    seq_len: int
    saved_tokens: int  # b * s less the packed row's length: the positions the transformer does not run

    def unpack(self, hidden: torch.Tensor) -> torch.Tensor:
        """The packed row's final norm output [T, 1, h] -> the rows' [s, b, h]."""
        flat = torch.cat([hidden[:, 0], hidden.new_zeros(1, hidden.shape[-1])])
        return flat.index_select(0, self.source).view(self.rows, self.seq_len, -1).transpose(0, 1)


def _labelled_bounds(labels: torch.Tensor) -> tuple[list[int], list[int]]:
    """Per row: the index of its first label and one past its last (0, 0 for a row with none)."""
    has = labels >= 0
    any_label = has.any(dim=1)
    index = torch.arange(labels.shape[1])
    first = torch.where(has, index, labels.shape[1]).amin(dim=1)
    last = torch.where(has, index, -1).amax(dim=1) + 1
    return torch.where(any_label, first, 0).tolist(), torch.where(any_label, last, 0).tolist()


def _common(a: torch.Tensor, b: torch.Tensor) -> int:
    """The length of the common prefix of two 1-D tensors of one length."""
    differ = (a != b).nonzero()
    return int(differ[0, 0]) if len(differ) else a.shape[0]


def pack_shared_prefixes(input_ids: torch.Tensor, position_ids: torch.Tensor, labels: torch.Tensor,
                         multiple: int = 1, pad_id: int = 0) -> SharedPrefixes | None:
    """The packing of these rows [b, s] (None when it would run no fewer positions than the rows: no two adjacent
    rows share their first token). A row joins the group of the rows before it when it shares at least the group's
    prefix with the group's first row (tokens and positions, up to either's first label position); `multiple`: the
    packed length is padded to it."""
    rows, seq = input_ids.shape
    first, end = _labelled_bounds(labels.cpu())
    ids_cpu, pos_cpu = input_ids.cpu(), position_ids.cpu()
    groups: list[tuple[list[int], int]] = []  # (rows, the prefix they share)
    for row in range(rows):
        if end[row] == 0:  # nothing to train on: nothing to run
            continue
        if groups:
            members, shared = groups[-1]
            lead = members[0]
            common = min(_common(ids_cpu[lead], ids_cpu[row]), _common(pos_cpu[lead], pos_cpu[row]),
                         first[lead] + 1, first[row] + 1)
            if common > 0 and (len(members) > 1 and common >= shared or len(members) == 1):
                groups[-1] = (members + [row], common if len(members) == 1 else shared)
                continue
        groups.append(([row], 0))
    if not any(len(members) > 1 for members, _ in groups):
        return None
    ids, pos, spans, prefixes = [], [], [], []
    source = torch.full((rows, seq), -1, dtype=torch.long)
    length = 0
    for members, shared in groups:
        prefix = None
        if shared > 0:
            lead = members[0]
            ids.append(ids_cpu[lead, :shared])
            pos.append(pos_cpu[lead, :shared])
            spans.append((length, length + shared))
            prefixes.append(None)
            prefix = (length, length + shared)
            source[members, :shared] = torch.arange(length, length + shared)
            length += shared
        for row in members:
            own = end[row] - shared
            ids.append(ids_cpu[row, shared:end[row]])
            pos.append(pos_cpu[row, shared:end[row]])
            spans.append((length, length + own))
            prefixes.append(prefix)
            source[row, shared:end[row]] = torch.arange(length, length + own)
            length += own
    padding = -length % multiple
    if padding:  # a document of its own, read by no row
        ids.append(torch.full((padding,), pad_id, dtype=ids_cpu.dtype))
        pos.append(torch.arange(padding, dtype=pos_cpu.dtype))
        spans.append((length, length + padding))
        prefixes.append(None)
    total = length + padding
    if total >= rows * seq:  # nothing saved (padding to the TP size can eat a small saving)
        return None
    source[source < 0] = total  # the zero vector appended by unpack
    device = input_ids.device
    return SharedPrefixes(
        input_ids=torch.cat(ids)[None].to(device), position_ids=torch.cat(pos)[None].to(device),
        documents=Documents((tuple(spans),), total, (tuple(prefixes),)),
        source=source.view(-1).to(device), rows=rows, seq_len=seq, saved_tokens=rows * seq - total)
