"""The coordinator's side of the ring: sending ops with sequence numbers, checking every reply against the op
it must answer, the pipelined prefill shared by every mode, and the solo decode loop.

Replies come back in send order because every stage applies ops in arrival order (DESIGN.md). The
coordinator does not trust that blindly: each reply must carry the (seq, row, op) of the oldest op in
flight, or ``ReplyMismatch`` is raised (the seed project matched prefill replies by FIFO order alone).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from ringshm import errors, messages as m
from ringshm.errors import KVCacheOverflow, ReplyMismatch, RingTimeout, StageError
from ringshm.ring import Ring
from ringshm.sampling import Sampler, TextStream

POLL_S = 0.1  # a wait on the ring re-checks every stage process at least this often


@dataclass
class _Pending:
    seq: int
    op: int
    row: int
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

    @property
    def in_flight(self) -> int:
        return len(self.pending)

    @property
    def n_sent(self) -> int:
        """Ops sent into stage 0 since the link was made (stage 0's applied-op counter trails it)."""
        return self._seq

    def send(self, msg: m.Message, tag: object = None) -> None:
        """Number ``msg`` with the next sequence number, write it into the first ring and remember it.

        Raises:
            StageDied: a stage died while the ring was full. RingTimeout: full for op_timeout_s.
        """
        if self._t_reply is not None:  # the coordinator's own work since the last reply (sampling, text, ...)
            self.work_s += time.perf_counter() - self._t_reply
            self._t_reply = None
        msg.seq = self._seq
        self._seq += 1
        n = m.encoded_size(msg)
        view = self._wait(lambda t: self.to_first.reserve(n, timeout_s=t), "room in stage 0's input ring")
        m.encode_into(view, msg)
        self.to_first.commit(n)
        self.pending.append(_Pending(msg.seq, msg.op, msg.row, tag))

    def recv(self, timeout_s: float | None = None) -> tuple[m.Message, object]:
        """The reply to the oldest op in flight (tensors copied out of the ring) and that op's tag.

        ``timeout_s`` (default ``op_timeout_s``) bounds the wait.

        Raises:
            ReplyMismatch: the reply answers another op. StageError (KVCacheOverflow for KV range errors):
            a stage failed the op. StageDied, RingTimeout: as ``send``.
        """
        if not self.pending:
            raise errors.RingStateError("recv with no op in flight")
        view = self._wait(lambda t: self.from_last.peek(timeout_s=t), "a reply", timeout_s)
        try:
            reply = m.decode(view)
            reply.tensors = [t.clone() for t in reply.tensors]
        finally:
            del view
            self.from_last.release()
        m.hold_until_delivered(reply, self.link_latency_ms)
        want = self.pending.popleft()
        if reply.seq != want.seq or reply.row != want.row or not reply.is_reply:
            raise ReplyMismatch(f"expected the reply to seq {want.seq} ({m.OP_NAMES.get(want.op)}, row "
                                f"{want.row}), got seq {reply.seq} ({m.OP_NAMES.get(reply.op)}, row {reply.row})")
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

        Stops quietly when a stage is gone (nothing more will come)."""
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


def _remote_error(reply: m.Message) -> StageError:
    text = reply.error_text()
    remote_type = text.split(":", 1)[0]
    message = f"stage {reply.aux}: {text}"
    if remote_type == "KVRangeError":
        return KVCacheOverflow(message, reply.aux, remote_type)
    return StageError(message, reply.aux, remote_type)


@dataclass
class Stream:
    """One request as the coordinator drives it: its KV row, prompt, sampler, stop rules and timings.

    ``finish_reason``: None while running, then "stop" (EOS or a stop string), "length" (max_new_tokens) or
    "cancelled".
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
    spec: object = None  # a SpecDecoder when the stream decodes speculatively (ringshm.spec_decode)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def position(self) -> int:
        """Position of the next token to feed (the last committed one)."""
        return len(self.prompt) + len(self.tokens) - 1

    def cancel(self) -> None:
        """End the stream now (the caller stops sending its ops)."""
        if self.finish_reason is None:
            self.finish_reason = "cancelled"

    def commit(self, token: int) -> str:
        """Append one generated token; set ``finish_reason`` on EOS, a stop string or the length limit.
        Returns the text delta to show."""
        self.tokens.append(token)
        self.token_times.append(time.perf_counter())
        delta = self.text.push(token)
        if token in self.eos_ids or self.text.stopped:
            self.finish_reason = "stop"
        elif len(self.tokens) >= self.max_new_tokens:
            self.finish_reason = "length"
        if self.done:
            delta += self.text.finish()
        return delta


@dataclass
class TokenEvent:
    """One committed token of one stream: its id and the text it adds (may be empty while held back)."""

    stream: int
    token_id: int
    text: str


def _next_token(stream: Stream, reply: m.Message, i: int) -> int:
    """The token for entry ``i`` of a reply: ids ``[n]`` (one row; the last position counts) or ``[B, 1]``,
    logits ``[vocab]`` or ``[B, vocab]``."""
    ids, logits = reply.tensors[0], reply.tensors[1] if len(reply.tensors) > 1 else None
    if ids.dim() == 2:
        return stream.sampler(int(ids[i, -1]), None if logits is None else logits[i])
    return stream.sampler(int(ids[-1]), logits)


def _flags(stream: Stream) -> int:
    return 0 if stream.sampler.greedy else m.WANT_LOGITS


@dataclass(frozen=True)
class PrefillTag:
    """Tag of a prefill op in flight: its stream, and whether it carries the prompt's last chunk."""

    stream: Stream
    last: bool

    def has(self, s: Stream) -> bool:
        return self.stream is s


@dataclass(frozen=True)
class DecodeTag:
    """Tag of a decode op in flight: the streams of its rows, in row-table order."""

    streams: tuple[Stream, ...]

    def has(self, s: Stream) -> bool:
        return s in self.streams


class PrefillPipeline:
    """Pipelined chunked prefill, the one helper solo, batch and rows modes share.

    Every (stream, chunk) pair is queued in order; up to ``depth`` prefill ops are kept in flight; replies are
    taken in FIFO order, and on each one the next op is sent before any other work, so the stages never idle
    on the coordinator. A stream is finalised when its last chunk's reply lands: its first token (and TTFT),
    ending it right there on EOS, a stop string or ``max_new_tokens == 1``. Token-identical to ``depth == 1``
    because stages apply ops in arrival order.
    """

    def __init__(self, link: Link, chunk: int, depth: int, job: int = 0):
        self.link, self.chunk, self.depth, self.job = link, chunk, depth, job
        self.queue: deque[tuple[Stream, int]] = deque()
        self.in_flight = 0

    @property
    def idle(self) -> bool:
        return not self.queue and self.in_flight == 0

    def add(self, stream: Stream) -> None:
        """Queue every chunk of ``stream``'s prompt and fill the window."""
        self.queue.extend((stream, start) for start in range(0, len(stream.prompt), self.chunk))
        self.fill()

    def drop(self, stream: Stream) -> None:
        """Forget the chunks of ``stream`` not yet sent (a cancelled request)."""
        self.queue = deque(p for p in self.queue if p[0] is not stream)

    def fill(self) -> None:
        while self.queue and self.in_flight < self.depth:
            s, start = self.queue.popleft()
            toks = s.prompt[start : start + self.chunk]
            last = start + len(toks) >= len(s.prompt)
            self.link.send(m.Message(m.PREFILL, job=self.job, row=s.row, start=start, n_tokens=len(toks),
                                     flags=_flags(s) if last else 0, rows=[(s.row, start)],
                                     tensors=[torch.tensor(toks, dtype=torch.int64)]), tag=PrefillTag(s, last))
            self.in_flight += 1

    def on_reply(self, reply: m.Message, tag: PrefillTag) -> TokenEvent | None:
        """Handle the reply to one of our ops: send the next op first, then finalise the stream if this was
        its last chunk (returns its first token) — unless the stream was cancelled meanwhile."""
        self.in_flight -= 1
        self.fill()
        s = tag.stream
        if not tag.last or s.done:
            return None
        token = _next_token(s, reply, 0)
        return TokenEvent(s.index, token, s.commit(token))


def prefill(link: Link, streams: list[Stream], chunk: int, depth: int, job: int = 0) -> Iterator[TokenEvent]:
    """Run a ``PrefillPipeline`` over ``streams`` alone; yields each stream's first token as it lands."""
    pipe = PrefillPipeline(link, chunk, depth, job)
    for s in streams:
        pipe.add(s)
    while not pipe.idle:
        reply, tag = link.recv()
        ev = pipe.on_reply(reply, tag)
        if ev is not None:
            yield ev


def decode_op(streams: list[Stream], job: int = 0) -> m.Message:
    """One DECODE op for ``streams`` in lockstep: solo shape (ids ``[1]``) for one stream, else ids ``[B, 1]``
    with each row at its own position."""
    rows = [(s.row, s.position) for s in streams]
    flags = m.WANT_LOGITS if any(not s.sampler.greedy for s in streams) else 0
    ids = torch.tensor([s.tokens[-1] for s in streams], dtype=torch.int64)
    return m.Message(m.DECODE, job=job, row=rows[0][0], start=rows[0][1], n_tokens=1, flags=flags, rows=rows,
                     tensors=[ids if len(streams) == 1 else ids.view(-1, 1)])


def commit_decode(reply: m.Message, tag: DecodeTag) -> list[TokenEvent]:
    """Sample and commit one token per stream of a decode reply (cancelled streams are skipped)."""
    events = []
    for i, s in enumerate(tag.streams):
        if not s.done:
            token = _next_token(s, reply, i)
            events.append(TokenEvent(s.index, token, s.commit(token)))
    return events


def decode_solo(link: Link, stream: Stream, job: int = 0) -> Iterator[TokenEvent]:
    """Decode one stream after its prefill: one single-row DECODE op per token until it finishes."""
    while not stream.done:
        link.send(decode_op([stream], job), tag=DecodeTag((stream,)))
        reply, tag = link.recv()
        yield from commit_decode(reply, tag)
