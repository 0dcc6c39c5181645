"""Single-process unit tests of ``ringshm.Ring``: boundaries, padding, counter wraparound, errors, and a
hypothesis state machine of the index arithmetic against a plain Python model of the layout in
csrc/ring.h.

One process may hold both sides of a ring, so most tests drive producer and consumer from one handle;
tests that need two handles (a "peer") attach a second one in the same process.
"""

from __future__ import annotations

import random
import struct
import time
from collections import deque

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from ringshm import Ring
from ringshm.errors import (
    PeerDied,
    RecordTooLarge,
    RingshmError,
    RingStateError,
    RingTimeout,
    SegmentMismatch,
)
from ringshm.transport.segment import Segment, list_segments

# Layout from csrc/ring.h, restated here so that the tests check it rather than borrow it.
HEADER_BYTES = 512
RECORD_HEADER = 8
OFF_MAGIC, OFF_VERSION, OFF_ALIGN, OFF_CAPACITY, OFF_HEADER_BYTES = 0, 8, 12, 16, 24
OFF_HEAD, OFF_TAIL = 128, 256
OFF_PRODUCER_START = 416
TAG_DATA, TAG_PAD = 0x41544144, 0x44444150
U64 = 2**64

# Generous bounds for waits that are not the subject of a test (shared, noisy 2-core machines).
SLACK_S = 1.0


def align8(n: int) -> int:
    return (n + 7) & ~7


def record_bytes(n_payload: int) -> int:
    """Bytes a record of n_payload bytes takes in the data area: header + payload, 8-byte aligned."""
    return align8(RECORD_HEADER + n_payload)


class RawHeader:
    """A second mapping of a ring's segment, to read and write header fields and data bytes directly."""

    def __init__(self, name: str):
        self.seg = Segment.attach(name)
        self.buf = self.seg.buf

    def u64(self, off: int) -> int:
        return struct.unpack_from("<Q", self.buf, off)[0]

    def put_u64(self, off: int, value: int) -> None:
        struct.pack_into("<Q", self.buf, off, value)

    def put_u32(self, off: int, value: int) -> None:
        struct.pack_into("<I", self.buf, off, value)

    def record_header(self, data_off: int) -> tuple[int, int]:
        """(len, tag) of the record header at data_off in the data area."""
        return struct.unpack_from("<II", self.buf, HEADER_BYTES + data_off)

    def data(self, data_off: int, n: int) -> bytes:
        return bytes(self.buf[HEADER_BYTES + data_off : HEADER_BYTES + data_off + n])

    def close(self) -> None:
        self.seg.close()


pytestmark = pytest.mark.usefixtures("no_segment_left_behind")


@pytest.fixture
def ring():
    with Ring.create(256) as r:
        yield r


@pytest.fixture
def raw(ring):
    h = RawHeader(ring.name)
    yield h
    h.close()


# ------------------------------------------------------------------------------------------ empty / full
def test_new_ring_is_empty_and_try_calls_return_none(ring):
    assert ring.used_bytes() == 0
    assert ring.try_peek() is None
    assert ring.try_recv() is None
    assert ring.capacity_bytes == 256
    assert ring.max_record_bytes == 256 - RECORD_HEADER


def test_ring_holds_exactly_capacity_over_record_size_records_then_refuses_until_one_is_received(ring):
    payload = 24  # record_bytes(24) == 32: eight records fill 256 bytes exactly
    sent = [bytes([i]) * payload for i in range(8)]
    assert all(ring.try_send(p) for p in sent)
    assert ring.used_bytes() == 256
    assert ring.try_send(b"") is False  # not even an empty record (8 bytes) fits
    assert ring.try_reserve(0) is None
    assert ring.try_recv() == sent[0]
    assert ring.used_bytes() == 256 - 32
    assert ring.try_send(b"z" * payload) is True
    assert [ring.try_recv() for _ in range(8)] == sent[1:] + [b"z" * payload]
    assert ring.try_recv() is None
    assert ring.used_bytes() == 0


def test_empty_record_round_trips_and_takes_one_header(ring):
    assert ring.try_send(b"")
    assert ring.used_bytes() == RECORD_HEADER
    assert ring.try_recv() == b""
    assert ring.used_bytes() == 0


