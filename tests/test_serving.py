"""``AsyncEngine``'s dispatcher over the fake oracle ring (issue 7): exact continuations under concurrency and
cancellation, the row and queue bounds, a stage error failing only what is open, and shutdown. Runs in about a
second; the real model behind a real server is tests/test_server.py."""

from __future__ import annotations

import asyncio
import dataclasses
import random
from types import SimpleNamespace

import pytest

from fake_stage import EOS, OracleModel, fake_kv, start_fake_ring
from ringshm.engine.async_engine import AsyncEngine
from ringshm.engine.coordinator import Stream
from ringshm.engine.engine import new_stream
from ringshm.engine.scheduler import Scheduler
from ringshm.errors import DispatcherFailed, EngineClosed, QueueFull, RequestFailed, StageDied

MAX_ROWS = 3


def scripts(n: int, length: int = 400, seed: int = 0) -> list[list[int]]:
    """``n`` token sequences with distinct first tokens and no EOS."""
    rng = random.Random(seed)
    return [[100 + i] + [rng.randrange(10, 1000) for _ in range(length - 1)] for i in range(n)]


class FakeEngine:
    """What ``AsyncEngine`` uses of an ``Engine``, over one fake stage; a prompt is a list of token ids."""

    def __init__(self, model: OracleModel, relays=()):
        self.ring = start_fake_ring(model, relays=relays)
        self.kv = fake_kv(model)  # the engine's KV blocks outlive a scheduler run
        self._link, self._job, self.model_path, self.tokenizer = self.ring.link, 0, "", None
        self.config = SimpleNamespace(max_rows=model.max_rows, prefill_chunk=4, prefill_depth=8, op_timeout_s=10)
        self.max_seq_len = 4096
        self.vocab = model.vocab
        self.dead = False

    def _make_stream(self, index, row, prompt, p) -> Stream:
        """The engine's stream of ``p`` with the logit controls, decoded greedily (the oracle's scripts are
        greedy continuations; temperature and speculation are dropped)."""
        if not prompt:
            raise ValueError("prompt is empty")
        p = dataclasses.replace(p, temperature=0.0, top_k=0, top_p=1.0, spec=None)
        return new_stream(index, row, list(prompt), p, None, frozenset({EOS}), self.vocab)

    def scheduler(self, serving: bool = False) -> Scheduler:
        c = self.config
        return Scheduler(self._link, [], c.max_rows, c.prefill_chunk, c.prefill_depth, 1, c.prefill_chunk,
                         kv=self.kv, prefill_stall_ratio=1.5 if serving else None)

    def _check_stages(self) -> None:
        if self.dead:
            raise StageDied("stage 0 (pid 1, layers 0-0) died: killed by signal 9", 0, -9)

    def close(self) -> None:
        self.ring.close()


@pytest.fixture
def make_engine(monkeypatch):
    monkeypatch.setattr("ringshm.model.tokenizer.load_tokenizer", lambda path: None)  # fake prompts are ids
    made = []

    def make(ts, max_waiting=8, max_rows=MAX_ROWS, **model_kw):
        running = []
        aengine = AsyncEngine(FakeEngine(OracleModel(ts, max_rows=max_rows, **model_kw)), max_waiting,
                              on_step=lambda n_running, n_segments: running.append((n_running, n_segments)))
        made.append(aengine)
        return aengine, running

    yield make
    for aengine in made:
        aengine.close()


async def _collect(chunks) -> list[int]:
    return [c.token_id async for c in chunks]


def test_more_requests_than_rows_each_get_exactly_their_scripted_continuation(make_engine):
    ts = scripts(8)
    aengine, running = make_engine(ts)

    async def main():
        return await asyncio.gather(*(aengine.complete(t[: 5 + 3 * i], 20 + i) for i, t in enumerate(ts)))

    results = asyncio.run(main())
    for i, (t, r) in enumerate(zip(ts, results)):
        n = 5 + 3 * i
        assert r.token_ids == t[n : n + 20 + i] and r.finish_reason == "length"
        assert r.n_prompt_tokens == n
    assert max(r for r, _ in running) == MAX_ROWS and (aengine.n_running, aengine.n_waiting) == (0, 0)
    assert max(n for _, n in running) > 1, "ready requests share step ops"
    assert aengine.step_stats.multi_segment_ops > 0


