"""Stage processes and the rings between them: start (from a fork server, ``process_start``), wait until every
stage answers, watch, stop.

Topology: coordinator ──ring 0──▶ stage 0 ──ring 1──▶ … ──ring N-1──▶ stage N-1 ──ring N──▶ coordinator.

Device binding: ``device="cuda"`` gives stage i GPU ``i % torch.cuda.device_count()``: the stage sets
``CUDA_VISIBLE_DEVICES`` first thing (``StageSpec.gpu``), so the process sees only its GPU before torch
initialises CUDA. ``device="cpu"``: the stages share this process's CPU affinity (``cores``); before
each op a stage takes ``cores // (stages computing right now)`` torch threads (``stage_threads.ThreadPicker``), so a
single stream's decode, which visits the stages one at a time, uses every core, and a pipelined prefill,
which keeps them all busy, does not oversubscribe; while other processes hold the cores a stage runs on one.

Several hosts (``ringshm.transport.cluster``): a group holds one node's share, its stages and their rings, plus
one bridge process per edge to another host (``ringshm.transport.bridge``); GPUs are numbered per node; ``busy()`` /
``ops()`` of
other nodes' stages read 0.

Cleanup: ``close()`` is idempotent and also runs when the group is garbage-collected or the interpreter
exits (``weakref.finalize``): it stops the stages, reaps them and unlinks every segment. Segments left by a
process that was SIGKILLed are removed by ``sweep_stale()`` when the next group starts.
"""

from __future__ import annotations

import os
import time
import weakref
from dataclasses import dataclass

from ringshm.config import EngineConfig
from ringshm.errors import RingTimeout, StageDied, StageError, StageStartupError
from ringshm.runtime.process_start import (
    UNGUARDED_MAIN_EXIT,
    process_context,
    refuse_in_spawn_bootstrap,
    unguarded_main_error,
)
from ringshm.runtime.resources import check_shm, ring_capacities
from ringshm.runtime.stage import LOADED, N_SLOTS, SLOT_BUSY_S, SLOT_OPS, SLOT_STATE, StageSpec, stage_main
from ringshm.transport import messages as m
from ringshm.transport.bridge import bridge_main
from ringshm.transport.cluster import DEFAULT_PORT, check_interrupted
from ringshm.transport.edge import EdgeSpec
from ringshm.transport.error_buffer import ERROR_BYTES, read_error
from ringshm.transport.ring import Ring
from ringshm.transport.segment import sweep_stale


def connect_timeout_s(cfg: EngineConfig) -> float:
    """How long an edge may take to form: both ends' bridges start within seconds of the rendezvous (an
    interpreter and torch to import), so 2 minutes, or ``startup_timeout_s`` if shorter. A peer that died in
    between is noticed then instead of after a long startup timeout."""
    return min(cfg.startup_timeout_s, 120.0)


@dataclass(frozen=True)
class NodePlan:
    """What one node runs: its stages, its rings' neighbours across hosts, and how its bridges meet.

    ``stages``: the global indices of this node's stages; ``node_ranges``: every node's. Ring ``i`` is stage
    ``i``'s input (ring ``n_stages``: the replies). A node owns rings ``stages.start .. stages.stop``; node 0 of
    a multi-node engine also owns the coordinator's reply ring, fed by the return edge.
    """

    node: int
    node_ranges: tuple[range, ...]
    n_stages: int
    store_addr: str = "127.0.0.1"
    store_port: int = DEFAULT_PORT
    session: str = ""
    bind_addr: str = "127.0.0.1"
    timeout_s: float = 5.0
    connect_timeout_s: float = 600.0
    latency_ms: float = 0.0
    hosts: tuple[str, ...] = ()

    @property
    def stages(self) -> range:
        return self.node_ranges[self.node]

    @property
    def nnodes(self) -> int:
        return len(self.node_ranges)

    def node_of(self, stage: int) -> int:
        """The node running ``stage``."""
        return next(j for j, r in enumerate(self.node_ranges) if stage in r)

    def host(self, node: int) -> str:
        """How messages name ``node``: ``node 1 (10.0.0.2)`` where its address is known."""
        addr = self.hosts[node] if node < len(self.hosts) and self.hosts[node] else ""
        return f"node {node} ({addr})" if addr else f"node {node}"

    def edges(self) -> list[tuple[int, int, int]]:
        """This node's bridges as ``(edge, rank, remote stage)``: rank 0 sends (its ring's producer is here),
        rank 1 receives; the remote stage is the one across the edge (-1: the coordinator)."""
        if self.nnodes == 1:
            return []
        out = []
        if self.node > 0:  # ring stages.start comes from the previous node
            out.append((self.stages.start, 1, self.stages.start - 1))
        stop = self.stages.stop  # ring stages.stop goes to the next node, or back to the coordinator
        out.append((stop, 0, stop if stop < self.n_stages else -1))
        if self.node == 0:
            out.append((self.n_stages, 1, self.n_stages - 1))
        return out


