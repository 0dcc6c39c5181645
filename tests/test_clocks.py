"""Every clock starts when its work starts (issue 19): each test idles past the clock's limit first, then gives
it work, and checks that nothing is timed out for the idle time.

- The stall clock (``AsyncEngine``): a server idle longer than ``op_timeout_s`` used to answer its next
  requests with ``stage_stalled`` (the clock of a stage ran from the last time anyone looked at it). Idle, then
  requests one after another and at once: all succeed. A stage stopped after idle is still named within
  ``op_timeout_s`` plus a step; a slow stage that makes progress is never named, however long a request takes.
- The queue-wait clock (``max_queue_wait_s``), the coordinator's reply wait (``op_timeout_s`` of ``Link``), the
  edge between hosts (``edge_timeout_s``: heartbeats while idle) and the worker's wait for its head's answer.

The same rule on a real server (SIGSTOP after idle) is in tests/test_server.py.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from fake_stage import GatedModel, RelayModel, fake_kv, make_stream, start_fake_ring
from ringshm.engine.async_engine import AsyncEngine
from ringshm.engine.scheduler import Scheduler
from ringshm.errors import ClusterRefused, QueueTimeout, StageStalled
from ringshm.runtime.stage import N_SLOTS, SLOT_OPS
from ringshm.transport import bridge, cluster
from ringshm.transport import messages as m
from ringshm.transport.ring import Ring
from test_bridge import _pair, _Run, free_port, record
from test_serving import FakeEngine, scripts

OP_TIMEOUT_S = 0.5
OP_S = 0.1  # each op takes longer than the dispatcher's step wait, so the stall watch looks while it runs


class WatchedEngine(FakeEngine):
    """Two fake stages (a relay taking ``OP_S`` per op, then the oracle) that report their applied-op counters,
    as real stages do (``Engine.stage_ops``)."""

    def __init__(self, model, op_timeout_s: float = OP_TIMEOUT_S):
        super().__init__(model, relays=[RelayModel(OP_S)])
        self.config.op_timeout_s = op_timeout_s
        self.pids, self.layer_ranges = [], None

    def stage_ops(self) -> list[int]:
        return [int(self.ring.status[i * N_SLOTS + SLOT_OPS]) for i in range(len(self.ring.threads))]


@pytest.fixture
def watched(monkeypatch):
    monkeypatch.setattr("ringshm.model.tokenizer.load_tokenizer", lambda path: None)  # fake prompts are ids
    made = []

    def make(model, **kw) -> AsyncEngine:
        aengine = AsyncEngine(WatchedEngine(model), **kw)
        made.append(aengine)
        return aengine

    yield make
    for aengine in made:
        aengine.close()


async def _complete(aengine, script, n_prompt=6, n_new=8) -> list[int]:
    return (await aengine.complete(script[:n_prompt], n_new)).token_ids


# ----------------------------------------------------------------------------------------------- stall clock
def test_requests_after_idling_past_op_timeout_succeed_one_after_another_and_at_once(watched):
    ts = scripts(8)
    aengine = watched(GatedModel(ts, max_rows=4, op_s=OP_S))

    async def main():
        first = await _complete(aengine, ts[0], n_new=3)
        await asyncio.sleep(3 * OP_TIMEOUT_S)  # idle: no op in flight
        serial = [await _complete(aengine, t, n_new=3) for t in ts[1:4]]
        await asyncio.sleep(3 * OP_TIMEOUT_S)
        together = await asyncio.gather(*(_complete(aengine, t, n_new=3) for t in ts[4:8]))
        return [first, *serial, *together]

    assert asyncio.run(main()) == [t[6:9] for t in ts]
    assert aengine.stalled is None


def test_a_stage_stopped_after_idling_is_named_within_op_timeout_plus_a_step(watched):
    ts = scripts(2)
    model = GatedModel(ts, max_rows=2, op_s=OP_S)
    aengine = watched(model)

    async def main():
        await _complete(aengine, ts[0], n_new=3)
        await asyncio.sleep(3 * OP_TIMEOUT_S)
        model.gate.clear()  # the last stage stops
        t0 = time.monotonic()
        with pytest.raises(StageStalled, match="stage 1"):  # the oracle, behind the relay
            await _complete(aengine, ts[1], n_new=3)
        return time.monotonic() - t0

    held_s = asyncio.run(main())
    model.gate.set()
    assert OP_TIMEOUT_S <= held_s < OP_TIMEOUT_S + 1.0, held_s


def test_a_slow_stage_that_makes_progress_is_never_named_however_long_the_request(watched):
    ts = scripts(2)
    aengine = watched(GatedModel(ts, max_rows=2, op_s=0.6 * OP_TIMEOUT_S))  # every op takes most of the limit

    async def main():
        await asyncio.sleep(2 * OP_TIMEOUT_S)
        return await asyncio.gather(*(_complete(aengine, t, n_new=6) for t in ts))  # ~7 ops: > 4 x op_timeout

    t0 = time.monotonic()
    assert asyncio.run(main()) == [t[6:12] for t in ts]
    assert time.monotonic() - t0 > 3 * OP_TIMEOUT_S and aengine.stalled is None


# ------------------------------------------------------------------------------------------ queue-wait clock
def test_a_request_after_idling_past_max_queue_wait_waits_only_its_own_time(watched):
    ts = scripts(3)
    aengine = watched(GatedModel(ts, max_rows=1), max_queue_wait_s=2.0)

    async def main():
        await asyncio.sleep(2.5)  # idle past max_queue_wait_s
        # One row: the second request waits for the first (5 ops of ~0.1 s), well within its 2 s.
        return await asyncio.gather(*(_complete(aengine, t, n_new=3) for t in ts[:2]))

    assert asyncio.run(main()) == [t[6:9] for t in ts[:2]]

    async def starved():  # the clock still runs out for a request that really waits: 400 ops ahead of it
        hog = asyncio.create_task(aengine.complete(ts[0][:6], 390))  # ~40 s of ops
        await asyncio.sleep(0.1)
        with pytest.raises(QueueTimeout, match="not started within max_queue_wait_s=2: 1 of max_rows 1 running"):
            await _complete(aengine, ts[2])
        hog.cancel()

    asyncio.run(starved())


# --------------------------------------------------------------------------------- the coordinator's replies
def test_the_link_times_out_a_reply_from_when_it_waits_not_from_its_last_reply():
    ts = scripts(1)
    ring = start_fake_ring(GatedModel(ts, max_rows=1))
    kv = fake_kv(ring.model)
    ring.link.op_timeout_s = OP_TIMEOUT_S
    try:
        def generate():
            run = Scheduler(ring.link, [make_stream(0, ts[0], 6, 8, row=-1)], 1, 4, 4, 1, 4, kv=kv)
            return [ev.token_id for ev in run]

        assert generate() == ts[0][6:14]
        time.sleep(3 * OP_TIMEOUT_S)
        assert generate() == ts[0][6:14]
    finally:
        ring.close()


# ------------------------------------------------------------------------------------ the edge between hosts
def test_an_edge_idle_for_many_timeouts_lives_on_heartbeats_and_then_carries_records():
    timeout_s = 0.6
    e0, e1, _store = _pair(timeout_s)
    src, dst = Ring.create(1 << 20), Ring.create(1 << 20)
    sender = _Run(bridge.run_sender, src, e0, timeout_s, "stage 1")
    receiver = _Run(bridge.run_receiver, dst, e1, timeout_s, 0.0, "stage 2")
    try:
        sender.start()
        receiver.start()
        time.sleep(5 * timeout_s)  # nothing to carry
        assert sender.error is None and receiver.error is None, (sender.error, receiver.error)
        sent = [record(i, m.STEP, 100) for i in range(5)] + [record(5, m.SHUTDOWN)]
        for r in sent:
            src.send(r, timeout_s=10)
        assert [bytes(dst.recv(timeout_s=10)) for _ in sent] == sent
        sender.join(10)
        receiver.join(10)
        assert sender.error is None and receiver.error is None, (sender.error, receiver.error)
    finally:
        for r in (src, dst):
            if not (sender.is_alive() or receiver.is_alive()):
                r.close()
            r.unlink()


# --------------------------------------------------------------------------------------- the worker's wait
def test_a_worker_that_waited_long_for_its_head_still_gets_the_heads_answer_in_time():
    """Node 2 of 3 starts first and waits most of its ``wait_s`` for the head; the head admits node 1 first, so
    node 2's answer is acknowledged after node 2's original deadline. Its wait for the answer starts when it
    answers (bounded by the head's own startup timeout), so it joins."""
    port, wait_s = free_port(), 6.0
    box: dict = {}
    node2 = threading.Thread(target=lambda: box.update(node2=_join(port, 2, wait_s)), daemon=True)
    t0 = time.monotonic()
    node2.start()
    time.sleep(2.0)  # the head comes late (the worker's store client retries meanwhile)
    store = dist.TCPStore("127.0.0.1", port, None, True, timedelta(seconds=30), wait_for_workers=False)
    hello = {"wire": cluster.wire_version(), "session": "s", "nnodes": 3, "config": {"startup_timeout_s": 30},
             "model": "m", "fingerprint": "f", "max_seq_len": 64, "nonce": "n"}
    store.set(cluster.HELLO_KEY, json.dumps(hello))
    store.wait(["ringshm/join2"], timedelta(seconds=10))  # node 2 answered: its nonce is queued
    while time.monotonic() < t0 + wait_s + 0.5:  # node 1 has not come yet: node 2's original deadline passes
        time.sleep(0.1)
    theirs = store.get("ringshm/join2").decode().split("\n")[0]
    assert json.loads(store.get(f"ringshm/node2/{theirs}"))["nonce"] == theirs
    store.set(f"ringshm/ack2/{theirs}",
              json.dumps({"ok": True, "proof": cluster._proof(None, f"head:2:{theirs}"), "hosts": []}))
    node2.join(10)
    assert not isinstance(box.get("node2"), Exception), box
    assert box["node2"]["session"] == "s"


def _join(port: int, rank: int, wait_s: float):
    try:
        return cluster.join(cluster.Rendezvous(rank, "127.0.0.1", port, wait_s=wait_s), 3, lambda hello: "f")[0]
    except ClusterRefused as exc:
        return exc
