"""KV in blocks, the coordinator's bookkeeping: block ids with reference counts, one block table per stream, and
a prefix cache whose hits are bit-exact (DESIGN.md, "KV in blocks"). Pure Python, no torch, sends nothing.

Every stage holds one pool of ``n_blocks`` KV blocks of ``block_size`` positions, with the same block ids on
every stage. Only the coordinator decides which block holds what: position p of a stream lives in block
``table[p // block_size]`` at offset ``p % block_size``; each segment of a step op carries its stream's table,
and stages append into and attend through the blocks it names.

A stream's ``kv_valid`` counts its leading positions whose KV a completed op wrote from final tokens (prompt
tokens, accepted outputs). Positions at or past it may hold drafts a verify wrote, to be rewritten.

Prefix cache (vLLM's automatic prefix caching: block hash = hash(parent hash, block tokens, extra keys)): every
full block whose positions are all < kv_valid is named by a hash chained over the prefix,

    h_-1 = H(fingerprint of the model, cache_salt)        h_i = H(h_{i-1}, token ids of block i)

H = BLAKE2b-256 over a fixed byte encoding (ids as little-endian int64; never Python's ``hash()``). The KV of a
block depends only on the model and the tokens up to its end, and ringshm computes every token with the same
bits whatever the chunking and batch-mates, so a block found by its hash is the block recomputation would
write: a hit never changes a byte. Another ``cache_salt`` (tenant) is another chain: it never hits.

Block states (each block in exactly one; ``ref`` = how many tables name it, ``hashed`` = in the index):

    state    ref   hashed  kept in                       leaves by
    -------  ----  ------  ----------------------------  ------------------------------------------------------
    FREE     0     no      _free                         _take (admit, ensure): -> OWN
    OWN      1     no      one table                     commit seals it: -> SEALED (stays OWN when its hash
                                                         already names another block); release: -> FREE
    SEALED   >= 1  yes     tables                        a hit attaches it (ref + 1); last release: -> CACHED
    CACHED   0     yes     _lru, least recently          a hit attaches it: -> SEALED; _take with _free
                           released first                empty evicts the oldest (unhashed): -> FREE

Invariants (``check`` tests them all):
  * no leak: len(_free) + len(_lru) + #(ref >= 1) == n_blocks, and ref[b] == how many table entries name b;
  * a block a stream may still write into (it holds a position >= that stream's kv_valid) is OWN: ref 1, not
    hashed. So a stream never writes into a shared or cached block, and cached blocks are full and immutable;
  * the index and the blocks agree: index[h] == b exactly when block b is hashed under h.

A table is released tail first, so the tail of a chain reaches the LRU queue (and eviction) before its head:
a head evicted first would strand its children (a lookup stops at the first miss).
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

DIGEST_BYTES = 32  # BLAKE2b-256: collisions are out of reach, so a hash hit is taken as a content match


@dataclass
class KVBlockStats:
    """Prefix-cache and pool counters for metrics.

    ``query_tokens``: prompt tokens of requests admitted with a lookup (a preempted stream's return is not
    counted again); ``hit_tokens``: of those, tokens whose KV came from the cache (prefill skipped);
    ``evictions``: cached blocks taken back to serve an allocation.
    ``n_used`` / ``n_free`` / ``n_cached``: blocks named by some table / on the free list / cached and unnamed
    (the LRU queue), now; they sum to the pool's ``n_blocks``.
    """

    query_tokens: int = 0
    hit_tokens: int = 0
    evictions: int = 0
    n_used: int = 0
    n_free: int = 0
    n_cached: int = 0

    @property
    def hit_rate(self) -> float:
        """hit_tokens / query_tokens (0.0 before any query)."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


@dataclass
class _Table:
    blocks: list[int]
    kv_valid: int  # leading positions holding final KV
    last_hash: bytes  # h_{kv_valid // block_size - 1}: the chain over every full valid block (the root if none)


