"""One Ring object driven by two threads, one per side (the fake-ring harness and embedded users do this).

Regression: the producer's reserve and the consumer's peek once shared the C out-parameter scratch of the
Ring object, so concurrent calls read each other's offsets (lost, misplaced and zero records)."""

from __future__ import annotations

import secrets
import threading
import zlib

from ringshm import Ring


def test_one_ring_with_a_producer_thread_and_a_consumer_thread_loses_and_reorders_nothing():
    seed = secrets.randbits(32)
    print(f"seed {seed}")
    n_records = 100_000
    sizes = [((seed * 2654435761 + i * 40503) % 56) + 8 for i in range(n_records)]
    errors: list[str] = []
    with Ring.create(1 << 20) as ring:  # roomy, tiny records: both threads stay in try_ calls at once

        def produce():
            for i, size in enumerate(sizes):
                body = (i.to_bytes(4, "little") * (size // 4 + 1))[:size]
                view = ring.try_reserve(size + 4)
                while view is None:
                    view = ring.try_reserve(size + 4)
                view[:size] = body
                view[size:] = zlib.crc32(body).to_bytes(4, "little")
                ring.commit()

        t = threading.Thread(target=produce)
        t.start()
        for i, size in enumerate(sizes):
            rec = ring.try_recv()
            while rec is None:
                rec = ring.try_recv()
            body, crc = rec[:-4], int.from_bytes(rec[-4:], "little")
            if len(body) != size or zlib.crc32(body) != crc or body[:4] != i.to_bytes(4, "little"):
                errors.append(f"record {i}: size {len(body)} (want {size}), crc ok {zlib.crc32(body) == crc}")
                break
        t.join(timeout=10)
    assert not errors, errors
