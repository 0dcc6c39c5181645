"""No client can hurt another through the HTTP server (issue 26), in process over the fake oracle ring
(tests/test_server_abuse.py's ``LiveServer``): a client that goes away is cancelled wherever its request is, the
cheap checks run before any tokenisation and a big input has its own lane, slow senders are cut off, and the
small findings (huge ints, content parts, duplicate logit_bias keys, refused legacy fields, stop caps)."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from fake_stage import GatedModel
from ringshm.generation_params import MAX_STOP_CHARS, MAX_STOP_STRINGS
from test_server_abuse import LiveServer, ServerEngine, _error, _script, serve_fake  # noqa: F401 - fixture


def _raw_request(port: int, body: dict | bytes, path: str = "/v1/completions") -> socket.socket:
    """An HTTP request sent whole on a new socket (left open; nothing is read)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def _poll(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} not reached within {timeout_s} s"
        time.sleep(0.02)


# ------------------------------------------------------------------------------- a client that goes away
@pytest.mark.parametrize("stream", [False, True])
def test_requests_whose_clients_closed_are_cancelled_queued_or_prefilling_and_never_computed(serve_fake, stream):
    """30 raw requests of 1,000 ids whose sockets closed pushed a normal request's TTFT from 0.07 s to 55 s: they
    kept their queue places and were prefilled in full. Now each is cancelled where it waits."""
    scripts = [_script(100 + i, 1200) for i in range(6)]
    model = GatedModel(scripts, max_rows=2)
    srv = serve_fake(model, max_waiting=8)
    model.gate.clear()  # the stage holds every op: nothing can finish while the clients leave
    socks = [_raw_request(srv.port, {"prompt": t[:1000], "max_tokens": 16, "stream": stream}) for t in scripts[:5]]
    _poll(lambda: srv.aengine.n_running + srv.aengine.n_waiting == 5, 10, "5 requests admitted or queued")
    for s in socks:
        s.close()
    _poll(lambda: srv.aengine.n_running + srv.aengine.n_waiting == 0, 5, "every abandoned request cancelled")
    model.gate.set()
    status, body, _ = srv.post("/v1/completions", {"prompt": scripts[5][:6], "max_tokens": 8})
    assert status == 200 and body["choices"][0]["text"] is not None
    # 5 prompts of 1,000 ids in chunks of 4 are 1,250 prefill ops in full; only what was in flight ran
    # (prefill_depth = 8 ops) beside the last request's 9 (2 prefill, 7 decode). Counted from 0, not from the
    # poll above: the in-flight ops may be sent just after the 5 requests are counted.
    assert srv.aengine.step_stats.ops <= 8 + 9, srv.aengine.step_stats
    metrics = srv.get("/metrics")[1]
    assert 'ringshm_request_finished_total{finish_reason="cancelled"} 5.0' in metrics


def test_a_client_that_leaves_while_its_prompt_is_tokenised_never_reaches_the_engine(serve_fake):
    srv = serve_fake(encode_s=1.0)
    sock = _raw_request(srv.port, {"prompt": "tokenised slowly", "max_tokens": 4})
    time.sleep(0.3)  # on the tokenizer lane now
    sock.close()
    time.sleep(1.2)  # tokenising ends
    assert srv.aengine.step_stats.ops == 0 and srv.aengine.n_waiting == 0


# ---------------------------------------------------------------- cheap checks first, and two lanes
class CountingEngine(ServerEngine):
    """ServerEngine counting its tokenisations; text longer than ``slow_chars`` takes ``slow_s`` (a big input)."""

    def __init__(self, *args, slow_chars: int = 10**9, slow_s: float = 0.0, **kw):
        super().__init__(*args, **kw)
        self.n_encoded, self.slow_chars, self.slow_s = 0, slow_chars, slow_s

    def encode(self, prompt, chat=False, tokenizer=None):
        self.n_encoded += 1
        if isinstance(prompt, str) and len(prompt) > self.slow_chars:
            time.sleep(self.slow_s)
        return super().encode(prompt, chat, tokenizer)


