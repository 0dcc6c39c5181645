"""Long prompts interleaved with decodes (issue 31): ``PrefillBudget``'s arithmetic, and the scheduler over the
fake oracle ring keeping a long prompt's chunks in flight within the budget while another stream decodes, short
prompts not held, every stream's tokens exact. Runs in seconds."""

from __future__ import annotations

import pytest

from fake_stage import RecordingModel, fake_kv, make_stream, start_fake_ring
from ringshm.engine.prefill_budget import MIN_TOKENS, PrefillBudget
from ringshm.engine.scheduler import Scheduler
from ringshm.engine.step_reply import StepTag
from test_scheduler import scripts

CHUNK = 4  # prefill_chunk: a prompt with more than 4 tokens to compute is long
BUDGET = 4  # the long-prompt tokens allowed in flight in the scheduler tests: one chunk


def _replied(budget: PrefillBudget, rtt_s: float, loaded: bool, decode: bool = True) -> None:
    """One op through ``budget``: sent (with long-prompt tokens in flight or not), answered ``rtt_s`` later."""
    tag = StepTag(kinds=[1] if decode else [0])
    budget.on_send(tag, loaded)
    tag.t_sent -= rtt_s  # as if sent rtt_s ago
    budget.on_reply(tag)


def test_the_budget_starts_at_the_minimum_and_waits_for_a_quiet_round_trip():
    b = PrefillBudget(2.0, max_tokens=256)
    assert b.tokens() == MIN_TOKENS
    _replied(b, 0.010, loaded=True)  # fast, but nothing to compare it with yet
    assert b.tokens() == MIN_TOKENS and b.t_quiet_s is None


def test_the_budget_grows_while_loaded_decodes_stay_within_the_ratio_and_shrinks_past_it():
    b = PrefillBudget(2.0, max_tokens=256)
    _replied(b, 0.030, loaded=False)
    assert b.t_quiet_s == pytest.approx(0.030, rel=0.05)
    for _ in range(30):  # 1.5 x a quiet round trip: under the target, so the budget grows to its ceiling
        _replied(b, 0.045, loaded=True)
    assert b.tokens() == 256
    for _ in range(60):  # 4 x: over it, so it shrinks to the floor
        _replied(b, 0.120, loaded=True)
    assert b.tokens() == MIN_TOKENS


def test_only_decode_bearing_round_trips_steer_the_budget():
    b = PrefillBudget(2.0, max_tokens=256)
    _replied(b, 0.030, loaded=False)
    for _ in range(10):
        _replied(b, 0.001, loaded=True, decode=False)  # a prefill-only op: no decoding stream waits on it
    assert b.tokens() == MIN_TOKENS and b.t_loaded_s is None


@pytest.mark.parametrize("ratio", [0, 1, 1.0, -2, float("nan")])
def test_a_stall_ratio_that_is_not_above_1_is_refused(ratio):
    with pytest.raises(ValueError, match="stall_ratio must be > 1"):
        PrefillBudget(ratio, max_tokens=256)


def _long_prompt_beside_a_decode(stall_ratio):
    """Stream 0 (3-token prompt) decodes; after its first token a long prompt (stream 1, 40 tokens) and a short
    one (stream 2, 4 tokens, submitted after it) arrive. Returns (streams, scripts, the most tokens of stream 1
    in flight seen after any send while stream 0 decoded, the index of the first op carrying stream 2, every op's
    segments as the stage applied them)."""
    ts = scripts(3)
    ring = start_fake_ring(RecordingModel(ts, max_rows=4))
    try:
        run = Scheduler(ring.link, [], 4, CHUNK, 8, 1, 64, kv=fake_kv(ring.model), prefill_stall_ratio=stall_ratio)
        if run.prefill_budget is not None:
            run.prefill_budget.tokens = lambda: BUDGET  # a fixed budget: the scheduler's side alone is tested here
        streams = [make_stream(0, ts[0], 3, 30), make_stream(1, ts[1], 40, 6), make_stream(2, ts[2], 4, 6)]
        peak = 0
        fill = run._fill

        def checked_fill():
            nonlocal peak
            fill()
            if streams[0].decoding:
                peak = max(peak, streams[1].n_prefilled - streams[1].n_prefill_done)

        run._fill = checked_fill
        run.submit(streams[0])
        while not streams[0].tokens:
            run.step()
        run.submit(streams[1])  # its first chunk takes the whole budget
        run.submit(streams[2])  # and this one comes while that chunk is in flight
        while run.link.in_flight or run.waiting:
            run.step()
        frames = ring.model.frames
        first_short = next(i for i, op in enumerate(frames) if any(row == streams[2].row for row, _, _ in op))
        return streams, ts, peak, first_short, frames
    finally:
        ring.close()


