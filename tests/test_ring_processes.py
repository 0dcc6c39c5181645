"""Rings between spawned processes: a seeded stress of random record sizes, peers killed or closed at the
worst moments, 20 spawn/kill -9 cycles against ``sweep_stale``, and a fuzz of corrupted headers run in
subprocesses (so a crash fails a test instead of killing pytest).

Workers live in tests/_ring_workers.py (spawn imports them by name). Every process started here is
joined (killed first if needed) before its test ends; the module checks at the end that none is left and
that no segment created by this process or its children stays in /dev/shm.
"""

from __future__ import annotations

import multiprocessing
import os
import secrets
import signal
import struct
import threading
import time

import pytest

import _ring_workers as workers
from ringshm import Ring
from ringshm.errors import PeerDied, RoleTaken
from ringshm.transport.segment import Segment, creator_of, list_segments, sweep_stale

CTX = multiprocessing.get_context("spawn")
STARTUP_S = 60.0  # generous: a spawned interpreter on a loaded 2-core machine
PEER_DIED_WITHIN_S = 1.0  # issue 2: a blocked call notices a dead or closed peer within 1 s
OFF_HEAD = 128
U64 = 2**64

_started: list = []  # every process this module started


@pytest.fixture(autouse=True, scope="module")
def no_process_or_segment_left_behind():
    before = set(list_segments())
    yield
    alive = [p.pid for p in _started if p.exitcode is None]
    for p in _started:
        _stop(p)
    ours = {os.getpid()} | {p.pid for p in _started}
    leaked = [s for s in set(list_segments()) - before if creator_of(s)[0] in ours]
    for name in leaked:
        Segment(name, None, 0, owner=True).unlink()
    assert not alive, f"worker processes still running at the end of the module: {alive}"
    assert not leaked, f"segments left in /dev/shm: {leaked}"


def _start(target, *args):
    """Start ``target(*args, conn)`` in a spawned process; returns (process, our end of the pipe)."""
    ours, theirs = CTX.Pipe()
    p = CTX.Process(target=target, args=(*args, theirs), daemon=True)
    p.start()
    theirs.close()
    _started.append(p)
    return p, ours


def _expect(p, conn, kind: str, timeout_s: float = STARTUP_S) -> tuple:
    """The next message from a worker, which must be of ``kind``; a worker error or exit fails the test."""
    if not conn.poll(timeout_s):
        pytest.fail(f"no {kind!r} from worker pid {p.pid} within {timeout_s} s")
    try:
        msg = conn.recv()
    except EOFError:
        p.join(5)
        pytest.fail(f"worker pid {p.pid} exited (exit code {p.exitcode}) before sending {kind!r}")
    if msg[0] == "error":
        pytest.fail(f"worker pid {p.pid} failed:\n{msg[1]}")
    assert msg[0] == kind, msg
    return msg


def _stop(p) -> None:
    """Kill (if still running) and reap."""
    if p.exitcode is None:
        p.kill()
    p.join(30)


def _proc_state(pid: int) -> str | None:
    """The state letter of /proc/<pid>/stat ('Z' for a zombie), or None when the pid is gone."""
    try:
        stat = open(f"/proc/{pid}/stat", "rb").read()
    except FileNotFoundError:
        return None
    return stat[stat.rindex(b")") + 2 :].split()[0].decode()


