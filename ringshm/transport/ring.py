"""``Ring``: the shared-memory SPSC ring as bytes in, bytes or zero-copy views out. No torch here.

One process is the producer and one the consumer (the same process may be both, e.g. in tests). A side is
claimed on first use (or up front with ``role=``); a second live process that tries to take a claimed side
gets ``RoleTaken``. Blocking calls take ``timeout_s`` (None: no deadline) and re-check the peer at least
every ``LIVENESS_PERIOD_S``; they raise ``PeerDied`` when the peer process is gone or has closed its side,
and ``RingTimeout`` when the deadline passes with the peer alive. One thread may drive the producer side while
another drives the consumer side of the same ``Ring``; two threads on one side need a lock of their own.
"""

from __future__ import annotations

import os
import time
import weakref

from ringshm import errors
from ringshm._C import ffi, lib
from ringshm.errors import PeerDied, RingStateError, RingTimeout, RoleTaken, check_status
from ringshm.transport.segment import Segment, is_alive, self_start_time

PRODUCER = lib.RINGSHM_PRODUCER
CONSUMER = lib.RINGSHM_CONSUMER
_ROLE_NAMES = {"producer": PRODUCER, "consumer": CONSUMER}

LIVENESS_PERIOD_S = 0.1  # a blocked call re-checks its peer at least this often (issue 2)
DEFAULT_SPIN = 5000  # most pause-loop iterations before parking: ~70 us at the ~14 ns per pause measured here
# (a futex wake costs ~40 us per hop on these VMs, so a peer that answers within the spin saves that)
PROBE_EVERY = 64  # after this many parks in a row, one wait spins the full DEFAULT_SPIN again
_READY_AFTER_SLEEP = lib.RINGSHM_READY_AFTER_SLEEP
HEADER_BYTES = int(lib.ringshm_ring_segment_bytes(0))  # the header precedes the data area


