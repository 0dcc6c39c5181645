"""What one hostile client costs every other client of ``ringshm serve`` (issue 26), figures only.

One server (3 stages, the default model, max_rows 8, max_waiting 64). A victim sends a short greedy streaming chat
(``VICTIM_TOKENS`` tokens) and measures, at the client, its TTFT and its inter-token latency; each attack is
measured against the same victim on the quiet server, rounds interleaved:

- ``abandoned``: 30 raw requests of 1,000 token ids whose sockets close as soon as they are sent (before the fix
  they kept their queue places and were prefilled in full; then the ops already in the rings were still computed):
  the victim's TTFT right after; and the same with prompts of 1 id (``abandoned 1-id``), what 30 requests that
  arrive at once cost on their own, whatever their prompts;
- ``stop strings``: a streaming request beside the victim with the most stop strings a request may carry (16 of
  256 never-matching characters; 250 of 7,000 are refused with 400 now, and the time of that refusal is reported):
  the victim's ITL p50;
- ``big tokenise``: six concurrent ``/tokenize`` calls of 1.9 MB of text (refused from their length now): the
  victim's TTFT while they run;
- ``slowloris``: 40 connections that send their headers a byte every 0.5 s: the victim's TTFT while they trickle,
  and how many of them are still open after the header timeout (10 s) plus 2 s.

Run: ``python -m pytest bench/bench_hostile.py --benchmark-only -s -p no:cacheprovider``. The same file measures
an older checkout when ``PYTHONPATH`` points at it (the server subprocess inherits it). The table names the CPU.
"""

from __future__ import annotations

import json
import socket
import statistics
import threading
import time
import urllib.error
import urllib.request

import pytest

from conftest import cpu_label, ringshm_server

VICTIM_TOKENS = 32
ROUNDS = 3


@pytest.fixture(scope="module")
def server():
    with ringshm_server("--stages", "3", "--max-rows", "8", "--max-waiting", "64", "--max-seq-len", "2048") as url:
        yield url


