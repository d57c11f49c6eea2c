"""Tokenise raw text into a Megatron indexed dataset (PREFIX.bin + PREFIX.idx).

Inputs, one document each:
    .json / .jsonl   a record (its `json_key` field)        .parquet   a row (its `json_key` column)
    .txt / .text     a paragraph: text between blank lines ("\\n\\n"), stripped of surrounding whitespace
Documents are written in input order, then in file order; empty documents (no tokens) are skipped. Tokens are the
tokenizer's encoding of the text without special tokens, plus the eos token when `append_eod` is set.
Loading and tokenising go through `datasets` (Arrow caches, `num_proc` workers), so the output does not depend on
`workers`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from qlm_core.data.files import cache_errors, quiet, read_dataset
from qlm_core.data.indexed import IndexedWriter, token_dtype
from qlm_core.data.tokenizer import load_tokenizer
from qlm_core.errors import QlmError

JSON_SUFFIXES = (".json", ".jsonl")
PARQUET_SUFFIXES = (".parquet",)
TEXT_SUFFIXES = (".txt", ".text")
WRITE_BATCH = 4096


@dataclass
class PreprocessStats:
    output_prefix: str
    documents: int
    tokens: int
    seconds: float

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("inf")


def load_input(path: str | os.PathLike, json_key: str = "text", cache_dir: str | None = None):
    """One input file as a `datasets.Dataset` with a single column "text"."""
    import datasets

    path = Path(path)
    suffix = path.suffix.lower()
    if suffix in JSON_SUFFIXES:
        builder, options = "json", {}
    elif suffix in PARQUET_SUFFIXES:
        builder, options = "parquet", {}
    elif suffix in TEXT_SUFFIXES:
        builder, options, json_key = "text", {"sample_by": "paragraph"}, "text"
    else:
        if not path.exists():
            raise QlmError(f"input file {path} does not exist", "check the path (inputs are files, not folders)")
        raise QlmError(f"input file {path} has an unknown type {suffix or '(no suffix)'}",
                       "use .json, .jsonl, .parquet or .txt")
    dataset = read_dataset(builder, path, "input file", cache_dir, **options)
    if json_key not in dataset.column_names:
        raise QlmError(f"{path} has no key {json_key!r} (its keys: {', '.join(dataset.column_names) or 'none'})",
                       "pass the key that holds the text with --json-key")
    dataset = dataset.select_columns([json_key])
    feature = dataset.features[json_key]
    if not isinstance(feature, datasets.Value) or feature.dtype not in ("string", "large_string"):
        raise QlmError(f"{path}: {json_key!r} holds {feature}, not text",
                       "pass the key that holds the text with --json-key")
    if json_key != "text":
        dataset = dataset.rename_column(json_key, "text")
    if feature.dtype != "string":  # parquet may store large_string; concatenating needs one type
        dataset = dataset.cast_column("text", datasets.Value("string"))
    if builder == "text":  # paragraphs keep the newlines around them
        dataset = dataset.map(_strip, batched=True, desc="strip paragraphs")
    return dataset


def _strip(batch):
    return {"text": [text.strip() for text in batch["text"]]}


def _tokenize(batch, tokenizer, eod_id: int | None):
    texts = [text if isinstance(text, str) else "" for text in batch["text"]]
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    if eod_id is not None:
        ids = [doc + [eod_id] if doc else doc for doc in ids]
    return {"input_ids": ids}


def tokenize_dataset(dataset, tokenizer, append_eod: bool = False, workers: int = 1):
    """Map a "text" dataset to an "input_ids" dataset (cached by `datasets`, `workers` processes)."""
    eod_id = None
    if append_eod:
        eod_id = tokenizer.eos_token_id
        if eod_id is None:
            raise QlmError("append_eod needs an end-of-document token but the tokenizer has no eos token",
                           "use a tokenizer with an eos token, or turn append_eod off")
    return dataset.map(
        _tokenize, batched=True, num_proc=workers if workers > 1 else None, remove_columns=["text"],
        fn_kwargs={"tokenizer": tokenizer, "eod_id": eod_id}, desc="tokenize",
    )


def preprocess(
    inputs: list[str | os.PathLike],
    tokenizer_dir: str | os.PathLike,
    output_prefix: str | os.PathLike,
    json_key: str = "text",
    append_eod: bool = False,
    workers: int = 1,
    progress: Callable[[int, int], None] | None = None,
    cache_dir: str | None = None,
) -> PreprocessStats:
    """Tokenise `inputs` with the tokenizer in `tokenizer_dir` into OUTPUT_PREFIX.bin/.idx.

    `progress(documents_written, documents_total)` is called after each written batch; `cache_dir` is where
    `datasets` keeps its Arrow caches (None: its default, ~/.cache/huggingface/datasets)."""
    import datasets

    start = time.perf_counter()
    if not inputs:
        raise QlmError("no input files were given", "pass one or more .jsonl, .json, .parquet or .txt files")
    if workers < 1:
        raise QlmError(f"workers must be at least 1, got {workers}", "pass workers >= 1")
    quiet()
    tokenizer = load_tokenizer(tokenizer_dir)
    documents = 0
    # the writer opens first (a bad output path fails before any tokenising) and replaces an existing pair only
    # when the new one is complete; any error below leaves the old pair as it was
    with IndexedWriter(output_prefix, token_dtype(len(tokenizer))) as writer:
        loaded = [load_input(path, json_key, cache_dir) for path in inputs]
        dataset = loaded[0] if len(loaded) == 1 else datasets.concatenate_datasets(loaded)
        with cache_errors("cannot tokenize the inputs"):
            tokens = tokenize_dataset(dataset, tokenizer, append_eod, workers)
        total = len(tokens)
        rows = tokens.with_format("arrow")
        for start_row in range(0, total, WRITE_BATCH):
            column = rows[start_row:start_row + WRITE_BATCH].column("input_ids").combine_chunks()
            lengths = np.diff(column.offsets.to_numpy())
            # all-empty batches come back as list<null>: no values, and a dtype numpy cannot use
            flat = np.asarray(column.flatten().to_numpy(zero_copy_only=False), dtype=np.int64)
            nonempty = lengths > 0
            writer.add_documents(flat, lengths[nonempty])
            documents += int(nonempty.sum())
            if progress is not None:
                progress(min(start_row + WRITE_BATCH, total), total)
        if documents == 0:
            raise QlmError(f"the inputs hold no documents with text ({', '.join(map(str, inputs))})",
                           f"check the files and that {json_key!r} holds the text")
    return PreprocessStats(str(output_prefix), documents, writer.num_tokens, time.perf_counter() - start)
