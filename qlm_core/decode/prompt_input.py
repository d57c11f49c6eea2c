"""The prompts of `qlm generate`, read and checked before any weight is: --prompt values, stdin's lines (`-`), a
prompt file's lines; UTF-8 (a BOM and CRLF line ends accepted), no empty prompt."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from qlm_core.errors import QlmError

STDIN = "-"


def _lines(data: bytes, where: str) -> list[str]:
    """The non-blank lines of `data` (UTF-8), each one prompt."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise QlmError(f"{where} is not UTF-8 text (byte {exc.start})",
                       "give prompts as UTF-8 text, one a line") from None
    lines = [line.removesuffix("\r") for line in text.removeprefix("\ufeff").split("\n")]
    return [line for line in lines if line.strip()]


def _stdin_prompts(notice: Callable[[str], None]) -> list[str]:
    if sys.stdin is not None and sys.stdin.isatty():
        notice("reading prompts from stdin, one a line (end with Ctrl-D)")
    stream = getattr(sys.stdin, "buffer", None)
    data = stream.read() if stream is not None else (sys.stdin.read() if sys.stdin else "").encode("utf-8")
    prompts = _lines(data, "stdin")
    if not prompts:
        raise QlmError("--prompt - reads prompts from stdin, but stdin has none", "pipe prompts in, one a line")
    return prompts


def _file_prompts(path: Path) -> list[str]:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise QlmError(f"prompt file {path} does not exist", "check the path") from None
    except IsADirectoryError:
        raise QlmError(f"prompt file {path} is a directory", "point --prompt-file at a text file") from None
    except OSError as exc:
        raise QlmError(f"cannot read prompt file {path} ({exc.strerror})", "check the file") from None
    prompts = _lines(data, f"prompt file {path}")
    if not prompts:
        raise QlmError(f"prompt file {path} holds no prompt", "write one prompt a line")
    return prompts


def collect_prompts(prompts: list[str], prompt_file: Path | None,
                    notice: Callable[[str], None] = lambda text: print(text, file=sys.stderr)) -> list[str]:
    """--prompt values in order (`-`: stdin's lines at that place), then --prompt-file's lines; `notice` tells a
    terminal that stdin is read."""
    if prompts.count(STDIN) > 1:
        raise QlmError("--prompt - is given twice", "read stdin once")
    collected = []
    for prompt in prompts:
        collected += _stdin_prompts(notice) if prompt == STDIN else [prompt]
    if prompt_file is not None:
        collected += _file_prompts(prompt_file)
    if not collected:
        raise QlmError("no prompt given", "pass --prompt TEXT (repeatable), --prompt - for stdin, or --prompt-file")
    for number, prompt in enumerate(collected, 1):
        what = f"prompt {number}" if len(collected) > 1 else "the prompt"
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError:
            raise QlmError(f"{what} is not valid UTF-8", "pass prompts as UTF-8 text") from None
        if not prompt.strip():
            raise QlmError(f"{what} is empty", "give it some text")
    return collected
