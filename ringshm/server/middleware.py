"""The HTTP server's Prometheus metrics and its two ASGI middlewares: responses counted by endpoint and status,
and the request-body cap (413 in OpenAI's error shape). ``ringshm.server.app`` wires them into its app."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from fastapi import HTTPException
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ringshm.engine.async_engine import AsyncEngine
from ringshm.engine.request_stream import Chunk

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics", "/tokenize",
             "/detokenize", "/version")
MODEL_PREFIX = "/v1/models/"  # one model's card: counted as "/v1/models/{model}", never by the name asked for


def endpoint_label(path: str) -> str:
    """The ``endpoint`` label a request to ``path`` is counted under: its route, or "other" (a 404, a probe)
    so that the label's values stay few whatever clients send."""
    if path in ENDPOINTS:
        return path
    if path.startswith(MODEL_PREFIX) and len(path) > len(MODEL_PREFIX):
        return MODEL_PREFIX + "{model}"
    return "other"


class Metrics:
    """The server's Prometheus metrics, in their own registry (several apps may live in one process)."""

    def __init__(self, aengine: AsyncEngine, spec: bool):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("ringshm_requests", "HTTP requests by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.finished = Counter("ringshm_request_finished", "Generation requests that ended, by finish reason",
                                ["finish_reason"], registry=r)
        self.ttft = Histogram("ringshm_time_to_first_token_seconds", "Request arrival to first token", registry=r,
                              buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80))
        self.itl = Histogram("ringshm_inter_token_latency_seconds", "Time between consecutive tokens of a "
                             "request", registry=r, buckets=(0.01, 0.025, 0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2))
        self.prompt_tokens = Counter("ringshm_prompt_tokens", "Prompt tokens of accepted requests", registry=r)
        self.generation_tokens = Counter("ringshm_generation_tokens", "Tokens generated", registry=r)
        self.logprob_requests = Counter("ringshm_logprob_requests", "Accepted requests that asked for logprobs "
                                        "(of generated or prompt tokens)", registry=r)
        self.prompt_logprob_tokens = Counter("ringshm_prompt_logprob_tokens", "Prompt tokens scored for prompt "
                                             "logprobs (echo with logprobs)", registry=r)
        self.structured_requests = Counter("ringshm_structured_requests", "Accepted requests with a structured "
                                           "output (JSON schema / object, regex, choice, grammar)", registry=r)
        self.grammar_compile = Histogram("ringshm_grammar_compile_seconds", "Compile time of each structured output "
                                         "not in the cache (the tokenizer's tables included on first use)",
                                         registry=r, buckets=(1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1, 3))
        stats = getattr(aengine.engine, "grammar_stats", None)  # a test's fake engine may have none
        for name, key, what in (("ringshm_grammar_cache_hits", "cache_hits", "Structured outputs whose grammar "
                                 "came from the compile cache (since start)"),
                                ("ringshm_grammar_masks", "masks", "Allowed-token masks computed (since start)"),
                                ("ringshm_grammar_mask_seconds", "mask_s", "Seconds spent computing allowed-token "
                                 "masks (since start)")):
            Gauge(name, what, registry=r).set_function(
                lambda key=key: aengine.engine.grammar_stats[key] if stats is not None else 0)
        self.step_running = Histogram("ringshm_step_running_requests", "Requests holding a row at each reply "
                                      "the dispatcher takes (continuous batching)", registry=r,
                                      buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32, 64))
        self.step_segments = Histogram("ringshm_step_segments", "Segments (requests) carried by each step op the "
                                       "dispatcher takes a reply to", registry=r,
                                       buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32, 64))
        Gauge("ringshm_requests_running", "Requests holding a row", registry=r).set_function(
            lambda: aengine.n_running)
        Gauge("ringshm_requests_waiting", "Requests waiting for a row and its KV blocks", registry=r).set_function(
            lambda: aengine.n_waiting)
        self.spec = spec
        if spec:
            self.draft_tokens = Counter("ringshm_spec_draft_tokens", "Draft tokens sent for verification",
                                        registry=r)
            self.accepted_tokens = Counter("ringshm_spec_accepted_tokens", "Draft tokens accepted", registry=r)
        r.register(_EngineCollector(aengine))
        aengine.on_step = self.on_step

    def on_step(self, n_running: int, n_segments: int) -> None:
        self.step_running.observe(n_running)
        self.step_segments.observe(n_segments)

    def on_chunk(self, chunk: Chunk, previous_s: float | None, generated: bool = True) -> None:
        """One stream's token: ITL, TTFT, speculation counters, and a generated token unless ``generated`` is
        False (``max_tokens`` 0 computes one token it does not return). Finish reasons are counted per choice
        by the response (``ringshm.server.openai_responses``)."""
        if previous_s is not None:
            self.itl.observe(chunk.time_s - previous_s)
        if generated:
            self.generation_tokens.inc()
        if chunk.result is not None:
            self.ttft.observe(chunk.result.ttft_s)
            if self.spec:
                self.draft_tokens.inc(chunk.result.draft_tokens)
                self.accepted_tokens.inc(chunk.result.accepted_tokens)


