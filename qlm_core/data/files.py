"""Reading users' data files through `datasets` with one-line errors, and quieting `datasets` while it works.

`read_dataset` checks what `datasets` would otherwise misreport or silently accept: a folder or an empty file, text
that is not UTF-8 (pyarrow's json reader replaces bad bytes without a word), a jsonl line that is not a JSON object;
the errors `datasets` / pyarrow do raise become a QlmError naming the file. `quiet()` turns off datasets' tqdm bars
(qlm draws its own) and, while a file is read, its log lines (the exception that follows says the same in one line).
"""

from __future__ import annotations

import contextlib
import errno
import glob
import json
import sys
from pathlib import Path

from qlm_core.disk import WRITE_FAULTS, os_reason, write_fault
from qlm_core.errors import QlmError

_CHUNK = 1 << 20
_JSON_KINDS = {list: "array", str: "string", int: "number", float: "number", bool: "boolean", type(None): "null"}


def quiet() -> None:
    """No datasets progress bars (qlm shows its own) and no warnings below errors from its logger."""
    import datasets

    datasets.disable_progress_bars()
    datasets.utils.logging.set_verbosity_error()


@contextlib.contextmanager
def _no_datasets_logs():
    """datasets logs a failed json parse at ERROR level and then raises: the raised error is reported instead."""
    from datasets.utils import logging as ds_logging

    level = ds_logging.get_verbosity()
    ds_logging.set_verbosity(ds_logging.CRITICAL)
    try:
        yield
    finally:
        ds_logging.set_verbosity(level)


# the write faults (qlm_core.disk) that are the datasets cache's, not the data file's
CACHE_ERRNOS = tuple(code for code, fault in WRITE_FAULTS.items()
                     if fault in ("no_space", "quota", "denied", "read_only", "in_the_way") and code != errno.EPERM)


def cache_error(what: str, exc: OSError) -> QlmError:
    where = f" ({exc.filename})" if isinstance(exc.filename, str) else ""
    if write_fault(exc) == "in_the_way":  # a file where the cache needs a folder, or back
        return QlmError(f"{what}: the datasets cache could not be written{where}: {os_reason(exc)}",
                        "remove the file in the way, or point data.cache_dir (HF_DATASETS_CACHE) at a folder")
    return QlmError(f"{what}: the datasets cache could not be written{where}: {os_reason(exc)}",
                    "free disk space, or point HF_DATASETS_CACHE at a writable folder with room")


@contextlib.contextmanager
def cache_errors(what: str):
    """datasets writes Arrow caches while it maps: a full or read-only cache folder becomes one line."""
    try:
        yield
    except OSError as exc:
        if exc.errno not in CACHE_ERRNOS:
            raise
        raise cache_error(what, exc) from None


def _os_error_in(exc: BaseException) -> OSError | None:
    for _ in range(8):
        if exc is None or isinstance(exc, OSError):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def check_readable_file(path: Path, what: str) -> None:
    """`what` PATH exists, is a file and is not empty."""
    if path.is_dir():
        raise QlmError(f"{what} {path} is a folder, not a file", "pass the file itself")
    if not path.is_file():
        raise QlmError(f"{what} {path} does not exist", "check the path")
    if path.stat().st_size == 0:
        raise QlmError(f"{what} {path} is empty", "pass a file with records in it")


def check_utf8(path: Path) -> None:
    """Raise a QlmError naming the first byte of `path` that is not UTF-8 (the file is read once, in chunks)."""
    offset = 0  # bytes of the file before `data`
    pending = b""  # a multi-byte character cut by the end of the last chunk
    try:
        with open(path, "rb") as fh:
            while True:
                chunk = fh.read(_CHUNK)
                data = pending + chunk
                try:
                    data.decode("utf-8")
                    offset, pending = offset + len(data), b""
                except UnicodeDecodeError as exc:
                    if chunk and exc.reason == "unexpected end of data" and exc.start >= len(data) - 3:
                        offset, pending = offset + exc.start, data[exc.start:]
                        continue
                    where = offset + exc.start
                    hint = ", it looks like UTF-16" if where == 0 and data[:2] in (b"\xff\xfe", b"\xfe\xff") else ""
                    raise QlmError(f"{path} is not UTF-8 (byte 0x{data[exc.start]:02x} at offset {where}{hint})",
                                   f"re-encode it as UTF-8 (e.g. iconv -f OLD -t UTF-8 {path.name})") from None
                if not chunk:
                    return
    except OSError as exc:
        raise QlmError(f"cannot read {path} ({os_reason(exc)})", "check the file and its permissions") from None


def _first_bad_json_line(path: Path) -> str | None:
    """For a jsonl file `datasets` could not parse: which line is wrong, and how (None if none is)."""
    with open(path, encoding="utf-8-sig") as fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                return f"line {number} is not valid JSON ({exc.msg.removesuffix(' at')}, column {exc.colno})"
            if not isinstance(record, dict):
                kind = _JSON_KINDS.get(type(record), type(record).__name__)
                return f"line {number} is a JSON {kind}, not an object ({line.strip()[:40]})"
    return None


def _reason(exc: BaseException) -> str:
    """The most specific message in an exception's chain (datasets wraps the parser's error)."""
    chain = []
    while exc is not None and len(chain) < 8:
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    for item in reversed(chain):  # the innermost error says what is wrong with the file
        text = str(item).strip()
        if text and "An error occurred while generating the dataset" not in text:
            return text.splitlines()[0]
    return type(chain[0]).__name__


