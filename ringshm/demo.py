"""``python -m ringshm.demo`` (``make demo-ring``): the ring on its own, between two processes.

A ping-pong that prints its figures: 64-byte round-trip
latency next to multiprocessing.Pipe, and 1 MiB record throughput next to a single-core memcpy.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import time

from ringshm import Ring
from ringshm._C import ffi

ROUND_TRIPS = 5000
RECORD_BYTES = 1 << 20
N_RECORDS = 200


def _echo(in_name: str, out_name: str) -> None:
    rin, rout = Ring.attach(in_name, role="consumer"), Ring.attach(out_name, role="producer")
    while msg := rin.recv(timeout_s=30):
        rout.send(msg, timeout_s=30)
    rout.send(b"", timeout_s=30)
    rin.close()
    rout.close()


def _pipe_echo(conn) -> None:
    while msg := conn.recv_bytes():
        conn.send_bytes(msg)
    conn.send_bytes(b"")


def _sink(in_name: str) -> None:
    rin = Ring.attach(in_name, role="consumer")
    dst = bytearray(RECORD_BYTES)
    dst_ptr = ffi.from_buffer(dst)
    while True:
        view = rin.peek(timeout_s=30)
        n = len(view)
        ffi.memmove(dst_ptr, view, n)
        rin.release()
        if n == 0:
            break
    rin.close()


def _median_rtt_us(send, recv) -> float:
    samples = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(ROUND_TRIPS // 5):
            send(b"x" * 64)
            recv()
        samples.append((time.perf_counter() - t0) / (ROUND_TRIPS // 5) * 1e6)
    return statistics.median(samples)


def main() -> None:
    ctx = mp.get_context("spawn")
    with Ring.create(1 << 16, role="producer") as a, Ring.create(1 << 16, role="consumer") as b:
        proc = ctx.Process(target=_echo, args=(a.name, b.name))
        proc.start()
        ring_us = _median_rtt_us(lambda m: a.send(m, timeout_s=30), lambda: b.recv(timeout_s=30))
        a.send(b"")
        b.recv(timeout_s=30)
        proc.join()
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_pipe_echo, args=(there,))
    proc.start()
    pipe_us = _median_rtt_us(here.send_bytes, here.recv_bytes)
    here.send_bytes(b"")
    here.recv_bytes()
    proc.join()
    print(f"64 B round trip, two processes:   ringshm {ring_us:7.2f} us   Pipe {pipe_us:7.2f} us   "
          f"ratio {ring_us / pipe_us:.3f}")

    src = os.urandom(RECORD_BYTES)
    with Ring.create(4 << 20, role="producer") as ring:
        proc = ctx.Process(target=_sink, args=(ring.name,))
        proc.start()
        t0 = time.perf_counter()
        for _ in range(N_RECORDS):
            ring.send(src, timeout_s=30)
        ring.send(b"", timeout_s=30)
        proc.join()
        ring_gbs = N_RECORDS * RECORD_BYTES / (time.perf_counter() - t0) / 1e9
    dst = bytearray(RECORD_BYTES)
    src_ptr, dst_ptr = ffi.from_buffer(src), ffi.from_buffer(dst)
    t0 = time.perf_counter()
    for _ in range(N_RECORDS):
        ffi.memmove(dst_ptr, src_ptr, RECORD_BYTES)
    memcpy_gbs = N_RECORDS * RECORD_BYTES / (time.perf_counter() - t0) / 1e9
    print(f"1 MiB records, two processes:     ringshm {ring_gbs:7.2f} GB/s memcpy {memcpy_gbs:5.2f} GB/s "
          f"ratio {ring_gbs / memcpy_gbs:.3f}")


if __name__ == "__main__":
    main()
