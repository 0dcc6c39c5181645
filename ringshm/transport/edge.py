"""The edge between two hosts: its wire format and its 2-rank gloo group (``ringshm.transport.bridge`` runs its ends).

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

A gloo wait that times out closes the pair for good: every wait here passes the edge timeout, and
``ringshm.transport.bridge`` keeps each side talking often enough that a live peer never trips it.
"""

from __future__ import annotations

import re
from collections import deque
from dataclasses import dataclass
from datetime import timedelta

from ringshm.errors import EdgeError
from ringshm.transport import messages as m

HEADER_WORDS = 8
MAGIC = 0x52534845  # "EHSR"
VERSION = 1  # this wire; part of the HELLO's wire version (ringshm.transport.cluster)
RECORD, HEARTBEAT, CREDIT, CLOSE, ABORT = 1, 2, 3, 4, 5
KIND_NAMES = {RECORD: "record", HEARTBEAT: "heartbeat", CREDIT: "credit", CLOSE: "close", ABORT: "abort"}
FORWARD_KINDS = frozenset({RECORD, HEARTBEAT, CLOSE, ABORT})  # what rank 0 may send
BACKWARD_KINDS = frozenset({CREDIT, ABORT})  # what rank 1 may send
CREDIT_WINDOW = 16  # records the receiver may hold outside its ring (its memory bound: 16 x the largest record)
SEND_WINDOW = 8  # sends in flight before the oldest is waited on (waits deferred)
MAX_REASON_BYTES = 4096


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
    if nbytes > limit or (kind == RECORD and nbytes < m.HEADER.size):
        raise EdgeError(f"a {KIND_NAMES[kind]} of {nbytes} bytes is outside [{m.HEADER.size if kind == RECORD else 0}"
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


def record_seq(buf) -> tuple[int, int]:
    """(op, seq) from a ring record's header."""
    magic, version, op, *_, seq = m.HEADER.unpack_from(buf, 0)[:8]
    if magic != m.MAGIC or version != m.VERSION:
        raise EdgeError(f"a record with magic {magic:#x} version {version} crossed the edge (expected "
                        f"{m.MAGIC:#x} version {m.VERSION})")
    return op, seq
