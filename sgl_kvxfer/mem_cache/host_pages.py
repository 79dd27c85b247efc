"""Transparent huge pages for large host (CPU) KV buffers.

Decode reads each request's KV rows where the allocator put them; with 4 KiB pages a batch of
256 requests touches tens of thousands of pages per layer and the walk is TLB-bound. On Linux
with THP in "madvise" mode (the common default) a buffer gets 2 MiB pages only if asked, before
its pages are first touched; `advise_hugepages` asks. Best effort: anywhere else it does nothing.
"""
from __future__ import annotations

import ctypes
import os
import sys

import torch

_MADV_HUGEPAGE = 14
_MIN_BYTES = 4 << 20


def advise_hugepages(t: torch.Tensor) -> bool:
    """madvise(MADV_HUGEPAGE) over a CPU tensor's storage; True if the kernel accepted it.
    Call right after allocation: pages already touched keep their size."""
    if t.device.type != "cpu" or t.nbytes < _MIN_BYTES or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        page = os.sysconf("SC_PAGE_SIZE")
        start = -(-t.data_ptr() // page) * page
        end = (t.data_ptr() + t.nbytes) // page * page
        return libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_HUGEPAGE) == 0
    except (OSError, AttributeError):
        return False
