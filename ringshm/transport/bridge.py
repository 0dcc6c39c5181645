"""Bridges: an edge of the pipeline between two hosts, carried over torch.distributed point-to-point.

Inside a host every hop is a shared-memory ring. An edge between hosts is a ring on each side and a pair of
bridge processes in between (DESIGN.md; vLLM's CPU path splits the same way: shm inside a node,
torch.distributed across nodes). The stage loop never learns which kind of hop it has:

            host A                                                   host B
    stage k-1 ──ring k──▶ [sending bridge] ══ gloo, edge k ══▶ [receiving bridge] ──ring k──▶ stage k

The edge's wire and gloo group are ``ringshm.transport.edge``; this module runs its two ends.

Flow control and liveness. The sender may have at most ``CREDIT_WINDOW`` records that the receiver has not
yet written into its ring. A gloo wait that times out closes the pair for good, so no wait may outlast a live
peer: each side keeps a receive posted at all times on its own thread (never held up by the ring), and sends
something at least every third of ``timeout_s`` (a record, a HEARTBEAT, or a CREDIT 0 while its ring is full).
Backpressure of any length is therefore safe, while a peer that is gone (connection closed: at once) or frozen
(SIGSTOP, a host that vanished: nothing for ``timeout_s``) kills the edge. Any error is fatal to the edge: the
bridge writes its reason into the shared error buffer and exits; the stage on its ring then exits too
(``PeerDied``), and the coordinator raises ``StageDied`` naming the remote stage and host.
"""

from __future__ import annotations

import os
import queue
import threading
import time

from ringshm.errors import EdgeError, PeerDied, RingTimeout
from ringshm.transport.edge import (
    ABORT,
    BACKWARD_KINDS,
    CLOSE,
    CREDIT,
    CREDIT_WINDOW,
    FORWARD_KINDS,
    HEADER_WORDS,
    HEARTBEAT,
    RECORD,
    Edge,
    EdgeSpec,
    connect,
    pack_header,
    parse_header,
    record_seq,
)


class _Credits:
    """A count shared by two threads (the sender's credit; the receiver's records not yet credited back), and
    the failure of the thread that feeds it."""

    def __init__(self, n: int):
        self.n = n
        self.error: BaseException | None = None
        self.cond = threading.Condition()

    def add(self, n: int) -> None:
        with self.cond:
            self.n += n
            self.cond.notify()

    def fail(self, exc: BaseException) -> None:
        with self.cond:
            self.error = exc
            self.cond.notify()

    def take_all(self) -> int:
        """Take every credit there is (0 when none)."""
        with self.cond:
            n, self.n = self.n, 0
            return n

    def take(self, timeout_s: float) -> bool:
        """Take one credit, waiting up to ``timeout_s``; False when none came. Raises the receive thread's error."""
        with self.cond:
            self.cond.wait_for(lambda: self.n > 0 or self.error is not None, timeout=max(0.0, timeout_s))
            if self.error is not None:
                raise self.error
            if self.n > 0:
                self.n -= 1
                return True
            return False


