"""The one scheduler over the fake oracle ring (issue 11): STEP ops with segment tables, exact continuations
whatever the depths, token budget, rows or arrival/cancel schedule, reply checks, and stage-side table checks.
Runs in seconds."""

from __future__ import annotations

import random
import time
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fake_stage import EOS, OracleModel, RecordingModel, RelayModel, fake_kv, make_stream, start_fake_ring
from ringshm.engine.logprobs import split_reply
from ringshm.engine.scheduler import Scheduler
from ringshm.runtime.stage import N_SLOTS, SLOT_OPS
from ringshm.engine.spec import NGramDrafter
from ringshm.engine.spec_decode import SpecDecoder
from ringshm.errors import ReplyMismatch, RingStateError, RingTimeout, StageError
from ringshm.transport import messages as m

CHUNK = 4


def scripts(n: int, length: int = 60, seed: int = 0) -> list[list[int]]:
    """``n`` token sequences with distinct first tokens and no EOS (ids 10..999)."""
    rng = random.Random(seed)
    return [[100 + i] + [rng.randrange(10, 1000) for _ in range(length - 1)] for i in range(n)]


@pytest.fixture
def fake():
    rings = []

    def start(model, **kw):
        rings.append(start_fake_ring(model, **kw))
        return rings[-1]

    yield start
    for r in rings:
        r.close()


def sched(ring, streams, max_rows=8, prefill_depth=8, depth=3, max_step_tokens=CHUNK, chunk=CHUNK):
    return Scheduler(ring.link, streams, max_rows, chunk, prefill_depth, depth, max_step_tokens,
                     kv=fake_kv(ring.model))


def per_row(frames):
    """Each row's segments ``(start, n)`` in the order the stage applied them."""
    rows: dict[int, list] = {}
    for op in frames:
        for row, start, n in op:
            rows.setdefault(row, []).append((start, n))
    return rows


@pytest.mark.parametrize("depth", [1, 3, 8])
@pytest.mark.parametrize("prefill_depth", [1, 8])
@pytest.mark.parametrize("max_step_tokens", [1, 6, 64])
def test_every_stream_gets_exactly_its_scripted_continuation(fake, depth, prefill_depth, max_step_tokens):
    ts = scripts(4)
    ring = fake(RecordingModel(ts, max_rows=4))
    prompt_lens = [3, 9, 17, 4]  # 1, 3, 5 and 1 chunks: different lengths, some shorter than the window
    streams = [make_stream(i, t, n, 12) for i, (t, n) in enumerate(zip(ts, prompt_lens))]
    run = sched(ring, streams, 4, prefill_depth, depth, max_step_tokens)
    events = list(run)
    for s, t, n in zip(streams, ts, prompt_lens):
        assert s.tokens == t[n : n + 12]
        assert s.finish_reason == "length"
    assert len(events) == 48 and ring.link.in_flight == 0
    for op in ring.model.frames:  # the budget bounds prefill tokens; decodes (1 token each) always go in
        prefill = [n for row, start, n in op if start < prompt_lens[row]]
        decodes = len(op) - len(prefill)
        assert sum(prefill) <= max(0, max_step_tokens - decodes)


def test_decoding_streams_share_step_ops(fake):
    ts = scripts(4, seed=1)
    ring = fake(RecordingModel(ts, max_rows=4))
    streams = [make_stream(i, t, 5, 10) for i, t in enumerate(ts)]
    run = sched(ring, streams, depth=1)
    list(run)
    assert [s.tokens for s in streams] == [t[5:15] for t in ts]
    decode_ops = [op for op in ring.model.frames if all(n == 1 for _, _, n in op)]
    assert max(len(op) for op in decode_ops) == 4, "with depth 1 every ready stream decodes in the same op"
    assert run.stats.multi_segment_ops > 0 and run.stats.segments > run.stats.ops


