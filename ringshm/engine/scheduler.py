"""The one scheduler: every entry point (``Engine.generate``, ``generate_batch``, ``AsyncEngine`` and the
server) drives its streams through a ``Scheduler``; one stream alone is the special case of one.

Each time it may send (after every reply, and when requests arrive), it builds one ``STEP`` op from every
admitted stream that has work and nothing blocking it:

    1. decode and verify segments first: a plain stream past its prefill with no op in flight adds its last
       token (1-token segment); a speculative stream adds its next verify segment (``SpecDecoder``:
       ``[last token, drafts...]``, chained under the epoch rule of ``ringshm.engine.spec_decode``);
    2. then prefill chunks of admitted streams, in admission order, one chunk per stream, each at most
       ``prefill_chunk`` tokens, until the op holds ``max_step_tokens`` tokens; while any stream decodes, a
       long prompt's chunks only as far as ``PrefillBudget`` allows (below).

A row appears at most once per op. KV lives in blocks (``ringshm.engine.kv_blocks``): admission attaches the
longest cached chain of the prompt's full blocks (the prefill starts after it: a hit computes nothing and
changes no byte) and takes fresh blocks for the rest; a decode or verify that crosses into a new block takes
one first, and every segment carries its stream's table. A reply makes the positions it wrote final, and full
blocks of final positions enter the prefix cache. When a block is needed and none can be had (free, or cached
and evicted least recently used first), the most recently admitted decoding stream with nothing in flight is
preempted: its blocks are released and it waits again with its tokens appended to its prompt, to be prefilled
again (exact, as recompute gives the same bits) before it decodes on.
Prefill chunks do not depend on replies, so one stream's chunks may fill
several ops in flight (the seed's pipelined prefill); a decode's input is the previous reply's output, so a
plain stream never has two ops in flight. Two windows bound what is in flight: at most ``depth`` ops that
carry decode/verify segments (the pipeline's micro-batches) and at most ``prefill_depth`` ops that carry
prefill chunks; an op with both counts against both, and a kind whose window is full waits for the next op.
While any stream decodes (``prefill_stall_ratio`` set), the chunks of long prompts (more than ``prefill_chunk``
tokens to compute) in all the ops in flight stay within the budget ``ringshm.engine.prefill_budget`` steers from
the decodes' round trips: a decode then finds at most that much of them queued ahead of it, so a long prompt
slows each decoding stream's tokens by about ``prefill_stall_ratio`` instead of holding them for its whole
prefill (stall-free batching), while it still pipelines over the stages in smaller ops. Short prompts
are not held: they are the steady arrivals of a server, and small ops cost more per token.
Waiting requests take free rows (``max_rows``) in arrival order; a finished or cancelled stream frees its
row once no op of it is in flight. A stream that ends with ops in flight (cancelled, failed, or finished with
verify segments out) has its row marked in ``ended``, shared with the stages, so that no stage computes the rest
of it (``ringshm.transport.messages``: ended streams are skipped); from then on none of its KV enters the prefix
cache, since a stage may have skipped writing it. The mark is cleared when the row is given to the next stream.

Every stage applies ops in arrival order, every row has its own KV, and the kernels compute each token's
row the same way whatever else shares the op (batch invariance, ``ringshm.model.stage_model``), so every stream gets
exactly the bytes it gets alone, whatever its batch-mates, the depths, the chunking or the token budget.

What a reply means to each of its streams (its next token, verified drafts, logprobs, the KV it made final) is
``ringshm.engine.step_reply``; here are the ops, their windows and the rows.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ringshm.engine.coordinator import Link, Stream, TokenEvent
from ringshm.engine.kv_blocks import KVBlocks
from ringshm.engine.logprobs import split_reply
from ringshm.engine.prefill_budget import PrefillBudget
from ringshm.engine.step_reply import DECODE, PREFILL, VERIFY, StepTag, commit_segment
from ringshm.errors import ReplyMismatch, RingTimeout
from ringshm.transport import messages as m

MIN_DECODE_WINDOW = 2  # decode ops in flight a row-scaled window allows whatever the rows (decode_window)


def window_fits_chain(spec_depth: int) -> bool:
    """Whether a row-scaled decode window (``Scheduler.decode_window``, at least ``MIN_DECODE_WINDOW`` ops) always
    lets a verify chain of ``spec_depth`` links run whole; else the speculating engine or server takes a fixed
    depth of at least ``spec_depth`` (each link of a chain is its own step op)."""
    return spec_depth <= MIN_DECODE_WINDOW


def _one_torch_thread(fn):
    """Run the coordinator's own torch work (sampling, building and encoding ops, stacking bitmasks) on one
    thread, and give the caller's thread count back after. torch's threads are per calling thread (OpenMP), and
    the stages hold the cores: at 2, a core held by a stage made every coordinator torch op wait a time slice
    (59 vs 1.7 ms), and an op built on 2 threads left libgomp's second thread spinning into the stage's op
    (measured, 16 JSON-constrained streams on 2 cores: the stage's decode op 57.6 ms against 50.1 ms for the
    same streams free, 5.8 involuntary switches per op against 1.7; 51.8 ms and 2.2 on one thread)."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        threads = torch.get_num_threads()
        if threads == 1:
            return fn(*args, **kwargs)
        torch.set_num_threads(1)
        try:
            return fn(*args, **kwargs)
        finally:
            torch.set_num_threads(threads)

    return run


