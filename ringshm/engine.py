"""``Engine``: spawns the stage processes, owns the rings between them, and serves requests.

Topology: coordinator ──ring 0──▶ stage 0 ──ring 1──▶ … ──ring N-1──▶ stage N-1 ──ring N──▶ coordinator.

Device binding: ``device="cuda"`` gives stage i GPU ``i % torch.cuda.device_count()`` by setting
``CUDA_VISIBLE_DEVICES`` for that child before it starts (spawn), so the process sees only its GPU before
torch initialises CUDA. ``device="cpu"`` gives each stage ``max(1, cores // stages)`` torch threads (cores =
this process's CPU affinity): the stages of a pipeline run at once, so more threads would oversubscribe.

Cleanup: ``close()`` (idempotent, also run by the context manager and, failing both, when the engine is
garbage-collected or the interpreter exits) stops the stages, reaps them and unlinks every segment.
Segments left by an engine whose process was SIGKILLed are removed by ``sweep_stale()`` at the next start.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from ringshm import messages as m
from ringshm.config import EngineConfig, GenerationParams
from ringshm.coordinator import Link, Stream, TokenEvent, decode_solo, prefill
from ringshm.results import BatchResult, GenerationResult, result_of
from ringshm.scheduler import RowsRun, run_batch
from ringshm.errors import RingTimeout, StageDied, StageError, StageStartupError
from ringshm.ring import Ring
from ringshm.sampling import Sampler, TextStream
from ringshm.segment import sweep_stale
from ringshm.spec import NGramDrafter, SpecStats
from ringshm.spec_decode import SpecDecoder, decode_solo_spec
from ringshm.stage import LOADED, N_SLOTS, SLOT_BUSY_S, SLOT_OPS, SLOT_STATE, StageSpec, stage_main


def _ring_capacity(cfg: EngineConfig, hidden: int, vocab: int) -> int:
    """Bytes per ring: room for prefill_depth + 1 of the largest record (a prefill chunk's hidden states,
    a batch's hidden states, or a batch's logits), as a power of two."""
    largest = max(max(cfg.prefill_chunk, cfg.max_rows) * hidden * 4, cfg.max_rows * vocab * 4) + 4096
    return 1 << ((cfg.prefill_depth + 1) * largest - 1).bit_length()


@contextmanager
def _visible_device(index: int | None):
    """CUDA_VISIBLE_DEVICES for one child's start (spawn copies the parent's environment then)."""
    old = os.environ.get("CUDA_VISIBLE_DEVICES")
    if index is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(index)
    try:
        yield
    finally:
        if index is not None:
            if old is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = old


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


class Engine:
    """A model split across ``stages`` processes connected by shared-memory rings.

    Arguments are those of ``EngineConfig`` (which documents them). Use as a context manager or call
    ``close()``.

    Raises:
        ValueError: a bad argument (see EngineConfig), or a layer split that does not fit the model.
        StageStartupError: a stage could not load its layers (the message is the stage's own error).
        StageDied: a stage process died during startup.
    """

    def __init__(self, model: str | os.PathLike | None = None, stages: int = 3, layer_split=None,
                 device: str = "cpu", prefill_chunk: int = 256, prefill_depth: int = 8, max_seq_len: int = 2048,
                 max_rows: int = 8, dtype: str = "float32", progress: bool = True, **options):
        from ringshm.loader import read_config
        from ringshm.models import default_model_path

        self._closed = True  # until every resource exists
        self.config = cfg = EngineConfig(
            model=None if model is None else str(model), stages=stages, layer_split=layer_split, device=device,
            prefill_chunk=prefill_chunk, prefill_depth=prefill_depth, max_seq_len=max_seq_len,
            max_rows=max_rows, dtype=dtype, **options)
        self.model_path = str(model) if model is not None else str(default_model_path())
        self.model_config = read_config(self.model_path)
        self.layer_ranges = cfg.layer_ranges(self.model_config.n_layers)
        self.max_seq_len = min(cfg.max_seq_len, self.model_config.max_seq_len)
        self.eos_ids = frozenset(self.model_config.eos_token_ids)
        self._tokenizer = None
        self._job = 0
        sweep_stale()

        n = cfg.stages
        capacity = _ring_capacity(cfg, self.model_config.hidden, self.model_config.vocab)
        self._rings = [Ring.create(capacity) for _ in range(n + 1)]
        self._procs: list = []
        self._finalizer = weakref.finalize(self, _cleanup, self._procs, self._rings)
        self._closed = False
        ctx = mp.get_context("spawn")
        self._status = ctx.Array("d", n * N_SLOTS, lock=False)
        n_gpus = 0
        if cfg.device == "cuda":
            import torch

            n_gpus = torch.cuda.device_count()
            if n_gpus == 0:
                self.close()
                raise ValueError("device='cuda' but torch sees no GPU: use device='cpu'")
        cores = len(os.sched_getaffinity(0))
        try:
            for i, layers in enumerate(self.layer_ranges):
                spec = StageSpec(index=i, n_stages=n, model_path=self.model_path, layer_start=layers.start,
                                 layer_stop=layers.stop, max_rows=cfg.max_rows, max_seq_len=self.max_seq_len,
                                 dtype=cfg.dtype, device=cfg.device, in_ring=self._rings[i].name,
                                 out_ring=self._rings[i + 1].name, n_threads=max(1, cores // n),
                                 ring_timeout_s=cfg.op_timeout_s, link_latency_ms=cfg.link_latency_ms)
                with _visible_device(i % n_gpus if n_gpus else None):
                    p = ctx.Process(target=stage_main, args=(spec, self._status), daemon=True,
                                    name=f"ringshm-stage-{i}")
                    p.start()
                self._procs.append(p)
            self._rings[0].claim("producer")
            self._rings[n].claim("consumer")
            self._link = Link(self._rings[0], self._rings[n], self._check_stages, cfg.op_timeout_s,
                              cfg.link_latency_ms)
            self._wait_ready(progress)
        except BaseException:
            self.close()
            raise

    # ----------------------------------------------------------------------------------------- lifecycle
    def _wait_ready(self, progress: bool) -> None:
        """Send a PING through every stage and wait for it, showing loading progress."""
        from tqdm import tqdm

        n = self.config.stages
        self._link.send(m.Message(m.PING))
        deadline = time.monotonic() + self.config.startup_timeout_s
        bar = tqdm(total=n, desc="loading stages", unit="stage", disable=not progress, leave=False)
        try:
            while True:
                loaded = sum(self._status[i * N_SLOTS + SLOT_STATE] >= LOADED for i in range(n))
                if loaded != bar.n:
                    bar.update(loaded - bar.n)
                try:
                    self._link.recv(timeout_s=0.2)
                    return
                except RingTimeout:
                    pass
                except StageError as exc:
                    raise StageStartupError(str(exc), exc.stage, exc.remote_type) from None
                except StageDied as exc:
                    raise StageStartupError(f"{exc} during startup", exc.stage) from None
                if time.monotonic() > deadline:
                    raise StageStartupError(f"stages not ready within startup_timeout_s="
                                            f"{self.config.startup_timeout_s}")
        finally:
            bar.close()

    def _check_stages(self) -> None:
        """Raise StageDied naming the first stage process that is gone."""
        for i, p in enumerate(self._procs):
            if not p.is_alive():
                code = p.exitcode
                how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
                layers = self.layer_ranges[i]
                raise StageDied(f"stage {i} (pid {p.pid}, layers {layers.start}-{layers.stop - 1}) died: {how}",
                                i, code)

    def close(self) -> None:
        """Stop the stages (SHUTDOWN, then kill what did not exit), reap them, unlink every segment.
        Idempotent; safe after a stage died."""
        if self._closed:
            return
        self._closed = True
        try:
            if all(p.is_alive() for p in self._procs) and self._procs:
                self._rings[0].try_send(m.encode(m.Message(m.SHUTDOWN)))
                for p in self._procs:
                    p.join(timeout=5)
        finally:
            self._finalizer()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def pids(self) -> list[int]:
        """The stage processes' pids, stage 0 first."""
        return [p.pid for p in self._procs]

    @property
    def in_flight(self) -> int:
        """Ops sent and not yet answered (0 between requests)."""
        return self._link.in_flight

    @property
    def segment_names(self) -> list[str]:
        """Names of the shared-memory segments this engine owns."""
        return [r.name for r in self._rings]

    # -------------------------------------------------------------------------------------------- text
    @property
    def tokenizer(self):
        """The model's tokenizer (transformers), loaded on first use and cached on disk."""
        if self._tokenizer is None:
            from ringshm.tokenizer import load_tokenizer

            self._tokenizer = load_tokenizer(self.model_path)
        return self._tokenizer

    def encode(self, prompt: str | list[int], chat: bool = False) -> list[int]:
        """Token ids of ``prompt``: a string is tokenised (``chat``: through the model's chat template as one
        user turn, with the assistant prefix); a list of ids is taken as is (no special tokens added).

        Raises:
            ValueError: an empty prompt, or an id outside the vocabulary.
        """
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty: give at least one character or token id")
            if chat:
                ids = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                         add_generation_prompt=True, tokenize=True)
                ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
            else:
                ids = self.tokenizer(prompt)["input_ids"]
            return [int(t) for t in ids]
        ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("prompt is empty: give at least one token id")
        vocab = self.model_config.vocab
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        return ids

    # ---------------------------------------------------------------------------------------- requests
    def _make_stream(self, index: int, row: int, prompt, p: GenerationParams) -> Stream:
        ids = self.encode(prompt, p.chat)
        if len(ids) + p.max_new_tokens > self.max_seq_len:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_new_tokens ({p.max_new_tokens}) = "
                             f"{len(ids) + p.max_new_tokens} exceeds max_seq_len {self.max_seq_len}: shorten the "
                             f"prompt, lower max_new_tokens, or start the engine with a larger max_seq_len")
        seed = None if p.seed is None else p.seed + index
        s = Stream(index, row, ids, p.max_new_tokens, Sampler(p.temperature, p.top_k, p.top_p, seed),
                   TextStream(self.tokenizer, p.stop), self.eos_ids)
        if p.spec == "ngram":
            s.spec = SpecDecoder(s, NGramDrafter(p.spec_k, p.spec_ngram), p.spec_depth)
        return s

    def _depth(self, p: GenerationParams) -> int:
        """The prefill depth of one request: the engine's unless overridden (A/B runs on one engine)."""
        return self.config.prefill_depth if p.prefill_depth is None else p.prefill_depth

    def stream(self, prompt: str | list[int], max_new_tokens: int = 128, **params) -> Iterator[TokenEvent]:
        """Generate, yielding a ``TokenEvent`` (token id and text delta) per committed token.

        Arguments as ``generate``; bad input raises here, at the call, before anything is sent. Closing the
        generator early drains what is in flight, so the engine is ready for the next request.
        """
        p = GenerationParams(max_new_tokens=max_new_tokens, **params)
        return self._run_solo(self._make_stream(0, 0, prompt, p), self._depth(p))

    def _run_solo(self, s: Stream, depth: int) -> Iterator[TokenEvent]:
        if self._closed:
            raise RuntimeError("engine is closed")
        self._job += 1
        try:
            yield from prefill(self._link, [s], self.config.prefill_chunk, depth, self._job)
            if s.spec is not None:
                s.spec.job = self._job
                yield from decode_solo_spec(self._link, s.spec)
            else:
                yield from decode_solo(self._link, s, self._job)
        finally:
            self._link.drain()

    def generate(self, prompt: str | list[int], max_new_tokens: int = 128, *,
                 on_token: Callable[[TokenEvent], None] | None = None, **params) -> GenerationResult:
        """Generate a continuation of ``prompt`` over the stage ring.

        Args:
            prompt: a string (tokenised; ``chat=True`` applies the chat template) or a list of token ids
                (taken as is, no special tokens added).
            max_new_tokens: most tokens to generate (>= 1).
            on_token: called with each ``TokenEvent`` as it is committed (streaming).
            **params: the other fields of ``ringshm.config.GenerationParams``: temperature, top_k, top_p,
                seed, stop, chat, prefill_depth, spec ("ngram"), spec_k, spec_depth, spec_ngram.

        Raises:
            ValueError: empty prompt, ids outside the vocabulary, prompt + max_new_tokens > max_seq_len,
                bad parameters — all before anything is sent. TypeError: an unknown parameter.
            StageDied: a stage process died (named, within ~0.1 s of its death).
            StageError / KVCacheOverflow: a stage failed an op; the engine stays usable.
        """
        p = GenerationParams(max_new_tokens=max_new_tokens, **params)
        s = self._make_stream(0, 0, prompt, p)
        busy0 = self._busy()
        busy_first = None
        for ev in self._run_solo(s, self._depth(p)):
            if busy_first is None:
                busy_first = self._busy()
            if on_token is not None:
                on_token(ev)
        return self._result(s, busy0, busy_first)

    def _busy(self) -> list[float]:
        return [self._status[i * N_SLOTS + SLOT_BUSY_S] for i in range(self.config.stages)]

    def stage_ops(self) -> list[int]:
        """Ops each stage has applied since startup."""
        return [int(self._status[i * N_SLOTS + SLOT_OPS]) for i in range(self.config.stages)]

    def _result(self, s: Stream, busy0: list[float], busy_first: list[float]) -> GenerationResult:
        return result_of(s, busy0, busy_first, self._busy(), self.config.stages)

    # ------------------------------------------------------------------------------------- many streams
    def stream_batch(self, prompts: list, mode: str = "rows", max_new_tokens: int = 128, *,
                     decode_depth: int = 1, **params) -> "BatchStream":
        """Serve many prompts at once; iterate the returned ``BatchStream`` for ``TokenEvent``s (``.stream``
        is the prompt's index) as tokens are committed. Arguments as ``generate_batch``; bad input raises
        here, before anything is sent."""
        if mode not in ("rows", "batch"):
            raise ValueError(f"mode must be 'rows' or 'batch', got {mode!r}")
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError("prompts must be a non-empty list of strings or token-id lists")
        if mode == "batch" and len(prompts) > self.config.max_rows:
            raise ValueError(f"batch mode needs one KV row per prompt: {len(prompts)} prompts > max_rows "
                             f"{self.config.max_rows}; use mode='rows' (it queues) or a larger max_rows")
        if not isinstance(decode_depth, int) or decode_depth < 1:
            raise ValueError(f"decode_depth must be an int >= 1, got {decode_depth!r}")
        p = GenerationParams(max_new_tokens=max_new_tokens, **params)
        if mode == "batch" and p.spec is not None:
            raise ValueError("batch mode decodes in lockstep without speculation: use mode='rows' with spec")
        streams = [self._make_stream(i, i if mode == "batch" else -1, prompt, p) for i, prompt in enumerate(prompts)]
        return BatchStream(self, streams, mode, self._depth(p), decode_depth)

    def generate_batch(self, prompts: list, mode: str = "rows", max_new_tokens: int = 128, *,
                       decode_depth: int = 1, on_token: Callable[[TokenEvent], None] | None = None,
                       **params) -> BatchResult:
        """Generate for every prompt over the same stages; one result per prompt, in input order.

        Args:
            prompts: strings or token-id lists (as ``generate``).
            mode: "rows" (de-lockstep: each stream its own ops; more prompts than max_rows queue for a free
                row; speculation allowed) or "batch" (lockstep decode; at most max_rows prompts).
            decode_depth: batch mode only: lockstep micro-batches in flight (see ``ringshm.scheduler``).
            **params: as ``generate`` (stream i samples with ``seed + i``).

        Raises:
            ValueError: bad input (any prompt), before anything is sent. StageDied, StageError: as generate.
        """
        run = self.stream_batch(prompts, mode, max_new_tokens, decode_depth=decode_depth, **params)
        for ev in run:
            if on_token is not None:
                on_token(ev)
        return run.result()


