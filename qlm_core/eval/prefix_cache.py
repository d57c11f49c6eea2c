"""Requests that share a context (multiple choice: one question, N answers) run that context once and score every
continuation from its KV cache, with the same numbers as scoring each request on its own row (scoring.py).

Contexts go in batches of `batch_size`, sorted longest first by lm-eval's Collator, left-padded and masked. The last
context token's logits predict each continuation's first token; the rest of each continuation (all but its last
token; right-padded, which causal attention never sees) then runs on a copy of its context's cache rows, at the
positions it would have had after its context: up to CACHE_COPIES x `batch_size` rows a pass, few tokens each, so
a group may span passes. Requests that lm-eval would cut from the left (context + continuation longer than
max_length + 1) have a prefix that depends on the continuation: they stay on the plain path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from lm_eval.models.utils import Collator

from qlm_core.decode.sampling import left_pad
from qlm_core.eval.scoring import Answer, Request, continuation_answer, model_device, right_padded
from qlm_core.models.attention import KVCache
from qlm_core.models.gpt import GPTModel

# a continuation pass runs few tokens a row: up to this many rows per context row keep it from being bound by
# reading the weights (multiple choice's 4 answers a question then take one pass per context batch)
CACHE_COPIES = 4


@dataclass
class SharedContext:
    tokens: list[int]
    members: list[tuple[int, list[int]]]  # (index among the requests, continuation tokens)


def split_shared(requests: Sequence[Request], max_length: int) -> tuple[list[SharedContext], list[int]]:
    """The contexts that two or more uncut requests share, and the indices of every other request."""
    uncut = [i for i, (_, ctx, cont) in enumerate(requests) if len(ctx) + len(cont) <= max_length + 1]
    by_context = Collator.group(uncut, fn=lambda i: requests[i][1], group_by="contexts")
    groups = [SharedContext(list(tokens), [(i, requests[i][2]) for i in members])
              for tokens, members in by_context.items() if len(members) > 1]
    shared = {i for group in groups for i, _ in group.members}
    return groups, [i for i in range(len(requests)) if i not in shared]


@dataclass
class _ContextBatch:
    lengths: list[int]
    cache: KVCache  # keys / values [contexts, groups, longest context, head_dim], each context flush right
    first: torch.Tensor  # [contexts, vocab]: the logits after each context's last token


def _run_contexts(model: GPTModel, contexts: list[list[int]]) -> _ContextBatch:
    """Left-padded, as generate.py's prompts: every context ends in the last cache column, so a continuation's
    distance to each context token (what a sliding window counts) is its distance in cache columns."""
    device = model_device(model)
    ids, mask = left_pad(contexts, pad_id=0)
    cache = KVCache.empty(len(model.decoder.layers))
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    hidden = model.hidden_states(ids.to(device), positions.to(device), cache=cache, attention_mask=mask.to(device))
    return _ContextBatch([len(c) for c in contexts], cache, model.logits(hidden[-1:])[:, -1])


def _run_continuations(model: GPTModel, batch: _ContextBatch, rows: list[tuple[int, list[int]]]) -> torch.Tensor:
    """rows (context number in `batch`, tokens after its context) -> logits [rows, longest row, vocab]."""
    device = model_device(model)
    owners = torch.tensor([c for c, _ in rows], device=device)
    past = max(batch.lengths[c] for c, _ in rows)  # the cache columns these rows' contexts fill
    width = max(len(tokens) for _, tokens in rows)
    cache = KVCache([k.index_select(0, owners)[:, :, -past:] for k in batch.cache.keys],
                    [v.index_select(0, owners)[:, :, -past:] for v in batch.cache.values])
    mask = torch.ones(len(rows), past + width, dtype=torch.long)
    for row, (c, _) in enumerate(rows):
        mask[row, : past - batch.lengths[c]] = 0  # the context's left padding
    positions = torch.tensor([[batch.lengths[c] + j for j in range(width)] for c, _ in rows])
    hidden = model.hidden_states(right_padded([tokens for _, tokens in rows], device), positions.to(device),
                                 cache=cache, attention_mask=mask.to(device))
    return model.logits(hidden)


def _continuation_batches(members: list, batch_size: int, budget: int):
    """Consecutive runs of `members` (longest continuation first): at most CACHE_COPIES x batch_size rows, whose
    cache copies are then at most that many times the context batch's cache, and at most `budget` new tokens (the
    context batch's), so that no pass holds more activations than the context pass did."""
    start = 0
    while start < len(members):
        width = len(members[start][2]) - 1
        rows = max(1, min(CACHE_COPIES * batch_size, budget // width))
        yield members[start: start + rows]
        start += rows


@torch.no_grad()
def score_shared(model: GPTModel, groups: Sequence[SharedContext], batch_size: int) -> dict[int, Answer]:
    """Every member's answer, by its request index."""
    ordered = Collator(list(groups), sort_fn=lambda g: (-len(g.tokens), tuple(g.tokens)))
    answers: dict[int, Answer] = {}
    for chunk in ordered.get_batched(n=batch_size):
        batch = _run_contexts(model, [group.tokens for group in chunk])
        members = [(c, index, cont) for c, group in enumerate(chunk) for index, cont in group.members]
        for c, index, cont in members:
            if len(cont) == 1:
                answers[index] = continuation_answer(batch.first[c: c + 1], cont)
        longer = sorted((m for m in members if len(m[2]) > 1), key=lambda m: (-len(m[2]), m[1]))
        for part in _continuation_batches(longer, batch_size, budget=batch_size * max(batch.lengths)):
            later = _run_continuations(model, batch, [(c, cont[:-1]) for c, _, cont in part])
            for (c, index, cont), scores in zip(part, later, strict=True):
                logits = torch.cat((batch.first[c: c + 1], scores[: len(cont) - 1]))
                answers[index] = continuation_answer(logits, cont)
    return answers
