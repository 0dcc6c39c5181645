"""A closed-loop serving load (the shape of ``vllm bench serve`` / GuideLLM's "concurrent" mode) for
bench_server.py: N clients, each sending its next request the moment its last one ends, for a fixed time.

Requests come from a fixed, seeded mix (``workload``), the same for every target and every run:

- **chat** (60 %): a short question (~30 prompt tokens with the chat template), 32-128 output tokens;
- **rag** (25 %): a shared ~1k-token system document (the same for every client: a prefix cache's case) and a
  short question, 32-64 output tokens;
- **long** (15 %): a short request for a long answer, 256-384 output tokens.

Every request is greedy with ``ignore_eos`` (its output length is the drawn one, whatever the model says), so two
targets get exactly the same work. Client ``i`` draws from its own generator (seed, i): its k-th request is the
same on every target.

Measured at the client, inside a window that starts ``warmup_s`` after the first request and lasts ``measure_s``
(requests still open at its end are cancelled; their tokens inside the window count):

- output tok/s: tokens that arrived in the window / window seconds. A streamed HTTP chunk counts the tokens its
  request's ``usage`` reports spread evenly over its chunks (1 per chunk for a request cut off at the end);
  ``AsyncEngine`` chunks are one token each;
- request throughput: requests that ended in the window / window seconds;
- TTFT (request sent to its first token) of requests sent in the window, and ITL (gaps between a stream's
  consecutive chunks) inside the window, p50 / p99.

Nothing here asserts on time: these are figures.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

from conftest import percentile

SEED = 20261204
CHAT_TOPICS = ["a lighthouse keeper", "a robot learning to paint", "the first city on Mars", "a talking cat",
               "a lost library", "a river that flows uphill", "a clockmaker's apprentice", "a winter festival",
               "the tides", "a bakery at dawn", "an old map", "a chess tournament"]
_WORDS = ("archive ledger harbour engine orchard valley council river signal bridge lantern market granary "
          "tower merchant voyage winter summer copper silver forest meadow station letter record journal "
          "treaty festival workshop garden canal mill quarry beacon").split()


def rag_document(n_sentences: int = 45, seed: int = SEED) -> str:
    """The rag requests' shared system document: seeded sentences, ~23 tokens each with SmolLM2's tokenizer
    (45: ~1k tokens)."""
    rng = random.Random(seed)
    lines = []
    for i in range(n_sentences):
        words = [rng.choice(_WORDS) for _ in range(10)]
        lines.append(f"Record {i + 1}: the {words[0]} near the {words[1]} kept its {words[2]} and "
                     f"{words[3]} until the {words[4]} of the {words[5]}.")
    return "You answer questions about these records.\n" + "\n".join(lines)


@dataclass
class LoadRequest:
    """One request of the mix: its kind, its chat messages and its exact output length."""

    kind: str
    messages: list[dict]
    max_tokens: int


def workload(client: int, seed: int = SEED):
    """Client ``client``'s endless request sequence (a generator of ``LoadRequest``), fixed by (seed, client)."""
    rng = random.Random(f"{seed}-{client}")
    doc = rag_document()
    while True:
        r = rng.random()
        topic = rng.choice(CHAT_TOPICS)
        if r < 0.60:
            yield LoadRequest("chat", [{"role": "user", "content": f"Tell me something about {topic}."}],
                              rng.randint(32, 128))
        elif r < 0.85:
            n = rng.randint(1, 45)
            yield LoadRequest("rag", [{"role": "system", "content": doc},
                                      {"role": "user", "content": f"What did record {n} keep?"}],
                              rng.randint(32, 64))
        else:
            yield LoadRequest("long", [{"role": "user", "content": f"Write a long story about {topic}."}],
                              rng.randint(256, 384))


@dataclass
class Record:
    """What one request saw at the client (perf_counter seconds)."""

    kind: str
    t_sent: float
    chunks: list[float] = field(default_factory=list)  # arrival of each chunk that carried tokens
    tokens: int | None = None  # the request's completion tokens when it ended (None: cut off at the window's end)
    t_end: float | None = None
    prompt_tokens: int | None = None


def summarise(records: list[Record], t0: float, t1: float) -> dict:
    """The window ``[t0, t1)``'s figures (module docstring) from every client's records."""
    span = t1 - t0
    tokens = 0.0
    itl: list[float] = []
    for r in records:
        per = r.tokens / len(r.chunks) if r.tokens and r.chunks else 1.0
        tokens += per * sum(1 for t in r.chunks if t0 <= t < t1)
        itl += [b - a for a, b in zip(r.chunks, r.chunks[1:]) if t0 <= b < t1]
    ttft = [r.chunks[0] - r.t_sent for r in records if t0 <= r.t_sent < t1 and r.chunks]
    done = [r for r in records if r.t_end is not None and t0 <= r.t_end < t1]
    return {"window_s": span, "output_tok_s": tokens / span, "requests_s": len(done) / span,
            "requests_done": len(done), "ttft_p50_s": percentile(ttft, 0.5), "ttft_p99_s": percentile(ttft, 0.99),
            "ttft_max_s": max(ttft, default=float("nan")),
            "itl_p50_s": percentile(itl, 0.5), "itl_p99_s": percentile(itl, 0.99), "itl_n": len(itl)}


