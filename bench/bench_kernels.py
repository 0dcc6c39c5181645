"""Attention: ringshm's C kernel vs torch's scaled_dot_product_attention, fp32 CPU, same shapes, same run.

Shapes are SmolLM2-135M's (Hq = 9, Hkv = 3, D = 64) at decode (n = 1), speculative verify (n = 8) and a prefill
chunk (n = 256), against a cache row holding L = 128 .. 4096 positions; queries sit at the end (start = L - n).
SDPA gets its native layout ([1, H, n, D], prepared outside the timed call), ``enable_gqa=True`` (no K/V
copies) and, for n > 1, an explicit bottom-right causal mask built once. Our kernel is single-threaded by
design (a stage is a single-threaded loop); SDPA runs with torch's default thread count and with one thread.

    python -m pytest bench/bench_kernels.py --benchmark-only   # one group per shape; ratios table at the end
    python bench/bench_kernels.py [--cpu-time]                 # markdown table, the three interleaved per shape

Figures only: nothing here asserts on time.
"""

from __future__ import annotations

import os
import statistics
import time

import pytest
import torch
import torch.nn.functional as F

from ringshm.model import kernels

HQ, HKV, D = 9, 3, 64
SHAPES = [(n, ctx) for n in (1, 8) for ctx in (128, 512, 1024, 4096)] + [(256, ctx) for ctx in (512, 1024, 4096)]
DEFAULT_THREADS = torch.get_num_threads()


def make_case(n: int, ctx: int, seed: int = 0):
    """Inputs for one shape: q [n, Hq, D], a cache row [Hkv, ctx, D] each for K and V, and SDPA's views."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, HQ, D, generator=g)
    k_cache = torch.randn(HKV, ctx, D, generator=g)
    v_cache = torch.randn(HKV, ctx, D, generator=g)
    start = ctx - n
    q_sdpa = q.transpose(0, 1)[None].contiguous()  # [1, Hq, n, D]
    mask = None if n == 1 else torch.ones(n, ctx, dtype=torch.bool).tril(start)  # query j sees keys <= start + j

    def ours():
        return kernels.attention(q, k_cache, v_cache, start)

    def sdpa():
        return F.scaled_dot_product_attention(q_sdpa, k_cache[None], v_cache[None], attn_mask=mask, enable_gqa=True)

    torch.testing.assert_close(ours(), sdpa()[0].transpose(0, 1), atol=1e-4, rtol=1e-4)  # same job
    return ours, sdpa


IMPLS = ["ringshm", "sdpa", "sdpa-1thread"]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("n,ctx", SHAPES, ids=[f"n{n}-ctx{c}" for n, c in SHAPES])
@pytest.mark.benchmark(max_time=0.4, min_rounds=5, warmup=True, warmup_iterations=3)
def test_attention_vs_sdpa(benchmark, figures, impl, n, ctx):
    ours, sdpa = make_case(n, ctx)
    shape = f"attention n={n} ctx={ctx}"
    benchmark.group = f"{shape} Hq={HQ} Hkv={HKV} D={D}"
    threads = torch.get_num_threads()
    torch.set_num_threads(DEFAULT_THREADS if impl == "sdpa" else 1)
    try:
        benchmark(ours if impl == "ringshm" else sdpa)
    finally:
        torch.set_num_threads(threads)
    figures.record(f"{shape}.{impl}", benchmark, n=n, ctx=ctx, threads=DEFAULT_THREADS if impl == "sdpa" else 1)
    if impl == "ringshm":
        goal = "<= 0.67 (1.5x faster)" if n in (1, 8) else ""
        figures.ratio(f"{shape}: ringshm / SDPA ({DEFAULT_THREADS} threads)", f"{shape}.ringshm", f"{shape}.sdpa", goal)
        figures.ratio(f"{shape}: ringshm / SDPA (1 thread)", f"{shape}.ringshm", f"{shape}.sdpa-1thread", goal)


def _mean_us(fn, calls: int, clock=time.perf_counter) -> float:
    t0 = clock()
    for _ in range(calls):
        fn()
    return (clock() - t0) / calls * 1e6


def ratio_table(rounds: int = 9, budget_s: float = 0.01, cpu_time: bool = False) -> str:
    """Markdown table: median µs per call of each, and ours / SDPA; the three are measured interleaved.

    ``cpu_time`` times the single-threaded pair (ours, SDPA with one thread) by this thread's CPU time, which
    a busy machine's preemption does not inflate; SDPA with several threads has no such clock and is left out.
    """
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    clock = time.thread_time if cpu_time else time.perf_counter
    impls = ["ringshm", "sdpa-1thread"] if cpu_time else IMPLS
    lines = [
        f"attention, fp32 CPU, Hq={HQ} Hkv={HKV} D={D}; ours single-threaded; "
        f"torch default threads = {DEFAULT_THREADS};"
        f" {os.cpu_count()} CPUs, load average before the run {load}; clock: "
        + ("thread CPU time" if cpu_time else "wall (other work on the machine inflates the multi-thread column most)"),
        "",
        "| n | ctx | ours µs | SDPA 1 thread µs | ours / SDPA |"
        + ("" if cpu_time else f" SDPA {DEFAULT_THREADS} threads µs | ours / SDPA |"),
        "|---:|---:|---:|---:|---:|" + ("" if cpu_time else "---:|---:|"),
    ]
    for n, ctx in SHAPES:
        ours, sdpa = make_case(n, ctx)
        calls = max(1, int(budget_s * 1e6 / _mean_us(sdpa, 3)))
        samples = {name: [] for name in impls}
        for _ in range(rounds):
            for name in impls:
                torch.set_num_threads(DEFAULT_THREADS if name == "sdpa" else 1)
                samples[name].append(_mean_us(ours if name == "ringshm" else sdpa, calls, clock))
        torch.set_num_threads(DEFAULT_THREADS)
        m = {name: statistics.median(v) for name, v in samples.items()}
        row = f"| {n} | {ctx} | {m['ringshm']:.1f} | {m['sdpa-1thread']:.1f} | {m['ringshm'] / m['sdpa-1thread']:.2f} |"
        if not cpu_time:
            row += f" {m['sdpa']:.1f} | {m['ringshm'] / m['sdpa']:.2f} |"
        lines.append(row)
    return "\n".join(lines)


if __name__ == "__main__":
    import sys

    print(ratio_table(cpu_time="--cpu-time" in sys.argv[1:]))