# ------------------------------------------------------------------------------------------- exact fit
def test_record_of_max_record_bytes_fills_an_empty_ring_exactly(ring, raw):
    payload = bytes(range(ring.max_record_bytes))
    assert ring.try_send(payload)
    assert ring.used_bytes() == ring.capacity_bytes
    assert ring.try_send(b"") is False
    assert raw.record_header(0) == (ring.max_record_bytes, TAG_DATA)
    assert ring.try_recv() == payload
    assert ring.used_bytes() == 0


def test_record_that_ends_exactly_at_the_end_of_the_data_area_needs_no_pad(ring, raw):
    assert ring.try_send(b"a" * 56)  # 64 bytes at [0, 64)
    assert ring.try_recv() == b"a" * 56
    tail_fit = ring.capacity_bytes - 64 - RECORD_HEADER  # 184 bytes: a record at [64, 256)
    assert ring.try_send(b"b" * tail_fit)
    assert ring.used_bytes() == ring.capacity_bytes - 64
    assert raw.record_header(64) == (tail_fit, TAG_DATA)
    assert ring.try_recv() == b"b" * tail_fit
    assert ring.try_send(b"c")  # the next record starts at offset 0 again
    assert raw.record_header(0) == (1, TAG_DATA)
    assert ring.try_recv() == b"c"


def test_max_record_when_the_head_is_not_at_zero_publishes_a_pad_first_then_fits_once_the_pad_is_skipped(
    ring, raw
):
    assert ring.try_send(b"x" * 8)  # 16 bytes at [0, 16)
    assert ring.try_recv() == b"x" * 8
    big = bytes(range(ring.max_record_bytes))
    assert ring.try_send(big) is False  # room for the pad only: it is published alone
    assert ring.used_bytes() == ring.capacity_bytes - 16
    assert raw.record_header(16) == (ring.capacity_bytes - 16 - RECORD_HEADER, TAG_PAD)
    assert ring.try_send(big) is False  # the unread pad still takes the room
    assert ring.try_recv() is None  # the consumer skips the pad: nothing to return
    assert ring.used_bytes() == 0
    assert ring.try_send(big) is True
    assert ring.used_bytes() == ring.capacity_bytes
    assert ring.try_recv() == big


# ------------------------------------------------------------------------------------------- padding
def test_record_that_does_not_fit_before_the_end_is_placed_at_offset_zero_after_a_pad(ring, raw):
    a, b, c = b"A" * 100, b"B" * 100, bytes(range(40))
    assert ring.try_send(a) and ring.try_send(b)  # [0, 112) and [112, 224)
    assert ring.try_recv() == a  # tail at 112; head at 224, 32 bytes before the end
    assert ring.try_send(c)  # 48 bytes do not fit in 32: pad [224, 256), record [0, 48)
    assert ring.used_bytes() == 112 + 32 + 48  # B + pad + C
    assert raw.record_header(224) == (32 - RECORD_HEADER, TAG_PAD)
    assert raw.record_header(0) == (40, TAG_DATA)
    assert raw.data(RECORD_HEADER, 40) == c
    assert ring.try_recv() == b
    view = ring.try_peek()  # skips the pad, returns C as one contiguous span
    assert view.contiguous and view.readonly
    assert bytes(view) == c
    assert ring.used_bytes() == 48  # the pad is freed as soon as the consumer skips it
    ring.release()
    assert ring.used_bytes() == 0


def test_pad_is_not_visible_before_the_record_that_needed_it_is_committed(ring, raw):
    assert ring.try_send(b"A" * 200)  # [0, 208)
    assert ring.try_recv() == b"A" * 200
    view = ring.try_reserve(100)  # 112 bytes: pad [208, 256), record at [0, 112)
    assert view is not None
    assert ring.used_bytes() == 0 and ring.try_peek() is None
    view[:] = b"R" * 100
    ring.commit()
    assert ring.used_bytes() == 48 + 112
    assert ring.try_recv() == b"R" * 100