async def _closed_loop(send, busy_s, n_clients: int, warmup_s: float, measure_s: float,
                       extra=None) -> tuple[list, float, list]:
    """Run ``n_clients`` clients, each awaiting ``send(request, record)`` for its requests back to back, until the
    window ends; returns (records, window start, each stage's utilisation in the window: ``await busy_s()``'s
    growth over the window's seconds; empty when the target does not tell). ``extra``: a coroutine function run
    beside them, given the window start (e.g. one long prompt sent mid-window)."""
    records: list[Record] = []
    t_start = time.perf_counter()
    w0 = t_start + warmup_s
    w1 = w0 + measure_s

    async def client(i: int):
        for req in workload(i):
            if time.perf_counter() >= w1:
                return
            rec = Record(req.kind, time.perf_counter())
            records.append(rec)
            await send(req, rec)

    tasks = [asyncio.create_task(client(i)) for i in range(n_clients)]
    if extra is not None:
        tasks.append(asyncio.create_task(extra(w0)))
    await asyncio.sleep(max(0.0, w0 - time.perf_counter()))
    busy0 = await busy_s()
    await asyncio.sleep(max(0.0, w1 - time.perf_counter()))
    busy1 = await busy_s()
    for t in tasks:
        t.cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException) and not isinstance(r, asyncio.CancelledError)]
    if errors:
        raise errors[0]
    return records, w0, [(b - a) / measure_s for a, b in zip(busy0, busy1)]


class HttpTarget:
    """Requests over an OpenAI-compatible streaming chat endpoint: aiohttp, one connection pool per level (the
    client ``vllm bench serve`` uses: at 16 clients it took 2 % of a core where httpx took 5 %, on cores the server
    shares). Each SSE event is one line."""

    def __init__(self, base_url: str, model: str):
        self.base_url, self.model, self.session = base_url, model, None

    async def open(self, n_clients: int) -> None:
        import aiohttp

        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600),
                                             connector=aiohttp.TCPConnector(limit=n_clients + 4))

    async def close(self) -> None:
        await self.session.close()

    async def stage_busy_s(self) -> list[float]:
        """ringshm's ``ringshm_stage_busy_seconds`` per stage from ``/metrics`` (empty for another server)."""
        from prometheus_client.parser import text_string_to_metric_families

        async with self.session.get(self.base_url.removesuffix("/v1") + "/metrics") as resp:
            if resp.status != 200:
                return []
            text = await resp.text()
        busy = {s.labels["stage"]: s.value for f in text_string_to_metric_families(text)
                if f.name == "ringshm_stage_busy_seconds" for s in f.samples}
        return [busy[k] for k in sorted(busy, key=int)]

    async def send(self, req: LoadRequest, rec: Record) -> None:
        body = {"model": self.model, "messages": req.messages, "max_tokens": req.max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        async with self.session.post(self.base_url + "/chat/completions", json=body) as resp:
            if resp.status != 200:
                raise RuntimeError(f"{resp.status}: {(await resp.read())[:300]!r}")
            async for line in resp.content:
                if not line.startswith(b"data: {"):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0].get("delta", {}).get("content"):
                    rec.chunks.append(time.perf_counter())
                if chunk.get("usage"):
                    rec.tokens = chunk["usage"]["completion_tokens"]
                    rec.prompt_tokens = chunk["usage"]["prompt_tokens"]
        rec.t_end = time.perf_counter()


class EngineTarget:
    """Requests through an in-process ``AsyncEngine`` (the prompt is the chat template's ids, as the server makes
    them, tokenised once per distinct prompt outside the window's clock; each chunk is one token)."""

    def __init__(self, aengine, tokenizer):
        self.aengine, self.tokenizer, self._ids = aengine, tokenizer, {}

    async def open(self, n_clients: int) -> None:
        pass

    async def close(self) -> None:
        pass

    async def stage_busy_s(self) -> list[float]:
        return self.aengine.engine.stage_busy_s()

    async def send(self, req: LoadRequest, rec: Record) -> None:
        from ringshm.model.tokenizer import encode_chat

        key = json.dumps(req.messages)
        ids = self._ids.get(key)
        if ids is None:
            ids = self._ids[key] = encode_chat(self.tokenizer, req.messages)
        rec.prompt_tokens = len(ids)
        async with self.aengine.stream(ids, req.max_tokens, temperature=0, ignore_eos=True) as chunks:
            async for _ in chunks:
                rec.chunks.append(time.perf_counter())
        rec.tokens = len(rec.chunks)
        rec.t_end = time.perf_counter()


def run_level(target, n_clients: int, warmup_s: float, measure_s: float, extra=None) -> tuple[dict, list[Record]]:
    """One closed-loop level of ``target`` (``HttpTarget`` / ``EngineTarget``) on a fresh event loop: (its
    ``summarise`` figures plus ``stage_util``, each stage's busy fraction of the window; its records)."""

    async def level():
        await target.open(n_clients)
        try:
            return await _closed_loop(target.send, target.stage_busy_s, n_clients, warmup_s, measure_s, extra)
        finally:
            await target.close()

    records, w0, util = asyncio.run(level())
    return {**summarise(records, w0, w0 + measure_s), "stage_util": util}, records
