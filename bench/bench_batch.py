"""Many streams over the ring (issue 5), figures only.

TTFT A/B: B = 4 streams with prompts of 3-6 prefill chunks, prefill_depth 1 vs 8, rows and batch modes,
3 stages, link latency 0 and 2 ms (``link_latency_ms``). The figure is the prefill makespan: the last
stream's TTFT (``max_new_tokens=1``, so a run is all prefill). Each run is set against the pipeline bound
computed from per-stage service times (stage busy seconds / ops) measured in the depth-1 run of the same
latency and mode, where one stage computes at a time (at depth 8, stages sharing cores stretch each
other's busy time, which would inflate the bound):

    serial    = ops x (sum_i service_i + hops x hop)          every op traverses the whole ring alone
    pipelined = ops x max_i service_i + (sum_i service_i + hops x hop)      bottleneck stage x ops + one traversal

with hops = stages + 1 and hop = link latency + the ring's measured per-hop overhead. These machines have 2
cores for 3 stage processes, so no more than 2 stages compute at once; ``bound_2core`` also respects
that: max(ops x max_i service_i, ops x sum_i service_i / 2) + one traversal.

Throughput: aggregate decode tok/s for 1, 2, 4, 8 streams, rows vs batch vs the same prompts run one after
another with solo. Goals: batch >= 3 x and rows >= 1.5 x sequential at 8 streams; pipelined TTFT <= 1.15 x bound.

Run: ``python -m pytest bench/bench_batch.py --benchmark-only``; JSON and PNG land in bench/results/.
"""

from __future__ import annotations

import statistics
import time

import pytest

from ringshm.engine import Engine

STAGES = 3
CHUNK = 64
N_STREAMS = 4
LATENCIES_MS = (0.0, 2.0)
ROUNDS = 3
THROUGHPUT_STREAMS = (1, 2, 4, 8)
THROUGHPUT_NEW = 24
TEXT = ("Pipeline parallelism splits a model's layers into stages that run in separate processes; while one "
        "stage works on a chunk of the prompt, the next stage can already work on the previous chunk. ")
_ENGINES: dict[float, Engine] = {}
_SERVICE_S: dict[tuple[float, str], list[float]] = {}  # (latency, mode) -> depth-1 service time per stage


@pytest.fixture(scope="module")
def engines():
    yield _ENGINES
    for eng in _ENGINES.values():
        eng.close()


def engine_for(engines, latency_ms: float) -> Engine:
    if latency_ms not in engines:
        engines[latency_ms] = Engine(stages=STAGES, prefill_chunk=CHUNK, max_rows=8, max_seq_len=1024,
                                     link_latency_ms=latency_ms, progress=False)
    return engines[latency_ms]


def ab_prompts(eng: Engine) -> list[list[int]]:
    """Four prompts of 3, 4, 5 and 6 chunks of CHUNK tokens."""
    base = eng.encode(TEXT * 12)
    return [base[: CHUNK * n - 7] for n in (3, 4, 5, 6)]


def bounds(service_s: list[float], n_ops: int, hop_s: float) -> dict:
    traversal = sum(service_s) + (len(service_s) + 1) * hop_s
    return {"serial_s": n_ops * traversal,
            "pipelined_s": n_ops * max(service_s) + traversal,
            "bound_2core_s": max(n_ops * max(service_s), n_ops * sum(service_s) / 2) + traversal}