# ----------------------------------------------------------------------------------- counters near 2^64
@pytest.mark.parametrize("k", [8, 64, 1000, 4096])
def test_counters_started_near_two_to_the_64_wrap_and_every_record_comes_out_in_order(k):
    start = U64 - align8(k)
    rng = random.Random(k)
    with Ring.create(256, start_index=start) as ring:
        raw = RawHeader(ring.name)
        try:
            assert raw.u64(OFF_HEAD) == raw.u64(OFF_TAIL) == start
            pending: deque[bytes] = deque()
            n_out = 0
            for i in range(3000):
                msg = i.to_bytes(4, "little") + rng.randbytes(rng.randrange(0, ring.max_record_bytes - 3))
                while not ring.try_send(msg):  # full (or a pad went out): drain some
                    for _ in range(rng.randrange(1, 4)):
                        got = ring.try_recv()
                        if got is not None:
                            assert got == pending.popleft()
                            n_out += 1
                pending.append(msg)
            while pending:
                assert ring.try_recv() == pending.popleft()
                n_out += 1
            head, tail = raw.u64(OFF_HEAD), raw.u64(OFF_TAIL)
            assert n_out == 3000
            assert head == tail
            assert head < start  # the counters went past 2^64 and wrapped to small values
            assert ring.used_bytes() == 0
        finally:
            raw.close()


def test_start_index_is_rounded_up_to_the_record_alignment_modulo_two_to_the_64():
    with Ring.create(64, start_index=U64 - 3) as ring:  # rounds up to 2^64, i.e. 0
        raw = RawHeader(ring.name)
        try:
            assert raw.u64(OFF_HEAD) == raw.u64(OFF_TAIL) == 0
            assert ring.try_send(b"ok") and ring.try_recv() == b"ok"
        finally:
            raw.close()


@pytest.mark.parametrize("bad", [-1, U64])
def test_start_index_outside_the_64_bit_range_is_a_value_error(bad):
    with pytest.raises(ValueError, match="start_index"):
        Ring.create(64, start_index=bad)


@pytest.mark.parametrize("bad", [0, 32, 63, 100, 1000])
def test_capacity_that_is_not_a_power_of_two_of_at_least_64_is_a_value_error(bad):
    with pytest.raises(ValueError, match="capacity_bytes"):
        Ring.create(bad)


# ----------------------------------------------------------------------------------------------- oversize
@pytest.mark.parametrize("call", ["try_send", "send", "try_reserve", "reserve"])
def test_record_larger_than_the_ring_can_ever_hold_raises_record_too_large_at_once(ring, call):
    assert ring.try_send(b"f" * 200)  # a part-full ring: a waiting implementation would block
    too_big = ring.max_record_bytes + 1
    t0 = time.monotonic()
    with pytest.raises(RecordTooLarge) as info:
        if call == "try_send":
            ring.try_send(bytes(too_big))
        elif call == "send":
            ring.send(bytes(too_big), timeout_s=5)
        elif call == "try_reserve":
            ring.try_reserve(too_big)
        else:
            ring.reserve(too_big, timeout_s=5)
    assert time.monotonic() - t0 < SLACK_S
    assert isinstance(info.value, ValueError)
    assert ring.try_recv() == b"f" * 200  # the ring is untouched
    assert ring.used_bytes() == 0


# ----------------------------------------------------------------------------------------------- timeouts
@pytest.mark.parametrize("timeout_s", [0.0, 0.3])
def test_recv_on_an_empty_ring_raises_ring_timeout_after_about_the_asked_duration(ring, timeout_s):
    t0 = time.monotonic()
    with pytest.raises(RingTimeout) as info:
        ring.recv(timeout_s=timeout_s)
    elapsed = time.monotonic() - t0
    assert isinstance(info.value, TimeoutError)
    assert timeout_s <= elapsed < timeout_s + SLACK_S


@pytest.mark.parametrize("timeout_s", [0.0, 0.3])
def test_send_on_a_full_ring_raises_ring_timeout_after_about_the_asked_duration(ring, timeout_s):
    assert ring.try_send(bytes(ring.max_record_bytes))
    t0 = time.monotonic()
    with pytest.raises(RingTimeout) as info:
        ring.send(b"one more", timeout_s=timeout_s)
    elapsed = time.monotonic() - t0
    assert isinstance(info.value, TimeoutError)
    assert timeout_s <= elapsed < timeout_s + SLACK_S
    assert ring.used_bytes() == ring.capacity_bytes  # nothing half-sent


def test_peek_and_reserve_time_out_like_recv_and_send(ring):
    with pytest.raises(RingTimeout):
        ring.peek(timeout_s=0.05)
    assert ring.try_send(bytes(ring.max_record_bytes))
    with pytest.raises(RingTimeout):
        ring.reserve(1, timeout_s=0.05)
    assert ring.try_reserve(0) is None  # the timed-out reserve left no reservation open


