"""``AsyncEngine``: an asyncio API over one ``Engine``, with a dispatcher thread that owns the ring.

    task ─stream()─▶ validate (GenerationParams, Engine._make_stream) ─▶ inbox ─▶ dispatcher thread
    task ◀─ asyncio.Queue ◀─ loop.call_soon_threadsafe ◀─ Chunks ◀─ Scheduler.step() ◀─ ring

The ring calls block, so one background thread owns the ring exclusively and runs one ``Scheduler``
(``ringshm.engine.scheduler``) for the engine's whole life: between replies it admits submitted requests (they take a
free row and the KV blocks of their prompt, or wait for them: continuous batching up to ``max_rows``) and
applies cancellations; while
something is in flight it takes one reply per ``step``, otherwise it sleeps on the inbox. Every step op
carries every ready request. Each committed token goes to its request's ``asyncio.Queue`` on the loop that
made the request, so any number of tasks (on any number of loops) may call ``stream`` / ``complete`` at once.
Every stream gets exactly the tokens ``Engine.generate`` gives it alone, whatever else runs beside it.

Failures: bad input raises ``ValueError`` in the caller, before anything is queued. A request whose own sampling,
detokenisation or stop handling raises (e.g. NaN logits) fails alone with ``RequestFailed``. More than ``max_rows +
max_waiting`` open requests raise ``QueueFull``; a request that waits longer than ``max_queue_wait_s`` for a
row fails with ``QueueTimeout``. A stage that holds an op past ``op_timeout_s`` fails the open requests with
``StageStalled`` (new ones are refused with it) until it answers again. A dead stage fails every open request with
``StageDied``, and
every later request fails at the call with it. A stage error (or a reply mismatch) fails the open requests
with ``RequestFailed`` and the dispatcher starts a fresh run; the engine stays usable.

While an ``AsyncEngine`` owns an engine, do not call the engine's own request methods; after ``close()`` the
engine is closed too.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable

from ringshm.engine.request_stream import Chunk, Request, RequestStream, copy_error, put_all
from ringshm.engine.results import GenerationResult, result_of
from ringshm.engine.sampling import TextStream
from ringshm.engine.scheduler import Scheduler, StepStats
from ringshm.errors import (
    DispatcherFailed,
    EngineClosed,
    EngineOwned,
    PeerDied,
    QueueFull,
    QueueTimeout,
    RingTimeout,
    StageDied,
    StageStalled,
)
from ringshm.generation_params import GenerationParams

log = logging.getLogger("ringshm.engine.async_engine")
STEP_TIMEOUT_S = 0.05  # the longest the dispatcher waits on the ring before it looks at its inbox again


class AsyncEngine:
    """Serve many concurrent asyncio requests on one ``Engine`` with continuous batching.

    Args:
        engine: a started ``Engine``; the ``AsyncEngine`` owns its ring from now on and closes it.
        max_waiting: requests that may wait for a row and its KV blocks beyond the ``max_rows`` running ones.
        on_step: called from the dispatcher thread after every reply with the number of running requests and
            the number of segments the answered step op carried (a metrics hook; keep it cheap).
        max_queue_wait_s: the longest a request may wait for a row and its KV blocks; then it fails with
        ``QueueTimeout``
            (None: no limit).

    A stage that holds an op longer than the engine's ``op_timeout_s`` (stopped, stuck) is ``stalled``: the
    open requests fail with ``StageStalled`` naming it, new ones are refused with it, and the engine recovers
    by itself when the stage answers again (the stalled ops' replies are taken and dropped).

    Raises:
        ValueError: ``max_waiting < 0`` or ``max_queue_wait_s <= 0``. EngineOwned: another AsyncEngine owns
            ``engine``.
    """

    def __init__(self, engine, max_waiting: int = 64, on_step: Callable[[int, int], None] | None = None,
                 max_queue_wait_s: float | None = None):
        from ringshm.model.tokenizer import load_tokenizer

        if not isinstance(max_waiting, int) or max_waiting < 0:
            raise ValueError(f"max_waiting must be an int >= 0, got {max_waiting!r}")
        if max_queue_wait_s is not None and not max_queue_wait_s > 0:
            raise ValueError(f"max_queue_wait_s must be > 0 or None, got {max_queue_wait_s!r}")
        if getattr(engine, "_owner", None) is not None:
            raise EngineOwned(f"this engine is already owned by an {engine._owner}")
        self.engine = engine
        engine._owner = "AsyncEngine"
        self.max_waiting = max_waiting
        self.max_queue_wait_s = max_queue_wait_s
        self.on_step = on_step
        self._stalled: StageStalled | None = None
        self._progress: list[tuple[int, float]] = []  # per stage: (ops applied, when its stall clock started)
        self._progress_base = 0.0  # the clock base _progress was started from (see _watch_stall)
        engine.tokenizer  # noqa: B018 -- load it here, not on the first request
        # The dispatcher decodes with its own tokenizer instance: the callers' threads encode with the
        # engine's, and one HF tokenizer used from two threads at once can fail ("Already borrowed").
        self._decode_tokenizer = load_tokenizer(engine.model_path)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._n_open = 0  # submitted and not yet finished (caller increments, dispatcher decrements)
        self._n_running = 0  # holding a row (dispatcher writes)
        self._closing = False
        self._dead: StageDied | None = None
        self._broken: DispatcherFailed | None = None  # the dispatcher thread stopped on an error of its own
        self._active: dict[int, Request] = {}  # dispatcher thread only
        self._outbox: dict[asyncio.AbstractEventLoop, list] = {}  # posts not yet sent (dispatcher thread only)
        self._batching = False  # _deliver collects its posts in _outbox and sends them once, per loop
        self.step_stats = StepStats()  # step ops sent over the engine's life (every scheduler run adds to it)
        self._thread = threading.Thread(target=self._dispatch, name="ringshm-dispatcher", daemon=True)
        self._thread.start()

    # --------------------------------------------------------------------------------------- public API
    @property
    def n_running(self) -> int:
        """Requests holding a row."""
        return self._n_running

    @property
    def n_waiting(self) -> int:
        """Requests accepted and waiting for a row and its KV blocks."""
        return max(0, self._n_open - self._n_running)

    @property
    def dead(self) -> StageDied | None:
        """The ``StageDied`` that stopped the dispatcher, if a stage died."""
        return self._dead

    @property
    def stalled(self) -> StageStalled | None:
        """The ``StageStalled`` naming a stage that holds an op past ``op_timeout_s``; None once it answers."""
        return self._stalled

    @property
    def max_seq_len(self) -> int:
        """Positions one request may reach: prompt + output tokens."""
        return self.engine.max_seq_len

    def stream(self, prompt: str | list[int], max_new_tokens: int = 128, **params) -> RequestStream:
        """Start a request; iterate the returned ``RequestStream`` (``async for``) for its ``Chunk``s.

        Call from a coroutine (the chunks arrive on its running loop). Arguments as ``Engine.generate``
        (``prefill_depth`` is the engine's for every request).

        Raises, at the call: ValueError (bad input, prompt + max_new_tokens over max_seq_len), TypeError (an
        unknown parameter), QueueFull, StageDied (a stage is dead), EngineClosed (DispatcherFailed: the
        dispatcher stopped on an error of its own).
        """
        loop = asyncio.get_running_loop()
        if self._closing:
            raise EngineClosed("the engine is shutting down: no new requests")
        p = GenerationParams(max_new_tokens=max_new_tokens, **params)
        s = self.engine._make_stream(0, -1, prompt, p)  # validates; seed applies as is (index 0)
        s.text = TextStream(self._decode_tokenizer, p.stop, p.min_tokens)
        self._check_alive()
        s.index = next(self._ids)
        req = Request(s.index, s, loop)
        with self._lock:  # the check and the put under one lock: no submit can follow close()'s "stop"
            if self._closing:
                raise EngineClosed("the engine is shutting down: no new requests")
            if self._broken is not None:  # under the lock: the failed dispatcher drains the inbox once, after
                raise copy_error(self._broken)
            if self._n_open >= self.engine.config.max_rows + self.max_waiting:
                raise QueueFull(f"{self._n_open} requests open (max_rows {self.engine.config.max_rows} running "
                                f"+ max_waiting {self.max_waiting} waiting): retry later")
            self._n_open += 1
            self._inbox.put(("submit", req))
        return RequestStream(self, req)

    async def complete(self, prompt: str | list[int], max_new_tokens: int = 128, **params) -> GenerationResult:
        """Generate to the end and return the ``GenerationResult``. Raises as ``stream`` and its chunks."""
        last = None
        async with self.stream(prompt, max_new_tokens, **params) as chunks:
            async for last in chunks:
                pass
        return last.result

    def check_stages(self) -> None:
        """Raise ``StageDied`` naming a dead stage, ``StageStalled`` naming a stalled one, or ``DispatcherFailed``
        (the health check)."""
        self._check_alive()

    def close(self, wait_s: float = 0.0) -> None:
        """Stop accepting; let open requests finish for up to ``wait_s``, cancel the rest (they raise
        ``EngineClosed``); join the dispatcher; close the engine (stages reaped, segments unlinked).
        Idempotent."""
        with self._lock:
            self._closing = True
            self._inbox.put(("stop", time.monotonic() + wait_s))
        self._thread.join()
        self.engine.close()

    async def aclose(self, wait_s: float = 0.0) -> None:
        """``close`` without blocking the event loop."""
        await asyncio.to_thread(self.close, wait_s)

    async def __aenter__(self) -> "AsyncEngine":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    # ----------------------------------------------------------------------------------------- private
    def _check_alive(self) -> None:
        if self._dead is not None:  # a dead stage first: the dispatcher may have failed after it
            raise copy_error(self._dead)
        if self._broken is not None:
            raise copy_error(self._broken)
        if self._stalled is not None:
            raise copy_error(self._stalled)
        try:
            self.engine._check_stages()
        except StageDied as exc:
            self._dead = self._dead or exc
            raise

    def _new_run(self) -> Scheduler:
        run = self.engine.scheduler(serving=True)
        run.stats = self.step_stats
        return run

    def _dispatch(self) -> None:
        """The dispatcher thread: the only code that touches the ring while the AsyncEngine lives.

        Errors of the stages and the scheduler are handled in ``_dispatch_loop`` (the open requests fail, the next
        ones run). Should the loop itself stop on an error, nothing would drain the inbox and every request would
        wait forever: so every open and queued request ends with ``DispatcherFailed`` naming the error, and every
        new one is refused with it (``check_stages`` too, so a server's health check reports it)."""
        try:
            self._dispatch_loop()
        except BaseException as exc:  # noqa: BLE001 -- nothing may leave a request waiting
            log.exception("the dispatcher thread failed")
            self._fail_broken(DispatcherFailed(f"the engine's dispatcher failed ({type(exc).__name__}: {exc}): "
                                               f"it serves no more requests; restart it"))

    def _fail_broken(self, err: DispatcherFailed) -> None:
        """End every open and queued request with ``err`` after the dispatcher failed (no scheduler run is used:
        it may be what failed)."""
        with self._lock:  # after this, ``stream`` refuses: nothing more enters the inbox
            self._broken = err
        reqs = list(self._active.values())
        self._active.clear()
        self._n_running = 0  # before any caller can see the end of its request
        while True:
            try:
                what, arg = self._inbox.get_nowait()
            except queue.Empty:
                break
            if what == "submit":
                reqs.append(arg)
        for req in reqs:
            with self._lock:
                self._n_open -= 1
            self._outbox.setdefault(req.loop, []).append((req, [copy_error(err)]))
        self._flush(None)  # none of them is in _active: a closed loop's requests need no cancel

    def _dispatch_loop(self) -> None:
        link, op_timeout_s = self.engine._link, self.engine.config.op_timeout_s
        run = self._new_run()
        stop_at = None
        last_reply = time.monotonic()
        while True:
            try:
                stop_at = self._drain_inbox(run, not link.in_flight and stop_at is None, stop_at)
                self._expire_waiting(run)
                self._count_running()
                if stop_at is not None and (not self._active or time.monotonic() >= stop_at):
                    break
                if self._dead is not None or not link.in_flight:
                    if stop_at is not None:
                        time.sleep(0.01)
                    last_reply = time.monotonic()
                    self._stalled = None
                    continue
                try:
                    events = run.step(timeout_s=STEP_TIMEOUT_S)
                except RingTimeout:
                    self._watch_stall(run, last_reply, op_timeout_s)
                    continue
                last_reply = time.monotonic()
                if self._stalled is not None:
                    log.warning("stage %d answers again", self._stalled.stage)
                    self._stalled = None
                self._deliver(run, events)
                self._count_running()
                if self.on_step is not None:
                    try:
                        self.on_step(self._n_running, run.last_segments)
                    except Exception:  # a metrics hook must not fail the requests
                        log.exception("on_step hook failed")
            except PeerDied as exc:  # StageDied, or a ring closed by a stage that is exiting
                self._dead = self._dead or self._stage_died(exc)
                self._fail_all(run, self._dead)
                link.drain()  # returns at once: nothing more will come
            except Exception as exc:  # a stage error, a reply mismatch: fail what is open, start afresh
                self._fail_all(run, exc)
                link.drain()
                run.release_all()  # nothing of it is in flight now: its KV blocks serve the next run
                run = self._new_run()
        self._fail_all(run, EngineClosed("the engine shut down before this request finished"))
        if self._stalled is None:
            link.drain()

    def _watch_stall(self, run: Scheduler, last_reply: float, op_timeout_s: float) -> None:
        """No reply yet: name a stage that has held work it was given for ``op_timeout_s`` without progress.

        The clock rule (a stage is timed only while it holds work):
        - Stage i has work while the stage before it (stage 0: the coordinator) has passed on more ops than i
          has applied (``Engine.stage_ops``).
        - Every stage's clock starts at ``base``, the later of the last reply (every stage moved then) and
          the first send after nothing was in flight (``Link.busy_since``: work arriving after idle).
          Time spent idle therefore never counts, however long it was.
        - It restarts whenever the stage's applied-op counter moves or it is seen with nothing to do.
        A stopped stage makes the stages before it wait on their full output rings (their counters freeze too),
        so the last stage that looks stuck is named. Without per-stage counters the engine as a whole is timed
        from ``base``. On a stall every open request fails with ``StageStalled`` (their rows free as the
        stalled ops come back)."""
        now = time.monotonic()
        base = max(last_reply, self.engine._link.busy_since)
        stage_ops = getattr(self.engine, "stage_ops", None)
        stalled = None
        if stage_ops is not None:
            ops = stage_ops()
            if self._progress_base != base or len(self._progress) != len(ops):
                self._progress, self._progress_base = [(n, base) for n in ops], base
            upstream = self.engine._link.n_sent
            for i, n in enumerate(ops):
                seen, since = self._progress[i]
                if n != seen or upstream <= n:
                    self._progress[i] = (n, now)
                elif now - since > op_timeout_s:
                    stalled = (i, now - since)  # the last one: a stopped stage also freezes those before it
                upstream = n
        elif now - base > op_timeout_s:
            stalled = (-1, now - base)
        if stalled is None or self._stalled is not None:
            return
        i, held_s = stalled
        who = f"stage {i}" if i >= 0 else "a stage"
        layers = getattr(self.engine, "layer_ranges", None)
        if i >= 0 and layers:
            who += f" (pid {self.engine.pids[i]}, layers {layers[i].start}-{layers[i].stop - 1})"
        self._stalled = StageStalled(f"{who} has held an op for {held_s:.1f} s, over op_timeout_s="
                                     f"{op_timeout_s:g}: it is stopped or stuck", i)
        log.error("%s", self._stalled)
        self._fail_all(run, self._stalled)

    def _expire_waiting(self, run: Scheduler) -> None:
        """Fail with ``QueueTimeout`` every request that has waited for a row and its KV blocks past
        ``max_queue_wait_s``."""
        if self.max_queue_wait_s is None:
            return
        now = time.monotonic()
        for req in list(self._active.values()):
            s = req.stream  # a preempted stream (resume_ids set) has started: it waits at the head, unexpired
            if s.row < 0 and s.resume_ids is None and now - req.t_submit > self.max_queue_wait_s:
                waiting = list(run.waiting)
                ahead = waiting.index(s) if s in waiting else 0
                why = (f"; {ahead} stream(s) wait ahead of it, the first "
                       + ("a preempted one resuming" if waiting[0].resume_ids is not None else "a new one")
                       + " (streams start in arrival order, each once its blocks are free)" if ahead else "")
                run.cancel(req.id)
                run.streams.pop(req.id, None)  # never started: nothing of it is in flight
                kv = self.engine.kv
                self._finish(run, req, [QueueTimeout(
                    f"not started within max_queue_wait_s={self.max_queue_wait_s:g}: {self._n_running} of max_rows "
                    f"{self.engine.config.max_rows} running, {kv.n_available} of {kv.n_blocks} KV blocks free"
                    f"{why}: retry later")])

    def _count_running(self) -> None:
        self._n_running = sum(1 for r in self._active.values() if r.stream.row >= 0)

    @staticmethod
    def _stage_died(exc: PeerDied) -> StageDied:
        """``exc`` as a ``StageDied`` (``Link`` already waited for the gone stage to be named)."""
        return exc if isinstance(exc, StageDied) else StageDied(f"a stage is gone: {exc}")

    def _drain_inbox(self, run: Scheduler, block: bool, stop_at: float | None) -> float | None:
        """Apply every queued command (waiting for one when ``block``); returns the stop deadline, if any."""
        try:
            cmd = self._inbox.get(timeout=1.0) if block else self._inbox.get_nowait()
        except queue.Empty:
            return stop_at
        while True:
            what, arg = cmd
            if what == "submit":
                self._submit(run, arg)
            elif what == "cancel":
                self._cancel(run, arg)
            else:
                stop_at = arg if stop_at is None else min(stop_at, arg)
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return stop_at

    def _submit(self, run: Scheduler, req: Request) -> None:
        if self._dead is not None or self._stalled is not None:
            self._finish(run, req, [copy_error(self._dead or self._stalled)])
            return
        self._active[req.id] = req
        run.submit(req.stream)

    def _cancel(self, run: Scheduler, req: Request) -> None:
        if self._active.get(req.id) is req:
            if self._dead is None:
                run.cancel(req.id)  # frees its row once nothing of it is in flight
            self._finish(run, req, [])

    def _finish(self, run: Scheduler, req: Request, items: list) -> None:
        """Forget a finished, cancelled or failed request and post its last items."""
        self._active.pop(req.id, None)
        self._count_running()  # before the caller can see the end of its request
        with self._lock:
            self._n_open -= 1
        if items:
            self._post(run, req, items)

    def _post(self, run: Scheduler, req: Request, items: list) -> None:
        """Post ``items`` to ``req``'s loop: at once, or with the rest of this reply's posts (``_deliver``)."""
        self._outbox.setdefault(req.loop, []).append((req, items))
        if not self._batching:
            self._flush(run)

    def _flush(self, run: Scheduler | None) -> None:
        """Send the queued posts, one ``call_soon_threadsafe`` per event loop: each call writes the loop's
        self-pipe (a syscall, and a wake-up of the loop's thread), which per request per step took 13 % of the
        server process's busy samples at 1 client (py-spy, issue 31). A request still open whose loop is closed
        is cancelled in ``run`` (None only after the dispatcher failed, when none is open)."""
        outbox, self._outbox = self._outbox, {}
        for loop, posts in outbox.items():
            try:
                loop.call_soon_threadsafe(put_all, [(req.queue, items) for req, items in posts])
            except RuntimeError:  # the requests' event loop is closed: nobody will read them
                for req, _ in posts:
                    if self._active.get(req.id) is req:
                        self._cancel(run, req)

    def _deliver(self, run: Scheduler, events: list) -> None:
        """Post each request its new chunks; a request whose stream failed on its own (an event with ``error``)
        gets its chunks so far, then ``RequestFailed``, and is finished; the others are not touched."""
        self._batching = True
        try:
            self._deliver_chunks(run, events)
        finally:
            self._batching = False
            self._flush(run)

    def _deliver_chunks(self, run: Scheduler, events: list) -> None:
        now = time.perf_counter()
        chunks: dict[int, list] = {}
        for ev in events:
            if ev.stream in self._active:
                chunks.setdefault(ev.stream, []).append(
                    copy_error(ev.error) if ev.error is not None else
                    Chunk(ev.token_id, ev.text, now, logprob=ev.logprob))
        for rid, items in chunks.items():
            req = self._active[rid]
            s = req.stream
            if s.error is not None:
                log.warning("request %d failed alone: %s: %s", rid, type(s.error).__name__, s.error)
                self._finish(run, req, items)
                continue
            try:
                if not req.started:
                    req.started = True
                    if s.prompt_logprobs is not None:
                        items[0].prompt_logprobs = list(s.prompt_token_logprobs)
                if s.done:
                    items[-1].finish_reason = s.finish_reason
                    items[-1].result = result_of(s)
            except Exception as exc:  # noqa: BLE001 - this request's result alone could not be built
                log.exception("request %d failed alone", rid)
                run.cancel(rid)
                self._finish(run, req, [copy_error(exc)])
                continue
            if s.done:
                self._finish(run, req, items)
            else:
                self._post(run, req, items)

    def _fail_all(self, run: Scheduler, exc: BaseException) -> None:
        """Finish every open request with (a copy of) ``exc``, cancelling its row in ``run``."""
        for req in list(self._active.values()):
            if self._dead is None and not req.stream.done:
                try:
                    run.cancel(req.id)
                except Exception:
                    pass
            self._finish(run, req, [copy_error(exc)])
