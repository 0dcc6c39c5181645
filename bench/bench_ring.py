"""Ring transport benchmarks (issue 2): two processes, figures and same-run ratios, never pass/fail.

- Round-trip latency of a 64-byte message: ringshm vs multiprocessing.Pipe vs multiprocessing.Queue.
  Goal: ringshm <= 0.1 x Pipe.
- Throughput of 1 MiB and 16 MiB records vs one single-core memcpy of the same size (cache-hot source and
  destination: the fastest a copy gets). The producer copies each record in; the consumer either copies it
  out (copy_out) or reads it in place (zero_copy). Goal: >= 0.8 x memcpy.

Run: ``make bench`` or ``python -m pytest bench/bench_ring.py --benchmark-only``.
"""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest

from ring_bench_workers import pipe_echo, queue_echo, ring_echo, ring_sink
from ringshm import Ring
from ringshm._C import ffi

CTX = mp.get_context("spawn")
ROUNDS = 25
RTT_PER_ROUND = 400
MSG = b"x" * 64


def _stop(proc) -> None:
    proc.join(10)
    if proc.is_alive():
        proc.kill()
        proc.join()


@pytest.fixture(scope="module")
def ring_pair():
    a, b = Ring.create(1 << 16, role="producer"), Ring.create(1 << 16, role="consumer")
    proc = CTX.Process(target=ring_echo, args=(a.name, b.name))
    proc.start()
    yield a, b
    a.send(b"", timeout_s=10)
    b.recv(timeout_s=10)
    _stop(proc)
    for r in (a, b):
        r.close()
        r.unlink()


def test_rtt_64B_ringshm(benchmark, figures, ring_pair):
    a, b = ring_pair

    def round_trips():
        for _ in range(RTT_PER_ROUND):
            a.send(MSG)
            b.recv()

    benchmark.pedantic(round_trips, rounds=ROUNDS, warmup_rounds=2)
    figures.record("rtt_64B.ringshm", benchmark, per=RTT_PER_ROUND)
    figures.ratio("RTT 64 B: ringshm / Pipe", "rtt_64B.ringshm", "rtt_64B.pipe", "<= 0.1")
    figures.ratio("RTT 64 B: ringshm / Queue", "rtt_64B.ringshm", "rtt_64B.queue")


def test_rtt_64B_pipe(benchmark, figures):
    here, there = CTX.Pipe()
    proc = CTX.Process(target=pipe_echo, args=(there,))
    proc.start()

    def round_trips():
        for _ in range(RTT_PER_ROUND):
            here.send_bytes(MSG)
            here.recv_bytes()

    try:
        benchmark.pedantic(round_trips, rounds=ROUNDS, warmup_rounds=2)
        figures.record("rtt_64B.pipe", benchmark, per=RTT_PER_ROUND)
    finally:
        here.send_bytes(b"")
        here.recv_bytes()
        _stop(proc)


def test_rtt_64B_queue(benchmark, figures):
    q_in, q_out = CTX.Queue(), CTX.Queue()
    proc = CTX.Process(target=queue_echo, args=(q_in, q_out))
    proc.start()

    def round_trips():
        for _ in range(RTT_PER_ROUND // 4):
            q_in.put(MSG)
            q_out.get()

    try:
        benchmark.pedantic(round_trips, rounds=ROUNDS, warmup_rounds=2)
        figures.record("rtt_64B.queue", benchmark, per=RTT_PER_ROUND // 4)
    finally:
        q_in.put(b"")
        q_out.get()
        _stop(proc)


SIZES = {"1MiB": 1 << 20, "16MiB": 16 << 20}
RECORDS_PER_ROUND = {"1MiB": 64, "16MiB": 8}


@pytest.mark.parametrize("consumer", ["copy_out", "zero_copy"])
@pytest.mark.parametrize("size", list(SIZES))
def test_throughput_ringshm(benchmark, figures, size, consumer):
    record_bytes, n = SIZES[size], RECORDS_PER_ROUND[size]
    capacity = 1 << (4 * (record_bytes + 8) - 1).bit_length()  # room for three records in flight
    src = os.urandom(record_bytes)
    ring, ack = Ring.create(capacity, role="producer"), Ring.create(1 << 12, role="consumer")
    proc = CTX.Process(target=ring_sink, args=(ring.name, ack.name, record_bytes, consumer == "copy_out"))
    proc.start()

    def stream():
        ring.send(n.to_bytes(8, "little"))
        for _ in range(n):
            ring.send(src)
        ack.recv()

    try:
        benchmark.pedantic(stream, rounds=8, warmup_rounds=1)
        name = f"throughput.{size}.ringshm_{consumer}"
        figures.record(name, benchmark, per=n, record_bytes=record_bytes)
        figures.ratio(f"throughput {size} {consumer}: ringshm / memcpy (higher is better)",
                      f"throughput.{size}.memcpy", name, ">= 0.8")
    finally:
        ring.send((0).to_bytes(8, "little"))
        _stop(proc)
        for r in (ring, ack):
            r.close()
            r.unlink()


@pytest.mark.parametrize("size", list(SIZES))
def test_throughput_memcpy(benchmark, figures, size):
    record_bytes, n = SIZES[size], RECORDS_PER_ROUND[size]
    src, dst = os.urandom(record_bytes), bytearray(record_bytes)
    src_ptr, dst_ptr = ffi.from_buffer(src), ffi.from_buffer(dst)

    def copies():
        for _ in range(n):
            ffi.memmove(dst_ptr, src_ptr, record_bytes)

    benchmark.pedantic(copies, rounds=8, warmup_rounds=1)
    figures.record(f"throughput.{size}.memcpy", benchmark, per=n, record_bytes=record_bytes)
