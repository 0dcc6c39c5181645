"""The packed weights' memory in 2 MiB pages where the kernel gives them (Linux transparent huge pages).

A matmul at a few rows streams its packed weights once per op, each thread through its share of the panels (a MoE
expert: one thread through all of it); in 4 KiB pages that stream crosses a page every 4 KiB, each a TLB miss and a
point where the hardware prefetcher stops. In 2 MiB pages (``madvise(MADV_HUGEPAGE)``: honoured where
``/sys/kernel/mm/transparent_hugepage/enabled`` says ``always`` or ``madvise``, a no-op where it says ``never``) it
crosses one every 2 MiB. Measured on an AMD EPYC Zen 5 (2 vCPU, 2026-12-07; bench/HISTORY.md has the runs): gate-up
2048 -> 8192 from a 300 MiB ring at one row, the same process alternating, one thread 1.08-1.10 x the GB/s (Q4_K,
Q6_K, Q4_1), two threads 1.01-1.03 x, 16 rows even (the fmas bind there); whole models' decode, the same process
alternating two copies, one stream: the 1B shape 0.99-1.14 x, OLMoE 1.03-1.12 x; the Qwen3-30B-A3B shape in
alternating processes 1.03-1.05 x (one stream), 1.02-1.14 x (8 streams).

The price is paid at load where memory is fragmented: the kernel compacts (and reclaims page cache) to find each
2 MiB page (``defrag``: ``madvise`` by default). On that VM, with ~10 GB of page cache, the 1B shape loaded in
1.8-1.9 s against 0.8-1.9 s, OLMoE in 7.4-10.4 s against 2.8-5.5 s, while the 30B shape loaded faster (30.5-34.1
against 35.6-43.9 s: 8 K page faults instead of 5 M). ``set_huge_pages(False)`` (``EngineConfig.huge_pages``,
``--huge-pages off``) keeps 4 KiB pages. Nothing a matmul computes depends on where its bytes sit.
"""

from __future__ import annotations

import mmap

import torch

HUGE_PAGE = 2 << 20  # bytes: x86-64's and arm64's (4 KiB base pages) transparent huge page
_ADVISE = getattr(mmap, "MADV_HUGEPAGE", None)  # Linux only; elsewhere every buffer is torch.empty's
_enabled = True


def huge_pages() -> bool:
    """Whether ``weight_buffer`` asks for 2 MiB pages (``set_huge_pages``; True unless turned off)."""
    return _enabled


def set_huge_pages(on: bool) -> bool:
    """Ask for 2 MiB pages in the weight buffers allocated from now on in this process (True, the default) or not
    (False: 4 KiB pages, the load without compaction stalls); buffers already allocated keep theirs. Returns
    ``huge_pages()`` after it.

    Raises:
        TypeError: ``on`` not a bool.
    """
    global _enabled
    if not isinstance(on, bool):
        raise TypeError(f"set_huge_pages takes True or False, got {on!r}")
    _enabled = on
    return _enabled


def weight_buffer(nbytes: int) -> torch.Tensor:
    """An uninitialised uint8 tensor of ``nbytes`` for packed weights. With ``huge_pages()`` on Linux and ``nbytes``
    of at least 2 MiB: from an anonymous private mapping whose whole 2 MiB extents (starting 2 MiB-aligned) are
    advised as huge pages, so that the kernel backs them with 2 MiB pages at first touch; the tail past the last
    whole extent stays in 4 KiB pages (no memory is taken beyond ``nbytes`` rounded up to 4 KiB; 2 MiB more of
    address space, never touched). Otherwise ``torch.empty``'s. The mapping lives as long as the tensor (or any view
    of it) does.

    Raises:
        ValueError: ``nbytes`` < 0. OSError: the mapping could not be made (out of address space); a kernel without
            transparent huge pages only ignores the advice.
    """
    if nbytes < 0:
        raise ValueError(f"weight_buffer needs nbytes >= 0, got {nbytes}")
    if not _enabled or _ADVISE is None or nbytes < HUGE_PAGE:
        return torch.empty(nbytes, dtype=torch.uint8)
    m = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(m, dtype=torch.uint8)  # holds the mapping: it closes when the last view is freed
    off = -whole.data_ptr() % HUGE_PAGE
    try:
        m.madvise(_ADVISE, off, nbytes // HUGE_PAGE * HUGE_PAGE)
    except OSError:  # EINVAL: a kernel built without transparent huge pages; the mapping serves in 4 KiB pages
        pass
    return whole[off:off + nbytes]
