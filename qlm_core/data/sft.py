"""Supervised fine-tuning examples: chat records -> token ids with the loss on assistant tokens only.

Formats, told apart by the keys of the first record:
    messages  (OpenAI)   {"messages": [{"role": "system"|"user"|"assistant", "content": ...}, ...]}
    sharegpt             {"conversations": [{"from": "system"|"human"|"gpt", "value": ...}, ...]}
    alpaca               {"instruction": ..., "input": ... (optional), "output": ..., "system": ... (optional)}
Every record becomes a list of messages, is rendered with a chat template and tokenised. The trained tokens are the
assistant turns' content and end-of-turn token: from the template's `{% generation %}` marks when it has them, else
from where each assistant turn starts and ends when the conversation is rendered one turn at a time.

Items are numpy int64 arrays of length seq_length: input_ids (pad id after the samples), labels (labels[t] is the
token at t+1 when that token is trained, else -100; never across two samples), and when packing, position_ids
(restarting at 0 for each sample and for the padding) and segment_ids (0, 1, ... per sample; the padding gets the next
number). Without packing each item holds one sample and position_ids / segment_ids are None (causal attention
never lets a sample see the padding that follows it).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from qlm_core.config import SftFormat, Truncation, choices
from qlm_core.data.files import cache_errors, read_records
from qlm_core.data.tokenizer import has_generation_markers, resolve_chat_template, tokenizer_and_pad
from qlm_core.errors import QlmError

SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}
MESSAGE_ROLES = ("system", "user", "assistant", "tool")
FORMATS = {"alpaca": ("instruction", "output"), "sharegpt": ("conversations",), "messages": ("messages",)}  # columns
assert ("auto", *FORMATS) == choices(SftFormat), "FORMATS and config.SftFormat name the same formats"


@dataclass
class SFTConfig:
    seq_length: int
    chat_template: str | None = None  # chatml | qwen | llama3 | Jinja text; None: the tokenizer's own
    max_length: int | None = None  # longest sample in tokens; None: seq_length
    truncation: Truncation = "right"  # right: keep the first max_length tokens; drop: leave the sample out
    pack: bool = True
    shuffle: bool = True  # seeded shuffle of the samples before packing
    seed: int = 1234
    num_proc: int = 1
    format: SftFormat = "auto"  # auto: told by the first record


def detect_format(record: dict) -> str:
    keys = [k for k, v in record.items() if v is not None]
    if "messages" in keys:
        return "messages"
    if "conversations" in keys:
        return "sharegpt"
    if "instruction" in keys and "output" in keys:
        return "alpaca"
    raise QlmError(f"cannot tell the SFT format from the first record (its keys: {', '.join(keys) or 'none'})",
                   "use OpenAI messages (messages), sharegpt (conversations) or alpaca (instruction, input, output)")


def _text(value, what: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise QlmError(f"{what} holds {type(value).__name__} {str(value)[:40]!r}, not text",
                       f"make every {what} a string")
    return value


def to_messages(record: dict, format: str) -> list[dict]:
    """One record of `format` as [{"role", "content"}, ...]."""
    if format == "alpaca":
        system, instruction = _text(record.get("system"), "system"), _text(record["instruction"], "instruction")
        extra, output = _text(record.get("input"), "input"), _text(record["output"], "output")
        messages = [{"role": "system", "content": system}] if system else []
        prompt = instruction + (f"\n\n{extra}" if extra else "")
        return messages + [{"role": "user", "content": prompt}, {"role": "assistant", "content": output}]
    key, role_key, text_key = ("conversations", "from", "value") if format == "sharegpt" else \
        ("messages", "role", "content")
    turns = record[key] or []
    if not isinstance(turns, list):
        raise QlmError(f"{key!r} is a {type(turns).__name__}, not a list of turns", f"make {key!r} a list of objects")
    messages = []
    for turn in turns:
        if not isinstance(turn, dict):
            raise QlmError(f"a turn of {key!r} is a {type(turn).__name__}, not an object ({str(turn)[:40]})",
                           f"write each turn as {{{role_key!r}: ..., {text_key!r}: ...}}")
        if format == "sharegpt":
            role = SHAREGPT_ROLES.get(turn.get("from"))
            if role is None:
                raise QlmError(f"sharegpt role {turn.get('from')!r} is not one of {', '.join(SHAREGPT_ROLES)}",
                               "fix the record's `from` fields")
        else:
            role = turn.get("role")
            if role not in MESSAGE_ROLES:
                raise QlmError(f"message role {role!r} is not one of {', '.join(MESSAGE_ROLES)}",
                               "fix the record's `role` fields")
        messages.append({"role": role, "content": _text(turn.get(text_key), f"the {role} turn's {text_key}")})
    return messages


def _normalise(batch, indices, format: str, path: str):
    rows = [dict(zip(batch, values, strict=True)) for values in zip(*batch.values(), strict=True)]
    out = []
    for index, row in zip(indices, rows, strict=True):
        try:
            out.append(to_messages(row, format))
        except QlmError as exc:  # name the file and the record
            raise QlmError(f"{path} record {index + 1} ({format} format): {exc.problem}", exc.fix) from None
    return {"messages": out}


def load_conversations(path: str | os.PathLike, cache_dir: str | None = None, num_proc: int = 1,
                       format: SftFormat = "auto"):
    """A json/jsonl file of `format` (auto: told by its first record) as a `datasets.Dataset` with one column,
    "messages"."""
    assert format in choices(SftFormat), f"SFT format {format!r}"  # train/validate.py checked it

    return read_records(path, "SFT data file", cache_dir, format, detect_format, FORMATS, _normalise, num_proc,
                        "set data.format to the file's format, or auto")


def render_example(messages: list[dict], tokenizer, template: str) -> tuple[list[int], list[int]]:
    """(token ids, mask of trained tokens) of one conversation rendered with `template`."""
    if has_generation_markers(template):
        out = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
        return list(out["input_ids"]), list(out["assistant_masks"])
    return _render_by_prefixes(messages, tokenizer, template)


def _render_by_prefixes(messages, tokenizer, template):
    """Mark each assistant turn as the text it adds to the conversation rendered up to its generation prompt."""
    def render(upto, prompt=False):
        return tokenizer.apply_chat_template(messages[:upto], chat_template=template, tokenize=False,
                                             add_generation_prompt=prompt)

    text = render(len(messages))
    spans = []
    for k, message in enumerate(messages):
        if message["role"] != "assistant" or k == 0:  # an opening assistant turn has no prompt to condition on
            continue
        before, after = render(k, prompt=True), render(k + 1)
        if not (after.startswith(before) and text.startswith(after)):
            raise QlmError("the chat template does not render conversations turn by turn, so the assistant tokens "
                           "cannot be found",
                           "use a named template (chatml, llama3) or one with {% generation %} marks")
        spans.append((len(before), len(after.rstrip())))  # the newline after an end-of-turn token is not trained
    if not getattr(tokenizer, "is_fast", False):
        raise QlmError("finding assistant tokens needs a fast tokenizer (character offsets)",
                       "use a tokenizer with tokenizer.json, or a chat template with {% generation %} marks")
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [int(any(end > lo and start < hi for lo, hi in spans)) for start, end in encoding["offset_mapping"]]
    return list(encoding["input_ids"]), mask


def _tokenize(batch, tokenizer, template: str, max_length: int):
    conversations = batch["messages"]
    rendered = {i: ([], []) for i, messages in enumerate(conversations) if not messages}  # dropped later
    todo = [i for i in range(len(conversations)) if i not in rendered]
    if todo and has_generation_markers(template):  # one batched call: ~1.5x faster than one call each
        out = tokenizer.apply_chat_template([conversations[i] for i in todo], chat_template=template, tokenize=True,
                                            return_dict=True, return_assistant_tokens_mask=True)
        rendered.update(zip(todo, zip(out["input_ids"], out["assistant_masks"], strict=True), strict=True))
    else:
        rendered.update((i, _render_by_prefixes(conversations[i], tokenizer, template)) for i in todo)
    # right truncation; "drop" gets one token more than it keeps, to tell which samples to leave out
    ids = [list(rendered[i][0][:max_length]) for i in range(len(conversations))]
    masks = [list(rendered[i][1][:max_length]) for i in range(len(conversations))]
    return {"input_ids": ids, "target_mask": masks, "length": [len(tokens) for tokens in ids]}


def tokenize_conversations(dataset, tokenizer, config: SFTConfig):
    """A "messages" dataset -> input_ids, target_mask (1 = trained token) and length; cached by `datasets`."""
    assert config.truncation in choices(Truncation), config.truncation  # the recipe's schema checked it (config.py)
    max_length = config.max_length or config.seq_length
    if max_length > config.seq_length:
        raise QlmError(f"max_length {max_length} is longer than seq_length {config.seq_length}",
                       "a sample must fit in one sequence: lower max_length")
    template = resolve_chat_template(tokenizer, config.chat_template)
    num_proc = config.num_proc if config.num_proc > 1 else None
    limit = max_length if config.truncation == "right" else max_length + 1
    tokenized = dataset.map(_tokenize, batched=True, num_proc=num_proc, remove_columns=dataset.column_names,
                            fn_kwargs={"tokenizer": tokenizer, "template": template, "max_length": limit},
                            desc="tokenize conversations")
    return tokenized.filter(_keep, batched=True, num_proc=num_proc, fn_kwargs={"max_length": max_length},
                            desc="drop untrainable samples")


def _keep(batch, max_length: int):
    # a sample is kept when it fits and trains at least one token (the first token is never a label)
    return [len(ids) <= max_length and sum(mask[1:]) > 0
            for ids, mask in zip(batch["input_ids"], batch["target_mask"], strict=True)]


def first_fit(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Greedy first-fit: each item in turn goes into the lowest-numbered bin with room (O(n log n))."""
    size = 1
    while size < max(len(lengths), 1):
        size *= 2
    room = [capacity] * (2 * size)  # a max-tree over the bins' free room; leaves are bins
    bins: list[list[int]] = []
    for item, length in enumerate(lengths):
        if length > capacity:
            raise ValueError(f"item {item} of length {length} does not fit in {capacity}")
        node = 1
        while node < size:
            node = 2 * node if room[2 * node] >= length else 2 * node + 1
        slot = node - size
        if slot == len(bins):
            bins.append([])
        bins[slot].append(item)
        room[node] -= length
        node //= 2
        while node:
            room[node] = max(room[2 * node], room[2 * node + 1])
            node //= 2
    return bins


