"""The edge between hosts (ringshm.transport.edge, .bridge) and the rendezvous (ringshm.transport.cluster),
without a model.

- Header rules: every field a hostile peer controls is checked before anything is allocated.
- Both ends of an edge in this process (two gloo ranks on threads, real rings): records cross in order and
  byte for byte; a receiver whose ring stays full for several edge timeouts keeps the edge alive
  (credits + heartbeats); a frozen sender kills it within the edge timeout.
- A receiving bridge process fed hostile headers by a fake sender: it exits with an error naming the rule,
  and nothing reaches its ring.
- The rendezvous refuses a wrong wire version, a wrong token (either way round) and a taken node rank, by name.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import socket
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from ringshm.errors import ClusterRefused, EdgeError
from ringshm.runtime.launcher import NodePlan
from ringshm.transport import bridge, cluster, edge
from ringshm.transport import messages as m
from ringshm.transport.edge import CREDIT_WINDOW, Edge, EdgeSpec, pack_header, parse_header
from ringshm.transport.error_buffer import ERROR_BYTES, read_error
from ringshm.transport.ring import Ring

pytestmark = pytest.mark.usefixtures("no_segment_left_behind")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def record(seq: int, op: int = m.PING, payload_bytes: int = 0) -> bytes:
    """A real ring record (a PING, or a STEP carrying ``payload_bytes`` of ids) numbered ``seq``."""
    if op == m.STEP:
        n = max(1, payload_bytes // 8)
        msg = m.Message(m.STEP, segments=[m.Segment(0, 0, n, m.WANT_LAST)],
                        tensors=[torch.arange(n, dtype=torch.int64) + seq])
    else:
        msg = m.Message(op)
    msg.seq = seq
    return bytes(m.encode(msg))


# --------------------------------------------------------------------------------------------- header rules
@pytest.mark.parametrize("words, rule", [
    ([0x1234, 1, edge.RECORD, 0, 0, 64, 0, 0], "bad magic"),
    ([edge.MAGIC, 99, edge.RECORD, 0, 0, 64, 0, 0], "wire version 99"),
    ([edge.MAGIC, 1, 77, 0, 0, 64, 0, 0], "kind 77"),
    ([edge.MAGIC, 1, edge.CREDIT, 0, 0, 0, 1, 0], "not allowed in this direction"),
    ([edge.MAGIC, 1, edge.RECORD, 0, 0, 2**60, 0, 0], "refused before allocating"),
    ([edge.MAGIC, 1, edge.RECORD, 0, 0, 4, 0, 0], "refused before allocating"),
    ([edge.MAGIC, 1, edge.RECORD, -1, 0, 64, 0, 0], "negative"),
    ([edge.MAGIC, 1, edge.HEARTBEAT, 0, 0, 8, 0, 0], "refused before allocating"),
    ([edge.MAGIC, 1, edge.ABORT, 0, 0, edge.MAX_REASON_BYTES + 1, 0, 0], "refused before allocating"),
])
def test_a_header_that_breaks_a_rule_is_refused_naming_it(words, rule):
    with pytest.raises(EdgeError, match=rule):
        parse_header(torch.tensor(words, dtype=torch.int64), edge.FORWARD_KINDS, 1 << 20)


def test_a_credit_over_the_window_is_refused():
    with pytest.raises(EdgeError, match="over the window"):
        parse_header(pack_header(edge.CREDIT, credits=CREDIT_WINDOW + 1), edge.BACKWARD_KINDS, 0)
    assert parse_header(pack_header(edge.CREDIT, credits=3), edge.BACKWARD_KINDS, 0)[4] == 3


# ------------------------------------------------------------------------------ both ends in one process
def _pair(timeout_s: float):
    """Two gloo ranks of one edge on threads: ``(edge0, edge1, store)``."""
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, None, True, timedelta(seconds=30), wait_for_workers=False)
    groups = [None, None]

    def make(rank):  # each rank its own store client: one client serves one blocking request at a time
        client = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=30), wait_for_workers=False)
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timedelta(seconds=30)
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        groups[rank] = dist.ProcessGroupGloo(dist.PrefixStore("t/edge1/", client), rank, 2, opts)

    threads = [threading.Thread(target=make, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return Edge(groups[0], 0, timeout_s, "edge 1 (test)"), Edge(groups[1], 1, timeout_s, "edge 1 (test)"), store


class _Run(threading.Thread):
    """A bridge loop on a thread; ``error`` holds what it raised."""

    def __init__(self, fn, *args):
        super().__init__(daemon=True)
        self.fn, self.args, self.error = fn, args, None

    def run(self):
        try:
            self.fn(*self.args)
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            self.error = exc


def test_records_cross_in_order_byte_for_byte_and_a_long_full_ring_does_not_kill_the_edge():
    timeout_s = 0.6
    e0, e1, _store = _pair(timeout_s)
    src, dst = Ring.create(1 << 20), Ring.create(1 << 16)  # dst holds a few records: it fills up
    sender = _Run(bridge.run_sender, src, e0, timeout_s, "stage 1")
    receiver = _Run(bridge.run_receiver, dst, e1, timeout_s, 0.0, "stage 2")
    try:
        sender.start()
        receiver.start()
        sent = [record(i, m.STEP, 6000) for i in range(40)] + [record(40, m.SHUTDOWN)]
        feeder = threading.Thread(target=lambda: [src.send(r, timeout_s=30) for r in sent], daemon=True)
        feeder.start()
        time.sleep(4 * timeout_s)  # nobody drains dst: it is full, the edge must live on heartbeats and credit
        assert sender.error is None and receiver.error is None, (sender.error, receiver.error)
        got = [bytes(dst.recv(timeout_s=30)) for _ in sent]
        assert got == sent
        sender.join(10)
        receiver.join(10)
        assert not sender.is_alive() and not receiver.is_alive()
        assert sender.error is None and receiver.error is None, (sender.error, receiver.error)
    finally:
        for r in (src, dst):
            if not (sender.is_alive() or receiver.is_alive()):  # never unmap a ring a loop still uses
                r.close()
            r.unlink()


def test_records_keep_their_order_while_the_ring_fills_and_drains_over_and_over():
    """The receiver writes some records straight from the edge and queues others while the ring is full; a
    record must never overtake one queued before it (a slow consumer keeps switching between the two)."""
    timeout_s = 2.0
    e0, e1, _store = _pair(timeout_s)
    src, dst = Ring.create(1 << 20), Ring.create(1 << 13)  # dst holds about two records
    sender = _Run(bridge.run_sender, src, e0, timeout_s, "stage 1")
    receiver = _Run(bridge.run_receiver, dst, e1, timeout_s, 0.0, "stage 2")
    try:
        sender.start()
        receiver.start()
        sent = [record(i, m.STEP, 2000 + 8 * (i % 7)) for i in range(300)] + [record(300, m.SHUTDOWN)]
        threading.Thread(target=lambda: [src.send(r, timeout_s=30) for r in sent], daemon=True).start()
        got = []
        for i in range(len(sent)):
            got.append(bytes(dst.recv(timeout_s=30)))
            if i % 3 == 0:
                time.sleep(0.002)
        assert [m.decode(r).seq for r in got] == list(range(len(sent)))
        assert got == sent
        sender.join(10)
        receiver.join(10)
        assert sender.error is None and receiver.error is None, (sender.error, receiver.error)
    finally:
        for r in (src, dst):
            if not (sender.is_alive() or receiver.is_alive()):
                r.close()
            r.unlink()


def test_a_frozen_sender_kills_the_edge_within_its_timeout():
    timeout_s = 0.6
    e0, e1, _store = _pair(timeout_s)
    dst = Ring.create(1 << 16)
    receiver = _Run(bridge.run_receiver, dst, e1, timeout_s, 0.0, "stage 2")
    try:
        t0 = time.monotonic()
        receiver.start()  # rank 0 never sends: it is frozen
        receiver.join(10 * timeout_s)
        assert not receiver.is_alive()
        assert isinstance(receiver.error, EdgeError) and "nothing heard" in str(receiver.error)
        assert time.monotonic() - t0 < 3 * timeout_s + 1
        assert dst.try_recv() is None
    finally:
        if not receiver.is_alive():
            dst.close()
        dst.unlink()


# -------------------------------------------------------------- a receiving bridge process, hostile headers
@pytest.mark.parametrize("words, rule", [
    ([edge.MAGIC, edge.VERSION, edge.RECORD, 0, 0, 2**60, 0, 0], "refused before allocating"),
    ([0xBAD, edge.VERSION, edge.RECORD, 0, 0, 64, 0, 0], "bad magic"),
    ([edge.MAGIC, edge.VERSION, edge.RECORD, 5, 0, 64, 0, 0], "expected record 0"),
])
def test_a_hostile_header_closes_the_edge_and_nothing_reaches_the_ring(words, rule):
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, None, True, timedelta(seconds=30), wait_for_workers=False)
    ring = Ring.create(1 << 16)
    ctx = mp.get_context("spawn")
    errors = ctx.Array("c", ERROR_BYTES, lock=False)
    spec = EdgeSpec(edge=1, rank=1, ring=ring.name, store_addr="127.0.0.1", store_port=port, session="t",
                    bind_addr="127.0.0.1", timeout_s=5.0, connect_timeout_s=30.0, where="edge 1 from the test")
    proc = ctx.Process(target=bridge.bridge_main, args=(spec, errors, "stage 1"), daemon=True)
    proc.start()
    try:
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timedelta(seconds=30)
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        pg = dist.ProcessGroupGloo(dist.PrefixStore("ringshm/t/edge1/", store), 0, 2, opts)
        pg.send([torch.tensor(words, dtype=torch.int64)], 1, 0).wait(timedelta(seconds=10))
        proc.join(15)
        assert proc.exitcode == 1
        text = read_error(errors, 0)
        assert "EdgeError" in text and rule in text, text
        assert ring.try_recv() is None  # nothing reached the ring
    finally:
        if proc.is_alive():
            proc.kill()
        ring.close()
        ring.unlink()


# ------------------------------------------------------------------------------------------- rendezvous
def _fake_head(port: int, **hello):
    store = dist.TCPStore("127.0.0.1", port, None, True, timedelta(seconds=30), wait_for_workers=False)
    base = {"wire": cluster.wire_version(), "session": "s", "nnodes": 2, "config": {}, "model": "m",
            "fingerprint": "f", "max_seq_len": 64, "nonce": "n"}
    store.set(cluster.HELLO_KEY, json.dumps({**base, **hello}))
    return store


def _answer(store, r: int = 1) -> dict:
    """The first answer queued for node ``r``, as the head reads it: its nonce from ``ringshm/join<r>``, the answer
    under ``ringshm/node<r>/<nonce>``."""
    nonce = store.get(f"ringshm/join{r}").split(b"\n")[0].decode()
    return json.loads(store.get(f"ringshm/node{r}/{nonce}"))


def test_a_worker_refuses_a_head_of_another_wire_version_and_says_so_to_it():
    port = free_port()
    store = _fake_head(port, wire="99.1")
    rdv = cluster.Rendezvous(1, "127.0.0.1", port, wait_s=10)
    with pytest.raises(ClusterRefused, match="wire version: the head speaks '99.1'"):
        cluster.join(rdv, 2, lambda hello: "f")
    answer = _answer(store)
    assert "wire version" in answer["error"]  # the head relays it: "node 1 refused to join: wire version ..."


def test_a_worker_refuses_a_model_whose_fingerprint_differs():
    port = free_port()
    store = _fake_head(port)
    rdv = cluster.Rendezvous(1, "127.0.0.1", port, wait_s=10)
    with pytest.raises(ClusterRefused, match="model fingerprint"):
        cluster.join(rdv, 2, lambda hello: "not f")
    assert "model fingerprint" in _answer(store)["error"]


@pytest.mark.parametrize("worker_token, head_proof_token", [("a", "a"), ("a", "b")])
def test_a_worker_checks_the_heads_proof_of_the_token(worker_token, head_proof_token):
    port = free_port()
    store = _fake_head(port)
    rdv = cluster.Rendezvous(1, "127.0.0.1", port, token=worker_token, wait_s=10)

    def head():
        answer = _answer(store)
        assert answer["proof"] == cluster._proof(worker_token, f"worker:1:n:{answer['nonce']}")
        store.set(f"ringshm/ack1/{answer['nonce']}", json.dumps(
            {"ok": True, "proof": cluster._proof(head_proof_token, f"head:1:{answer['nonce']}")}))

    t = threading.Thread(target=head, daemon=True)
    t.start()
    if worker_token == head_proof_token:
        hello, _ = cluster.join(rdv, 2, lambda hello: "f")
        assert hello["session"] == "s"
    else:
        with pytest.raises(ClusterRefused, match="token: the head .* does not know this worker's token"):
            cluster.join(rdv, 2, lambda hello: "f")
    t.join(10)


def test_a_second_worker_with_a_taken_node_rank_is_refused_without_touching_the_first_ones_answer():
    port = free_port()
    store = _fake_head(port)
    first = "a" * 32
    store.set(f"ringshm/node1/{first}", "the first worker's answer")
    store.append("ringshm/join1", f"{first}\n")
    store.set("ringshm/joined1", first)  # the head admitted it
    with pytest.raises(ClusterRefused, match="already joined .* as node 1"):
        cluster.join(cluster.Rendezvous(1, "127.0.0.1", port, wait_s=10), 2, lambda hello: "f")
    assert store.get(f"ringshm/node1/{first}") == b"the first worker's answer"
    assert store.get("ringshm/join1") == f"{first}\n".encode()  # nothing queued behind it


def test_a_worker_waiting_for_its_answer_is_refused_once_another_takes_the_rank():
    port = free_port()
    store = _fake_head(port)

    def head():  # admits someone else while this worker waits for its ack
        store.wait(["ringshm/join1"], timedelta(seconds=10))
        store.set("ringshm/joined1", "b" * 32)

    t = threading.Thread(target=head, daemon=True)
    t.start()
    with pytest.raises(ClusterRefused, match="already joined .* as node 1"):
        cluster.join(cluster.Rendezvous(1, "127.0.0.1", port, wait_s=10), 2, lambda hello: "f")
    t.join(10)


def test_the_head_ignores_answers_without_a_proof_and_admits_the_worker_that_has_one(model_path):
    """A stranger who reaches the port (garbage, a non-object, a wrong proof, an unproven refusal) cannot end
    the head's wait; the real worker then joins."""
    from ringshm.config import EngineConfig
    from ringshm.model.fingerprint import fingerprint
    from ringshm.model.loader import read_config

    port = free_port()
    cfg = EngineConfig(stages=2, nnodes=2)
    mc = read_config(model_path)
    ranges = cfg.layer_ranges(mc.n_layers)
    box = {}
    head = threading.Thread(target=lambda: box.update(head=cluster.Head(
        cluster.Rendezvous(0, "127.0.0.1", port, token="s3cret", wait_s=30), cfg, str(model_path),
        fingerprint(model_path, mc, ranges), 512)), daemon=True)
    head.start()
    client = cluster._connect_store(cluster.Rendezvous(1, "127.0.0.1", port, wait_s=10), time.monotonic() + 10)
    client.wait([cluster.HELLO_KEY], timedelta(seconds=10))
    client.append("ringshm/join1", "not a nonce\n" + "c" * 32 + "\n")  # junk, and a nonce with no answer
    for i, junk in enumerate((b"\xff\xfe", b"[1, 2, 3]", b'{"error": "go away"}',
                              json.dumps({"nonce": "x", "proof": "0" * 64, "error": "go away"}).encode())):
        nonce = f"{i:032x}"
        client.set(f"ringshm/node1/{nonce}", junk)
        client.append("ringshm/join1", f"{nonce}\n")
    time.sleep(1.0)  # the head reads them all
    assert head.is_alive() and not client.check(["ringshm/joined1"])  # still waiting, nothing taken
    hello, _ = cluster.join(cluster.Rendezvous(1, "127.0.0.1", port, token="s3cret", wait_s=10), 2,
                            lambda hello: hello["fingerprint"])
    head.join(10)
    assert box["head"].hosts[1] == "127.0.0.1" and hello["session"] == box["head"].session
    box["head"].close()


