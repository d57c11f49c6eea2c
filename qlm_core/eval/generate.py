"""Batched text generation with qlm's model and a KV cache: left-padded prompts, greedy or sampled decoding; and what
`qlm generate` needs around it (prompts rendered with a chat template, the tokens that end a turn, answer text)."""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from qlm_core.config import check_finite
from qlm_core.errors import QlmError
from qlm_core.models.gpt import GPTModel, KVCache

# end-of-turn markers of the chat templates qlm names (and most checkpoints' own): a turn stops where one appears
END_OF_TURN = ("<|im_end|>", "<|eot_id|>")
GENERATION_CONFIG = "generation_config.json"
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


@dataclass
class Generation:
    tokens: list[int] = field(default_factory=list)  # the new tokens, without the one that ended the turn
    finish: str = "length"  # "stop": an eos / stop token or `stop` ended it; "length": max_new_tokens reached


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
) -> list[Generation]:
    """input_ids / attention_mask [b, L], left-padded (mask 0 on padding). Each row's new tokens, ending at an
    eos id (`eos_token_id`: one or several; excluded) or when `stop(new_tokens)` says so (the tokens so far kept;
    callers trim stop strings). `on_token(row, token)` sees every kept token as it is chosen."""
    sampling = sampling or Sampling()
    eos = set() if eos_token_id is None else {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id)
    generator = torch.Generator().manual_seed(sampling.seed)
    model.eval()
    rows = input_ids.shape[0]
    mask = attention_mask.long()
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    cache = KVCache.empty(len(model.decoder.layers))
    hidden = model.hidden_states(input_ids, positions, cache=cache, attention_mask=mask)  # [L, b, h]
    logits = model.logits(hidden[-1:])[:, -1]  # the last position's only: never [b, L, vocab]
    if max_new_tokens > 1:
        cache.reserve(max_new_tokens - 1)  # each step writes its token's keys and values in place
    out = [Generation() for _ in range(rows)]
    done = [False] * rows
    active = list(range(rows))  # the rows still in the batch (finished ones are dropped, see below)
    next_position = positions[:, -1] + 1
    for step in range(max_new_tokens):
        chosen = _choose(logits, sampling, generator)
        for slot, token in enumerate(chosen.tolist()):
            row = active[slot]
            if done[row]:
                continue
            if token in eos:
                done[row], out[row].finish = True, "stop"
                continue
            out[row].tokens.append(token)
            if on_token is not None:
                on_token(row, token)
            if stop is not None and stop(out[row].tokens):
                done[row], out[row].finish = True, "stop"
        if all(done) or step == max_new_tokens - 1:
            break
        slots = [slot for slot, row in enumerate(active) if not done[row]]
        if 4 * (len(active) - len(slots)) >= len(active):  # a quarter of the batch is done: stop computing those
            active = [active[slot] for slot in slots]
            keep = torch.tensor(slots, device=mask.device)
            cache.select(keep)
            mask, next_position, chosen = mask[keep], next_position[keep], chosen[keep]
        mask = torch.cat((mask, torch.ones(len(active), 1, dtype=mask.dtype, device=mask.device)), dim=1)
        logits = model(chosen[:, None], next_position[:, None], cache=cache, attention_mask=mask)[:, -1]
        next_position = next_position + 1
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


@dataclass
class Prompting:
    chat_template: str | None = None  # a name (chatml, qwen, llama3) or Jinja; None: the tokenizer's own
    raw: bool = False  # no template: the prompt text as it is
    system: str | None = None


def prompt_template(tokenizer, prompting: Prompting, where: str) -> str | None:
    """The chat template prompts are rendered with (None: raw)."""
    from qlm_core.data.tokenizer import resolve_chat_template

    if prompting.raw:
        if prompting.chat_template is not None:
            raise QlmError("--raw renders no template, but --chat-template names one", "pass one of the two")
        if prompting.system is not None:
            raise QlmError("--system needs a chat template, but --raw renders none",
                           "drop --raw, or write the system text into the prompt")
        return None
    if prompting.chat_template is None:
        own = getattr(tokenizer, "chat_template", None)
        if not (own.get("default") if isinstance(own, dict) else own):
            raise QlmError(f"the tokenizer of {where} has no chat template",
                           "pass --chat-template chatml or llama3, or --raw for the prompt as written")
    return resolve_chat_template(tokenizer, prompting.chat_template)


