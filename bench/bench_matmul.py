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

``test_quant_types_side_by_side`` compares the encodings of a Q4_K_M download (Q4_K, Q6_K, Q5_0, Q5_K) with
the legacy ones (Q4_1, Q5_1, Q8_0) on the same shapes (K a multiple of 256: SmolLM2's down, Llama 3.2 1B's
projections): each round times every type once, in an order that rotates, so slow phases of this shared machine
fall on all of them alike; the ratios are medians over rounds (type / Q4_1 time, above 1 = slower than Q4_1).
"""

from __future__ import annotations

import platform
import time
from pathlib import Path

import numpy as np
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


def last_level_cache_bytes() -> int:
    """The largest CPU cache's size in bytes (sysfs; 0 when unknown)."""
    sizes = [0]
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip()
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        try:
            sizes.append(int(text.rstrip("KMG")) * mult)
        except ValueError:
            pass
    return max(sizes)


# 4 x the last-level cache (at least 192 MiB): cycled through, a ring that size leaves the cache few hits, so every
# call reads its weights from memory (a 105 MiB L3 kept part of a 192 MiB ring: Q8_0 read "1.3 x" the bandwidth).
RING_BYTES = max(192 << 20, 4 * last_level_cache_bytes())
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


# ---- the encodings side by side -----------------------------------------------------------------------------

TYPE_SHAPES = {  # name: (N, K)
    "down 1536->576": (576, 1536),
    "qkv 2048->3072": (3072, 2048),
    "gate_up 2048->16384": (16384, 2048),
    "down 8192->2048": (2048, 8192),
}
TYPES = (qm.Q4_1, qm.Q4_K, qm.Q6_K, qm.Q5_0, qm.Q5_K, qm.Q5_1, qm.Q8_0)
TYPE_MS = (1, 8, 256)
TYPE_THREADS = sorted({1, torch.get_num_threads()})  # one thread: the kernel alone, without the pool's wake-ups
TYPE_CASES = [(s, m, t) for s in TYPE_SHAPES for m in TYPE_MS for t in TYPE_THREADS]
K_BLOCK_BYTES = {qm.Q4_K: 144, qm.Q5_K: 176, qm.Q6_K: 210}


def type_weight(qtype: int, n: int, k: int) -> qm.RawWeight:
    """A weight of ``qtype``: gguf.quants of a normal tensor, or (K-quants, which gguf-py does not quantize)
    random blocks with fp16 scales that give weights of about the same size."""
    rng = np.random.default_rng(0)
    if qtype == qm.F16:  # gguf.quants has no F16 codec: the file's bytes are numpy's float16
        w = rng.standard_normal((n, k), dtype=np.float32)
        return qm.RawWeight.from_bytes(qtype, n, k, w.astype(np.float16).view(np.uint8).reshape(-1))
    if qtype == qm.MXFP4:  # random nibbles under one scale (gguf.quants' MXFP4 search would take gigabytes here)
        raw = rng.integers(0, 256, size=(n, k // 32, 17), dtype=np.uint8)
        raw[:, :, 0] = 121  # d = 2^-7: weights up to 12 / 128
        return qm.RawWeight.from_bytes(qtype, n, k, raw.reshape(-1))
    if qtype not in qm.K_QUANTS:
        w = rng.standard_normal((n, k), dtype=np.float32)
        return qm.RawWeight.from_bytes(qtype, n, k, quants.quantize(w, QT(qtype)).reshape(-1))
    raw = rng.integers(0, 256, size=(n, k // 256, K_BLOCK_BYTES[qtype]), dtype=np.uint8)
    for at in ((208,) if qtype == qm.Q6_K else (0, 2)):
        raw[:, :, at:at + 2] = np.full(raw.shape[:2], 0.01, np.float16).view(np.uint8).reshape(*raw.shape[:2], 2)
    return qm.RawWeight.from_bytes(qtype, n, k, raw.reshape(-1))


_TYPE_CACHE: dict = {}


def type_rings(shape: str) -> dict:
    """For each type: a ring of PackedWeight copies larger than the last-level cache (one shape at a time)."""
    if shape not in _TYPE_CACHE:
        _TYPE_CACHE.clear()
        n, k = TYPE_SHAPES[shape]
        rings = {}
        for qtype in TYPES:
            raw = type_weight(qtype, n, k)
            first = qm.PackedWeight(raw)
            copies = max(2, RING_BYTES // first.nbytes)
            rings[qtype] = Ring([first] + [qm.PackedWeight(raw) for _ in range(copies - 1)])
        _TYPE_CACHE[shape] = rings
    return _TYPE_CACHE[shape]


@pytest.mark.parametrize("shape,m,threads", TYPE_CASES,
                         ids=[f"{s.split()[0]}{s.split()[1]}-M{m}-T{t}" for s, m, t in TYPE_CASES])
def test_quant_types_side_by_side(benchmark, figures, shape, m, threads):
    rings = type_rings(shape)
    n, k = TYPE_SHAPES[shape]
    x = torch.randn(m, k)
    budget_s = 3.0  # per case, all types together
    calls = 1
    for qtype in TYPES:  # warm up; size a round to about budget / 15
        t0 = time.perf_counter()
        rings[qtype].next().matmul(x, threads=threads)
        calls = max(calls, int(budget_s / 15 / len(TYPES) / max(time.perf_counter() - t0, 1e-6)))
    calls = min(calls, 200)
    times: dict[int, list[float]] = {t: [] for t in TYPES}

    def run():
        rounds, start = 0, time.perf_counter()
        while rounds < 5 or (time.perf_counter() - start < budget_s and rounds < 40):
            order = TYPES[rounds % len(TYPES):] + TYPES[:rounds % len(TYPES)]
            for qtype in order:
                ring = rings[qtype]
                t0 = time.perf_counter()
                for _ in range(calls):
                    ring.next().matmul(x, threads=threads)
                times[qtype].append((time.perf_counter() - t0) / calls)
            rounds += 1

    benchmark.pedantic(run, rounds=1, warmup_rounds=0)  # the rounds are run's own, interleaved over the types
    rounds = len(times[TYPES[0]])
    label = f"{shape} M={m} T={threads}"
    for qtype in TYPES:
        figures.record_value(f"{label} {qm.type_name(qtype)}", float(np.median(times[qtype])), cpu=cpu_name(),
                             isa=qm.ISA_NAMES[qm.BEST_ISA], threads=threads, rounds=rounds,
                             calls=calls, weight_bytes=rings[qtype].items[0].nbytes)
    if not figures.summary or not figures.summary[0].startswith("quant types side by side"):
        figures.summary.insert(0, f"quant types side by side on {cpu_name()}, {qm.ISA_NAMES[qm.BEST_ISA]} "
                                  f"(median per call; T = threads):")
    figures.summary.append(f"  {label:<28} " + "  ".join(
        f"{qm.type_name(t)} {np.median(times[t]) * 1e6:9.1f} us" for t in TYPES) + f"  ({rounds} rounds)")
    for qtype in TYPES[1:]:
        goal = "<= 1.11 (Q4_K at least 0.9 x Q4_1's speed)" if qtype == qm.Q4_K and m == 1 else ""
        figures.ratio(f"{label}: {qm.type_name(qtype)} / Q4_1 (time)", f"{label} {qm.type_name(qtype)}",
                      f"{label} Q4_1", goal)
