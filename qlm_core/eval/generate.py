"""Batched text generation with qlm's model and a KV cache: left-padded prompts, greedy or sampled decoding."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from qlm_core.models.gpt import GPTModel, KVCache


@dataclass
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 1234


def _choose(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> torch.Tensor:
    if sampling.temperature <= 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / sampling.temperature
    if sampling.top_k > 0:
        kth = logits.topk(min(sampling.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative - sorted_logits.softmax(dim=-1) > sampling.top_p  # keep the first token always
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return torch.multinomial(logits.softmax(dim=-1).cpu(), 1, generator=generator).squeeze(-1).to(logits.device)


@torch.no_grad()
def generate(
    model: GPTModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    max_new_tokens: int,
    eos_token_id: int | None,
    sampling: Sampling | None = None,
    stop: Callable[[list[int]], bool] | None = None,
) -> list[list[int]]:
    """input_ids / attention_mask [b, L], left-padded (mask 0 on padding). Returns each row's new tokens, ending at
    eos (excluded) or when `stop(new_tokens)` says so (the tokens so far kept; callers trim stop strings)."""
    sampling = sampling or Sampling()
    generator = torch.Generator().manual_seed(sampling.seed)
    model.eval()
    rows = input_ids.shape[0]
    mask = attention_mask.long()
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    cache = KVCache.empty(len(model.decoder.layers))
    logits = model(input_ids, positions, cache=cache, attention_mask=mask)[:, -1]
    new_tokens: list[list[int]] = [[] for _ in range(rows)]
    done = [False] * rows
    next_position = positions[:, -1] + 1
    for _ in range(max_new_tokens):
        chosen = _choose(logits, sampling, generator)
        for row, token in enumerate(chosen.tolist()):
            if done[row]:
                continue
            if token == eos_token_id:
                done[row] = True
                continue
            new_tokens[row].append(token)
            if stop is not None and stop(new_tokens[row]):
                done[row] = True
        if all(done):
            break
        mask = torch.cat((mask, torch.ones(rows, 1, dtype=mask.dtype, device=mask.device)), dim=1)
        logits = model(chosen[:, None], next_position[:, None], cache=cache, attention_mask=mask)[:, -1]
        next_position = next_position + 1
    return new_tokens
