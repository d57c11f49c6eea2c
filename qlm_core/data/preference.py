"""Preference pairs (DPO, SimPO, ORPO): a prompt with a chosen and a rejected response -> token ids.

Formats, told apart by the keys of the first record (every one needs `chosen` and `rejected`):
    trl        {"prompt": ..., "chosen": ..., "rejected": ...}: strings (the prompt is one user turn, each response one
               assistant turn), or messages: prompt = [{"role", "content"}, ...] (system and earlier turns
               included), chosen / rejected = [{"role": "assistant", "content": ...}, ...]
    alpaca     {"instruction", "input" (optional), "chosen", "rejected", "system" (optional),
                "history" (optional): [[user, assistant], ...] earlier turns}; the user turn is instruction, then
               "\\n\\n" and input when there is one (as data/sft.py)
    sharegpt   {"conversations": [{"from": "system"|"human"|"gpt", "value"} or {"role", "content"}, ...],
                "chosen": {"from": "gpt", "value": ...}, "rejected": {...}, "system": ... (optional)} (LLaMA-Factory)

Each record becomes prompt messages and two response message lists. The prompt is rendered with the chat template and
add_generation_prompt; each response is the text the template adds after that when the conversation is rendered
with the response (so it holds the end-of-turn token and whatever the template writes after it). Prompt and
responses are tokenised separately without special tokens (as TRL's DPO: the prompt ids are the same in both
sequences of a pair).

Truncation, in this order (TRL's DPO; documented in PreferenceDataConfig):
    1. the prompt is cut to max_prompt_length tokens: its last ones with truncation_mode keep_end (the default),
       its first ones with keep_start; and it is always cut to at most max_length - 1 tokens, so a prompt longer
       than the sequence keeps room for one response token;
    2. each response is cut at its end to max_length - len(prompt) tokens.
A record with anything cut counts as truncated; tokenize_preferences returns the count so the caller can report it.

pair_sequences lays a pair out as two sequences of seq_length tokens (qlm's label convention, as data/sft.py:
labels[t] is the token at t+1 when that token is part of the response, else -100). In a micro-batch of P pairs the
chosen sequences are rows 0..P-1 and the rejected ones rows P..2P-1 (TRL's concatenated order), so the per-sequence
log-probs split with .chunk(2).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import get_args

import numpy as np
import torch

from qlm_core.config import PreferenceFormat, PreferenceTruncation
from qlm_core.data.files import cache_errors, read_records
from qlm_core.data.sft import MESSAGE_ROLES, SHAREGPT_ROLES
from qlm_core.data.tokenizer import resolve_chat_template, tokenizer_and_pad
from qlm_core.errors import QlmError

FORMAT_COLUMNS = {"trl": ("prompt", "chosen", "rejected"), "alpaca": ("instruction", "chosen", "rejected"),
                  "sharegpt": ("conversations", "chosen", "rejected")}
FORMAT_HELP = ("use TRL's prompt/chosen/rejected, alpaca instruction/input/chosen/rejected or sharegpt "
               "conversations/chosen/rejected")


@dataclass
class PreferenceDataConfig:
    seq_length: int
    chat_template: str | None = None  # chatml | qwen | llama3 | Jinja text; None: the tokenizer's own
    max_length: int | None = None  # prompt + response, in tokens (TRL's name); None: seq_length
    max_prompt_length: int | None = None  # prompt tokens kept (TRL's name); None: up to max_length - 1
    truncation_mode: PreferenceTruncation = "keep_end"  # which end of a long prompt is kept (TRL's name)
    format: PreferenceFormat = "auto"  # auto: told by the first record
    num_proc: int = 1


def detect_format(record: dict) -> str:
    keys = [k for k, v in record.items() if v is not None]
    if "conversations" in keys:
        found = "sharegpt"
    elif "instruction" in keys:
        found = "alpaca"
    elif "prompt" in keys:
        found = "trl"
    else:
        raise QlmError(f"cannot tell the preference format from the first record (its keys: "
                       f"{', '.join(keys) or 'none'})", FORMAT_HELP)
    missing = [key for key in ("chosen", "rejected") if key not in keys]
    if missing:
        raise QlmError(f"the first record ({found} format) has no {' or '.join(map(repr, missing))} key",
                       "give every record a chosen and a rejected response")
    return found


def _text(value, what: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise QlmError(f"{what} holds {type(value).__name__} {str(value)[:40]!r}, not text", f"make {what} a string")
    return value


def _message(turn, what: str, allowed=MESSAGE_ROLES) -> dict:
    """{"role", "content"} from an OpenAI-style or sharegpt-style turn."""
    if not isinstance(turn, dict):
        raise QlmError(f"{what} is a {type(turn).__name__}, not an object ({str(turn)[:40]})",
                       "write each turn as {'role': ..., 'content': ...} or {'from': ..., 'value': ...}")
    if "from" in turn and turn.get("role") is None:
        role = SHAREGPT_ROLES.get(turn["from"])
        if role is None:
            raise QlmError(f"{what} has sharegpt role {turn['from']!r}, not one of {', '.join(SHAREGPT_ROLES)}",
                           "fix its `from` field")
        return {"role": role, "content": _text(turn.get("value"), f"{what}'s value")}
    role = turn.get("role")
    if role not in allowed:
        raise QlmError(f"{what} has role {role!r}, not one of {', '.join(allowed)}", "fix its `role` field")
    return {"role": role, "content": _text(turn.get("content"), f"{what}'s content")}


def _turns(value, what: str) -> list[dict]:
    if not isinstance(value, list):
        raise QlmError(f"{what} is a {type(value).__name__}, not a list of messages", f"make {what} a list of objects")
    return [_message(turn, f"a turn of {what}") for turn in value]


def _response(value, name: str) -> list[dict]:
    """A chosen / rejected response: a string, one message, or a list of messages (assistant turns)."""
    if value is None:
        raise QlmError(f"the {name} response is missing", f"give the record a non-empty {name} response")
    if isinstance(value, str):
        messages = [{"role": "assistant", "content": value}]
    elif isinstance(value, dict):
        messages = [_message(value, f"the {name} response")]
    else:
        messages = _turns(value, f"the {name} response")
    if not messages or not any(m["content"].strip() for m in messages):
        raise QlmError(f"the {name} response is empty", f"give the record a non-empty {name} response, or drop it")
    if messages[0]["role"] != "assistant":
        raise QlmError(f"the {name} response starts with a {messages[0]['role']} turn, not an assistant one",
                       f"put only the assistant's answer in {name}")
    return messages


def to_pair(record: dict, format: str) -> tuple[list[dict], list[dict], list[dict]]:
    """One record of `format` as (prompt messages, chosen response messages, rejected response messages)."""
    for key in ("chosen", "rejected"):
        if key not in record:
            raise QlmError(f"the record has no {key!r} key", f"give every record a {key} response")
    _check_format_key(record, format)
    system = _text(record.get("system"), "system")
    prompt = [{"role": "system", "content": system}] if system else []
    if format == "trl":
        value = record.get("prompt")
        if value is None or isinstance(value, str):
            if not _text(value, "prompt").strip():
                raise QlmError("the prompt is empty", "give the record a prompt")
            prompt.append({"role": "user", "content": value})
        else:
            prompt += _turns(value, "the prompt")
    elif format == "alpaca":
        for k, pair in enumerate(record.get("history") or []):
            if not (isinstance(pair, (list, tuple)) and len(pair) == 2):
                raise QlmError(f"history entry {k + 1} is not a [user, assistant] pair ({str(pair)[:40]})",
                               "write history as [[user, assistant], ...]")
            prompt += [{"role": "user", "content": _text(pair[0], f"history entry {k + 1}'s user turn")},
                       {"role": "assistant", "content": _text(pair[1], f"history entry {k + 1}'s assistant turn")}]
        instruction, extra = _text(record.get("instruction"), "instruction"), _text(record.get("input"), "input")
        prompt.append({"role": "user", "content": instruction + (f"\n\n{extra}" if extra else "")})
    else:  # sharegpt
        prompt += _turns(record.get("conversations") or [], "conversations")
    if not prompt or prompt[-1]["role"] == "assistant":
        raise QlmError("the prompt does not end with a user turn", "end the prompt with the turn the responses answer")
    for number, turn in enumerate(prompt, 1):
        if turn["role"] == "user" and not turn["content"].strip():
            raise QlmError(f"the prompt's turn {number} (user) is empty" if len(prompt) > 1 else "the prompt is empty",
                           "give every user turn some text, or drop the record")
    chosen, rejected = _response(record["chosen"], "chosen"), _response(record["rejected"], "rejected")
    if chosen == rejected:
        raise QlmError("the chosen and rejected responses are the same (the pair prefers nothing: its DPO loss has no "
                       "gradient and it counts as a wrong preference)", "drop the record or fix one response")
    return prompt, chosen, rejected


def _check_format_key(record: dict, format: str):
    """A record must carry its format's prompt key: a record of another format in the same file (told by the first
    record) would otherwise train with an empty prompt."""
    key = FORMAT_COLUMNS[format][0]
    if record.get(key) is not None:
        return
    other = next((name for name, columns in FORMAT_COLUMNS.items()
                  if name != format and record.get(columns[0]) is not None), None)
    if other is not None:
        raise QlmError(f"the record is in the {other} format (it has {FORMAT_COLUMNS[other][0]!r}, not {key!r}), but "
                       f"the file's first record is in the {format} format", "use one format in a file")
    raise QlmError(f"the record has no {key!r} ({format} format)", f"give every record its {key}")


def _normalise(batch, indices, format: str, path: str):
    rows = [dict(zip(batch, values, strict=True)) for values in zip(*batch.values(), strict=True)]
    out = {"prompt": [], "chosen": [], "rejected": []}
    for index, row in zip(indices, rows, strict=True):
        try:
            prompt, chosen, rejected = to_pair(row, format)
        except QlmError as exc:  # name the file and the record
            raise QlmError(f"{path} record {index + 1} ({format} format): {exc.problem}", exc.fix) from None
        out["prompt"].append(prompt)
        out["chosen"].append(chosen)
        out["rejected"].append(rejected)
    return out


def load_preferences(path: str | os.PathLike, cache_dir: str | None = None, num_proc: int = 1,
                     format: PreferenceFormat = "auto"):
    """A json / jsonl / parquet file of `format` as a `datasets.Dataset` with columns prompt, chosen, rejected
    (lists of {"role", "content"})."""
    if format not in get_args(PreferenceFormat):
        raise QlmError(f"unknown preference format {format!r}", f"use one of {', '.join(get_args(PreferenceFormat))}")
    builder = "parquet" if Path(path).suffix.lower() == ".parquet" else "json"
    return read_records(path, "preference data file", cache_dir, format, detect_format, FORMAT_COLUMNS, _normalise,
                        num_proc, "set the format to the file's format, or auto", builder=builder)


def render_pair(prompt: list[dict], chosen: list[dict], rejected: list[dict], tokenizer,
                template: str) -> tuple[list[int], list[int], list[int]]:
    """(prompt ids, chosen response ids, rejected response ids), untruncated (see the module doc)."""
    def render(messages, generation_prompt=False):
        return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                             add_generation_prompt=generation_prompt)

    def encode(text):
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    prompt_text = render(prompt, generation_prompt=True)
    responses = []
    for name, response in (("chosen", chosen), ("rejected", rejected)):
        full = render(prompt + response)
        if not full.startswith(prompt_text) or len(full) == len(prompt_text):
            raise QlmError(f"the chat template does not render the {name} response after the prompt's generation "
                           "prompt, so the response tokens cannot be found",
                           "use a named template (chatml, llama3) or one that renders conversations turn by turn")
        responses.append(encode(full[len(prompt_text):]))
    return encode(prompt_text), responses[0], responses[1]


def truncate_pair(prompt_ids: list[int], chosen_ids: list[int], rejected_ids: list[int], max_length: int,
                  max_prompt_length: int | None = None,
                  truncation_mode: PreferenceTruncation = "keep_end") -> tuple[list[int], list[int], list[int], bool]:
    """The module doc's truncation: (prompt, chosen, rejected, whether anything was cut)."""
    limit = max_length - 1 if max_prompt_length is None else min(max_prompt_length, max_length - 1)
    cut = len(prompt_ids) > limit
    if cut:
        prompt_ids = prompt_ids[len(prompt_ids) - limit:] if truncation_mode == "keep_end" else prompt_ids[:limit]
    room = max_length - len(prompt_ids)
    cut = cut or len(chosen_ids) > room or len(rejected_ids) > room
    return prompt_ids, chosen_ids[:room], rejected_ids[:room], cut