def test_blocking_send_waits_for_room_made_by_the_consumer_in_the_meantime(ring):
    """A send that had to wait succeeds once room appears: here a second handle frees it after 0.2 s."""
    import threading

    consumer = Ring.attach(ring.name, role="consumer")
    try:
        assert ring.try_send(bytes(ring.max_record_bytes))
        timer = threading.Timer(0.2, consumer.try_recv)
        timer.start()
        try:
            ring.send(b"after the wait", timeout_s=10)
        finally:
            timer.join()
        assert consumer.recv(timeout_s=10) == b"after the wait"
    finally:
        consumer.close()


# --------------------------------------------------------------------------------------- two-phase order
def test_commit_without_a_reservation_is_a_ring_state_error(ring):
    with pytest.raises(RingStateError):
        ring.commit()
    with pytest.raises(RingStateError):
        ring.commit(0)


def test_release_without_a_peek_is_a_ring_state_error(ring):
    with pytest.raises(RingStateError):
        ring.release()
    assert ring.try_send(b"x")
    assert ring.try_peek() is not None
    ring.release()
    with pytest.raises(RingStateError):
        ring.release()  # released once already


def test_a_second_reserve_or_a_send_while_a_reservation_is_open_is_a_ring_state_error(ring):
    view = ring.try_reserve(16)
    with pytest.raises(RingStateError):
        ring.try_reserve(8)
    with pytest.raises(RingStateError):
        ring.try_send(b"x")
    with pytest.raises(RingStateError):
        ring.send(b"x", timeout_s=1)
    view[:] = b"0123456789abcdef"
    ring.commit()
    assert ring.try_recv() == b"0123456789abcdef"


def test_committing_more_than_was_reserved_is_a_ring_state_error_and_keeps_the_reservation(ring):
    view = ring.try_reserve(16)
    with pytest.raises(RingStateError):
        ring.commit(17)
    assert ring.used_bytes() == 0
    view[:] = b"k" * 16
    ring.commit(16)
    assert ring.try_recv() == b"k" * 16


def test_commit_of_fewer_bytes_than_reserved_publishes_only_those_and_frees_the_rest(ring, raw):
    view = ring.try_reserve(100)
    view[:30] = b"s" * 30
    view[30:] = b"!" * 70  # written but not committed
    ring.commit(30)
    assert ring.used_bytes() == record_bytes(30)
    assert raw.record_header(0) == (30, TAG_DATA)
    assert ring.try_send(b"next")  # goes right after the 30-byte record, not after the 100 reserved
    assert raw.record_header(record_bytes(30)) == (4, TAG_DATA)
    assert ring.try_recv() == b"s" * 30
    assert ring.try_recv() == b"next"
    assert ring.used_bytes() == 0


def test_commit_of_zero_bytes_publishes_an_empty_record(ring):
    ring.try_reserve(50)
    ring.commit(0)
    assert ring.try_recv() == b""


def test_view_from_peek_is_read_only_and_invalid_after_release(ring):
    assert ring.try_send(b"hello")
    view = ring.try_peek()
    assert bytes(view) == b"hello"
    with pytest.raises(TypeError):
        view[0] = 0
    ring.release()
    with pytest.raises(ValueError):
        bytes(view)
    with pytest.raises(ValueError):
        view[0]


def test_view_from_reserve_is_invalid_after_commit(ring):
    view = ring.try_reserve(4)
    view[:] = b"abcd"
    ring.commit()
    with pytest.raises(ValueError):
        view[0] = 1
    assert ring.try_recv() == b"abcd"


def test_peeking_twice_without_release_returns_the_same_record(ring):
    assert ring.try_send(b"one") and ring.try_send(b"two")
    assert bytes(ring.try_peek()) == b"one"
    assert bytes(ring.peek(timeout_s=1)) == b"one"
    ring.release()
    assert ring.try_recv() == b"two"


# ----------------------------------------------------------------------------------- peer leaving the ring
def test_consumer_gets_every_record_sent_before_the_producer_closed_then_peer_died():
    with Ring.create(256, role="producer") as producer:
        consumer = Ring.attach(producer.name, role="consumer")
        try:
            producer.send(b"first")
            producer.send(b"second")
            producer.close()
            assert consumer.recv(timeout_s=5) == b"first"
            assert consumer.recv(timeout_s=5) == b"second"
            t0 = time.monotonic()
            with pytest.raises(PeerDied):
                consumer.recv(timeout_s=5)
            assert time.monotonic() - t0 < SLACK_S
        finally:
            consumer.close()