class KVBlocks:
    """The block pool of one pipeline (the same ids on every stage), its streams' tables and the prefix cache.

    Args:
        n_blocks: blocks in each stage's pool. block_size: positions per block, a power of two (16-64 in
            serving; any power of two here). fingerprint: bytes naming what makes the KV bits what they are
            (the checkpoint's weights and their encoding, the kernels' version): the root of every chain.

    Raises:
        ValueError: n_blocks < 1, or block_size not a power of two. TypeError: fingerprint is not bytes.
    """

    def __init__(self, n_blocks: int, block_size: int, fingerprint: bytes):
        for name, v in (("n_blocks", n_blocks), ("block_size", block_size)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {block_size}")
        if not isinstance(fingerprint, bytes):
            raise TypeError(f"fingerprint must be bytes, got {type(fingerprint).__name__}")
        self.n_blocks, self.block_size, self.fingerprint = n_blocks, block_size, fingerprint
        self._pack = struct.Struct(f"<{block_size}q").pack
        self._ref = [0] * n_blocks
        self._hash_of: list[bytes | None] = [None] * n_blocks
        self._index: dict[bytes, int] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # CACHED blocks, the next to evict first
        self._free = list(range(n_blocks - 1, -1, -1))  # a stack: block 0 goes first
        self._tables: dict[int, _Table] = {}
        self._stats = KVBlockStats()

    # --------------------------------------------------------------------------------------------- sizes
    def tokens_capacity(self) -> int:
        """Positions the whole pool holds (n_blocks x block_size): a request whose prompt + max_new_tokens
        exceeds it can never run, even alone (refuse it up front: ValueError / HTTP 400)."""
        return self.n_blocks * self.block_size

    def blocks_for(self, n_positions: int) -> int:
        """Blocks a table needs to cover ``n_positions`` positions (ceil(n_positions / block_size))."""
        return -(-n_positions // self.block_size)

    @property
    def n_available(self) -> int:
        """Blocks an allocation can get now without preempting anyone (free + cached and unnamed)."""
        return len(self._free) + len(self._lru)

    # ------------------------------------------------------------------------------------------- streams
    def admit(self, stream_id: int, prompt: Sequence[int], cache_salt: str | None = None,
              lookup: bool = True, count: bool = True) -> int | None:
        """Give a new stream a table covering its prompt: the longest chain of cached blocks of the prompt
        (ref + 1), then fresh blocks. Returns the cached token count (attached blocks x block_size; its prefill
        starts there), or None, changing nothing, when the pool cannot hold the rest now (preempt, retry).

        At most ``(len(prompt) - 1) // block_size`` blocks are attached, so the prompt's last token is computed
        (it must give logits) into a block of the stream's own. ``lookup=False`` attaches nothing (a request
        that wants every prompt position scored); its blocks still enter the cache as they are committed. A
        preempted stream comes back with prompt = its prompt + its generated tokens, and ``count=False``: the
        query / hit counters are what clients see (``usage.prompt_tokens_details.cached_tokens``), once a request.

        Args:
            prompt: token ids (ints in int64 range). cache_salt: tenant key (None: no salt; "" is a salt).

        Raises:
            ValueError: stream_id already has a table, the prompt is empty, or it alone needs more than
                n_blocks blocks (it could never be admitted). struct.error: a token id outside int64.
        """
        if stream_id in self._tables:
            raise ValueError(f"stream {stream_id} already has a block table")
        n, bs = len(prompt), self.block_size
        if n == 0:
            raise ValueError(f"stream {stream_id} has an empty prompt")
        need = self.blocks_for(n)
        if need > self.n_blocks:
            raise ValueError(f"a prompt of {n} tokens needs {need} KV blocks, the pool holds {self.n_blocks} "
                             f"({self.tokens_capacity()} tokens)")
        h = _root_hash(self.fingerprint, cache_salt)
        hits: list[int] = []
        if lookup:
            for i in range((n - 1) // bs):
                hi = _block_hash(h, self._pack(*prompt[i * bs:(i + 1) * bs]))
                b = self._index.get(hi)
                if b is None:
                    break
                hits.append(b)
                h = hi
        n_fresh = need - len(hits)
        if n_fresh > self.n_available - sum(1 for b in hits if self._ref[b] == 0):
            return None
        for b in hits:
            if self._ref[b] == 0:
                del self._lru[b]
            self._ref[b] += 1
        self._tables[stream_id] = _Table(hits + self._take(n_fresh), len(hits) * bs, h)
        if lookup and count:
            self._stats.query_tokens += n
            self._stats.hit_tokens += len(hits) * bs
        return len(hits) * bs

    def ensure(self, stream_id: int, n_positions: int) -> bool:
        """Grow the stream's table to cover positions [0, n_positions) before an op writes up to there (a
        decode at p needs p + 1; a verify of k drafts at p needs p + 1 + k). Returns False, changing nothing,
        when the pool cannot give the blocks now (preempt someone and retry).

        Raises:
            KeyError: no table for stream_id. ValueError: n_positions < 0.
        """
        t = self._tables[stream_id]
        if n_positions < 0:
            raise ValueError(f"n_positions must be >= 0, got {n_positions}")
        need = self.blocks_for(n_positions) - len(t.blocks)
        if need <= 0:
            return True
        if need > self.n_available:
            return False
        t.blocks += self._take(need)
        return True

    def commit(self, stream_id: int, tokens: Sequence[int], kv_valid: int) -> int:
        """Record that positions [0, kv_valid) of the stream hold final KV (an op writing them from final tokens
        has completed), and name every block this fills in the prefix cache. Returns how many blocks entered
        the cache (a block whose hash already names another block stays the stream's own, unhashed).

        Args:
            tokens: the stream's final token ids, prompt then accepted outputs, at least kv_valid of them; only
                those of newly filled blocks are read (the call is O(1) when no block fills).
            kv_valid: never less than the last value (admission sets it to the cached token count).

        Raises:
            KeyError: no table for stream_id. ValueError: kv_valid decreases, exceeds the table's positions
                or len(tokens).
        """
        t, bs = self._tables[stream_id], self.block_size
        if not t.kv_valid <= kv_valid <= len(t.blocks) * bs:
            raise ValueError(f"stream {stream_id}: kv_valid {kv_valid} outside [{t.kv_valid}, "
                             f"{len(t.blocks) * bs}] (it never decreases nor passes the table)")
        if len(tokens) < kv_valid:
            raise ValueError(f"stream {stream_id}: kv_valid {kv_valid} but only {len(tokens)} tokens given")
        n_new = 0
        for i in range(t.kv_valid // bs, kv_valid // bs):
            t.last_hash = h = _block_hash(t.last_hash, self._pack(*tokens[i * bs:(i + 1) * bs]))
            if h not in self._index:
                b = t.blocks[i]
                self._index[h] = b
                self._hash_of[b] = h
                n_new += 1
        t.kv_valid = kv_valid
        return n_new

    def release(self, stream_id: int) -> None:
        """Drop the stream's table (it finished, was cancelled or is preempted), tail first: ref - 1 for each
        block; one at ref 0 goes to the LRU queue if cached, else to the free list. Call it only once no op
        of the stream is in flight (a stage could still write into the blocks).

        Raises:
            KeyError: no table for stream_id.
        """
        for b in reversed(self._tables.pop(stream_id).blocks):
            self._ref[b] -= 1
            if self._ref[b] == 0:
                if self._hash_of[b] is None:
                    self._free.append(b)
                else:
                    self._lru[b] = None

    def table(self, stream_id: int) -> list[int]:
        """A copy of the stream's block table (block ids; it covers len x block_size positions).

        Raises:
            KeyError: no table for stream_id."""
        return list(self._tables[stream_id].blocks)

    def kv_valid(self, stream_id: int) -> int:
        """The stream's leading positions that hold final KV.

        Raises:
            KeyError: no table for stream_id."""
        return self._tables[stream_id].kv_valid

    def __contains__(self, stream_id: int) -> bool:
        return stream_id in self._tables

    def stats(self) -> KVBlockStats:
        """A snapshot of the counters (``KVBlockStats``)."""
        s = self._stats
        return KVBlockStats(s.query_tokens, s.hit_tokens, s.evictions,
                            self.n_blocks - self.n_available, len(self._free), len(self._lru))

    def check(self) -> None:
        """Test every invariant of the module docstring, O(n_blocks + table entries); for tests and debugging.

        Raises:
            AssertionError: naming the first invariant found broken.
        """
        def need(ok: bool, what: str) -> None:
            if not ok:
                raise AssertionError(what)

        bs, refs = self.block_size, [0] * self.n_blocks
        for sid, t in self._tables.items():
            need(t.kv_valid <= len(t.blocks) * bs, f"stream {sid}: kv_valid past its table")
            for i, b in enumerate(t.blocks):
                refs[b] += 1
                if (i + 1) * bs > t.kv_valid:
                    need(self._ref[b] == 1 and self._hash_of[b] is None,
                         f"stream {sid} may write block {b} (table[{i}]) but it is shared or cached")
        need(refs == self._ref, "a refcount differs from the tables naming the block")
        free, lru = set(self._free), set(self._lru)
        need(len(free) == len(self._free) and not free & lru, "a block twice on the free list / LRU")
        need(all(self._ref[b] == 0 and self._hash_of[b] is None for b in free), "a free block is used or hashed")
        need(all(self._ref[b] == 0 and self._hash_of[b] is not None for b in lru), "an LRU block is used/unhashed")
        need(len(free) + len(lru) + sum(r > 0 for r in refs) == self.n_blocks, "a block leaked")
        need(all(self._hash_of[b] == h for h, b in self._index.items()), "the index names a block hashed otherwise")
        need(len(self._index) == sum(h is not None for h in self._hash_of), "a hashed block missing from the index")

    # ----------------------------------------------------------------------------------------------- private
    def _take(self, n: int) -> list[int]:
        """n blocks at ref 1: free ones first, then the least recently released cached ones (evicted: unhashed).
        The caller has checked n <= n_available."""
        out = []
        for _ in range(n):
            if self._free:
                b = self._free.pop()
            else:
                b, _ = self._lru.popitem(last=False)
                del self._index[self._hash_of[b]]
                self._hash_of[b] = None
                self._stats.evictions += 1
            self._ref[b] = 1
            out.append(b)
        return out


def _root_hash(fingerprint: bytes, cache_salt: str | None) -> bytes:
    """h_-1 = BLAKE2b-256(len, fingerprint, salt flag [, len, UTF-8 salt]); lengths as little-endian u64."""
    h = hashlib.blake2b(digest_size=DIGEST_BYTES, person=b"ringshm.kv.root")
    h.update(len(fingerprint).to_bytes(8, "little") + fingerprint)
    if cache_salt is None:
        h.update(b"\x00")
    else:
        salt = cache_salt.encode("utf-8")
        h.update(b"\x01" + len(salt).to_bytes(8, "little") + salt)
    return h.digest()


def _block_hash(parent: bytes, packed_tokens: bytes) -> bytes:
    """h_i = BLAKE2b-256(h_{i-1} (32 bytes), block_size token ids as little-endian int64)."""
    return hashlib.blake2b(parent + packed_tokens, digest_size=DIGEST_BYTES, person=b"ringshm.kv.block").digest()
