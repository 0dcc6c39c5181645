"""The quantized matmul against the roofline of the machine it runs on (issue 28), figures only.

Two bounds, measured in the same run, with 1 thread and with a thread per core:

- **bandwidth**: the bytes per second a stage can stream from memory: ``qmatmul.read_probe`` (each thread reads
  its part of the buffer as 4 streams into 8 independent 16-lane add chains, the ISA path in use) over a fp32
  buffer the size of a case's ring of weight copies (``bench_matmul.RING_BYTES``: 4 x the last-level cache), the
  best of rounds (``torch.sum`` read 8 GB/s on one Xeon core where a Q8_0 matmul streamed 10);
- **peak**: the fp32 FMA flop/s of the ISA path in use (``conftest.fma_peak``: ``qmatmul.fma_probe``'s independent
  16-lane fma chains on every thread, csrc/matmul.h), the best of rounds.

Bounds are the best of their rounds (what the machine can do; a shared machine's slow moments only lower them),
matmul times the median.

Each case, every weight encoding a download carries on Llama-3.2-1B's gate-up shape (2048 → 16384; K-quants need
K a multiple of 256) at M = 1 (decode), 16 (batched decode, verify) and 256 (a prefill chunk), reads its weights
from a ring of copies larger than the last-level cache, as a decode that walks the layers does. A case's bound is
the roofline's time, ``max(packed weight bytes / bandwidth, 2·M·N·K / peak)``, and the figure is
``bound / measured`` (1.0 = at the machine's limit): memory-bound for small M, compute-bound for large M.

    python -m pytest bench/bench_roofline.py --benchmark-only -s -p no:cacheprovider

The last cases time the row prefetch forced on against forced off on the same weights (``qmatmul.set_row_prefetch``):
whether it pays on this CPU. The table names the CPU (vendor, family / model, ISA path). Issue 28's goal at M = 1 is
>= 0.85 of the bandwidth for every type; for the prefill GEMM >= 0.75 of the peak.
"""

from __future__ import annotations

import time

import pytest
import torch

from bench_matmul import RING_BYTES, Ring, type_weight
from conftest import cpu_label, fma_peak
from ringshm.model import qmatmul as qm

STREAM_BYTES = RING_BYTES // (128 * 4) * (128 * 4)
SHAPE = "gate_up 2048->16384"
N, K = 16384, 2048
TYPES = (qm.Q4_0, qm.Q4_1, qm.Q5_0, qm.Q5_1, qm.Q8_0, qm.Q4_K, qm.Q5_K, qm.Q6_K, qm.MXFP4, qm.F16, qm.BF16)
MS = (1, 16, 256)
THREADS = sorted({1, torch.get_num_threads()})
BOUNDS: dict[int, tuple[float, float]] = {}  # threads: (bytes/s, flop/s)


