"""Multi-host benchmarks (issue 13): what crossing hosts over torch.distributed (gloo) costs against a ring hop,
and what it does to the engine. Two "hosts" on one machine (loopback), same run; figures only.

- Transport: round trip of one small record and of pipelined 1 MiB records, through an echo process over
  two rings vs over two edges (ring -> sending bridge -> gloo -> receiving bridge -> ring, each way).
- Engine: decode tok/s and TTFT of 4 stages on one host vs 2 + 2 over loopback gloo (a worker process tree);
  with 2 ms of emulated latency on the edges only, the TTFT of a long prompt at prefill_depth 1 vs 8 (the seed
  project's case: slow links are where the pipelined prefill pays).

On one machine the bridges compete with the stages for the same cores, so the engine ratios are an upper bound
on the cost of the bridges, not a measurement of a network.

Run: ``python -m pytest bench/bench_multihost.py --benchmark-only -s``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import statistics
import subprocess
import sys
from datetime import timedelta

import pytest
import torch

from ring_bench_workers import record_echo
from ringshm.engine.engine import Engine
from ringshm.transport import messages as m
from ringshm.transport.bridge import bridge_main
from ringshm.transport.edge import EdgeSpec
from ringshm.transport.error_buffer import ERROR_BYTES
from ringshm.transport.ring import Ring

CTX = mp.get_context("spawn")
RTT_PER_ROUND = 200
MIB_RECORDS = 64
WINDOW = 4
ROUNDS = 5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _record(op: int, n_bytes: int = 0) -> bytes:
    if op == m.STEP:
        n = n_bytes // 8
        msg = m.Message(m.STEP, segments=[m.Segment(0, 0, n, m.WANT_NONE)], tensors=[torch.zeros(n, dtype=torch.int64)])
    else:
        msg = m.Message(op)
    return bytes(m.encode(msg))


class _Path:
    """bench -> out ring -> [edge] -> echo -> [edge] -> back ring -> bench; ``edges`` False: rings only."""

    def __init__(self, edges: bool, capacity: int = 8 << 20):
        self.rings, self.procs = [], []
        if not edges:
            a, b = Ring.create(capacity), Ring.create(capacity)
            self.rings = [a, b]
            self.procs.append(CTX.Process(target=record_echo, args=(a.name, b.name), daemon=True))
            self.out, self.back = a, b
        else:
            import torch.distributed as dist

            port = _free_port()
            self.store = dist.TCPStore("127.0.0.1", port, None, True, timedelta(seconds=60), wait_for_workers=False)
            self.errors = CTX.Array("c", 4 * ERROR_BYTES, lock=False)
            a, b, c, d = (Ring.create(capacity) for _ in range(4))
            self.rings = [a, b, c, d]
            for slot, (edge, rank, ring) in enumerate([(1, 0, a), (1, 1, b), (2, 0, c), (2, 1, d)]):
                spec = EdgeSpec(edge=edge, rank=rank, ring=ring.name, store_addr="127.0.0.1", store_port=port,
                                session="bench", bind_addr="127.0.0.1", timeout_s=10.0, connect_timeout_s=60.0,
                                where=f"edge {edge}", error_slot=slot)
                self.procs.append(CTX.Process(target=bridge_main, args=(spec, self.errors, "bench"), daemon=True))
            self.procs.append(CTX.Process(target=record_echo, args=(b.name, c.name), daemon=True))
            self.out, self.back = a, d
        self.out.claim("producer")
        self.back.claim("consumer")
        for p in self.procs:
            p.start()

    def close(self) -> None:
        self.out.send(_record(m.SHUTDOWN), timeout_s=60)
        self.back.recv(timeout_s=60)
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()
        for r in self.rings:
            r.close()
            r.unlink()


@pytest.fixture(scope="module", params=[False, True], ids=["ring", "edge"])
def path(request):
    p = _Path(request.param)
    p.out.send(_record(m.PING), timeout_s=120)  # the edges form on first use
    p.back.recv(timeout_s=120)
    yield request.param, p
    p.close()


def test_round_trip_of_a_small_record(benchmark, figures, path):
    edges, p = path
    rec = _record(m.PING)

    def round_trips():
        for _ in range(RTT_PER_ROUND):
            p.out.send(rec, timeout_s=30)
            p.back.recv(timeout_s=30)

    benchmark.pedantic(round_trips, rounds=ROUNDS, warmup_rounds=1)
    name = "edge" if edges else "ring"
    figures.record(f"multihost_rtt.{name}", benchmark, per=RTT_PER_ROUND, record_bytes=len(rec))
    if edges:
        figures.ratio("round trip of one record: two edges / two ring hops", "multihost_rtt.edge", "multihost_rtt.ring")


def test_pipelined_1MiB_records(benchmark, figures, path):
    edges, p = path
    rec = _record(m.STEP, 1 << 20)

    def stream():
        for _ in range(WINDOW):
            p.out.send(rec, timeout_s=30)
        for i in range(MIB_RECORDS):
            p.back.recv(timeout_s=30)
            if i + WINDOW < MIB_RECORDS:
                p.out.send(rec, timeout_s=30)

    benchmark.pedantic(stream, rounds=ROUNDS, warmup_rounds=1)
    name = "edge" if edges else "ring"
    figures.record(f"multihost_1MiB.{name}", benchmark, per=MIB_RECORDS, window=WINDOW)
    per = figures.medians[f"multihost_1MiB.{name}"]
    print(f"\n{name}: 1 MiB records echoed, {WINDOW} in flight: {per * 1e3:.2f} ms each, {1 / per:.0f} MiB/s each way")
    if edges:
        figures.ratio("1 MiB records, pipelined: time per record, edges / rings", "multihost_1MiB.edge",
                      "multihost_1MiB.ring")


# -------------------------------------------------------------------------------------------------- engine
KW = dict(stages=4, prefill_chunk=64, max_rows=1, max_seq_len=1024, progress=False,
          prefix_cache=False)  # prefix_cache off: every round prefills cold (a repeated prompt would hit)
N_NEW = 32
PROMPT_WORDS = 500


def _prompt(engine) -> list[int]:
    text = " ".join(f"word{i % 37}" for i in range(PROMPT_WORDS))
    return engine.encode(f"Summarise: {text}")[:700]


def _measure(engine, prefill_depths=(8,)) -> dict:
    ids = _prompt(engine)
    engine.generate(ids, max_new_tokens=4)  # warm up
    out = {}
    for depth in prefill_depths:
        rs = [engine.generate(ids, max_new_tokens=N_NEW, prefill_depth=depth) for _ in range(ROUNDS)]
        out[depth] = (statistics.median(r.ttft_s for r in rs), statistics.median(r.tpot_s for r in rs))
    return out


def _two_nodes(**options):
    port = _free_port()
    worker = subprocess.Popen([sys.executable, "-m", "ringshm", "worker", "--nnodes", "2", "--node-rank", "1",
                               "--master-port", str(port), "--wait", "120"], start_new_session=True,
                              stderr=subprocess.DEVNULL)
    return worker, Engine(nnodes=2, master_port=port, **KW, **options)


def _stop(worker) -> None:
    try:
        worker.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait()


def test_engine_one_host_vs_two_nodes(benchmark, figures):
    res = {}

    def run():
        with Engine(**KW) as eng:
            res["one"] = _measure(eng)[8]
        worker, eng = _two_nodes()
        with eng:
            res["two"] = _measure(eng)[8]
        _stop(worker)

    benchmark.pedantic(run, rounds=1, warmup_rounds=0)
    for name, (ttft, tpot) in res.items():
        figures.record_value(f"multihost_ttft.{name}", ttft)
        figures.record_value(f"multihost_tpot.{name}", tpot, tok_s=1 / tpot)
        print(f"\n{name}: TTFT {ttft * 1e3:.0f} ms, decode {1 / tpot:.1f} tok/s")
    figures.ratio("decode tok/s: 2+2 stages over loopback gloo / 4 on one host", "multihost_tpot.one",
                  "multihost_tpot.two")
    figures.ratio("TTFT: 2+2 stages over loopback gloo / 4 on one host", "multihost_ttft.two", "multihost_ttft.one")


def test_ttft_over_2ms_edges_prefill_depth_8_vs_1(benchmark, figures):
    res = {}

    def run():
        worker, eng = _two_nodes(edge_latency_ms=2.0)
        with eng:
            res.update(_measure(eng, prefill_depths=(1, 8)))
        _stop(worker)

    benchmark.pedantic(run, rounds=1, warmup_rounds=0)
    for depth, (ttft, _) in res.items():
        figures.record_value(f"multihost_ttft_2ms.depth{depth}", ttft)
        print(f"\n2 ms edges, prefill_depth {depth}: TTFT {ttft * 1e3:.0f} ms")
    figures.ratio("TTFT over 2 ms edges: prefill_depth 8 / 1", "multihost_ttft_2ms.depth8",
                  "multihost_ttft_2ms.depth1")
