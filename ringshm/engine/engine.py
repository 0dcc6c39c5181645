"""``Engine``: the public API. It starts a ``StageGroup`` (the stage processes and their rings,
``ringshm.runtime.launcher``) and serves requests over it through the one ``Scheduler``
(``ringshm.engine.scheduler``): one request alone, many at once (continuous batching over ``max_rows`` rows),
speculative decoding.

``close()`` (idempotent, also run by the context manager and, failing both, when the engine is
garbage-collected or the interpreter exits) stops the stages, reaps them and unlinks every segment.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator

from ringshm.config import EngineConfig
from ringshm.engine.coordinator import Link, Stream, TokenEvent
from ringshm.engine.kv_blocks import KVBlocks
from ringshm.engine.request_stream import copy_error
from ringshm.engine.results import BatchResult, GenerationResult, result_of
from ringshm.engine.sampling import Sampler, TextStream
from ringshm.engine.scheduler import Scheduler, StepStats, window_fits_chain
from ringshm.engine.spec import NGramDrafter, SpecStats
from ringshm.engine.spec_decode import SpecDecoder
from ringshm.errors import EngineOwned, InvalidParameter
from ringshm.generation_params import GenerationParams, check_logit_bias
from ringshm.runtime.launcher import NodePlan, StageGroup, connect_timeout_s, default_depth
from ringshm.runtime.process_start import refuse_in_spawn_bootstrap
from ringshm.runtime.resources import check_memory
from ringshm.transport.cluster import DEFAULT_PORT, TOKEN_ENV, Head, Rendezvous


class Engine:
    """A model split across ``stages`` processes connected by shared-memory rings.

    Arguments are those of ``EngineConfig`` (which documents them). Use as a context manager or call
    ``close()``.

    Raises:
        ValueError: a bad argument (see EngineConfig), or a layer split that does not fit the model.
        TypeError: ``model`` is neither a path nor a name (an EngineConfig, say).
        ResourceShortage: the rings do not fit in /dev/shm, or weights + KV cache do not fit the available
            memory (checked before any stage starts; the message gives the numbers and what to change).
        StageStartupError: a stage could not load its layers (the message is the stage's own error), or a
            stage process died during startup.
        ClusterRefused: with ``nnodes > 1``: a worker did not join within ``startup_timeout_s``, or it refused
            or was refused (wire version, model fingerprint, token), naming the node and the reason.

    Several hosts (``nnodes > 1``, ``ringshm.transport.cluster``): this process is node 0, the head; ``master_addr`` /
    ``master_port`` is where it serves the rendezvous, ``bind_addr`` the address its edges bind (default
    ``master_addr``), ``token`` the secret every worker must share (default: ``$RINGSHM_TOKEN``, else none).
    The other nodes run ``ringshm worker`` (``ringshm.runtime.worker.run_worker``).
    """

    def __init__(self, model: str | os.PathLike | None = None, stages: int = 3, layer_split=None,
                 device: str = "cpu", prefill_chunk: int = 256, prefill_depth: int = 8, max_seq_len: int = 2048,
                 max_rows: int = 8, dtype: str = "float32", progress: bool = True, *, node_rank: int = 0,
                 master_addr: str = "127.0.0.1", master_port: int = DEFAULT_PORT, bind_addr: str | None = None,
                 token: str | None = None, **options):
        from ringshm.model.fingerprint import fingerprint
        from ringshm.model.loader import read_config
        from ringshm.model.packaged import default_model_path
        from ringshm.model.stage_model import check_int8_runs_native

        refuse_in_spawn_bootstrap()  # a stage re-running an unguarded script: stop it before it does anything
        self._closed = True  # until every resource exists
        if model is not None and not isinstance(model, (str, os.PathLike)):
            how = (" (from an EngineConfig: Engine(**dataclasses.asdict(config)))"
                   if isinstance(model, EngineConfig) else "")
            raise TypeError(f"Engine's model must be a path or a packaged model's name (got {type(model).__name__}); "
                            f"the other settings are keyword arguments{how}")
        self.config = cfg = EngineConfig(
            model=None if model is None else str(model), stages=stages, layer_split=layer_split, device=device,
            prefill_chunk=prefill_chunk, prefill_depth=prefill_depth, max_seq_len=max_seq_len,
            max_rows=max_rows, dtype=dtype, **options)
        self.model_path = str(model) if model is not None else str(default_model_path())
        self.model_config = read_config(self.model_path)
        check_int8_runs_native(self.model_config, cfg.matmul_activations)
        self.layer_ranges = cfg.layer_ranges(self.model_config.n_layers)
        self.max_seq_len = min(cfg.max_seq_len, self.model_config.max_seq_len)
        self.n_blocks = cfg.kv_blocks(self.model_config, self.max_seq_len)
        # A request longer than the pool could never run: max_seq_len (and so the server's max_model_len and
        # chat's default max_tokens, the rest of the context) is at most what the pool holds.
        capped = self.n_blocks * cfg.block_size < self.max_seq_len
        self.max_seq_len = min(self.max_seq_len, self.n_blocks * cfg.block_size)
        self.eos_ids = frozenset(self.model_config.eos_token_ids)
        # decode micro-batches in flight, and on shared cores the rows each one beyond the second needs
        self.depth, self.rows_per_op = (cfg.depth, None) if cfg.depth is not None else default_depth(cfg)
        self._tokenizer = None
        self._grammars = None
        self._job = 0
        self._owner: str | None = None  # set by an AsyncEngine while its dispatcher drives the ring
        node_ranges = tuple(cfg.node_stage_ranges())
        rdv = Rendezvous(node_rank, master_addr, master_port, bind_addr,
                         os.environ.get(TOKEN_ENV) if token is None else token, cfg.startup_timeout_s)
        if node_rank != 0:
            raise ValueError(f"the engine runs on node 0, got node_rank={node_rank}: run `ringshm worker` on the "
                             f"other nodes")
        check_memory(cfg, self.model_config, self.layer_ranges, self.max_seq_len, self.model_path,
                     local=node_ranges[0])
        plan, self._head = None, None
        if cfg.nnodes > 1:  # meet the workers before any stage starts: a refusal costs nothing
            self._head = Head(rdv, cfg, self.model_path,
                              fingerprint(self.model_path, self.model_config, self.layer_ranges), self.max_seq_len,
                              log=(lambda text: print(f"ringshm: {text}", file=sys.stderr, flush=True))
                              if progress else (lambda text: None))
            plan = NodePlan(0, node_ranges, cfg.stages, master_addr, master_port, self._head.session,
                            rdv.local_addr(), cfg.edge_timeout_s, connect_timeout_s(cfg), cfg.edge_latency_ms,
                            tuple(self._head.hosts))
        self.kv = KVBlocks(self.n_blocks, cfg.block_size, self._fingerprint())
        if progress:
            tokens, per_block = self.kv.tokens_capacity(), cfg.kv_block_bytes(self.model_config)
            print(f"ringshm: KV cache: {self.n_blocks} blocks of {cfg.block_size} positions = {tokens} tokens "
                  f"({self.n_blocks * per_block / 2**30:.2f} GiB of {cfg.kv_cache_dtype} over {cfg.stages} "
                  f"stage{'s' if cfg.stages > 1 else ''}); "
                  f"prefix cache {'on' if cfg.prefix_cache else 'off'}"
                  + (f"; max_seq_len lowered to {self.max_seq_len}, what it holds" if capped else ""),
                  file=sys.stderr, flush=True)
            if cfg.matmul_activations == "int8":
                print("ringshm: matmuls multiply 8-bit activations (--matmul-activations int8): outputs are not the "
                      "fp32 oracle's; every byte-identity between runs still holds", file=sys.stderr, flush=True)
        self._group = StageGroup(cfg, self.model_path, self.layer_ranges, self.max_seq_len,
                                 self.model_config.hidden, self.model_config.vocab, plan, n_blocks=self.n_blocks)
        self._closed = False
        try:
            self._link = Link(self._group.rings[0], self._group.rings[-1], self._group.check, cfg.op_timeout_s,
                              cfg.link_latency_ms)
            self._group.wait_ready(self._link, progress)
        except BaseException:
            self.close()
            raise

    def _fingerprint(self) -> bytes:
        """What the prefix cache's chains start from: what makes a block's KV bits what they are (the model's
        path and config, the activation and KV dtypes, the matmuls' activations, the block size), so a chain never
        names other KV."""
        import hashlib

        cfg = self.config
        key = (f"{self.model_path}|{self.model_config}|{cfg.dtype}|{cfg.kv_cache_dtype}|{cfg.block_size}"
               f"|{cfg.matmul_activations}")
        return hashlib.blake2b(key.encode(), digest_size=16).digest()

    # ----------------------------------------------------------------------------------------- lifecycle
    def _check_stages(self) -> None:
        """Raise StageDied naming the first stage process that is gone."""
        self._group.check()

    def close(self) -> None:
        """Stop the stages, reap them, unlink every segment. Idempotent; safe after a stage died."""
        self._closed = True
        if hasattr(self, "_group"):
            self._group.close()
        if getattr(self, "_head", None) is not None:
            self._head.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def pids(self) -> list[int]:
        """This host's stage processes' pids, stage 0 first."""
        return [p.pid for p in self._group.procs]

    def stage_status(self) -> list[dict]:
        """Every stage, this host's and the other nodes': ``{"stage", "node", "pid", "alive", "seen"}``
        (``StageGroup.stage_status``: another node's stages are seen alive through the edges to it)."""
        return self._group.stage_status()

    @property
    def in_flight(self) -> int:
        """Ops sent and not yet answered (0 between requests)."""
        return self._link.in_flight

    @property
    def segment_names(self) -> list[str]:
        """Names of the shared-memory segments this engine owns."""
        return [r.name for r in self._group.rings]

    # -------------------------------------------------------------------------------------------- text
    @property
    def tokenizer(self):
        """The model's tokenizer (transformers), loaded on first use and cached on disk.

        Raises:
            ValueError: the checkpoint carries no tokenizer (then prompts must be token ids).
        """
        if self._tokenizer is None:
            from ringshm.model.tokenizer import has_tokenizer, load_tokenizer

            if not has_tokenizer(self.model_path):
                raise ValueError(f"{self.model_path} carries no tokenizer: give prompts as token ids (text, chat "
                                 f"and stop strings need a tokenizer)")
            self._tokenizer = load_tokenizer(self.model_path)
        return self._tokenizer

    def _text_tokenizer(self, p: GenerationParams):
        """The tokenizer a request's output text needs, or None for a checkpoint without one (its text stays
        empty). Raises ValueError when the request needs text: stop strings."""
        from ringshm.model.tokenizer import has_tokenizer

        if self._tokenizer is None and not has_tokenizer(self.model_path):
            if p.stop:
                raise ValueError(f"stop strings need a tokenizer, and {self.model_path} carries none")
            return None
        return self.tokenizer

    def encode(self, prompt: str | list[int], chat: bool = False, tokenizer=None) -> list[int]:
        """Token ids of ``prompt``: a string is tokenised (``chat``: through the model's chat template as one
        user turn, with the assistant prefix); a list of ids is taken as is (no special tokens added).
        ``tokenizer``: another instance of the model's tokenizer to use (one instance must not serve two threads
        at once; default: the engine's).

        With ``chat``, the prompt is the user turn's content and is tokenised as plain text: special-token
        spellings in it (``<|im_end|>``) cannot forge turns (``ringshm.model.tokenizer.encode_chat``).

        Raises:
            ValueError: an empty prompt, bytes (decode them first), text with a lone surrogate, a token list
                holding something other than ints, or an id outside the vocabulary.
        """
        from ringshm.model.tokenizer import check_text, encode_chat

        if isinstance(prompt, (bytes, bytearray, memoryview)):
            raise ValueError("prompt is bytes: pass text (prompt.decode('utf-8')) or a list of token ids")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty: give at least one character or token id")
            check_text(prompt)
            tokenizer = tokenizer or self.tokenizer
            if chat:
                return encode_chat(tokenizer, [{"role": "user", "content": prompt}])
            return [int(t) for t in tokenizer(prompt)["input_ids"]]
        if not isinstance(prompt, (list, tuple)) or any(
                isinstance(t, bool) or not isinstance(t, int) for t in prompt):
            raise ValueError(f"prompt must be a string or a list of int token ids, got "
                             f"{type(prompt).__name__}"
                             f"{' with non-int items' if isinstance(prompt, (list, tuple)) else ''}")
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
        if len(ids) + p.max_new_tokens > self.max_seq_len:  # never more than the pool holds (__init__)
            by_pool = self.max_seq_len == self.kv.tokens_capacity() < self.config.max_seq_len
            raise ValueError(f"prompt ({len(ids)} tokens) + max_new_tokens ({p.max_new_tokens}) = "
                             f"{len(ids) + p.max_new_tokens} exceeds max_seq_len {self.max_seq_len}"
                             + (f", all the KV cache holds ({self.n_blocks} blocks of {self.config.block_size} "
                                f"positions): shorten the request or start the engine with more kv_cache_memory "
                                f"(--kv-cache-memory)" if by_pool else
                                ": shorten the prompt, lower max_new_tokens, or start the engine with a larger "
                                "max_seq_len (--max-seq-len)"))
        s = new_stream(index, row, ids, p, self._text_tokenizer(p), self.eos_ids, self.model_config.vocab)
        s.cache_salt = p.cache_salt
        if p.structured_output is not None:
            s.grammar = self.grammars.state(p.structured_output)
            s.grammar.words()  # the first position's mask: a grammar that cannot start is refused here
        return s

    @property
    def grammars(self):
        """The engine's ``GrammarCompiler`` (``ringshm.engine.grammar``: structured output), made on first use.

        Raises:
            ValueError: the checkpoint carries no tokenizer (a grammar is over text).
        """
        if self._grammars is None:
            from ringshm.engine.grammar import GrammarCompiler
            from ringshm.model.tokenizer import has_tokenizer

            if self._tokenizer is None and not has_tokenizer(self.model_path):
                raise InvalidParameter(f"structured output needs a tokenizer, and {self.model_path} carries none",
                                       "structured_output")
            self._grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab, self.eos_ids)
        return self._grammars

    @property
    def grammar_stats(self) -> dict[str, float]:
        """Structured output so far (zeros before the first): grammars compiled, compile-cache hits, masks
        computed and the seconds they took. Reads without building anything."""
        g = self._grammars
        if g is None:
            return {"compiled": 0, "cache_hits": 0, "masks": 0, "mask_s": 0.0}
        return {"compiled": g.n_compiled, "cache_hits": g.n_cache_hits, "masks": g.mask_totals[1],
                "mask_s": g.mask_totals[0]}

    def _decode_depth(self, p: GenerationParams) -> int | None:
        """Decode ops in flight for a request: None for the engine's window (``depth``, row-scaled on shared
        cores: ``Scheduler.decode_window``), or ``depth`` raised to ``spec_depth`` when it speculates with chains
        longer than that window is sure to allow (each link of a verify chain is its own step op)."""
        if p.spec is None or (self.rows_per_op is not None and window_fits_chain(p.spec_depth)):
            return None
        return max(self.depth, p.spec_depth)

    def _prefill_depth(self, p: GenerationParams) -> int:
        """The prefill depth of one request: the engine's unless overridden (A/B runs on one engine)."""
        return self.config.prefill_depth if p.prefill_depth is None else p.prefill_depth

    def scheduler(self, streams: list[Stream] = (), prefill_depth: int | None = None,
                  depth: int | None = None, serving: bool = False) -> Scheduler:
        """A ``Scheduler`` over this engine's ring with the engine's limits (``prefill_depth`` and ``depth``
        override the engine's for one run) and a fresh job id. ``serving``: requests that stream to clients
        (``AsyncEngine``), whose decodes a long prompt must not hold up (``prefill_stall_ratio``); a batch
        (``generate_batch``) is judged by its wall time and prefills at full speed."""
        cfg = self.config
        self._job += 1
        return Scheduler(self._link, list(streams), cfg.max_rows, cfg.prefill_chunk,
                         cfg.prefill_depth if prefill_depth is None else prefill_depth,
                         self.depth if depth is None else depth, cfg.step_tokens, self._job, kv=self.kv,
                         prefix_cache=cfg.prefix_cache, ended=self._group.ended,
                         prefill_stall_ratio=cfg.prefill_stall_ratio if serving else None,
                         rows_per_op=self.rows_per_op if depth is None else None)

    def stream(self, prompt: str | list[int], max_new_tokens: int = 128, **params) -> Iterator[TokenEvent]:
        """Generate, yielding a ``TokenEvent`` (token id and text delta) per committed token.

        Arguments as ``generate``; bad input raises here, at the call, before anything is sent. Closing the
        generator early drains what is in flight, so the engine is ready for the next request.
        """
        self._check_usable()
        p = GenerationParams(max_new_tokens=max_new_tokens, **params)
        return self._run_solo(self._make_stream(0, -1, prompt, p), self._prefill_depth(p), self._decode_depth(p))

    def _check_usable(self) -> None:
        """Raise when this engine cannot take a request from its caller now (closed, or owned)."""
        if self._owner is not None:
            raise EngineOwned(f"this engine is owned by an {self._owner}, whose dispatcher thread drives its ring: "
                              f"use the {self._owner}'s stream() / complete(), or close the {self._owner} first")
        if self._closed:
            raise RuntimeError("engine is closed")

    def _run_solo(self, s: Stream, prefill_depth: int, depth: int | None) -> Iterator[TokenEvent]:
        """The events of one stream; its own failure (an event with ``error``) raises ``RequestFailed``."""
        self._check_usable()
        run = self.scheduler([s], prefill_depth, depth)
        try:
            for ev in run:
                if ev.error is not None:
                    raise copy_error(ev.error)
                yield ev
        finally:
            self._link.drain()
            run.release_all()

    def generate(self, prompt: str | list[int], max_new_tokens: int = 128, *,
                 on_token: Callable[[TokenEvent], None] | None = None, **params) -> GenerationResult:
        """Generate a continuation of ``prompt`` over the stage ring.

        Args:
            prompt: a string (tokenised; ``chat=True`` applies the chat template) or a list of token ids
                (taken as is, no special tokens added).
            max_new_tokens: most tokens to generate (>= 1).
            on_token: called with each ``TokenEvent`` as it is committed (streaming).
            **params: the other fields of ``ringshm.generation_params.GenerationParams``: temperature, top_k, top_p,
                seed, stop, chat, prefill_depth, spec ("ngram"), spec_k, spec_depth, spec_ngram, and the logit
                controls logit_bias, presence_penalty, frequency_penalty, repetition_penalty, min_tokens,
                ignore_eos, and logprobs / prompt_logprobs (top-k counts; the result's ``logprobs`` and
                ``prompt_logprobs``).

        Raises:
            ValueError: empty prompt, bytes, ids outside the vocabulary, prompt + max_new_tokens > max_seq_len,
                bad parameters (NaN temperature, ...) — all before anything is sent. TypeError: an unknown
                parameter. EngineOwned: an ``AsyncEngine`` owns this engine.
            StageDied: a stage process died (named, within ~0.1 s of its death).
            StageError / KVCacheOverflow: a stage failed an op; the engine stays usable.
            RequestFailed: the request's own sampling or text work failed (e.g. the model's logits hold NaN);
                the engine stays usable.
        """
        self._check_usable()
        p = GenerationParams(max_new_tokens=max_new_tokens, **params)
        s = self._make_stream(0, -1, prompt, p)
        busy0 = self.stage_busy_s()
        busy_first = work_first = None
        for ev in self._run_solo(s, self._prefill_depth(p), self._decode_depth(p)):
            if busy_first is None:
                busy_first, work_first = self.stage_busy_s(), self._link.work_s
            if on_token is not None:
                on_token(ev)
        return result_of(s, busy0, busy_first, self.stage_busy_s(), self.config.stages,
                         self._link.work_s - (work_first or 0.0))

    def stage_busy_s(self) -> list[float]:
        """Wall seconds each of this host's stages has spent applying ops since startup (its clock runs from an
        op's arrival to its reply, so a stage descheduled mid-op still counts as busy); over a window,
        ``busy / window`` is the stage's utilisation."""
        return self._group.busy()

    def stage_ops(self) -> list[int]:
        """Ops each stage has applied since startup."""
        return self._group.ops()

    # ------------------------------------------------------------------------------------- many streams
    def stream_batch(self, prompts: list, max_new_tokens: int = 128, *, depth: int | None = None,
                     **params) -> "BatchStream":
        """Serve many prompts at once; iterate the returned ``BatchStream`` for ``TokenEvent``s (``.stream``
        is the prompt's index) as tokens are committed. Arguments as ``generate_batch``; bad input raises
        here, before anything is sent."""
        self._check_usable()
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError("prompts must be a non-empty list of strings or token-id lists")
        if depth is not None and (not isinstance(depth, int) or isinstance(depth, bool) or depth < 1):
            raise ValueError(f"depth must be an int >= 1 or None, got {depth!r}")
        p = GenerationParams(max_new_tokens=max_new_tokens, **params)
        streams = [self._make_stream(i, -1, prompt, p) for i, prompt in enumerate(prompts)]
        return BatchStream(self, streams, self._prefill_depth(p),
                           self._decode_depth(p) if depth is None else depth)

    def generate_batch(self, prompts: list, max_new_tokens: int = 128, *, depth: int | None = None,
                       on_token: Callable[[TokenEvent], None] | None = None, **params) -> BatchResult:
        """Generate for every prompt over the same stages; one result per prompt, in input order.

        Every step op carries every stream that is ready (``ringshm.engine.scheduler``); prompts beyond ``max_rows``
        wait for a free row. Each stream gets exactly the tokens ``generate`` gives it alone.

        Args:
            prompts: strings or token-id lists (as ``generate``).
            depth: decode ops in flight for this run (default: the engine's ``depth``, raised to ``spec_depth``
                when speculating).
            **params: as ``generate`` (stream i samples with ``seed + i``).

        Raises:
            ValueError: bad input (any prompt), before anything is sent. StageDied, StageError: as generate.
            A stream that fails on its own (its sampling or text work raised) does not raise: its result has
            finish_reason "error" and ``error``, and the other streams run to their end.
        """
        run = self.stream_batch(prompts, max_new_tokens, depth=depth, **params)
        for ev in run:
            if on_token is not None:
                on_token(ev)
        return run.result()


def new_stream(index: int, row: int, ids: list[int], p: GenerationParams, tokenizer, eos_ids: frozenset[int],
               vocab: int | None = None) -> Stream:
    """The ``Stream`` of one request of ``ids`` (token ids) under ``p``: its sampler (seed ``p.seed + index``),
    text stream, EOS rule and, with ``p.spec``, its speculative decoder.

    Raises:
        InvalidParameter (a ValueError): a ``logit_bias`` id outside ``[0, vocab)``.
    """
    try:
        check_logit_bias(p.logit_bias, vocab)
    except ValueError as exc:
        raise InvalidParameter(str(exc), "logit_bias") from None
    seed = None if p.seed is None else p.seed + index
    sampler = Sampler(p.temperature, p.top_k, p.top_p, seed, logit_bias=p.logit_bias,
                      presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
                      repetition_penalty=p.repetition_penalty, min_tokens=p.min_tokens, eos_ids=eos_ids)
    s = Stream(index, row, ids, p.max_new_tokens, sampler, TextStream(tokenizer, p.stop, p.min_tokens), eos_ids,
               ignore_eos=p.ignore_eos, logprobs=p.logprobs, prompt_logprobs=p.prompt_logprobs,
               prompt_token_logprobs=[None] if p.prompt_logprobs is not None else [])
    if p.spec == "ngram":
        s.spec = SpecDecoder(s, NGramDrafter(p.spec_k, p.spec_ngram), p.spec_depth)
    return s


class BatchStream:
    """An iterable run of many streams (``Engine.stream_batch``): yields ``TokenEvent``s; ``cancel(i)`` ends
    stream ``i`` and leaves the others running; ``result()`` after the run gives the ``BatchResult``.
    Abandoning the iteration early drains what is in flight."""

    def __init__(self, engine: Engine, streams: list[Stream], prefill_depth: int, depth: int | None):
        self.engine, self.streams = engine, streams
        self.prefill_depth, self.depth = prefill_depth, depth
        self._run: Scheduler | None = None
        self._t0 = self._t1 = 0.0
        self._busy0: list[float] = []
        self._busy1: list[float] = []

    def __iter__(self) -> Iterator[TokenEvent]:
        eng = self.engine
        eng._check_usable()
        self._t0, self._busy0 = time.perf_counter(), eng.stage_busy_s()
        try:
            self._run = eng.scheduler(self.streams, self.prefill_depth, self.depth)
            yield from self._run
        finally:
            eng._link.drain()
            if self._run is not None:
                self._run.release_all()
            self._t1, self._busy1 = time.perf_counter(), eng.stage_busy_s()

    def cancel(self, index: int) -> None:
        """End stream ``index`` (finish_reason "cancelled"); the others go on. Unknown or finished streams
        are ignored."""
        if self._run is not None:
            self._run.cancel(index)
        elif 0 <= index < len(self.streams):
            self.streams[index].cancel()

    def result(self) -> BatchResult:
        """Per-stream results (input order), wall time, aggregate output tok/s and step counters of the run."""
        results = [result_of(s) for s in self.streams]
        wall = max(self._t1 - self._t0, 1e-9)
        spec = SpecStats()
        for s in self.streams:
            if s.spec is not None:
                spec.add(s.spec.stats)
        return BatchResult(results, wall, sum(r.n_output_tokens for r in results) / wall,
                           [b - b0 for b, b0 in zip(self._busy1, self._busy0)], spec,
                           self._run.stats if self._run is not None else StepStats())