@pytest.mark.parametrize("knob", ["prefill_depth", "depth", "max_step_tokens"])
def test_the_windows_change_how_ops_are_cut_never_the_tokens(fake, knob):
    ts = scripts(3, seed=1)
    got = []
    for value in (1, 8):
        model = RecordingModel(ts, max_rows=3)
        ring = fake(model)
        streams = [make_stream(i, t, 5 + 6 * i, 6) for i, t in enumerate(ts)]
        kw = {"prefill_depth": 8, "depth": 3, "max_step_tokens": CHUNK, knob: value}
        list(sched(ring, streams, 3, **kw))
        for row, segs in per_row(model.frames).items():  # each row's segments tile its positions in order
            assert [start for start, _ in segs] == [0] + [start + n for start, n in segs[:-1]]
        got.append(([s.tokens for s in streams], model.frames))
    assert got[0][0] == got[1][0] == [t[5 + 6 * i: 11 + 6 * i] for i, t in enumerate(ts)]
    assert got[0][1] != got[1][1], f"{knob} 1 and 8 should cut the ops differently"


@pytest.mark.parametrize("rows_per_op,most", [(None, 3), (4, 2)])
def test_on_shared_cores_a_decode_op_beyond_the_second_needs_rows_per_op_decoding_streams(fake, rows_per_op, most):
    ts = scripts(6, length=80, seed=4)
    ring = fake(OracleModel(ts, max_rows=6))
    streams = [make_stream(i, t, 1 + CHUNK * i, 30) for i, t in enumerate(ts)]  # start decoding one by one
    run = Scheduler(ring.link, streams, 6, CHUNK, 8, 3, CHUNK, kv=fake_kv(ring.model), rows_per_op=rows_per_op)
    seen = 0
    while ring.link.in_flight or run.waiting:
        run.step()
        seen = max(seen, run.n_decode_ops)
        assert run.n_decode_ops <= run.decode_window()
    assert seen == most, f"decode ops in flight peaked at {seen}, expected {most}"
    assert [s.tokens for s in streams] == [t[1 + CHUNK * i: 31 + CHUNK * i] for i, t in enumerate(ts)]


@pytest.mark.parametrize("depth,decoding,window", [(3, 0, 2), (3, 23, 2), (3, 24, 3), (3, 64, 3), (4, 31, 3),
                                                   (4, 40, 4), (1, 64, 1)])
def test_the_decode_window_grows_by_one_per_rows_per_op_decoding_streams_up_to_depth(fake, depth, decoding, window):
    ring = fake(OracleModel(scripts(1), max_rows=1))
    run = Scheduler(ring.link, [], 1, CHUNK, 1, depth, CHUNK, kv=fake_kv(ring.model), rows_per_op=8)
    run.active = [SimpleNamespace(decoding=True)] * decoding + [SimpleNamespace(decoding=False)] * 5
    assert run.decode_window() == window


@pytest.mark.parametrize("spec,spec_depth,want_depth,want_rows", [(None, 1, 3, 8), ("ngram", 2, 3, 8),
                                                                   ("ngram", 4, 4, None)])
def test_a_batch_without_a_depth_gets_the_engine_s_row_scaled_window_unless_its_chains_need_more(
        fake, spec, spec_depth, want_depth, want_rows):
    from ringshm.engine.engine import Engine
    from ringshm.generation_params import GenerationParams

    ring = fake(OracleModel(scripts(1), max_rows=4))
    eng = Engine.__new__(Engine)
    eng._link, eng._job, eng.kv, eng.depth, eng.rows_per_op = ring.link, 0, fake_kv(ring.model), 3, 8
    eng.config = SimpleNamespace(max_rows=4, prefill_chunk=CHUNK, prefill_depth=8, prefix_cache=True,
                                 prefill_stall_ratio=None, step_tokens=CHUNK)
    eng._group = SimpleNamespace(ended=None)
    run = eng.scheduler([], 8, eng._decode_depth(GenerationParams(spec=spec, spec_depth=spec_depth)))
    assert (run.depth, run.rows_per_op) == (want_depth, want_rows)


@pytest.mark.parametrize("bad", [0, -1, True, 2.0])
def test_rows_per_op_must_be_a_positive_int(fake, bad):
    ring = fake(OracleModel(scripts(1), max_rows=1))
    with pytest.raises(ValueError, match="rows_per_op"):
        Scheduler(ring.link, [], 1, CHUNK, 1, 3, CHUNK, kv=fake_kv(ring.model), rows_per_op=bad)