def run_sender(ring, edge: Edge, timeout_s: float, upstream: str) -> None:
    """Rank 0: drain ``ring`` into the edge until a SHUTDOWN record has crossed (then CLOSE and return).

    ``upstream`` names the stage that produces the ring (for the ABORT reason when it dies).

    Raises:
        EdgeError: the edge broke (the peer's ABORT reason, a timeout, a closed connection, a bad message).
        PeerDied: the upstream stage is gone (after the far side was told).
    """
    import torch

    from ringshm.transport import messages as m

    period = timeout_s / 3
    credits = _Credits(CREDIT_WINDOW)

    def receive() -> None:
        h = torch.empty(HEADER_WORDS, dtype=torch.int64)
        try:
            while True:
                edge.recv(h)
                kind, _, _, nbytes, n = parse_header(h, BACKWARD_KINDS, 0)
                if kind == ABORT:
                    reason = torch.empty(nbytes, dtype=torch.uint8)
                    edge.recv(reason)
                    text = bytes(reason.numpy()).decode("utf-8", "replace")
                    raise EdgeError(f"{edge.where}: the far side gave up: {text}")
                credits.add(n)
        except BaseException as exc:
            credits.fail(exc)

    threading.Thread(target=receive, daemon=True, name="ringshm-edge-recv").start()
    count = 0
    last_sent = time.monotonic()
    while True:
        wait = last_sent + period - time.monotonic()
        if not credits.take(wait):
            edge.send(pack_header(HEARTBEAT, count))
            last_sent = time.monotonic()
            continue
        try:
            view = ring.peek(timeout_s=max(0.0, last_sent + period - time.monotonic()))
        except RingTimeout:
            credits.add(1)
            edge.send(pack_header(HEARTBEAT, count))
            last_sent = time.monotonic()
            continue
        except PeerDied:
            edge.abort(f"{upstream} exited")
            raise
        try:
            op, seq = record_seq(view)
            payload = torch.frombuffer(view, dtype=torch.uint8).clone()
        finally:
            del view
            ring.release()
        edge.send(pack_header(RECORD, count, seq, payload.numel()), payload)
        count += 1
        last_sent = time.monotonic()
        if op == m.SHUTDOWN:
            edge.send(pack_header(CLOSE, count))
            edge.flush()
            return


_CLOSED, _CREDIT = object(), object()
CREDIT_BATCH = CREDIT_WINDOW // 2  # the receiver returns credit in batches of this many records (or with a heartbeat)


def run_receiver(ring, edge: Edge, timeout_s: float, latency_ms: float, downstream: str) -> None:
    """Rank 1: write every record that crosses the edge into ``ring``, in order, until the sender's CLOSE.

    ``downstream`` names the stage that consumes the ring (for the ABORT reason when it dies). ``latency_ms``:
    each record is held this long after it arrived (emulated link latency).

    Two paths into the ring, one at a time (``producer`` lock), in arrival order: while nothing waits and the
    ring has room, the receive thread receives the record straight into its reservation (no copy, no
    hand-over); otherwise the record goes into a private buffer and the main thread writes it when there is
    room, sending heartbeats meanwhile. Credit goes back in batches of ``CREDIT_BATCH`` (and with every
    heartbeat).

    Raises:
        EdgeError: the edge broke (the peer's ABORT reason, a timeout, a closed connection, a header that
            breaks the wire: nothing of that message reaches the ring).
        PeerDied: the downstream stage is gone (after the far side was told).
    """
    import torch

    period = timeout_s / 3
    inbox: queue.Queue = queue.Queue()
    held = threading.Semaphore(CREDIT_WINDOW)  # records received and not yet written into the ring
    producer = threading.Lock()  # the ring's producer side
    queued, drained = [0], [0]  # records put into the inbox (receive thread) / written from it (main thread):
    # one writer each, so neither blocks; the difference is what waits, read under ``producer``
    freed = _Credits(0)  # records written into the ring and not yet credited back

    def written() -> None:
        held.release()
        freed.add(1)
        if freed.n >= CREDIT_BATCH:
            inbox.put(_CREDIT)  # only the main thread sends

    def check_seq(buf, seq: int, count: int) -> None:
        if record_seq(buf)[1] != seq:
            raise EdgeError(f"{edge.where}: record {count} says seq {seq} in the edge header and "
                            f"{record_seq(buf)[1]} in its own")

    def write_direct(nbytes: int, seq: int, count: int) -> bool:
        if latency_ms or not producer.acquire(blocking=False):
            return False
        try:
            view = None if queued[0] != drained[0] else ring.try_reserve(nbytes)
            if view is None:
                return False
            dst = torch.frombuffer(view, dtype=torch.uint8)
            edge.recv(dst)
            check_seq(view, seq, count)  # before the commit: a bad record never reaches the ring
            del dst, view
            ring.commit(nbytes)
        finally:
            producer.release()
        written()
        return True

    def receive() -> None:
        h = torch.empty(HEADER_WORDS, dtype=torch.int64)
        expect = 0
        try:
            while True:
                edge.recv(h)
                kind, count, seq, nbytes, _ = parse_header(h, FORWARD_KINDS, ring.max_record_bytes)
                if kind == HEARTBEAT:
                    continue
                if kind == CLOSE:
                    inbox.put(_CLOSED)
                    return
                if kind == ABORT:
                    reason = torch.empty(nbytes, dtype=torch.uint8)
                    edge.recv(reason)
                    raise EdgeError(f"{edge.where}: the far side gave up: "
                                    f"{bytes(reason.numpy()).decode('utf-8', 'replace')}")
                if count != expect:
                    raise EdgeError(f"{edge.where}: record {count} arrived, expected record {expect}")
                if not held.acquire(blocking=False):
                    raise EdgeError(f"{edge.where}: the sender overran its credit of {CREDIT_WINDOW} records")
                expect += 1
                if write_direct(nbytes, seq, count):
                    continue
                payload = torch.empty(nbytes, dtype=torch.uint8)
                edge.recv(payload)
                check_seq(payload.numpy(), seq, count)
                queued[0] += 1
                inbox.put((time.monotonic(), payload))
        except BaseException as exc:
            inbox.put(exc)

    threading.Thread(target=receive, daemon=True, name="ringshm-edge-recv").start()
    last_sent = time.monotonic()

    def send_credit() -> None:  # also the heartbeat (credit 0)
        nonlocal last_sent
        edge.send(pack_header(CREDIT, credits=freed.take_all()))
        last_sent = time.monotonic()

    while True:
        try:
            item = inbox.get(timeout=max(0.0, last_sent + period - time.monotonic()))
        except queue.Empty:
            send_credit()
            continue
        if item is _CLOSED:
            return
        if item is _CREDIT:
            if freed.n >= CREDIT_BATCH:
                send_credit()
            continue
        if isinstance(item, BaseException):
            raise item
        arrived, payload = item
        while (hold := arrived + latency_ms / 1e3 - time.monotonic()) > 0:
            time.sleep(min(hold, period))
        n = payload.numel()
        with producer:  # the receive thread does not wait for it: it queues meanwhile
            while True:
                try:
                    dst = ring.reserve(n, timeout_s=max(0.0, last_sent + period - time.monotonic()))
                    break
                except RingTimeout:
                    send_credit()
                except PeerDied:
                    edge.abort(f"{downstream} exited")
                    raise
            dst[:] = payload.numpy().data
            del dst
            ring.commit(n)
            drained[0] += 1
        written()


