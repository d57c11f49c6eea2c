"""Rollouts for reinforcement learning, in the trainer's own process: the policy's current weights answer each
prompt `num_generations` times with qlm's KV-cache decoding (decode/sampling.py), the answers are scored
(rewards.py) and turned into group-relative advantages, and everything is packed as the training rows of a
RolloutBatch (objectives/grpo.py):

    input_ids = (prompt + completion)[:-1], labels = (prompt + completion)[1:] with -100 on the rows that predict
    prompt tokens and on the right padding; old_logps = each completion token's log-probability under the
    distribution it was sampled from, at its label's position. A completion that an eos ended trains on the eos too.

Positions are the tokens' indices from the prompt's first token, as decoding saw them (its left padding is not
counted), so the trainer's forward of a row is the rollout's forward of the same tokens. An MoE policy's rollout
records the experts each of those input tokens was routed to (`routes`, -1 on the padding), for the trainer to
replay (routing replay, R3) or compare."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from qlm_core.decode.sampling import Generation, Sampling, generate_rows, left_pad
from qlm_core.errors import QlmError
from qlm_core.models.gpt import GPTModel
from qlm_core.train.objectives.grpo import RolloutBatch
from qlm_core.train.rewards import Rewards, ScaleRewards, group_advantages, nanstd, source_metrics


@dataclass(frozen=True)
class RolloutConfig:
    num_generations: int = 8  # completions per prompt (a group)
    max_completion_length: int = 64
    sampling: Sampling = field(default_factory=lambda: Sampling(temperature=1.0))
    scale_rewards: ScaleRewards = "group"
    overlong_filter: bool = False  # truncated completions do not train (DAPO)
    overlong_buffer: int = 0  # soft overlong punishment over the last this many tokens (DAPO's L_cache; 0: off)
    overlong_penalty_factor: float = 1.0
    max_sampling_tries: int = 4  # dynamic sampling: the most prompt draws for one step
    batch_rows: int = 0  # completions decoded at once (bounds the KV cache); 0: all of them

    def __post_init__(self):
        for name, least in (("num_generations", 1), ("max_completion_length", 1), ("max_sampling_tries", 1),
                            ("overlong_buffer", 0), ("batch_rows", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise QlmError(f"rl.{name} is {value!r}, not an integer of {least} or more",
                               f"set rl.{name} to {least} or more")
        if self.overlong_buffer >= self.max_completion_length:
            raise QlmError(f"rl.overlong_buffer {self.overlong_buffer} is not below rl.max_completion_length "
                           f"{self.max_completion_length}", "set a buffer shorter than the longest completion")


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
    recorded = generations[0].routes if generations else None
    routes = None if recorded is None else torch.full((rows, seq_length, *recorded.shape[1:]), -1, dtype=torch.int32)
    for row, (prompt, generation) in enumerate(zip(prompts, generations, strict=True)):
        if not prompt:
            raise QlmError(f"rollout row {row} has an empty prompt", "give every prompt at least one token")
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
        if routes is not None:
            if generation.routes.shape[0] != length:  # decoding fed every input token once
                raise ValueError(f"row {row}: routes of {generation.routes.shape[0]} tokens for {length} inputs")
            routes[row, :length] = generation.routes
    return RolloutBatch(input_ids, labels, old_logps=old, routes=routes)


@torch.no_grad()
def generate_groups(model: GPTModel, prompts: Sequence[Sequence[int]], config: RolloutConfig,
                    eos_token_id: int | Sequence[int] | None, pad_id: int,
                    record_routes: bool = True) -> list[Generation]:
    """`num_generations` completions of each prompt, a prompt's adjacent, decoded `batch_rows` at a time (default
    all in one batch; when that is whole groups, each prompt is read once and its cache shared by its group); an
    MoE model's routes recorded for the trainer (`record_routes`)."""
    n = config.num_generations
    size = config.batch_rows or len(prompts) * n
    copies = n if size % n == 0 else 1  # whole groups in every decode batch: each prompt read once for its group
    rows = [list(p) for p in prompts for _ in range(n // copies)]
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(config.sampling.seed)  # one stream through every decode batch
    out = []
    for first in range(0, len(rows), size // copies):
        input_ids, mask = left_pad(rows[first:first + size // copies], pad_id)
        out += generate_rows(model, input_ids.to(device), mask.to(device), max_new_tokens=config.max_completion_length,
                             eos_token_id=eos_token_id, sampling=config.sampling, generator=generator,
                             record_routes=record_routes, copies=copies)
    return out


@dataclass
class Groups:
    """Sampled groups before they become a batch: each row's prompt ids, record and completion, the sources'
    rewards [rows, sources]; a group is `num_generations` adjacent rows."""

    prompts: list[list[int]]
    records: list[dict[str, Any]]
    generations: list[Generation]
    per_source: torch.Tensor

    def select(self, groups: list[int], size: int) -> Groups:
        rows = [g * size + k for g in groups for k in range(size)]
        return Groups([self.prompts[r] for r in rows], [self.records[r] for r in rows],
                      [self.generations[r] for r in rows], self.per_source[rows])

    @staticmethod
    def join(parts: Sequence[Groups]) -> Groups:
        return Groups([p for g in parts for p in g.prompts], [r for g in parts for r in g.records],
                      [x for g in parts for x in g.generations], torch.cat([g.per_source for g in parts]))


def overlong_penalty(length: int, max_length: int, buffer: int) -> float:
    """DAPO's soft overlong punishment: 0 up to max_length - buffer tokens, then falling linearly to -1 at
    max_length (and beyond)."""
    free = max_length - buffer
    if length <= free:
        return 0.0
    return max((free - length) / buffer, -1.0)


def sample_groups(model: GPTModel, prompts: Sequence[Sequence[int]], records: Sequence[dict[str, Any]],
                  config: RolloutConfig, rewards: Rewards, decode_text: Callable[[list[int]], str], *,
                  seq_length: int, eos_token_id: int | Sequence[int] | None, pad_id: int,
                  record_routes: bool = True) -> Groups:
    """`num_generations` scored completions of each prompt (`records`: their data records, each with its `prompt`
    text and the fields the rewards read); `record_routes`: an MoE model's routes kept for training."""
    longest = max(len(p) for p in prompts)
    if longest + config.max_completion_length - 1 > seq_length:
        raise QlmError(f"a prompt of {longest} tokens leaves no room for rl.max_completion_length "
                       f"{config.max_completion_length} in data.seq_length {seq_length}",
                       "raise data.seq_length, lower rl.max_completion_length or shorten the prompts")
    generations = generate_groups(model, prompts, config, eos_token_id, pad_id, record_routes)
    n = config.num_generations
    row_prompts = [list(p) for p in prompts for _ in range(n)]
    row_records = [record for record in records for _ in range(n)]
    texts = [decode_text(g.tokens) for g in generations]
    per_source = rewards.score([str(r.get("prompt", "")) for r in row_records], texts, row_records)
    return Groups(row_prompts, row_records, list(generations), per_source)


def _scored(groups: Groups, config: RolloutConfig, rewards: Rewards) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """(rewards per source [rows, sources], their weights, their names), the soft overlong punishment one more."""
    per_source, weights, names = groups.per_source, rewards.weights, rewards.names
    if config.overlong_buffer > 0:
        penalty = torch.tensor([[overlong_penalty(len(trained_tokens(g)), config.max_completion_length,
                                                  config.overlong_buffer)] for g in groups.generations],
                               dtype=per_source.dtype)
        per_source = torch.cat([per_source, penalty], dim=1)
        weights = torch.cat([weights, torch.tensor([config.overlong_penalty_factor], dtype=weights.dtype)])
        names = [*names, "overlong"]
    return per_source, weights, names


@dataclass
class DataRanks:
    """Where a rank's rows sit among the data-parallel ranks of a step: its index of `size`, and `gather`, which
    joins a tensor's rows of every data-parallel rank in rank order (a collective; one process: the tensor)."""

    rank: int = 0
    size: int = 1
    gather: Callable[[torch.Tensor], torch.Tensor] = lambda rows: rows


def assemble(groups: Groups, config: RolloutConfig, rewards: Rewards, *, seq_length: int, pad_id: int,
             ranks: DataRanks | None = None) -> tuple[RolloutBatch, dict[str, float]]:
    """The training rows of sampled groups, their advantages and the step's metrics (TRL's names). With several
    data-parallel `ranks` each holds its own groups; the rewards of every rank's are gathered, so that the batch
    scaling and the metrics are the global batch's."""
    ranks = ranks or DataRanks()
    per_source, weights, names = _scored(groups, config, rewards)
    truncated = [g.finish == "length" for g in groups.generations]
    lengths = [float(len(trained_tokens(g))) for g in groups.generations]
    local = torch.cat([per_source, torch.tensor([lengths, truncated], dtype=per_source.dtype).T], dim=1)
    everyone = ranks.gather(local)
    per_source, lengths, clipped = everyone[:, :-2], everyone[:, -2], everyone[:, -1]
    advantages, metrics = group_advantages(per_source, weights, config.num_generations, config.scale_rewards)
    rows = len(groups.generations)
    batch = pack_rollouts(groups.prompts, groups.generations, seq_length, pad_id)
    batch.advantages = advantages[ranks.rank * rows:(ranks.rank + 1) * rows].float()
    if config.overlong_filter:  # a truncated completion's tokens do not train (DAPO's overlong filtering)
        batch.labels[torch.tensor(truncated)] = -100
    metrics.update(source_metrics(per_source, names))
    metrics.update({"completions/mean_length": lengths.mean().item(), "completions/max_length": lengths.max().item(),
                    "completions/min_length": lengths.min().item(),
                    "completions/clipped_ratio": clipped.mean().item()})
    return batch, metrics


def rollout(model: GPTModel, prompts: Sequence[Sequence[int]], records: Sequence[dict[str, Any]],
            config: RolloutConfig, rewards: Rewards, decode_text: Callable[[list[int]], str], *,
            seq_length: int, eos_token_id: int | Sequence[int] | None, pad_id: int
            ) -> tuple[RolloutBatch, dict[str, float]]:
    """One step's rollout batch from `prompts` (token ids; `records` their data records) and its metrics."""
    groups = sample_groups(model, prompts, records, config, rewards, decode_text, seq_length=seq_length,
                           eos_token_id=eos_token_id, pad_id=pad_id)
    return assemble(groups, config, rewards, seq_length=seq_length, pad_id=pad_id)


def signal_split(groups: Groups, config: RolloutConfig, rewards: Rewards) -> tuple[list[int], list[int]]:
    """The groups whose completions earned different rewards (a learning signal) and those that all earned the
    same, as the advantages will see them."""
    per_source, weights, _ = _scored(groups, config, rewards)
    totals = (per_source * weights).nansum(dim=1)
    totals[torch.isnan(per_source).all(dim=1)] = float("nan")
    spread = torch.nan_to_num(nanstd(totals.view(-1, config.num_generations), dim=1), nan=0.0)
    return ([g for g in range(spread.shape[0]) if spread[g] > 0],
            [g for g in range(spread.shape[0]) if spread[g] <= 0])


def collect_groups(sample: Callable[[int], Groups], num_prompts: int, config: RolloutConfig, rewards: Rewards,
                   agree: Callable[[bool], bool] = lambda done: done) -> tuple[Groups, dict[str, float]]:
    """DAPO's dynamic sampling: groups whose completions all earned the same reward (no signal) are dropped and
    more prompts drawn (`sample(k)`: the k-th draw's scored groups) until `num_prompts` groups carry a signal, at
    most `max_sampling_tries` draws; then the batch is filled with dropped groups. `agree(done)`: whether every
    rank that draws in step with this one is done (a collective; one process: `done`). Reports the draws and the
    groups filled."""
    n, kept, dropped, tries = config.num_generations, [], [], 0
    while tries < config.max_sampling_tries:
        done = sum(len(g.prompts) for g in kept) >= num_prompts * n
        if agree(done):
            break
        tries += 1  # a draw of every rank's prompts: a rank already full skips its share
        if done:
            continue
        groups = sample(tries - 1)
        signal, flat = signal_split(groups, config, rewards)
        if signal:
            kept.append(groups.select(signal, n))
        if flat:
            dropped.append(groups.select(flat, n))
    joined = Groups.join(kept) if kept else None
    have = 0 if joined is None else len(joined.prompts) // n
    filled = 0
    if have < num_prompts and dropped:  # out of tries: the batch is filled with groups that carry no signal
        spare = Groups.join(dropped)
        filled = min(num_prompts - have, len(spare.prompts) // n)
        spare = spare.select(list(range(filled)), n)
        joined = spare if joined is None else Groups.join([joined, spare])
    if joined is None or len(joined.prompts) < num_prompts * n:
        raise QlmError(f"the prompts ran out: {0 if joined is None else len(joined.prompts) // n} of {num_prompts} "
                       "groups for the step", "give more prompts (or fewer per step)")
    return joined.select(list(range(num_prompts)), n), {"dynamic_sampling/draws": float(tries),
                                                        "dynamic_sampling/filled_groups": float(filled)}