def test_one_stream_alone_puts_chunked_prefill_then_one_token_decodes_on_the_wire(fake):
    (t,) = scripts(1, seed=2)
    model = RecordingModel([t], 2)
    s = make_stream(0, t, 10, 8)
    list(sched(fake(model), [s]))
    assert s.tokens == t[10:18]
    assert model.frames == [((0, 0, 4),), ((0, 4, 4),), ((0, 8, 2),)] + [((0, p, 1),) for p in range(10, 17)]


def test_a_stream_whose_prefill_yields_eos_finishes_at_its_first_token(fake):
    ts = scripts(2, seed=3)
    ts[0][7] = EOS  # the token after a 7-token prompt
    ring = fake(OracleModel(ts, max_rows=2))
    streams = [make_stream(0, ts[0], 7, 10), make_stream(1, ts[1], 7, 10)]
    list(sched(ring, streams))
    assert streams[0].tokens == [EOS] and streams[0].finish_reason == "stop"
    assert streams[1].tokens == ts[1][7:17]


def test_eos_mid_decode_ends_only_that_stream(fake):
    ts = scripts(3, seed=4)
    ts[1][12] = EOS
    ring = fake(OracleModel(ts, max_rows=3))
    streams = [make_stream(i, t, 8, 10) for i, t in enumerate(ts)]
    list(sched(ring, streams, depth=1))
    assert streams[1].tokens == ts[1][8:13] and streams[1].finish_reason == "stop"
    assert streams[0].tokens == ts[0][8:18] and streams[2].tokens == ts[2][8:18]


def test_max_new_tokens_1_ends_each_stream_at_its_prefill(fake):
    ts = scripts(3, seed=5)
    ring = fake(RecordingModel(ts, max_rows=3))
    streams = [make_stream(i, t, 6, 1) for i, t in enumerate(ts)]
    list(sched(ring, streams, max_step_tokens=64))
    assert [s.tokens for s in streams] == [[t[6]] for t in ts]
    # only prefill segments went out (chunks of 4 then 2 per 6-token prompt), no decode
    assert sorted(g for op in ring.model.frames for g in op) == sorted(
        (r, start, n) for r in range(3) for start, n in ((0, 4), (4, 2)))
    assert ring.link.in_flight == 0


def test_more_streams_than_rows_queue_and_reuse_freed_rows(fake):
    ts = scripts(7, seed=7)
    ring = fake(RecordingModel(ts, max_rows=2))
    streams = [make_stream(i, t, 3 + i, 4 + i) for i, t in enumerate(ts)]
    run = sched(ring, streams, max_rows=2)
    list(run)
    assert [s.tokens for s in streams] == [t[3 + i : 7 + 2 * i] for i, t in enumerate(ts)]
    assert {row for op in ring.model.frames for row, _, _ in op} == {0, 1}
    assert sorted(run.free_rows) == [0, 1] and not run.active and not run.streams


def test_cancelling_one_stream_leaves_the_others_exact(fake):
    ts = scripts(3, seed=8)
    ring = fake(OracleModel(ts, max_rows=3))
    streams = [make_stream(i, t, 6, 20) for i, t in enumerate(ts)]
    run = sched(ring, streams)
    for n, ev in enumerate(run):
        if n == 6:
            run.cancel(1)
    assert streams[1].finish_reason == "cancelled" and len(streams[1].tokens) < 20
    assert streams[1].tokens == ts[1][6 : 6 + len(streams[1].tokens)]
    assert streams[0].tokens == ts[0][6:26] and streams[2].tokens == ts[2][6:26]
    assert ring.link.in_flight == 0


def test_a_cancelled_stream_frees_its_row_for_a_waiting_one(fake):
    ts = scripts(3, seed=9)
    ring = fake(OracleModel(ts, max_rows=1))
    streams = [make_stream(i, t, 5, 30) for i, t in enumerate(ts)]
    run = sched(ring, streams, max_rows=1)
    for ev in run:
        if ev.stream == 0 and len(streams[0].tokens) == 3:
            run.cancel(0)
        if ev.stream == 1 and len(streams[1].tokens) == 2:
            run.cancel(1)
    assert [s.finish_reason for s in streams] == ["cancelled", "cancelled", "length"]
    assert streams[2].tokens == ts[2][5:35]


