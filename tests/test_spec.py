"""Speculative decoding (issue 6): the n-gram drafter, the accept rule, and verify chains over the fake oracle
ring, where losslessness is an exact equality with the script."""

from __future__ import annotations

import random

import pytest

from fake_stage import EOS, RecordingModel, fake_kv, make_stream, start_fake_ring
from ringshm.engine.scheduler import Scheduler
from ringshm.engine.spec import NGramDrafter, SpecStats, accept
from ringshm.engine.spec_decode import SpecDecoder


# ------------------------------------------------------------------------------------------ pure logic
def test_drafter_proposes_what_followed_the_latest_earlier_occurrence_of_the_longest_suffix():
    d = NGramDrafter(k=3, ngram_max=3)
    d.extend([5, 6, 7, 8, 1, 6, 7, 9, 4, 6, 7])
    assert d.propose() == [9, 4, 6]  # suffix [6, 7]: latest earlier occurrence ends at index 7
    assert d.propose([9]) == [4, 6, 7]  # with an unverified tail [9]: suffix [6, 7, 9]


def test_drafter_proposes_nothing_without_a_repeat_and_prefers_longer_ngrams():
    d = NGramDrafter(k=2, ngram_max=2)
    d.extend([1, 2, 3])
    assert d.propose() == []
    d.extend([9, 3, 7, 2, 3])  # [2, 3] occurred at 1..2 (then 9); [3] most recently at 4 (then 7)
    assert d.propose() == [9, 3]


def test_drafter_rejects_bad_sizes():
    with pytest.raises(ValueError, match="spec_k"):
        NGramDrafter(k=0)
    with pytest.raises(ValueError, match="ngram"):
        NGramDrafter(k=2, ngram_max=1, ngram_min=2)


@pytest.mark.parametrize("drafts, ids, want", [
    ([3, 4, 5], [3, 4, 5, 6], [3, 4, 5, 6]),  # full accept + bonus
    ([3, 4, 5], [3, 9, 5, 6], [3, 9]),  # rejection at the second draft: its correction
    ([3], [8, 3], [8]),  # first draft wrong
    ([], [7], [7]),  # no drafts: a plain decode step
])
def test_accept_commits_the_argmax_up_to_and_including_the_first_mismatch(drafts, ids, want):
    assert accept(drafts, ids) == want


def test_accept_checks_lengths():
    with pytest.raises(ValueError):
        accept([1, 2], [1, 2])


# -------------------------------------------------------------------------------- over the fake ring
class WrongDrafter(NGramDrafter):
    """Always proposes tokens the oracle never gives (so every verify rejects at the first draft)."""

    def propose(self, tail=()):
        return [1] * self.k


