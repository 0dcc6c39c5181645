"""KV blocks and the prefix cache (issue 22), the coordinator's bookkeeping alone: hits and their cap, salts,
eviction order, what may and may not be cached (kv_valid, speculative drafts), reference counts, failures that
change nothing; then a hypothesis state machine over arrivals, prefill chunks, decodes, verifies with
rollbacks, cancels and preemptions on a tiny pool, checking after every step that each stream's table names,
at every valid position, a block whose recorded content is exactly what recomputation would write there.
Runs in seconds, no torch."""

from __future__ import annotations

import hashlib
import struct

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from ringshm.engine.kv_blocks import KVBlocks

BS = 4
FP = b"test-model"


def prefilled(kv: KVBlocks, sid: int, prompt: list[int], salt: str | None = None) -> int:
    """Admit a stream and complete its whole prefill (kv_valid = len(prompt)); returns its cached tokens."""
    n_cached = kv.admit(sid, prompt, salt)
    assert n_cached is not None
    kv.commit(sid, prompt, len(prompt))
    kv.check()
    return n_cached


def seq(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


# ------------------------------------------------------------------------------------------------ hits
@pytest.mark.parametrize("n", range(1, 18))
def test_a_repeated_prompt_hits_every_full_block_before_its_last_token(n):
    kv = KVBlocks(16, BS, FP)
    assert prefilled(kv, 0, seq(100, n)) == 0
    assert kv.admit(1, seq(100, n)) == (n - 1) // BS * BS  # exactly k blocks of tokens: k - 1 blocks hit
    kv.check()


def test_a_prompt_of_exactly_k_blocks_hits_k_minus_1_and_computes_its_last_block_itself():
    kv = KVBlocks(16, BS, FP)
    prefilled(kv, 0, seq(0, 3 * BS))
    assert kv.admit(1, seq(0, 3 * BS)) == 2 * BS
    a, b = kv.table(0), kv.table(1)
    assert b[:2] == a[:2] and b[2] != a[2]  # the last token's block is the stream's own
    assert kv.kv_valid(1) == 2 * BS


def test_a_shared_first_block_hits_one_block_and_a_different_one_hits_none():
    kv = KVBlocks(16, BS, FP)
    prefilled(kv, 0, seq(0, 2 * BS + 1))
    assert kv.admit(1, seq(0, BS) + [7, 7, 7, 7, 7]) == BS
    assert kv.admit(2, [99] + seq(1, 2 * BS)) == 0
    assert kv.admit(3, seq(0, 2 * BS) + [5]) == 2 * BS  # the whole (capped) prompt
    s = kv.stats()
    assert (s.query_tokens, s.hit_tokens) == (4 * (2 * BS + 1), 3 * BS)


def test_the_same_block_after_another_prefix_does_not_hit():
    kv = KVBlocks(16, BS, FP)
    prefilled(kv, 0, [1] * BS + seq(50, BS) + [0])
    prefilled(kv, 1, [2] * BS + [0])  # [2,2,2,2] cached as block 0 of another chain
    assert kv.admit(2, [2] * BS + seq(50, BS) + [0]) == BS  # block 1's tokens match stream 0's, its parent not


def test_the_same_prompt_under_another_salt_never_hits():
    kv = KVBlocks(32, BS, FP)
    prompt = seq(0, 3 * BS)
    salts = [None, "", "tenant-a", "tenant-b"]
    for i, salt in enumerate(salts):
        assert prefilled(kv, i, prompt, salt) == 0
    for i, salt in enumerate(salts):
        assert kv.admit(10 + i, prompt, salt) == 2 * BS
        assert kv.table(10 + i)[:2] == kv.table(i)[:2]


def test_a_pool_of_another_model_fingerprint_names_blocks_otherwise():
    a, b = KVBlocks(8, BS, b"model-a"), KVBlocks(8, BS, b"model-b")
    prefilled(a, 0, seq(0, BS + 1))
    prefilled(b, 0, seq(0, BS + 1))
    assert set(a._index).isdisjoint(b._index)


def test_block_hashes_follow_the_documented_encoding():
    """h_-1 = BLAKE2b-256(u64 len, fingerprint, 1, u64 len, salt), h_0 = BLAKE2b-256(h_-1, int64 LE ids):
    fixed bytes, so every process (whatever PYTHONHASHSEED) names a block alike."""
    kv = KVBlocks(8, BS, FP)
    prefilled(kv, 0, seq(7, BS + 1), "s")
    root = hashlib.blake2b(len(FP).to_bytes(8, "little") + FP + b"\x01" + (1).to_bytes(8, "little") + b"s",
                           digest_size=32, person=b"ringshm.kv.root").digest()
    h0 = hashlib.blake2b(root + struct.pack("<4q", 7, 8, 9, 10), digest_size=32, person=b"ringshm.kv.block")
    assert list(kv._index) == [h0.digest()]


def test_lookup_false_attaches_nothing_but_its_blocks_still_enter_the_cache():
    kv = KVBlocks(16, BS, FP)
    prefilled(kv, 0, seq(0, 2 * BS + 1))
    assert kv.admit(1, seq(0, 2 * BS + 1), lookup=False) == 0
    kv.release(0)
    kv.commit(1, seq(0, 2 * BS + 1), 2 * BS + 1)  # its blocks duplicate cached ones: they stay its own
    kv.check()
    assert kv.admit(2, seq(0, 2 * BS + 1)) == 2 * BS


# ------------------------------------------------------------------------------------- what is cached
def test_full_blocks_are_cached_only_once_every_position_holds_valid_kv():
    kv = KVBlocks(16, BS, FP)
    prompt = seq(0, 3 * BS)
    assert kv.admit(0, prompt) == 0  # the prefill was sent but no reply came back yet: nothing valid
    assert kv.admit(1, prompt) == 0
    kv.commit(0, prompt, 2 * BS - 1)  # block 1 is written up to one position short
    assert kv.kv_valid(0) == 2 * BS - 1 and kv.admit(2, prompt) == BS
    kv.commit(0, prompt, 2 * BS)
    assert kv.admit(3, prompt) == 2 * BS
    kv.check()


def test_speculative_drafts_past_kv_valid_are_never_cached():
    kv = KVBlocks(16, BS, FP)
    prompt = seq(0, BS + 1)  # positions 0..4
    prefilled(kv, 0, prompt)
    t0, drafts = 40, [41, 42, 43]
    assert kv.ensure(0, len(prompt) + 1 + len(drafts))  # verify [t0, 41, 42, 43] at positions 5..8
    final = prompt + [t0, 41, 99]  # 41 accepted, 42 rejected, bonus 99; position 7 holds 42's KV
    kv.commit(0, final, len(prompt) + 2)  # kv_valid = 7: block 1 (positions 4..7) is full but not valid
    assert kv.kv_valid(0) == len(prompt) + 2
    kv.check()
    assert kv.admit(1, final + [5]) == BS
    kv.commit(0, final + [3], len(final))  # a decode rewrote position 7 with 99: now block 1 is valid
    assert kv.admit(2, final + [5]) == 2 * BS
    kv.check()


def test_a_stream_that_computed_a_cached_prefix_again_keeps_its_blocks_to_itself():
    kv = KVBlocks(16, BS, FP)
    prompt = seq(0, 2 * BS + 1)
    kv.admit(0, prompt)
    kv.admit(1, prompt)  # both before either completed: both compute it
    assert kv.commit(0, prompt, len(prompt)) == 2
    assert kv.commit(1, prompt, len(prompt)) == 0
    kv.check()
    kv.release(1)
    assert kv.stats().n_cached == 0 and kv.stats().n_free == 16 - 3  # stream 1's copies went to the free list


# ----------------------------------------------------------------------------------- refcounts, release
def test_two_streams_sharing_a_prefix_share_its_blocks_until_both_release():
    kv = KVBlocks(16, BS, FP)
    prefilled(kv, 0, seq(0, 2 * BS) + [1, 2])
    prefilled(kv, 1, seq(0, 2 * BS) + [3])
    a, b = kv.table(0), kv.table(1)
    assert a[:2] == b[:2] and not set(a[2:]) & set(b[2:])
    assert [kv._ref[x] for x in a[:2]] == [2, 2]
    assert kv.stats().n_used == 4
    kv.release(0)
    kv.check()
    assert [kv._ref[x] for x in b[:2]] == [1, 1] and kv.stats().n_used == 3
    kv.release(1)
    kv.check()
    s = kv.stats()
    assert (s.n_used, s.n_cached, s.n_free) == (0, 2, 14)


def test_releasing_every_stream_returns_every_block():
    kv = KVBlocks(12, BS, FP)
    for i in range(4):
        prefilled(kv, i, seq(10 * (i % 2), 2 * BS + 1 + i % 2))
    assert kv.stats().n_used == 8  # 3 + 3 blocks, then 2 hits + 1 own twice
    for i in range(4):
        kv.release(i)
        kv.check()
    s = kv.stats()
    assert s.n_used == 0 and s.n_free + s.n_cached == 12
    assert kv.admit(9, seq(500, kv.tokens_capacity())) == 0  # one prompt can take the whole pool back
    assert kv.stats().evictions == s.n_cached and not kv._index
    kv.check()


def test_released_chains_are_evicted_tail_first_then_least_recently_used_first():
    kv = KVBlocks(4, BS, FP)
    prompt = seq(0, 3 * BS + 1)  # 4 blocks, 3 of them cached
    prefilled(kv, 0, prompt)
    kv.release(0)  # LRU: block 2, block 1, block 0 (tail first); the last token's block is free
    assert kv.admit(1, seq(100, 2 * BS)) == 0  # takes the free block, then evicts the chain's tail
    assert kv.stats().evictions == 1
    assert kv.admit(2, prompt) is None  # 2 blocks hit, 2 more needed, none left
    kv.release(1)
    assert kv.admit(2, prompt) == 2 * BS
    kv.check()


def test_a_recently_hit_chain_outlives_an_older_one():
    kv = KVBlocks(6, BS, FP)
    old, hot = seq(0, BS + 1), seq(100, BS + 1)
    prefilled(kv, 0, old)
    prefilled(kv, 1, hot)
    kv.release(1)
    kv.release(0)  # LRU: hot's block, then old's: hot would go first...
    assert kv.admit(2, hot) == BS
    kv.release(2)  # ...but this hit made it the most recently used
    assert kv.admit(3, seq(200, 4 * BS + 1)) == 0  # 5 blocks: 4 free + 1 evicted
    assert kv.admit(4, old) is None and kv.stats().evictions == 1
    kv.release(3)
    assert kv.admit(4, hot) == BS and kv.admit(5, old) == 0


def test_a_chain_whose_parent_was_evicted_does_not_hit_beyond_it():
    kv = KVBlocks(5, BS, FP)
    long = seq(0, 2 * BS + 1)
    prefilled(kv, 0, long[:BS + 1])  # block 0 cached by stream 0
    assert kv.admit(1, long, lookup=False) == 0
    kv.commit(1, long, len(long))  # block 0 is a duplicate (stays its own), block 1 is cached
    kv.release(0)
    kv.release(1)  # LRU: stream 0's block 0, then stream 1's block 1; 3 blocks free
    assert kv.admit(2, seq(100, 4 * BS)) == 0  # 4 blocks: 3 free + evicts block 0, the parent
    assert kv.stats().evictions == 1
    kv.release(2)
    assert len(kv._index) == 1  # block 1 is stranded: still named, unreachable
    assert kv.admit(3, long) == 0
    kv.check()


# ------------------------------------------------------------------------------------- failures, limits
def test_a_request_larger_than_the_pool_is_refused_up_front():
    kv = KVBlocks(4, BS, FP)
    assert kv.tokens_capacity() == 4 * BS and kv.blocks_for(4 * BS + 1) == 5
    with pytest.raises(ValueError, match="16 tokens"):
        kv.admit(0, seq(0, 4 * BS + 1))
    assert 0 not in kv and kv.stats().query_tokens == 0
    assert kv.admit(0, seq(0, 4 * BS)) == 0
    assert kv.ensure(0, 4 * BS) and not kv.ensure(0, 4 * BS + 1)


def test_failed_admission_and_growth_change_nothing():
    kv = KVBlocks(5, BS, FP)
    prefilled(kv, 0, seq(0, 2 * BS + 1))
    prefilled(kv, 1, seq(0, BS + 1))  # hits block 0, one block of its own
    before = (kv.stats(), kv.table(0), kv.table(1), list(kv._ref), dict(kv._index))
    assert kv.admit(2, seq(0, 2 * BS) + seq(50, BS + 1)) is None  # 2 hit, 2 more needed, 1 free
    assert not kv.ensure(1, 4 * BS)
    assert (kv.stats(), kv.table(0), kv.table(1), list(kv._ref), dict(kv._index)) == before
    assert 2 not in kv
    kv.check()


def test_misuse_is_refused():
    for bad in (0, 3, 24, True):
        with pytest.raises(ValueError):
            KVBlocks(8, bad, FP)
    with pytest.raises(TypeError):
        KVBlocks(8, BS, "not bytes")
    kv = KVBlocks(8, BS, FP)
    with pytest.raises(ValueError):
        kv.admit(0, [])
    prefilled(kv, 0, seq(0, 6))
    with pytest.raises(ValueError):
        kv.admit(0, seq(0, 6))
    with pytest.raises(ValueError):
        kv.commit(0, seq(0, 6), 5)  # kv_valid never decreases
    with pytest.raises(ValueError):
        kv.commit(0, seq(0, 9), 9)  # past the table
    kv.ensure(0, 9)
    with pytest.raises(ValueError):
        kv.commit(0, seq(0, 8), 9)  # fewer tokens than kv_valid
    for call in (kv.release, kv.table, kv.kv_valid, lambda s: kv.ensure(s, 1)):
        with pytest.raises(KeyError):
            call(7)
    kv.check()


# ------------------------------------------------------------------------------------- state machine
N_BLOCKS = 6  # 24 positions: two or three streams fill it
ALPHABET = 3  # tails and outputs from few ids: equal blocks after different prefixes are common
PREFIXES = [
    [],
    [0, 1, 2, 0, 1, 2, 0, 1],
    [0, 1, 2, 0, 2, 2, 2, 2],  # block 0 as above, block 1 its own
    [2, 2, 2, 2, 2, 2, 2, 2],  # block 1 equal to the one above, after another block 0
    [1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2, 0],
]
SALTS = [None, None, "a", "b"]
REQUESTS = st.tuples(st.sampled_from(PREFIXES), st.lists(st.integers(0, ALPHABET - 1), max_size=14),
                     st.sampled_from(SALTS), st.integers(1, 20),  # prefix, tail, salt, max_new_tokens,
                     st.sampled_from([None, BS, 2 * BS, 3 * BS]))  # and a cut: exact multiples of BS are common


class _S:
    """One stream of the model: its final tokens, salt, token limit, and positions [0, written) holding KV
    from final tokens (its kv_valid once the op that wrote them completed)."""

    def __init__(self, tokens: list[int], salt: str | None, limit: int, n_prompt: int, written: int):
        self.tokens, self.salt, self.limit, self.n_prompt, self.written = tokens, salt, limit, n_prompt, written

    @property
    def decoding(self) -> bool:
        return self.written >= self.n_prompt


def _can_prefill(s: _S) -> bool:
    return not s.decoding


def _can_decode(s: _S) -> bool:
    return s.decoding and len(s.tokens) < s.limit


class KVBlocksMachine(RuleBasedStateMachine):
    """The coordinator, sketched: requests arrive and wait, are admitted when the pool allows, prefill in
    chunks, decode, verify drafts (rejected ones rolled back), finish or are cancelled, and are preempted
    (released, requeued with their tokens) when growth fails or at random. ``content[b][o]`` is what block b
    holds at offset o: (salt, every token up to that position) of the last write there; a recycled block
    keeps it, as memory does."""

    @initialize(first=st.lists(REQUESTS, min_size=1, max_size=3))
    def start(self, first):
        """An empty pool, and a first few requests (so that more than ``arrive`` is enabled at once)."""
        self.kv = KVBlocks(N_BLOCKS, BS, FP)
        self.content: list[list] = [[None] * BS for _ in range(N_BLOCKS)]
        self.active: dict[int, _S] = {}
        self.waiting: list[tuple[list[int], str | None, int]] = []
        self.next_id = 0
        self.n_evictions = 0
        for request in first:
            self.arrive(*request)

    def _some(self, want) -> bool:
        return any(want(s) for s in self.active.values())

    def _pick(self, i: int, want=lambda s: True) -> int:
        ids = [k for k, s in sorted(self.active.items()) if want(s)]
        return ids[i % len(ids)]

    def _write(self, sid: int, start: int, inputs: list[int]) -> None:
        """An op writes KV at positions [start, start + len(inputs)) of the stream, fed ``inputs``."""
        s, table = self.active[sid], self.kv.table(sid)
        seen = s.tokens[:start]
        for p, tok in enumerate(inputs, start):
            b = table[p // BS]
            assert self.kv._ref[b] == 1 and self.kv._hash_of[b] is None, f"stream {sid} writes shared block {b}"
            seen = seen + [tok]
            self.content[b][p % BS] = (s.salt, tuple(seen))

    def _preempt(self, sid: int) -> None:
        """Release the stream and requeue it first with its tokens (one at its limit has finished instead)."""
        s = self.active.pop(sid)
        self.kv.release(sid)
        if len(s.tokens) < s.limit:
            event("preempted")
            self.waiting.insert(0, (s.tokens, s.salt, s.limit))

    def _try_admit(self) -> None:
        tokens, salt, limit = self.waiting[0]
        before = (self.kv.stats(), list(self.kv._ref), dict(self.kv._index))
        n_cached = self.kv.admit(self.next_id, tokens, salt)
        if n_cached is None:
            assert self.active, "a request that fits the pool alone was refused with nothing running"
            assert (self.kv.stats(), list(self.kv._ref), dict(self.kv._index)) == before
            event("admission refused (pool full)")
            return
        event(f"admitted with {n_cached // BS} cached blocks")
        assert n_cached % BS == 0 and n_cached <= (len(tokens) - 1) // BS * BS
        self.waiting.pop(0)
        self.active[self.next_id] = _S(list(tokens), salt, limit, len(tokens), n_cached)
        self.next_id += 1

    @rule(request=REQUESTS)
    def arrive_rule(self, request):
        self.arrive(*request)

    def arrive(self, prefix, tail, salt, max_new, cut):
        prompt = (prefix + tail)[:cut][:N_BLOCKS * BS - 1] or [0]
        self.waiting.append((prompt, salt, min(len(prompt) + max_new, N_BLOCKS * BS)))
        self._try_admit()

    @precondition(lambda self: self.waiting)
    @rule()
    def admit_waiting(self):
        self._try_admit()

    @precondition(lambda self: self._some(_can_prefill))
    @rule(i=st.integers(0, 99), n=st.integers(1, 9), token=st.integers(0, ALPHABET - 1))
    def prefill_chunk(self, i, n, token):
        sid = self._pick(i, _can_prefill)
        s = self.active[sid]
        n = min(n, s.n_prompt - s.written)
        self._write(sid, s.written, s.tokens[s.written:s.written + n])
        s.written += n
        if s.decoding:  # the prompt's last chunk gives the next token
            s.tokens.append(token)
        self.kv.commit(sid, s.tokens, s.written)

    @precondition(lambda self: self._some(_can_decode))
    @rule(i=st.integers(0, 99), drafts=st.lists(st.integers(0, ALPHABET - 1), max_size=6),
          n_accept=st.integers(0, 6), bonus=st.integers(0, ALPHABET - 1))
    def decode(self, i, drafts, n_accept, bonus):
        """A decode (no drafts) or a verify of [last token, drafts...]: the first n_accept drafts are accepted,
        then the bonus token (another than the draft it replaces); KV past the accepted ones is rolled back
        (left for later ops to overwrite)."""
        sid = self._pick(i, _can_decode)
        s = self.active[sid]
        drafts = drafts[:s.limit - len(s.tokens) - 1]
        pos = len(s.tokens) - 1
        if not self.kv.ensure(sid, pos + 1 + len(drafts)):
            event("growth refused (pool full)")
            self._preempt(sid)  # the victim is the scheduler's choice; any exercises the same calls
            return
        self._write(sid, pos, [s.tokens[pos]] + drafts)
        a = min(n_accept, len(drafts))
        if a < len(drafts):
            bonus = (drafts[a] + 1 + bonus % (ALPHABET - 1)) % ALPHABET
            event("verify rejected a draft")
        elif drafts:
            event("verify accepted every draft")
        s.tokens += drafts[:a] + [bonus]
        s.written = pos + 1 + a  # positions past it hold rejected drafts' KV, rewritten later
        self.kv.commit(sid, s.tokens, s.written)

    @precondition(lambda self: self.active)
    @rule(i=st.integers(0, 99), requeue=st.booleans())
    def end(self, i, requeue):
        """Finish or cancel a stream (release), or preempt it (release, requeue with its tokens)."""
        sid = self._pick(i)
        if requeue:
            self._preempt(sid)
        else:
            del self.active[sid]
            self.kv.release(sid)

    @invariant()
    def blocks_are_accounted_for(self):
        if not hasattr(self, "kv"):
            return
        self.kv.check()
        refs = [0] * N_BLOCKS
        for sid in self.active:
            for b in self.kv.table(sid):
                refs[b] += 1
        s = self.kv.stats()
        assert refs == self.kv._ref
        assert s.n_used == sum(r > 0 for r in refs) and s.n_used + s.n_free + s.n_cached == N_BLOCKS
        assert 0 <= s.hit_tokens <= s.query_tokens
        if s.evictions > self.n_evictions:
            event("evicted cached blocks")
            self.n_evictions = s.evictions

    @invariant()
    def every_valid_position_holds_what_recomputation_would_write(self):
        if not hasattr(self, "kv"):
            return
        for sid, s in self.active.items():
            table = self.kv.table(sid)
            assert self.kv.kv_valid(sid) == s.written and len(table) * BS >= s.written
            for p in range(s.written):
                assert self.content[table[p // BS]][p % BS] == (s.salt, tuple(s.tokens[:p + 1])), (sid, p)


KVBlocksMachine.TestCase.settings = settings(max_examples=400, stateful_step_count=60, deadline=None,
                                             suppress_health_check=[HealthCheck.too_slow])
test_kv_blocks_state_machine = KVBlocksMachine.TestCase