def _tokenize(batch, indices, tokenizer, template: str, config: PreferenceDataConfig, max_length: int):
    out = {"prompt_ids": [], "chosen_ids": [], "rejected_ids": [], "truncated": []}
    for index, prompt, chosen, rejected in zip(indices, batch["prompt"], batch["chosen"], batch["rejected"],
                                               strict=True):
        try:
            ids = render_pair(prompt, chosen, rejected, tokenizer, template)
        except QlmError as exc:
            raise QlmError(f"record {index + 1}: {exc.problem}", exc.fix) from None
        if not ids[1] or not ids[2]:
            which = "chosen" if not ids[1] else "rejected"
            raise QlmError(f"record {index + 1}: the {which} response has no tokens",
                           f"give the record a non-empty {which} response, or drop it")
        p, c, r, cut = truncate_pair(*ids, max_length, config.max_prompt_length, config.truncation_mode)
        for key, value in zip(("prompt_ids", "chosen_ids", "rejected_ids", "truncated"), (p, c, r, cut), strict=True):
            out[key].append(value)
    return out


def tokenize_preferences(dataset, tokenizer, config: PreferenceDataConfig):
    """A prompt/chosen/rejected dataset -> (dataset of prompt_ids, chosen_ids, rejected_ids, truncated; the number of
    truncated records)."""
    if config.truncation_mode not in get_args(PreferenceTruncation):
        raise QlmError(f"unknown truncation_mode {config.truncation_mode!r}", "use keep_end or keep_start")
    max_length = config.max_length or config.seq_length
    if max_length > config.seq_length:
        raise QlmError(f"max_length {max_length} is longer than seq_length {config.seq_length}",
                       "a prompt and its response must fit in one sequence: lower max_length")
    if max_length < 2:
        raise QlmError(f"max_length {max_length} leaves no room for a prompt and a response", "raise max_length")
    if config.max_prompt_length is not None and config.max_prompt_length < 1:
        raise QlmError(f"max_prompt_length {config.max_prompt_length} keeps no prompt token",
                       "set max_prompt_length to at least 1, or leave it unset")
    template = resolve_chat_template(tokenizer, config.chat_template)
    tokenized = dataset.map(_tokenize, batched=True, with_indices=True, remove_columns=dataset.column_names,
                            num_proc=config.num_proc if config.num_proc > 1 else None,
                            fn_kwargs={"tokenizer": tokenizer, "template": template, "config": config,
                                       "max_length": max_length}, desc="tokenize pairs")
    return tokenized, int(sum(tokenized["truncated"]))


