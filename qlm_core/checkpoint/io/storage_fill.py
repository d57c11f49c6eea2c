"""torch.save files whose tensor bytes are written afterwards, straight to their place in the file.

`torch.serialization.skip_data` saves a file's zip structure and pickle with every storage's bytes left as a hole
(a sparse file: the holes read as zeros); the zip records give each storage's file offset (storage_offsets). The
bytes then go in with pwrite or copy_file_range, in whatever order suits the source, and the finished file is byte
for byte what torch.save writes (tests/checkpoint/test_legacy_stream.py).
"""

from __future__ import annotations

import errno
import os
import struct
import zipfile
from pathlib import Path

import torch

# copy_file_range refused (another file system on old kernels, a file system or kernel without it): read and write
_NO_COPY_FILE_RANGE = {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EBADF}
_COPY_BLOCK = 64 << 20
_LOCAL_HEADER = 30  # a zip local file header's fixed part, before its name and extra field


def tensors_in(obj):
    """Every tensor in nested dicts, lists and tuples, in a fixed order."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from tensors_in(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from tensors_in(value)


def storage_offsets(path: Path, saved) -> dict[int, int] | None:
    """File offset of the bytes of every storage of `saved` (by the storage's data_ptr) in `path`, which holds
    torch.save(saved) (as written under skip_data); None when some storage was not found (a tensor held by an object
    other than a dict, list or tuple), so that the caller writes the file whole instead.

    torch.save names the storages `<archive>/data/<n>` in the order its pickler first meets them, which for
    nested dicts, lists and tuples is tensors_in's order; each record's bytes start after its zip local header.
    Reading the headers (not unpickling the file again) keeps this cheap for tens of thousands of tensors."""
    # (record name, data_ptr) by the storage's C object, as torch.save's persistent_id keys storages
    keys: dict[int, tuple[str, int]] = {}
    for tensor in tensors_in(saved):
        storage = tensor.untyped_storage()
        keys.setdefault(storage._cdata, (str(len(keys)), storage.data_ptr()))
    with zipfile.ZipFile(path) as archive:
        records = {info.filename.rsplit("/", 1)[1]: info for info in archive.infolist()
                   if info.filename.split("/")[-2:-1] == ["data"]}
    if sorted(records) != sorted(key for key, _ in keys.values()):
        return None
    offsets: dict[int, int] = {}
    with open(path, "rb") as fh:
        for key, ptr in keys.values():
            info = records[key]
            if not info.file_size:
                continue
            fh.seek(info.header_offset)
            header = fh.read(_LOCAL_HEADER)
            if header[:4] != b"PK\x03\x04":
                return None
            name_length, extra_length = struct.unpack("<HH", header[26:30])
            offsets[ptr] = info.header_offset + _LOCAL_HEADER + name_length + extra_length
    return offsets


def byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy()).cast("B")


def pwrite_all(fd: int, data: memoryview, offset: int):
    while len(data):
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def write_view(fd: int, offset: int, values: torch.Tensor, strides: tuple[int, ...]):
    """Write `values` into the elements of a tensor view with `strides` (in elements) whose first element is at
    file `offset`: one write when the view is contiguous, else one per row (a column block of a matrix)."""
    values = values.contiguous()
    if values.dim() == 0 or tuple(strides) == values.stride() or (values.dim() == 1 and strides[0] == 1):
        pwrite_all(fd, byte_view(values), offset)
        return
    if values.dim() != 2 or strides[1] != 1:
        raise AssertionError(f"cannot place a {list(values.shape)} block with strides {strides}")
    row_stride = strides[0] * values.element_size()
    for i, row in enumerate(values):
        pwrite_all(fd, byte_view(row), offset + i * row_stride)


class RangeCopier:
    """Byte ranges from one file into another: copy_file_range (the kernel copies page cache to page cache, no
    user-space copy), or where the file systems refuse it, read into one reused buffer and write."""

    def __init__(self):
        self.in_kernel = hasattr(os, "copy_file_range")
        self._buffer: bytearray | None = None

    def copy(self, src: int, src_offset: int, dst: int, dst_offset: int, nbytes: int):
        while nbytes > 0 and self.in_kernel:
            try:
                n = os.copy_file_range(src, dst, nbytes, src_offset, dst_offset)
            except OSError as exc:
                if exc.errno not in _NO_COPY_FILE_RANGE:
                    raise
                self.in_kernel = False
                break
            if n == 0:
                raise OSError(errno.EIO, "the source file ended early")
            src_offset, dst_offset, nbytes = src_offset + n, dst_offset + n, nbytes - n
        if nbytes > 0:
            self._read_write(src, src_offset, dst, dst_offset, nbytes)

    def _read_write(self, src: int, src_offset: int, dst: int, dst_offset: int, nbytes: int):
        if self._buffer is None:
            self._buffer = bytearray(_COPY_BLOCK)
        view = memoryview(self._buffer)
        while nbytes > 0:
            n = os.preadv(src, [view[:min(nbytes, len(view))]], src_offset)
            if n == 0:
                raise OSError(errno.EIO, "the source file ended early")
            pwrite_all(dst, view[:n], dst_offset)
            src_offset, dst_offset, nbytes = src_offset + n, dst_offset + n, nbytes - n
