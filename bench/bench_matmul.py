"""The quantized matmul (ringshm.model.qmatmul) vs torch's fp32 ``F.linear`` on the dequantized weights, same run.

Shapes are SmolLM2-135M's: the fused QKV (576 → 960), the attention output (576 → 576), the fused gate-up
(576 → 3072) and down (1536 → 576), all Q4_1 as in the checkpoint, and the tied LM head (576 → 49152, Q8_0).
M = 1 is a decode, 8 a speculative verify or 8 streams, 256 a prefill chunk. Both sides use the same thread
count (torch's default, as a stage with every core does). Each call reads a different copy of the weights from
a ring of copies larger than the last-level cache, as a decode that walks 30 layers does; the baseline
"memcpy" copies the same number of bytes per call out of such a ring.

    python -m pytest bench/bench_matmul.py --benchmark-only -s

Figures: per-call medians, ``F.linear`` / ours (above 1 = ours faster), and the weight bytes per second the
matmul streams against memcpy's. Nothing here asserts on time.
"""

from __future__ import annotations

import platform
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf import quants

from ringshm.model import qmatmul as qm

SHAPES = {  # name: (N, K, type)
    "qkv 576->960": (960, 576, qm.Q4_1),
    "o 576->576": (576, 576, qm.Q4_1),
    "gate_up 576->3072": (3072, 576, qm.Q4_1),
    "down 1536->576": (576, 1536, qm.Q4_1),
    "lm_head 576->49152": (49152, 576, qm.Q8_0),
}
MS = (1, 8, 256)
RING_BYTES = 192 << 20  # more than any last-level cache here: every call reads its weights from memory
CASES = [(s, m) for s in SHAPES for m in MS if not (s.startswith("lm_head") and m == 256)]


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


class Ring:
    """``items`` cycled one per call."""

    def __init__(self, items):
        self.items, self.i = items, 0

    def next(self):
        self.i = (self.i + 1) % len(self.items)
        return self.items[self.i]


_CACHE: dict = {}


def case(shape: str):
    """(ring of PackedWeight copies, ring of fp32 weights, ring of byte buffers for memcpy) for a shape."""
    if shape not in _CACHE:
        n, k, qtype = SHAPES[shape]
        w = torch.randn(n, k, generator=torch.Generator().manual_seed(0)).numpy()
        gq = {qm.Q4_1: QT.Q4_1, qm.Q8_0: QT.Q8_0}[qtype]
        raw = quants.quantize(w, gq)
        packed = qm.PackedWeight(qm.RawWeight.from_bytes(qtype, n, k, raw.reshape(-1)))
        dense = torch.from_numpy(quants.dequantize(raw, gq)).reshape(n, k).contiguous()
        n_q = max(2, RING_BYTES // packed.nbytes)
        n_f = max(2, RING_BYTES // (dense.numel() * 4))
        packs = [packed] + [qm.PackedWeight(qm.RawWeight.from_bytes(qtype, n, k, raw.reshape(-1)))
                            for _ in range(n_q - 1)]
        denses = [dense] + [dense.clone() for _ in range(n_f - 1)]
        bufs = [torch.empty(packed.nbytes, dtype=torch.uint8) for _ in range(n_q)]
        _CACHE.clear()  # one shape's rings at a time
        _CACHE[shape] = (Ring(packs), Ring(denses), Ring(bufs), torch.empty(packed.nbytes, dtype=torch.uint8))
    return _CACHE[shape]


@pytest.mark.parametrize("impl", ["ringshm", "torch-fp32", "memcpy"])
@pytest.mark.parametrize("shape,m", CASES, ids=[f"{s.split()[0]}-M{m}" for s, m in CASES])
@pytest.mark.benchmark(max_time=0.5, min_rounds=5, warmup=True, warmup_iterations=2)
def test_matmul_vs_fp32_linear(benchmark, figures, impl, shape, m):
    packs, denses, bufs, dst = case(shape)
    x = torch.randn(m, SHAPES[shape][1])
    if impl == "ringshm":
        benchmark(lambda: packs.next().matmul(x))
    elif impl == "torch-fp32":
        benchmark(lambda: torch.nn.functional.linear(x, denses.next()))
    else:
        if m != 1:
            pytest.skip("memcpy does not depend on M: measured once per shape, at M = 1")
        benchmark(lambda: dst.copy_(bufs.next()))
    label = f"{shape} M={m}"
    figures.record(f"{label} {impl}", benchmark, cpu=cpu_name(), isa=qm.ISA_NAMES[qm.BEST_ISA],
                   threads=torch.get_num_threads(), weight_bytes=packs.items[0].nbytes)
    if impl == "ringshm":
        figures.ratio(f"{label}: F.linear fp32 / ringshm (time)", f"{label} torch-fp32", f"{label} ringshm")
        if m == 1:
            figures.ratio(f"{shape}: memcpy / ringshm M=1 (weight bytes/s vs memcpy)", f"{shape} M=1 memcpy",
                          f"{label} ringshm")
