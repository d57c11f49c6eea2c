"""What the conversion benches share: the raw-copy floor a converter is measured against."""

from __future__ import annotations

from pathlib import Path

CHUNK = 64 << 20


def raw_copy(files: list[Path], dst: Path, write_bytes: int) -> int:
    """Read every byte of `files` and write `write_bytes` bytes to dst/raw.bin: the floor any converter pays to
    produce an output of that size from that input."""
    dst.mkdir(parents=True, exist_ok=True)
    buffer = bytearray(CHUNK)
    view = memoryview(buffer)
    written = 0
    with open(dst / "raw.bin", "wb", buffering=0) as fout:
        for file in files:
            with open(file, "rb", buffering=0) as fin:
                while n := fin.readinto(buffer):
                    n = min(n, write_bytes - written)
                    fout.write(view[:n])
                    written += n
        while written < write_bytes:
            n = min(CHUNK, write_bytes - written)
            fout.write(view[:n])
            written += n
    return written
