"""Prompts for reinforcement learning (data.kind = "rl"): a json / jsonl / parquet file of records, each with a
`prompt` — a string, or a conversation as a list of {"role", "content"} turns — and whatever else its reward
functions read (`answer`, `solution`, a task name...), as TRL's GRPOTrainer takes them.

A prompt is rendered with the chat template (data.chat_template, else the tokenizer's own) as the user's turn and
the assistant's generation prompt; a tokenizer without a template takes a string prompt as it is. Every prompt must
leave room for rl.max_completion_length tokens in data.seq_length: one that does not is one line naming the file and
the record, before the first step. Each record keeps the rendered conversation (its turns, as JSON text, under
CONVERSATION; "" for a prompt taken as written) for a reward model, which renders it with its own template; reward
functions see the record without it (`user_fields`)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qlm_core.data.files import cache_errors, quiet, read_dataset
from qlm_core.data.tokenizer import load_tokenizer, resolve_chat_template
from qlm_core.errors import QlmError

ROLES = ("system", "user", "assistant")


@dataclass
class PromptSet:
    """Prompt token ids and the records they came from (each record's `prompt` as text, for the rewards)."""

    ids: list[list[int]]
    records: list[dict[str, Any]]

    def __len__(self) -> int:
        return len(self.ids)

    def subset(self, indices) -> PromptSet:
        return PromptSet([self.ids[i] for i in indices], [self.records[i] for i in indices])


def _turns(value: list, where: str) -> list[dict]:
    turns = []
    for turn in value:
        if not (isinstance(turn, dict) and turn.get("role") in ROLES and isinstance(turn.get("content"), str)):
            raise QlmError(f"{where}: a prompt turn is not {{\"role\": system|user|assistant, \"content\": text}}",
                           "write the prompt as a string or as a list of such turns")
        turns.append({"role": turn["role"], "content": turn["content"]})
    if not turns or turns[-1]["role"] != "user":
        raise QlmError(f"{where}: the prompt's conversation does not end with a user turn",
                       "end each prompt with the user's turn the model answers")
    return turns


CONVERSATION = "qlm_conversation"


def user_fields(record: dict[str, Any]) -> dict[str, Any]:
    """A prompt record as its file had it (the prompt as text): what a reward function is given."""
    return {key: value for key, value in record.items() if key != CONVERSATION}


def render_prompt(prompt: Any, tokenizer, template: str | None, where: str) -> tuple[list[int], str, list[dict]]:
    """(token ids, the prompt as text for the rewards, the turns rendered: [] for a prompt taken as written) of one
    record's prompt."""
    if isinstance(prompt, str):
        if template is None:
            return list(tokenizer.encode(prompt)), prompt, []
        turns = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, list):
        if template is None:
            raise QlmError(f"{where}: a conversation prompt needs a chat template, and the tokenizer has none",
                           "set data.chat_template (chatml, llama3) or write the prompts as strings")
        turns = _turns(prompt, where)
    else:
        raise QlmError(f"{where}: prompt is a {type(prompt).__name__}, not a string or a list of turns",
                       "write each record's prompt as a string or a list of {role, content} turns")
    text = tokenizer.apply_chat_template(turns, chat_template=template, tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(text, add_special_tokens=False)), turns[-1]["content"], turns


def prompts_template(tokenizer, chat_template: str | None) -> str | None:
    """The template RL prompts are rendered with: data.chat_template, else the tokenizer's own; None (the prompt
    as written) when there is neither."""
    own = getattr(tokenizer, "chat_template", None)
    return resolve_chat_template(tokenizer, chat_template) if chat_template or own else None


def _render(batch, indices, tokenizer, template: str | None, room: int, max_completion_length: int,
            seq_length: int, path: str):
    ids, texts, conversations = [], [], []
    for index, prompt in zip(indices, batch["prompt"], strict=True):
        where = f"{path} record {index}"
        prompt_ids, text, turns = render_prompt(prompt, tokenizer, template, where)
        if len(prompt_ids) > room:
            raise QlmError(f"{where}: its prompt of {len(prompt_ids)} tokens leaves no room for "
                           f"rl.max_completion_length {max_completion_length} in data.seq_length {seq_length}",
                           "raise data.seq_length, lower rl.max_completion_length or shorten the prompt")
        if not prompt_ids:
            raise QlmError(f"{where}: its prompt renders to no tokens", "give every record a non-empty prompt")
        ids.append(prompt_ids)
        texts.append(text)
        conversations.append(json.dumps(turns) if turns else "")
    return {PROMPT_IDS: ids, "prompt": texts, CONVERSATION: conversations}


PROMPT_IDS = "qlm_prompt_ids"


def load_prompts(path: str | os.PathLike, tokenizer_dir: Path, chat_template: str | None, *, seq_length: int,
                 max_completion_length: int, cache_dir: str | None = None) -> PromptSet:
    """Every record of `path` rendered and checked for room to answer (through `datasets`, cached: the ranks that
    read the file after the first find its rendering there)."""
    quiet()
    path = Path(path)
    builder = "parquet" if path.suffix.lower() == ".parquet" else "json"
    with cache_errors(f"cannot prepare {path}"):
        dataset = read_dataset(builder, path, "RL prompt file", cache_dir)
        if len(dataset) == 0:
            raise QlmError(f"RL prompt file {path} has no records", "check the file")
        if "prompt" not in dataset.column_names:
            raise QlmError(f"RL prompt file {path} has no prompt column",
                           "give each record a prompt (a string or a list of turns) beside the fields the rewards "
                           "read")
        tokenizer = load_tokenizer(tokenizer_dir)
        room = seq_length - max_completion_length + 1  # the last completion token is a label, never an input
        template = prompts_template(tokenizer, chat_template)
        rendered = dataset.map(_render, batched=True, with_indices=True, desc="render RL prompts",
                               fn_kwargs={"tokenizer": tokenizer, "template": template, "room": room,
                                          "max_completion_length": max_completion_length, "seq_length": seq_length,
                                          "path": str(path)})
    return PromptSet(rendered[PROMPT_IDS], rendered.remove_columns(PROMPT_IDS).to_list())