def test_a_stream_cancelled_before_it_got_a_row_never_holds_one(fake):
    ts = scripts(2, seed=15)
    ring = fake(OracleModel(ts, max_rows=1))
    streams = [make_stream(i, t, 5, 6) for i, t in enumerate(ts)]
    streams[0].cancel()  # as BatchStream.cancel does before the run starts
    run = sched(ring, streams, max_rows=1)
    list(run)
    assert streams[0].tokens == [] and streams[1].tokens == ts[1][5:11]
    assert run.free_rows == [0] and not run.active and not run.streams


def test_an_op_that_could_not_be_sent_is_not_counted_and_goes_out_later(fake):
    ts = scripts(3, seed=16)
    ts[0] = ts[0][:1] + (ts[0][1:6] * 12)[:59]  # a repeating script: its drafts get accepted
    ring = fake(OracleModel(ts, max_rows=3))
    streams = [make_stream(i, t, 9, 8) for i, t in enumerate(ts)]
    streams[0].spec = SpecDecoder(streams[0], NGramDrafter(k=3), 2)
    real, calls = ring.link.send, []

    def flaky(msg, tag=None):
        calls.append(msg.seq)
        if len(calls) in (2, 9):  # stage 0's ring "full" once during prefill, once during decode
            raise RingTimeout("no room in stage 0's input ring")
        return real(msg, tag)

    ring.link.send = flaky
    run = sched(ring, streams, depth=2, prefill_depth=4)
    events = []
    while True:
        try:
            events += list(run)
            break
        except RingTimeout:
            continue
    assert [s.tokens for s in streams] == [t[9:17] for t in ts]
    assert len(events) == 24 and (run.n_decode_ops, run.n_prefill_ops) == (0, 0)
    assert all(s.n_in_flight == 0 for s in streams) and not streams[0].spec.in_flight


def test_the_engine_refuses_more_rows_than_one_step_op_can_hold():
    from ringshm.config import MAX_ROWS, EngineConfig

    with pytest.raises(ValueError, match=f"at most {MAX_ROWS}"):
        EngineConfig(max_rows=MAX_ROWS + 1)


def test_swapped_replies_raise_reply_mismatch_instead_of_being_misassigned(fake):
    ts = scripts(2, seed=10)
    ring = fake(OracleModel(ts, max_rows=2), swap_at=2)
    streams = [make_stream(i, t, 9, 5) for i, t in enumerate(ts)]
    with pytest.raises(ReplyMismatch, match="expected the reply to seq 1"):
        list(sched(ring, streams))


def test_a_reply_carrying_another_segment_table_raises_reply_mismatch(fake):
    ts = scripts(2, seed=10)
    ring = fake(OracleModel(ts, max_rows=2), tamper_at=3)
    streams = [make_stream(i, t, 9, 5) for i, t in enumerate(ts)]
    with pytest.raises(ReplyMismatch, match="segments"):
        list(sched(ring, streams, depth=1))


