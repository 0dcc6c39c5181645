"""Stage processes and the rings between them: spawn, wait until every stage answers, watch, stop.

Topology: coordinator ──ring 0──▶ stage 0 ──ring 1──▶ … ──ring N-1──▶ stage N-1 ──ring N──▶ coordinator.

Device binding: ``device="cuda"`` gives stage i GPU ``i % torch.cuda.device_count()`` by setting
``CUDA_VISIBLE_DEVICES`` for that child before it starts (spawn), so the process sees only its GPU before
torch initialises CUDA. ``device="cpu"``: the stages share this process's CPU affinity (``cores``); before
each op a stage takes ``cores // (stages computing right now)`` torch threads (``stage.pick_threads``), so a
single stream's decode, which visits the stages one at a time, uses every core, and a pipelined prefill,
which keeps them all busy, does not oversubscribe.

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

from ringshm import messages as m
from ringshm.config import EngineConfig
from ringshm.errors import RingTimeout, StageDied, StageError, StageStartupError
from ringshm.ring import Ring
from ringshm.segment import sweep_stale
from ringshm.stage import LOADED, N_SLOTS, SLOT_BUSY_S, SLOT_OPS, SLOT_STATE, StageSpec, stage_main


def _ring_capacity(cfg: EngineConfig, hidden: int, vocab: int) -> int:
    """Bytes per ring: room for prefill_depth + 1 of the largest record (a prefill chunk's hidden states,
    a batch's hidden states, or a batch's logits), as a power of two."""
    largest = max(max(cfg.prefill_chunk, cfg.max_rows) * hidden * 4, cfg.max_rows * vocab * 4) + 4096
    return 1 << ((cfg.prefill_depth + 1) * largest - 1).bit_length()


# libgomp (torch's OpenMP on Linux) keeps a worker spinning ~300k iterations after each parallel region. A stage
# that has just finished an op then burns a core the next stage wants: on 2 cores, 3-stage decode measured
# 56.6 ms/token with the default, 47.9 with 10k, 44.6 with 50k, 53.6 with 2k and 65.4 with OMP_WAIT_POLICY=
# PASSIVE (every region then pays a wake-up). Children get 50k unless the caller set a spin count itself.
_CHILD_ENV = {"GOMP_SPINCOUNT": "50000"}


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
                 hidden: int, vocab: int):
        self.cfg, self.layer_ranges = cfg, layer_ranges
        self.closed = False
        sweep_stale()
        n = cfg.stages
        n_gpus = 0
        if cfg.device == "cuda":
            import torch

            n_gpus = torch.cuda.device_count()
            if n_gpus == 0:
                raise ValueError("device='cuda' but torch sees no GPU: use device='cpu'")
        capacity = _ring_capacity(cfg, hidden, vocab)
        self.rings: list[Ring] = []
        self.procs: list = []
        self._finalizer = weakref.finalize(self, _cleanup, self.procs, self.rings)
        ctx = mp.get_context("spawn")
        self.status = ctx.Array("d", n * N_SLOTS, lock=False)
        cores = len(os.sched_getaffinity(0))
        try:
            self.rings.extend(Ring.create(capacity) for _ in range(n + 1))
            for i, layers in enumerate(layer_ranges):
                spec = StageSpec(index=i, n_stages=n, model_path=model_path, layer_start=layers.start,
                                 layer_stop=layers.stop, max_rows=cfg.max_rows, max_seq_len=max_seq_len,
                                 dtype=cfg.dtype, device=cfg.device, in_ring=self.rings[i].name,
                                 out_ring=self.rings[i + 1].name, cores=cores,
                                 ring_timeout_s=cfg.op_timeout_s, link_latency_ms=cfg.link_latency_ms)
                with _child_env(i % n_gpus if n_gpus else None):
                    p = ctx.Process(target=stage_main, args=(spec, self.status), daemon=True,
                                    name=f"ringshm-stage-{i}")
                    p.start()
                self.procs.append(p)
            self.rings[0].claim("producer")
            self.rings[n].claim("consumer")
        except BaseException:
            self.close()
            raise

    def wait_ready(self, link, progress: bool) -> None:
        """Send a PING through every stage and wait for it, showing loading progress (tqdm).

        Raises:
            StageStartupError: a stage failed to load (its own error), died, or startup_timeout_s passed.
        """
        from tqdm import tqdm

        n = self.cfg.stages
        link.send(m.Message(m.PING))
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        bar = tqdm(total=n, desc="loading stages", unit="stage", disable=not progress, leave=False)
        try:
            while True:
                loaded = sum(self.status[i * N_SLOTS + SLOT_STATE] >= LOADED for i in range(n))
                if loaded != bar.n:
                    bar.update(loaded - bar.n)
                try:
                    link.recv(timeout_s=0.2)
                    return
                except RingTimeout:
                    pass
                except StageError as exc:
                    raise StageStartupError(str(exc), exc.stage, exc.remote_type) from None
                except StageDied as exc:
                    raise StageStartupError(f"{exc} during startup", exc.stage) from None
                if time.monotonic() > deadline:
                    raise StageStartupError(f"stages not ready within startup_timeout_s={self.cfg.startup_timeout_s}")
        finally:
            bar.close()

    def check(self) -> None:
        """Raise StageDied naming the first stage process that is gone."""
        for i, p in enumerate(self.procs):
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
            if self.procs and all(p.is_alive() for p in self.procs):
                self.rings[0].try_send(m.encode(m.Message(m.SHUTDOWN)))
                for p in self.procs:
                    p.join(timeout=5)
        finally:
            self._finalizer()