def read_dataset(builder: str, path: Path, what: str, cache_dir: str | None = None, **options):
    """`datasets.load_dataset(builder, path)`'s train split; `what` names the file in errors ("input file")."""
    import datasets
    import pyarrow

    path = Path(path)
    check_readable_file(path, what)
    if builder in ("json", "text"):
        check_utf8(path)
    def load(**extra):
        with _no_datasets_logs():
            # data_files are glob patterns: a name with [brackets] or * must be escaped to mean itself
            return datasets.load_dataset(builder, data_files=[glob.escape(str(path))], split="train",
                                         cache_dir=cache_dir, **options, **extra)

    try:
        try:
            return load()
        except (datasets.exceptions.DatasetGenerationError, pyarrow.ArrowException, ValueError, OSError) as exc:
            inner = _os_error_in(exc)
            if inner is not None and (inner.errno in CACHE_ERRNOS or inner.filename not in (None, str(path))):
                raise
            # the file passed the checks above: a damaged Arrow cache of an earlier read fails the same way, so the
            # file is read again with the cache rebuilt before the file is blamed
            dataset = load(download_mode="force_redownload")
            print(f"warning: the datasets cache of {path} was damaged (" + " ".join(_reason(exc).split())[:100]
                  + "); it was rebuilt", file=sys.stderr, flush=True)
            return dataset
    except OSError as exc:
        if (exc.errno in CACHE_ERRNOS or exc.filename is not None) and exc.filename != str(path):
            raise cache_error(f"cannot read {path}", exc) from None  # the cache's fault, not the file's
        raise QlmError(f"cannot read {path} ({os_reason(exc)})", "check the file and its permissions") from None
    except (datasets.exceptions.DatasetGenerationError, pyarrow.ArrowException, ValueError) as exc:
        # malformed files: datasets wraps pyarrow's / json's errors in DatasetGenerationError (and a full cache)
        inner = _os_error_in(exc)
        if inner is not None and inner.errno in CACHE_ERRNOS:
            raise cache_error(f"cannot read {path}", inner) from None
        reason = _reason(exc)
        if builder == "json" and path.suffix.lower() == ".jsonl":
            reason = _first_bad_json_line(path) or reason
        raise QlmError(f"cannot read {path} as {builder} ({reason})",
                       f"check that {path.name} is valid {'JSON lines' if builder == 'json' else builder}") from None


def _kind(value) -> str:
    if isinstance(value, dict):
        return "an object"
    kind = _JSON_KINDS.get(type(value), type(value).__name__)
    return {"array": "a list", "string": "text", "number": "a number", "boolean": "a boolean"}.get(kind, kind)


def _raw_records(path: Path):
    """The records of a json / jsonl file as Python's json module reads them (a JSON array, or one object a line)."""
    text = Path(path).read_text(encoding="utf-8-sig")
    try:
        whole = json.loads(text)
    except json.JSONDecodeError:
        whole = None
    if isinstance(whole, list):
        yield from whole
        return
    if isinstance(whole, dict):
        yield whole
        return
    for line in text.splitlines():
        if line.strip():
            yield json.loads(line)


def check_column_types(dataset, path: Path) -> None:
    """One JSON type per column. `datasets` keeps a column whose records mix types (text in some, a message list in
    others) as JSON text and decodes every value on reading, and stores a string that happens to be valid JSON
    (`"a b"` with its quotes, `[1, 2]`, `12`) as that JSON, so it comes back as something else: such a file is
    refused, naming the first record whose type differs from the first record's, as the file has them (a null is a
    missing value, not a type)."""
    mixed = [name for name, feature in dataset.features.items() if type(feature).__name__ == "Json"]
    if not mixed:
        return
    first: dict[str, tuple[int, str]] = {}
    for index, record in enumerate(_raw_records(path)):
        if not isinstance(record, dict):
            continue
        for name in mixed:
            if record.get(name) is None:
                continue
            kind = _kind(record[name])
            seen = first.setdefault(name, (index, kind))
            if kind != seen[1]:
                raise QlmError(f"{path}: column {name!r} is {seen[1]} in record {seen[0] + 1} but {kind} in "
                               f"record {index + 1}", f"give {name} one type in every record (e.g. all text or all "
                               "message lists)")


def read_records(path: Path, what: str, cache_dir: str | None, format: str, detect, columns: dict[str, tuple],
                 normalise, num_proc: int, fix: str, builder: str = "json"):
    """A data file of records in `format` ("auto": `detect(first record)` tells it) mapped through `normalise`
    (batched, with indices; given format= and path=): the one reading path of the SFT and preference files.
    `columns`: each format's required columns; `fix` is the error line's fix for a missing one."""
    quiet()
    dataset = read_dataset(builder, Path(path), what, cache_dir)
    if len(dataset) == 0:
        raise QlmError(f"{what} {path} has no records", "check the file")
    check_column_types(dataset, path)
    if format == "auto":
        try:
            format = detect(dataset[0])
        except QlmError as exc:  # name the file: a run may read several
            raise QlmError(f"{path}: {exc.problem}", exc.fix) from None
    missing = [column for column in columns[format] if column not in dataset.column_names]
    if missing:
        raise QlmError(f"{path} has no {', '.join(missing)} column for the {format} format", fix)
    return dataset.map(normalise, batched=True, with_indices=True, fn_kwargs={"format": format, "path": str(path)},
                       remove_columns=dataset.column_names, num_proc=num_proc if num_proc > 1 else None,
                       desc=f"read {format}")
