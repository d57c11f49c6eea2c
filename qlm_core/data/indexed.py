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

import contextlib
import errno
import os
import shutil
import struct
from array import array
from pathlib import Path

import numpy as np

from qlm_core.disk import TEMPORARY_MARK, os_reason, pid_alive, write_fault
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


TMP_MARK = TEMPORARY_MARK  # PREFIX.bin.tmp-PID / PREFIX.idx.tmp-PID: written just before they replace the pair


def _temporaries(final: Path) -> list[tuple[str, int]]:
    """(name, PID) of every FINAL.tmp-PID beside FINAL (none when its folder cannot be listed)."""
    try:
        names = os.listdir(final.parent)
    except OSError:
        return []
    head = final.name + TMP_MARK
    return [(name, int(name[len(head):])) for name in names
            if name.startswith(head) and name[len(head):].isdigit()]


def _finish_killed_rename(prefix: str | os.PathLike):
    """A run killed between its two renames left its new .bin in place and its complete .idx as PREFIX.idx.tmp-PID
    (no .bin.tmp-PID beside it any more): the pair is that run's, so finish the rename."""
    bin_path, idx_path = index_paths(prefix)
    bin_pids = {pid for _, pid in _temporaries(bin_path)}
    for name, pid in _temporaries(idx_path):
        if pid != os.getpid() and not pid_alive(pid) and pid not in bin_pids and bin_path.exists():
            with contextlib.suppress(FileNotFoundError):
                os.replace(idx_path.parent / name, idx_path)


def remove_stale_temporaries(prefix: str | os.PathLike) -> list[Path]:
    """Remove PREFIX.bin.tmp-PID / PREFIX.idx.tmp-PID left by runs that were killed (their PID is gone), after
    finishing the rename of a run killed between its .bin's and its .idx's."""
    _finish_killed_rename(prefix)
    removed = []
    for final in index_paths(prefix):
        for name, pid in _temporaries(final):
            if pid != os.getpid() and pid_alive(pid):
                continue  # a run that is still writing this prefix
            with contextlib.suppress(FileNotFoundError):
                (final.parent / name).unlink()
                removed.append(final.parent / name)
    return removed


def output_error(prefix: str | os.PathLike, exc: OSError) -> QlmError:
    """A failed write of PREFIX.bin/.idx as one line: what failed and what to do."""
    where = f"{exc.filename}: " if isinstance(exc.filename, str) else ""
    reason = os_reason(exc)
    fault = write_fault(exc)
    if fault in ("no_space", "quota"):
        fix = "free disk space, or write to another output prefix"
    elif fault in ("denied", "read_only"):
        fix = "write to a folder you can write to, or fix its permissions"
    elif fault == "in_the_way":
        fix = "part of the output path is a file: choose another output prefix"
    else:
        fix = "check the output path, or write to another output prefix"
    return QlmError(f"cannot write the indexed dataset {prefix}.bin/.idx: {where}{reason}", fix)


class _Staged:
    """One output file written in its final folder but with no name until `stage` (O_TMPFILE where the system has
    it, so a killed run leaves nothing), then named PATH.tmp-PID, ready to be renamed over PATH."""

    def __init__(self, final: Path):
        self.final = final
        self.temporary = Path(f"{final}{TMP_MARK}{os.getpid()}")
        self.named = False
        flags = os.O_RDWR | getattr(os, "O_CLOEXEC", 0)
        fd = None
        if hasattr(os, "O_TMPFILE"):
            try:
                fd = os.open(final.parent, os.O_TMPFILE | flags, 0o666)
            except OSError as exc:
                if exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                    raise
        if fd is None:  # no unnamed files here: a named temporary from the start
            fd = os.open(self.temporary, os.O_CREAT | os.O_TRUNC | flags, 0o666)
            self.named = True
        self.file = os.fdopen(fd, "w+b")

    def write(self, data) -> None:
        self.file.write(data)

    def stage(self) -> None:
        """Flush, sync and give the file its temporary name."""
        self.file.flush()
        os.fsync(self.file.fileno())
        if not self.named:
            self._link()
            self.named = True
        self.file.close()

    def _link(self) -> None:
        self.temporary.unlink(missing_ok=True)
        fd = self.file.fileno()
        try:
            _linkat_empty_path(fd, self.temporary)
            return
        except OSError:
            pass
        try:
            os.link(f"/proc/self/fd/{fd}", self.temporary)
            return
        except OSError:
            pass
        # no way to name an unnamed file here: copy it to the temporary name (removed by discard if this fails)
        self.named = True
        self.file.seek(0)
        with open(self.temporary, "wb") as out:
            shutil.copyfileobj(self.file, out, 1 << 20)
            out.flush()
            os.fsync(out.fileno())

    def discard(self) -> None:
        with contextlib.suppress(OSError):
            self.file.close()
        if self.named:
            self.temporary.unlink(missing_ok=True)