class Ring:
    """A mapped ring. Make one with ``Ring.create`` (owns the segment name) or ``Ring.attach``.

    Attributes:
        name: the segment name to pass to ``Ring.attach`` in another process.
        capacity_bytes: size of the data area (a power of two).
        max_record_bytes: largest payload one record can carry (capacity_bytes - 8).
        max_spin: most pause-loop iterations a blocked call spins before it sleeps on the futex.

    Spinning is adaptive: a wait whose peer answered within the spin doubles the next spin (up to
    max_spin); a wait that had to park halves it, and every PROBE_EVERY parks one wait spins max_spin
    again. With free cores the spin catches the peer (no wake syscall); with more processes than cores a
    spinning waiter would only delay the peer it waits for, and the spin shrinks towards zero.
    """

    def __init__(self, segment: Segment, *, spin: int = DEFAULT_SPIN, role: str | None = None):
        self._segment = segment
        self._h = ffi.new("ringshm_ring *")
        self._base = ffi.from_buffer(segment.buf)
        try:
            check_status(lib.ringshm_ring_open(self._h, self._base, segment.size_bytes), f"ring {segment.name}")
        except BaseException:
            ffi.release(self._base)
            segment.close()
            raise
        self.name = segment.name
        self.capacity_bytes = int(self._h.capacity)
        self.max_record_bytes = int(lib.ringshm_ring_max_record(self._h.capacity))
        self.max_spin = spin
        self._data = memoryview(segment.buf)[HEADER_BYTES : HEADER_BYTES + self.capacity_bytes]
        self._data_ptr = self._h.data
        # Per-side scratch and wait state: one thread may produce while another consumes the same Ring.
        self._w, self._r = _Side(spin), _Side(spin)
        self._roles: set[int] = set()
        # One slot per side: a process holding both sides must not lose its reservation to a release.
        self._write_view: memoryview | None = None  # the view of the open reservation
        self._read_view: memoryview | None = None  # the view of the peeked record
        # A creator that forgets close() still removes the name when the object is collected or at exit.
        self._finalizer = weakref.finalize(self, segment.unlink) if segment.owner else None
        if role is not None:
            self.claim(role)

    # ----------------------------------------------------------------------------------------------- life
    @classmethod
    def create(
        cls, capacity_bytes: int, *, role: str | None = None, spin: int = DEFAULT_SPIN, start_index: int = 0,
        tag: str = "",
    ) -> "Ring":
        """Create a ring with a data area of ``capacity_bytes`` in a new 0600 segment.

        Args:
            capacity_bytes: a power of two >= 64; records up to ``capacity_bytes - 8`` bytes fit.
            role: claim 'producer' or 'consumer' now instead of on first use.
            start_index: initial value of both 64-bit byte counters (tests use values near 2**64 to
                exercise counter wraparound); rounded up to a multiple of 8.
            tag: the host tag in the segment's name (``Segment.create``).

        Raises:
            ValueError: capacity_bytes is not a power of two >= 64, or start_index is not in [0, 2**64).
        """
        if capacity_bytes < 64 or capacity_bytes & (capacity_bytes - 1):
            raise ValueError(f"capacity_bytes must be a power of two >= 64, got {capacity_bytes}")
        if not 0 <= start_index < 2**64:
            raise ValueError(f"start_index must be in [0, 2**64), got {start_index}")
        seg = Segment.create(int(lib.ringshm_ring_segment_bytes(capacity_bytes)), tag)
        try:
            base = ffi.from_buffer(seg.buf)
            check_status(lib.ringshm_ring_init(base, seg.size_bytes, capacity_bytes, start_index))
            ffi.release(base)
        except BaseException:
            seg.close()
            seg.unlink()
            raise
        return cls(seg, spin=spin, role=role)

    @classmethod
    def attach(cls, name: str, *, role: str | None = None, spin: int = DEFAULT_SPIN) -> "Ring":
        """Map the ring another process created.

        Raises:
            FileNotFoundError: no segment of that name.
            SegmentMismatch: the segment holds no ring of this layout (bad magic, version or capacity).
        """
        return cls(Segment.attach(name), spin=spin, role=role)

    def close(self) -> None:
        """Mark this process's sides closed (a blocked peer gets ``PeerDied``) and unmap. Idempotent.

        The creator's name stays until ``unlink()`` (or until the object is collected). A view still held
        by the caller keeps the mapping alive (no dangling memory); it is unmapped when the view goes.
        """
        if self._h is None:
            return
        for role in self._roles:
            lib.ringshm_ring_close_side(self._h, role)
        self._write_view = _released(self._write_view)
        self._read_view = _released(self._read_view)
        self._data.release()
        ffi.release(self._base)
        self._h = None
        self._segment.close()

    def unlink(self) -> None:
        """Remove the segment's name (creator only; otherwise a no-op). Mappings stay valid. Idempotent."""
        self._segment.unlink()
        if self._finalizer is not None:
            self._finalizer.detach()

    def __enter__(self) -> "Ring":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
        self.unlink()

    def __repr__(self) -> str:
        state = "closed" if self._h is None else f"used={self.used_bytes()}"
        return f"Ring({self.name!r}, capacity_bytes={self.capacity_bytes}, {state})"

    # -------------------------------------------------------------------------------------- producer side
    def try_reserve(self, n: int) -> memoryview | None:
        """Reserve a writable, contiguous view of ``n`` bytes, or None when the ring is too full now.

        The view is invisible to the consumer until ``commit()``; it is valid until then.

        Raises:
            RecordTooLarge: n > max_record_bytes (it could never fit).
            RingStateError: a reservation is already open, or the ring is closed.
            RingCorrupt: the shared indices are out of bounds.
        """
        off = self._try_reserve_offset(n, "reserve")
        if off is None:
            return None
        self._write_view = view = self._data[off : off + n]
        return view

    def _try_reserve_offset(self, n: int, what: str) -> int | None:
        """The C reserve: the payload's offset in the data area, or None when the ring is too full now."""
        st = lib.ringshm_ring_try_reserve(self._producer(), n, self._w.off)
        if st:
            if st < 0:
                check_status(st, f"{what} {n} bytes on {self.name}")
            return None
        return self._w.off[0]

    def reserve(self, n: int, timeout_s: float | None = None) -> memoryview:
        """Blocking ``try_reserve``: wait for room until ``timeout_s`` (None: no deadline).

        Raises:
            RingTimeout: still no room after timeout_s seconds, consumer alive.
            PeerDied: the consumer process is gone or closed the ring.
            RecordTooLarge, RingStateError, RingCorrupt: as try_reserve.
        """
        view = self.try_reserve(n)
        if view is not None:
            return view
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            st = lib.ringshm_ring_wait_writable(self._h, n, self._slice_ns(deadline), self._w.spin)
            if st < 0:
                self._raise_wait_error(st, CONSUMER)
            self._w.adapt_spin(st, self.max_spin)
            view = self.try_reserve(n)
            if view is not None:
                return view
            self._check_blocked(self._w, deadline, CONSUMER, f"no room for {n} bytes")

    def commit(self, n: int | None = None) -> None:
        """Publish the first ``n`` bytes (default: all) of the open reservation.

        Raises:
            RingStateError: no open reservation, or n larger than reserved.
        """
        if self._h is None:
            raise RingStateError(f"ring {self.name} is closed")
        if n is None:
            n = self._h.write_max
        # A refused commit (n too large) leaves the reservation open, so its view stays usable.
        check_status(lib.ringshm_ring_commit(self._h, n), f"commit {n} bytes on {self.name}")
        self._write_view = _released(self._write_view)

    def try_send(self, buf) -> bool:
        """Copy ``buf`` (any C-contiguous buffer) into one record and publish it; False when full now."""
        src = memoryview(buf)
        n = src.nbytes
        off = self._try_reserve_offset(n, "send")
        if off is None:
            return False
        ffi.memmove(self._data_ptr + off, src, n)
        lib.ringshm_ring_commit(self._h, n)
        return True

    def send(self, buf, timeout_s: float | None = None) -> None:
        """Copy ``buf`` (any C-contiguous buffer) into one record and publish it, waiting for room.

        Raises:
            RingTimeout, PeerDied, RecordTooLarge, RingCorrupt: as ``reserve``.
        """
        if self.try_send(buf):
            return
        n = memoryview(buf).nbytes
        self.reserve(n, timeout_s)
        ffi.memmove(self._data_ptr + self._w.off[0], buf, n)
        self.commit(n)

    # -------------------------------------------------------------------------------------- consumer side
    def try_peek(self) -> memoryview | None:
        """A read-only, zero-copy view of the oldest record, or None when the ring is empty.

        The view is valid until ``release()``, which also invalidates it (using it afterwards raises
        ValueError instead of reading bytes the producer may be overwriting). Peeking again without a
        release returns the same record.

        Raises:
            RingCorrupt: an index or record header failed its bounds checks.
            RingStateError: the ring is closed.
        """
        h = self._consumer()
        st = lib.ringshm_ring_try_peek(h, self._r.off, self._r.len)
        if st:
            if st < 0:
                check_status(st, f"peek on {self.name}")
            return None
        off = self._r.off[0]
        self._read_view = _released(self._read_view)
        self._read_view = view = self._data[off : off + self._r.len[0]].toreadonly()
        return view

    def peek(self, timeout_s: float | None = None) -> memoryview:
        """Blocking ``try_peek``: wait for a record until ``timeout_s`` (None: no deadline).

        Raises:
            RingTimeout: still empty after timeout_s seconds, producer alive.
            PeerDied: empty and the producer process is gone or closed the ring.
            RingCorrupt, RingStateError: as try_peek.
        """
        view = self.try_peek()
        if view is not None:
            return view
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            st = lib.ringshm_ring_wait_readable(self._h, self._slice_ns(deadline), self._r.spin)
            if st < 0:
                self._raise_wait_error(st, PRODUCER)
            self._r.adapt_spin(st, self.max_spin)
            view = self.try_peek()
            if view is not None:
                return view
            self._check_blocked(self._r, deadline, PRODUCER, "no record")

    def release(self) -> None:
        """Free the peeked record (and invalidate its view).

        Raises:
            RingStateError: nothing is peeked, or the ring is closed.
        """
        if self._h is None:
            raise RingStateError(f"ring {self.name} is closed")
        self._read_view = _released(self._read_view)
        check_status(lib.ringshm_ring_release(self._h), f"release on {self.name}")

    def try_recv(self) -> bytes | None:
        """The oldest record as ``bytes`` (a copy; the record is released), or None when empty."""
        view = self.try_peek()
        if view is None:
            return None
        data = bytes(view)
        self.release()
        return data

    def recv(self, timeout_s: float | None = None) -> bytes:
        """The oldest record as ``bytes`` (a copy; the record is released at once), waiting for one.

        For zero-copy reads use ``peek()`` / ``release()``.

        Raises:
            RingTimeout, PeerDied, RingCorrupt: as ``peek``.
        """
        data = bytes(self.peek(timeout_s))
        self.release()
        return data

    def claim(self, role: str) -> None:
        """Take the 'producer' or 'consumer' side now (otherwise the first call of that side takes it).

        Raises:
            ValueError: an unknown role. RoleTaken: another live process holds that side.
        """
        if role not in _ROLE_NAMES:
            raise ValueError(f"role must be 'producer' or 'consumer', got {role!r}")
        if _ROLE_NAMES[role] not in self._roles:
            self._claim(_ROLE_NAMES[role])

    # ---------------------------------------------------------------------------------------- inspection
    def used_bytes(self) -> int:
        """Bytes published and not yet released, record headers and pads included."""
        status = ffi.new("int *")
        used = lib.ringshm_ring_used(self._live(), status)
        check_status(status[0], f"used bytes of {self.name}")
        return int(used)

    def peer(self, role: str) -> tuple[int, bool]:
        """(pid, closed) of the process holding ``role`` ('producer' or 'consumer'); pid 0 = unclaimed."""
        pid, _start, closed = self._peer(_ROLE_NAMES[role])
        return pid, closed

    # ------------------------------------------------------------------------------------------- private
    def _live(self):
        if self._h is None:
            raise RingStateError(f"ring {self.name} is closed")
        return self._h

    def _producer(self):
        if PRODUCER not in self._roles:
            self._claim(PRODUCER)
        return self._live()

    def _consumer(self):
        if CONSUMER not in self._roles:
            self._claim(CONSUMER)
        return self._live()

    def _claim(self, role: int) -> None:
        holder = ffi.new("int32_t *")
        check_status(lib.ringshm_ring_claim(self._live(), role, os.getpid(), self_start_time(), holder))
        if holder[0] != os.getpid():
            side = "producer" if role == PRODUCER else "consumer"
            state = "alive" if is_alive(holder[0]) else "gone; create a new ring"
            raise RoleTaken(f"the {side} side of ring {self.name} is held by pid {holder[0]} ({state})")
        self._roles.add(role)

    def _peer(self, role: int) -> tuple[int, int, bool]:
        pid, start, closed = ffi.new("int32_t *"), ffi.new("uint64_t *"), ffi.new("int32_t *")
        check_status(lib.ringshm_ring_peer(self._live(), role, pid, start, closed))
        return pid[0], start[0], bool(closed[0])

    @staticmethod
    def _slice_ns(deadline: float | None) -> int:
        """Nanoseconds to sleep in one futex wait: the time left, capped at the liveness period."""
        if deadline is None:
            return int(LIVENESS_PERIOD_S * 1e9)
        return max(0, int(min(deadline - time.monotonic(), LIVENESS_PERIOD_S) * 1e9))

    def _raise_wait_error(self, status: int, peer_role: int) -> None:
        side = "producer" if peer_role == PRODUCER else "consumer"
        if status == errors.ERR_PEER_CLOSED:
            raise PeerDied(f"the {side} of ring {self.name} closed it")
        check_status(status, f"wait on {self.name}")

    def _check_blocked(self, side: "_Side", deadline: float | None, peer_role: int, what: str) -> None:
        """Between waits: raise PeerDied if the peer is gone (checked at most every LIVENESS_PERIOD_S),
        RingTimeout if the deadline passed."""
        now = time.monotonic()
        if now - side.last_peer_check >= LIVENESS_PERIOD_S:
            side.last_peer_check = now
            pid, start, closed = self._peer(peer_role)
            peer = "producer" if peer_role == PRODUCER else "consumer"
            gone = closed or (pid and not is_alive(pid, start))
            if gone and peer_role == PRODUCER and self.used_bytes():
                # Published just before the producer left (after our last empty check): deliver it first.
                side.last_peer_check = 0.0
                return
            if closed:
                raise PeerDied(f"the {peer} of ring {self.name} closed it")
            if gone:
                raise PeerDied(f"the {peer} of ring {self.name} (pid {pid}) is gone")
        if deadline is not None and now >= deadline:
            raise RingTimeout(f"{what} on ring {self.name} after the timeout")


class _Side:
    """One side's scratch (C out-parameters) and wait state, so two threads can each drive one side."""

    __slots__ = ("off", "len", "spin", "parks", "last_peer_check")

    def __init__(self, spin: int):
        self.off = ffi.new("uint64_t *")
        self.len = ffi.new("uint64_t *")
        self.spin = spin
        self.parks = 0
        self.last_peer_check = 0.0

    def adapt_spin(self, status: int, max_spin: int) -> None:
        """Double the spin after a wait the spin caught; halve it after one that parked (see Ring)."""
        if status == 0:  # RINGSHM_OK: ready while spinning
            self.parks = 0
            self.spin = min(max_spin, max(2 * self.spin, 64))
        else:
            self.parks += 1
            self.spin = max_spin if self.parks % PROBE_EVERY == 0 else self.spin // 2


def _released(view: memoryview | None) -> None:
    """Release a view handed out by peek/reserve, so that using it afterwards raises ValueError."""
    if view is not None:
        try:
            view.release()
        except BufferError:  # the caller built something on it (e.g. torch.frombuffer); it stays valid
            pass
    return None