@pytest.mark.parametrize("how", ["closes", "dies"])
def test_record_published_just_before_the_producer_leaves_a_blocked_recv_is_still_delivered(how):
    """The race a blocked consumer must not lose: its wait ends empty, then the producer publishes a last
    record and closes (or dies) before the consumer checks the peer. The record must come out first.

    The producer is a second handle in this process; "dies" is simulated by making the recorded start
    time of the producer differ from this process's, which is how a dead (or reused) pid is told apart.
    """
    with Ring.create(256, role="producer") as producer:
        consumer = Ring.attach(producer.name, role="consumer")
        raw = RawHeader(producer.name)
        real_try_peek = consumer.try_peek
        calls = []

        def try_peek_then_producer_leaves():
            view = real_try_peek()
            calls.append(view)
            if len(calls) == 2:  # the first check inside recv's wait loop came back empty
                producer.send(b"last words")
                if how == "closes":
                    producer.close()
                else:
                    raw.put_u64(OFF_PRODUCER_START, raw.u64(OFF_PRODUCER_START) + 1)
            return view

        consumer.try_peek = try_peek_then_producer_leaves
        try:
            assert consumer.recv(timeout_s=5) == b"last words"
            assert len(calls) >= 3  # the record came through the wait loop, not the first try
            with pytest.raises(PeerDied):
                consumer.recv(timeout_s=5)
        finally:
            raw.close()
            consumer.close()


# ---------------------------------------------------------------------------------------- bad header
def _corrupted_attach(mutate) -> SegmentMismatch:
    with Ring.create(256) as ring:
        raw = RawHeader(ring.name)
        try:
            mutate(raw)
        finally:
            raw.close()
        with pytest.raises(SegmentMismatch) as info:
            Ring.attach(ring.name)
    assert isinstance(info.value, ValueError)
    assert ring.name in str(info.value)
    return info.value


def test_attach_to_a_segment_with_the_wrong_magic_raises_segment_mismatch_naming_the_magic():
    err = _corrupted_attach(lambda raw: raw.put_u64(OFF_MAGIC, 0x0123456789ABCDEF))
    assert "magic" in str(err)


@pytest.mark.parametrize("off", [OFF_VERSION, OFF_ALIGN])
def test_attach_to_a_segment_with_another_layout_version_raises_segment_mismatch_naming_the_version(off):
    err = _corrupted_attach(lambda raw: raw.put_u32(off, 2))
    assert "version" in str(err)


def test_attach_to_a_segment_with_another_header_size_raises_segment_mismatch_naming_the_version():
    err = _corrupted_attach(lambda raw: raw.put_u64(OFF_HEADER_BYTES, 1024))
    assert "version" in str(err)


@pytest.mark.parametrize("capacity", [0, 32, 200, 255, 257, 512, 2**40, U64 - 1])
def test_attach_to_a_header_with_a_bad_capacity_raises_segment_mismatch_naming_the_capacity(capacity):
    """Not a power of two, below the 64-byte minimum, or larger than the segment's data area (256)."""
    err = _corrupted_attach(lambda raw: raw.put_u64(OFF_CAPACITY, capacity))
    assert "capacity" in str(err)


def test_attach_to_a_zero_filled_or_too_small_segment_raises_segment_mismatch():
    for size in (4096, 100):
        seg = Segment.create(size)
        try:
            with pytest.raises(SegmentMismatch):
                Ring.attach(seg.name)
        finally:
            seg.close()
            seg.unlink()


def test_attach_to_a_missing_segment_raises_file_not_found():
    with pytest.raises(FileNotFoundError):
        Ring.attach("/ringshm-1-1-0000000000000000")


# ---------------------------------------------------------------------------------------- life cycle
def test_close_and_unlink_are_idempotent_and_unlink_removes_the_name():
    ring = Ring.create(64)
    name = ring.name
    assert name in list_segments()
    ring.close()
    ring.close()
    assert name in list_segments()  # close unmaps; the name stays until unlink
    ring.unlink()
    ring.unlink()
    assert name not in list_segments()