class BatchStream:
    """An iterable run of many streams (``Engine.stream_batch``): yields ``TokenEvent``s; ``cancel(i)`` ends
    stream ``i`` and leaves the others running; ``result()`` after the run gives the ``BatchResult``.
    Abandoning the iteration early drains what is in flight."""

    def __init__(self, engine: Engine, streams: list[Stream], mode: str, depth: int, decode_depth: int):
        self.engine, self.streams, self.mode = engine, streams, mode
        self.depth, self.decode_depth = depth, decode_depth
        self._rows: RowsRun | None = None
        self._t0 = self._t1 = 0.0
        self._busy0: list[float] = []
        self._busy1: list[float] = []

    def __iter__(self) -> Iterator[TokenEvent]:
        eng = self.engine
        if eng._closed:
            raise RuntimeError("engine is closed")
        eng._job += 1
        for s in self.streams:
            if s.spec is not None:
                s.spec.job = eng._job
        cfg = eng.config
        self._t0, self._busy0 = time.perf_counter(), eng._busy()
        try:
            if self.mode == "rows":
                self._rows = RowsRun(eng._link, self.streams, cfg.max_rows, cfg.prefill_chunk, self.depth, eng._job)
                yield from self._rows
            else:
                yield from run_batch(eng._link, self.streams, cfg.prefill_chunk, self.depth, self.decode_depth,
                                     eng._job)
        finally:
            eng._link.drain()
            self._t1, self._busy1 = time.perf_counter(), eng._busy()

    def cancel(self, index: int) -> None:
        """End stream ``index`` (finish_reason "cancelled"); the others go on."""
        if self._rows is not None:
            self._rows.cancel(index)
        else:
            self.streams[index].cancel()

    def result(self) -> BatchResult:
        """Per-stream results (input order), wall time and aggregate output tok/s of the finished run."""
        results = [result_of(s) for s in self.streams]
        wall = max(self._t1 - self._t0, 1e-9)
        spec = SpecStats()
        for s in self.streams:
            if s.spec is not None:
                spec.add(s.spec.stats)
        return BatchResult(results, self.mode, wall, sum(r.n_output_tokens for r in results) / wall,
                           [b - b0 for b, b0 in zip(self._busy1, self._busy0)], spec)
