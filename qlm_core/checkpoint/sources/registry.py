"""Every checkpoint format qlm reads and writes, in the order their sniffs are tried (a new format: its module in
this package exporting one CheckpointFormat, and one entry here)."""

from __future__ import annotations

from pathlib import Path

from qlm_core.checkpoint.sources.deepspeed_format import DEEPSPEED_FORMAT
from qlm_core.checkpoint.sources.format_api import CheckpointFormat
from qlm_core.checkpoint.sources.hf_format import HF_FORMAT
from qlm_core.checkpoint.sources.megatron_format import MEGATRON_FORMAT

FORMATS: dict[str, CheckpointFormat] = {f.name: f for f in (MEGATRON_FORMAT, HF_FORMAT, DEEPSPEED_FORMAT)}


def format_of(path: Path) -> CheckpointFormat | None:
    """The first format whose sniff recognises the directory `path`, or None."""
    return next((f for f in FORMATS.values() if f.sniff(path)), None)
