"""Where packed weights live: anonymous memory in chunks the kernel is asked to back with transparent huge pages.

A decode streams every weight byte once per token from memory; in 4 KiB pages a stage's ~1 GB of weights spans
~250k pages, each a TLB miss and a point where the hardware prefetchers stop. ``weight_buffer`` hands out
64-byte-aligned pieces of chunks of ``CHUNK_BYTES`` (or one chunk of its own for a larger request), each chunk an
anonymous ``mmap`` given ``madvise(MADV_HUGEPAGE)`` before anything touches it, so that the 2 MiB-aligned parts of
it fault in as huge pages where the system's THP setting is ``always`` or ``madvise`` (with ``never``, or without
free huge pages, the kernel backs them with 4 KiB pages and nothing else changes). A chunk is unmapped when every
tensor cut from it is gone; untouched parts of a chunk are never resident.
"""

from __future__ import annotations

import mmap
import threading

import torch

CHUNK_BYTES = 64 << 20  # a chunk's size: small weights share one; a weight above it gets a chunk of its own
ALIGN = 64  # bytes: a cache line, and the alignment the C kernels' loads assume of a packed weight
HUGE_PAGE = 2 << 20  # the x86-64 transparent huge page

_lock = threading.Lock()
_chunk: torch.Tensor | None = None  # the chunk being cut, as uint8 over its whole mapping
_used = 0  # bytes of it handed out


def _map(nbytes: int) -> torch.Tensor:
    """A fresh anonymous mapping as a uint8 tensor of ``nbytes`` that starts on a huge-page boundary and keeps the
    mapping alive. Only the whole huge pages inside the tensor are advised (``MADV_HUGEPAGE``): its last partial
    2 MiB and the unused head before the boundary stay 4 KiB pages, so no huge page is faulted in past its end."""
    size = -(-(nbytes + HUGE_PAGE) // mmap.PAGESIZE) * mmap.PAGESIZE
    m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(m, dtype=torch.uint8)  # the tensor's storage holds a reference to the mapping
    head = -whole.data_ptr() % HUGE_PAGE
    if nbytes >= HUGE_PAGE and hasattr(mmap, "MADV_HUGEPAGE"):  # Linux; elsewhere plain pages
        m.madvise(mmap.MADV_HUGEPAGE, head, nbytes // HUGE_PAGE * HUGE_PAGE)
    return whole[head:head + nbytes]


def weight_buffer(nbytes: int) -> torch.Tensor:
    """A uint8 tensor of ``nbytes`` for a packed weight: zero-filled, 64-byte aligned (``ALIGN``), in memory asked
    for as transparent huge pages (module docstring). Thread-safe.

    Raises:
        ValueError: ``nbytes`` < 1. OSError: the mapping failed (out of address space or memory).
    """
    global _chunk, _used
    if nbytes < 1:
        raise ValueError(f"weight_buffer needs at least one byte, got {nbytes}")
    if nbytes > CHUNK_BYTES // 4:  # large: its own mapping, so no chunk's tail is wasted on it
        return _map(nbytes)
    with _lock:
        if _chunk is None or _used + nbytes > _chunk.numel():
            _chunk, _used = _map(CHUNK_BYTES), 0
        piece = _chunk[_used:_used + nbytes]
        _used += -(-nbytes // ALIGN) * ALIGN
    return piece
