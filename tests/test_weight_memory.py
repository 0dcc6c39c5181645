"""Packed weights' memory (ringshm.model.weight_memory): aligned, disjoint, zeroed, and advised as transparent huge
pages over exactly the whole 2 MiB pages inside a weight (read back from the kernel's /proc/self/smaps)."""

from __future__ import annotations

import mmap
import re
from pathlib import Path

import pytest
import torch

from ringshm.model import qmatmul as qm
from ringshm.model.weight_memory import ALIGN, CHUNK_BYTES, HUGE_PAGE, weight_buffer

SMAPS = Path("/proc/self/smaps")
needs_smaps = pytest.mark.skipif(not SMAPS.exists() or not hasattr(mmap, "MADV_HUGEPAGE"),
                                 reason="Linux only: madvise(MADV_HUGEPAGE) and /proc/self/smaps")


def vma_flags(addr: int) -> list[str]:
    """The VmFlags of the mapping that holds ``addr``."""
    lines = SMAPS.read_text().splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if m and int(m.group(1), 16) <= addr < int(m.group(2), 16):
            for follow in lines[i + 1:]:
                if follow.startswith("VmFlags:"):
                    return follow.split()[1:]
    raise AssertionError(f"no mapping holds {addr:#x}")


def test_pieces_are_aligned_disjoint_and_zeroed():
    sizes = [1, 63, 64, 65, 4096, 300_000, CHUNK_BYTES // 4, CHUNK_BYTES // 4 + 1, 3 * HUGE_PAGE + 5]
    bufs = [weight_buffer(n) for n in sizes]
    spans = sorted((b.data_ptr(), b.data_ptr() + b.numel()) for b in bufs)
    for (b0, e0), (b1, _) in zip(spans, spans[1:]):
        assert e0 <= b1, "two weights share bytes"
    for n, b in zip(sizes, bufs):
        assert b.dtype == torch.uint8 and b.numel() == n and b.is_contiguous()
        assert b.data_ptr() % ALIGN == 0
        assert int(b.count_nonzero()) == 0
        b.fill_(7)  # writable, and writing one does not touch the others
    assert all(int(b.min()) == 7 for b in bufs)
    with pytest.raises(ValueError, match="at least one byte"):
        weight_buffer(0)


@needs_smaps
def test_a_large_weight_is_advised_huge_over_its_whole_huge_pages_only():
    pages = CHUNK_BYTES // 4 // HUGE_PAGE + 1  # past a quarter chunk: a mapping of its own
    b = weight_buffer(pages * HUGE_PAGE + 12345)
    start = b.data_ptr()
    assert start % HUGE_PAGE == 0, "a large weight starts on a huge page"
    for page in range(pages):
        assert "hg" in vma_flags(start + page * HUGE_PAGE + 100), f"huge page {page} not advised"
    assert "hg" not in vma_flags(start + pages * HUGE_PAGE), "the partial last 2 MiB must stay 4 KiB pages"


@needs_smaps
def test_small_weights_share_an_advised_chunk():
    a, b = weight_buffer(1000), weight_buffer(1000)
    assert b.data_ptr() - a.data_ptr() == 1024  # cut one after the other, each on its cache line
    assert "hg" in vma_flags(a.data_ptr())


def test_packed_weights_live_there_and_multiply_as_before():
    w = torch.randn(64, 256)
    packed = qm.PackedWeight(qm.RawWeight.from_tensor(w))
    assert packed.packed.data_ptr() % ALIGN == 0
    x = torch.randn(3, 256)
    torch.testing.assert_close(packed.matmul(x), x @ w.T, rtol=1e-5, atol=1e-5)
