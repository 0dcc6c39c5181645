"""The packed weights' buffers in 2 MiB pages (ringshm.model.hugepages): which extents are advised, that the mapping
lives as long as any view, that a weight packed there computes the same bits, and the setting's checks."""
import gc
import mmap

import pytest
import torch

from ringshm.config import EngineConfig
from ringshm.model import hugepages
from ringshm.model import qmatmul as qm
from ringshm.model.hugepages import HUGE_PAGE, weight_buffer

from test_matmul import make_weight

LINUX = getattr(mmap, "MADV_HUGEPAGE", None) is not None


def vmas(pid="self"):
    """[(start, end, advised)] of a process's mappings: advised where the kernel marks the VMA ``hg``
    (``madvise(MADV_HUGEPAGE)``, /proc/PID/smaps VmFlags)."""
    out, cur = [], None
    for line in open(f"/proc/{pid}/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            cur = [lo, hi, False]
            out.append(cur)
        elif head == "VmFlags:":
            cur[2] = "hg" in line.split()[1:]
    return [tuple(v) for v in out]


def advised_at(addr: int, pid="self") -> bool:
    (hit,) = [adv for lo, hi, adv in vmas(pid) if lo <= addr < hi]
    return hit


def advised_bytes(pid) -> int:
    """Bytes of a process's mappings advised as huge pages."""
    return sum(hi - lo for lo, hi, adv in vmas(pid) if adv)


@pytest.mark.skipif(not LINUX, reason="madvise(MADV_HUGEPAGE) is Linux's")
def test_a_buffer_of_whole_huge_pages_is_aligned_and_only_its_whole_extents_are_advised():
    n = 2 * HUGE_PAGE + 12345
    t = weight_buffer(n)
    assert t.dtype == torch.uint8 and t.numel() == n and t.data_ptr() % HUGE_PAGE == 0
    t.fill_(7)
    assert int(t.sum()) == 7 * n
    p = t.data_ptr()
    assert advised_at(p) and advised_at(p + 2 * HUGE_PAGE - 1)
    assert not advised_at(p + 2 * HUGE_PAGE)  # the tail stays in 4 KiB pages: no page of memory past n
    assert not advised_at(p - 1)


def from_torch_empty(t: torch.Tensor) -> bool:
    """A buffer of torch.empty's own (its storage exactly its bytes), not a view into weight_buffer's mapping (2 MiB
    longer). Where torch.empty's memory lands is the allocator's business: in a process that ran other tests it may
    sit in a heap range that NumPy advised huge for an array of its own (it does for arrays of 4 MiB and more), so
    the VMA flags prove only weight_buffer's advice."""
    return t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel()


@pytest.mark.skipif(not LINUX, reason="madvise(MADV_HUGEPAGE) is Linux's")
def test_small_buffers_and_the_setting_turned_off_take_torch_empty():
    assert hugepages.huge_pages()
    small = weight_buffer(HUGE_PAGE - 1)
    assert small.numel() == HUGE_PAGE - 1 and from_torch_empty(small)
    try:
        assert hugepages.set_huge_pages(False) is False and not hugepages.huge_pages()
        big = weight_buffer(3 * HUGE_PAGE)
        assert big.numel() == 3 * HUGE_PAGE and from_torch_empty(big)
    finally:
        hugepages.set_huge_pages(True)
    again = weight_buffer(3 * HUGE_PAGE)
    assert not from_torch_empty(again) and advised_at(again.data_ptr() + HUGE_PAGE)


def test_the_mapping_lives_as_long_as_a_view_of_it():
    t = weight_buffer(3 * HUGE_PAGE)
    t[HUGE_PAGE:HUGE_PAGE + 8] = torch.arange(8, dtype=torch.uint8)
    view = t[HUGE_PAGE:HUGE_PAGE + 8]
    del t
    gc.collect()
    weight_buffer(3 * HUGE_PAGE).fill_(255)  # a new mapping would reuse freed address space
    assert view.tolist() == list(range(8))


def test_a_weight_packed_in_huge_pages_gives_the_same_bits():
    """Speed only: the same packed bytes and the same matmul bits either way (a weight over 2 MiB, so that it does
    sit in advised pages where the setting is on)."""
    raw, _, _ = make_weight(qm.Q4_K, 2048, 2048)
    packs = {}
    try:
        for on in (True, False):
            hugepages.set_huge_pages(on)
            packs[on] = qm.PackedWeight(raw)
    finally:
        hugepages.set_huge_pages(True)
    assert packs[True].nbytes >= HUGE_PAGE
    if LINUX:
        assert advised_at(packs[True].packed.data_ptr()) and from_torch_empty(packs[False].packed)
    assert torch.equal(packs[True].packed, packs[False].packed)
    x = torch.randn(5, 2048, generator=torch.Generator().manual_seed(3))
    for m in (1, 5):
        a, b = packs[True].matmul(x[:m], threads=2), packs[False].matmul(x[:m], threads=2)
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_the_setting_is_checked():
    with pytest.raises(TypeError, match="set_huge_pages takes True or False"):
        hugepages.set_huge_pages(1)
    with pytest.raises(ValueError, match="weight_buffer needs nbytes >= 0"):
        weight_buffer(-1)
    with pytest.raises(ValueError, match="huge_pages must be True or False"):
        EngineConfig(huge_pages="on")
