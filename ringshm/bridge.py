"""Bridges: an edge of the pipeline between two hosts, carried over torch.distributed point-to-point.

Inside a host every hop is a shared-memory ring. An edge between hosts is a ring on each side and a pair of
bridge processes in between (DESIGN.md; vLLM's CPU path splits the same way: shm inside a node,
torch.distributed across nodes). The stage loop never learns which kind of hop it has:

            host A                                                   host B
    stage k-1 ──ring k──▶ [sending bridge] ══ gloo, edge k ══▶ [receiving bridge] ──ring k──▶ stage k

Edge ``k`` carries what ring ``k`` carries (its index is that ring's; edge ``stages`` carries the replies back
to the coordinator). Each edge is its own 2-rank gloo group (rank 0 sends records, rank 1 receives them), made
over the head's TCPStore under the session's key prefix. Order comes from the one TCP stream per direction,
never from tags (NCCL ignores them; gloo's are not needed).

Wire (no pickle). Every message is one int64 header tensor of ``HEADER_WORDS``::

    magic | version | kind | count | seq | nbytes | credits | reserved

then, for ``RECORD`` and ``ABORT``, ``nbytes`` of payload as one exact-size uint8 tensor: a ring record as it
is (its own header keeps the op's seq; the receiver checks it equals ``seq``), or the abort reason in UTF-8.

    rank 0 → rank 1: RECORD (count = records sent before it), HEARTBEAT, CLOSE (after a SHUTDOWN record),
                     ABORT (the local stage died: the reason)
    rank 1 → rank 0: CREDIT (records written into the ring since the last one, sent every CREDIT_BATCH
                     records or with a heartbeat; 0 is a heartbeat), ABORT

The receiver checks every header before it allocates anything: magic, version, a kind that direction may
carry, ``count`` in sequence, ``nbytes`` within its ring's largest record (``ABORT``: ``MAX_REASON_BYTES``),
and the sender's credit. A header that breaks any rule closes the edge; nothing reaches the ring.

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
import re
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass
from datetime import timedelta

from ringshm.errors import EdgeError, PeerDied, RingTimeout

HEADER_WORDS = 8
MAGIC = 0x52534845  # "EHSR"
VERSION = 1  # this wire; part of the HELLO's wire version (ringshm.cluster)
RECORD, HEARTBEAT, CREDIT, CLOSE, ABORT = 1, 2, 3, 4, 5
KIND_NAMES = {RECORD: "record", HEARTBEAT: "heartbeat", CREDIT: "credit", CLOSE: "close", ABORT: "abort"}
FORWARD_KINDS = frozenset({RECORD, HEARTBEAT, CLOSE, ABORT})  # what rank 0 may send
BACKWARD_KINDS = frozenset({CREDIT, ABORT})  # what rank 1 may send
CREDIT_WINDOW = 16  # records the receiver may hold outside its ring (its memory bound: 16 x the largest record)
SEND_WINDOW = 8  # sends in flight before the oldest is waited on (waits deferred)
MAX_REASON_BYTES = 4096
_RECORD_HEAD = struct.Struct("<HBBHBxIiQ")  # the leading fields of ringshm.messages.HEADER: magic .. seq


@dataclass(frozen=True)
class EdgeSpec:
    """One end of one edge, as plain values (pickled once by ``spawn``; the edge itself carries no pickle).

    ``edge``: the ring index it carries. ``rank``: 0 = the sending end, 1 = the receiving end. ``ring``: the
    local ring's segment name. ``store_*`` / ``session``: where the gloo group meets. ``bind_addr``: the local
    address gloo binds. ``timeout_s``: the edge timeout; ``connect_timeout_s``: how long forming the group may
    take. ``latency_ms``: emulated latency (receiving end). ``where``: how messages name the far side.
    ``error_slot``: this bridge's slot in the shared error buffer.
    """

    edge: int
    rank: int
    ring: str
    store_addr: str
    store_port: int
    session: str
    bind_addr: str
    timeout_s: float
    connect_timeout_s: float
    latency_ms: float = 0.0
    where: str = ""
    error_slot: int = 0


def pack_header(kind: int, count: int = 0, seq: int = 0, nbytes: int = 0, credits: int = 0):
    """The header tensor: int64 ``[HEADER_WORDS]``."""
    import torch

    return torch.tensor([MAGIC, VERSION, kind, count, seq, nbytes, credits, 0], dtype=torch.int64)


def parse_header(h, kinds: frozenset[int], max_record_bytes: int) -> tuple[int, int, int, int, int]:
    """``(kind, count, seq, nbytes, credits)`` of a received header, checked before anything is allocated.

    Raises:
        EdgeError: bad magic or version, a kind this direction may not carry, a negative field, or ``nbytes``
            over ``max_record_bytes`` (RECORD) / ``MAX_REASON_BYTES`` (ABORT) or non-zero for other kinds.
    """
    magic, version, kind, count, seq, nbytes, credits, _ = (int(v) for v in h.tolist())
    if magic != MAGIC:
        raise EdgeError(f"bad magic {magic:#x} on the edge (expected {MAGIC:#x}): not a ringshm bridge")
    if version != VERSION:
        raise EdgeError(f"edge wire version {version}, this side speaks {VERSION}: run the same ringshm everywhere")
    if kind not in kinds:
        raise EdgeError(f"message kind {kind} ({KIND_NAMES.get(kind, 'unknown')}) is not allowed in this direction")
    if min(count, seq, nbytes, credits) < 0:
        raise EdgeError(f"negative field in a {KIND_NAMES[kind]} header: count {count}, seq {seq}, nbytes {nbytes}, "
                        f"credits {credits}")
    limit = max_record_bytes if kind == RECORD else MAX_REASON_BYTES if kind == ABORT else 0
    if nbytes > limit or (kind == RECORD and nbytes < _RECORD_HEAD.size):
        raise EdgeError(f"a {KIND_NAMES[kind]} of {nbytes} bytes is outside [{_RECORD_HEAD.size if kind == RECORD else 0}"
                        f", {limit}] (the local ring's largest record): refused before allocating it")
    if credits > CREDIT_WINDOW:
        raise EdgeError(f"a credit of {credits} is over the window of {CREDIT_WINDOW}")
    return kind, count, seq, nbytes, credits


def _gloo_error(exc: BaseException, timeout_s: float) -> str:
    """A short reason for a gloo failure (its first line, plus what it means)."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    text = re.sub(r"^\[[^\]]*\]\s*", "", text)  # gloo's "[/path/file.cc:78] " prefix
    text = text.split(". This is typically")[0]  # gloo's generic advice after the fact
    if "Timed out" in text or "timeout" in text:
        return f"nothing heard for {timeout_s:g} s (the far side is frozen or unreachable; edge_timeout_s): {text}"
    if "closed" in text.lower() or "reset" in text.lower():
        return f"the connection was closed (the far side exited or was killed): {text}"
    return text


