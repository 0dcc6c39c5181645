"""Many streams over one ring: ``batch`` (lockstep) and ``rows`` (de-lockstep) modes, both prefilling through
the one ``PrefillPipeline``.

batch: after every prompt is prefilled, one DECODE op per step carries every live row, each at its own
    position; finished rows leave the batch. Rule for ``decode_depth`` (steps in flight): a row's next input is
    its previous output, so a row can never have two decode ops in flight. Batch mode decodes without
    speculation. The live rows are split into
    ``decode_depth`` groups (round-robin) and each group keeps one lockstep op in flight: micro-batches that
    pipeline through the stages. ``decode_depth = 1`` is plain lockstep.
rows: each stream sends its own solo-shaped ops tagged with its KV row, so streams interleave on the ring and
    advance independently (speculatively too: each stream with its own drafter, epoch and verify chain). A stream's first decode op goes out as soon as its prefill ends (other streams may
    still be prefilling); its next op as soon as its previous reply arrived (one op in flight per stream). A
    finished or cancelled stream frees its row, and a waiting request takes it (continuous batching).

Every stage applies ops in arrival order and every row has its own KV, so rows mode gives each stream
exactly the tokens solo gives it. Batch mode's lockstep matmuls may round differently (tie-aware).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from ringshm.coordinator import (DecodeTag, Link, PrefillPipeline, PrefillTag, Stream, TokenEvent, commit_decode,
                                 decode_op, prefill)
from ringshm.spec_decode import VerifyTag


def run_batch(link: Link, streams: list[Stream], chunk: int, depth: int, decode_depth: int = 1,
              job: int = 0) -> Iterator[TokenEvent]:
    """Lockstep mode; ``streams`` already hold distinct rows. Yields tokens as they are committed."""
    yield from prefill(link, streams, chunk, depth, job)
    live = [s for s in streams if not s.done]
    groups = [live[g::decode_depth] for g in range(decode_depth)]
    for group in groups:
        if group:
            link.send(decode_op(group, job), tag=DecodeTag(tuple(group)))
    while link.in_flight:
        reply, tag = link.recv()
        yield from commit_decode(reply, tag)
        group = [s for s in tag.streams if not s.done]
        if group:  # the same group's next step: each row still has at most one op in flight
            link.send(decode_op(group, job), tag=DecodeTag(tuple(group)))


class RowsRun:
    """Rows mode over a queue of requests: iterate for ``TokenEvent``s; ``cancel(i)`` ends stream ``i``
    without disturbing the others; ``submit(stream)`` adds a request while the run goes on.

    Streams wait for a free KV row (``max_rows`` of them); a stream that finishes or is cancelled frees its
    row once no op of it is in flight, and the oldest waiting stream takes it.
    """

    def __init__(self, link: Link, streams: list[Stream], max_rows: int, chunk: int, depth: int, job: int = 0):
        self.link, self.job = link, job
        self.pipe = PrefillPipeline(link, chunk, depth, job)
        self.waiting: deque[Stream] = deque()
        self.free_rows = list(range(max_rows))
        self.busy: dict[int, Stream] = {}  # row -> stream holding it
        self.streams: dict[int, Stream] = {}
        for s in streams:
            self.submit(s, admit=False)

    def submit(self, stream: Stream, admit: bool = True) -> None:
        """Queue a request; it starts as soon as a row is free."""
        self.streams[stream.index] = stream
        self.waiting.append(stream)
        if admit:
            self._admit()

    def cancel(self, index: int) -> None:
        """End stream ``index`` now: finish_reason "cancelled"; its row is freed once nothing of it is in
        flight. Unknown or finished streams are ignored."""
        s = self.streams.get(index)
        if s is None or s.done:
            return
        s.cancel()
        if s in self.waiting:
            self.waiting.remove(s)
        else:
            self.pipe.drop(s)
            self._maybe_free(s)

    def __iter__(self) -> Iterator[TokenEvent]:
        self._admit()
        while self.link.in_flight:
            yield from self.step()

    def step(self, timeout_s: float | None = None) -> list[TokenEvent]:
        """Take the next reply (waiting at most ``timeout_s``, default the link's op timeout), send what it
        makes possible (the stream's next op, waiting requests into freed rows), then return its tokens.
        For a dispatcher that interleaves ``submit``/``cancel`` with replies (``ringshm.serving``).

        Raises:
            RingTimeout: no reply within timeout_s (nothing is lost: call again). StageDied, StageError,
            ReplyMismatch: as ``Link.recv``.
        """
        self._admit()
        reply, tag = self.link.recv(timeout_s)
        if isinstance(tag, PrefillTag):
            s = tag.stream
            events = [ev] if (ev := self.pipe.on_reply(reply, tag)) is not None else []
            if tag.last:
                self._next(s)
        elif isinstance(tag, VerifyTag):
            s = tag.decoder.stream
            events = tag.decoder.on_reply(reply, tag, self.link)  # sends the stream's next ops
        else:
            (s,) = tag.streams
            events = commit_decode(reply, tag)
            self._next(s)
        if s.done:
            self._maybe_free(s)
        self._admit()  # next ops out before the caller sees the tokens
        return events

    @property
    def idle(self) -> bool:
        """Nothing in flight and nobody waiting."""
        return not self.link.in_flight and not self.waiting

    # ----------------------------------------------------------------------------------------- private
    def _admit(self) -> None:
        while self.waiting and self.free_rows:
            s = self.waiting.popleft()
            s.row = self.free_rows.pop(0)
            self.busy[s.row] = s
            self.pipe.add(s)

    def _next(self, s: Stream) -> None:
        if s.done:
            return
        if s.spec is not None:
            s.spec.fill(self.link)
        else:
            self.link.send(decode_op([s], self.job), tag=DecodeTag((s,)))

    def _maybe_free(self, s: Stream) -> None:
        """Free the row of a finished stream once no op of it is in flight."""
        if self.busy.get(s.row) is not s:
            return
        if any(p.tag.has(s) for p in self.link.pending):
            return
        del self.busy[s.row]
        self.free_rows.append(s.row)
        self.streams.pop(s.index, None)  # a long-running run (a server) must not keep every past request