def pair_sequences(pair: dict, seq_length: int, pad_token_id: int = 0) -> tuple[tuple[np.ndarray, np.ndarray],
                                                                                   tuple[np.ndarray, np.ndarray]]:
    """((chosen input_ids, labels), (rejected input_ids, labels)), int64 arrays of seq_length, from a pair's
    prompt_ids / chosen_ids / rejected_ids: prompt + response, then pad_token_id; labels[t] = input_ids[t + 1] where
    that token is a response token, else -100. Put the chosen sequences of a micro-batch first, then the rejected
    ones in the same order (module doc)."""
    prompt = np.asarray(pair["prompt_ids"], dtype=np.int64)
    out = []
    for key in ("chosen_ids", "rejected_ids"):
        response = np.asarray(pair[key], dtype=np.int64)
        n = prompt.size + response.size
        if n > seq_length:
            raise ValueError(f"a pair's {key[:-4]} sequence of {n} tokens does not fit in {seq_length}")
        input_ids = np.full(seq_length, pad_token_id, dtype=np.int64)
        labels = np.full(seq_length, -100, dtype=np.int64)
        input_ids[:prompt.size], input_ids[prompt.size:n] = prompt, response
        if response.size:
            labels[prompt.size - 1:n - 1] = response  # the prompt's last token predicts the response's first
        out.append((input_ids, labels))
    return out[0], out[1]