def test_every_call_on_a_closed_ring_is_a_ring_state_error():
    ring = Ring.create(64)
    ring.unlink()
    ring.close()
    for call in (
        lambda: ring.try_send(b"x"),
        lambda: ring.try_reserve(1),
        lambda: ring.commit(),
        lambda: ring.try_peek(),
        lambda: ring.try_recv(),
        lambda: ring.release(),
        lambda: ring.used_bytes(),
    ):
        with pytest.raises(RingStateError):
            call()


def test_context_manager_closes_and_unlinks_even_when_the_body_raises():
    with pytest.raises(KeyError):
        with Ring.create(64) as ring:
            name = ring.name
            assert name in list_segments()
            raise KeyError("boom")
    assert name not in list_segments()
    with pytest.raises(RingStateError):
        ring.try_send(b"x")


def test_unlink_by_an_attacher_leaves_the_name_and_the_creator_still_works():
    with Ring.create(64) as ring:
        other = Ring.attach(ring.name)
        other.unlink()
        other.close()
        assert ring.name in list_segments()
        assert ring.try_send(b"x") and ring.try_recv() == b"x"


def test_closing_the_consumer_while_a_peeked_view_is_alive_invalidates_the_view():
    with Ring.create(64) as ring:
        assert ring.try_send(b"held")
        view = ring.try_peek()
        ring.close()
        with pytest.raises(ValueError):
            bytes(view)


# ---------------------------------------------------------------------- property test of the index arithmetic
def _start_indices():
    near_top = st.integers(U64 - 4096, U64 - 1)
    return st.one_of(st.just(0), near_top, st.integers(0, U64 - 1))


