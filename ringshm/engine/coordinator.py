"""The coordinator's side of the ring: sending ops with sequence numbers, checking every reply against the op
it must answer, and the per-request state (``Stream``) the scheduler (``ringshm.engine.scheduler``) drives.

Replies come back in send order because every stage applies ops in arrival order (DESIGN.md). The
coordinator does not trust that blindly: each reply must carry the seq, op and segment table of the oldest op
in flight, or ``ReplyMismatch`` is raised (the seed project matched prefill replies by FIFO order alone).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ringshm import errors
from ringshm.engine.sampling import Sampler, TextStream
from ringshm.errors import KVCacheOverflow, ReplyMismatch, RingTimeout, StageError
from ringshm.transport import messages as m
from ringshm.transport.ring import Ring

POLL_S = 0.1  # a wait on the ring re-checks every stage process at least this often


@dataclass
class _Pending:
    seq: int
    op: int
    segments: list[m.Segment]
    tag: object


class Link:
    """Ops into stage 0, replies from the last stage, and the in-flight bookkeeping between them.

    ``check_stages()`` raises ``StageDied`` when a stage process is gone; it runs between waits of at most
    ``POLL_S``, so a dead stage is reported within about that long. ``op_timeout_s`` bounds one wait.
    """

    def __init__(self, to_first: Ring, from_last: Ring, check_stages: Callable[[], None], op_timeout_s: float,
                 link_latency_ms: float = 0.0):
        self.to_first, self.from_last = to_first, from_last
        self.check_stages = check_stages
        self.op_timeout_s = op_timeout_s
        self.link_latency_ms = link_latency_ms
        self.pending: deque[_Pending] = deque()
        self._seq = 0
        self.work_s = 0.0  # coordinator time between taking a reply and sending the next op (see send)
        self._t_reply: float | None = None
        self.busy_since = 0.0  # time.monotonic() of the last send that found nothing in flight (see send)
        self.owed: m.Message | None = None  # a sent STEP op with WANT_ALLOWED whose MASKS record is not out yet
        self._masks_out: m.Message | None = None  # a MASKS record that found stage 0's ring full (sent first next)

    @property
    def in_flight(self) -> int:
        return len(self.pending)

    @property
    def n_sent(self) -> int:
        """Ops sent into stage 0 since the link was made (stage 0's applied-op counter trails it)."""
        return self._seq

    def send(self, msg: m.Message, tag: object = None) -> None:
        """Number ``msg`` with the next sequence number, write it into the first ring and remember it. A STEP op
        with a ``WANT_ALLOWED`` segment owes its MASKS record (``send_masks``) before anything else is sent.

        Raises:
            StageDied: a stage died while the ring was full. RingTimeout: full for op_timeout_s (a MASKS record
                still waiting to go out is tried first, and raises the same).
            RingStateError: the MASKS record of the op sent before is owed.
        """
        self._flush_masks()
        if self.owed is not None:
            raise errors.RingStateError(f"op {self.owed.seq}'s MASKS record must be sent before the next op")
        if self._t_reply is not None:  # the coordinator's own work since the last reply (sampling, text, ...)
            self.work_s += time.perf_counter() - self._t_reply
            self._t_reply = None
        if not self.pending:  # work arrives after idle: the stall clocks of ringshm.engine.async_engine start here
            self.busy_since = time.monotonic()
        msg.seq = self._seq
        self._seq += 1
        n = m.encoded_size(msg)
        view = self._wait(lambda t: self.to_first.reserve(n, timeout_s=t), "room in stage 0's input ring")
        m.encode_into(view, msg)
        self.to_first.commit(n)
        self.pending.append(_Pending(msg.seq, msg.op, msg.segments, tag))
        if msg.op == m.STEP and m.needs_masks(msg.segments):
            self.owed = msg

    def send_masks(self, allowed) -> None:
        """Send the MASKS record the op sent last owes (``messages.masks_record``: ``allowed`` int32
        ``[Σ n_allowed_rows, ceil(vocab / 32)]``), right behind it. Once made, the record goes out even if this
        call raises: a full ring keeps it, and the next ``send`` / ``recv`` sends it first.

        Raises:
            RingStateError: no op owes a MASKS record. ValueError: ``allowed`` of the wrong shape or dtype.
            StageDied, RingTimeout: as ``send``.
        """
        if self.owed is None:
            raise errors.RingStateError("no op sent owes a MASKS record")
        self._masks_out, self.owed = m.masks_record(self.owed, allowed), None
        self._flush_masks()

    def _flush_masks(self, timeout_s: float | None = None) -> None:
        if self._masks_out is None:
            return
        n = m.encoded_size(self._masks_out)
        view = self._wait(lambda t: self.to_first.reserve(n, timeout_s=t), "room in stage 0's input ring", timeout_s)
        m.encode_into(view, self._masks_out)
        self.to_first.commit(n)
        self._masks_out = None

    def recv(self, timeout_s: float | None = None) -> tuple[m.Message, object]:
        """The reply to the oldest op in flight (tensors copied out of the ring) and that op's tag.

        ``timeout_s`` (default ``op_timeout_s``) bounds the wait.

        Raises:
            ReplyMismatch: the reply answers another op (seq, op or segment table differ, but for segments a
                stage skipped: ``messages.same_table``).
            StageError (KVCacheOverflow for KV range errors): a stage failed the op.
            StageDied, RingTimeout: as ``send``.
        """
        if not self.pending:
            raise errors.RingStateError("recv with no op in flight")
        if self.owed is not None:  # the last stage waits for it: no reply could come
            raise errors.RingStateError(f"op {self.owed.seq}'s MASKS record must be sent before a reply can come")
        self._flush_masks(timeout_s)
        view = self._wait(lambda t: self.from_last.peek(timeout_s=t), "a reply", timeout_s)
        try:
            reply = m.decode(view)
            reply.tensors = [t.clone() for t in reply.tensors]
        finally:
            del view
            self.from_last.release()
        m.hold_until_delivered(reply, self.link_latency_ms)
        want = self.pending.popleft()
        if reply.seq != want.seq or not m.same_table(want.segments, reply.segments) or not reply.is_reply:
            raise ReplyMismatch(f"expected the reply to seq {want.seq} ({m.OP_NAMES.get(want.op)}, segments "
                                f"{_rows(want.segments)}), got seq {reply.seq} ({m.OP_NAMES.get(reply.op)}, "
                                f"segments {_rows(reply.segments)})")
        if reply.op == m.ERROR:
            exc = _remote_error(reply)
            exc.tag = want.tag  # which request the failed op belonged to
            raise exc
        if reply.op != want.op:
            raise ReplyMismatch(f"seq {want.seq}: sent {m.OP_NAMES.get(want.op)}, reply is "
                                f"{m.OP_NAMES.get(reply.op)}")
        self._t_reply = time.perf_counter()
        return reply, want.tag

    def drain(self) -> None:
        """Receive and drop every reply still in flight (after an error), so the next request starts clean.

        Stops quietly when a stage is gone (nothing more will come). An op whose MASKS record was never made (its
        masks' computation broke off) gets one of zero-width rows, which its last stage refuses: that op's ERROR
        reply is dropped like the rest, and the link sends again."""
        if self.owed is not None:
            rows = sum(seg.n_allowed_rows() for seg in self.owed.segments)
            try:
                self.send_masks(torch.zeros(rows, 0, dtype=torch.int32))
            except (errors.PeerDied, RingTimeout):
                self.pending.clear()
                return
        while self.pending:
            try:
                self.recv()
            except (StageError, ReplyMismatch):
                continue
            except (errors.PeerDied, RingTimeout):
                self.pending.clear()
                return

    def _wait(self, call, what: str, timeout_s: float | None = None):
        timeout_s = self.op_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return call(min(POLL_S, max(0.0, deadline - time.monotonic())))
            except RingTimeout:
                self.check_stages()
                if time.monotonic() >= deadline:
                    raise RingTimeout(f"no {what} within {timeout_s} s") from None
            except errors.PeerDied:
                # The ring's peer closed it on its way out; give the process a moment to be reaped so the
                # error can name the stage (StageDied) rather than only the ring.
                until = time.monotonic() + 1.0
                while time.monotonic() < until:
                    self.check_stages()
                    time.sleep(0.01)
                raise


def _rows(segments: list[m.Segment]) -> str:
    """A segment table as ``row@start+n`` items, for error messages."""
    return "[" + ", ".join(f"{g.row}@{g.start}+{g.n_tokens}" for g in segments[:8]) + (
        ", ..." if len(segments) > 8 else "") + "]"


def _remote_error(reply: m.Message) -> StageError:
    text = reply.error_text()
    remote_type = text.split(":", 1)[0]
    message = f"stage {reply.aux}: {text}"
    if remote_type == "KVRangeError":
        return KVCacheOverflow(message, reply.aux, remote_type)
    return StageError(message, reply.aux, remote_type)


@dataclass(eq=False)
class Stream:
    """One request as the coordinator drives it: its row, prompt, sampler, stop rules and timings.

    ``row``: its slot while admitted (-1 while it waits); its KV lives in the blocks the scheduler's
    ``KVBlocks`` table names. ``n_prefilled``: tokens of ``prefill_ids`` already sent in prefill chunks (a
    prefix-cache hit starts it past 0), ``n_prefill_done`` those answered. ``n_in_flight``: step ops in flight
    that carry a segment of it (its slot and blocks are freed only at 0). A preempted stream comes back with
    ``resume_ids`` = its prompt and the tokens generated so far, prefilled again (exactly: recompute gives the
    same bits), the last of them asking for the next token. ``cached_tokens``: prompt tokens whose KV came from
    the prefix cache at its first admission; ``n_to_prefill``: tokens of ``prefill_ids`` its current admission
    computes (past the cache hit); ``cache_salt``: the tenant key of its prefix-cache chain.
    ``finish_reason``: None while running, then "stop" (EOS or a stop string), "length"
    (max_new_tokens), "cancelled", or "error" (its own sampling, detokenisation or stop handling raised:
    ``error`` holds the exception; no other stream is touched). ``ignore_eos``: EOS does not end it.
    ``logprobs`` / ``prompt_logprobs``: None, or the top-k count of each generated token's / prompt token's
    logprobs (``GenerationParams``), which collect in ``token_logprobs`` (one ``TokenLogprob`` per token) and
    ``prompt_token_logprobs`` (None for the first prompt token, then one per prompt token, filled as the prefill
    chunks are answered). ``skip_marked``: it ended with ops in flight and the stages were told to skip the rest
    of it (``ringshm.engine.scheduler``). ``grammar``: None, or the ``GrammarState`` of its structured output
    (``ringshm.engine.grammar``): each committed token moves it on, and the stream ends ("stop") once the grammar
    is complete.
    """

    index: int
    row: int
    prompt: list[int]
    max_new_tokens: int
    sampler: Sampler
    text: TextStream
    eos_ids: frozenset[int]
    t_start: float = field(default_factory=time.perf_counter)
    tokens: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    spec: object = None  # a SpecDecoder when the stream decodes speculatively (ringshm.engine.spec_decode)
    n_prefilled: int = 0
    n_in_flight: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    token_logprobs: list = field(default_factory=list)
    prompt_token_logprobs: list = field(default_factory=list)
    n_prefill_done: int = 0
    resume_ids: list[int] | None = None
    cached_tokens: int = 0
    n_to_prefill: int = 0
    cache_salt: str | None = None
    n_preemptions: int = 0
    error: BaseException | None = None
    skip_marked: bool = False
    grammar: object = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def prefill_ids(self) -> list[int]:
        """What its prefill feeds: the prompt, or after a preemption the prompt and the tokens generated then."""
        return self.prompt if self.resume_ids is None else self.resume_ids

    @property
    def position(self) -> int:
        """Position of the next token to feed (the last committed one)."""
        return len(self.prompt) + len(self.tokens) - 1

    @property
    def decoding(self) -> bool:
        """Past its prefill: every prefill chunk answered and a token committed since."""
        return bool(self.tokens) and not self.done and self.n_prefill_done >= len(self.prefill_ids)

    def cancel(self) -> None:
        """End the stream now (the scheduler stops sending its segments)."""
        if self.finish_reason is None:
            self.finish_reason = "cancelled"

    def fail(self, exc: BaseException) -> None:
        """End the stream with ``exc`` (finish_reason "error"): the scheduler stops sending its segments."""
        self.finish_reason, self.error = "error", exc

    def commit(self, token: int) -> str:
        """Append one generated token; set ``finish_reason`` on EOS, a stop string, a complete grammar or the
        length limit. Returns the text delta to show.

        Raises:
            RuntimeError: the stream's grammar refuses the token (``GrammarState.accept``); nothing is appended.
            (The grammar's next mask is computed by the scheduler for every stream of the reply at once.)
        """
        if self.grammar is not None:
            self.grammar.accept(token)
        self.tokens.append(token)
        self.token_times.append(time.perf_counter())
        delta = self.text.push(token)
        if (token in self.eos_ids and not self.ignore_eos) or self.text.stopped or (
                self.grammar is not None and self.grammar.stopped):
            self.finish_reason = "stop"
        elif len(self.tokens) >= self.max_new_tokens:
            self.finish_reason = "length"
        if self.done:
            delta += self.text.finish()
        return delta


@dataclass
class TokenEvent:
    """One committed token of one stream: its id, the text it adds (may be empty while held back) and, when
    the stream asked for them, its ``TokenLogprob`` (``ringshm.engine.logprobs``).

    An event with ``error`` set carries no token (``token_id`` -1): the stream failed on its own (its sampling,
    detokenisation or stop handling raised ``error``) and ends there with finish_reason "error"."""

    stream: int
    token_id: int
    text: str
    logprob: object = None
    error: BaseException | None = None