class _EngineCollector:
    """The engine's state as Prometheus metrics at each scrape: the KV pool and prefix cache, read from its
    ``KVBlocks`` (vLLM's ``prefix_cache_queries`` / ``prefix_cache_hits``, in tokens; ``num_preemptions``), and
    each stage's busy seconds (``Engine.stage_busy_s``)."""

    def __init__(self, aengine: AsyncEngine):
        self.aengine = aengine

    def collect(self):
        kv = self.aengine.engine.kv.stats()
        yield CounterMetricFamily("ringshm_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                  value=kv.query_tokens)
        yield CounterMetricFamily("ringshm_prefix_cache_hits", "Prompt tokens whose KV came from the prefix cache "
                                  "(their prefill skipped)", value=kv.hit_tokens)
        yield CounterMetricFamily("ringshm_kv_cache_evictions", "Cached KV blocks evicted to serve an allocation",
                                  value=kv.evictions)
        yield CounterMetricFamily("ringshm_preemptions", "Streams preempted for want of KV blocks (recomputed on "
                                  "resume, exactly)", value=self.aengine.step_stats.preemptions)
        blocks = GaugeMetricFamily("ringshm_kv_blocks", "KV blocks by state: used (named by a live stream), cached "
                                   "(unnamed prefix-cache blocks, evictable), free", labels=["state"])
        for state, n in (("used", kv.n_used), ("cached", kv.n_cached), ("free", kv.n_free)):
            blocks.add_metric([state], n)
        yield blocks
        busy_s = getattr(self.aengine.engine, "stage_busy_s", None)
        if busy_s is not None:
            busy = CounterMetricFamily("ringshm_stage_busy_seconds", "Wall seconds each of this host's stages spent "
                                       "applying ops (its utilisation: the rate of this counter)", labels=["stage"])
            for i, s in enumerate(busy_s()):
                busy.add_metric([str(i)], s)
            yield busy


class CountRequests:
    """ASGI middleware counting responses by endpoint and status (streaming-safe, unlike BaseHTTPMiddleware)."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        endpoint = endpoint_label(scope.get("path", ""))

        async def counting_send(message):
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(endpoint, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)


class BodyLimit:
    """ASGI middleware: a request body over ``max_bytes`` gets the 413 of ``error()`` (OpenAI's shape). A
    declared ``Content-Length`` over it is refused unread; a chunked body is counted as it arrives and cut as
    soon as it passes the cap (an HTTPException the app's handler answers), so it is never held whole; the
    rest is read and dropped (at most ``DRAIN_BYTES`` within ``DRAIN_S``) so that the client gets the 413,
    not a connection reset.
    (FastAPI's own ``max_body_size`` answers a declared length with plain text, hence this.)"""

    DRAIN_BYTES = 8 * 2**20  # what is read and dropped past the cap before answering, at most
    DRAIN_S = 2.0

    def __init__(self, app, max_bytes: int, error: Callable[[], JSONResponse]):
        self.app, self.max_bytes, self.error = app, max_bytes, error

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or ()).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            return await self.error()(scope, receive, send)
        seen = 0

        async def drain(message) -> None:
            """Read (and drop) the rest of the body, up to DRAIN_BYTES: a socket closed with unread data in it
            sends the client a reset, which can beat the 413 to the client."""
            budget = self.DRAIN_BYTES
            while message.get("more_body") and budget > 0:
                message = await receive()
                budget -= len(message.get("body", b""))

        async def counted():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    try:
                        await asyncio.wait_for(drain(message), self.DRAIN_S)
                    except asyncio.TimeoutError:
                        pass
                    raise HTTPException(413, "request body too large")
            return message

        await self.app(scope, counted, send)
