"""Peer processes for the multi-process ring tests (top-level functions, so the spawn start method can
import them by name).

Every worker talks to the test through one ``multiprocessing`` connection (a socket pair: no semaphores,
so no resource-tracker bookkeeping): it sends ``("ready", ...)`` once it holds what the test waits for,
and reports a result or ``("error", traceback)`` at the end.
"""

from __future__ import annotations

import random
import struct
import time
import traceback
import zlib

from ringshm import Ring
from ringshm.errors import (
    PeerDied,
    RecordTooLarge,
    RingCorrupt,
    RingshmError,
    RingTimeout,
    RoleTaken,
    SegmentMismatch,
)
from ringshm.transport.segment import Segment

# Stress record: seq u64 | crc32 of the body u32 | body length u32 | body.
STRESS_HEADER = struct.Struct("<QII")


def stress_record_sizes(rng: random.Random, max_record_bytes: int) -> int:
    """A record size: mostly small, a quarter medium, one in ten within 64 bytes of the ring's maximum (so
    that most of those need a pad at the wrap)."""
    r = rng.random()
    lo = STRESS_HEADER.size
    if r < 0.10:
        return rng.randrange(max_record_bytes - 64, max_record_bytes + 1)
    if r < 0.35:
        return rng.randrange(lo, max_record_bytes // 2)
    return rng.randrange(lo, lo + 200)


def stress_producer(name: str, seed: int, n_records: int, conn) -> None:
    """Send ``n_records`` checksummed records of seeded random sizes, alternating at random between
    ``send`` and ``reserve`` / ``commit`` (sometimes reserving more than it commits), then close."""
    try:
        ring = Ring.attach(name, role="producer")
        rng = random.Random(seed)
        t0 = time.monotonic()
        for seq in range(n_records):
            size = stress_record_sizes(rng, ring.max_record_bytes)
            body = rng.randbytes(size - STRESS_HEADER.size)
            head = STRESS_HEADER.pack(seq, zlib.crc32(body), len(body))
            if rng.random() < 0.5:
                ring.send(head + body, timeout_s=30)
            else:
                extra = rng.randrange(0, ring.max_record_bytes - size + 1) if rng.random() < 0.3 else 0
                view = ring.reserve(size + extra, timeout_s=30)
                view[: STRESS_HEADER.size] = head
                view[STRESS_HEADER.size : size] = body
                ring.commit(size)
        ring.close()
        conn.send(("done", time.monotonic() - t0))
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def stress_consumer(name: str, conn) -> None:
    """Receive until the producer closes; check each record's sequence number, length and crc32.

    Reports ``("done", n_received, first_errors, n_errors, elapsed_s)``."""
    try:
        ring = Ring.attach(name, role="consumer")
        rng = random.Random(0)  # only picks recv vs peek/release; the payload check needs no seed
        expected = 0
        errors: list[str] = []
        n_errors = 0
        t0 = time.monotonic()
        while True:
            try:
                if rng.random() < 0.5:
                    rec = ring.recv(timeout_s=30)
                    problem = _check_stress_record(memoryview(rec), expected)
                else:
                    view = ring.peek(timeout_s=30)
                    problem = _check_stress_record(view, expected)
                    ring.release()
            except PeerDied:
                break
            if problem:
                n_errors += 1
                if len(errors) < 5:
                    errors.append(problem)
            expected += 1
        ring.close()
        conn.send(("done", expected, errors, n_errors, time.monotonic() - t0))
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def _check_stress_record(rec: memoryview, expected_seq: int) -> str | None:
    if len(rec) < STRESS_HEADER.size:
        return f"record {expected_seq}: {len(rec)} bytes, shorter than its header"
    seq, crc, n_body = STRESS_HEADER.unpack_from(rec)
    if seq != expected_seq:
        return f"expected seq {expected_seq}, got {seq} (lost, duplicated or reordered)"
    if n_body != len(rec) - STRESS_HEADER.size:
        return f"record {seq}: header says {n_body} body bytes, record has {len(rec) - STRESS_HEADER.size}"
    if zlib.crc32(rec[STRESS_HEADER.size :]) != crc:
        return f"record {seq}: crc32 mismatch (torn record)"
    return None


def hold_side(name: str, role: str, conn) -> None:
    """Attach and claim ``role``, say ready, then sleep until killed or told to stop."""
    try:
        ring = Ring.attach(name, role=role)
        conn.send(("ready",))
        conn.recv()  # any message (or the test closing its end) means stop
        ring.close()
    except EOFError:
        pass
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def close_on_request(name: str, conn) -> None:
    """Claim the producer side, say ready, close the ring when the test says so, then stay alive (so the
    consumer can only learn of the close from the closed flag, not from the process being gone)."""
    try:
        ring = Ring.attach(name, role="producer")
        conn.send(("ready",))
        conn.recv()
        ring.close()
        conn.send(("closed",))
        conn.recv()
    except EOFError:
        pass
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def reserve_half_then_sleep(name: str, first_bytes: int, reserve_bytes: int, conn) -> None:
    """Producer that dies mid-record: send one record of ``first_bytes`` (moving the head towards the end
    of the data area), wait until the test has received it, reserve ``reserve_bytes`` (which needs a pad at
    the wrap), fill half of the reservation, say where it is, then sleep without committing."""
    try:
        ring = Ring.attach(name, role="producer")
        ring.send(bytes([0xAB]) * first_bytes, timeout_s=30)
        conn.recv()
        view = ring.reserve(reserve_bytes, timeout_s=30)
        half = reserve_bytes // 2
        view[:half] = bytes([0xCD]) * half
        conn.send(("reserved",))
        time.sleep(60)
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def create_rings_and_sleep(n_rings: int, conn) -> None:
    """Create ``n_rings`` rings (claiming the producer side of each), report their names, sleep until killed
    (SIGKILL: nothing unlinks them)."""
    try:
        rings = [Ring.create(4096, role="producer") for _ in range(n_rings)]
        conn.send(("ready", [r.name for r in rings]))
        time.sleep(60)
    except BaseException:
        conn.send(("error", traceback.format_exc()))


# ------------------------------------------------------------------------------------------------ fuzz
# Offsets into the ring header (csrc/ring.h): the fields a corruption is most likely to matter for.
_HEADER_FIELDS = {  # offset: width in bytes
    0: 8,  # magic
    8: 4,  # version
    12: 4,  # record_align
    16: 8,  # capacity
    24: 8,  # header_bytes
    128: 8,  # head
    136: 8,  # cached_tail
    256: 8,  # tail
    264: 8,  # cached_head
    400: 4,  # producer_closed
    404: 4,  # consumer_closed
    408: 4,  # producer_pid
    412: 4,  # consumer_pid
    416: 8,  # producer_start
}
HEADER_BYTES = 512
# Clean outcomes of a try_ call on a corrupted ring; a blocking call may also time out or see its (fake)
# peer as dead or closed.
FUZZ_CLEAN = (RingCorrupt, SegmentMismatch, RecordTooLarge, RoleTaken)
FUZZ_CLEAN_BLOCKING = FUZZ_CLEAN + (RingTimeout, PeerDied)
# Blocking calls (which may sleep up to their timeout) are one draw in ten.
_FUZZ_OPS = ["try_peek", "try_recv", "try_send", "try_reserve", "used_bytes"] * 4 + ["recv", "send"]


def fuzz_rings(seed: int, n_cases: int, conn) -> None:
    """Corrupt rings at random and drive them; report outcome counts and every unclean outcome.

    Each case: a ring of random capacity and start index with a few records and pads in it; then random
    bytes, random 8-byte words or random values of index/header fields are written into the header and/or
    the data area through a second mapping; then the already-open handle and a freshly attached one run
    random try_peek / try_recv / try_send / try_reserve+commit / used_bytes calls and short blocking calls.
    Clean: a valid result or one of FUZZ_CLEAN(_BLOCKING). Anything else is reported with the case seed.
    Reports ``("done", counts, failures)``."""
    counts: dict[str, int] = {}
    failures: list[str] = []
    try:
        master = random.Random(seed)
        for _ in range(n_cases):
            case_seed = master.getrandbits(64)
            try:
                _fuzz_case(random.Random(case_seed), counts)
            except Exception:  # noqa: BLE001 - any escape from a case is a finding
                failures.append(f"case seed {case_seed:#x}:\n{traceback.format_exc()}")
                if len(failures) >= 5:
                    break
        conn.send(("done", counts, failures))
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def _fuzz_case(rng: random.Random, counts: dict[str, int]) -> None:
    capacity = rng.choice([64, 128, 256, 1024])
    start = rng.choice([0, rng.getrandbits(64), 2**64 - 8 * rng.randrange(1, 64)]) & ~7
    with Ring.create(capacity, start_index=start) as ring:
        for _ in range(rng.randrange(0, 8)):  # records and pads at random places
            ring.try_send(rng.randbytes(rng.randrange(0, ring.max_record_bytes + 1)))
            if rng.random() < 0.5:
                ring.try_recv()
        seg = Segment.attach(ring.name)
        try:
            _corrupt(rng, seg.buf, capacity)
        finally:
            seg.close()
        _drive(rng, ring, counts, "open")
        try:
            attached = Ring.attach(ring.name)
        except SegmentMismatch:
            counts["attach:SegmentMismatch"] = counts.get("attach:SegmentMismatch", 0) + 1
            return
        try:
            _drive(rng, attached, counts, "attached")
        finally:
            attached.close()


def _corrupt(rng: random.Random, buf, capacity: int) -> None:
    where = rng.choice(["header", "data", "both"])
    for _ in range(rng.randrange(1, 6)):
        target = where if where != "both" else rng.choice(["header", "data"])
        how = rng.choice(["byte", "word", "field"])
        if target == "header" and how == "field":
            off, width = rng.choice(list(_HEADER_FIELDS.items()))
            value = rng.choice([0, 1, 2**64 - 1, rng.getrandbits(64), rng.randrange(-4096, 4096) & (2**64 - 1)])
            buf[off : off + width] = (value & (2 ** (8 * width) - 1)).to_bytes(width, "little")
            continue
        lo, hi = (0, HEADER_BYTES) if target == "header" else (HEADER_BYTES, HEADER_BYTES + capacity)
        if how == "byte":
            buf[rng.randrange(lo, hi)] = rng.randrange(256)
        else:  # an aligned 8-byte word: in the data area, that is where record headers live
            off = lo + 8 * rng.randrange((hi - lo) // 8)
            word = rng.choice([  # random, or a PAD / DATA record header with a random or plausible length
                rng.getrandbits(64),
                0x44444150 << 32 | rng.getrandbits(32),
                0x41544144 << 32 | rng.getrandbits(32),
                0x41544144 << 32 | rng.randrange(capacity),
            ])
            buf[off : off + 8] = word.to_bytes(8, "little")


def _drive(rng: random.Random, ring: Ring, counts: dict[str, int], label: str) -> None:
    for _ in range(rng.randrange(1, 24)):
        op = rng.choice(_FUZZ_OPS)
        key = f"{label}:{op}"
        try:
            if op == "try_peek":
                view = ring.try_peek()
                if view is not None:
                    _check_len(len(view), ring)
                    bytes(view)
                    ring.release()
            elif op == "try_recv":
                rec = ring.try_recv()
                if rec is not None:
                    _check_len(len(rec), ring)
            elif op == "try_send":
                ring.try_send(rng.randbytes(rng.randrange(0, ring.max_record_bytes + 1)))
            elif op == "try_reserve":
                n = rng.randrange(0, ring.max_record_bytes + 1)
                view = ring.try_reserve(n)
                if view is not None:
                    if len(view) != n:
                        raise AssertionError(f"try_reserve({n}) gave a view of {len(view)} bytes")
                    view[:] = rng.randbytes(n)
                    ring.commit(rng.randrange(n + 1))
            elif op == "used_bytes":
                used = ring.used_bytes()
                if not 0 <= used <= ring.capacity_bytes:
                    raise AssertionError(f"used_bytes() = {used} outside [0, {ring.capacity_bytes}]")
            elif op == "recv":
                try:
                    rec = ring.recv(timeout_s=rng.choice([0, 0.001]))
                    _check_len(len(rec), ring)
                except FUZZ_CLEAN_BLOCKING as exc:
                    counts[f"{key}:{type(exc).__name__}"] = counts.get(f"{key}:{type(exc).__name__}", 0) + 1
                    continue
            else:
                try:
                    n = rng.randrange(0, ring.max_record_bytes + 1)
                    ring.send(rng.randbytes(n), timeout_s=rng.choice([0, 0.001]))
                except FUZZ_CLEAN_BLOCKING as exc:
                    counts[f"{key}:{type(exc).__name__}"] = counts.get(f"{key}:{type(exc).__name__}", 0) + 1
                    continue
            counts[f"{key}:ok"] = counts.get(f"{key}:ok", 0) + 1
        except FUZZ_CLEAN as exc:
            counts[f"{key}:{type(exc).__name__}"] = counts.get(f"{key}:{type(exc).__name__}", 0) + 1
        except RingshmError as exc:  # e.g. RingStateError: the API was used in order, so this is a finding
            raise AssertionError(f"{op} raised {type(exc).__name__}: {exc}") from exc


def _check_len(n: int, ring: Ring) -> None:
    if n > ring.max_record_bytes:
        raise AssertionError(f"a record of {n} bytes came out of a ring whose max is {ring.max_record_bytes}")
