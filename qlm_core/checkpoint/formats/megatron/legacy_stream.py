"""The legacy rank files of one pipeline stage, written from an HF checkpoint with each source byte read once.

`build_shard` runs as it always does, but against a recorder standing in for the HF files: every read it asks for
is noted, with the view of the shard tensor it was to fill, instead of being done. Each file is saved with its
tensor bytes left out (io/storage_fill.py) and the views become file offsets. Rows that lie contiguous on both sides
are then copied file to file by the kernel (copy_file_range: no copy through user space), on a few threads, as soon
as their file is added: the copying overlaps the next files' building and saving on the main thread. The rest (the
column blocks of row-parallel weights, dtype conversions, fused or .bin sources) waits for fill(), which reads each
such source tensor once, in source-file order, for all the stage's files together into a reused buffer, so that TP
ranks do not each re-read it. The files are byte for byte what torch.save writes.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from qlm_core.checkpoint.formats.hf.checkpoint import HFCheckpoint
from qlm_core.checkpoint.io.storage_fill import (
    RangeCopier,
    byte_view,
    pwrite_all,
    storage_offsets,
    tensors_in,
    write_view,
)
from qlm_core.models.layout import HFTensorSource

COPY_THREADS = max(2, min(8, os.cpu_count() or 1))
COPY_BATCH_BYTES = 64 << 20  # kernel copies handed to a thread together: few futures, still spread over threads
STREAMING = hasattr(torch.serialization, "skip_data")  # torch >= 2.5; older torch writes the files whole


@dataclass
class _Read:
    """One read build_shard asked for: entries [start, stop) of HF tensor `name` along `axis`, into `out` (a view of
    a shard tensor) until its file is saved, then into the file at `offset` with the view's shape and strides."""

    name: str
    axis: int
    start: int
    stop: int
    out: torch.Tensor | None
    file: int = -1
    offset: int = 0
    shape: tuple[int, ...] = ()
    strides: tuple[int, ...] = ()
    dtype: torch.dtype | None = None


class _Recorder:
    """Stands in for the HFCheckpoint behind an HFTensorSource: notes reads instead of doing them."""

    def __init__(self, hf: HFCheckpoint):
        self.hf = hf
        self.reads: list[_Read] = []

    def dtype(self, name: str) -> torch.dtype:
        return self.hf.dtype(name)

    def read_into(self, name: str, axis: int, start: int, stop: int, out: torch.Tensor):
        self.reads.append(_Read(name, axis, start, stop, out))


def _narrowed_range(base: torch.Tensor, view: torch.Tensor, axis: int) -> tuple[int, int] | None:
    """[lo, hi) along `axis` when `view` is base.narrow(axis, lo, hi - lo), else None."""
    if view.untyped_storage().data_ptr() != base.untyped_storage().data_ptr() or view.dim() != base.dim():
        return None
    if any(view.shape[d] != base.shape[d] for d in range(base.dim()) if d != axis) or view.stride() != base.stride():
        return None
    lo = view.storage_offset() // base.stride(axis) if base.stride(axis) else 0
    if view.storage_offset() != lo * base.stride(axis):
        return None
    return lo, lo + view.shape[axis]