@dataclass
class StepStats:
    """Counters over a scheduler's life: step ops sent, segments and tokens they carried, ops that carried
    more than one segment (batched steps), streams preempted for want of KV blocks, the most streams that held
    a row at once (``peak_rows``), and the segments and tokens a stage skipped because their stream had ended
    (``skipped_segments``, ``skipped_tokens``: work a cancelled request did not cost)."""

    ops: int = 0
    segments: int = 0
    tokens: int = 0
    multi_segment_ops: int = 0
    preemptions: int = 0
    peak_rows: int = 0
    skipped_segments: int = 0
    skipped_tokens: int = 0


class Scheduler:
    """Streams over one ring: iterate for ``TokenEvent``s, or call ``step`` from a dispatcher loop;
    ``submit`` adds a request while the run goes on, ``cancel`` ends one without disturbing the others.

    Args:
        link: the coordinator's ``Link`` (the scheduler owns it while it runs).
        streams: requests to start with (``row`` is assigned here).
        max_rows: stream slots (streams live at once; they reserve no KV).
        prefill_chunk: most prompt tokens per prefill segment. prefill_depth: ops with prefill chunks in
            flight. depth: ops with decode/verify segments in flight. max_step_tokens: token budget of one
            op for prefill chunks (decode and verify segments always go in). job: the job id on the wire.
            prefill_stall_ratio: while any stream decodes, long prompts' tokens in flight stay within
            ``PrefillBudget(prefill_stall_ratio, max_step_tokens * prefill_depth).tokens()`` (module docstring);
            None: no such limit.
            ended: the per-row marks shared with the stages (a writable sequence of ``max_rows`` bytes:
            ``StageGroup.ended``); None: nothing is skipped.
            rows_per_op: None, or the decoding streams each decode op in flight beyond the second needs
            (``decode_window``; cores shared by the stages).

    Raises:
        ValueError: a limit < 1, or a stream with an empty prompt.
    """

    def __init__(self, link: Link, streams: list[Stream], max_rows: int, prefill_chunk: int, prefill_depth: int,
                 depth: int, max_step_tokens: int, job: int = 0, *, kv: KVBlocks, prefix_cache: bool = True,
                 ended=None, prefill_stall_ratio: float | None = None, rows_per_op: int | None = None):
        for name, v in (("max_rows", max_rows), ("prefill_chunk", prefill_chunk), ("prefill_depth", prefill_depth),
                        ("depth", depth), ("max_step_tokens", max_step_tokens)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if rows_per_op is not None and (isinstance(rows_per_op, bool) or not isinstance(rows_per_op, int)
                                        or rows_per_op < 1):
            raise ValueError(f"rows_per_op must be None or an int >= 1, got {rows_per_op!r}")
        self.rows_per_op = rows_per_op
        self.prefill_budget = (None if prefill_stall_ratio is None
                               else PrefillBudget(prefill_stall_ratio, max_step_tokens * prefill_depth))
        self.link, self.job, self.kv, self.prefix_cache = link, job, kv, prefix_cache
        if ended is not None and len(ended) < max_rows:
            raise ValueError(f"ended holds {len(ended)} row marks, fewer than max_rows={max_rows}")
        self.ended = ended
        self.chunk, self.prefill_depth, self.depth, self.max_step_tokens = (prefill_chunk, prefill_depth, depth,
                                                                            max_step_tokens)
        self.waiting: deque[Stream] = deque()
        self.free_rows = list(range(max_rows))
        self.active: list[Stream] = []  # holding a row, in admission order
        self.streams: dict[int, Stream] = {}
        self.n_decode_ops = self.n_prefill_ops = 0  # ops in flight counting against each window
        self.n_long_tokens = 0  # tokens of long prompts' chunks in the ops in flight (PrefillBudget's)
        self.stats = StepStats()
        self.last_segments = 0  # segments of the op the last reply answered
        self._building: list[Stream] = []  # the streams of the op being built
        self._late_events: list[TokenEvent] = []  # streams failed after a reply (their masks): the next step's
        for s in streams:
            self.submit(s, send=False)

    # --------------------------------------------------------------------------------------- public API
    def submit(self, stream: Stream, send: bool = True) -> None:
        """Queue a request; it starts as soon as a row is free (and, with ``send``, at once if one is).

        Raises:
            ValueError: the stream's prompt is empty (it could never be prefilled).
        """
        if not stream.prompt:
            raise ValueError(f"stream {stream.index} has an empty prompt: give at least one token")
        self.streams[stream.index] = stream
        self.waiting.append(stream)
        if send:
            self._admit()
            self._fill()

    def cancel(self, index: int) -> None:
        """End stream ``index`` now: finish_reason "cancelled"; its row is freed once nothing of it is in
        flight. Unknown or finished streams are ignored."""
        s = self.streams.get(index)
        if s is None or s.done:
            return
        s.cancel()
        if s in self.waiting:
            self.waiting.remove(s)
            self.streams.pop(s.index, None)
        else:
            self._maybe_free(s)

    def __iter__(self) -> Iterator[TokenEvent]:
        self._admit()
        self._fill()
        while self.link.in_flight:
            yield from self.step()

    def step(self, timeout_s: float | None = None) -> list[TokenEvent]:
        """Take the next reply (waiting at most ``timeout_s``, default the link's op timeout), commit its
        tokens, send the ops it makes possible, and return the tokens.

        Raises:
            RingTimeout: no reply within timeout_s, or no room in stage 0's ring for an op within the link's
                op timeout (nothing is lost either way: an op that was not sent is not counted; call again).
            StageDied, StageError, ReplyMismatch: as ``Link.recv`` (also a reply whose outputs do not fit its
                segment table).
        """
        self._admit()
        self._fill()
        reply, tag = self.link.recv(timeout_s)
        if self.prefill_budget is not None:
            self.prefill_budget.on_reply(tag)
        events = self._on_reply(reply, tag)
        self._admit()
        try:
            self._fill()  # next ops out before the caller sees the tokens
        except RingTimeout:
            pass  # stage 0's ring stayed full: those ops go out on the next call; these tokens are returned now
        events += self._late_events  # streams whose next mask failed as their op went out
        self._late_events = []
        return events

    def decode_window(self) -> int:
        """Ops with decode / verify segments that may be in flight now: ``depth``, or with ``rows_per_op`` set
        at least 2 (1 when ``depth`` is 1) and beyond that one more per ``rows_per_op`` decoding streams, up to
        ``depth`` (``ringshm.runtime.launcher.default_depth``: on shared cores a micro-batch pays for its pass over
        the weights only with rows enough)."""
        if self.rows_per_op is None:
            return self.depth
        n = sum(1 for s in self.active if s.decoding)
        return min(self.depth, max(MIN_DECODE_WINDOW, n // self.rows_per_op))

    @property
    def idle(self) -> bool:
        """Nothing in flight and nobody waiting."""
        return not self.link.in_flight and not self.waiting

    # ----------------------------------------------------------------------------------------- private
    def _admit(self) -> None:
        """Waiting streams take a free row and the KV blocks of their prompt, in arrival order; one that cannot
        get its blocks waits (head of the line) until a stream ends or is preempted."""
        while self.waiting and self.free_rows:
            s = self.waiting[0]
            if s.done:  # cancelled before it got a row: nothing to run
                self.waiting.popleft()
                self.streams.pop(s.index, None)
                continue
            lookup = self.prefix_cache and s.prompt_logprobs is None  # prompt logprobs score every position
            cached = self.kv.admit(s, s.prefill_ids, s.cache_salt, lookup=lookup, count=s.resume_ids is None)
            if cached is None:  # not now: running streams are not preempted for a newcomer (it fits alone)
                return
            self.waiting.popleft()
            s.row = self.free_rows.pop(0)
            if self.ended is not None:  # nothing of the row's last stream is in flight: its mark is spent
                self.ended[s.row] = 0
            s.n_prefilled = s.n_prefill_done = cached
            s.n_to_prefill = len(s.prefill_ids) - cached
            if s.resume_ids is None:
                s.cached_tokens = cached
            self.active.append(s)
            self.stats.peak_rows = max(self.stats.peak_rows, len(self.active))

    def _preempt(self) -> bool:
        """Free KV blocks by preempting the most recently admitted decoding stream with no op in flight and no
        segment in the op being built (vLLM's recompute preemption): its blocks go back, it waits at the head of
        the queue with the tokens it generated appended to what it prefills. Returns False when no stream can be
        preempted now."""
        victims = [s for s in self.active if s.decoding and not s.n_in_flight and s not in self._building]
        if not victims:
            return False
        s = victims[-1]
        self.active.remove(s)
        self.kv.release(s)
        self.free_rows.append(s.row)
        s.row, s.n_prefilled, s.n_prefill_done = -1, 0, 0
        s.resume_ids = s.prompt + s.tokens
        s.n_preemptions += 1
        self.stats.preemptions += 1
        self.waiting.appendleft(s)
        return True

    def _blocks_for(self, s: Stream, end: int) -> bool:
        """Make the stream's table cover positions [0, end), preempting others if need be; False when it cannot
        (the segment waits for the next op)."""
        while not self.kv.ensure(s, end):
            if not self._preempt():
                return False
            if s.row < 0:  # it was the victim itself
                return False
        return True

    @_one_torch_thread
    def _fill(self) -> None:
        """Send step ops while a window has room and some stream has work (module docstring)."""
        decoding = self.prefill_budget is not None and any(s.decoding for s in self.active)
        depth = self.decode_window()
        while self.n_decode_ops < depth or self.n_prefill_ops < self.prefill_depth:
            segs: list[m.Segment] = []
            ids: list[int] = []
            targets: list[int] = []
            tag = StepTag()
            self._building = tag.streams  # not preempted while this op is built (_preempt)
            if self.n_decode_ops < depth:
                self._add_decodes(segs, ids, tag)
            if self.n_prefill_ops < self.prefill_depth:
                long_budget = (self.prefill_budget.tokens() - self.n_long_tokens  # module docstring
                               if decoding else None)
                self._add_prefill_chunks(segs, ids, targets, tag, self.max_step_tokens - len(ids), long_budget)
            if not segs:
                return
            try:
                tensors = [torch.tensor(ids, dtype=torch.int64)]
                if targets:  # the ids prompt logprobs score, forwarded by every stage to the last
                    tensors.append(torch.tensor(targets, dtype=torch.int64))
                tables: list[int] = []
                for st, seg in zip(tag.streams, segs):  # each segment's table, exactly its positions' blocks
                    tables += self.kv.table(st)[:self.kv.blocks_for(seg.start + seg.n_tokens)]
                tensors.append(torch.tensor(tables, dtype=torch.int32))
                self.link.send(m.Message(m.STEP, job=self.job, segments=segs, tensors=tensors), tag=tag)
            except BaseException:  # not sent (RingTimeout, StageDied): undo what building it claimed
                for s, kind, v, seg in zip(tag.streams, tag.kinds, tag.verifies, segs):
                    if kind == PREFILL:
                        s.n_prefilled -= seg.n_tokens
                    elif v is not None:
                        s.spec.in_flight.remove(v)
                raise
            for s in tag.streams:
                s.n_in_flight += 1
            self.n_long_tokens += tag.n_long_tokens
            if self.prefill_budget is not None:
                self.prefill_budget.on_send(tag, self.n_long_tokens > 0)
            self.n_decode_ops += tag.decode
            self.n_prefill_ops += tag.prefill
            st = self.stats
            st.ops, st.segments, st.tokens = st.ops + 1, st.segments + len(segs), st.tokens + len(ids)
            st.multi_segment_ops += len(segs) > 1
            if self.link.owed is not None:  # after the bookkeeping: the op is out even if its masks find no room
                self._send_masks(tag, segs)

    def _add_decodes(self, segs: list[m.Segment], ids: list[int], tag: StepTag) -> None:
        """A decode segment of each plain stream with its last token and nothing in flight, and the next
        verify segment of each speculative stream that has one (``SpecDecoder.next_segment``)."""
        for s in list(self.active):
            if not s.decoding or s.row < 0:
                continue
            if s.spec is None:
                if not s.n_in_flight and self._blocks_for(s, s.position + 1):
                    segs.append(m.Segment(s.row, s.position, 1, _want(s)))
                    ids.append(s.tokens[-1])
                    tag.add(s, DECODE)
            elif (v := s.spec.next_segment()) is not None:
                if not self._blocks_for(s, v.start + len(v.inputs)):
                    s.spec.in_flight.remove(v)  # not sent: the chain is built again next time
                    continue
                segs.append(m.Segment(s.row, v.start, len(v.inputs),
                                      m.WANT_ALL | (m.WANT_ALLOWED if v.allowed is not None else 0)))
                ids.extend(v.inputs)
                tag.add(s, VERIFY, v)

    def _add_prefill_chunks(self, segs: list[m.Segment], ids: list[int], targets: list[int], tag: StepTag,
                            budget: int, long_budget: int | None = None) -> None:
        """The next prompt chunk of each stream still reading its prompt, in admission order, within
        ``budget`` tokens, and the chunks of long prompts (more than ``prefill_chunk`` tokens to compute) within
        ``long_budget`` too (None: no such bound; a long prompt past it waits, the others go on); the prompt's
        last chunk asks for the stream's first token. A stream with ``prompt_logprobs`` scores each chunk
        position against the next prompt id (``targets``)."""
        for s in self.active:
            if budget <= 0:
                return
            feed = s.prefill_ids
            left = len(feed) - s.n_prefilled
            if left <= 0 or s.done:
                continue
            n = min(self.chunk, left, budget)
            if long_budget is not None and s.n_to_prefill > self.chunk:  # a long prompt while streams decode
                n = min(n, long_budget)
                if n <= 0:
                    continue
                long_budget -= n
                tag.n_long_tokens += n
            want = _want(s) if n == left else m.WANT_NONE
            if s.prompt_logprobs is not None and s.resume_ids is None:
                k = max(s.prompt_logprobs, m.Segment(0, 0, 1, want).k)  # the last chunk may carry both kinds
                want = (want & ~(0xFF << m.WANT_K_SHIFT)) | m.WANT_PROMPT_LOGPROBS | m.want_k(k)
                targets.extend(s.prompt[s.n_prefilled + 1: s.n_prefilled + n + 1])
            segs.append(m.Segment(s.row, s.n_prefilled, n, want))
            ids.extend(feed[s.n_prefilled: s.n_prefilled + n])
            s.n_prefilled += n
            budget -= n
            tag.add(s, PREFILL)

    @_one_torch_thread
    def _on_reply(self, reply: m.Message, tag: StepTag) -> list[TokenEvent]:
        """Commit what one step reply carries, segment by segment, and free the rows of finished streams.

        A segment's own work (prompt logprobs, sampling, speculative acceptance, detokenisation, stop strings)
        that raises fails that stream alone: it ends with finish_reason "error" and an event carrying the
        exception; the op's other segments are committed as usual."""
        return self._commit_reply(reply, tag)

    def _commit_reply(self, reply: m.Message, tag: StepTag) -> list[TokenEvent]:
        self.last_segments = len(tag.streams)
        self.n_decode_ops -= tag.decode
        self.n_prefill_ops -= tag.prefill
        self.n_long_tokens -= tag.n_long_tokens
        for s in tag.streams:
            s.n_in_flight -= 1
        events: list[TokenEvent] = []
        for seg, s, kind, v, part in zip(reply.segments, tag.streams, tag.kinds, tag.verifies, split_reply(reply)):
            if seg.want & m.SKIPPED:
                if not s.skip_marked:
                    raise ReplyMismatch(f"seq {reply.seq}: a stage skipped the segment of row {seg.row} (stream "
                                        f"{s.index}), which the coordinator had not marked ended")
                self.stats.skipped_segments += 1
                self.stats.skipped_tokens += seg.n_tokens
            if kind == PREFILL:
                s.n_prefill_done += seg.n_tokens
            if s.error is None:
                n_events = len(events)
                try:
                    failure = commit_segment(s, seg, kind, v, part, events, self.kv if self.prefix_cache else None)
                except Exception as exc:  # noqa: BLE001 - whatever this stream's own work raised ends it alone
                    del events[n_events:]
                    failure = exc
                if failure is not None:
                    s.fail(failure)
                    events.append(TokenEvent(s.index, -1, "", error=failure))
            if s.done:
                self._maybe_free(s)
        return events

    def _send_masks(self, tag: StepTag, segs: list[m.Segment]) -> None:
        """The MASKS record of the op just sent (``ringshm.transport.messages``: masks travel behind their op): each
        constrained segment's bitmasks, a verify's from its drafts' walk, a decode's or a prompt's last chunk's
        computed now, on this thread, while the stages run the op (masks computed before it, on llguidance's 2
        threads, left every stage idle ~0.6 ms a step at 16 streams; on their 2 threads while the stage runs, they took
        its cores: 16-stream decode 0.76 x). A grammar that allows no token, or fails, ends its own stream: its
        rows allow every token (its reply is dropped), and the record always goes out."""
        constrained = [(st, v) for st, seg, v in zip(tag.streams, segs, tag.verifies) if seg.want & m.WANT_ALLOWED]
        width = -(-constrained[0][0].grammar.vocab // 32)
        rows: list[torch.Tensor] = []
        try:
            for st, v in constrained:
                if v is not None:
                    rows += v.allowed
                    continue
                try:
                    rows.append(st.grammar.words())
                except Exception as exc:  # noqa: BLE001 - this stream's grammar failed: it ends alone
                    rows.append(torch.full((width,), -1, dtype=torch.int32))
                    if st.error is None:
                        st.fail(exc)
                        self._late_events.append(TokenEvent(st.index, -1, "", error=exc))
                    self._maybe_free(st)
            masks = torch.stack(rows)
        except BaseException:  # anything else (an interrupt): the record still goes out, or the op would hold its
            n = sum(seg.n_allowed_rows() for seg in segs)  # last stage, and the link, until the ring timeout
            self.link.send_masks(torch.full((n, width), -1, dtype=torch.int32))
            raise
        self.link.send_masks(masks)

    def _maybe_free(self, s: Stream) -> None:
        """Free the row and KV blocks of a finished stream once no op of it is in flight; while some is, mark its
        row ended so that the stages skip it (module docstring)."""
        if s.row < 0 or s not in self.active:
            return
        if s.n_in_flight:
            if not s.skip_marked:
                s.skip_marked = True
                if self.ended is not None:
                    self.ended[s.row] = 1
            return
        self.active.remove(s)
        self.kv.release(s)
        self.free_rows.append(s.row)
        self.streams.pop(s.index, None)  # a long-running scheduler (a server) must not keep every past request

    def release_all(self) -> None:
        """Give back the KV blocks of every stream this run still holds (after a failure, once nothing of it is
        in flight: ``Link.drain``), so the engine's pool serves the next run whole."""
        for s in self.active:
            if s in self.kv:
                self.kv.release(s)
        self.active.clear()


def _want(s: Stream) -> int:
    """What a stream's decode or last prefill chunk asks of the last stage: the argmax, plus the logits when
    it samples or processes them (logit_bias, penalties, min_tokens: ``Sampler.needs_logits``; a grammar's mask
    is then the coordinator's), else the argmax among the tokens its grammar allows (``WANT_ALLOWED``, its
    bitmask in the MASKS record behind the op) and, when it asks for logprobs, the argmax's logprob and top-k
    (with logits, the coordinator computes them)."""
    if s.sampler.needs_logits:
        return m.WANT_LAST | m.WANT_LOGITS
    want = m.WANT_LAST | (m.WANT_ALLOWED if s.grammar is not None else 0)
    if s.logprobs is not None:
        return want | m.WANT_LOGPROBS | m.want_k(s.logprobs)
    return want
