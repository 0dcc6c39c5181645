"""Many streams over the ring through the one scheduler (issues 5 and 11), figures only.

TTFT A/B: B = 4 streams with prompts of 3-6 prefill chunks, prefill_depth 1 vs 8, 3 stages, link latency 0 and
2 ms (``link_latency_ms``). The figure is the prefill makespan: the last stream's TTFT (``max_new_tokens=1``,
so a run is all prefill). Each run is set against the pipeline bound computed from per-stage service times
(stage busy seconds / ops) measured in the depth-1 run of the same latency, where one stage computes at a time
(at depth 8, stages sharing cores stretch each other's busy time, which would inflate the bound):

    serial    = ops x (sum_i service_i + hops x hop)          every op traverses the whole ring alone
    pipelined = ops x max_i service_i + (sum_i service_i + hops x hop)      bottleneck stage x ops + one traversal

with hops = stages + 1 and hop = link latency + the ring's measured per-hop overhead. These machines have 2
cores for 3 stage processes, so no more than 2 stages compute at once; ``bound_2core`` also respects
that: max(ops x max_i service_i, ops x sum_i service_i / 2) + one traversal.

Throughput: 1, 2, 4, 8, 16 streams arriving together, ``THROUGHPUT_NEW`` tokens each (levels interleaved
over ``THROUGHPUT_ROUNDS`` rounds, medians), served by the
scheduler with the engine's default decode depth (every ready stream in one step op on a machine where the
stages share the cores); aggregate output tok/s (prefill included in the wall time) against one stream, the
per-stream ITL (median TPOT over the streams) and the coordinator's own work per committed token. At 8 streams
also ``depth = stages`` (one decode micro-batch per stage) and the same prompts served one after another
(``generate``), for the policy choice. Goal: 8 streams >= 4 x one stream.

Run: ``python -m pytest bench/bench_batch.py --benchmark-only``; JSON and PNG land in bench/results/.
"""

from __future__ import annotations

import statistics
import time

import pytest

from conftest import cpu_label
from ringshm.engine.engine import Engine

STAGES = 3
CHUNK = 64
N_STREAMS = 4
LATENCIES_MS = (0.0, 2.0)
ROUNDS = 3
THROUGHPUT_STREAMS = (1, 2, 4, 8, 16)
THROUGHPUT_NEW = 64
THROUGHPUT_ROUNDS = 3
TEXT = ("Pipeline parallelism splits a model's layers into stages that run in separate processes; while one "
        "stage works on a chunk of the prompt, the next stage can already work on the previous chunk. ")
_ENGINES: dict[float, Engine] = {}
_SERVICE_S: dict[float, list[float]] = {}  # latency -> depth-1 service time per stage


@pytest.fixture(scope="module")
def engines():
    yield _ENGINES
    for eng in _ENGINES.values():
        eng.close()