def test_a_worker_waits_for_a_head_and_gives_up_naming_the_address():
    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(ClusterRefused, match=f"no head at 127.0.0.1:{port} within 1 s"):
        cluster.join(cluster.Rendezvous(1, "127.0.0.1", port, wait_s=1), 2, lambda hello: "f")
    assert time.monotonic() - t0 < 1 + 2 * cluster.SLICE_S + 1.5  # the wait it was given (+ one slice), not twice it


def test_the_head_serves_the_rendezvous_on_master_addr_only():
    port = free_port()
    store, address = cluster._serve_store(cluster.Rendezvous(0, "127.0.0.1", port))
    assert address == ("127.0.0.1", port)
    with pytest.raises(ClusterRefused, match="free --master-port"):
        cluster._serve_store(cluster.Rendezvous(0, "127.0.0.1", port))
    del store


def test_node_stages_split_evenly_node_0_first_or_as_given():
    from ringshm.config import EngineConfig

    assert EngineConfig(stages=5, nnodes=2).node_stage_ranges() == [range(0, 3), range(3, 5)]
    assert EngineConfig(stages=4, nnodes=2, node_stages=(1, 3)).node_stage_ranges() == [range(0, 1), range(1, 4)]
    with pytest.raises(ValueError, match="node_stages must give 2 stage counts"):
        EngineConfig(stages=4, nnodes=2, node_stages=(1, 2))
    with pytest.raises(ValueError, match="at least one stage per node"):
        EngineConfig(stages=2, nnodes=3)
    plan = NodePlan(1, (range(0, 2), range(2, 4)), 4)
    assert plan.edges() == [(2, 1, 1), (4, 0, -1)]
    assert NodePlan(0, (range(0, 2), range(2, 4)), 4).edges() == [(2, 0, 2), (4, 1, 3)]
