"""The prefix cache and KV blocks on the real model (issue 22): with the cache on, every stream gives the bytes
it gives with the cache off (token ids, and the logprob bits of sampled streams), at 1 and 3 stages, across hits
of one block to a whole earlier turn, inside a batch, after evictions and preemptions in a tiny pool, and with
speculation. The reference is a 3-stage engine with the cache off and 64-position blocks (the others use 32).
"""

from __future__ import annotations

import pytest

from conftest import own_segments
from ringshm.engine.engine import Engine

SYSTEM = ("You are a careful assistant for a lighthouse museum. Answer in one or two sentences, plainly, and say "
          "when you do not know. The museum opens at nine, closes at five, and the lamp room is closed in winter. ")
QUESTIONS = ["When does the museum open?", "Can I visit the lamp room in January?", "Who built the lighthouse?",
             "Is there a cafe?"]
KW = dict(max_rows=4, max_seq_len=512, prefill_chunk=48, progress=False)
N_NEW = 24
GEN = dict(ignore_eos=True)  # every stream runs N_NEW tokens (raw prompts often end at once)


@pytest.fixture(scope="module")
def reference():
    """Another block size than the engines under test: the bits do not depend on it either."""
    with Engine(stages=3, prefix_cache=False, block_size=64, **KW) as engine:
        yield engine


@pytest.fixture(scope="module", params=[1, 3], ids=["1 stage", "3 stages"])
def cached(request):
    with Engine(stages=request.param, **KW) as engine:
        yield engine


@pytest.fixture(scope="module")
def tiny():
    """3 stages and a KV pool of 8 blocks of 32 (256 positions) for 4 streams of ~200: evictions and
    preemptions."""
    with Engine(stages=3, block_size=32, kv_cache_memory=8 * 32 * 30 * 2 * 192 * 2 / 2**30, **KW) as engine:
        assert engine.n_blocks == 8
        yield engine


def _requests(engine) -> list[list[int]]:
    """Prompts sharing SYSTEM, as token ids: one per question, and a second turn resending the first."""
    first = [engine.encode(SYSTEM + q) for q in QUESTIONS]
    return first + [first[0] + engine.encode(" It opens at nine. And when does it close?")]


def _bits(result):
    return result.token_ids, [(lp.token_id, lp.logprob, lp.top) for lp in result.logprobs or []]


@pytest.fixture(scope="module")
def want(reference):
    prompts = _requests(reference)
    greedy = [_bits(reference.generate(p, N_NEW, **GEN, logprobs=2)) for p in prompts]
    sampled = [_bits(reference.generate(p, N_NEW, **GEN, temperature=0.8, seed=7, logprobs=2)) for p in prompts]
    # generate_batch samples stream i with seed + i: each alone with its own seed
    batch = [_bits(reference.generate(p, N_NEW, **GEN, temperature=0.8, seed=7 + i, logprobs=2))
             for i, p in enumerate(prompts)]
    return prompts, greedy, sampled, batch


def test_one_request_after_another_hits_the_shared_prefix_and_gives_the_same_bytes(cached, want):
    prompts, greedy, sampled, _ = want
    for i, p in enumerate(prompts):
        r = cached.generate(p, N_NEW, **GEN, logprobs=2)
        assert _bits(r) == greedy[i], f"greedy request {i}"
        assert (r.n_cached_tokens > 0) == (i > 0), (i, r.n_cached_tokens)
        assert r.n_cached_tokens % cached.config.block_size == 0 and r.n_cached_tokens < len(p)
    for i, p in enumerate(prompts):  # every prompt is cached now, up to its last block
        r = cached.generate(p, N_NEW, **GEN, temperature=0.8, seed=7, logprobs=2)
        assert _bits(r) == sampled[i], f"sampled request {i}"
        assert r.n_cached_tokens >= len(p) - cached.config.block_size