def test_a_long_prompt_keeps_its_chunks_in_flight_within_the_budget_while_a_stream_decodes():
    streams, ts, peak, _, _ = _long_prompt_beside_a_decode(2.0)
    assert 0 < peak <= BUDGET
    for s, t, n in zip(streams, ts, (3, 40, 4)):  # every stream exact, whatever the chunking
        assert s.tokens == t[n: n + s.max_new_tokens]


def test_without_a_stall_ratio_a_long_prompt_fills_the_prefill_window_ahead_of_the_decodes():
    streams, ts, peak, _, _ = _long_prompt_beside_a_decode(None)
    assert peak > BUDGET  # the contrast that makes the test above mean something: 8 ops of 4 tokens can queue
    for s, t, n in zip(streams, ts, (3, 40, 4)):
        assert s.tokens == t[n: n + s.max_new_tokens]


def test_a_short_prompt_is_not_held_behind_a_throttled_long_one():
    streams, _, _, first_short, frames = _long_prompt_beside_a_decode(2.0)
    long_row = streams[1].row
    long_ops = [i for i, op in enumerate(frames) if any(row == long_row for row, _, _ in op)]
    # the short prompt came while the long one's first chunk held the whole budget: it went out at once, in the
    # next op, not after that chunk's reply
    assert first_short == long_ops[0] + 1 and len(long_ops) > 2, (first_short, long_ops)


def test_the_engine_budget_applies_to_served_requests_only():
    """``Engine.scheduler(serving=True)`` (AsyncEngine) gets the configured ratio; a batch prefills at full
    speed."""
    from ringshm.engine.engine import Engine

    class Cfg:
        max_rows, prefill_chunk, prefill_depth, prefix_cache, prefill_stall_ratio, step_tokens = 4, 4, 8, True, 2.0, 4

    ts = scripts(1)
    ring = start_fake_ring(RecordingModel(ts, max_rows=4))
    try:
        eng = Engine.__new__(Engine)
        eng._link, eng.config, eng.depth, eng._job, eng.kv = ring.link, Cfg(), 1, 0, fake_kv(ring.model)
        eng.rows_per_op = None
        eng._group = type("G", (), {"ended": None})()
        assert eng.scheduler(serving=True).prefill_budget.stall_ratio == 2.0
        assert eng.scheduler().prefill_budget is None
    finally:
        ring.close()


def test_the_budget_steers_from_real_round_trips_through_the_fake_ring():
    """A long prompt beside a decoding stream through the fake ring: quiet and loaded round trips are measured,
    and every stream stays exact."""
    ts = scripts(2, length=120)
    ring = start_fake_ring(RecordingModel(ts, max_rows=4))
    try:
        run = Scheduler(ring.link, [], 4, CHUNK, 8, 1, 64, kv=fake_kv(ring.model), prefill_stall_ratio=2.0)
        a, b = make_stream(0, ts[0], 3, 60), make_stream(1, ts[1], 60, 4)
        run.submit(a)
        while len(a.tokens) < 5:
            run.step()
        run.submit(b)
        while run.link.in_flight or run.waiting:
            run.step()
        assert run.prefill_budget.t_quiet_s is not None and run.prefill_budget.t_loaded_s is not None
        assert a.tokens == ts[0][3:63] and b.tokens == ts[1][60:64]
    finally:
        ring.close()