ROWS_PER_DECODE_OP = 8  # shared cores: decoding rows per micro-batch before one more is sent (default_depth)


def default_depth(cfg: EngineConfig) -> tuple[int, int | None]:
    """``(depth, rows_per_op)`` when ``cfg.depth`` is None: decode micro-batches in flight, one per stage, and
    ``rows_per_op`` None where every stage computes on its own (``device="cuda"``: a GPU each; CPU: at least 2
    cores per stage), else ``ROWS_PER_DECODE_OP``: with fewer cores than stages need, the scheduler keeps two
    micro-batches (one for one stage) and adds the third and later ones only while each would carry that many
    decoding rows (``Scheduler``'s ``rows_per_op``).

    Each micro-batch is one more pass over every stage's weights per step. With cores shared, one step alone
    leaves the stages waiting on each other and two fill them at a few streams (2 cores, AMD EPYC Zen 5, 3 stages,
    depth 1 -> 2: bench_server's in-process AsyncEngine at 32 and 64 clients 459 -> 689 and 548 -> 618 tok/s, at
    8 and 16 clients 346 -> 404 and 438 -> 472; issue 31); more pay only with rows enough to share each pass:
    depth 3 / depth 2, the same machine, paired rounds on one engine (medians of 3): 8 and 16 clients 0.95 /
    1.00 in-process and 1.06 / 1.03 through the server, 32 clients 1.11-1.15 in-process, 64 clients 1.00-1.05
    in-process and 1.28-1.30 through the server; ``generate_batch`` of 8 streams 0.66-1.02, of 32 1.05-1.17.
    """
    if cfg.device == "cuda" or len(os.sched_getaffinity(0)) >= 2 * cfg.stages:
        return cfg.stages, None
    return cfg.stages, (ROWS_PER_DECODE_OP if cfg.stages > 1 else None)


def _cleanup(procs: list, rings: list[Ring]) -> None:
    """Last resort (GC / interpreter exit): kill the stages, reap them, unlink every ring."""
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=5)
    for r in rings:
        r.close()
        r.unlink()


