"""Peer processes for bench_ring.py (top-level functions, so the spawn start method can import them)."""

from __future__ import annotations

from ringshm import Ring
from ringshm._C import ffi


def ring_echo(in_name: str, out_name: str) -> None:
    """Send every record back until an empty record arrives."""
    rin, rout = Ring.attach(in_name, role="consumer"), Ring.attach(out_name, role="producer")
    while True:
        msg = rin.recv(timeout_s=60)
        rout.send(msg, timeout_s=60)
        if not msg:
            break
    rin.close()
    rout.close()


def pipe_echo(conn) -> None:
    while True:
        msg = conn.recv_bytes()
        conn.send_bytes(msg)
        if not msg:
            break


def queue_echo(q_in, q_out) -> None:
    while True:
        msg = q_in.get()
        q_out.put(msg)
        if not msg:
            break


def ring_sink(in_name: str, ack_name: str, record_bytes: int, copy_out: bool) -> None:
    """Consume records, acknowledging each batch with one small record; stop on a zero count.

    copy_out=True copies each record out of the ring into a private buffer (what a stage does when it
    copies a hidden state to its device); copy_out=False reads it in place (zero-copy: the first 8 bytes).
    """
    rin, ack = Ring.attach(in_name, role="consumer"), Ring.attach(ack_name, role="producer")
    dst = bytearray(record_bytes)
    dst_ptr = ffi.from_buffer(dst)
    while True:
        n_records = int.from_bytes(rin.recv(timeout_s=60), "little")
        if n_records == 0:
            break
        for _ in range(n_records):
            view = rin.peek(timeout_s=60)
            if copy_out:
                ffi.memmove(dst_ptr, view, len(view))
            else:
                dst[:8] = view[:8]
            rin.release()
        ack.send(b"k", timeout_s=60)
    rin.close()
    ack.close()


def record_echo(in_name: str, out_name: str) -> None:
    """Send every ring record back unchanged until a SHUTDOWN record has gone back (bench_multihost.py: the
    records cross bridges, which only carry real ringshm records)."""
    from ringshm.transport import messages as m

    rin, rout = Ring.attach(in_name, role="consumer"), Ring.attach(out_name, role="producer")
    while True:
        msg = rin.recv(timeout_s=120)
        rout.send(msg, timeout_s=120)
        if msg[3] == m.SHUTDOWN:  # the op byte of the record header
            break
    rin.close()
    rout.close()