def encode_prompt(tokenizer, text: str, template: str | None, system: str | None) -> list[int]:
    """The prompt's token ids: rendered as one user turn (after `system`) and the assistant's generation prompt, or
    with the tokenizer's own special tokens (BOS) when raw."""
    if template is None:
        return list(tokenizer.encode(text))
    from jinja2 import TemplateError

    messages = ([{"role": "system", "content": system}] if system is not None else []) + [
        {"role": "user", "content": text}]
    try:
        rendered = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                                 add_generation_prompt=True)
    except (TemplateError, ValueError) as exc:  # a Jinja syntax error, raise_exception(), no such template
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise QlmError(f"the chat template does not render the prompt ({reason})",
                       "pass --chat-template chatml or llama3, or --raw") from None
    return list(tokenizer.encode(rendered, add_special_tokens=False))  # the template wrote BOS when it has one


def generation_config_eos(directories: Sequence[Path | None]) -> list[int]:
    """The eos ids of the first generation_config.json among `directories` (an int or a list there)."""
    for directory in directories:
        if directory is None or not (Path(directory) / GENERATION_CONFIG).is_file():
            continue
        path = Path(directory) / GENERATION_CONFIG
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise QlmError(f"cannot read {path} ({type(exc).__name__}: {exc})",
                           f"fix or remove {GENERATION_CONFIG}") from None
        eos = config.get("eos_token_id") if isinstance(config, dict) else None
        values = [eos] if isinstance(eos, int) else eos if isinstance(eos, list) else []
        if eos is not None and not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
            raise QlmError(f"{path}: eos_token_id {eos!r} is not a token id or a list of them",
                           f"fix eos_token_id in {GENERATION_CONFIG}")
        return values
    return []


@dataclass
class Stops:
    ids: set[int]  # tokens that end a turn (not part of the answer)
    texts: list[str]  # end-of-turn markers the tokenizer does not hold as one token: cut where they appear

    def reached(self, tokenizer) -> Callable[[list[int]], bool] | None:
        if not self.texts:
            return None
        longest = max(len(t) for t in self.texts)

        def stop(tokens: list[int]) -> bool:  # the tail is enough: a marker is at most `longest` tokens long
            tail = tokenizer.decode(tokens[-longest:], skip_special_tokens=False, clean_up_tokenization_spaces=False)
            return any(t in tail for t in self.texts)
        return stop


def stop_tokens(tokenizer, template: str | None, config_dirs: Sequence[Path | None]) -> Stops:
    """eos, the template's end-of-turn marker and generation_config.json's eos ids."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    ids.update(generation_config_eos(config_dirs))
    texts = []
    for marker in END_OF_TURN if template is not None else ():
        if marker not in template:
            continue
        encoded = tokenizer.encode(marker, add_special_tokens=False)
        if len(encoded) == 1:
            ids.add(encoded[0])
        else:  # the tokenizer spells it as ordinary text
            texts.append(marker)
    return Stops(ids, texts)


def answer_text(tokenizer, tokens: Sequence[int], stops: Stops) -> str:
    """The answer as text: special tokens left out, cut at the first end-of-turn marker spelled as text."""
    text = tokenizer.decode(list(tokens), skip_special_tokens=True, clean_up_tokenization_spaces=False)
    for marker in stops.texts:
        text = text.split(marker, 1)[0]
    return text


class TextStream:
    """The answer text of a growing token list, handed out piece by piece: held back while it may still become an
    end-of-turn marker or ends in half a character, so the pieces add up to answer_text's text."""

    def __init__(self, tokenizer, stops: Stops):
        self.tokenizer, self.stops = tokenizer, stops
        self.tokens: list[int] = []
        self.shown = ""

    def _safe(self, text: str) -> str:
        text = text.rstrip("\ufffd")
        for marker in self.stops.texts:
            for k in range(len(marker) - 1, 0, -1):
                if text.endswith(marker[:k]):
                    return text[:-k]
        return text

    def push(self, token: int) -> str:
        self.tokens.append(token)
        return self._advance(self._safe(answer_text(self.tokenizer, self.tokens, self.stops)))

    def finish(self, tokens: Sequence[int]) -> str:
        return self._advance(answer_text(self.tokenizer, tokens, self.stops))

    def _advance(self, text: str) -> str:
        if not text.startswith(self.shown):  # decoding changed what was shown (never for byte-level BPE)
            return ""
        piece, self.shown = text[len(self.shown):], text
        return piece


