"""A machine that is not ours alone (issue 19), figures only: slowdown under CPU-bound neighbours.

With 0, 1 and 2 hog processes (each one Python busy loop, as another tenant's job would be) running beside the
engine, in interleaved rounds (each round visits every hog level; the order rotates):

- single-stream greedy decode, 64 tokens after a short chat prompt (ringshm 3 stages, the default; its
  ``GenerationResult.tpot_s``), and llama.cpp with 2 threads on the same GGUF file in its own process (the
  peer bench's child, ``bench_peers.LlamaPeer``; only when llama-cpp-python is installed: ``make bench-peers``);
- 8 streams at once, 32 new tokens each (``generate_batch``): aggregate output tok/s, prefill included.

Ratios: each figure's slowdown at 1 and 2 hogs against the same figure with none (goals: <= 2.5 x and <= 4 x)
and ringshm's decode slowdown over llama.cpp's (goal <= 1). A fair share of 2 cores with k hogs is 2 / (2 + k)
of the CPU for everything else: 1.5 x at one hog, 2 x at two.

Then the server under full load: ``ringshm serve`` with 8 streaming clients for 20 s while another thread
asks ``/health`` and ``/metrics`` 5 times a second; p50 / p99 of their latency (goal p99 < 100 ms).

    python -m pytest bench/bench_contention.py --benchmark-only -s -p no:cacheprovider
"""

from __future__ import annotations

import importlib.util
import json
import multiprocessing as mp
import statistics
import time
import urllib.request
from pathlib import Path

import openai
import pytest

from conftest import cpu_info, cpu_label, percentile, ringshm_server, run_together

RESULTS_DIR = Path(__file__).resolve().parent / "results"
HOGS = (0, 1, 2)
ROUNDS = 2
N_NEW, N_STREAMS, N_BATCH_NEW = 64, 8, 32
PROMPT = "Write a detailed story, at least three paragraphs long, about a lighthouse keeper."
BATCH = ["Name a colour.", "Why is the sea salty?", "Say hello in French.", "What is 2 + 2?",
         "Give me a fruit.", "Who wrote Hamlet?", "List three prime numbers.", "Describe a cat."]
HAVE_LLAMA = importlib.util.find_spec("llama_cpp") is not None
_SAMPLES: dict[str, dict[int, list[float]]] = {}  # figure -> hogs -> seconds per token, per round
_SERVER: dict = {}


def _hog() -> None:
    while True:
        pass


class Hogs:
    """``n`` CPU-bound processes for the length of a ``with``."""

    def __init__(self, n: int):
        self.n, self.procs = n, []

    def __enter__(self):
        ctx = mp.get_context("spawn")
        self.procs = [ctx.Process(target=_hog, daemon=True) for _ in range(self.n)]
        for p in self.procs:
            p.start()
        time.sleep(0.5 if self.n else 0)  # let them reach their loop
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            p.kill()
            p.join()


def _add(figure: str, hogs: int, seconds_per_token: float) -> None:
    _SAMPLES.setdefault(figure, {}).setdefault(hogs, []).append(seconds_per_token)


def test_slowdown_under_hogs(benchmark, figures):
    from ringshm.engine.engine import Engine
    from ringshm.model.packaged import default_model_path

    peer = None
    if HAVE_LLAMA:
        from bench_peers import LlamaPeer

        peer = LlamaPeer(str(default_model_path()), 2)
    try:
        with Engine(stages=3, max_rows=N_STREAMS, max_seq_len=1024, progress=False) as engine:
            ids = engine.encode(PROMPT, chat=True)
            engine.generate(ids, 8)  # warm-up

            def rounds():
                for r in range(ROUNDS):
                    for hogs in HOGS[r % len(HOGS):] + HOGS[:r % len(HOGS)]:
                        with Hogs(hogs):
                            _add("ringshm decode", hogs, engine.generate(ids, N_NEW, ignore_eos=True).tpot_s)
                            if peer is not None:
                                _add("llama.cpp decode", hogs, peer.call("decode", ids, N_NEW)["tpot_s"])
                            out = engine.generate_batch(BATCH, N_BATCH_NEW, chat=True, ignore_eos=True)
                            _add("ringshm 8 streams", hogs, 1 / out.output_tok_s)

            benchmark.pedantic(rounds, rounds=1, warmup_rounds=0)
    finally:
        if peer is not None:
            peer.close()
    for figure, by_hogs in _SAMPLES.items():
        key = figure.replace(" ", "_").replace(".", "")
        for hogs, xs in by_hogs.items():
            figures.record_value(f"contention.{key}.h{hogs}", statistics.median(xs))
        for hogs, goal in ((1, "<= 2.5"), (2, "<= 4")):
            figures.ratio(f"{figure}: slowdown with {hogs} hog(s)", f"contention.{key}.h{hogs}",
                          f"contention.{key}.h0", goal)
    if peer is not None:
        for hogs in (1, 2):
            figures.ratio(f"decode at {hogs} hog(s): ringshm s/token / llama.cpp s/token",
                          f"contention.ringshm_decode.h{hogs}", f"contention.llamacpp_decode.h{hogs}")


def test_health_and_metrics_answer_fast_under_full_load(benchmark, figures):
    with ringshm_server("--stages", "3", "--max-rows", str(N_STREAMS)) as url:
        stop = time.monotonic() + 20
        latencies: dict[str, list[float]] = {"/health": [], "/metrics": []}

        def client(i: int) -> None:
            c = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
            while time.monotonic() < stop:
                for _ in c.chat.completions.create(model=c.models.list().data[0].id, max_tokens=64, stream=True,
                                                   messages=[{"role": "user", "content": BATCH[i]}]):
                    pass

        def poll() -> None:
            while time.monotonic() < stop:
                for path in latencies:
                    t0 = time.perf_counter()
                    with urllib.request.urlopen(url + path, timeout=10) as r:
                        r.read()
                    latencies[path].append(time.perf_counter() - t0)
                time.sleep(0.2)

        def run():
            run_together([lambda i=i: client(i) for i in range(N_STREAMS)] + [poll])

        benchmark.pedantic(run, rounds=1, warmup_rounds=0)
    for path, xs in latencies.items():
        _SERVER[path] = {"n": len(xs), "p50_ms": 1e3 * percentile(xs, 0.5), "p99_ms": 1e3 * percentile(xs, 0.99)}
        figures.summary.append(f"{path} under {N_STREAMS} streaming clients: p50 {_SERVER[path]['p50_ms']:.1f} ms, "
                               f"p99 {_SERVER[path]['p99_ms']:.1f} ms over {len(xs)} requests (goal p99 < 100 ms)")


@pytest.fixture(scope="module", autouse=True)
def _report(figures):
    yield
    figures.summary.append(f"contention (bench_contention.py), CPU: {cpu_label()}")
    for figure, by_hogs in _SAMPLES.items():
        per = {h: statistics.median(xs) for h, xs in sorted(by_hogs.items())}
        figures.summary.append(f"{figure:>18}: " + ", ".join(
            f"{h} hogs {1 / s:6.1f} tok/s ({s / per[0]:.2f} x)" for h, s in per.items()))
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / f"contention-{time.strftime('%Y%m%d-%H%M%S')}.json").write_text(
        json.dumps({"cpu": cpu_info(), "samples_s_per_token": _SAMPLES, "server": _SERVER}, indent=2))