class PreferenceDataset:
    """Tokenised pairs; item i = pair_sequences of pair i. `truncated`: how many records were cut."""

    def __init__(self, tokenized, truncated: int, seq_length: int, pad_token_id: int):
        self.pairs, self.truncated = tokenized.with_format(None), truncated
        self.seq_length, self.pad_token_id = seq_length, pad_token_id

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, i: int):
        return pair_sequences(self.pairs[i], self.seq_length, self.pad_token_id)


def build_preference_dataset(path: str | os.PathLike, tokenizer, config: PreferenceDataConfig,
                             cache_dir: str | None = None) -> PreferenceDataset:
    """Load, normalise and tokenise (cached by `datasets`) the preference file at `path`; `tokenizer` is one or its
    directory."""
    tokenizer, pad_token_id = tokenizer_and_pad(tokenizer)
    with cache_errors(f"cannot prepare {path}"):
        rows = load_preferences(path, cache_dir, config.num_proc, config.format)
        tokenized, truncated = tokenize_preferences(rows, tokenizer, config)
    return PreferenceDataset(tokenized, truncated, config.seq_length, pad_token_id)


class PositionedPairs:
    """Item i of a pair dataset (a PreferenceDataset, a Subset or ConcatDataset of them) as (i, item): the
    precomputed reference log-probs are looked up by that position."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int):
        return i, self.dataset[i]


def pair_rows(k: int, pairs_per_micro: int) -> tuple[int, int]:
    """The rows (chosen, rejected) of the k-th pair of a batch laid out by collate_pairs."""
    micro, slot = divmod(k, pairs_per_micro)
    chosen = 2 * pairs_per_micro * micro + slot
    return chosen, chosen + pairs_per_micro


def chosen_row_mask(rows: int, pairs_per_micro: int) -> torch.Tensor:
    """[rows] bool: the chosen rows of a batch laid out by collate_pairs."""
    return (torch.arange(rows) % (2 * pairs_per_micro)) < pairs_per_micro


def collate_pairs(items: list, pairs_per_micro: int, reference: np.ndarray | None = None):
    """PositionedPairs items -> (input_ids, labels [2·pairs, seq] int64, reference log-probs [2·pairs] or None),
    each micro-batch of `pairs_per_micro` pairs laid out as its chosen rows, then its rejected rows (module doc);
    `reference`: [len(dataset), 2] (chosen, rejected) log-probs by position."""
    if len(items) % pairs_per_micro:
        raise ValueError(f"{len(items)} pairs do not make micro-batches of {pairs_per_micro}")
    rows, ref = [], []
    for start in range(0, len(items), pairs_per_micro):
        group = items[start:start + pairs_per_micro]
        for side in (0, 1):
            rows += [pair[side] for _, pair in group]
            if reference is not None:
                ref += [reference[position, side] for position, _ in group]
    input_ids = torch.as_tensor(np.stack([ids for ids, _ in rows]))
    labels = torch.as_tensor(np.stack([labels for _, labels in rows]))
    return input_ids, labels, None if reference is None else torch.as_tensor(np.asarray(ref, dtype=np.float64))