def _best_time(fn, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def bounds(threads: int) -> tuple[float, float]:
    """(bandwidth bytes/s, fp32 FMA peak flop/s) with ``threads`` threads, measured once per run."""
    if threads not in BOUNDS:
        buf = torch.ones(STREAM_BYTES // 4)
        qm.read_probe(buf, threads)  # the pages are in
        bandwidth = STREAM_BYTES / _best_time(lambda: qm.read_probe(buf, threads), 9)
        del buf
        BOUNDS[threads] = (bandwidth, fma_peak(threads))
    return BOUNDS[threads]


_RINGS: dict[int, Ring] = {}


def ring(qtype: int) -> Ring:
    """PackedWeight copies of one type larger than the last-level cache (one type at a time)."""
    if qtype not in _RINGS:
        _RINGS.clear()
        raw = type_weight(qtype, N, K)
        first = qm.PackedWeight(raw)
        _RINGS[qtype] = Ring([first] + [qm.PackedWeight(raw) for _ in range(max(2, RING_BYTES // first.nbytes) - 1)])
    return _RINGS[qtype]


CASES = [(t, m, th) for t in TYPES for m in MS for th in THREADS]


@pytest.mark.parametrize("qtype,m,threads", CASES, ids=[f"{qm.type_name(t)}-M{m}-T{th}" for t, m, th in CASES])
def test_matmul_against_the_roofline(benchmark, figures, qtype, m, threads):
    bandwidth, peak = bounds(threads)
    r = ring(qtype)
    x = torch.randn(m, K)
    r.next().matmul(x, threads=threads)
    t0 = time.perf_counter()
    r.next().matmul(x, threads=threads)
    calls = max(1, min(200, int(0.02 / max(time.perf_counter() - t0, 1e-6))))

    def run():
        for _ in range(calls):
            r.next().matmul(x, threads=threads)

    benchmark.pedantic(run, rounds=7, warmup_rounds=1)
    measured = benchmark.stats.stats.median / calls
    nbytes = r.items[0].nbytes
    t_mem, t_fma = nbytes / bandwidth, 2 * m * N * K / peak
    bound = max(t_mem, t_fma)
    name = f"{qm.type_name(qtype)} M={m} T={threads}"
    figures.record_value(f"roofline {name}", measured, bound_s=bound, bound="memory" if t_mem >= t_fma else "fma",
                         weight_bytes=nbytes, bandwidth=bandwidth, peak=peak)
    if not any(line.startswith("roofline of") for line in figures.summary):
        figures.summary.append(f"roofline of the quantized matmul, {SHAPE}, on {cpu_label()}")
        for th in THREADS:
            bw, pk = bounds(th)
            figures.summary.append(f"  {th} thread(s): bandwidth {bw / 1e9:.1f} GB/s (ringshm_read_probe over "
                                   f"{STREAM_BYTES >> 20} MiB), fp32 FMA peak {pk / 1e9:.1f} GFLOP/s "
                                   f"(ringshm_fma_probe), ridge {pk / bw:.1f} flop/byte")
        figures.summary.append(f"  {'case':<22} {'time':>10} {'GB/s':>7} {'GFLOP/s':>8}  bound   of bound")
    figures.summary.append(
        f"  {name:<22} {measured * 1e6:8.0f}us {nbytes / measured / 1e9:7.1f} {2 * m * N * K / measured / 1e9:8.1f}"
        f"  {'memory' if t_mem >= t_fma else 'fma':<6}  {bound / measured:6.2f}")


Q8_TYPES = tuple(t for t in TYPES if t not in (qm.F16, qm.BF16))  # the types with an 8-bit path
Q8_CASES = [(t, m) for t in Q8_TYPES for m in MS]
Q8_ROUNDS = 5


@pytest.mark.parametrize("qtype,m", Q8_CASES, ids=[f"{qm.type_name(t)}-M{m}" for t, m in Q8_CASES])
def test_int8_activations_against_fp32(benchmark, figures, qtype, m):
    """The opt-in 8-bit activations (``activations="int8"``, csrc/matmul.h) against the fp32 contract on the same
    weights, a thread per core: the two timed back to back in each of ``Q8_ROUNDS`` rounds (order flipped every
    round), the figure the median of the rounds' time ratios; at M = 1 also the 8-bit path's fraction of the
    bandwidth bound."""
    threads = THREADS[-1]
    bandwidth, _ = bounds(threads)
    r = ring(qtype)
    x = torch.randn(m, K)
    for act in ("float32", "int8"):
        r.next().matmul(x, threads=threads, activations=act)
    t0 = time.perf_counter()
    r.next().matmul(x, threads=threads)
    calls = max(1, min(200, int(0.02 / max(time.perf_counter() - t0, 1e-6))))
    pairs: list[tuple[float, float]] = []

    def timed(act: str) -> float:
        t0 = time.perf_counter()
        for _ in range(calls):
            r.next().matmul(x, threads=threads, activations=act)
        return (time.perf_counter() - t0) / calls

    def run():
        for i in range(Q8_ROUNDS):
            if i % 2:
                fp32 = timed("float32")
                pairs.append((timed("int8"), fp32))
            else:
                int8 = timed("int8")
                pairs.append((int8, timed("float32")))

    benchmark.pedantic(run, rounds=1, iterations=1)
    name = f"{qm.type_name(qtype)} M={m} T={threads}"
    figures.paired_ratio(f"int8 / fp32 time, {name}", pairs)
    nbytes = r.items[0].nbytes
    t8 = sorted(p[0] for p in pairs)[len(pairs) // 2]
    speed = sorted(d / n for n, d in pairs)[len(pairs) // 2]
    if not any(line.startswith("8-bit activations") for line in figures.summary):
        figures.summary.append(f"8-bit activations against fp32, {SHAPE}, {threads} thread(s), on {cpu_label()}")
        figures.summary.append(f"  {'case':<22} {'int8 time':>10} {'GB/s':>7} {'of bw':>6} {'x fp32 speed':>12}")
    figures.summary.append(f"  {name:<22} {t8 * 1e6:8.0f}us {nbytes / t8 / 1e9:7.1f} "
                           f"{nbytes / bandwidth / t8:6.2f} {speed:12.2f}")


IN_ORDER = (qm.Q4_0, qm.Q4_1, qm.Q8_0, qm.Q4_K, qm.MXFP4, qm.F16, qm.BF16)  # the types the row prefetch applies to
PF_CASES = [(t, m, act) for t in IN_ORDER
            for m, act in ((1, "float32"), (4, "float32"), (16, "float32"), (1, "int8"))
            if act == "float32" or t in qm.QUANTIZED]
PF_ROUNDS = 6


@pytest.mark.parametrize("qtype,m,act", PF_CASES, ids=[f"{qm.type_name(t)}-M{m}-{a}" for t, m, a in PF_CASES])
def test_the_row_prefetch_on_against_off(benchmark, figures, qtype, m, act):
    """The software prefetch of the rows ahead (``qmatmul.set_row_prefetch``; cpuid's choice per op:
    ``qmatmul.row_prefetch_for``, csrc/matmul.c) forced on and off in the same process, a thread per core, back to
    back in each of ``PF_ROUNDS`` rounds (order flipped every round): the figure is the median of the rounds' on / off
    time ratios (below 1: the prefetch pays on this CPU). What a session on a CPU not yet measured reads to set its
    default, per op's rows (M = 1, 4, 16)."""
    threads = THREADS[-1]
    r = ring(qtype)
    x = torch.randn(m, K)
    pairs: list[tuple[float, float]] = []

    def timed(on: bool) -> float:
        qm.set_row_prefetch(on)
        r.next().matmul(x, threads=threads, activations=act)
        t0 = time.perf_counter()
        for _ in range(calls):
            r.next().matmul(x, threads=threads, activations=act)
        return (time.perf_counter() - t0) / calls

    t0 = time.perf_counter()
    r.next().matmul(x, threads=threads, activations=act)
    calls = max(1, min(100, int(0.05 / max(time.perf_counter() - t0, 1e-6))))

    def run():
        for i in range(PF_ROUNDS):
            if i % 2:
                off = timed(False)
                pairs.append((timed(True), off))
            else:
                on = timed(True)
                pairs.append((on, timed(False)))

    try:
        benchmark.pedantic(run, rounds=1, iterations=1)
    finally:
        qm.set_row_prefetch(None)
    name = f"{qm.type_name(qtype)} M={m} T={threads} {act}"
    figures.paired_ratio(f"row prefetch on / off time, {name}", pairs)
    nbytes = r.items[0].nbytes
    on, off = (sorted(p[i] for p in pairs)[len(pairs) // 2] for i in (0, 1))
    if not any(line.startswith("row prefetch") for line in figures.summary):
        figures.summary.append(f"row prefetch on against off, {SHAPE}, {threads} thread(s), on {cpu_label()}")
        figures.summary.append(f"  {'case':<30} {'off GB/s':>9} {'on GB/s':>8} {'on / off time':>14}")
    figures.summary.append(f"  {name:<30} {nbytes / off / 1e9:9.1f} {nbytes / on / 1e9:8.1f} "
                           f"{sorted(a / b for a, b in pairs)[len(pairs) // 2]:14.2f}")