def _linkat_empty_path(fd: int, path: Path) -> None:
    """linkat(fd, "", AT_FDCWD, path, AT_EMPTY_PATH): name an O_TMPFILE file (Linux)."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        linkat = libc.linkat
    except (OSError, AttributeError) as exc:
        raise OSError(errno.ENOSYS, "no linkat") from exc
    if linkat(fd, b"", -100, os.fsencode(path), 0x1000) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


def _sync_folder(folder: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class IndexedWriter:
    """Streams documents into PREFIX.bin; PREFIX.idx is written by close() (or leaving the `with` block).

    Both files are written under temporary names in PREFIX's folder and replace an existing PREFIX.bin/.idx only
    when both are complete (bin first, then idx, a rename each): an existing pair is never removed first. If the
    block raises, only this writer's files (and folders it created) are removed. Temporaries of a killed run into
    the same prefix are removed when the next writer opens. Write errors (disk full, permissions, a file where a
    folder should be) are QlmErrors naming the path."""

    def __init__(self, prefix: str | os.PathLike, dtype: np.dtype | type = np.int32):
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODE_OF_DTYPE:
            raise QlmError(f"token dtype {self.dtype} has no Megatron dtype code",
                           f"use one of {', '.join(str(np.dtype(d)) for d in DTYPE_CODES.values())}")
        self.prefix = str(prefix)
        self.bin_path, self.idx_path = index_paths(prefix)
        for path in (self.bin_path, self.idx_path):
            if path.is_dir():
                raise QlmError(f"cannot write the indexed dataset {self.prefix}.bin/.idx: {path} is a folder",
                               "choose another output prefix")
        self._created: list[Path] = []  # folders this writer made, removed again if it fails
        self._staged: list[_Staged] = []
        self._done = False
        try:
            self._make_folders(self.bin_path.parent)
            remove_stale_temporaries(prefix)
            self._bin = _Staged(self.bin_path)
            self._staged.append(self._bin)
        except OSError as exc:
            self.abort()
            raise output_error(self.prefix, exc) from None
        # growable C arrays: a few bytes per sequence, however many documents are streamed
        self._lengths = array("i")
        self._sequences_per_document = array("q")
        self._limits = np.iinfo(self.dtype) if self.dtype.kind in "iu" else None
        self.num_tokens = 0

    def _make_folders(self, folder: Path) -> None:
        missing = []
        while not folder.exists():
            missing.append(folder)
            if folder.parent == folder:
                break
            folder = folder.parent
        if folder.exists() and not folder.is_dir():
            raise QlmError(f"cannot write the indexed dataset {self.prefix}.bin/.idx: {folder} is a file, "
                           "not a folder", "choose another output prefix")
        for path in reversed(missing):
            path.mkdir()
            self._created.append(path)

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
        try:
            self._write(self._bin, tokens.astype(self.dtype, copy=False).tobytes(order="C"))
        except OSError as exc:
            self.abort()
            raise output_error(self.prefix, exc) from None
        self._lengths.frombytes(lengths.astype(np.int32).tobytes())
        self._sequences_per_document.frombytes(np.asarray(sequences_per_document, dtype=np.int64).tobytes())
        self.num_tokens += tokens.size

    @staticmethod
    def _write(staged: _Staged, data: bytes) -> None:
        staged.write(data)

    def close(self) -> None:
        if self._done:
            return
        lengths = np.frombuffer(self._lengths, dtype=np.int32) if self._lengths else np.zeros(0, np.int32)
        pointers = np.zeros(lengths.size, np.int64)
        np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        document_indices = np.zeros(len(self._sequences_per_document) + 1, np.int64)
        if self._sequences_per_document:
            np.cumsum(np.frombuffer(self._sequences_per_document, dtype=np.int64), out=document_indices[1:])
        try:
            idx = _Staged(self.idx_path)
            self._staged.append(idx)
            self._write(idx, MAGIC)
            self._write(idx, struct.pack("<QBQQ", VERSION, CODE_OF_DTYPE[self.dtype], lengths.size,
                                         document_indices.size))
            self._write(idx, lengths.tobytes(order="C"))
            self._write(idx, pointers.tobytes(order="C"))
            self._write(idx, document_indices.tobytes(order="C"))
            for staged in self._staged:
                staged.stage()
            # both complete: replace the pair (the window between the two renames is microseconds, and a reader
            # refuses a .bin/.idx that do not belong together)
            os.replace(self._bin.temporary, self.bin_path)
            os.replace(idx.temporary, self.idx_path)
        except OSError as exc:
            self.abort()
            raise output_error(self.prefix, exc) from None
        self._done = True
        _sync_folder(self.bin_path.parent)

    def abort(self) -> None:
        """Forget this writer's output: its temporaries and the folders it created; an older pair stays."""
        if self._done:
            return
        self._done = True
        for staged in self._staged:
            staged.discard()
        for folder in reversed(self._created):
            with contextlib.suppress(OSError):
                folder.rmdir()

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
        described = _HEADER_BYTES + num_sequences * 12 + num_document_indices * 8
        idx_size = self.idx_path.stat().st_size
        if idx_size not in (described, described + num_sequences):  # megatron-core may add int8 sequence modes
            raise QlmError(f"{self.idx_path} is {idx_size:,} bytes but its header describes {described:,} "
                           "(a truncated or damaged index)", "regenerate it with `qlm data preprocess`")
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
        self._check_consistent(num_sequences)
        # the .idx must describe exactly the .bin beside it: a pair of two runs would read wrong documents
        size = self.bin_path.stat().st_size
        expected = 0
        if num_sequences:
            expected = int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * self.dtype.itemsize
        if expected != size or (num_sequences and self.sequence_pointers[0] != 0):
            raise QlmError(f"{self.bin_path} ({size:,} bytes) and {self.idx_path} (which indexes {expected:,} bytes) "
                           "do not belong together",
                           "regenerate both with `qlm data preprocess` (an interrupted copy or run can leave such a "
                           "pair)")
        # np.memmap refuses empty files, and an empty .bin is valid (a dataset of empty documents)
        self._tokens = (np.memmap(self.bin_path, mode="r", dtype=self.dtype) if size
                        else np.zeros(0, self.dtype))

    def _check_consistent(self, num_sequences: int):
        """Lengths of 0 or more, each sequence starting where the one before ends, document indices from 0 that
        never go back: a damaged index otherwise surfaces as a traceback in sampling or in the model's forward
        (vectorised: a pass over the index, not the tokens)."""
        lengths, pointers, documents = self.sequence_lengths, self.sequence_pointers, self.document_indices
        problem = None
        if num_sequences and lengths.min() < 0:
            problem = f"sequence {int(np.argmax(lengths < 0))} has a negative length"
        elif num_sequences > 1:
            ends = pointers[:-1] + lengths[:-1].astype(np.int64) * self.dtype.itemsize
            wrong = np.flatnonzero(pointers[1:] != ends)
            if wrong.size:
                problem = f"sequence {int(wrong[0]) + 1} does not start where sequence {int(wrong[0])} ends"
        if problem is None and (documents[0] != 0 or (documents.size > 1 and np.any(np.diff(documents) < 0))):
            problem = "its document indices do not start at 0 and rise"
        if problem is not None:
            raise QlmError(f"{self.idx_path} is inconsistent: {problem}", "regenerate it with `qlm data preprocess`")

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
