"""The OpenAI-compatible server (issue 7), driven over loopback with the official ``openai`` client.

One main server (3 stages, max_rows 8) runs for the module in a subprocess (``python -m ringshm.cli serve``),
as a user would start it; a second small one (2 stages, one KV row, one waiting slot) serves the 429 and
dead-stage cases. Expected answers come from ``Engine.generate`` in this process (every stream gets exactly its
solo tokens whatever shares its step ops, so concurrent answers must equal them exactly). The last test
SIGTERMs the main server.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import CHATS
from ringshm.engine.async_engine import AsyncEngine
from ringshm.engine.engine import Engine
from ringshm.transport.segment import list_segments, process_start_time

N_NEW = 12
SMALL_OP_TIMEOUT_S = 3  # --op-timeout of the small server
MAIN_ARGS = ["--stages", "3", "--max-seq-len", "1024", "--max-rows", "8", "--prefill-chunk", "64"]
PROMPTS = CHATS[:3] + ["Name a colour.", "What is 2 + 2?", "Say hello in French.", "Give me a fruit.",
                       "Why is the sea salty?"]
COMPLETION_PROMPT = "The capital of France is"


class Server:
    """``ringshm serve`` in a subprocess on a free loopback port, its output in a log file."""

    def __init__(self, args: list[str], log_path: Path):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "ringshm.cli", "serve", "--port", str(self.port),
                                      "--log-level", "warning", *args], stdout=self._log, stderr=subprocess.STDOUT)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def wait_healthy(self, timeout_s: float = 180.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"server exited with {self.proc.returncode}:\n{self.log()}"
            try:
                if _http(f"{self.url}/health")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"server not healthy within {timeout_s} s:\n{self.log()}")

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="x", max_retries=0, timeout=120)

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics as ``{"name{label=value,...}": value}``."""
        out = {}
        for family in text_string_to_metric_families(_http(f"{self.url}/metrics")[1]):
            for s in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}"] = s.value
        return out

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def _http(url: str, body: str | None = None) -> tuple[int, str]:
    """GET (or POST a JSON ``body``) with the standard library: (status, text), errors included."""
    req = urllib.request.Request(url, data=None if body is None else body.encode(),
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _own_segments(pid: int) -> list[str]:
    return [n for n in list_segments() if n.startswith(f"/ringshm-{pid}-")]


def _poll(condition, timeout_s: float = 15.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} not reached within {timeout_s} s"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def main_server(tmp_path_factory):
    server = Server(MAIN_ARGS, tmp_path_factory.mktemp("server") / "main.log")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def local_engine(model_path, main_server):
    """An engine in this process with the server's configuration (it loads while the server loads)."""
    with Engine(model_path, stages=3, max_seq_len=1024, max_rows=8, prefill_chunk=64, progress=False) as eng:
        yield eng


@pytest.fixture(scope="module")
def solo(local_engine) -> dict[str, object]:
    """``Engine.generate``'s greedy answer to each chat prompt, and to the completion prompt."""
    answers = {p: local_engine.generate(p, N_NEW, chat=True) for p in PROMPTS}
    answers[COMPLETION_PROMPT] = local_engine.generate(COMPLETION_PROMPT, N_NEW)
    return answers


@pytest.fixture(scope="module")
def server(main_server, solo) -> Server:
    main_server.wait_healthy()
    return main_server


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.client()


@pytest.fixture(scope="module")
def model_id(client) -> str:
    return client.models.list().data[0].id


def _chat(client, model_id, prompt, **kw):
    kw = {"max_tokens": N_NEW, "temperature": 0, **kw}
    return client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": prompt}], **kw)


def _stream_text(stream) -> tuple[str, str, object]:
    text, finish, usage = [], None, None
    for chunk in stream:
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        usage = chunk.usage or usage
    return "".join(text), finish, usage


# ------------------------------------------------------------------------------------------- main server
def test_models_lists_the_checkpoint_stem_as_the_model_id(client, model_path):
    assert [m.id for m in client.models.list().data] == [Path(model_path).stem]


def test_greedy_chat_completion_equals_engine_generate_of_the_same_prompt(client, model_id, solo):
    prompt = PROMPTS[0]
    out = _chat(client, model_id, prompt)
    want = solo[prompt]
    assert out.choices[0].message.content == want.text
    assert out.choices[0].finish_reason == want.finish_reason
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (want.n_prompt_tokens, want.n_output_tokens)
    assert out.usage.total_tokens == want.n_prompt_tokens + want.n_output_tokens


def test_greedy_text_completion_equals_engine_generate_of_the_same_prompt(client, model_id, solo):
    out = client.completions.create(model=model_id, prompt=COMPLETION_PROMPT, max_tokens=N_NEW, temperature=0)
    assert out.choices[0].text == solo[COMPLETION_PROMPT].text
    assert out.usage.completion_tokens == solo[COMPLETION_PROMPT].n_output_tokens


def test_streamed_chat_reassembles_to_the_same_text_with_usage_on_the_last_chunk(client, model_id, solo):
    prompt = PROMPTS[1]
    text, finish, usage = _stream_text(_chat(client, model_id, prompt, stream=True))
    assert text == solo[prompt].text and finish == solo[prompt].finish_reason
    assert usage.completion_tokens == solo[prompt].n_output_tokens
    chunks = list(_chat(client, model_id, prompt, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == solo[prompt].n_output_tokens


def test_stop_string_ends_the_answer_before_it_with_finish_reason_stop(client, model_id, solo):
    prompt = PROMPTS[2]
    words = solo[prompt].text.split()
    assert len(words) >= 3, solo[prompt].text
    stop = " " + words[2]
    out = _chat(client, model_id, prompt, stop=[stop])
    assert out.choices[0].message.content == solo[prompt].text[: solo[prompt].text.index(stop)]
    assert out.choices[0].finish_reason == "stop"


def _run_clients(server, model_id, prompts, drop: int | None = None) -> dict[int, tuple]:
    """One thread per prompt, all starting at once, each streaming its chat answer; client ``drop`` closes its
    stream after two content chunks. Returns ``{i: (text, finish_reason)}`` or ``{i: exception}``."""
    results: dict[int, object] = {}
    barrier = threading.Barrier(len(prompts))

    def one(i: int, prompt: str) -> None:
        client = server.client()
        try:
            barrier.wait(timeout=30)
            stream = _chat(client, model_id, prompt, stream=True,
                           **({"max_tokens": 400} if i == drop else {}))
            if i == drop:
                n = 0
                for chunk in stream:
                    n += bool(chunk.choices and chunk.choices[0].delta.content)
                    if n == 2:
                        break
                stream.close()
                results[i] = ("dropped", None)
            else:
                results[i] = _stream_text(stream)[:2]
        except BaseException as exc:  # noqa: BLE001 -- reported by the test
            results[i] = exc
        finally:
            client.close()

    threads = [threading.Thread(target=one, args=(i, p)) for i, p in enumerate(prompts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    return results


def _batched_steps(metrics: dict[str, float], more_than: int, family: str = "step_running_requests") -> float:
    """Replies the dispatcher took while more than ``more_than`` requests held a KV row (``family``
    "step_segments": to step ops that carried more than ``more_than`` segments)."""
    count = metrics[f"ringshm_{family}_count{{}}"]
    return count - metrics[f"ringshm_{family}_bucket{{le={float(more_than)}}}"]


def test_eight_concurrent_streaming_clients_each_get_their_solo_answer_and_run_batched(server, model_id, solo):
    before = server.metrics()
    results = _run_clients(server, model_id, PROMPTS)
    for i, prompt in enumerate(PROMPTS):
        assert results[i] == (solo[prompt].text, solo[prompt].finish_reason), (i, results[i])
    after = server.metrics()
    assert _batched_steps(after, 4) - _batched_steps(before, 4) > 0, "no reply ever had more than 4 rows running"
    assert _batched_steps(after, 1, "step_segments") - _batched_steps(before, 1, "step_segments") > 0, \
        "no step op carried more than one request's segment"
    assert after["ringshm_generation_tokens_total{}"] - before["ringshm_generation_tokens_total{}"] == sum(
        solo[p].n_output_tokens for p in PROMPTS)


def test_a_client_dropping_mid_stream_leaves_its_seven_batch_mates_intact(server, model_id, solo):
    before = server.metrics()
    results = _run_clients(server, model_id, PROMPTS, drop=3)
    assert results[3] == ("dropped", None), results[3]
    for i, prompt in enumerate(PROMPTS):
        if i != 3:
            assert results[i] == (solo[prompt].text, solo[prompt].finish_reason), (i, results[i])
    key = "ringshm_request_finished_total{finish_reason=cancelled}"
    _poll(lambda: server.metrics().get(key, 0) - before.get(key, 0) == 1, what="the dropped request cancelled")
    # The dropped request asked for 400 tokens: its row is free long before they could have been generated.
    _poll(lambda: server.metrics()["ringshm_requests_running{}"] == 0, what="every KV row free")


SYSTEM = ("You answer questions about the Brackenridge lighthouse museum. It opens at nine and closes at five; "
          "the lamp room is closed from November to March; tickets cost four pounds, children go free. Be brief.")


def _with_system(client, model_id, question: str, **kw):
    return client.chat.completions.create(
        model=model_id, messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        max_tokens=N_NEW, temperature=0, logprobs=True, top_logprobs=2, **kw)


def _answer_bits(out) -> tuple:
    c = out.choices[0]
    return c.message.content, [(t.token, t.logprob, [(x.token, x.logprob) for x in t.top_logprobs])
                               for t in c.logprobs.content]


def test_a_shared_system_prompt_hits_the_prefix_cache_and_changes_no_byte(server, client, model_id):
    before = server.metrics()
    first = _with_system(client, model_id, "When does it open?")
    assert first.usage.prompt_tokens_details.cached_tokens == 0  # nobody sent this system prompt before
    hit = _with_system(client, model_id, "Can I see the lamp room in January?")
    cached = hit.usage.prompt_tokens_details.cached_tokens
    assert 32 <= cached < hit.usage.prompt_tokens and cached % 32 == 0, cached  # whole blocks of the system prompt
    # The same request under another tenant's salt shares nothing, computes the whole prompt, gives the same bits.
    other = _with_system(client, model_id, "Can I see the lamp room in January?", extra_body={"cache_salt": "b"})
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    assert _answer_bits(other) == _answer_bits(hit)
    after = server.metrics()
    hits = after["ringshm_prefix_cache_hits_total{}"] - before["ringshm_prefix_cache_hits_total{}"]
    queries = after["ringshm_prefix_cache_queries_total{}"] - before["ringshm_prefix_cache_queries_total{}"]
    assert hits == cached and queries == first.usage.prompt_tokens + 2 * hit.usage.prompt_tokens
    blocks = {k: v for k, v in after.items() if k.startswith("ringshm_kv_blocks{")}
    assert set(blocks) == {f"ringshm_kv_blocks{{state={s}}}" for s in ("cached", "free", "used")}
    assert blocks["ringshm_kv_blocks{state=cached}"] > 0 and after["ringshm_preemptions_total{}"] == 0
    busy = {k: v - before[k] for k, v in after.items() if k.startswith("ringshm_stage_busy_seconds_total{")}
    assert sorted(busy) == [f"ringshm_stage_busy_seconds_total{{stage={i}}}" for i in range(3)]
    assert all(0 < v < 60 for v in busy.values()), busy  # every stage applied these requests' ops


@pytest.mark.parametrize("salt", ["", 7, ["a"]])
def test_a_cache_salt_that_is_not_a_nonempty_string_is_a_400_naming_it(server, salt):
    body = json.dumps({"messages": [{"role": "user", "content": "Hi"}], "cache_salt": salt})
    code, text = _http(f"{server.url}/v1/chat/completions", body)
    assert code == 400 and json.loads(text)["error"]["param"] == "cache_salt", text


@pytest.mark.parametrize("case, status, param", [
    ("malformed_json", 400, None),
    ("wrong_field_type", 400, "temperature"),
    ("missing_messages", 400, "messages"),
    ("n_above_16", 400, "n"),
    ("over_the_context", 400, "max_tokens"),
    ("unknown_model", 404, "model"),
])
def test_bad_request_gets_its_status_and_an_openai_error_body(server, model_id, case, status, param):
    url = f"{server.url}/v1/chat/completions"
    msgs = [{"role": "user", "content": "Hi"}]
    body = {"malformed_json": '{"model": "x", "messages": [',
            "wrong_field_type": json.dumps({"messages": msgs, "temperature": "hot"}),
            "missing_messages": json.dumps({"model": model_id}),
            "n_above_16": json.dumps({"messages": msgs, "n": 17}),
            "over_the_context": json.dumps({"messages": msgs, "max_tokens": 1024}),
            "unknown_model": json.dumps({"model": "gpt-4", "messages": msgs})}[case]
    code, text = _http(url, body)
    assert code == status, text
    err = json.loads(text)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param
    assert "Traceback" not in text
    if case == "over_the_context":
        assert "1024" in err["message"] and "in the prompt" in err["message"]


def test_over_context_request_raises_bad_request_in_the_openai_client_with_the_limits(client, model_id):
    with pytest.raises(openai.BadRequestError, match="maximum context length is 1024 tokens"):
        _chat(client, model_id, "Hi", max_tokens=1020)


def test_health_is_200_and_lists_every_live_stage(server):
    code, text = _http(f"{server.url}/health")
    assert code == 200
    stages = json.loads(text)["stages"]
    assert [s["stage"] for s in stages] == [0, 1, 2] and all(s["alive"] for s in stages)
    assert all(s["node"] == 0 and s["seen"] == "process" and s["pid"] > 0 for s in stages)


def test_the_server_says_where_it_serves_once_the_stages_are_up(server, model_id):
    # uvicorn names no address for a socket it is handed: a new user saw no line saying the server was ready
    assert f"ringshm: serving {model_id} at {server.url}/v1 (Ctrl-C stops)" in server.log()


def test_async_engine_tasks_get_solo_answers_and_a_cancelled_task_cancels_only_its_request(local_engine, solo):
    async def main():
        aengine = AsyncEngine(local_engine, max_waiting=4)
        try:
            async def first_chunk_then_wait(prompt):
                async for _ in aengine.stream(prompt, 400, chat=True):
                    started.set()
            started = asyncio.Event()
            victim = asyncio.create_task(first_chunk_then_wait(PROMPTS[7]))
            await started.wait()
            others = [asyncio.create_task(aengine.complete(p, N_NEW, chat=True)) for p in PROMPTS[:4]]
            await asyncio.sleep(0)
            victim.cancel()
            results = await asyncio.gather(*others)
            with pytest.raises(asyncio.CancelledError):
                await victim
            with pytest.raises(ValueError, match="exceeds max_seq_len"):
                aengine.stream("Hi", 2000, chat=True)
            deadline = time.monotonic() + 10  # the victim asked for 400 tokens: its row frees only if cancelled
            while (aengine.n_running, aengine.n_waiting) != (0, 0) and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            return results, aengine.n_running, aengine.n_waiting
        finally:
            await aengine.aclose()

    results, running, waiting = asyncio.run(main())
    assert [r.text for r in results] == [solo[p].text for p in PROMPTS[:4]]
    assert (running, waiting) == (0, 0)


# ---------------------------------------------------------------------------- small server: 429 and 503
@pytest.fixture(scope="module")
def small_server(tmp_path_factory):
    server = Server(["--stages", "2", "--max-seq-len", "512", "--max-rows", "1", "--max-waiting", "1",
                     "--prefill-chunk", "256", "--op-timeout", str(SMALL_OP_TIMEOUT_S)],
                    tmp_path_factory.mktemp("server") / "small.log")
    server.wait_healthy()
    yield server
    server.stop()


def test_a_request_beyond_max_rows_plus_max_waiting_gets_429(small_server):
    client = small_server.client()
    model = client.models.list().data[0].id
    running = _chat(client, model, "Tell me a story.", stream=True, max_tokens=150)
    next(iter(running))
    # A streaming request's headers come with its first token (so a queue timeout is a real 503): the
    # waiting one blocks in create() until it gets a row, hence its own thread.
    waiting: list = []
    waiter = threading.Thread(target=lambda: waiting.append(
        _chat(client, model, "Tell me a joke.", stream=True, max_tokens=150)))
    waiter.start()
    _poll(lambda: small_server.metrics()["ringshm_requests_waiting{}"] == 1, what="one request waiting")
    with pytest.raises(openai.RateLimitError) as info:
        _chat(client, model, "Hi")
    assert info.value.status_code == 429 and info.value.body["code"] == "queue_full"
    assert info.value.response.headers["retry-after"] == "1"
    running.close()
    waiter.join(timeout=60)
    waiting[0].close()
    _poll(lambda: small_server.metrics()["ringshm_requests_running{}"] == 0
          and small_server.metrics()["ringshm_requests_waiting{}"] == 0, what="both requests cancelled")


def test_requests_after_idling_past_op_timeout_are_answered_one_after_another_and_at_once(small_server):
    """Issue 19: a server idle longer than --op-timeout answered its next requests with 503 stage_stalled."""
    client = small_server.client()
    model = client.models.list().data[0].id
    # Prompts of ~170 tokens, one prefill chunk: an op takes longer than the dispatcher's step wait, so the
    # stall watch looks at the stages while they work. The first request ends on its last prefill chunk
    # (max_tokens 1, as a scoring harness sends): the watch last saw stage 0 done and stage 1 busy.
    prompts = [f"{word} " * 150 + "Summarise." for word in ("alpha", "beta", "gamma", "delta", "omega", "sigma")]
    assert _chat(client, model, prompts[0], max_tokens=1).choices[0].finish_reason in ("length", "stop")
    time.sleep(SMALL_OP_TIMEOUT_S + 1)  # idle
    for prompt in prompts[1:4]:
        assert _chat(client, model, prompt, max_tokens=4).choices[0].finish_reason in ("length", "stop")
    time.sleep(SMALL_OP_TIMEOUT_S + 1)
    with ThreadPoolExecutor(2) as pool:  # max_rows 1 + max_waiting 1
        done = list(pool.map(lambda p: _chat(client, model, p, max_tokens=4), prompts[4:]))
    assert all(c.choices[0].finish_reason in ("length", "stop") for c in done)


def test_a_stopped_stage_is_reported_after_op_timeout_then_the_server_recovers(small_server):
    client = small_server.client()
    model = client.models.list().data[0].id
    pid = json.loads(_http(f"{small_server.url}/health")[1])["stages"][1]["pid"]
    time.sleep(SMALL_OP_TIMEOUT_S + 1)  # idle first: the stall clock runs only while a stage holds work
    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with pytest.raises(openai.InternalServerError) as info:
            _chat(client, model, "Hi")
        held_s = time.monotonic() - t0
        assert info.value.status_code == 503 and "stage 1" in str(info.value)
        assert SMALL_OP_TIMEOUT_S <= held_s < SMALL_OP_TIMEOUT_S + 2, held_s  # op_timeout_s + about a step
        code, text = _http(f"{small_server.url}/health")
        assert code == 503 and json.loads(text)["stalled_stage"] == 1, text
    finally:
        os.kill(pid, signal.SIGCONT)
    _poll(lambda: _http(f"{small_server.url}/health")[0] == 200, what="health back to 200")
    assert _chat(client, model, "Hi", max_tokens=2).choices[0].finish_reason in ("length", "stop")


def test_a_dead_stage_fails_the_open_stream_with_503_then_the_server_exits_3_leaving_nothing(small_server):
    client = small_server.client()
    model = client.models.list().data[0].id
    stream = iter(_chat(client, model, "Tell me a story.", stream=True, max_tokens=150))
    next(stream)
    stages = [s["pid"] for s in json.loads(_http(f"{small_server.url}/health")[1])["stages"]]
    os.kill(stages[1], signal.SIGKILL)
    with pytest.raises(openai.APIError, match="stage 1"):
        for _ in stream:
            pass
    assert small_server.proc.wait(timeout=60) == 3, small_server.log()
    assert "stage 1" in small_server.log()
    assert _own_segments(small_server.pid) == []
    _poll(lambda: all(process_start_time(p) is None for p in stages), what="every stage process gone")


# ------------------------------------------------------------------------------------------ last: SIGTERM
def test_sigterm_finishes_the_open_stream_then_exits_0_leaving_no_process_or_segment(server, model_id, solo):
    stage_pids = [s["pid"] for s in json.loads(_http(f"{server.url}/health")[1])["stages"]]
    assert len(_own_segments(server.pid)) == 4  # 3 stages: 4 rings
    stream = iter(_chat(server.client(), model_id, PROMPTS[0], stream=True))
    first = next(stream)
    server.proc.send_signal(signal.SIGTERM)
    text, finish, _ = _stream_text(stream)
    assert (first.choices[0].delta.content or "") + text == solo[PROMPTS[0]].text
    assert server.proc.wait(timeout=60) == 0, server.log()
    assert _own_segments(server.pid) == []
    _poll(lambda: all(process_start_time(p) is None for p in stage_pids), what="every stage process gone")
