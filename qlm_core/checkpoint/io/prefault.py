"""Map in the pages of a memory-mapped tensor with one system call before copying out of it.

Copying out of a torch.load(mmap=True) tensor takes one page fault per 4 KiB, which reads page-cached data at about
a fifth of the speed of madvise(MADV_POPULATE_READ) (Linux >= 5.14) followed by the copy. Elsewhere, or on older
kernels, this does nothing and the copy faults the pages in as before.
"""

from __future__ import annotations

import ctypes
import mmap
import sys

import torch

_MADV_POPULATE_READ = 22
_madvise = None
if sys.platform.startswith("linux"):
    try:
        _madvise = ctypes.CDLL(None, use_errno=True).madvise
        _madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    except (OSError, AttributeError):
        _madvise = None


def prefault(tensor: torch.Tensor) -> None:
    """Best effort: populate the pages `tensor`'s elements span (a no-op for memory that is already resident)."""
    if _madvise is None or not tensor.numel() or tensor.device.type != "cpu":
        return
    start = tensor.data_ptr()
    stop = start + tensor.numel() * tensor.element_size() if tensor.is_contiguous() else None
    if stop is None:
        return
    page = mmap.PAGESIZE
    aligned = start - start % page
    _madvise(aligned, stop - aligned, _MADV_POPULATE_READ)