def test_the_tokens_of_a_cached_block_after_another_prefix_are_not_attached(cached, reference):
    """A block is named by its whole prefix: a prompt that begins with the tokens of another prompt's second
    block gets none of its KV (computed after other tokens, at other positions), and its own bytes."""
    bs = cached.config.block_size
    first = cached.encode(SYSTEM * 2)[:3 * bs]
    second = first[bs:2 * bs] + cached.encode(" And is there a cafe?")
    cached.generate(first, 2, **GEN)  # caches first's blocks 0 and 1
    r = cached.generate(second, N_NEW, **GEN, logprobs=2)
    assert _bits(r) == _bits(reference.generate(second, N_NEW, **GEN, logprobs=2))
    assert r.n_cached_tokens == 0


def test_a_batch_sharing_a_prefix_gives_each_stream_its_solo_bytes(cached, want):
    prompts, greedy, _, _ = want
    out = cached.generate_batch(prompts, N_NEW, **GEN, logprobs=2)
    assert [_bits(r) for r in out.results] == greedy
    assert out.steps.peak_rows == 4  # max_rows: the fifth waited for a row


def test_a_tiny_pool_evicts_and_preempts_and_every_stream_keeps_its_bytes(tiny, want):
    prompts, greedy, _, sampled = want
    out = tiny.generate_batch(prompts, N_NEW, **GEN, logprobs=2)
    assert [_bits(r) for r in out.results] == greedy
    assert out.steps.preemptions > 0 and tiny.kv.stats().evictions > 0
    out = tiny.generate_batch(prompts, N_NEW, **GEN, temperature=0.8, seed=7, logprobs=2)
    assert [_bits(r) for r in out.results] == sampled


def test_speculative_streams_hit_the_cache_and_decode_the_same_tokens(cached, want):
    prompts, greedy, _, _ = want
    for i in (0, 4):
        r = cached.generate(prompts[i], N_NEW, **GEN, spec="ngram", spec_k=4)
        assert r.token_ids == greedy[i][0]
    assert cached.kv.stats().hit_tokens > 0


def test_a_request_longer_than_the_pool_is_refused_up_front_saying_how_many_tokens_it_holds(tiny):
    """max_seq_len (512 asked) is lowered to what the pool holds, so the server's max_model_len and chat's default
    max_tokens (the rest of the context) always fit."""
    assert tiny.max_seq_len == 256
    with pytest.raises(ValueError, match=r"exceeds max_seq_len 256, all the KV cache holds \(8 blocks of 32 "
                                         r"positions\).*--kv-cache-memory"):
        tiny.generate(list(range(10, 260)), 100)  # 350 positions: within the 512 asked, over the pool
    r = tiny.generate(list(range(10, 250)), 16)  # 256 positions: the whole pool
    assert len(r.token_ids) == 16


def test_a_cache_salt_that_is_not_a_string_is_refused(cached):
    with pytest.raises(ValueError, match="cache_salt"):
        cached.generate("Hi", 2, cache_salt=3)


@pytest.mark.parametrize("kw, match", [(dict(kv_cache_memory=1e-6), "holds no KV block.*at least 0.0007 GiB"),
                                       (dict(kv_cache_memory=0.0027, block_size=128), "at least 0.0028 GiB"),
                                       (dict(kv_cache_memory=0), "kv_cache_memory must be"),
                                       (dict(kv_cache_memory=True), "kv_cache_memory must be"),
                                       (dict(kv_cache_memory=1e308), r"in \(0, 1048576\], got 1e\+308"),
                                       (dict(block_size=16), "block_size must be 32, 64 or 128"),
                                       (dict(kv_cache_dtype="fp8"), "kv_cache_dtype must be one of"),
                                       (dict(prefix_cache="yes"), "prefix_cache must be")])
def test_bad_kv_settings_are_refused_before_any_stage_starts(kw, match):
    before = own_segments()
    with pytest.raises(ValueError, match=match):
        Engine(stages=3, progress=False, **kw)
    assert own_segments() == before
