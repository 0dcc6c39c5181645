"""One request's side of ``AsyncEngine``: the chunks it yields (``Chunk``), the async iterator a caller holds
(``RequestStream``) and the state the dispatcher keeps for it (``Request``).

A request's chunks travel from the dispatcher thread to the event loop that made the request, through that
request's own ``asyncio.Queue`` (``loop.call_soon_threadsafe``); an exception in the queue ends the stream
with it. Leaving a stream early posts a "cancel" to the dispatcher's inbox, which ends that request only.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ringshm.engine.coordinator import Stream
from ringshm.engine.results import GenerationResult
from ringshm.errors import (
    EngineClosed,
    InvalidParameter,
    QueueTimeout,
    RequestFailed,
    RingshmError,
    StageDied,
    StageStalled,
)

if TYPE_CHECKING:
    from ringshm.engine.async_engine import AsyncEngine


@dataclass
class Chunk:
    """One committed token of a request: its id and the text it adds (may be empty while held back).

    The last chunk of a request also carries ``finish_reason`` ("stop" or "length") and ``result`` (the
    request's ``GenerationResult``: token ids, text, TTFT, TPOT, speculation counters). ``time_s`` is
    ``time.perf_counter()`` when the dispatcher committed the token. ``logprob``: the token's
    ``TokenLogprob`` when the request asked for ``logprobs``; ``prompt_logprobs``, on the first chunk of a
    request that asked for them: None for the first prompt token, then one ``TokenLogprob`` per prompt token.
    """

    token_id: int
    text: str
    time_s: float
    finish_reason: str | None = None
    result: GenerationResult | None = None
    logprob: object = None
    prompt_logprobs: list | None = None

    @property
    def usage(self) -> dict | None:
        """OpenAI-style token counts, on the last chunk only."""
        if self.result is None:
            return None
        r = self.result
        return {"prompt_tokens": r.n_prompt_tokens, "completion_tokens": r.n_output_tokens,
                "total_tokens": r.n_prompt_tokens + r.n_output_tokens}


@dataclass(eq=False)
class Request:
    id: int
    stream: Stream
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    t_submit: float = field(default_factory=time.monotonic)
    started: bool = False  # its first chunk went out


def put_all(posts: list[tuple[asyncio.Queue, list]]) -> None:
    """On a request's event loop: put each ``(queue, items)`` post's items on its queue, in order."""
    for q, items in posts:
        for item in items:
            q.put_nowait(item)


def copy_error(exc: BaseException) -> BaseException:
    """A fresh exception per request (one instance raised in many tasks would share a traceback)."""
    if isinstance(exc, StageDied):
        return StageDied(str(exc), exc.stage, exc.exitcode)
    if isinstance(exc, EngineClosed):  # DispatcherFailed too
        return type(exc)(str(exc))
    if isinstance(exc, StageStalled):
        return StageStalled(str(exc), exc.stage)
    if isinstance(exc, QueueTimeout):
        return QueueTimeout(str(exc))
    if isinstance(exc, InvalidParameter):  # the request's own input (a grammar that cannot go on): 400, not 500
        return InvalidParameter(str(exc), exc.param)
    what = str(exc) if isinstance(exc, RingshmError) else f"{type(exc).__name__}: {exc}"
    err = RequestFailed(f"request failed: {what}")
    err.__cause__ = exc
    return err


class RequestStream:
    """The chunks of one request, as an async iterator (``AsyncEngine.stream`` returns one).

    Leaving it early — ``break``, ``aclose()``, ``async with`` exit, cancelling the task that awaits it, or
    dropping it — cancels this request only. Raises, from ``__anext__``: ``StageDied``, ``RequestFailed``,
    ``EngineClosed``.
    """

    def __init__(self, engine: "AsyncEngine", req: Request):
        self._engine, self._req = engine, req
        self._finished = False

    @property
    def prompt_ids(self) -> list[int]:
        """The request's prompt as token ids."""
        return self._req.stream.prompt

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> Chunk:
        if self._finished:
            raise StopAsyncIteration
        try:
            item = await self._req.queue.get()
        except BaseException:  # the consuming task was cancelled
            self.cancel()
            raise
        if isinstance(item, BaseException):
            self._finished = True
            raise item
        if item.finish_reason is not None:
            self._finished = True
        return item

    def cancel(self) -> None:
        """Cancel the request (no-op once it finished). Safe from any thread and from ``__del__``."""
        if not self._finished:
            self._finished = True
            self._engine._inbox.put(("cancel", self._req))

    async def aclose(self) -> None:
        self.cancel()

    async def __aenter__(self) -> "RequestStream":
        return self

    async def __aexit__(self, *exc) -> None:
        self.cancel()

    def __del__(self) -> None:
        try:
            self.cancel()
        except Exception:  # interpreter shutdown
            pass