@pytest.fixture
def serve_counting(model_path):
    made = []

    def make(**kw) -> LiveServer:
        srv = LiveServer(CountingEngine(GatedModel([_script(100)], max_rows=2), model_path, **kw))
        made.append(srv)
        return srv

    yield make
    for srv in made:
        srv.close()


def test_a_list_of_many_prompts_is_refused_from_its_length_before_any_is_tokenised(serve_counting):
    srv = serve_counting()
    status, body, _ = srv.post("/v1/completions", {"prompt": ["hi there"] * 120_000, "max_tokens": 1})
    assert status == 400 and "120000 prompt(s)" in _error(body)["message"]
    assert srv.aengine.engine.n_encoded == 0


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "word " * 400_000}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 400_000}]}),
    ("/tokenize", {"prompt": "word " * 400_000}),
])
def test_a_text_longer_than_the_context_can_hold_is_refused_untokenised(serve_counting, path, body):
    srv = serve_counting()
    status, parsed, _ = srv.post(path, {**body, "max_tokens": 1} if path != "/tokenize" else body)
    err = _error(parsed)
    assert status == 400 and "characters" in err["message"] and "1024 tokens" in err["message"], err
    assert srv.aengine.engine.n_encoded == 0


def test_big_inputs_take_their_own_lane_so_small_requests_are_not_queued_behind_them(serve_counting):
    """Six concurrent 1.9 MB /tokenize calls pushed every new request's TTFT from 0.08 s to 3.7 s."""
    srv = serve_counting(slow_chars=20_000, slow_s=1.5)
    big = [threading.Thread(target=srv.post, args=("/tokenize", {"prompt": "word " * 5_000})) for _ in range(3)]
    for t in big:
        t.start()
    time.sleep(0.3)  # the first big one is being tokenised, two wait on its lane
    t0 = time.monotonic()
    status, body, _ = srv.post("/v1/completions", {"prompt": "small", "max_tokens": 1})
    small_s = time.monotonic() - t0
    bigs_done = sum(not t.is_alive() for t in big)
    for t in big:
        t.join(timeout=30)
    assert status == 200, body
    assert bigs_done == 0, f"the small request waited for {bigs_done} big one(s) ({small_s:.2f} s)"


# -------------------------------------------------------------------------------------------- slow senders
def _closed_within(sock: socket.socket, timeout_s: float) -> bytes:
    """What the server sent before it closed the connection; fails when it is still open after ``timeout_s``."""
    sock.settimeout(timeout_s)
    got = b""
    try:
        while chunk := sock.recv(4096):
            got += chunk
    except TimeoutError:
        pytest.fail(f"the connection is still open after {timeout_s} s (got {got!r})")
    return got


def test_headers_sent_a_byte_at_a_time_are_cut_off_at_the_header_timeout(serve_fake):
    srv = serve_fake(header_timeout_s=1.0)
    sock = socket.create_connection(("127.0.0.1", srv.port))
    stop = threading.Event()

    def trickle():
        for b in b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 1000:
            if stop.is_set():
                return
            try:
                sock.send(bytes([b]))
            except OSError:
                return
            time.sleep(0.1)

    sender = threading.Thread(target=trickle, daemon=True)
    t0 = time.monotonic()
    sender.start()
    got = _closed_within(sock, 5.0)
    stop.set()
    assert got.startswith(b"HTTP/1.1 408") and time.monotonic() - t0 < 3.0
    status, _, _ = srv.post("/v1/completions", {"prompt": [100, 110], "max_tokens": 1})
    assert status == 200  # others are served meanwhile and after


def test_an_idle_connection_that_never_sends_is_closed_at_the_header_timeout(serve_fake):
    srv = serve_fake(header_timeout_s=1.0)
    sock = socket.create_connection(("127.0.0.1", srv.port))
    assert _closed_within(sock, 5.0).startswith(b"HTTP/1.1 408")