def _wait_until_zombie(pid: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while _proc_state(pid) != "Z":
        assert time.monotonic() < deadline, f"pid {pid} not a zombie after SIGKILL (state {_proc_state(pid)})"
        time.sleep(0.005)


def _head(name: str) -> int:
    seg = Segment.attach(name)
    try:
        return struct.unpack_from("<Q", seg.buf, OFF_HEAD)[0]
    finally:
        seg.close()


# ------------------------------------------------------------------------------------------------ stress
N_STRESS_RECORDS = 100_000


@pytest.mark.slow
def test_a_hundred_thousand_records_of_random_sizes_arrive_whole_in_order_and_exactly_once():
    """Producer and consumer in two spawned processes, a 4 KiB ring whose counters cross 2^64 halfway,
    record sizes from 16 bytes to the ring's maximum (one in ten needs a pad at the wrap), sent with
    send or reserve/commit and read with recv or peek/release. Each record carries its sequence number
    and the crc32 of its body; the consumer reads until the producer closes."""
    seed = secrets.randbits(32)
    print(f"stress seed: {seed}")
    capacity = 4096
    start = U64 - capacity * 2000
    with Ring.create(capacity, start_index=start) as ring:
        consumer, c_conn = _start(workers.stress_consumer, ring.name)
        producer, p_conn = _start(workers.stress_producer, ring.name, seed, N_STRESS_RECORDS)
        try:
            _, sent_s = _expect(producer, p_conn, "done", timeout_s=120)
            _, n_received, errors, n_errors, recv_s = _expect(consumer, c_conn, "done", timeout_s=60)
        finally:
            _stop(producer)
            _stop(consumer)
        bytes_through = (_head(ring.name) - start) % U64
    print(f"stress: {N_STRESS_RECORDS} records, {bytes_through / capacity:.0f} wraps, sent in {sent_s:.1f} s")
    assert n_errors == 0, f"seed {seed}: {n_errors} bad records, first ones: {errors}"
    assert n_received == N_STRESS_RECORDS, f"seed {seed}: received {n_received} of {N_STRESS_RECORDS}"
    assert bytes_through > 1000 * capacity  # many wraps, and the counters crossed 2^64


# ------------------------------------------------------------------------------------------------ faults
def _kill_later(p, delay_s: float, reap: bool, killed_at: list) -> threading.Timer:
    def kill():
        killed_at.append(time.monotonic())
        os.kill(p.pid, signal.SIGKILL)
        if reap:
            p.join(30)

    timer = threading.Timer(delay_s, kill)
    timer.start()
    return timer


@pytest.mark.parametrize("reaped", [True, False], ids=["reaped", "zombie"])
def test_producer_blocked_on_a_full_ring_gets_peer_died_within_a_second_of_the_consumer_being_killed(reaped):
    with Ring.create(4096, role="producer") as ring:
        consumer, conn = _start(workers.hold_side, ring.name, "consumer")
        timer = None
        try:
            _expect(consumer, conn, "ready")
            while ring.try_send(bytes(1000)):
                pass
            killed_at: list[float] = []
            timer = _kill_later(consumer, 0.35, reaped, killed_at)
            t0 = time.monotonic()
            with pytest.raises(PeerDied):
                ring.send(bytes(1000), timeout_s=10)
            died_at = time.monotonic()
            timer.join()
            assert killed_at[0] - t0 > 0.2, "the send did not block until the kill"
            latency = died_at - killed_at[0]
            state = "reaped" if reaped else "zombie"
            print(f"PeerDied {latency * 1e3:.0f} ms after SIGKILL of the consumer ({state})")
            assert latency < PEER_DIED_WITHIN_S
            if not reaped:
                assert _proc_state(consumer.pid) == "Z"  # detected while still an unreaped zombie
        finally:
            if timer is not None:
                timer.join()
            _stop(consumer)


def test_consumer_never_sees_the_record_of_a_producer_killed_between_reserve_and_commit():
    """The producer sends 3000 bytes, then reserves 2000 (3008 + 2008 > 4096: a pad at the wrap, the
    record at offset 0), fills half of it and is killed. The blocked consumer gets PeerDied within a
    second, and neither the half-written record nor its pad is ever visible."""
    with Ring.create(4096, role="consumer") as ring:
        producer, conn = _start(workers.reserve_half_then_sleep, ring.name, 3000, 2000)
        timer = None
        try:
            assert ring.recv(timeout_s=STARTUP_S) == bytes([0xAB]) * 3000
            conn.send("go")
            _expect(producer, conn, "reserved")
            assert ring.try_peek() is None and ring.used_bytes() == 0
            killed_at: list[float] = []
            timer = _kill_later(producer, 0.35, False, killed_at)
            with pytest.raises(PeerDied):
                ring.recv(timeout_s=10)
            died_at = time.monotonic()
            timer.join()
            latency = died_at - killed_at[0]
            print(f"PeerDied {latency * 1e3:.0f} ms after SIGKILL of the producer mid-record")
            assert latency < PEER_DIED_WITHIN_S
            assert ring.try_peek() is None
            assert ring.used_bytes() == 0
            with pytest.raises(PeerDied):
                ring.peek(timeout_s=5)
        finally:
            if timer is not None:
                timer.join()
            _stop(producer)


def test_consumer_blocked_on_an_empty_ring_gets_peer_died_promptly_when_the_live_producer_closes():
    with Ring.create(4096, role="consumer") as ring:
        producer, conn = _start(workers.close_on_request, ring.name)
        timer = None
        try:
            _expect(producer, conn, "ready")
            asked_at: list[float] = []

            def ask_to_close():
                asked_at.append(time.monotonic())
                conn.send("close")

            timer = threading.Timer(0.3, ask_to_close)
            timer.start()
            with pytest.raises(PeerDied, match="closed"):
                ring.recv(timeout_s=10)
            died_at = time.monotonic()
            timer.join()
            latency = died_at - asked_at[0]
            print(f"PeerDied {latency * 1e3:.0f} ms after the producer was asked to close")
            assert latency < PEER_DIED_WITHIN_S
            _expect(producer, conn, "closed")
            assert producer.exitcode is None  # the producer is alive: the close, not a death, ended the wait
            conn.send("stop")
            producer.join(30)
            assert producer.exitcode == 0
        finally:
            if timer is not None:
                timer.join()
            _stop(producer)


def test_a_second_process_claiming_a_taken_side_gets_role_taken_naming_the_holder():
    with Ring.create(4096) as ring:
        holder, conn = _start(workers.hold_side, ring.name, "producer")
        try:
            _expect(holder, conn, "ready")
            with pytest.raises(RoleTaken, match=rf"pid {holder.pid} \(alive\)"):
                ring.try_send(b"x")
            with pytest.raises(RoleTaken):
                Ring.attach(ring.name, role="producer")
            assert ring.try_recv() is None  # the consumer side is still free
            holder.kill()
            holder.join(30)
            with pytest.raises(RoleTaken, match="gone"):  # a dead holder still holds it: make a new ring
                ring.try_send(b"x")
        finally:
            _stop(holder)


# ----------------------------------------------------------------------------------------- stale segments
@pytest.mark.slow
def test_sweep_stale_removes_the_segments_of_twenty_killed_creators_and_keeps_those_of_live_ones():
    """20 cycles: a spawned process creates two rings and is killed with SIGKILL; then sweep_stale() runs,
    with the killed process reaped (even cycles) or still an unreaped zombie (odd cycles). Its segments
    must be gone; the segments of this process and of a live child must stay."""
    own = Ring.create(4096)
    live, live_conn = _start(workers.create_rings_and_sleep, 2)
    try:
        _, live_names = _expect(live, live_conn, "ready")
        keep = {own.name, *live_names}
        all_killed: list[str] = []
        for cycle in range(20):
            p, conn = _start(workers.create_rings_and_sleep, 2)
            try:
                _, names = _expect(p, conn, "ready")
                assert set(names) <= set(list_segments())
                p.kill()
                if cycle % 2 == 0:
                    p.join(30)
                else:
                    _wait_until_zombie(p.pid)
                removed = sweep_stale()
                if cycle % 2:
                    assert _proc_state(p.pid) == "Z"  # it was swept while a zombie
            finally:
                _stop(p)
            # gone, by this sweep or by one that a process group started at the same moment ran (the launcher
            # sweeps at every start: under xdist another worker's engine can get there first)
            left = set(names) & set(list_segments())
            assert not left, f"cycle {cycle}: {left} not swept (this sweep removed {sorted(removed)})"
            assert not keep & set(removed), f"cycle {cycle}: swept segments of live creators"
            assert keep <= set(list_segments()), f"cycle {cycle}: a live creator's segment is gone"
            all_killed += names
        present = set(list_segments())
        assert not present & set(all_killed)
        assert keep <= present
    finally:
        _stop(live)
        own.close()
        own.unlink()
    sweep_stale()  # the live child's segments, now that it is dead
    assert not set(live_names) & set(list_segments())


# -------------------------------------------------------------------------------------------------- fuzz
N_FUZZ_CASES = 2500


@pytest.mark.slow
def test_corrupted_header_and_data_bytes_give_valid_results_or_clean_errors_never_a_crash_or_a_hang():
    """Two spawned workers, N_FUZZ_CASES seeded cases each (see _ring_workers.fuzz_rings). A segfault
    shows up as a negative exit code, a hang as a missing report."""
    seeds = [secrets.randbits(32) for _ in range(2)]
    print(f"fuzz seeds: {seeds}")
    procs = [_start(workers.fuzz_rings, seed, N_FUZZ_CASES) for seed in seeds]
    totals: dict[str, int] = {}
    try:
        for seed, (p, conn) in zip(seeds, procs):
            if not conn.poll(120):
                pytest.fail(f"fuzz seed {seed}: no report within 120 s (a hang?)")
            try:
                msg = conn.recv()
            except EOFError:
                p.join(10)
                pytest.fail(f"fuzz seed {seed}: worker died with exit code {p.exitcode} (a crash)")
            assert msg[0] != "error", f"fuzz seed {seed}: {msg[1]}"
            _, counts, failures = msg
            assert not failures, f"fuzz seed {seed}: unclean outcomes:\n" + "\n".join(failures)
            for key, n in counts.items():
                totals[key] = totals.get(key, 0) + n
            p.join(30)
            assert p.exitcode == 0, f"fuzz seed {seed}: exit code {p.exitcode}"
    finally:
        for p, _ in procs:
            _stop(p)
    print("fuzz outcomes:", dict(sorted(totals.items())))

    def seen(suffix: str) -> int:
        return sum(n for k, n in totals.items() if k.endswith(suffix))

    # The fuzz reached every kind of outcome, so the checks above were not vacuous.
    assert totals.get("attach:SegmentMismatch", 0) > 0
    assert seen(":RingCorrupt") > 0
    assert seen(":RoleTaken") > 0
    assert seen(":ok") > 0
    assert sum(n for k, n in totals.items() if k.startswith("attached:") and k.endswith(":ok")) > 0
