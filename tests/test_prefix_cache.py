"""KV in blocks and the prefix cache through the scheduler, over the fake oracle ring (issue 22). The oracle's KV
is paged as a real stage's (tests/fake_stage.py): a stream's context is what the blocks its table names hold, so
a cached block attached one position off, a block shared while written, or a preempted stream resumed wrong
shows up as a WRONG token. Every stream must give its scripted continuation, the same tokens the cache off
gives, through hits of 1 block to the whole prompt, evictions, preemption and speculation.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from fake_stage import EOS, OracleModel, make_stream, start_fake_ring
from ringshm.engine.kv_blocks import KVBlocks
from ringshm.engine.scheduler import Scheduler
from ringshm.engine.spec import NGramDrafter
from ringshm.engine.spec_decode import SpecDecoder

B = 16  # the fake stage's block size (fake_stage.BLOCK)


def script(first: int, length: int = 400, seed: int = 0) -> list[int]:
    """A token sequence (no EOS) whose first token names it to the oracle."""
    rng = random.Random(seed * 1000 + first)
    return [first] + [rng.randrange(10, 1000) for _ in range(length - 1)]


@pytest.fixture
def ring():
    rings = []

    def start(max_rows: int = 4, n_blocks: int | None = None, scripts=()):
        rings.append(start_fake_ring(OracleModel(list(scripts), max_rows, max_seq_len=1024, n_blocks=n_blocks)))
        return rings[-1]

    yield start
    for r in rings:
        r.close()


def run(ring, kv: KVBlocks, streams, prefix_cache: bool = True, max_rows: int = 4, depth: int = 1,
        chunk: int = 8) -> Scheduler:
    s = Scheduler(ring.link, streams, max_rows, chunk, 8, depth, chunk, kv=kv, prefix_cache=prefix_cache)
    list(s)
    kv.check()
    return s


def test_a_repeated_prompt_hits_every_full_block_but_the_last_tokens_own_and_gives_the_same_tokens(ring):
    t = script(100)
    r = ring(scripts=[t])
    kv = KVBlocks(r.model.n_blocks, B, b"fake")
    for n_prompt, cached in ((40, 0), (40, 32), (48, 32), (49, 48), (17, 16), (16, 0), (100, 48)):
        s = make_stream(0, t, n_prompt, 5)
        run(r, kv, [s])
        assert s.tokens == t[n_prompt:n_prompt + 5] and s.cached_tokens == cached, (n_prompt, s.cached_tokens)
    assert kv.stats().hit_tokens == 32 + 32 + 48 + 16 + 48


def test_a_whole_earlier_stream_prompt_plus_output_is_a_hit_for_a_follow_up_turn(ring):
    t = script(101)
    r = ring(scripts=[t])
    kv = KVBlocks(r.model.n_blocks, B, b"fake")
    first = make_stream(0, t, 30, 40)  # its prompt and output fill positions 0 .. 69
    run(r, kv, [first])
    turn2 = make_stream(1, t, 90, 6)  # the whole first turn resent, plus 20 more tokens
    run(r, kv, [turn2])
    assert turn2.tokens == t[90:96] and turn2.cached_tokens == 64  # 4 full blocks of the first turn


def test_the_cache_off_computes_everything_and_gives_the_same_tokens(ring):
    t = script(102)
    r = ring(scripts=[t])
    kv = KVBlocks(r.model.n_blocks, B, b"fake")
    for n in (40, 40, 65):
        s = make_stream(0, t, n, 7)
        run(r, kv, [s], prefix_cache=False)
        assert s.tokens == t[n:n + 7] and s.cached_tokens == 0
    assert kv.stats().hit_tokens == 0 and kv.stats().n_cached == 0


def test_a_salted_request_never_hits_another_salts_chain(ring):
    t = script(103)
    r = ring(scripts=[t])
    kv = KVBlocks(r.model.n_blocks, B, b"fake")
    for salt, cached in (("tenant-a", 0), ("tenant-b", 0), ("tenant-a", 32), (None, 0), (None, 32)):
        s = make_stream(0, t, 40, 3)
        s.cache_salt = salt
        run(r, kv, [s])
        assert s.tokens == t[40:43] and s.cached_tokens == cached, salt


def test_the_same_tokens_after_another_prefix_are_another_block(ring):
    """A block is named by its whole prefix: a prompt whose first block holds the tokens of another prompt's
    second block must not attach it (its KV was computed after other tokens, at other positions)."""
    a = script(105)
    b = a[B:2 * B] + script(a[B], length=200, seed=1)[1:]  # starts with a's second block
    assert b[0] != a[0]
    r = ring(scripts=[a, b])
    kv = KVBlocks(r.model.n_blocks, B, b"fake")
    first = make_stream(0, a, 40, 3)
    run(r, kv, [first])
    second = make_stream(1, b, 40, 5)
    run(r, kv, [second])
    assert first.tokens == a[40:43]
    assert second.tokens == b[40:45]  # attached a's block: its context is wrong, so are its tokens
    assert second.cached_tokens == 0


def test_streams_sharing_a_prefix_arrive_while_the_first_is_still_filling_it(ring):
    """A newcomer hits only blocks whose KV a completed op wrote; a block another live stream is still filling
    is computed again, never shared while written."""
    t = script(104, length=600)
    r = ring(scripts=[t], max_rows=4)
    kv = KVBlocks(r.model.n_blocks, B, b"fake")
    sch = Scheduler(r.link, [], 4, 8, 8, 1, 8, kv=kv)
    streams = [make_stream(i, t, 120 + 7 * i, 20) for i in range(4)]
    sch.submit(streams[0])
    events = 0
    for s in streams[1:]:
        for _ in range(3):  # a few replies between arrivals: the first prompt is partly prefilled
            events += len(sch.step())
        sch.submit(s)
        kv.check()
    while r.link.in_flight:
        sch.step()
        kv.check()
    for s in streams:
        n = len(s.prompt)
        assert s.tokens == t[n:n + 20]
    assert any(s.cached_tokens for s in streams[1:]) and kv.stats().n_used == 0


def test_a_tiny_pool_evicts_and_preempts_and_every_stream_stays_exact(ring):
    ts = [script(110 + i, length=300) for i in range(4)]
    r = ring(scripts=ts, max_rows=4, n_blocks=14)  # 224 positions for 4 streams of ~60-100
    kv = KVBlocks(14, B, b"fake")
    preemptions = queried = cached = 0
    for first in (0, 2, 0):  # the second round evicts the first's cached blocks; the third hits what is left
        streams = [make_stream(i, ts[first + i % 2], 30 + 5 * i, 40) for i in range(4)]
        preemptions += run(r, kv, streams, depth=4).stats.preemptions
        for s in streams:
            n = len(s.prompt)
            assert s.tokens == ts[first + s.index % 2][n:n + 40], (first, s.index, s.n_preemptions)
        queried += sum(len(s.prompt) for s in streams)
        cached += sum(s.cached_tokens for s in streams)
    assert preemptions > 0 and kv.stats().evictions > 0
    # The counters are what clients see: a preempted stream's return is not a second query.
    assert (kv.stats().query_tokens, kv.stats().hit_tokens) == (queried, cached)


def test_speculative_streams_share_prefixes_and_stay_exact(ring):
    base = script(120, length=200)
    t = base[:100] + base[20:100] + base[20:120]  # repetitive: the n-gram drafter proposes, some accepted
    r = ring(scripts=[t])
    kv = KVBlocks(r.model.n_blocks, B, b"fake")
    for n in (110, 118, 150):
        s = make_stream(0, t, n, 40)
        s.spec = SpecDecoder(s, NGramDrafter(4, 3), 2)
        run(r, kv, [s], depth=2)
        assert s.tokens == t[n:n + 40] and s.spec.stats.accepted_tokens > 0
    assert kv.stats().hit_tokens > 0


def test_an_eos_ended_stream_releases_its_blocks_and_its_prefix_serves_the_next(ring):
    t = script(130, length=80)
    t[50] = EOS
    r = ring(scripts=[t])
    kv = KVBlocks(r.model.n_blocks, B, b"fake")
    s = make_stream(0, t, 40, 30)
    run(r, kv, [s])
    assert s.tokens == t[40:51] and s.finish_reason == "stop" and kv.stats().n_used == 0
    again = make_stream(1, t, 45, 3)
    run(r, kv, [again])
    assert again.tokens == t[45:48] and again.cached_tokens == 32


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_arrivals_lengths_and_cancels_in_a_tiny_pool_keep_every_stream_exact(data):
    """Streams on two scripts (so prompts share prefixes) arrive at random steps with random prompt and output
    lengths, some are cancelled, some speculate, in a pool of 8-16 blocks (evictions and preemptions). After
    every reply the pool's invariants hold (no leak, no shared block written: ``KVBlocks.check``); at the end
    every stream that ran to its end gave its script's continuation, every cancelled one a prefix of it, and
    every block is back (free or cached)."""
    ts = [script(140, length=300, seed=1), script(141, length=300, seed=2)]
    n_blocks = data.draw(st.integers(8, 16), label="n_blocks")
    max_rows = data.draw(st.integers(1, 4), label="max_rows")
    plans = data.draw(st.lists(st.tuples(st.integers(0, 1), st.integers(1, 90), st.integers(1, 30),
                                         st.integers(0, 12), st.one_of(st.none(), st.integers(0, 20)), st.booleans()),
                               min_size=1, max_size=8), label="streams")
    r = start_fake_ring(OracleModel(ts, max_rows, max_seq_len=1024, n_blocks=n_blocks))
    try:
        kv = KVBlocks(n_blocks, B, b"fake")
        streams = []
        for i, (which, n_prompt, n_new, _, _, spec) in enumerate(plans):
            s = make_stream(i, ts[which], n_prompt, n_new)
            if spec:
                s.spec = SpecDecoder(s, NGramDrafter(4, 3), 2)
            streams.append(s)
        sch = Scheduler(r.link, [], max_rows, 8, 4, 2, 24, kv=kv)
        step = 0
        while True:
            for s, (_, _, _, arrive, cancel, _) in zip(streams, plans):
                if arrive == step:
                    sch.submit(s)
                if cancel is not None and arrive + cancel == step:
                    sch.cancel(s.index)
            if r.link.in_flight:
                sch.step()
            elif step > max(p[3] + (p[4] or 0) for p in plans):
                break
            kv.check()
            step += 1
        kv.check()
        assert kv.stats().n_used == 0, "a block is still named by a table after every stream ended"
        for s, (which, n_prompt, n_new, _, _, _) in zip(streams, plans):
            want = ts[which][n_prompt:n_prompt + n_new]
            if s.finish_reason == "cancelled":
                assert s.tokens == want[:len(s.tokens)], s.index
            else:
                assert s.tokens == want, (s.index, s.n_preemptions, s.cached_tokens)
        event(f"preempted: {sum(s.n_preemptions > 0 for s in streams) > 0}")
        event(f"hit: {kv.stats().hit_tokens > 0}")
    finally:
        r.close()