def test_a_body_sent_too_slowly_is_cut_off_at_the_body_timeout(serve_fake):
    srv = serve_fake(body_timeout_s=1.0)
    sock = socket.create_connection(("127.0.0.1", srv.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 100\r\n\r\n{")
    got = _closed_within(sock, 5.0)
    assert got.startswith(b"HTTP/1.1 408")
    assert srv.aengine.n_waiting == 0 and srv.aengine.step_stats.ops == 0


def test_keep_alive_requests_on_one_connection_are_not_cut_off(serve_fake):
    import http.client

    srv = serve_fake(header_timeout_s=1.0, body_timeout_s=1.0)
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
    for _ in range(3):
        conn.request("POST", "/v1/completions", json.dumps({"prompt": [100, 110], "max_tokens": 2}),
                     {"content-type": "application/json"})
        assert conn.getresponse().read() and True
        time.sleep(0.6)  # idle between requests: uvicorn's keep-alive timeout (5 s) applies, not the header one
    conn.close()


# --------------------------------------------------------------------------------------------- small ones
@pytest.mark.parametrize("raw, param", [
    (b'{"prompt": [100, 110], "max_tokens": ' + b"9" * 4301 + b"}", None),  # json cannot even read it as an int
    (b'{"prompt": [100, 110], "max_tokens": ' + b"9" * 4300 + b"}", "max_tokens"),
    (b'{"prompt": [100, 110], "max_tokens": 2, "seed": ' + b"9" * 4000 + b"}", "seed"),
])
def test_ints_of_thousands_of_digits_get_400_not_500(serve_fake, raw, param):
    srv = serve_fake()
    status, body, _ = srv.post("/v1/completions", raw)
    assert status == 400 and _error(body)["param"] == param, body


@pytest.mark.parametrize("part", [{"type": "text", "text": None}, {"type": "text", "text": 5},
                                  {"type": "text", "text": {"a": 1}}, {"type": "text"},
                                  {"type": "image_url", "image_url": {"url": "x"}}])
def test_a_content_part_that_is_not_text_gets_400_instead_of_being_stringified(serve_fake, part):
    srv = serve_fake()
    status, body, _ = srv.post("/v1/chat/completions", {"messages": [{"role": "user", "content": [part]}],
                                                        "max_tokens": 2})
    assert status == 400 and _error(body)["param"] == "messages", body


def test_logit_bias_naming_one_token_twice_gets_400(serve_fake):
    srv = serve_fake()
    status, body, _ = srv.post("/v1/completions", {"prompt": [100, 110], "max_tokens": 2,
                                                   "logit_bias": {"00005": 10, "5": -10}})
    assert status == 400 and _error(body)["param"] == "logit_bias" and "twice" in _error(body)["message"]


@pytest.mark.parametrize("field, value", [("functions", [{"name": "f", "parameters": {}}]),
                                          ("function_call", "auto"), ("tool_choice", "auto"),
                                          ("tool_choice", {"type": "function", "function": {"name": "f"}})])
def test_legacy_functions_and_a_lone_tool_choice_are_refused_not_ignored(serve_fake, field, value):
    srv = serve_fake()
    status, body, _ = srv.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                        "max_tokens": 2, field: value})
    assert status == 400 and _error(body)["param"] == field, body
    status, _, _ = srv.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                     "max_tokens": 2, "tool_choice": "none"})
    assert status == 200


@pytest.mark.parametrize("stop", [["s"] * (MAX_STOP_STRINGS + 1), "z" * (MAX_STOP_CHARS + 1),
                                  ["ok", "z" * (MAX_STOP_CHARS + 1)]])
def test_stop_lists_over_the_caps_get_400_naming_stop(serve_fake, stop):
    srv = serve_fake()
    status, body, _ = srv.post("/v1/completions", {"prompt": [100, 110], "max_tokens": 2, "stop": stop})
    assert status == 400 and _error(body)["param"] == "stop", body
