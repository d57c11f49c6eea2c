"""What decoding needs around the model: prompts rendered with a chat template (or raw), the tokens that end a turn
(eos, the template's end-of-turn marker, generation_config.json) and the answer text, streamed or whole."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from qlm_core.errors import QlmError

# end-of-turn markers of the chat templates qlm names (and most checkpoints' own): a turn stops where one appears
END_OF_TURN = ("<|im_end|>", "<|eot_id|>")
GENERATION_CONFIG = "generation_config.json"


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
