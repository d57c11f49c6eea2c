"""Megatron's indexed dataset: PREFIX.bin holds every token id back to back, PREFIX.idx says where each sequence is.

PREFIX.idx, little-endian:
    b"MMIDIDX\\x00\\x00"            9-byte magic
    version           uint64     always 1
    dtype code        uint8      see DTYPE_CODES
    sequence count    uint64     S
    document count    uint64     D + 1 (the document indices below)
    sequence lengths  int32[S]   tokens per sequence
    sequence pointers int64[S]   byte offset of each sequence in PREFIX.bin
    document indices  int64[D+1] 0, then the index of the sequence just past each document

A document is one or more consecutive sequences (Megatron's preprocessor can split documents into sentences);
qlm's preprocessor writes one sequence per document. Files are read through numpy memory maps, so opening a dataset
reads nothing but its header.
"""

from __future__ import annotations

import os
import struct
from array import array
from pathlib import Path

import numpy as np

from qlm_core.errors import QlmError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPE_CODES = {
    1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16,
}
CODE_OF_DTYPE = {np.dtype(dtype): code for code, dtype in DTYPE_CODES.items()}
_HEADER_BYTES = len(MAGIC) + 8 + 1 + 8 + 8


def token_dtype(vocab_size: int | None) -> np.dtype:
    """The token dtype Megatron picks: uint16 below 65500 ids, else int32."""
    return np.dtype(np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32)


def index_paths(prefix: str | os.PathLike) -> tuple[Path, Path]:
    """(PREFIX.bin, PREFIX.idx)."""
    prefix = str(prefix)
    return Path(prefix + ".bin"), Path(prefix + ".idx")


def exists(prefix: str | os.PathLike) -> bool:
    return all(path.is_file() for path in index_paths(prefix))


class IndexedWriter:
    """Streams documents into PREFIX.bin; PREFIX.idx is written by close() (or leaving the `with` block).

    If the block raises, both files are removed so no half-written dataset is left behind."""

    def __init__(self, prefix: str | os.PathLike, dtype: np.dtype | type = np.int32):
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODE_OF_DTYPE:
            raise QlmError(f"token dtype {self.dtype} has no Megatron dtype code",
                           f"use one of {', '.join(str(np.dtype(d)) for d in DTYPE_CODES.values())}")
        self.bin_path, self.idx_path = index_paths(prefix)
        self.bin_path.parent.mkdir(parents=True, exist_ok=True)
        self._bin = open(self.bin_path, "wb")
        # growable C arrays: a few bytes per sequence, however many documents are streamed
        self._lengths = array("i")
        self._sequences_per_document = array("q")
        self._limits = np.iinfo(self.dtype) if self.dtype.kind in "iu" else None
        self.num_tokens = 0

    def add_document(self, tokens, sequence_lengths=None) -> None:
        """One document of token ids (a list or 1-D array): one sequence, or several of `sequence_lengths`."""
        tokens = np.asarray(tokens).reshape(-1)
        lengths = np.array([tokens.size]) if sequence_lengths is None else np.asarray(sequence_lengths)
        self._add(tokens, lengths, np.array([lengths.size]))

    def add_documents(self, tokens, lengths) -> None:
        """Many one-sequence documents at once: `tokens` is their ids concatenated, `lengths` the size of each."""
        lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
        self._add(tokens, lengths, np.ones(lengths.size, dtype=np.int64))

    def _add(self, tokens, lengths, sequences_per_document) -> None:
        tokens, lengths = np.asarray(tokens).reshape(-1), np.asarray(lengths, dtype=np.int64).reshape(-1)
        if int(lengths.sum()) != tokens.size:
            raise ValueError(f"lengths add up to {int(lengths.sum())} but {tokens.size} tokens were given")
        if tokens.size and self._limits is not None and (tokens.min() < self._limits.min or
                                                         tokens.max() > self._limits.max):
            raise QlmError(f"token ids {tokens.min()}..{tokens.max()} do not fit in {self.dtype}",
                           "write with a wider dtype (int32 when the vocabulary has 65500 ids or more)")
        self._bin.write(tokens.astype(self.dtype, copy=False).tobytes(order="C"))
        self._lengths.frombytes(lengths.astype(np.int32).tobytes())
        self._sequences_per_document.frombytes(np.asarray(sequences_per_document, dtype=np.int64).tobytes())
        self.num_tokens += tokens.size

    def close(self) -> None:
        if self._bin.closed:
            return
        self._bin.close()
        lengths = np.frombuffer(self._lengths, dtype=np.int32) if self._lengths else np.zeros(0, np.int32)
        pointers = np.zeros(lengths.size, np.int64)
        np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        document_indices = np.zeros(len(self._sequences_per_document) + 1, np.int64)
        if self._sequences_per_document:
            np.cumsum(np.frombuffer(self._sequences_per_document, dtype=np.int64), out=document_indices[1:])
        with open(self.idx_path, "wb") as idx:
            idx.write(MAGIC)
            idx.write(struct.pack("<QBQQ", VERSION, CODE_OF_DTYPE[self.dtype], lengths.size, document_indices.size))
            idx.write(lengths.tobytes(order="C"))
            idx.write(pointers.tobytes(order="C"))
            idx.write(document_indices.tobytes(order="C"))

    def abort(self) -> None:
        self._bin.close()
        for path in (self.bin_path, self.idx_path):
            path.unlink(missing_ok=True)

    @property
    def num_documents(self) -> int:
        return len(self._sequences_per_document)

    def __enter__(self) -> IndexedWriter:
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
        else:
            self.abort()