class StageGroup:
    """The stage processes of one engine, their rings and their shared status counters.

    Args:
        cfg: the engine configuration. model_path: the checkpoint every stage loads its layers from.
        layer_ranges: one contiguous range per stage. max_seq_len: KV positions per row.
        hidden, vocab: the model's widths (they size the rings).

    Raises:
        ValueError: device="cuda" without a visible GPU.
    """

    def __init__(self, cfg: EngineConfig, model_path: str, layer_ranges: list[range], max_seq_len: int,
                 hidden: int, vocab: int, plan: NodePlan | None = None, n_blocks: int | None = None):
        refuse_in_spawn_bootstrap()
        self.cfg, self.layer_ranges = cfg, layer_ranges
        self.plan = plan = plan or NodePlan(0, (range(cfg.stages),), cfg.stages)
        self.closed = False
        self.ready = False  # every stage answered the startup PING (wait_ready)
        sweep_stale()
        n, local = cfg.stages, plan.stages
        n_gpus = 0
        if cfg.device == "cuda":
            import torch

            n_gpus = torch.cuda.device_count()
            if n_gpus == 0:
                raise ValueError("device='cuda' but torch sees no GPU: use device='cpu'")
        capacities = ring_capacities(cfg, hidden, vocab, max_seq_len)
        # Ring i is stage i's input (ring n: the replies). This node's: its stages' inputs and its last stage's
        # output; node 0 of several also the coordinator's reply ring, which the return edge feeds.
        ring_ids = list(range(local.start, local.stop + 1)) + ([n] if plan.node == 0 and plan.nnodes > 1 else [])
        check_shm([capacities[i] for i in ring_ids])
        tag = f"n{plan.node}" if plan.nnodes > 1 else ""  # each host's segments told apart by name (segment names)
        self.rings: list[Ring] = []
        self.procs: list = []  # the stage processes, in stage order
        self.bridges: list[tuple[object, int, int, int]] = []  # (process, edge, rank, remote stage)
        self._children: list = []  # stages and bridges: what the finalizer reaps
        self._finalizer = weakref.finalize(self, _cleanup, self._children, self.rings)
        ctx = process_context()
        self.status = ctx.Array("d", n * N_SLOTS, lock=False)
        self.errors = ctx.Array("c", (n + 3) * ERROR_BYTES, lock=False)  # each stage's / bridge's error, if any
        # A byte per row: the coordinator marks the rows of streams that ended with ops in flight, and this host's
        # stages skip their segments (ringshm.transport.messages). Another host's stages read their own, never
        # marked, and skip only what a stage here already marked in the op's table.
        self.ended = ctx.Array("B", cfg.max_rows, lock=False)
        cores = len(os.sched_getaffinity(0))
        try:
            self.rings.extend(Ring.create(capacities[i], tag=tag) for i in ring_ids)
            ring_of = dict(zip(ring_ids, self.rings))
            for i in local:
                layers = layer_ranges[i]
                spec = StageSpec(index=i, n_stages=n, model_path=model_path, layer_start=layers.start,
                                 layer_stop=layers.stop, max_rows=cfg.max_rows, max_seq_len=max_seq_len,
                                 dtype=cfg.dtype, device=cfg.device, in_ring=ring_of[i].name,
                                 out_ring=ring_of[i + 1].name, cores=cores,
                                 ring_timeout_s=cfg.op_timeout_s, link_latency_ms=cfg.link_latency_ms,
                                 max_op_tokens=cfg.max_op_tokens, node=plan.node, block_size=cfg.block_size,
                                 n_blocks=n_blocks, kv_dtype=cfg.kv_cache_dtype,
                                 matmul_activations=cfg.matmul_activations, row_prefetch=cfg.row_prefetch,
                                 huge_pages=cfg.huge_pages,
                                 gpu=(i - local.start) % n_gpus if n_gpus else None)
                p = ctx.Process(target=stage_main, args=(spec, self.status, self.errors, self.ended), daemon=True,
                                name=f"ringshm-stage-{i}")
                p.start()
                self.procs.append(p)
                self._children.append(p)
            for k, (edge, rank, remote) in enumerate(plan.edges()):
                spec = EdgeSpec(edge=edge, rank=rank, ring=ring_of[edge].name, store_addr=plan.store_addr,
                                store_port=plan.store_port, session=plan.session, bind_addr=plan.bind_addr,
                                timeout_s=plan.timeout_s, connect_timeout_s=plan.connect_timeout_s,
                                latency_ms=plan.latency_ms if rank == 1 else 0.0,
                                where=f"edge {edge} {'to' if rank == 0 else 'from'} {self.describe(remote)}",
                                error_slot=n + k)
                here = (f"stage {edge - 1}" if rank == 0 else f"stage {edge}" if edge < n else "the coordinator")
                p = ctx.Process(target=bridge_main, args=(spec, self.errors, f"{here} on {plan.host(plan.node)}"),
                                daemon=True, name=f"ringshm-bridge-{edge}-{'send' if rank == 0 else 'recv'}")
                p.start()
                self.bridges.append((p, edge, rank, remote))
                self._children.append(p)
            if plan.node == 0:
                self.rings[0].claim("producer")
                self.rings[-1].claim("consumer")
        except BaseException:
            self.close()
            raise

    @property
    def children(self) -> list:
        """Every process of this group: its stages, then its bridges."""
        return list(self._children)

    def describe(self, stage: int) -> str:
        """``stage 2 on node 1 (10.0.0.2)``; -1 is the coordinator."""
        if stage < 0:
            return f"the coordinator on {self.plan.host(0)}"
        return f"stage {stage} on {self.plan.host(self.plan.node_of(stage))}"

    def wait_ready(self, link, progress: bool) -> None:
        """Send a PING through every stage and wait for it, showing loading progress (tqdm).

        Raises:
            StageStartupError: a stage failed to load (its own error), died, or startup_timeout_s passed.
        """
        from tqdm import tqdm

        remote = self.cfg.stages - len(self.plan.stages)
        link.send(m.Message(m.PING))
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        # Every stage of the engine counts; another node's stages are known loaded once the PING is back.
        bar = tqdm(total=self.cfg.stages, desc="loading stages" + (f" ({remote} on other nodes)" if remote else ""),
                   unit="stage", disable=not progress)
        try:
            while True:
                loaded = sum(self.status[i * N_SLOTS + SLOT_STATE] >= LOADED for i in self.plan.stages)
                if loaded != bar.n:
                    bar.update(loaded - bar.n)
                self._raise_load_error()
                check_interrupted()  # serve blocks the stop signals meanwhile: one pending stops the load
                try:
                    link.recv(timeout_s=0.2)
                    bar.update(self.cfg.stages - bar.n)
                    self.ready = True
                    return
                except RingTimeout:
                    pass
                except StageError as exc:
                    raise StageStartupError(str(exc), exc.stage, exc.remote_type) from None
                except StageDied as exc:
                    self._raise_load_error()  # a stage that failed to load wrote its error before it exited
                    if exc.exitcode == UNGUARDED_MAIN_EXIT:
                        raise unguarded_main_error(exc) from None
                    raise StageStartupError(f"{exc} during startup", exc.stage) from None
                if time.monotonic() > deadline:
                    raise StageStartupError(f"stages not ready within startup_timeout_s={self.cfg.startup_timeout_s}")
        finally:
            bar.close()

    def _raise_load_error(self) -> None:
        """Raise the first stage's own load error (from the shared error buffer), if one wrote any."""
        for i in self.plan.stages:
            text = read_error(self.errors, i)
            if text:
                layers = self.layer_ranges[i]
                remote_type = text.split(":", 1)[0]
                raise StageStartupError(f"stage {i} (layers {layers.start}-{layers.stop - 1}) failed to load: "
                                        f"{text}", i, remote_type)

    def check(self) -> None:
        """Raise StageDied naming the first stage process that is gone, preferring one that wrote its error (the
        cause: a stage whose ring peer failed exits 0 a moment before the failed one is gone); a bridge that is gone
        names the stage across its edge (a local stage then often exits too, but only because its ring peer went)."""
        for k, (p, edge, _, remote) in enumerate(self.bridges):
            if not p.is_alive():
                text = read_error(self.errors, self.cfg.stages + k)
                if not text:  # it wrote nothing: this host's own bridge process was killed or crashed
                    how = f"killed by signal {-p.exitcode}" if (p.exitcode or 0) < 0 else f"exit code {p.exitcode}"
                    text = f"this node's bridge of edge {edge} (pid {p.pid}) died: {how}"
                raise StageDied(f"{self.describe(remote)} is unreachable: {text}", remote, p.exitcode)
        stages = list(zip(self.plan.stages, self.procs))
        dead = [(i, p) for i, p in stages if not p.is_alive()]
        if not dead:
            return
        # The cause first: a stage that wrote its error. One that exited 0 without one left because its ring peer
        # did (or on SHUTDOWN); the stage that failed may still be on its way out, its error already written.
        culprit = next(((i, p) for i, p in dead if read_error(self.errors, i)), None)
        if culprit is None and all(p.exitcode == 0 for _, p in dead):
            culprit = next(((i, p) for i, p in stages if read_error(self.errors, i)), None)
            if culprit is not None:
                culprit[1].join(timeout=1.0)
        i, p = culprit or dead[0]
        code = p.exitcode
        how = ("still exiting" if code is None else f"killed by signal {-code}" if code < 0 else f"exit code {code}")
        text = read_error(self.errors, i)  # what the stage wrote before it exited, if anything
        layers = self.layer_ranges[i]
        raise StageDied(f"stage {i} (pid {p.pid}, layers {layers.start}-{layers.stop - 1}) died: {how}"
                        + (f": {text}" if text else ""), i, code)

    def stage_status(self) -> list[dict]:
        """Every stage of the engine as this node sees it: ``{"stage", "node", "pid", "alive", "seen"}``.

        A stage of this node: its pid and whether its process lives (``seen`` "process"). Another node's stage:
        pid None, alive while every bridge of this node lives (``seen`` "edges": a remote stage that dies, or
        a host that goes silent for the edge timeout, ends the edges, which end these bridges)."""
        edges_alive = all(p.is_alive() for p, *_ in self.bridges)
        local = dict(zip(self.plan.stages, self.procs))
        out = []
        for i in range(self.cfg.stages):
            p = local.get(i)
            out.append({"stage": i, "node": self.plan.node_of(i), "pid": None if p is None else p.pid,
                        "alive": p.is_alive() if p is not None else edges_alive,
                        "seen": "process" if p is not None else "edges"})
        return out

    def busy(self) -> list[float]:
        """Seconds each stage has spent applying ops since startup."""
        return [self.status[i * N_SLOTS + SLOT_BUSY_S] for i in range(self.cfg.stages)]

    def ops(self) -> list[int]:
        """Ops each stage has applied since startup."""
        return [int(self.status[i * N_SLOTS + SLOT_OPS]) for i in range(self.cfg.stages)]

    def close(self) -> None:
        """Stop the stages (SHUTDOWN, then kill what did not exit), reap them, unlink every segment.
        Idempotent; safe after a stage died."""
        if self.closed:
            return
        self.closed = True
        try:
            # Stages still loading read no op: a SHUTDOWN would wait for their load. They hold nothing yet, so
            # they are killed at once (the finalizer), as is everything after a failure.
            if self.ready and self.plan.node == 0 and self._children and all(p.is_alive() for p in self._children):
                try:  # may fail when an exception (a signal) interrupted a send half-way: then kill below
                    sent = self.rings[0].try_send(m.encode(m.Message(m.SHUTDOWN)))
                except Exception:
                    sent = False
                if sent is not False:
                    for p in self._children:
                        p.join(timeout=5)
        finally:
            self._finalizer()