def engine_for(engines, latency_ms: float) -> Engine:
    if latency_ms not in engines:
        engines[latency_ms] = Engine(stages=STAGES, prefill_chunk=CHUNK, max_rows=16, max_seq_len=1024,
                                     link_latency_ms=latency_ms, progress=False,
                                     prefix_cache=False)  # every round prefills cold (repeated prompts would hit)
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
@pytest.mark.parametrize("latency_ms", LATENCIES_MS, ids=lambda x: f"lat{x:g}ms")
def test_ttft_ab(benchmark, figures, engines, latency_ms, depth):
    eng = engine_for(engines, latency_ms)
    prompts = ab_prompts(eng)
    n_ops = sum(-(-len(p) // CHUNK) for p in prompts)  # one chunk per op: the budget is one chunk
    eng.generate_batch(prompts[:1], max_new_tokens=1)  # warm up
    hop_us = eng.generate("warm", max_new_tokens=8).hop_overhead_us
    runs = []

    def run():
        runs.append(eng.generate_batch(prompts, max_new_tokens=1, prefill_depth=depth))

    benchmark.pedantic(run, rounds=ROUNDS, warmup_rounds=0)
    makespan = statistics.median(max(r.ttft_s for r in out.results) for out in runs)
    mean_ttft = statistics.median(statistics.mean(r.ttft_s for r in out.results) for out in runs)
    service = [statistics.median(out.stage_busy_s[i] for out in runs) / n_ops for i in range(STAGES)]
    if depth == 1:
        _SERVICE_S[latency_ms] = service
    service = _SERVICE_S.get(latency_ms, service)
    b = bounds(service, n_ops, latency_ms / 1e3 + hop_us / 1e6)
    key = f"ttft.lat{latency_ms:g}.d{depth}"
    figures.record_value(key, makespan, mean_ttft_s=mean_ttft, service_s=service, n_ops=n_ops, hop_us=hop_us, **b,
                         measured_over_bound=makespan / b["pipelined_s"],
                         measured_over_bound_2core=makespan / b["bound_2core_s"])
    benchmark.extra_info.update(makespan_s=makespan, mean_ttft_s=mean_ttft, **b)
    print(f"\nlat {latency_ms:g} ms depth {depth}: last TTFT {makespan * 1e3:.0f} ms (mean "
          f"{mean_ttft * 1e3:.0f}), bound {b['pipelined_s'] * 1e3:.0f} ms, 2-core bound "
          f"{b['bound_2core_s'] * 1e3:.0f} ms, serial {b['serial_s'] * 1e3:.0f} ms")
    if depth == 8:
        figures.ratio(f"TTFT lat {latency_ms:g} ms: prefill_depth 8 / 1", key, f"ttft.lat{latency_ms:g}.d1")


def _throughput_prompts(eng: Engine, n: int) -> list[list[int]]:
    topics = ["a lighthouse keeper", "a robot learning to paint", "the first city on Mars", "a talking cat",
              "a lost library", "a river that flows uphill", "a clockmaker's apprentice", "a winter festival"]
    return [eng.encode(f"Write a short story about {topics[i % 8]} (part {i // 8 + 1}).", chat=True)
            for i in range(n)]


def test_throughput_vs_streams(benchmark, figures, engines):
    """Every level once per round, rounds interleaved, so drift on a shared machine hits all levels alike."""
    eng = engine_for(engines, 0.0)
    prompts = {n: _throughput_prompts(eng, n) for n in THROUGHPUT_STREAMS}
    outs: dict[int, list] = {n: [] for n in THROUGHPUT_STREAMS}
    work: dict[int, list] = {n: [] for n in THROUGHPUT_STREAMS}
    eng.generate_batch(prompts[max(THROUGHPUT_STREAMS)], max_new_tokens=8)  # warm up

    def run():
        for n in THROUGHPUT_STREAMS:
            w0 = eng._link.work_s
            outs[n].append(eng.generate_batch(prompts[n], max_new_tokens=THROUGHPUT_NEW))
            work[n].append(eng._link.work_s - w0)

    benchmark.pedantic(run, rounds=THROUGHPUT_ROUNDS, warmup_rounds=0)
    for n in THROUGHPUT_STREAMS:
        rate = statistics.median(o.output_tok_s for o in outs[n])
        itl = statistics.median(statistics.median(r.tpot_s for r in o.results) for o in outs[n])
        tokens = sum(r.n_output_tokens for r in outs[n][-1].results)
        coord_us = statistics.median(work[n]) / tokens * 1e6
        segs = outs[n][-1].steps.segments / outs[n][-1].steps.ops
        figures.record_value(f"tput.{n}", 1.0 / rate, tok_s=rate, itl_s=itl, coordinator_us_per_token=coord_us,
                             segments_per_op=segs, depth=eng.depth, rows_per_op=eng.rows_per_op)
        figures.record_value(f"itl.{n}", itl)
        depth = f"{eng.depth}" if eng.rows_per_op is None else f"<= {eng.depth}, 1 per {eng.rows_per_op} decoding"
        print(f"\n{n} streams (depth {depth}): {rate:.1f} tok/s, ITL p50 {itl * 1e3:.1f} ms, coordinator "
              f"{coord_us:.0f} us/token, {segs:.1f} segments/op")
        if n > 1:
            figures.ratio(f"aggregate tok/s: {n} streams / 1 stream", "tput.1", f"tput.{n}", ">= 4" if n == 8 else "")
            figures.ratio(f"ITL p50: {n} streams / 1 stream", f"itl.{n}", "itl.1")


@pytest.mark.parametrize("how", ["micro_batches", "sequential"])
def test_throughput_policies_at_8_streams(benchmark, figures, engines, how):
    eng = engine_for(engines, 0.0)
    prompts = _throughput_prompts(eng, 8)
    tok_s = []

    def run():
        t0 = time.perf_counter()
        if how == "sequential":
            n = sum(eng.generate(p, max_new_tokens=THROUGHPUT_NEW).n_output_tokens for p in prompts)
            tok_s.append(n / (time.perf_counter() - t0))
        else:
            tok_s.append(eng.generate_batch(prompts, max_new_tokens=THROUGHPUT_NEW, depth=STAGES).output_tok_s)

    benchmark.pedantic(run, rounds=2, warmup_rounds=0)
    rate = statistics.median(tok_s)
    figures.record_value(f"tput8.{how}", 1.0 / rate, tok_s=rate)
    figures.ratio(f"8 streams: {how} ({'depth ' + str(STAGES) if how != 'sequential' else 'one by one'}) / "
                  f"default", "tput.8", f"tput8.{how}")


def _plot(figures, results_dir, stamp):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4))
    labels, d1, d8, bound = [], [], [], []
    for lat in LATENCIES_MS:
        k1, k8 = f"ttft.lat{lat:g}.d1", f"ttft.lat{lat:g}.d8"
        if k1 in figures.medians and k8 in figures.medians:
            labels.append(f"{lat:g} ms / hop")
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
    pts = [(n, figures.extra[f"tput.{n}"]) for n in THROUGHPUT_STREAMS if f"tput.{n}" in figures.extra]
    if pts:
        ns = [n for n, _ in pts]
        ax2.plot(ns, [e["tok_s"] for _, e in pts], marker="o", label="ringshm")
        ax2.plot(ns, [pts[0][1]["tok_s"] * n for n in ns], ls=":", color="gray", label="linear in streams")
        ax3.plot(ns, [e["itl_s"] * 1e3 for _, e in pts], marker="o")
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel("concurrent streams")
    ax2.set_ylabel("aggregate output tok/s")
    ax2.set_title(f"throughput vs streams, {STAGES} stages")
    ax2.legend()
    ax3.set_xscale("log", base=2)
    ax3.set_xlabel("concurrent streams")
    ax3.set_ylabel("ITL p50 (ms)")
    ax3.set_title("inter-token latency vs streams")
    fig.suptitle(cpu_label(), fontsize=9)
    fig.tight_layout()
    path = results_dir / f"batch-{stamp}.png"
    fig.savefig(path, dpi=110)
    figures.summary.append(f"bench_batch CPU: {cpu_label()}")
    return path


@pytest.fixture(scope="module", autouse=True)
def _register_plot(figures):
    figures.plots.append(_plot)
