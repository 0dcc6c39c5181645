"""Stage processes and the rings between them: spawn, wait until every stage answers, watch, stop.

Topology: coordinator ──ring 0──▶ stage 0 ──ring 1──▶ … ──ring N-1──▶ stage N-1 ──ring N──▶ coordinator.

Device binding: ``device="cuda"`` gives stage i GPU ``i % torch.cuda.device_count()`` by setting
``CUDA_VISIBLE_DEVICES`` for that child before it starts (spawn), so the process sees only its GPU before
torch initialises CUDA. ``device="cpu"``: the stages share this process's CPU affinity (``cores``); before
each op a stage takes ``cores // (stages computing right now)`` torch threads (``stage.pick_threads``), so a
single stream's decode, which visits the stages one at a time, uses every core, and a pipelined prefill,
which keeps them all busy, does not oversubscribe.

Several hosts (``ringshm.cluster``): a group holds one node's share, its stages and their rings, plus one bridge
process per edge to another host (``ringshm.bridge``); GPUs are numbered per node; ``busy()`` / ``ops()`` of
other nodes' stages read 0.

Cleanup: ``close()`` is idempotent and also runs when the group is garbage-collected or the interpreter
exits (``weakref.finalize``): it stops the stages, reaps them and unlinks every segment. Segments left by a
process that was SIGKILLed are removed by ``sweep_stale()`` when the next group starts.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import weakref
from contextlib import contextmanager
from pathlib import Path

from ringshm import messages as m
from ringshm.bridge import bridge_main
from ringshm.edge import EdgeSpec
from ringshm.cluster import NodePlan
from ringshm.config import MAX_TOP_LOGPROBS, EngineConfig, ModelConfig
from ringshm.errors import ResourceShortage, RingTimeout, StageDied, StageError, StageStartupError
from ringshm.ring import Ring
from ringshm.segment import SHM_DIR, shm_free_bytes, sweep_stale
from ringshm.stage import (ERROR_BYTES, LOADED, N_SLOTS, SLOT_BUSY_S, SLOT_OPS, SLOT_STATE, StageSpec, read_error,
                           stage_main)


RECORD_OVERHEAD = 4096  # a record's header, row table, tensor descriptors and alignment, rounded up
MIN_RING_BYTES = 1 << 16


def _pow2(n: int) -> int:
    return 1 << max(MIN_RING_BYTES, n - 1).bit_length()


def default_depth(cfg: EngineConfig) -> int:
    """Decode micro-batches in flight when ``cfg.depth`` is None: one per stage where every stage computes on
    its own (``device="cuda"``: a GPU each; CPU: at least 2 cores per stage), else 1.

    Each micro-batch is one more pass over every stage's weights per step, which pays only when the stages
    then run at once. Measured on 2 cores, 3 stages, 8 streams of 64 tokens: depth 1 226 tok/s, depth 3 125.
    """
    if cfg.device == "cuda" or len(os.sched_getaffinity(0)) >= 2 * cfg.stages:
        return cfg.stages
    return 1


def ring_capacities(cfg: EngineConfig, hidden: int, vocab: int) -> list[int]:
    """Data bytes of each ring (``stages + 1``), sized from what its records can be, as powers of two.

    A step op carries at most ``cfg.max_op_tokens`` tokens: ring 0 their ids (int64) and as many prompt
    target ids (int64, prompt logprobs), the rings between stages their hidden states (``[T, hidden]``, 4
    bytes each) and the targets, the last ring the replies (ids, plus fp32 logits ``[n, vocab]`` of the
    segments that sample, plus logprobs: 4 + ``MAX_TOP_LOGPROBS`` x 12 bytes per scored position). Up to
    ``prefill_depth + depth`` ops are in flight. The last ring must hold every reply in flight: the
    coordinator drains it only between sends, so a full one would block the stages while the coordinator
    waits to send. A plain or sampling stream has one decode op in flight, so all replies together carry at
    most ``max_rows`` logits rows and ``max_rows`` decode logprob positions, plus the prompt positions of the
    prefill ops (``prefill_depth`` x ``step_tokens``). The other rings only need room for a few records: when
    one is full its producer waits (backpressure) while the consumer keeps draining it. With the defaults and
    SmolLM2 (hidden 576, vocab 49152): 256 KiB, 4 MiB per hop between stages, 4 MiB.
    """
    tokens = cfg.max_op_tokens
    in_flight = cfg.prefill_depth + (cfg.stages if cfg.depth is None else cfg.depth) + 1
    ids = tokens * 8 + RECORD_OVERHEAD
    first = _pow2(in_flight * (ids + tokens * 8) + ids)
    hidden_rec = tokens * (hidden * 4 + 8) + RECORD_OVERHEAD
    middle = _pow2(3 * hidden_rec)  # one being read, one being written, one waiting
    logits = cfg.max_rows * vocab * 4
    per_position = 4 + MAX_TOP_LOGPROBS * 12  # lp_chosen fp32, top-k ids int64 + logprobs fp32
    logprobs = (cfg.prefill_depth * cfg.step_tokens + cfg.max_rows) * per_position
    largest = ids + logits + tokens * per_position + RECORD_OVERHEAD  # a wrap wastes at most one record's tail
    last = _pow2(in_flight * (ids + RECORD_OVERHEAD) + logits + logprobs + largest)
    return [first] + [middle] * (cfg.stages - 1) + [last]


def check_shm(capacities: list[int]) -> None:
    """Refuse, before anything is created, rings that ``/dev/shm`` has no room for.

    Raises:
        ResourceShortage: with the sizes and what to change (Docker's ``--shm-size``, fewer stages / rows).
    """
    from ringshm.ring import HEADER_BYTES

    need = sum(c + HEADER_BYTES for c in capacities)
    free = shm_free_bytes()
    if need > free:
        mib = 2 ** 20
        raise ResourceShortage(
            f"the {len(capacities)} rings need {need / mib:.1f} MiB of shared memory ("
            f"{', '.join(f'{c / mib:g}' for c in capacities)} MiB) but {SHM_DIR} has {free / mib:.1f} MiB free: "
            f"enlarge it (Docker: --shm-size=1g; Kubernetes: an emptyDir with medium Memory on /dev/shm), "
            f"remove stale segments there, or use fewer stages, a smaller --prefill-chunk / --prefill-depth or "
            f"fewer --max-rows")


# Memory one stage process needs besides its weights and KV cache: the interpreter, torch and its thread
# pools, the tokenizer-free stage loop (measured ~350 MB RSS for a SmolLM2 stage with 3 layers on CPU).
STAGE_BASE_BYTES = 400 * 2**20


def stage_memory_bytes(mc: ModelConfig, layers: range, is_first: bool, is_last: bool, max_rows: int,
                       max_seq_len: int, bytes_per_weight: float) -> tuple[int, int]:
    """(weights, KV cache) bytes of one stage: ``bytes_per_weight`` per parameter (the checkpoint's own
    encoding on CPU fp32 stages, the dtype's width where weights are dequantized), each stage holding its own
    embedding / head; KV fp32 ``[max_rows, max_seq_len, 2 * kv_dim]`` per layer."""
    per_layer = (mc.hidden * mc.q_dim + 2 * mc.hidden * mc.kv_dim + mc.q_dim * mc.hidden
                 + 3 * mc.hidden * mc.intermediate + 2 * mc.hidden)
    if mc.attention_bias:
        per_layer += mc.q_dim + 2 * mc.kv_dim
    params = len(layers) * per_layer
    if is_first:
        params += mc.vocab * mc.hidden
    if is_last:
        params += mc.hidden + mc.vocab * mc.hidden
    kv = len(layers) * max_rows * max_seq_len * 2 * mc.kv_dim * 4
    return int(params * bytes_per_weight), kv


def checkpoint_bytes_per_weight(path: str | Path, mc: ModelConfig) -> float:
    """Average stored bytes per parameter: the checkpoint's tensor files (a .gguf, or an HF directory's
    *.safetensors) over the model's parameter count. CPU fp32 stages keep weights in that encoding."""
    p = Path(path)
    size = p.stat().st_size if p.is_file() else sum(f.stat().st_size for f in p.glob("*.safetensors"))
    n_params = stage_memory_bytes(mc, range(mc.n_layers), True, not mc.tie_embeddings, 0, 0, 1.0)[0]
    return max(size / max(n_params, 1), 0.5)


def available_memory_bytes() -> int:
    """Memory this process tree may still use: the system's available memory (psutil), capped by the cgroup
    v2 limit (``memory.max - memory.current``) when there is one (containers)."""
    import psutil

    avail = psutil.virtual_memory().available
    try:
        cg = Path("/sys/fs/cgroup")
        limit = (cg / "memory.max").read_text().strip()
        if limit != "max":
            avail = min(avail, int(limit) - int((cg / "memory.current").read_text()))
    except (OSError, ValueError):
        pass
    return avail


def check_memory(cfg: EngineConfig, mc: ModelConfig, layer_ranges: list[range], max_seq_len: int,
                 available_bytes: int | None = None, bytes_per_weight: float | None = None,
                 local: range | None = None) -> None:
    """Refuse, before any stage starts, weights + KV caches that do not fit the available memory.

    CPU stages count against host memory; with ``device="cuda"`` the KV cache and weights live on the GPU
    and only the per-process base is checked here. ``bytes_per_weight``: the checkpoint's encoding
    (``checkpoint_bytes_per_weight``), what CPU fp32 stages hold; None counts dequantized weights of the dtype.
    ``local``: the stages this host runs (a node of a multi-host engine); None = all.

    Raises:
        ResourceShortage: with the per-stage numbers and what to change.
    """
    gib = 2 ** 30
    width = 2.0 if cfg.dtype == "bfloat16" else 4.0
    if bytes_per_weight is not None and cfg.device == "cpu" and cfg.dtype == "float32":
        width = bytes_per_weight
    local = range(len(layer_ranges)) if local is None else local
    parts = [stage_memory_bytes(mc, layer_ranges[i], i == 0, i == len(layer_ranges) - 1, cfg.max_rows, max_seq_len,
                                width) for i in local]
    weights, kv = sum(w for w, _ in parts), sum(k for _, k in parts)
    base = STAGE_BASE_BYTES * len(parts)
    need = base + (weights + kv if cfg.device == "cpu" else 0)
    avail = available_memory_bytes() if available_bytes is None else available_bytes
    if need > avail:
        per_stage = ", ".join(f"{(w + k) / gib:.2f}" for w, k in parts)
        raise ResourceShortage(
            f"the engine needs ~{need / gib:.1f} GiB of memory (weights {weights / gib:.2f} GiB + KV cache "
            f"{kv / gib:.2f} GiB for max_rows={cfg.max_rows} x max_seq_len={max_seq_len} + "
            f"{base / gib:.2f} GiB for {len(parts)} stage processes; per stage: {per_stage} GiB) but "
            f"{avail / gib:.1f} GiB is available: lower --max-rows or --max-seq-len (the KV cache is fp32 whatever "
            f"the dtype)")


# libgomp (the OpenMP of torch and of ringshm's matmul) keeps a worker spinning after each parallel region. A
# stage that has just finished an op then burns a core the next stage wants. With the quantized C matmul (120
# short parallel regions per decode token, ~10 ms a token), on 2 cores, 3-stage / 1-stage decode tok/s measured
# 0.73 with 50k (the value tuned for torch's fp32 GEMMs), 0.42 with 200k, 0.66-0.80 with 20k, 0.83-0.86 with
# 10k, 0.97-1.03 with 5k, 0.95 with 2k and 0.88 with 0 (every region then pays a wake-up; 1 stage loses 12 %).
# Children get 5k unless the caller set a spin count itself.
_CHILD_ENV = {"GOMP_SPINCOUNT": "5000"}


@contextmanager
def _child_env(gpu: int | None):
    """The environment one stage child starts with (spawn copies the parent's at start): its GPU in
    CUDA_VISIBLE_DEVICES, and libgomp's spin count (see _CHILD_ENV) unless already set."""
    changes = {k: v for k, v in _CHILD_ENV.items() if k not in os.environ}
    if gpu is not None:
        changes["CUDA_VISIBLE_DEVICES"] = str(gpu)
    old = {k: os.environ.get(k) for k in changes}
    os.environ.update(changes)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


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
                 hidden: int, vocab: int, plan: NodePlan | None = None):
        self.cfg, self.layer_ranges = cfg, layer_ranges
        self.plan = plan = plan or NodePlan(0, (range(cfg.stages),), cfg.stages)
        self.closed = False
        sweep_stale()
        n, local = cfg.stages, plan.stages
        n_gpus = 0
        if cfg.device == "cuda":
            import torch

            n_gpus = torch.cuda.device_count()
            if n_gpus == 0:
                raise ValueError("device='cuda' but torch sees no GPU: use device='cpu'")
        capacities = ring_capacities(cfg, hidden, vocab)
        # Ring i is stage i's input (ring n: the replies). This node's: its stages' inputs and its last stage's
        # output; node 0 of several also the coordinator's reply ring, which the return edge feeds.
        ring_ids = list(range(local.start, local.stop + 1)) + ([n] if plan.node == 0 and plan.nnodes > 1 else [])
        check_shm([capacities[i] for i in ring_ids])
        tag = f"n{plan.node}" if plan.nnodes > 1 else ""  # each host's segments told apart by name (segment.py)
        self.rings: list[Ring] = []
        self.procs: list = []  # the stage processes, in stage order
        self.bridges: list[tuple[object, int, int, int]] = []  # (process, edge, rank, remote stage)
        self._children: list = []  # stages and bridges: what the finalizer reaps
        self._finalizer = weakref.finalize(self, _cleanup, self._children, self.rings)
        ctx = mp.get_context("spawn")
        self.status = ctx.Array("d", n * N_SLOTS, lock=False)
        self.errors = ctx.Array("c", (n + 3) * ERROR_BYTES, lock=False)  # each stage's / bridge's error, if any
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
                                 max_op_tokens=cfg.max_op_tokens, node=plan.node)
                with _child_env((i - local.start) % n_gpus if n_gpus else None):
                    p = ctx.Process(target=stage_main, args=(spec, self.status, self.errors), daemon=True,
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

        n = len(self.plan.stages)
        link.send(m.Message(m.PING))
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        bar = tqdm(total=n, desc="loading stages", unit="stage", disable=not progress, leave=False)
        try:
            while True:
                loaded = sum(self.status[i * N_SLOTS + SLOT_STATE] >= LOADED for i in self.plan.stages)
                if loaded != bar.n:
                    bar.update(loaded - bar.n)
                self._raise_load_error()
                try:
                    link.recv(timeout_s=0.2)
                    return
                except RingTimeout:
                    pass
                except StageError as exc:
                    raise StageStartupError(str(exc), exc.stage, exc.remote_type) from None
                except StageDied as exc:
                    self._raise_load_error()  # a stage that failed to load wrote its error before it exited
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
        """Raise StageDied naming the first stage process that is gone; a bridge that is gone names the stage
        across its edge (a local stage then often exits too, but only because its ring peer went)."""
        for k, (p, edge, _, remote) in enumerate(self.bridges):
            if not p.is_alive():
                text = read_error(self.errors, self.cfg.stages + k)
                if not text:  # it wrote nothing: this host's own bridge process was killed or crashed
                    how = f"killed by signal {-p.exitcode}" if (p.exitcode or 0) < 0 else f"exit code {p.exitcode}"
                    text = f"this node's bridge of edge {edge} (pid {p.pid}) died: {how}"
                raise StageDied(f"{self.describe(remote)} is unreachable: {text}", remote, p.exitcode)
        for i, p in zip(self.plan.stages, self.procs):
            if not p.is_alive():
                code = p.exitcode
                how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
                layers = self.layer_ranges[i]
                raise StageDied(f"stage {i} (pid {p.pid}, layers {layers.start}-{layers.stop - 1}) died: {how}",
                                i, code)

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
            if self.plan.node == 0 and self._children and all(p.is_alive() for p in self._children):
                try:  # may fail when an exception (a signal) interrupted a send half-way: then kill below
                    sent = self.rings[0].try_send(m.encode(m.Message(m.SHUTDOWN)))
                except Exception:
                    sent = False
                if sent is not False:
                    for p in self._children:
                        p.join(timeout=5)
        finally:
            self._finalizer()