def test_cancelled_task_and_abandoned_stream_end_only_their_own_requests(make_engine):
    ts = scripts(5, length=4000)
    aengine, _ = make_engine(ts, max_seq_len=8192)

    async def main():
        victim_chunks = []

        async def victim():
            async for c in aengine.stream(ts[0][:6], 3990):
                victim_chunks.append(c)

        task = asyncio.create_task(victim())
        abandoned = aengine.stream(ts[1][:6], 3990)
        async for _ in abandoned:
            break  # leave the loop: aclose() below, as ``async with`` would
        await abandoned.aclose()
        while not victim_chunks:
            await asyncio.sleep(0)
        others = asyncio.gather(*(_collect(aengine.stream(t[:6], 60)) for t in ts[2:]))
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return await others, len(victim_chunks)

    others, n_victim = asyncio.run(main())
    assert others == [t[6:66] for t in ts[2:]]
    assert n_victim < 3990


def test_requests_beyond_max_rows_plus_max_waiting_raise_queue_full_at_the_call(make_engine):
    ts = scripts(6)
    aengine, _ = make_engine(ts, max_waiting=2)

    async def main():
        open_ = [aengine.stream(t[:6], 390) for t in ts[: MAX_ROWS + 2]]
        with pytest.raises(QueueFull, match="max_waiting 2"):
            aengine.stream(ts[5][:6], 10)
        for s in open_:
            await s.aclose()
        while aengine.n_running or aengine.n_waiting:  # the dispatcher applies the cancels
            await asyncio.sleep(0.001)
        with pytest.raises(ValueError, match="empty"):
            aengine.stream([], 10)
        return await aengine.complete(ts[5][:6], 10)  # room again once they are cancelled

    assert asyncio.run(main()).token_ids == ts[5][6:16]


def test_a_stage_error_fails_the_open_requests_and_the_next_request_succeeds(make_engine):
    ts = scripts(3)
    aengine, _ = make_engine(ts, max_seq_len=64)  # a request past 64 positions makes the stage fail an op

    async def main():
        doomed = [asyncio.create_task(aengine.complete(t[:6], 200)) for t in ts[:2]]
        outcomes = await asyncio.gather(*doomed, return_exceptions=True)
        return outcomes, await aengine.complete(ts[2][:6], 20)

    outcomes, after = asyncio.run(main())
    assert all(isinstance(o, RequestFailed) and "past max_seq_len" in str(o) for o in outcomes), outcomes
    assert after.token_ids == ts[2][6:26]


def test_a_dead_stage_fails_new_requests_at_the_call(make_engine):
    aengine, _ = make_engine(scripts(1))
    aengine.engine.dead = True

    async def main():
        with pytest.raises(StageDied, match="stage 0"):
            aengine.stream([100, 5], 4)

    asyncio.run(main())


def test_close_ends_open_requests_with_engine_closed_and_refuses_new_ones(make_engine):
    ts = scripts(2, length=4000)
    aengine, _ = make_engine(ts, max_seq_len=8192)

    async def main():
        chunks = aengine.stream(ts[0][:6], 3990)
        await chunks.__anext__()
        await aengine.aclose()
        with pytest.raises(EngineClosed):
            async for _ in chunks:
                pass
        with pytest.raises(EngineClosed):
            aengine.stream(ts[1][:6], 4)

    asyncio.run(main())


def test_a_failed_dispatcher_ends_every_request_and_refuses_new_ones(make_engine, monkeypatch):
    """The dispatcher thread's own failure (here: no scheduler run can be made after a stage error) must not
    leave a request waiting forever: the open one ends with the stage's error, a later one (queued, or refused
    at the call) with ``DispatcherFailed`` naming the cause, and ``check_stages`` (a server's health) reports it."""
    ts = scripts(3)
    aengine, _ = make_engine(ts, max_seq_len=64)  # a request past 64 positions makes the stage fail an op
    asyncio.run(aengine.complete(ts[0][:6], 4))  # the dispatcher has made its scheduler run

    def no_scheduler(serving=False):
        raise RuntimeError("no scheduler run to be had")

    monkeypatch.setattr(aengine.engine, "scheduler", no_scheduler)

    async def main():
        with pytest.raises(RequestFailed, match="past max_seq_len"):
            await asyncio.wait_for(aengine.complete(ts[1][:6], 200), 30)
        with pytest.raises(DispatcherFailed, match="no scheduler run to be had"):  # at the call or from its queue
            await asyncio.wait_for(aengine.complete(ts[2][:6], 4), 30)
        aengine._thread.join(10)
        with pytest.raises(DispatcherFailed, match="no scheduler run to be had"):
            aengine.stream(ts[2][:6], 4)  # refused at the call once the dispatcher has stopped

    asyncio.run(main())
    with pytest.raises(DispatcherFailed):
        aengine.check_stages()
    assert (aengine.n_running, aengine.n_waiting) == (0, 0)