class SFTDataset:
    """Sequences of seq_length tokens, each one sample (padded) or several packed samples (see module doc)."""

    def __init__(self, tokenized, config: SFTConfig, pad_token_id: int):
        self.config, self.seq_length, self.pad_token_id = config, config.seq_length, pad_token_id
        self.samples = tokenized.with_format("numpy", columns=["input_ids", "target_mask"])
        order = np.arange(len(tokenized))
        if config.shuffle:
            order = np.random.default_rng(config.seed).permutation(len(tokenized))
        if config.pack:
            lengths = np.asarray(tokenized["length"])[order]
            self.sequences = [[int(order[i]) for i in members] for members in first_fit(lengths, self.seq_length)]
        else:
            self.sequences = [[int(i)] for i in order]

    def __len__(self) -> int:
        return len(self.sequences)

    def __getitem__(self, i: int) -> dict:
        S = self.seq_length
        input_ids = np.full(S, self.pad_token_id, dtype=np.int64)
        labels = np.full(S, -100, dtype=np.int64)
        position_ids = np.zeros(S, dtype=np.int64)
        segment_ids = np.zeros(S, dtype=np.int64)
        cursor = 0
        members = self.sequences[i]
        for segment, row in enumerate(members):
            sample = self.samples[row]
            ids, mask = sample["input_ids"].astype(np.int64), sample["target_mask"].astype(bool)
            end = cursor + ids.size
            input_ids[cursor:end] = ids
            labels[cursor:end - 1] = np.where(mask[1:], ids[1:], -100)
            position_ids[cursor:end] = np.arange(ids.size)
            segment_ids[cursor:end] = segment
            cursor = end
        position_ids[cursor:] = np.arange(S - cursor)
        segment_ids[cursor:] = len(members)
        if not self.config.pack:
            return dict(input_ids=input_ids, labels=labels, position_ids=None, segment_ids=None)
        return dict(input_ids=input_ids, labels=labels, position_ids=position_ids, segment_ids=segment_ids)


def build_sft_dataset(path: str | os.PathLike, tokenizer, config: SFTConfig,
                      cache_dir: str | None = None) -> SFTDataset:
    """Load, normalise, tokenise (cached) and pack the SFT file at `path`; `tokenizer` is one or its directory."""
    tokenizer, pad_token_id = tokenizer_and_pad(tokenizer)
    with cache_errors(f"cannot prepare {path}"):
        conversations = load_conversations(path, cache_dir, config.num_proc, config.format)
        tokenized = tokenize_conversations(conversations, tokenizer, config)
    if len(tokenized) == 0:
        raise QlmError(f"no sample of {path} fits in {config.max_length or config.seq_length} tokens with an "
                       "assistant token to train on", "raise max_length / seq_length, or use truncation = right")
    return SFTDataset(tokenized, config, pad_token_id)
