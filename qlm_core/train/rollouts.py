"""Rollouts for reinforcement learning, in the trainer's own process: the policy's current weights answer each
prompt `num_generations` times with qlm's KV-cache decoding (decode/sampling.py), the answers are scored
(rewards.py) and turned into group-relative advantages, and everything is packed as the training rows of a
RolloutBatch (objectives/grpo.py):

    input_ids = (prompt + completion)[:-1], labels = (prompt + completion)[1:] with -100 on the rows that predict
    prompt tokens and on the right padding; old_logps = each completion token's log-probability under the
    distribution it was sampled from, at its label's position. A completion that an eos ended trains on the eos too.

Positions are the tokens' indices from the prompt's first token, as decoding saw them (its left padding is not
counted), so the trainer's forward of a row is the rollout's forward of the same tokens."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from qlm_core.decode.sampling import Generation, Sampling, generate_rows, left_pad
from qlm_core.errors import QlmError
from qlm_core.models.gpt import GPTModel
from qlm_core.train.objectives.grpo import RolloutBatch
from qlm_core.train.rewards import Rewards, ScaleRewards, group_advantages, source_metrics


@dataclass(frozen=True)
class RolloutConfig:
    num_generations: int = 8  # completions per prompt (a group)
    max_completion_length: int = 64
    sampling: Sampling = field(default_factory=lambda: Sampling(temperature=1.0))
    scale_rewards: ScaleRewards = "group"


def trained_tokens(generation: Generation) -> list[int]:
    """The completion tokens the step trains on: the kept ones and the eos that ended the turn."""
    return generation.tokens + ([generation.eos_token] if generation.eos_token is not None else [])


def pack_rollouts(prompts: Sequence[Sequence[int]], generations: Sequence[Generation], seq_length: int,
                  pad_id: int) -> RolloutBatch:
    """Rows of prompt + completion (one per generation; `prompts` aligned with them) as RolloutBatch tensors
    [rows, seq_length] (advantages left to the caller)."""
    rows = len(generations)
    input_ids = torch.full((rows, seq_length), pad_id, dtype=torch.long)
    labels = torch.full((rows, seq_length), -100, dtype=torch.long)
    old = torch.zeros(rows, seq_length, dtype=torch.float32)
    for row, (prompt, generation) in enumerate(zip(prompts, generations, strict=True)):
        completion = trained_tokens(generation)
        sequence = list(prompt) + completion
        if len(sequence) - 1 > seq_length:
            raise QlmError(f"a prompt of {len(prompt)} tokens and its answer of {len(completion)} exceed "
                           f"data.seq_length {seq_length}", "raise data.seq_length or lower rl.max_completion_length")
        length = len(sequence) - 1
        input_ids[row, :length] = torch.tensor(sequence[:-1])
        first = len(prompt) - 1  # the position that predicts the first completion token
        labels[row, first:length] = torch.tensor(completion)
        old[row, first:length] = torch.tensor(generation.logprobs, dtype=torch.float32)
    return RolloutBatch(input_ids, labels, old_logps=old)


@torch.no_grad()
def generate_groups(model: GPTModel, prompts: Sequence[Sequence[int]], config: RolloutConfig,
                    eos_token_id: int | Sequence[int] | None, pad_id: int) -> list[Generation]:
    """`num_generations` completions of each prompt, a prompt's adjacent, in one batched decode."""
    repeated = [list(p) for p in prompts for _ in range(config.num_generations)]
    input_ids, mask = left_pad(repeated, pad_id)
    return generate_rows(model, input_ids, mask, max_new_tokens=config.max_completion_length,
                         eos_token_id=eos_token_id, sampling=config.sampling)


def rollout(model: GPTModel, prompts: Sequence[Sequence[int]], records: Sequence[dict[str, Any]],
            config: RolloutConfig, rewards: Rewards, decode_text: Callable[[list[int]], str], *,
            seq_length: int, eos_token_id: int | Sequence[int] | None, pad_id: int
            ) -> tuple[RolloutBatch, dict[str, float]]:
    """One step's rollout batch from `prompts` (token ids; `records` their data records, each with its `prompt`
    text and the fields the rewards read) and the step's metrics (TRL's names)."""
    longest = max(len(p) for p in prompts)
    if longest + config.max_completion_length - 1 > seq_length:
        raise QlmError(f"a prompt of {longest} tokens leaves no room for rl.max_completion_length "
                       f"{config.max_completion_length} in data.seq_length {seq_length}",
                       "raise data.seq_length, lower rl.max_completion_length or shorten the prompts")
    generations = generate_groups(model, prompts, config, eos_token_id, pad_id)
    n = config.num_generations
    texts = [decode_text(g.tokens) for g in generations]
    prompt_texts = [str(record.get("prompt", "")) for record in records for _ in range(n)]
    row_records = [record for record in records for _ in range(n)]
    per_source = rewards.score(prompt_texts, texts, row_records)
    advantages, metrics = group_advantages(per_source, rewards.weights, n, config.scale_rewards)
    batch = pack_rollouts([p for p in prompts for _ in range(n)], generations, seq_length, pad_id)
    batch.advantages = advantages.float()
    lengths = torch.tensor([len(trained_tokens(g)) for g in generations], dtype=torch.float64)
    metrics.update(source_metrics(per_source, rewards.names))
    metrics.update({"completions/mean_length": lengths.mean().item(), "completions/max_length": lengths.max().item(),
                    "completions/min_length": lengths.min().item(),
                    "completions/clipped_ratio": sum(g.finish == "length" for g in generations) / len(generations)})
    return batch, metrics
