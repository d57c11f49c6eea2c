"""Small text and JSON metadata files of a checkpoint (config.json, latest_checkpointed_iteration.txt, DeepSpeed's
`latest`, index and metadata JSON), read with one-line errors naming the file: missing, unreadable, not UTF-8, or
not the JSON object expected."""

from __future__ import annotations

import json
from pathlib import Path

from qlm_core.errors import QlmError


def read_text_file(path: Path, fix: str) -> str:
    """The file's text (UTF-8); `fix` is the advice for a file that cannot be read or decoded."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise QlmError(f"{path} does not exist", fix) from None
    except OSError as exc:
        raise QlmError(f"cannot read {path} ({exc.strerror or exc})", fix) from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise QlmError(f"{path} is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start})",
                       fix) from None


def read_json_object(path: Path, fix: str) -> dict:
    """A JSON file that must hold one object (a dict)."""
    text = read_text_file(path, fix)
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise QlmError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})", fix) from None
    if not isinstance(value, dict):
        raise QlmError(f"{path} holds a JSON {type(value).__name__}, not an object", fix)
    return value