class Edge:
    """The gloo group of one edge as seen from one end: sends with deferred waits, receives with a timeout.

    Sends come from one thread, receives from another (each end has both). Every wait is bounded by
    ``timeout_s``; a failure raises ``EdgeError`` naming ``where``.
    """

    def __init__(self, pg, rank: int, timeout_s: float, where: str):
        self.pg, self.peer = pg, 1 - rank
        self.timeout_s = timeout_s
        self._timeout = timedelta(seconds=timeout_s)
        self.where = where
        self._sends: deque = deque()

    def send(self, *tensors) -> None:
        """Post ``tensors`` in order; wait for the oldest posted send while more than ``SEND_WINDOW`` are open."""
        try:
            for t in tensors:
                self._sends.append((self.pg.send([t], self.peer, 0), t))
            while len(self._sends) > SEND_WINDOW:
                self._sends.popleft()[0].wait(self._timeout)
        except RuntimeError as exc:
            raise EdgeError(f"{self.where}: {_gloo_error(exc, self.timeout_s)}") from None

    def flush(self) -> None:
        """Wait until every posted send has completed."""
        try:
            while self._sends:
                self._sends.popleft()[0].wait(self._timeout)
        except RuntimeError as exc:
            raise EdgeError(f"{self.where}: {_gloo_error(exc, self.timeout_s)}") from None

    def recv(self, t) -> None:
        """Receive into ``t`` (exact size), waiting at most ``timeout_s``."""
        try:
            self.pg.recv([t], self.peer, 0).wait(self._timeout)
        except RuntimeError as exc:
            raise EdgeError(f"{self.where}: {_gloo_error(exc, self.timeout_s)}") from None

    def abort(self, reason: str) -> None:
        """Tell the far side why this end gives up (best effort), then return."""
        import torch

        data = reason.encode("utf-8", "replace")[:MAX_REASON_BYTES]
        try:
            self.send(pack_header(ABORT, nbytes=len(data)), torch.frombuffer(bytearray(data), dtype=torch.uint8)
                      if data else torch.empty(0, dtype=torch.uint8))
            self.flush()
        except EdgeError:
            pass


def connect(spec: EdgeSpec):
    """The edge's 2-rank gloo group (TCPStore client to the head, a key prefix per session and edge).

    Raises:
        EdgeError: the store or the peer did not answer within ``connect_timeout_s``.
    """
    import torch.distributed as dist

    timeout = timedelta(seconds=spec.connect_timeout_s)
    try:
        store = dist.TCPStore(spec.store_addr, spec.store_port, None, False, timeout, wait_for_workers=False)
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout  # forming the group; every later wait passes the edge timeout itself
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=spec.bind_addr)]
        return dist.ProcessGroupGloo(dist.PrefixStore(f"ringshm/{spec.session}/edge{spec.edge}/", store),
                                     spec.rank, 2, opts)
    except (RuntimeError, ValueError) as exc:
        raise EdgeError(f"{spec.where}: could not form the edge within {spec.connect_timeout_s:g} s: "
                        f"{_gloo_error(exc, spec.connect_timeout_s)}") from None


def _record_seq(buf) -> tuple[int, int]:
    """(op, seq) from a ring record's header."""
    from ringshm import messages as m

    magic, version, op, _flags, _nt, _job, _nseg, seq = _RECORD_HEAD.unpack_from(buf, 0)
    if magic != m.MAGIC or version != m.VERSION:
        raise EdgeError(f"a record with magic {magic:#x} version {version} crossed the edge (expected "
                        f"{m.MAGIC:#x} version {m.VERSION})")
    return op, seq


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

    from ringshm import messages as m

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
                    raise EdgeError(f"{edge.where}: the far side gave up: {bytes(reason.numpy()).decode('utf-8', 'replace')}")
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
            op, seq = _record_seq(view)
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
        if _record_seq(buf)[1] != seq:
            raise EdgeError(f"{edge.where}: record {count} says seq {seq} in the edge header and "
                            f"{_record_seq(buf)[1]} in its own")

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

    ``errors``: the shared error buffer (``ringshm.stage.ERROR_BYTES`` per slot); on failure the reason goes
    into ``spec.error_slot`` and the process exits with code 1 (0 after a clean CLOSE). ``peer_stage`` names
    the local stage on the ring (for the far side's message when it dies).
    """
    import signal

    from setproctitle import setproctitle

    from ringshm.ring import Ring
    from ringshm.stage import write_error

    setproctitle(f"ringshm bridge edge {spec.edge} {'send' if spec.rank == 0 else 'recv'}")
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
