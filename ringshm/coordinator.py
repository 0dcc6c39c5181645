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

    def __init__(self, to_first: Ring, from_last: Ring, check_stages: Callable[[], None], op_timeout_s: float):
        self.to_first, self.from_last = to_first, from_last
        self.check_stages = check_stages
        self.op_timeout_s = op_timeout_s
        self.pending: deque[_Pending] = deque()
        self._seq = 0

    @property
    def in_flight(self) -> int:
        return len(self.pending)

    def send(self, msg: m.Message, tag: object = None) -> None:
        """Number ``msg`` with the next sequence number, write it into the first ring and remember it.

        Raises:
            StageDied: a stage died while the ring was full. RingTimeout: full for op_timeout_s.
        """
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
        want = self.pending.popleft()
        if reply.seq != want.seq or reply.row != want.row or not reply.is_reply:
            raise ReplyMismatch(f"expected the reply to seq {want.seq} ({m.OP_NAMES.get(want.op)}, row "
                                f"{want.row}), got seq {reply.seq} ({m.OP_NAMES.get(reply.op)}, row {reply.row})")
        if reply.op == m.ERROR:
            raise _remote_error(reply)
        if reply.op != want.op:
            raise ReplyMismatch(f"seq {want.seq}: sent {m.OP_NAMES.get(want.op)}, reply is "
                                f"{m.OP_NAMES.get(reply.op)}")
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
                self.check_stages()
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
    """One request as the coordinator drives it: its KV row, prompt, sampler, stop rules and timings."""

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

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def position(self) -> int:
        """Position of the next token to feed (the last committed one)."""
        return len(self.prompt) + len(self.tokens) - 1

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


def _next_token(stream: Stream, reply: m.Message) -> int:
    ids = reply.tensors[0].reshape(-1)
    logits = reply.tensors[1].reshape(-1) if len(reply.tensors) > 1 else None
    return stream.sampler(int(ids[-1]), logits)


def _flags(stream: Stream) -> int:
    return 0 if stream.sampler.greedy else m.WANT_LOGITS


def prefill(link: Link, streams: list[Stream], chunk: int, depth: int, job: int = 0) -> Iterator[TokenEvent]:
    """Pipelined chunked prefill of every stream; yields each stream's first token as its last chunk lands.

    Every (stream, chunk) pair is listed in order; up to ``depth`` prefill ops are kept in flight; replies
    are drained in FIFO order and the next op is sent before any other work is done on a reply, so the
    stages never idle on the coordinator. A stream whose first token is EOS, a stop or its only token is
    finished right there. Token-identical to ``depth == 1`` because stages apply ops in arrival order.
    """
    pairs = deque((s, start) for s in streams for start in range(0, len(s.prompt), chunk))

    def send_next() -> None:
        s, start = pairs.popleft()
        toks = s.prompt[start : start + chunk]
        last = start + len(toks) >= len(s.prompt)
        link.send(m.Message(m.PREFILL, job=job, row=s.row, start=start, n_tokens=len(toks),
                            flags=_flags(s) if last else 0, rows=[(s.row, start)],
                            tensors=[torch.tensor(toks, dtype=torch.int64)]), tag=(s, last))

    while pairs and link.in_flight < depth:
        send_next()
    while link.in_flight:
        reply, (s, last) = link.recv()
        if pairs:
            send_next()
        if last:
            token = _next_token(s, reply)
            yield TokenEvent(s.index, token, s.commit(token))


def decode_solo(link: Link, stream: Stream, job: int = 0) -> Iterator[TokenEvent]:
    """Decode one stream after its prefill: one single-row DECODE op per token until it finishes."""
    while not stream.done:
        link.send(m.Message(m.DECODE, job=job, row=stream.row, start=stream.position, n_tokens=1,
                            flags=_flags(stream), rows=[(stream.row, stream.position)],
                            tensors=[torch.tensor([stream.tokens[-1]], dtype=torch.int64)]), tag=stream)
        reply, _ = link.recv()
        token = _next_token(stream, reply)
        yield TokenEvent(stream.index, token, stream.commit(token))