def bridge_main(spec: EdgeSpec, errors, peer_stage: str) -> None:
    """Process entry point of one bridge: attach the ring, form the edge, run until CLOSE or an error.

    ``errors``: the shared error buffer (``ringshm.transport.error_buffer``); on failure the reason goes
    into ``spec.error_slot`` and the process exits with code 1 (0 after a clean CLOSE). ``peer_stage`` names
    the local stage on the ring (for the far side's message when it dies).
    """
    import signal

    from setproctitle import setproctitle

    from ringshm.transport.error_buffer import write_error
    from ringshm.transport.ring import Ring
    from ringshm.transport.segment import exit_with_parent

    setproctitle(f"ringshm bridge edge {spec.edge} {'send' if spec.rank == 0 else 'recv'}")
    exit_with_parent()  # a bridge lives no longer than the engine or worker that started it
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # the coordinator / worker ends it, in order
        signal.signal(sig, signal.SIG_IGN)
    code = 1
    try:
        ring = Ring.attach(spec.ring, role="consumer" if spec.rank == 0 else "producer")
        edge = Edge(connect(spec), spec.rank, spec.timeout_s, spec.where)
        if spec.rank == 0:
            run_sender(ring, edge, spec.timeout_s, peer_stage)
        else:
            run_receiver(ring, edge, spec.timeout_s, spec.latency_ms, peer_stage)
        code = 0
    except BaseException as exc:  # noqa: BLE001 - whatever it was, it is this edge's end: report it
        write_error(errors, spec.error_slot, exc)
    finally:
        os._exit(code)  # skip interpreter teardown (gloo threads); the ring's peer sees this process gone