def row_tables(model: OracleModel, segments) -> torch.Tensor:
    """The op's tables tensor when every segment's stream owns its row's fixed blocks (``OracleModel.row_table``)."""
    ids = [b for g in segments for b in model.row_table(max(g.row, 0))[:-(-(g.start + g.n_tokens) // model.block_size)]]
    return torch.tensor(ids, dtype=torch.int32)


def step_op(model: OracleModel, segments, ids) -> m.Message:
    return m.Message(m.STEP, segments=segments, tensors=[torch.tensor(ids), row_tables(model, segments)])


def _ban(model: OracleModel, token: int) -> torch.Tensor:
    """One bitmask row allowing every token but ``token``."""
    words = torch.full((1, -(-model.vocab // 32)), -1, dtype=torch.int32)
    words[0, token // 32] = ~(1 << token % 32) if token % 32 != 31 else 0x7FFFFFFF
    return words


def _answers_plain(ring, model: OracleModel, t: list[int]) -> None:
    """The ring still serves: an unconstrained op over ``t[:4]`` answers ``t[4]``."""
    ring.link.send(step_op(model, [m.Segment(0, 0, 4, m.WANT_LAST)], t[:4]))
    reply, _ = ring.link.recv()
    assert split_reply(reply)[0].ids == [t[4]]


@pytest.mark.parametrize("relays", [0, 2])
def test_masks_travel_behind_their_op_and_the_last_stage_reads_them_only_when_it_needs_them(fake, relays):
    """A constrained op goes out first; its MASKS record may follow any time after (the last stage holds the
    logits and waits for it), and nothing else may go between them. A MASKS record no op reads (here one of a
    seq never sent) is dropped by the last stage, after the stages before it forwarded it."""
    (t,) = scripts(1, seed=21)
    model = OracleModel([t], max_rows=2)
    ring = fake(model, relays=[RelayModel() for _ in range(relays)])
    seg = m.Segment(0, 0, 4, m.WANT_LAST | m.WANT_ALLOWED)
    ring.link.send(step_op(model, [seg], t[:4]))
    with pytest.raises(RingStateError, match="MASKS record must be sent before a reply"):
        ring.link.recv()
    with pytest.raises(RingStateError, match="MASKS record must be sent before the next op"):
        ring.link.send(step_op(model, [m.Segment(1, 0, 1, m.WANT_LAST)], t[:1]))
    time.sleep(0.2)  # the op is applied up to its head, which waits
    ring.link.send_masks(_ban(model, t[4]))
    reply, _ = ring.link.recv()
    assert split_reply(reply)[0].ids == [(t[4] + 1) % model.vocab], "the answer was banned: the next id"
    ops = [ring.status[i * N_SLOTS + SLOT_OPS] for i in range(relays + 1)]
    assert ops == [ring.link.n_sent] * (relays + 1), "a MASKS record is not an op: the stall watch compares these"
    with pytest.raises(RingStateError, match="no op sent owes"):
        ring.link.send_masks(_ban(model, t[4]))
    stray = m.Message(m.MASKS, seq=1000, segments=[seg], tensors=[_ban(model, t[5])])
    ring.link.to_first.send(m.encode(stray))
    ring.link.send(step_op(model, [m.Segment(0, 4, 1, m.WANT_LAST)], t[4:5]))
    reply, _ = ring.link.recv()
    assert split_reply(reply)[0].ids == [t[5]], "the stray record restricted nothing"


def test_drain_gives_an_op_whose_masks_were_never_made_a_record_its_last_stage_refuses(fake):
    """The masks' computation broke off (an interrupt) with the op out: ``drain`` sends a MASKS record of zero-width
    rows, the last stage fails that op, the ERROR reply is dropped, and the link serves on."""
    (t,) = scripts(1, seed=23)
    model = OracleModel([t], max_rows=2)
    ring = fake(model)
    ring.link.send(step_op(model, [m.Segment(0, 0, 4, m.WANT_LAST | m.WANT_ALLOWED)], t[:4]))
    ring.link.drain()
    assert ring.link.owed is None and not ring.link.in_flight
    _answers_plain(ring, model, t)


def test_masks_that_never_come_fail_their_op_within_the_ring_timeout_and_come_late_to_nothing(fake):
    (t,) = scripts(1, seed=22)
    model = OracleModel([t], max_rows=2)
    ring = fake(model, ring_timeout_s=0.5)
    seg = m.Segment(0, 0, 4, m.WANT_LAST | m.WANT_ALLOWED)
    op = step_op(model, [seg], t[:4])
    ring.link.send(op)
    ring.link.owed = None  # a coordinator that never sends them (a bug this test stands in for)
    with pytest.raises(StageError, match="RingTimeout"):
        ring.link.recv(timeout_s=5)
    ring.link.to_first.send(m.encode(m.masks_record(op, _ban(model, t[4]))))  # too late: dropped
    _answers_plain(ring, model, t)


def test_an_op_reading_kv_never_written_comes_back_as_a_stage_error_naming_the_segment(fake):
    (t,) = scripts(1, seed=11)
    model = OracleModel([t], max_rows=2)
    ring = fake(model)
    ring.link.send(step_op(model, [m.Segment(1, 0, 2, m.WANT_LAST), m.Segment(0, 3, 2, m.WANT_LAST)],
                           t[0:2] + t[3:5]))
    with pytest.raises(StageError, match="segment 1.*never written"):
        ring.link.recv()
    s = make_stream(0, t, 5, 3)
    list(sched(ring, [s]))
    assert s.tokens == t[5:8]  # the ring is still usable


@pytest.mark.parametrize("segments, n_ids, match", [
    ([m.Segment(0, 0, 2), m.Segment(0, 0, 1)], 3, "once per op"),
    ([m.Segment(5, 0, 1)], 1, "outside"),
    ([m.Segment(0, 0, 2)], 3, "tokens"),
])
def test_a_bad_segment_table_is_refused_by_the_stage(fake, segments, n_ids, match):
    (t,) = scripts(1, seed=13)
    model = OracleModel([t], max_rows=2)
    ring = fake(model)
    ring.link.send(step_op(model, segments, t[:n_ids]))
    with pytest.raises(StageError, match=match):
        ring.link.recv()


def test_a_step_op_over_the_op_budget_is_refused_and_the_ring_stays_usable(fake):
    (t,) = scripts(1, seed=14)
    model = OracleModel([t], max_rows=1)
    ring = fake(model, max_op_tokens=8)
    ring.link.send(step_op(model, [m.Segment(0, 0, 9, m.WANT_LAST)], t[:9]))
    with pytest.raises(StageError, match="9 tokens is over the op budget of 8"):
        ring.link.recv()
    s = make_stream(0, t, 9, 3)
    list(sched(ring, [s], max_step_tokens=8))
    assert s.tokens == t[9:12]


def test_a_segment_whose_table_names_blocks_that_hold_nothing_reads_kv_never_written(fake):
    (t,) = scripts(1, seed=12)
    model = OracleModel([t], max_rows=2)
    ring = fake(model)
    s = make_stream(0, t, 6, 2)
    list(sched(ring, [s]))
    fresh = torch.tensor([model.n_blocks - 1], dtype=torch.int32)  # a block no op wrote
    ring.link.send(m.Message(m.STEP, segments=[m.Segment(0, 6, 1, m.WANT_LAST)], tensors=[torch.tensor(t[6:7]), fresh]))
    with pytest.raises(StageError, match="never written"):
        ring.link.recv()


# ------------------------------------------------------------------------------ random schedules
@st.composite
def schedules(draw):
    n = draw(st.integers(1, 7))
    return dict(
        prompt_lens=draw(st.lists(st.integers(1, 30), min_size=n, max_size=n)),
        max_new=draw(st.lists(st.integers(1, 15), min_size=n, max_size=n)),
        arrive=draw(st.lists(st.integers(0, 25), min_size=n, max_size=n)),  # replies taken before it arrives
        cancel=draw(st.lists(st.one_of(st.none(), st.integers(0, 20)), min_size=n, max_size=n)),
        spec=draw(st.lists(st.integers(0, 3), min_size=n, max_size=n)),  # 0: plain, else its verify chain depth
        max_rows=draw(st.integers(1, 4)), depth=draw(st.integers(1, 4)), prefill_depth=draw(st.integers(1, 4)),
        budget=draw(st.integers(1, 12)), chunk=draw(st.integers(1, 8)))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plan=schedules())
def test_random_arrivals_cancels_and_speculation_keep_every_stream_exact(fake, plan):
    n = len(plan["prompt_lens"])
    ts = scripts(n, length=60, seed=sum(plan["prompt_lens"]))
    for i in range(0, n, 2):  # every other script repeats itself, so n-gram drafts get accepted
        ts[i] = ts[i][:1] + (ts[i][1:6] * 12)[:59]
    ring = fake(OracleModel(ts, max_rows=plan["max_rows"]))
    streams = [make_stream(i, t, p, k) for i, (t, p, k) in enumerate(zip(ts, plan["prompt_lens"], plan["max_new"]))]
    for s, d in zip(streams, plan["spec"]):
        if d:
            s.spec = SpecDecoder(s, NGramDrafter(k=3), d)
    run = Scheduler(ring.link, [], plan["max_rows"], plan["chunk"], plan["prefill_depth"], plan["depth"],
                    plan["budget"], kv=fake_kv(ring.model))
    pending = sorted(range(n), key=lambda i: plan["arrive"][i])
    replies = 0
    while pending or ring.link.in_flight:
        while pending and (plan["arrive"][pending[0]] <= replies or not ring.link.in_flight):
            run.submit(streams[pending.pop(0)])
        if not ring.link.in_flight:
            continue
        run.step()
        replies += 1
        assert run.n_decode_ops <= plan["depth"] and run.n_prefill_ops <= plan["prefill_depth"]
        for i, c in enumerate(plan["cancel"]):
            if c is not None and c == replies:
                run.cancel(i)
    for s, t, p, k, c in zip(streams, ts, plan["prompt_lens"], plan["max_new"], plan["cancel"]):
        assert s.tokens == t[p : p + len(s.tokens)], "a stream committed a token it would not get alone"
        if s.finish_reason != "cancelled":
            assert len(s.tokens) == k and s.finish_reason == "length"
    assert sorted(run.free_rows) == list(range(plan["max_rows"])) and not run.active


# ------------------------------------------------------------------------------------------ logit controls
def test_a_greedy_stream_with_a_logit_control_asks_for_logits_and_a_plain_one_does_not():
    from ringshm.engine.sampling import Sampler
    from ringshm.engine.scheduler import _want

    plain, banned = make_stream(0, [100, 5], 1, 4), make_stream(1, [101, 5], 1, 4)
    banned.sampler = Sampler(logit_bias={5: -100})
    assert _want(plain) == m.WANT_LAST
    assert _want(banned) == m.WANT_LAST | m.WANT_LOGITS
    for kw in ({"presence_penalty": 0.1}, {"frequency_penalty": -0.1}, {"repetition_penalty": 1.1},
               {"min_tokens": 1, "eos_ids": {EOS}}):
        banned.sampler = Sampler(**kw)
        assert _want(banned) & m.WANT_LOGITS, kw


def test_logit_bias_moves_only_its_own_stream_off_the_argmax_in_a_shared_batch(fake):
    from ringshm.engine.sampling import Sampler

    ts = scripts(3, length=20)
    ring = fake(OracleModel(ts, max_rows=3))
    streams = [make_stream(i, t, 5, 6) for i, t in enumerate(ts)]
    banned = ts[1][5]
    streams[1].sampler = Sampler(logit_bias={banned: -100})  # the oracle's logits: 9 at banned + 1
    list(sched(ring, streams, depth=1, max_step_tokens=64))
    assert streams[0].tokens == ts[0][5:11] and streams[2].tokens == ts[2][5:11]
    assert streams[1].tokens[0] == banned + 1 and streams[1].tokens != ts[1][5:11]


def test_min_tokens_masks_eos_from_the_fake_stage_and_ignore_eos_runs_to_the_length_limit(fake):
    from ringshm.engine.sampling import Sampler

    script = [100, 10, 11, EOS, 12, 13, 14, 15]
    ring = fake(OracleModel([script], max_rows=1))
    plain = make_stream(0, script, 2, 6)
    list(sched(ring, [plain]))
    assert plain.tokens == [11, EOS] and plain.finish_reason == "stop"
    masked = make_stream(0, script, 2, 6)
    masked.sampler = Sampler(min_tokens=3, eos_ids={EOS})
    list(sched(ring, [masked]))
    assert masked.tokens[:2] == [11, EOS + 1] and len(masked.tokens) == 6 and masked.finish_reason == "length"
    ignoring = make_stream(0, script, 2, 6)
    ignoring.ignore_eos = True
    list(sched(ring, [ignoring]))
    assert ignoring.tokens == script[2:8] and ignoring.finish_reason == "length"