def repeating_script(first: int, period: int, length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    pattern = [rng.randrange(10, 1000) for _ in range(period)]
    return [first] + (pattern * (length // period + 1))[: length - 1]


@pytest.fixture
def fake():
    rings = []

    def start(model):
        rings.append(start_fake_ring(model))
        return rings[-1]

    yield start
    for r in rings:
        r.close()


def run_spec(ring, stream, drafter, depth):
    stream.spec = dec = SpecDecoder(stream, drafter, depth)
    list(Scheduler(ring.link, [stream], 1, 8, 8, depth, 8, kv=fake_kv(ring.model)))
    assert ring.link.in_flight == 0 and not dec.in_flight
    return dec.stats


@pytest.mark.parametrize("depth", [1, 2, 4])
def test_perfect_drafts_commit_several_tokens_per_verify_and_equal_the_script(fake, depth):
    t = repeating_script(100, 7, 120, seed=1)
    ring = fake(RecordingModel([t], max_rows=1))
    s = make_stream(0, t, 20, 60, row=0)
    stats = run_spec(ring, s, NGramDrafter(k=4), depth)
    assert s.tokens == t[20:80]
    assert stats.acceptance_rate == 1.0
    assert stats.mean_accepted_length > 4.5  # 4 drafts + the bonus per step (the last step may be shorter)
    assert stats.verify_steps <= 60 // 5 + 2


@pytest.mark.parametrize("depth", [1, 3])
def test_always_wrong_drafts_still_give_exactly_the_script(fake, depth):
    t = repeating_script(100, 50, 120, seed=2)
    ring = fake(RecordingModel([t], max_rows=1))
    s = make_stream(0, t, 10, 30, row=0)
    stats = run_spec(ring, s, WrongDrafter(k=3), depth)
    assert s.tokens == t[10:40]
    assert stats.accepted_tokens == 0 and stats.mean_accepted_length == 1.0


def test_a_rejection_in_a_pipelined_window_drops_the_stale_ops_and_stays_exact(fake):
    t = repeating_script(100, 6, 140, seed=3)
    for i in (40, 41, 70, 97):  # break the pattern: drafts built on it are rejected mid-window
        t[i] = 999
    ring = fake(RecordingModel([t], max_rows=1))
    s = make_stream(0, t, 18, 100, row=0)
    stats = run_spec(ring, s, NGramDrafter(k=3), depth=4)
    assert s.tokens == t[18:118]
    assert 0 < stats.acceptance_rate < 1
    sent = [op for op in ring.model.frames if op[0][1] >= 18]
    committed_steps = stats.verify_steps
    assert len(sent) > committed_steps + 1, "no op was discarded: the window never held a stale op"


def test_stale_replies_are_recognised_by_epoch_and_never_committed(fake):
    t = repeating_script(100, 5, 100, seed=4)
    t[33] = 998
    ring = fake(RecordingModel([t], max_rows=1))
    s = make_stream(0, t, 15, 40)
    epochs_answered = []
    real = SpecDecoder.on_reply

    def spy(self, ids, tag):
        epochs_answered.append((tag.epoch, self.epoch))
        return real(self, ids, tag)

    SpecDecoder.on_reply = spy
    try:
        run_spec(ring, s, NGramDrafter(k=3), depth=3)
    finally:
        SpecDecoder.on_reply = real
    assert s.tokens == t[15:55]
    assert any(sent < now for sent, now in epochs_answered), "the rejection at 33 must leave stale replies"


def test_eos_inside_an_accepted_run_ends_the_stream_at_eos(fake):
    t = repeating_script(100, 4, 80, seed=5)
    t[30] = EOS  # lands inside a run of perfectly drafted tokens
    ring = fake(RecordingModel([t], max_rows=1))
    s = make_stream(0, t, 16, 50, row=0)
    run_spec(ring, s, NGramDrafter(k=6), depth=2)
    assert s.tokens == t[16:31] and s.tokens[-1] == EOS and s.finish_reason == "stop"


@pytest.mark.parametrize("max_new", [1, 2, 7, 13])
def test_max_new_tokens_landing_inside_a_run_stops_exactly_there(fake, max_new):
    t = repeating_script(100, 3, 80, seed=6)
    ring = fake(RecordingModel([t], max_rows=1))
    s = make_stream(0, t, 12, max_new, row=0)
    run_spec(ring, s, NGramDrafter(k=5), depth=3)
    assert s.tokens == t[12 : 12 + max_new] and s.finish_reason == "length"


def test_streams_sharing_step_ops_each_speculate_with_their_own_drafter_and_stay_exact(fake):
    ts = [repeating_script(100 + i, 5 + i, 120, seed=10 + i) for i in range(3)]
    ts[1][50] = 997
    ring = fake(RecordingModel(ts, max_rows=2))  # 3 streams, 2 rows: one queues
    streams = [make_stream(i, t, 14, 40) for i, t in enumerate(ts)]
    for s in streams:
        s.spec = SpecDecoder(s, NGramDrafter(k=4), depth=2)
    run = Scheduler(ring.link, streams, 2, 8, 8, 2, 8, kv=fake_kv(ring.model))
    list(run)
    assert run.stats.multi_segment_ops > 0
    assert [s.tokens for s in streams] == [t[14:54] for t in ts]
    total = SpecStats()
    for s in streams:
        total.add(s.spec.stats)
    assert total.mean_accepted_length > 2