class StageWriter:
    """Build one stage's shards with `source`, hand each saved file to add_file, then call fill()."""

    def __init__(self, hf: HFCheckpoint):
        self.hf = hf
        self._recorder = _Recorder(hf)
        self.source = HFTensorSource(self._recorder)
        self._fds: list[int] = []  # the added files, open until fill() or close()
        self._reads: list[_Read] = []  # the reads that go through memory, done by fill()
        self._buffers: dict[str, torch.Tensor] = {}
        self._copiers = threading.local()  # a RangeCopier per copying thread (its fallback buffer is its own)
        self._pool: ThreadPoolExecutor | None = None
        self._copies: list = []
        self._sources: dict[Path, int] = {}

    # ---- per file: the reads of its tensors become file offsets --------------------------------------------------

    def add_file(self, path: Path, state: dict):
        """`path` holds torch.save(state) without the tensor bytes (megatron_legacy.write_shard_file,
        tensor_bytes=False); the reads recorded since the last file fill its tensors."""
        reads, self._recorder.reads = self._recorder.reads, []
        offsets = storage_offsets(path, state)
        tensors = _bases(state)
        if offsets is None:  # a storage the meta load could not place: read now, save the file whole
            self._read_now(reads)
            from qlm_core.checkpoint.formats.megatron.legacy import fast_torch_save

            fast_torch_save(state, path)
            return
        by_storage: dict[int, list[_Read]] = {}
        for read in reads:
            by_storage.setdefault(read.out.untyped_storage().data_ptr(), []).append(read)
        index = len(self._fds)
        fd = os.open(path, os.O_WRONLY)
        self._fds.append(fd)
        placed: list[_Read] = []
        for ptr, base in tensors.items():
            placed.extend(self._place(fd, index, offsets[ptr], base, by_storage.get(ptr, [])))
        self._start_copies(placed)

    def _place(self, fd: int, index: int, offset: int, base: torch.Tensor, reads: list[_Read]) -> list[_Read]:
        """Turn the reads into `base` (stored at `offset`) into reads into the file, returned; what they do not
        cover (vocabulary padding, tensors that are not reads) is written now from `base` itself."""
        covered = [_narrowed_range(base, read.out, read.axis) for read in reads]
        axes = {read.axis for read in reads}
        whole = base.storage_offset() == 0 and base.is_contiguous() and (
            base.numel() * base.element_size() == base.untyped_storage().nbytes())
        if not reads or not whole or None in covered or len(axes) != 1:
            self._read_now(reads)
            pwrite_all(fd, byte_view(_whole_storage(base)), offset)
            return []
        axis = axes.pop()
        item = base.element_size()
        for read in reads:
            read.file, read.offset = index, offset + read.out.storage_offset() * item
            read.shape, read.strides, read.dtype = tuple(read.out.shape), read.out.stride(), read.out.dtype
            read.out = None
        done = 0
        for lo, hi in sorted(covered) + [(base.shape[axis], base.shape[axis])]:
            if lo > done:
                gap = base.narrow(axis, done, lo - done)
                write_view(fd, offset + gap.storage_offset() * item, gap, gap.stride())
            done = max(done, hi)
        return reads

    def _read_now(self, reads: list[_Read]):
        for read in reads:
            self.hf.read_into(read.name, read.axis, read.start, read.stop, read.out)
            read.out = None

    # ---- kernel copies, started as files are added -----------------------------------------------------------------

    def _start_copies(self, reads: list[_Read]):
        """Hand the reads that are plain byte ranges on both sides to the copying threads, in batches; keep the
        others for fill()."""
        batch, batch_bytes = [], 0
        for read in reads:
            span = self.hf.byte_span(read.name, read.start, read.stop)
            if (span is None or read.axis != 0 or read.dtype != self.hf.dtype(read.name)
                    or not _is_contiguous(read.shape, read.strides)):
                self._reads.append(read)
                continue
            file, start, nbytes = span
            if file not in self._sources:
                self._sources[file] = os.open(file, os.O_RDONLY)
            batch.append((self._sources[file], start, self._fds[read.file], read.offset, nbytes))
            batch_bytes += nbytes
            if batch_bytes >= COPY_BATCH_BYTES:
                self._submit(batch)
                batch, batch_bytes = [], 0
        if batch:
            self._submit(batch)

    def _submit(self, ranges: list[tuple[int, int, int, int, int]]):
        if self._pool is None:
            # copy_file_range leaves the GIL: the threads copy while the main thread builds and saves
            self._pool = ThreadPoolExecutor(COPY_THREADS, thread_name_prefix="qlm-copy")
        self._copies.append(self._pool.submit(self._copy_ranges, ranges))

    def _copy_ranges(self, ranges: list[tuple[int, int, int, int, int]]):
        copier = getattr(self._copiers, "copier", None)
        if copier is None:
            copier = self._copiers.copier = RangeCopier()
        for src, src_offset, dst, dst_offset, nbytes in ranges:
            copier.copy(src, src_offset, dst, dst_offset, nbytes)

    # ---- per stage: every source tensor that goes through memory read once -----------------------------------------

    def fill(self):
        """Write the reads that go through memory, source tensor by source tensor in file order; wait for the
        copies; close the files."""
        try:
            by_name: dict[str, list[_Read]] = {}
            for read in self._reads:
                by_name.setdefault(read.name, []).append(read)
            for name in sorted(by_name, key=self._source_position):
                self._fill_tensor(name, by_name[name])
            for copy in self._copies:
                copy.result()  # a copy's error raised here
        finally:
            self.close()

    def close(self):
        """Wait for the copies started (an error of theirs is fill's to raise) and close every file."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        for fd in [*self._fds, *self._sources.values()]:
            os.close(fd)
        self._pool, self._copies, self._fds, self._sources = None, [], [], {}
        self._reads, self._buffers = [], {}

    def _source_position(self, name: str) -> tuple[str, int, str]:
        """Source file and offset (tensors that are no byte range of a file last): reads in file order."""
        span = self.hf.byte_span(name, 0, 0)
        return (str(span[0]), span[1], name) if span is not None else ("\uffff", 0, name)

    def _fill_tensor(self, name: str, reads: list[_Read]):
        whole = self._buffer("source", self.hf.shape(name), self.hf.dtype(name))
        self.hf.read_into(name, 0, 0, whole.shape[0], whole)
        for read in reads:
            part = whole.narrow(read.axis, read.start, read.stop - read.start)
            values = self._buffer("part", read.shape, read.dtype)
            values.copy_(part)
            write_view(self._fds[read.file], read.offset, values, read.strides)

    def _buffer(self, role: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A tensor of `shape` over a buffer reused for every tensor of this role (no fresh pages to fault in)."""
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        held = self._buffers.get(role)
        if held is None or held.numel() < nbytes:
            held = self._buffers[role] = torch.empty(max(nbytes, 1), dtype=torch.uint8)
        return held[:nbytes].view(dtype).view(shape)


def _is_contiguous(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    expected = 1
    for size, stride in reversed(list(zip(shape, strides, strict=True))):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _whole_storage(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage())


def _bases(state) -> dict[int, torch.Tensor]:
    """Every non-empty storage of `state` (by data_ptr) and a tensor over it."""
    found = {}
    for tensor in tensors_in(state):
        if tensor.untyped_storage().nbytes():
            found.setdefault(tensor.untyped_storage().data_ptr(), tensor)
    return found