class IndexedDataset:
    """Read-only view of PREFIX.bin/.idx: item i is sequence i as a numpy array of the file's dtype."""

    def __init__(self, prefix: str | os.PathLike):
        self.prefix = str(prefix)
        self.bin_path, self.idx_path = index_paths(prefix)
        for path in (self.bin_path, self.idx_path):
            if not path.is_file():
                raise QlmError(f"indexed dataset file {path} does not exist",
                               "pass the prefix of a PREFIX.bin/PREFIX.idx pair (as `qlm data preprocess` writes)")
        with open(self.idx_path, "rb") as idx:
            header = idx.read(_HEADER_BYTES)
        if len(header) < _HEADER_BYTES or not header.startswith(MAGIC):
            raise QlmError(f"{self.idx_path} is not a Megatron indexed-dataset index (bad header)",
                           "regenerate it with `qlm data preprocess`")
        version, code, num_sequences, num_document_indices = struct.unpack("<QBQQ", header[len(MAGIC):])
        if version != VERSION or code not in DTYPE_CODES:
            raise QlmError(f"{self.idx_path} has version {version} and dtype code {code}; qlm reads version 1 with "
                           f"codes {sorted(DTYPE_CODES)}", "regenerate it with `qlm data preprocess`")
        self.dtype = np.dtype(DTYPE_CODES[code])
        index = np.memmap(self.idx_path, mode="r", dtype=np.uint8)
        offset = _HEADER_BYTES
        self.sequence_lengths = np.frombuffer(index, np.int32, num_sequences, offset)
        offset += self.sequence_lengths.nbytes
        self.sequence_pointers = np.frombuffer(index, np.int64, num_sequences, offset)
        offset += self.sequence_pointers.nbytes
        self.document_indices = np.frombuffer(index, np.int64, num_document_indices, offset)
        if self.document_indices.size == 0 or self.document_indices[-1] != num_sequences:
            raise QlmError(f"{self.idx_path} is inconsistent: its document indices do not end at the sequence count",
                           "regenerate it with `qlm data preprocess`")
        # np.memmap refuses empty files, and an empty .bin is valid (a dataset of empty documents)
        size = self.bin_path.stat().st_size
        self._tokens = (np.memmap(self.bin_path, mode="r", dtype=self.dtype) if size
                        else np.zeros(0, self.dtype))

    def __len__(self) -> int:
        return self.sequence_lengths.size

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens [offset, offset + length) of sequence i (to its end when length is None)."""
        size = int(self.sequence_lengths[i])
        length = size - offset if length is None else length
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"tokens [{offset}, {offset + length}) are outside sequence {i} of {size} tokens")
        start = int(self.sequence_pointers[i]) // self.dtype.itemsize + offset
        return self._tokens[start:start + length]

    @property
    def num_documents(self) -> int:
        return self.document_indices.size - 1

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))

    def document_sequences(self, document: int) -> range:
        """The sequence indices of one document."""
        return range(int(self.document_indices[document]), int(self.document_indices[document + 1]))