def _payload(serial: int, n: int) -> bytes:
    """Distinct contents for each record (a reordering or mix-up changes the bytes)."""
    seed = serial.to_bytes(4, "little") + b"\xa5\x5a\xc3\x3c"
    return (seed * (n // 8 + 1))[:n]


class RingAgainstModel(RuleBasedStateMachine):
    """Random try_send / reserve+commit / peek+release / try_recv on a small ring, checked step by step
    against a model of the layout in csrc/ring.h: two counters modulo 2^64, records of align8(8 + n) bytes,
    a pad to the end of the data area when a record would not fit before it, and the pad published alone
    when only the pad fits.

    Checked: what comes out equals what went in, in order; try_send / try_reserve fail exactly when the
    model says the record cannot fit; used_bytes and the raw counters equal the model's; used_bytes never
    exceeds the capacity; and a record sent into an empty ring goes in after at most one pad skip.
    """

    @initialize(capacity=st.sampled_from([64, 128, 256]), start=_start_indices())
    def make_ring(self, capacity, start):
        self.ring = Ring.create(capacity, start_index=start)
        self.raw = RawHeader(self.ring.name)
        self.cap = capacity
        self.head = self.tail = align8(start) % U64  # published counters
        self.items: deque = deque()  # ("pad", nbytes) or ("rec", payload, nbytes), oldest first
        self.reservation = None  # (view, pad, n, serial) while a reserve is open
        self.peeked = None  # the view while a peek is open
        self.serial = 0

    def teardown(self):
        if hasattr(self, "ring"):
            self.raw.close()
            self.ring.close()
            self.ring.unlink()

    # ---- model
    def _place(self, n: int) -> tuple[int, int, bool]:
        """(pad, need, fits) for a record of n payload bytes at the model's head."""
        need = align8(RECORD_HEADER + n)
        off = self.head % self.cap
        pad = self.cap - off if off + need > self.cap else 0
        free = self.cap - (self.head - self.tail) % U64
        return pad, need, free >= pad + need

    def _publish_pad_alone_if_it_fits(self, pad: int) -> None:
        free = self.cap - (self.head - self.tail) % U64
        if pad and free >= pad:
            self.items.append(("pad", pad))
            self.head = (self.head + pad) % U64

    def _skip_pads(self) -> None:
        while self.items and self.items[0][0] == "pad":
            self.tail = (self.tail + self.items.popleft()[1]) % U64

    def _next_payload(self, n: int) -> bytes:
        self.serial += 1
        return _payload(self.serial, n)

    # ---- producer
    @precondition(lambda self: self.reservation is None)
    @rule(data=st.data())
    def try_send(self, data):
        n = data.draw(st.integers(0, self.cap - RECORD_HEADER))
        payload = self._next_payload(n)
        pad, need, fits = self._place(n)
        assert self.ring.try_send(payload) is fits
        if fits:
            if pad:
                self.items.append(("pad", pad))
            self.items.append(("rec", payload, need))
            self.head = (self.head + pad + need) % U64
        else:
            self._publish_pad_alone_if_it_fits(pad)

    @precondition(lambda self: self.reservation is None)
    @rule(data=st.data())
    def try_reserve(self, data):
        n = data.draw(st.integers(0, self.cap - RECORD_HEADER))
        pad, need, fits = self._place(n)
        view = self.ring.try_reserve(n)
        assert (view is not None) is fits
        if fits:
            assert len(view) == n
            self.reservation = (view, pad, n, self.serial + 1)
            self.serial += 1
        else:
            self._publish_pad_alone_if_it_fits(pad)

    @precondition(lambda self: self.reservation is not None)
    @rule(data=st.data())
    def commit(self, data):
        view, pad, n, serial = self.reservation
        k = data.draw(st.integers(0, n))
        payload = _payload(serial, k)
        view[:k] = payload
        self.ring.commit(k)
        self.reservation = None
        if pad:
            self.items.append(("pad", pad))
        need = align8(RECORD_HEADER + k)
        self.items.append(("rec", payload, need))
        self.head = (self.head + pad + need) % U64

    @precondition(lambda self: self.reservation is None)
    @rule()
    def commit_without_reserve_is_refused(self):
        with pytest.raises(RingStateError):
            self.ring.commit(0)

    @precondition(lambda self: self.reservation is None and self.peeked is None and not self.items)
    @rule(data=st.data())
    def send_into_an_empty_ring_succeeds_after_at_most_one_pad_skip(self, data):
        n = data.draw(st.integers(0, self.cap - RECORD_HEADER))
        payload = self._next_payload(n)
        pad, need, _ = self._place(n)
        if not self.ring.try_send(payload):
            assert pad, "an empty ring refused a record that needs no pad"
            assert self.ring.try_recv() is None  # skips the pad, which freed the whole ring
            assert self.ring.try_send(payload), "refused again after the pad was skipped"
            self.head = self.tail = (self.head + pad) % U64
            pad = 0
        if pad:
            self.items.append(("pad", pad))
        self.items.append(("rec", payload, need))
        self.head = (self.head + pad + need) % U64

    # ---- consumer
    @rule()
    def try_recv(self):
        got = self.ring.try_recv()
        self.peeked = None  # try_recv releases the record a peek may have left open
        self._skip_pads()
        if not self.items:
            assert got is None
            return
        _, payload, need = self.items.popleft()
        assert got == payload
        self.tail = (self.tail + need) % U64

    @rule()
    def try_peek(self):
        view = self.ring.try_peek()
        self._skip_pads()
        if not self.items:
            assert view is None
            return
        assert bytes(view) == self.items[0][1]
        self.peeked = view

    @precondition(lambda self: self.peeked is not None)
    @rule()
    def release(self):
        view = self.peeked
        self.ring.release()
        self.peeked = None
        _, _, need = self.items.popleft()
        self.tail = (self.tail + need) % U64
        with pytest.raises(ValueError):
            bytes(view)

    @precondition(lambda self: self.peeked is None)
    @rule()
    def release_without_peek_is_refused(self):
        with pytest.raises(RingStateError):
            self.ring.release()

    # ---- invariants
    @invariant()
    def used_bytes_and_counters_match_the_model(self):
        if not hasattr(self, "ring"):
            return
        used = self.ring.used_bytes()
        assert used == (self.head - self.tail) % U64
        assert 0 <= used <= self.cap
        assert self.raw.u64(OFF_HEAD) == self.head
        assert self.raw.u64(OFF_TAIL) == self.tail


RingAgainstModel.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_ring_indices_match_a_deque_model_under_random_two_phase_calls = pytest.mark.slow(RingAgainstModel.TestCase)


def test_every_ring_error_is_a_ringshm_error_and_its_builtin():
    assert issubclass(RecordTooLarge, RingshmError) and issubclass(RecordTooLarge, ValueError)
    assert issubclass(RingTimeout, RingshmError) and issubclass(RingTimeout, TimeoutError)
    assert issubclass(SegmentMismatch, RingshmError) and issubclass(SegmentMismatch, ValueError)
    assert issubclass(PeerDied, RingshmError) and issubclass(PeerDied, BrokenPipeError)
