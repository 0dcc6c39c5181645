"""What a request returns: ``GenerationResult`` for one stream, ``BatchResult`` for many, and how a finished
``Stream`` becomes one."""

from __future__ import annotations

from dataclasses import dataclass, field

from ringshm.engine.coordinator import Stream
from ringshm.engine.scheduler import StepStats
from ringshm.engine.spec import SpecStats


@dataclass
class GenerationResult:
    """One request's output and timings.

    ``token_ids``: generated tokens only (the prompt excluded); ``text``: their text, cut before a stop
    string; ``finish_reason``: "stop" (EOS or a stop string) or "length" (max_new_tokens); in a batch also
    "cancelled", or "error" when the stream failed on its own (``error`` says why; its batch-mates go on).
    ``ttft_s``: time to first token, from the call to the first token committed (prefill included).
    ``tpot_s``: mean time per output token after the first; ``decode_tok_s`` = 1 / tpot_s.
    ``stage_busy_s``: seconds each stage spent applying this request's ops.
    ``coordinator_us_per_op``: the coordinator's own work per decode op (taking the reply, sampling,
    detokenising, building and encoding the next op). ``hop_overhead_us``: what is left of the decode wall
    time after the stages' busy time and the coordinator's work, per hop (decode ops x (stages + 1) hops):
    the ring's transfer and wake-up cost. A single stream's decode visits the stages one after another, so
    the three add up to the wall time.
    ``logprobs``: one ``ringshm.engine.logprobs.TokenLogprob`` per generated token, and ``prompt_logprobs``: None for
    the first prompt token then one per prompt token, when the request asked for them (else None).
    ``n_cached_tokens``: prompt tokens whose KV came from the prefix cache (their prefill was skipped; a whole
    number of KV blocks; OpenAI's ``usage.prompt_tokens_details.cached_tokens``). ``n_preemptions``: times the
    stream gave its KV blocks back for want of them and was computed again (the same bytes either way).
    """

    token_ids: list[int]
    text: str
    finish_reason: str
    ttft_s: float
    tpot_s: float
    decode_tok_s: float
    n_prompt_tokens: int
    n_output_tokens: int
    stage_busy_s: list[float] = field(default_factory=list)
    hop_overhead_us: float = 0.0
    coordinator_us_per_op: float = 0.0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    acceptance_rate: float = 0.0
    mean_accepted_length: float = 0.0
    logprobs: list | None = None
    prompt_logprobs: list | None = None
    n_cached_tokens: int = 0
    n_preemptions: int = 0
    error: str | None = None

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class BatchResult:
    """Results of ``Engine.generate_batch``: one ``GenerationResult`` per prompt, in input order.

    ``wall_s``: from the call to the last token; ``output_tok_s``: every stream's output tokens over wall_s
    (the aggregate throughput); ``stage_busy_s``: each stage's busy seconds over the whole batch (per-stream
    results leave theirs empty: a step op serves several streams at once); ``spec``: the speculation
    counters summed over the streams; ``steps``: the scheduler's op counters (ops, segments, tokens, ops
    with more than one segment, preemptions).
    """

    results: list[GenerationResult]
    wall_s: float
    output_tok_s: float
    stage_busy_s: list[float] = field(default_factory=list)
    spec: SpecStats = field(default_factory=SpecStats)  # summed over the streams that speculated
    steps: StepStats = field(default_factory=StepStats)

    def __len__(self) -> int:
        return len(self.results)

    def __getitem__(self, i: int) -> GenerationResult:
        return self.results[i]


def result_of(s: Stream, busy0: list[float] | None = None, busy_first: list[float] | None = None,
              busy_end: list[float] | None = None, n_stages: int = 0,
              decode_work_s: float = 0.0) -> GenerationResult:
    """The ``GenerationResult`` of a finished stream. With the stages' busy seconds at the start, at the first
    token and at the end, and the coordinator's work during decode (solo runs), it also fills
    ``stage_busy_s``, ``coordinator_us_per_op`` and ``hop_overhead_us``."""
    times = s.token_times
    n = len(s.tokens)
    ttft = times[0] - s.t_start if times else 0.0
    tpot = (times[-1] - times[0]) / (n - 1) if n > 1 else 0.0
    busy, hop_us, coord_us = [], 0.0, 0.0
    spec = s.spec.stats if s.spec is not None else SpecStats()
    if busy0 is not None and busy_end is not None:
        busy = [b - b0 for b, b0 in zip(busy_end, busy0)]
        decode_ops = spec.verify_steps if s.spec is not None else n - 1
        if decode_ops > 0 and busy_first is not None:
            decode_busy = sum(busy_end) - sum(busy_first)
            coord_us = decode_work_s / decode_ops * 1e6
            hop_us = ((times[-1] - times[0]) - decode_busy - decode_work_s) / (decode_ops * (n_stages + 1)) * 1e6
    return GenerationResult(
        token_ids=list(s.tokens), text=s.text.text, finish_reason=s.finish_reason or "length", ttft_s=ttft,
        tpot_s=tpot, decode_tok_s=1.0 / tpot if tpot > 0 else 0.0, n_prompt_tokens=len(s.prompt),
        n_output_tokens=n, stage_busy_s=busy, hop_overhead_us=hop_us, coordinator_us_per_op=coord_us,
        draft_tokens=spec.draft_tokens,
        accepted_tokens=spec.accepted_tokens, acceptance_rate=spec.acceptance_rate,
        mean_accepted_length=spec.mean_accepted_length,
        logprobs=list(s.token_logprobs) if s.logprobs is not None else None,
        prompt_logprobs=list(s.prompt_token_logprobs) if s.prompt_logprobs is not None else None,
        n_cached_tokens=s.cached_tokens, n_preemptions=s.n_preemptions,
        error=None if s.error is None else f"{type(s.error).__name__}: {s.error}")
