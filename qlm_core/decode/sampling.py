"""Batched decoding with qlm's model and a KV cache: left-padded prompts, greedy or sampled tokens. What `qlm
generate`, lm-eval's generate_until and a rollout of reinforcement learning all run."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

import torch

from qlm_core.config import check_finite
from qlm_core.decode.routes import RouteRecorder
from qlm_core.errors import QlmError
from qlm_core.models.attention import KVCache
from qlm_core.models.gpt import GPTModel

MAX_SEED = 2**63 - 1


@dataclass
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 1234


def check_sampling(sampling: Sampling, max_new_tokens: int):
    """One-line errors for values `generate` cannot use (the CLI's option names)."""
    if max_new_tokens < 1:
        raise QlmError(f"--max-new-tokens {max_new_tokens} generates nothing", "pass --max-new-tokens 1 or more")
    check_finite("--temperature", sampling.temperature)
    check_finite("--top-p", sampling.top_p)
    if not sampling.temperature >= 0:
        raise QlmError(f"--temperature {sampling.temperature} is negative", "pass 0 (greedy) or a positive value")
    if not 0 < sampling.top_p <= 1:
        raise QlmError(f"--top-p {sampling.top_p} is not in (0, 1]", "pass a probability mass such as 0.9 (1: off)")
    if sampling.top_k < 0:
        raise QlmError(f"--top-k {sampling.top_k} is negative", "pass 0 (off) or a token count")
    if not 0 <= sampling.seed <= MAX_SEED:
        raise QlmError(f"--seed {sampling.seed} is out of range", f"pass a seed from 0 to {MAX_SEED}")
    if sampling.temperature == 0 and (sampling.top_p < 1 or sampling.top_k > 0):
        raise QlmError("--top-p / --top-k choose among sampled tokens, but decoding is greedy (--temperature 0)",
                       "pass --temperature > 0 to sample, or drop --top-p / --top-k")


def _choose(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """The next token of each row and its log-probability (fp32) under the distribution it was drawn from: logits /
    temperature with top-k and top-p applied (greedy: the plain softmax's)."""
    if sampling.temperature <= 0:
        chosen = logits.argmax(dim=-1)
        return chosen, logits.float().log_softmax(dim=-1).gather(-1, chosen[:, None]).squeeze(-1)
    scaled = logits.float() / sampling.temperature
    # a temperature so small that logits overflow (or 0 in fp32; above 1e-2 no logit a model gives can): relative to
    # each row's largest logit, the others go to -inf (greedy, in effect) and softmax sees no inf - inf
    if sampling.temperature < 1e-2 and not torch.isfinite(scaled).all():
        logits = logits.float()
        scaled = (logits - logits.amax(dim=-1, keepdim=True)) / max(sampling.temperature, 1e-30)
    logits = scaled
    if sampling.top_k > 0:
        kth = logits.topk(min(sampling.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative - sorted_logits.softmax(dim=-1) > sampling.top_p  # keep the first token always
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    # inverse transform sampling: one uniform draw a row, found in the row's cumulative probabilities (fp64), draws
    # token i with probability p_i as torch.multinomial does, without its random number for every vocabulary entry
    cumulative = logits.softmax(dim=-1).double().cumsum(dim=-1)
    if not torch.isfinite(cumulative[:, -1]).all():  # NaN / inf logits (a diverged model): no distribution to draw
        raise ValueError("the model's logits hold NaN or inf: nothing to sample from")
    uniform = torch.rand(cumulative.shape[0], 1, dtype=torch.float64, generator=generator,
                         device=generator.device).to(cumulative.device)
    chosen = torch.searchsorted(cumulative, uniform * cumulative[:, -1:], right=True).squeeze(-1)
    chosen = chosen.clamp(max=logits.shape[-1] - 1)
    return chosen, logits.log_softmax(dim=-1).gather(-1, chosen[:, None]).squeeze(-1)


@dataclass
class Generation:
    tokens: list[int] = field(default_factory=list)  # the new tokens, without the one that ended the turn
    finish: str = "length"  # "stop": an eos / stop token or `stop` ended it; "length": max_new_tokens reached
    # log-probability of each token under the distribution it was drawn from (a rollout's π_old), then, when an
    # eos id ended the turn, that token's (a rollout trains on it too)
    logprobs: list[float] = field(default_factory=list)
    eos_token: int | None = None  # the eos id that ended the turn (finish "stop" by eos)
    # record_routes (an MoE model): the experts each token the model was fed (the prompt's, then every new token but
    # the last) was routed to, [tokens, MoE layers, k] int16 (decode/routes.py)
    routes: torch.Tensor | None = None


@torch.no_grad()
def generate_rows(
    model: GPTModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    max_new_tokens: int,
    eos_token_id: int | Collection[int] | None,
    sampling: Sampling | None = None,
    stop: Callable[[list[int]], bool] | None = None,
    on_token: Callable[[int, int], None] | None = None,
    row_limits: Sequence[int] | None = None,
    generator: torch.Generator | None = None,
    record_routes: bool = False,
    copies: int = 1,
) -> list[Generation]:
    """input_ids / attention_mask [b, L], left-padded (mask 0 on padding). Each row's new tokens, ending at an
    eos id (`eos_token_id`: one or several; excluded) or when `stop(new_tokens)` says so (the tokens so far kept;
    callers trim stop strings). `on_token(row, token)` sees every kept token as it is chosen. `row_limits`: each
    row's own most tokens (its room in the context window), at most max_new_tokens. `generator`: the random stream
    to sample from (default a new one seeded with sampling.seed), for callers that decode in several batches.
    `record_routes`: each Generation keeps the MoE routes of the tokens fed (Generation.routes). `copies`: each
    input row is answered that many times (out row r * copies + c; `row_limits` per output row), its prompt read
    once and its keys and values shared by the copies (a rollout's group)."""
    sampling = sampling or Sampling()
    eos = set() if eos_token_id is None else {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id)
    generator = generator or torch.Generator().manual_seed(sampling.seed)
    model.eval()
    rows = input_ids.shape[0] * copies
    mask = attention_mask.long()
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    cache = KVCache.empty(len(model.decoder.layers))
    recorder = RouteRecorder(model, rows, input_ids.shape[1], max_new_tokens, record_routes)
    hidden, routes = recorder.run(model.hidden_states, input_ids, positions, cache=cache,
                                  attention_mask=mask)  # [L, b, h]
    logits = model.logits(hidden[-1:])[:, -1]  # the last position's only: never [b, L, vocab]
    if copies > 1:  # every copy starts from its prompt's cache, logits and routes
        shared = torch.arange(input_ids.shape[0], device=mask.device).repeat_interleave(copies)
        cache.select(shared)
        mask, positions, logits = mask[shared], positions[shared], logits[shared]
        routes = None if routes is None else routes.repeat_interleave(copies, dim=1)
    if routes is not None:
        recorder.keep_prompts(routes, mask.sum(dim=1).tolist())
    if max_new_tokens > 1:
        cache.reserve(max_new_tokens - 1)  # each step writes its token's keys and values in place
    out = [Generation() for _ in range(rows)]
    limits = [max_new_tokens] * rows if row_limits is None else [min(max_new_tokens, n) for n in row_limits]
    done = [n < 1 for n in limits]
    active = list(range(rows))  # the rows still in the batch (finished ones are dropped, see below)
    next_position = positions[:, -1] + 1
    for step in range(max_new_tokens):
        chosen, logprobs = _choose(logits, sampling, generator)
        for slot, (token, logprob) in enumerate(zip(chosen.tolist(), logprobs.tolist(), strict=True)):
            row = active[slot]
            if done[row]:
                continue
            if token in eos:
                done[row], out[row].finish, out[row].eos_token = True, "stop", token
                out[row].logprobs.append(logprob)  # the ending token's, which a rollout trains on too
                continue
            out[row].tokens.append(token)
            out[row].logprobs.append(logprob)
            if on_token is not None:
                on_token(row, token)
            if stop is not None and stop(out[row].tokens):
                done[row], out[row].finish = True, "stop"
            elif len(out[row].tokens) >= limits[row]:
                done[row] = True  # finish stays "length": its room in the window is used up
        if all(done) or step == max_new_tokens - 1:
            break
        slots = [slot for slot, row in enumerate(active) if not done[row]]
        if 4 * (len(active) - len(slots)) >= len(active):  # a quarter of the batch is done: stop computing those
            active = [active[slot] for slot in slots]
            keep = torch.tensor(slots, device=mask.device)
            cache.select(keep)
            mask, next_position, chosen = mask[keep], next_position[keep], chosen[keep]
        mask = torch.cat((mask, torch.ones(len(active), 1, dtype=mask.dtype, device=mask.device)), dim=1)
        hidden, routes = recorder.run(model.hidden_states, chosen[:, None], next_position[:, None], cache=cache,
                                      attention_mask=mask)
        if routes is not None:  # the rows still answering were fed their token; the others' is never read
            fed = [(slot, row) for slot, row in enumerate(active) if not done[row]]
            recorder.keep_step(routes, [slot for slot, _ in fed], [row for _, row in fed])
        logits = model.logits(hidden)[:, -1]  # any GPTModel, a pipeline StageModel (a rollout's policy) too
        next_position = next_position + 1
    for row, generation in enumerate(out):
        generation.routes = recorder.routes(row)
    return out


def generate(model: GPTModel, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, max_new_tokens: int,
             eos_token_id: int | Collection[int] | None, sampling: Sampling | None = None,
             stop: Callable[[list[int]], bool] | None = None) -> list[list[int]]:
    """generate_rows' new tokens only."""
    rows = generate_rows(model, input_ids, attention_mask, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id,
                         sampling=sampling, stop=stop)
    return [row.tokens for row in rows]


def left_pad(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rows -> (input_ids, attention_mask) [b, longest], padding on the left."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            ids[i, width - len(r):], mask[i, width - len(r):] = torch.tensor(list(r)), 1
    return ids, mask


# ---- `qlm generate`: prompts, stop tokens, answers -------------------------------------------------------------------