@pytest.mark.parametrize("depth", [1, 8])
@pytest.mark.parametrize("mode", ["rows", "batch"])
@pytest.mark.parametrize("latency_ms", LATENCIES_MS, ids=lambda x: f"lat{x:g}ms")
def test_ttft_ab(benchmark, figures, engines, latency_ms, mode, depth):
    eng = engine_for(engines, latency_ms)
    prompts = ab_prompts(eng)
    n_ops = sum(-(-len(p) // CHUNK) for p in prompts)
    eng.generate_batch(prompts[:1], mode=mode, max_new_tokens=1)  # warm up
    hop_us = eng.generate("warm", max_new_tokens=8).hop_overhead_us
    runs = []

    def run():
        runs.append(eng.generate_batch(prompts, mode=mode, max_new_tokens=1, prefill_depth=depth))

    benchmark.pedantic(run, rounds=ROUNDS, warmup_rounds=0)
    makespan = statistics.median(max(r.ttft_s for r in out.results) for out in runs)
    mean_ttft = statistics.median(statistics.mean(r.ttft_s for r in out.results) for out in runs)
    service = [statistics.median(out.stage_busy_s[i] for out in runs) / n_ops for i in range(STAGES)]
    if depth == 1:
        _SERVICE_S[(latency_ms, mode)] = service
    service = _SERVICE_S.get((latency_ms, mode), service)
    b = bounds(service, n_ops, latency_ms / 1e3 + hop_us / 1e6)
    key = f"ttft.lat{latency_ms:g}.{mode}.d{depth}"
    figures.record_value(key, makespan, mean_ttft_s=mean_ttft, service_s=service, n_ops=n_ops, hop_us=hop_us, **b,
                         measured_over_bound=makespan / b["pipelined_s"],
                         measured_over_bound_2core=makespan / b["bound_2core_s"])
    benchmark.extra_info.update(makespan_s=makespan, mean_ttft_s=mean_ttft, **b)
    print(f"\nlat {latency_ms:g} ms {mode} depth {depth}: last TTFT {makespan * 1e3:.0f} ms (mean "
          f"{mean_ttft * 1e3:.0f}), bound {b['pipelined_s'] * 1e3:.0f} ms, 2-core bound "
          f"{b['bound_2core_s'] * 1e3:.0f} ms, serial {b['serial_s'] * 1e3:.0f} ms")
    if depth == 8:
        figures.ratio(f"TTFT lat {latency_ms:g} ms {mode}: depth 8 / depth 1", key,
                      f"ttft.lat{latency_ms:g}.{mode}.d1")


@pytest.mark.parametrize("n_streams", THROUGHPUT_STREAMS)
@pytest.mark.parametrize("how", ["sequential", "rows", "batch"])
def test_decode_throughput(benchmark, figures, engines, how, n_streams):
    eng = engine_for(engines, 0.0)
    prompts = [eng.encode(f"Write a short note about topic number {i}: ") for i in range(n_streams)]
    tok_s = []

    def run():
        t0 = time.perf_counter()
        if how == "sequential":
            n = sum(eng.generate(p, max_new_tokens=THROUGHPUT_NEW, stop=None).n_output_tokens for p in prompts)
            tok_s.append(n / (time.perf_counter() - t0))
        else:
            tok_s.append(eng.generate_batch(prompts, mode=how, max_new_tokens=THROUGHPUT_NEW).output_tok_s)

    benchmark.pedantic(run, rounds=2, warmup_rounds=0)
    rate = statistics.median(tok_s)
    figures.record_value(f"tput.{how}.{n_streams}", 1.0 / rate, tok_s=rate)
    if how != "sequential" and n_streams == max(THROUGHPUT_STREAMS):
        goal = ">= 3" if how == "batch" else ">= 1.5"
        figures.ratio(f"aggregate tok/s at {n_streams} streams: {how} / sequential solo",
                      f"tput.sequential.{n_streams}", f"tput.{how}.{n_streams}", goal)


def _plot(figures, results_dir, stamp):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    labels, d1, d8, bound = [], [], [], []
    for lat in LATENCIES_MS:
        for mode in ("rows", "batch"):
            k1, k8 = f"ttft.lat{lat:g}.{mode}.d1", f"ttft.lat{lat:g}.{mode}.d8"
            if k1 in figures.medians and k8 in figures.medians:
                labels.append(f"{mode}\n{lat:g} ms")
                d1.append(figures.medians[k1] * 1e3)
                d8.append(figures.medians[k8] * 1e3)
                bound.append(figures.extra[k8]["pipelined_s"] * 1e3)
    xs = range(len(labels))
    ax1.bar([x - 0.2 for x in xs], d1, 0.4, label="prefill_depth 1")
    ax1.bar([x + 0.2 for x in xs], d8, 0.4, label="prefill_depth 8")
    ax1.scatter([x + 0.2 for x in xs], bound, color="k", marker="_", s=400, label="pipeline bound")
    ax1.set_xticks(list(xs), labels)
    ax1.set_ylabel("last stream's TTFT (ms)")
    ax1.set_title(f"TTFT, {N_STREAMS} streams, {STAGES} stages")
    ax1.legend()
    for how in ("sequential", "rows", "batch"):
        pts = [(n, figures.extra[f"tput.{how}.{n}"]["tok_s"]) for n in THROUGHPUT_STREAMS
               if f"tput.{how}.{n}" in figures.extra]
        if pts:
            ax2.plot(*zip(*pts), marker="o", label=how)
    ax2.set_xlabel("streams")
    ax2.set_ylabel("aggregate decode tok/s")
    ax2.set_title("throughput vs streams")
    ax2.legend()
    fig.tight_layout()
    path = results_dir / f"batch-{stamp}.png"
    fig.savefig(path, dpi=110)
    return path


@pytest.fixture(scope="module", autouse=True)
def _register_plot(figures):
    figures.plots.append(_plot)
