"""The OpenAI-compatible server under load (issue 7), figures only: a small ``vllm bench serve``-style load
generator over loopback.

One ``ringshm serve`` subprocess (3 stages, max_rows 8); for 1, 4 and 8 concurrent clients (threads with the
official ``openai`` client), each client sends ``REQUESTS_PER_CLIENT`` streaming chat requests back to back
(greedy, ``MAX_TOKENS`` tokens at most). Per request, measured at the client: TTFT (request sent to the first
content chunk) and ITL (gaps between content chunks); per level: p50 / p95 of both, and output tok/s (every
completion token, from ``usage``, over the level's wall time).

Run: ``python -m pytest bench/bench_server.py --benchmark-only -s``; JSON and PNG land in bench/results/.
"""

from __future__ import annotations

import json
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import openai
import pytest

RESULTS_DIR = Path(__file__).resolve().parent / "results"

CLIENTS = (1, 4, 8)
REQUESTS_PER_CLIENT = 2
MAX_TOKENS = 32
TOPICS = ["a lighthouse keeper", "a robot learning to paint", "the first city on Mars", "a talking cat",
          "a lost library", "a river that flows uphill", "a clockmaker's apprentice", "a winter festival"]
_LEVELS: dict[int, dict] = {}


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


@pytest.fixture(scope="module")
def server():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "ringshm.cli", "serve", "--port", str(port), "--stages", "3",
                             "--max-rows", "8", "--max-seq-len", "1024", "--prefill-chunk", "64",
                             "--log-level", "warning"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, "server did not start"
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            time.sleep(0.2)
    yield url
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)


def _client_loop(url: str, model: str, i: int, out: list[dict]) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=300)
    for k in range(REQUESTS_PER_CLIENT):
        topic = TOPICS[(i + k) % len(TOPICS)]
        t0 = time.perf_counter()
        times, usage = [], None
        stream = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"Write a long story about {topic}."}],
            max_tokens=MAX_TOKENS, temperature=0, stream=True)
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                times.append(time.perf_counter())
            usage = chunk.usage or usage
        out.append({"ttft_s": times[0] - t0, "itl_s": [b - a for a, b in zip(times, times[1:])],
                    "tokens": usage.completion_tokens})
    client.close()


@pytest.mark.parametrize("n_clients", CLIENTS)
def test_server_load(benchmark, figures, server, n_clients):
    model = openai.OpenAI(base_url=f"{server}/v1", api_key="x").models.list().data[0].id
    _client_loop(server, model, 0, [])  # warm up
    requests: list[dict] = []
    walls = []

    def run():
        threads = [threading.Thread(target=_client_loop, args=(server, model, i, requests))
                   for i in range(n_clients)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        walls.append(time.perf_counter() - t0)

    benchmark.pedantic(run, rounds=1, warmup_rounds=0)
    ttft = [r["ttft_s"] for r in requests]
    itl = [x for r in requests for x in r["itl_s"]]
    tok_s = sum(r["tokens"] for r in requests) / walls[0]
    level = {"clients": n_clients, "requests": len(requests), "ttft_p50_s": _pct(ttft, 0.5),
             "ttft_p95_s": _pct(ttft, 0.95), "itl_p50_s": _pct(itl, 0.5), "itl_p95_s": _pct(itl, 0.95),
             "output_tok_s": tok_s, "mean_ttft_s": statistics.mean(ttft)}
    _LEVELS[n_clients] = level
    figures.record_value(f"server.c{n_clients}.s_per_output_token", 1.0 / tok_s, **level)
    benchmark.extra_info.update(level)
    print(f"\n{n_clients} clients: TTFT p50 {level['ttft_p50_s'] * 1e3:.0f} ms p95 {level['ttft_p95_s'] * 1e3:.0f} "
          f"ms | ITL p50 {level['itl_p50_s'] * 1e3:.0f} ms p95 {level['itl_p95_s'] * 1e3:.0f} ms | "
          f"{tok_s:.1f} output tok/s")
    if n_clients > 1:
        figures.ratio(f"server output tok/s: {n_clients} clients / 1 client", "server.c1.s_per_output_token",
                      f"server.c{n_clients}.s_per_output_token")


def _plot(figures, results_dir, stamp):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = [_LEVELS[c] for c in CLIENTS if c in _LEVELS]
    if not levels:
        return None
    (results_dir / f"server-{stamp}.json").write_text(json.dumps(levels, indent=2))
    xs = [lv["clients"] for lv in levels]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, key, title in ((axes[0], "ttft", "TTFT (ms)"), (axes[1], "itl", "inter-token latency (ms)")):
        ax.plot(xs, [lv[f"{key}_p50_s"] * 1e3 for lv in levels], marker="o", label="p50")
        ax.plot(xs, [lv[f"{key}_p95_s"] * 1e3 for lv in levels], marker="o", label="p95")
        ax.set_title(title)
        ax.legend()
    axes[2].plot(xs, [lv["output_tok_s"] for lv in levels], marker="o")
    axes[2].set_title("output tok/s (all clients)")
    for ax in axes:
        ax.set_xlabel("concurrent streaming clients")
        ax.set_xticks(xs)
    fig.suptitle(f"ringshm serve, 3 stages, max_rows 8, greedy, max_tokens {MAX_TOKENS}, loopback")
    fig.tight_layout()
    path = results_dir / f"server-{stamp}.png"
    fig.savefig(path, dpi=110)
    return path


@pytest.fixture(scope="module", autouse=True)
def _register_plot(figures):
    figures.plots.append(_plot)
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