def _post(url: str, body: dict, timeout_s: float = 300) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def victim(url: str) -> tuple[float, float]:
    """(TTFT s, ITL p50 s) of the victim's streamed greedy chat."""
    body = {"messages": [{"role": "user", "content": "Name three colours of the sea."}], "max_tokens": VICTIM_TOKENS,
            "temperature": 0, "stream": True}
    req = urllib.request.Request(f"{url}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    t0 = time.perf_counter()
    times = []
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            if line.startswith(b"data: {") and b'"content":"' in line and b'"content":""' not in line:
                times.append(time.perf_counter())
    gaps = [b - a for a, b in zip(times, times[1:])]
    return times[0] - t0, statistics.median(gaps) if gaps else float("nan")


def _raw(url: str, body: bytes, path: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    return sock


def abandoned(url: str, n_ids: int = 1000) -> float:
    socks = [_raw(url, json.dumps({"prompt": [(7 * i + j) % 40000 + 100 for j in range(n_ids)],
                                   "max_tokens": 16}).encode(), "/v1/completions") for i in range(30)]
    for s in socks:
        s.close()
    return victim(url)[0]


def stop_strings(url: str) -> float:
    stop = [f"never {i} " + "z" * 240 for i in range(16)]
    body = {"messages": [{"role": "user", "content": "Tell me a long story about a ship."}], "max_tokens": 200,
            "temperature": 0, "stream": True, "stop": stop}
    t = threading.Thread(target=_post, args=(f"{url}/v1/chat/completions", body))
    t.start()
    time.sleep(0.5)
    itl = victim(url)[1]
    t.join()
    return itl


def big_tokenise(url: str) -> float:
    text = "word " * 380_000  # 1.9 MB
    threads = [threading.Thread(target=_post, args=(f"{url}/tokenize", {"prompt": text})) for _ in range(6)]
    for t in threads:
        t.start()
    time.sleep(0.2)
    ttft = victim(url)[0]
    for t in threads:
        t.join()
    return ttft


def slowloris(url: str, n: int = 40) -> tuple[float, int]:
    host, port = url.removeprefix("http://").split(":")
    socks = [socket.create_connection((host, int(port)), timeout=30) for _ in range(n)]
    stop = threading.Event()

    def trickle(sock):
        for b in b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 1000:
            if stop.is_set():
                return
            try:
                sock.send(bytes([b]))
            except OSError:
                return
            time.sleep(0.5)

    threads = [threading.Thread(target=trickle, args=(s,), daemon=True) for s in socks]
    for t in threads:
        t.start()
    time.sleep(1.0)
    ttft = victim(url)[0]
    time.sleep(11.0)  # past the header timeout
    still_open = sum(_is_open(s) for s in socks)
    stop.set()
    for s in socks:
        s.close()
    return ttft, still_open


def _is_open(sock: socket.socket) -> bool:
    """Whether the server still holds the connection open (reads what it sent, e.g. a 408, until end of file)."""
    sock.settimeout(0.05)
    try:
        while sock.recv(4096):
            pass
        return False
    except TimeoutError:
        return True
    except OSError:
        return False


def test_what_one_hostile_client_costs_the_others(server, figures, benchmark):
    victim(server)  # warm-up
    quiet_ttft, quiet_itl = [], []
    rows = {"abandoned": [], "abandoned 1-id": [], "stop strings": [], "big tokenise": [], "slowloris": []}
    open_after = []
    for _ in range(ROUNDS):
        t, i = victim(server)
        quiet_ttft.append(t)
        quiet_itl.append(i)
        rows["abandoned"].append(abandoned(server))
        time.sleep(1.0)
        rows["abandoned 1-id"].append(abandoned(server, 1))
        time.sleep(1.0)
        rows["stop strings"].append(stop_strings(server))
        rows["big tokenise"].append(big_tokenise(server))
        ttft, still = slowloris(server)
        rows["slowloris"].append(ttft)
        open_after.append(still)
    t0 = time.perf_counter()
    status, _ = _post(f"{server}/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                        "max_tokens": 4, "stop": ["s" * 7000] * 250})
    refuse_s = time.perf_counter() - t0
    benchmark.pedantic(lambda: None, rounds=1)
    med = statistics.median
    figures.record_value("victim TTFT quiet", med(quiet_ttft))
    figures.record_value("victim ITL p50 quiet", med(quiet_itl))
    for name, key in (("abandoned", "victim TTFT after 30 abandoned requests"),
                      ("abandoned 1-id", "victim TTFT after 30 abandoned 1-id requests"),
                      ("big tokenise", "victim TTFT beside 6 x 1.9 MB /tokenize"),
                      ("slowloris", "victim TTFT beside 40 slowloris connections")):
        figures.record_value(key, med(rows[name]))
        figures.ratio(f"{key} / quiet", key, "victim TTFT quiet")
    figures.record_value("victim ITL p50 beside 16 x 256-char stop strings", med(rows["stop strings"]))
    figures.ratio("victim ITL p50 beside 16 x 256-char stop strings / quiet",
                  "victim ITL p50 beside 16 x 256-char stop strings", "victim ITL p50 quiet")
    figures.summary += [
        f"bench_hostile on {cpu_label()}",
        f"  quiet victim: TTFT {med(quiet_ttft) * 1e3:.0f} ms, ITL p50 {med(quiet_itl) * 1e3:.1f} ms",
        *(f"  {name}: {med(v) * 1e3:.0f} ms ({'ITL p50' if name == 'stop strings' else 'TTFT'})"
          for name, v in rows.items()),
        f"  slowloris connections still open 12 s after they began: {open_after} of 40",
        f"  250 stop strings of 7,000 characters: HTTP {status} in {refuse_s * 1e3:.0f} ms",
    ]
