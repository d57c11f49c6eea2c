"""Log-likelihoods of continuations as lm-eval's hf backend computes them: each request's context + continuation,
cut from the left to max_length + 1 tokens and its last token dropped, in right-padded batches sorted longest first
by lm-eval's Collator. The output layer runs only where a continuation token is predicted, never over a whole row.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from lm_eval.models.utils import Collator

from qlm_core.models.gpt import GPTModel

Answer = tuple[float, bool]  # (log-likelihood of the continuation, whether greedy decoding gives it)
Request = tuple[object, list[int], list[int]]  # (lm-eval's cache key, context tokens, continuation tokens)


def continuation_answer(logits: torch.Tensor, continuation: Sequence[int]) -> Answer:
    """logits [len(continuation), vocab], row j predicting continuation[j] -> the request's answer."""
    log_probs = F.log_softmax(logits.float(), dim=-1)
    target = torch.tensor(list(continuation), device=logits.device)
    greedy = bool((log_probs.argmax(dim=-1) == target).all())
    return float(log_probs.gather(-1, target[:, None]).sum()), greedy


def right_padded(rows: Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
    """Token rows -> [b, longest] ids, zeros after each row's end (causal attention never looks there)."""
    batch = torch.zeros(len(rows), max(len(r) for r in rows), dtype=torch.long)
    for i, r in enumerate(rows):
        batch[i, : len(r)] = torch.tensor(list(r))
    return batch.to(device)


def logits_at(model: GPTModel, hidden: torch.Tensor, positions: Sequence[Sequence[int]]) -> torch.Tensor:
    """hidden [s, b, h] and, per row, the positions to project (all rows as many) -> logits [b, n, vocab]."""
    index = torch.tensor(positions, device=hidden.device)  # [b, n]
    rows = torch.arange(hidden.shape[1], device=hidden.device)[:, None].expand_as(index)
    return model.logits(hidden[index.T, rows.T])


def model_device(model: GPTModel) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def score_plain(model: GPTModel, requests: Sequence[Request], batch_size: int, max_length: int) -> list[Answer]:
    """Every request on its own row (lm-eval's hf path); answers in the order of `requests`."""
    device = model_device(model)
    ordered = Collator(list(requests), sort_fn=lambda r: (-len(r[1] + r[2]), tuple(r[1] + r[2])))
    answers = []
    for chunk in ordered.get_batched(n=batch_size):
        rows = [(ctx + cont)[-(max_length + 1):][:-1] for _, ctx, cont in chunk]
        width = max(len(cont) for _, _, cont in chunk)
        # row i predicts its continuation at its last len(cont) positions; shorter ones repeat their last position
        positions = [[len(row) - len(cont) + min(j, len(cont) - 1) for j in range(width)]
                     for row, (_, _, cont) in zip(rows, chunk, strict=True)]
        logits = logits_at(model, model.hidden_states(right_padded(rows, device)), positions)
        answers += [continuation_answer(scores[: len(cont)], cont)
                    for (_, _, cont), scores in zip(chunk, logits, strict=True)]
    return ordered.get_original(answers)
