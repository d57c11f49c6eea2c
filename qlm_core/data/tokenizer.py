"""Tokenizers: load a local Hugging Face tokenizer, name a chat template, train a tiny BPE for the CPU demo.

The named chat templates mark each assistant turn with `{% generation %}...{% endgeneration %}` around its content and
its end-of-turn token, so `apply_chat_template(..., return_assistant_tokens_mask=True, return_dict=True)` returns
exactly the tokens SFT trains on. They write the family's special tokens literally (`<|im_start|>`, `<|eot_id|>`):
the tokenizer should know them as special tokens, or they are encoded as ordinary text.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path

from qlm_core.errors import QlmError

CHATML = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- generation %}{{- message['content'] + '<|im_end|>' }}{%- endgeneration %}"
    "{{- '\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

LLAMA3 = (
    "{{- '<|begin_of_text|>' }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{%- generation %}{{- message['content'] | trim + '<|eot_id|>' }}{%- endgeneration %}"
    "{%- else %}"
    "{{- message['content'] | trim + '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

CHAT_TEMPLATES = {"chatml": CHATML, "qwen": CHATML, "llama3": LLAMA3}
LLAMA3_SPECIAL_TOKENS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
DEMO_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def load_tokenizer(path: str | os.PathLike):
    """A Hugging Face tokenizer from a local directory (nothing is downloaded)."""
    from transformers import AutoTokenizer

    path = Path(path)
    if path.is_file():
        raise QlmError(f"tokenizer directory {path} is a file, not a directory",
                       "point to the directory that holds tokenizer.json or tokenizer_config.json")
    if not path.is_dir():
        raise QlmError(f"tokenizer directory {path} does not exist",
                       "point to a directory holding tokenizer.json or tokenizer_config.json")
    known = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt", "tokenizer.model", "spiece.model")
    if not any((path / name).exists() for name in known) and not any(path.glob("*.model")):
        raise QlmError(f"tokenizer directory {path} holds no tokenizer files",
                       "point to a directory holding tokenizer.json or tokenizer_config.json with its vocabulary")
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:  # transformers raises OSError, ValueError, KeyError, ... for unreadable files
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise QlmError(f"cannot read a tokenizer from {path} ({reason})",
                       "point to a directory holding a Hugging Face tokenizer (tokenizer.json or "
                       "tokenizer_config.json with its vocabulary files)") from None


def tokenizer_and_pad(tokenizer) -> tuple[object, int]:
    """`tokenizer` (one, or its directory) and the id sequences are padded with: its pad token, else its eos."""
    if isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = load_tokenizer(tokenizer)
    pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad_token_id is None:
        raise QlmError("the tokenizer has neither a pad nor an eos token to pad sequences with",
                       "use a tokenizer with a pad or eos token")
    return tokenizer, pad_token_id


def chat_template(name_or_template: str) -> str:
    """A named template (chatml, qwen, llama3) or, when the text is already Jinja, that text."""
    if "{%" in name_or_template or "{{" in name_or_template:
        return name_or_template
    try:
        return CHAT_TEMPLATES[name_or_template.lower()]
    except KeyError:
        raise QlmError(f"unknown chat template {name_or_template!r}",
                       f"use one of {', '.join(CHAT_TEMPLATES)}, or a Jinja template string") from None


def resolve_chat_template(tokenizer, name_or_template: str | None) -> str:
    """The template to render with: the named one, else the tokenizer's own."""
    if name_or_template:
        return chat_template(name_or_template)
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates: the default one is the chat template
        template = template.get("default")
    if not template:
        raise QlmError("the tokenizer has no chat template",
                       f"name one with chat_template = one of {', '.join(CHAT_TEMPLATES)}")
    return template


def has_generation_markers(template: str) -> bool:
    return re.search(r"\{%-?\s*generation\s*-?%\}", template) is not None


QWEN2_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""  # noqa: E501
)


def build_demo_tokenizer(out_dir: str | os.PathLike, corpus: Iterable[str], vocab_size: int = 512) -> Path:
    """Train a byte-level BPE on `corpus` and save it as an HF fast tokenizer with the chatml template.

    Specials: <|endoftext|> (eos and pad), <|im_start|>, <|im_end|>. Any byte sequence stays encodable.
    The pipeline (NFC, Qwen2's split regex, byte level) is exactly the one transformers' Qwen2Tokenizer rebuilds
    around a vocabulary: a directory that also holds a qwen2 config.json (an exported model) then loads as
    Qwen2Tokenizer and must tokenise identically."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=DEMO_SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
        additional_special_tokens=DEMO_SPECIAL_TOKENS[1:],
    )
    fast.chat_template = CHATML
    out_dir = Path(out_dir)
    fast.save_pretrained(out_dir)
    return out_dir
