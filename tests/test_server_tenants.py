"""One client cannot hurt another on a real server (issue 26): ``ringshm serve`` (1 stage, the default model) in
a subprocess, driven over loopback.

- A seeded fuzz: clients send random in-range sampling values (temperatures down to 1e-300, top_p 1e-300,
  repetition penalties at their limits, penalties, logit_bias), stop lists up to the caps, content parts, values
  just past the caps, and disconnect mid-request, while a victim streams a greedy chat. The victim's bytes equal
  its answer alone, its median inter-token latency stays within a bound of the same run beside benign clients,
  and no request is answered 5xx.
- SIGHUP ends the server as SIGTERM does: the open stream finishes with ``[DONE]``, exit 0, no segment left.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import statistics
import threading
import time
import urllib.request

import pytest

from ringshm.transport.segment import process_start_time
from test_server import Server, _own_segments, _poll

ARGS = ["--stages", "1", "--max-seq-len", "1024", "--max-rows", "8", "--max-waiting", "32"]
VICTIM = "Write a short poem about the sea."
VICTIM_TOKENS = 48
SEED = int(os.environ.get("RINGSHM_FUZZ_SEED", "26"))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server(ARGS, tmp_path_factory.mktemp("tenants") / "serve.log")
    srv.wait_healthy()
    yield srv
    srv.stop()


def _post(url: str, body: dict, timeout_s: float = 120) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _victim(url: str) -> tuple[str, list[float]]:
    """The victim's streamed greedy chat: its text and the gaps between its content events (s)."""
    body = {"messages": [{"role": "user", "content": VICTIM}], "max_tokens": VICTIM_TOKENS, "temperature": 0,
            "stream": True}
    req = urllib.request.Request(f"{url}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    text, times = [], []
    with urllib.request.urlopen(req, timeout=120) as r:
        for line in r:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            for choice in event["choices"]:
                if choice["delta"].get("content"):
                    text.append(choice["delta"]["content"])
                    times.append(time.perf_counter())
    return "".join(text), [b - a for a, b in zip(times, times[1:])]


def _random_text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice("abcdefgh xyz.,!é東🙂") for _ in range(n))


def _hostile(rng: random.Random) -> dict:
    """One request with random in-range values (and now and then one just past a cap)."""
    body: dict = {"max_tokens": rng.randint(1, 24), "seed": rng.randint(-(2**63), 2**63 - 1)}
    body["temperature"] = rng.choice([1e-300, 1e-38, 1e-5, 0.0, rng.uniform(0, 2), 2.0])
    body["top_p"] = rng.choice([1e-300, 1e-45, 1.0, rng.uniform(1e-9, 1)])
    if rng.random() < 0.5:
        body["top_k"] = rng.choice([0, 1, 5, 10**6])
    if rng.random() < 0.5:
        body["repetition_penalty"] = rng.choice([0.01, 100.0, rng.uniform(0.01, 100)])
    if rng.random() < 0.3:
        body["presence_penalty"], body["frequency_penalty"] = rng.uniform(-2, 2), rng.uniform(-2, 2)
    if rng.random() < 0.3:
        body["logit_bias"] = {str(rng.randrange(49152)): rng.choice([-100, 100, rng.uniform(-100, 100)])
                              for _ in range(rng.randint(1, 20))}
    if rng.random() < 0.5:
        n_stop = rng.choice([1, 4, 16, 17])  # 17: one past the cap, a 400
        body["stop"] = [_random_text(rng, rng.choice([1, 3, 256, 257])) for _ in range(n_stop)]
    if rng.random() < 0.3:
        body["n"] = rng.randint(1, 3)
    parts = [{"type": "text", "text": _random_text(rng, rng.randint(1, 40))} for _ in range(rng.randint(1, 4))]
    body["messages"] = [{"role": "user", "content": parts if rng.random() < 0.5 else _random_text(rng, 30)}]
    body["stream"] = rng.random() < 0.5
    return body


def _send_and_maybe_leave(url: str, body: dict, leave_after_s: float | None, statuses: list) -> None:
    """Send ``body``; with ``leave_after_s``, close the connection after that long (a client that goes away)."""
    if leave_after_s is None:
        statuses.append(_post(f"{url}/v1/chat/completions", body)[0])
        return
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        time.sleep(leave_after_s)


def _run_beside(url: str, bodies: list[dict], rng: random.Random) -> tuple[str, list[float], list[int]]:
    """The victim streams while ``bodies`` are sent by 6 client threads (a third of them leave early)."""
    statuses: list[int] = []
    plan = [(b, rng.choice([None, None, rng.uniform(0.0, 0.5)])) for b in bodies]
    lock = threading.Lock()

    def client():
        while True:
            with lock:
                if not plan:
                    return
                body, leave = plan.pop()
            _send_and_maybe_leave(url, body, leave, statuses)

    threads = [threading.Thread(target=client) for _ in range(6)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    text, gaps = _victim(url)
    for t in threads:
        t.join(timeout=300)
    return text, gaps, statuses


def test_random_hostile_clients_change_neither_the_victims_bytes_nor_its_latency(server):
    print(f"fuzz seed {SEED} (RINGSHM_FUZZ_SEED)")
    url = server.url
    alone, _ = _victim(url)
    rng = random.Random(SEED)
    hostile = [_hostile(rng) for _ in range(40)]
    benign = [{"messages": [{"role": "user", "content": _random_text(rng, 30)}], "temperature": 0.7,
               "max_tokens": b["max_tokens"], "n": b.get("n", 1), "stream": b["stream"]} for b in hostile]
    base_text, base_gaps, base_statuses = _run_beside(url, benign, random.Random(SEED + 1))
    text, gaps, statuses = _run_beside(url, hostile, random.Random(SEED + 1))
    assert base_text == alone and text == alone, "the victim's bytes changed beside other clients"
    assert all(s in (200, 400) for s in statuses + base_statuses), sorted(set(statuses))
    assert statuses.count(400) >= 1 and statuses.count(200) >= 10, statuses  # both kinds were exercised
    p50_base, p50 = statistics.median(base_gaps), statistics.median(gaps)
    print(f"victim ITL p50: {p50 * 1e3:.1f} ms beside hostile clients, {p50_base * 1e3:.1f} ms beside benign ones")
    assert p50 <= 2.5 * p50_base + 0.03, (p50, p50_base)
    health = json.loads(urllib.request.urlopen(f"{url}/health", timeout=10).read())
    assert health["status"] == "ok"
    _poll(lambda: json.loads(urllib.request.urlopen(f"{url}/health", timeout=10).read())["running"] == 0,
          timeout_s=30, what="every abandoned request gone")


def test_sighup_finishes_the_open_stream_then_exits_0_leaving_no_process_or_segment(server):
    stage_pids = [s["pid"] for s in json.loads(urllib.request.urlopen(f"{server.url}/health").read())["stages"]]
    body = {"messages": [{"role": "user", "content": VICTIM}], "max_tokens": 24, "temperature": 0, "stream": True}
    req = urllib.request.Request(f"{server.url}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        first = r.readline()
        assert first.startswith(b"data: ")
        server.proc.send_signal(signal.SIGHUP)
        rest = r.read()
    assert rest.rstrip().endswith(b"data: [DONE]"), rest[-200:]
    assert server.proc.wait(timeout=60) == 0, server.log()
    assert _own_segments(server.pid) == []
    _poll(lambda: all(process_start_time(p) is None for p in stage_pids), what="every stage process gone")