@dataclass
class Generator:
    """A checkpoint opened for `qlm generate`: its tokenizer, the prompt template, the stops, and (after load())
    qlm's model. Opening reads no weights, so that every prompt can be checked first."""

    opened: object  # qlm_core.checkpoint.sources.open.OpenedCheckpoint
    tokenizer: object
    template: str | None
    stops: Stops
    system: str | None = None
    model: GPTModel | None = None

    @classmethod
    def open(cls, checkpoint: str | Path, *, prompting: Prompting, tokenizer: str | Path | None = None,
             iteration: int | None = None) -> Generator:
        """`iteration` of a Megatron root or a qlm run (default: its latest)."""
        from qlm_core.checkpoint.formats.megatron_legacy import HF_SIDE_DIR
        from qlm_core.checkpoint.sources.open import open_checkpoint
        from qlm_core.data.tokenizer import load_tokenizer

        opened = open_checkpoint(checkpoint, iteration)
        tokenizer_dir = tokenizer if tokenizer is not None else opened.tokenizer_dir
        if tokenizer_dir is None:
            raise QlmError(f"no tokenizer found with {checkpoint}", "pass --tokenizer DIR (a Hugging Face tokenizer)")
        loaded = load_tokenizer(tokenizer_dir)
        template = prompt_template(loaded, prompting, str(tokenizer_dir))
        path = Path(checkpoint)
        stops = stop_tokens(loaded, template, [opened.tokenizer_dir, path, path / HF_SIDE_DIR])
        return cls(opened, loaded, template, stops, prompting.system)

    @property
    def context(self) -> int:
        """The model's context window in tokens."""
        return self.opened.spec.max_position_embeddings

    def load(self, dtype: torch.dtype = torch.float32, device: torch.device | None = None) -> Generator:
        """Read the weights into qlm's model (the one `qlm eval` builds)."""
        from qlm_core.eval.lm import build_model
        from qlm_core.parallel.state import default_device

        self.model = build_model(self.opened, dtype, device or default_device())
        return self

    def encode(self, prompts: Sequence[str]) -> list[list[int]]:
        """Token ids of each prompt; one-line errors for a prompt that is empty, too long or out of vocabulary."""
        vocab = self.opened.spec.vocab_size
        encoded = []
        for number, prompt in enumerate(prompts, 1):
            ids = encode_prompt(self.tokenizer, prompt, self.template, self.system)
            what = f"prompt {number}" if len(prompts) > 1 else "the prompt"
            if not ids:
                raise QlmError(f"{what} is empty", "give it some text")
            if len(ids) >= self.context:
                raise QlmError(f"{what} is {len(ids)} tokens, but the model's context window is {self.context}",
                               f"shorten it below {self.context} tokens")
            if max(ids) >= vocab:
                raise QlmError(f"the tokenizer gives token id {max(ids)}, outside the model's vocabulary of {vocab}",
                               "pass this model's tokenizer with --tokenizer DIR")
            encoded.append(ids)
        return encoded

    def run(self, encoded: Sequence[Sequence[int]], *, max_new_tokens: int, sampling: Sampling,
            on_token: Callable[[int, int], None] | None = None) -> list[Generation]:
        """Generate for one batch of encoded prompts; at most to the end of the context window."""
        assert self.model is not None, "load() the weights first"
        room = self.context - max(len(ids) for ids in encoded)
        pad = self.tokenizer.pad_token_id
        pad = pad if pad is not None else (self.tokenizer.eos_token_id or 0)
        ids, mask = left_pad(encoded, pad)
        device = next(self.model.parameters()).device
        return generate_rows(self.model, ids.to(device), mask.to(device), max_new_tokens=min(max_new_tokens, room),
                             eos_token_id=self.stops.ids, sampling=sampling, stop=self.stops.reached(self.tokenizer),
                             on_token=on_token)

    def text(self, generation: Generation) -> str:
        return answer_text(self.tokenizer, generation.tokens, self.stops)
