"""Paged KV and attention (csrc/kernels.h via ringshm.model.attention) against the plain torch reference, and their
contracts: a stream's positions live in the blocks its table names, wherever they sit in the pool.

The reference is an independent implementation (gather the blocks, matmul, boolean mask, torch.softmax); the C
path is an online softmax over the blocks with a hand-written exp, so agreement to 1e-5 is a real check.
Invariance tests compare bits: a row alone vs in a chunk, a segment alone vs beside others, and the same stream
at two placements of its blocks in the pool.
"""

from __future__ import annotations

import pytest
import torch

from ringshm.errors import KVRangeError
from ringshm.model import attention as A
from ringshm.model import kernels

ATOL = RTOL = 1e-5


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def paged(k_row: torch.Tensor, v_row: torch.Tensor, block_size: int, seed: int = 0,
          spare: int = 3) -> tuple[A.KVPool, torch.Tensor]:
    """A pool holding the contiguous rows ``[Hkv, L, D]`` in randomly placed blocks (the other blocks hold
    noise), and the row's table."""
    hkv, length, d = k_row.shape
    n = A.table_len(length, block_size)
    g = _gen(seed)
    pool = A.KVPool(n + spare, hkv, block_size, d)
    pool.k.copy_(torch.randn(pool.k.shape, generator=g))
    pool.v.copy_(torch.randn(pool.v.shape, generator=g))
    table = torch.randperm(n + spare, generator=g)[:n].to(torch.int32)
    pad = n * block_size - length
    k = torch.cat([k_row, torch.zeros(hkv, pad, d)], dim=1).reshape(hkv, n, block_size, d).transpose(0, 1)
    v = torch.cat([v_row, torch.zeros(hkv, pad, d)], dim=1).reshape(hkv, n, block_size, d).transpose(0, 1)
    pool.k[table.long()] = k
    pool.v[table.long()] = v
    return pool, table


def _row(hkv: int, length: int, d: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(hkv, length, d, generator=g), torch.randn(hkv, length, d, generator=g)


# --- attention --------------------------------------------------------------------------------------------------
ATTN_CASES = [
    # (Hq, Hkv, D, n, start, B)
    (9, 3, 64, 1, 0, 32),  # SmolLM2 decode of the first token
    (9, 3, 64, 1, 300, 32),  # SmolLM2 decode
    (9, 3, 64, 7, 125, 32),  # verify-sized chunk across a block boundary
    (9, 3, 64, 64, 0, 64),  # prefill chunk from the start
    (9, 3, 64, 64, 200, 128),
    (4, 4, 64, 7, 33, 32),  # GQA ratio 1 (plain multi-head)
    (8, 2, 64, 1, 77, 64),  # ratio 4
    (8, 1, 64, 64, 5, 32),  # ratio 8 (multi-query)
    (8, 1, 32, 7, 0, 32),  # another D
    (12, 3, 128, 7, 40, 32),
    (2, 1, 256, 1, 150, 64),  # the largest D the C kernel takes
    (6, 2, 48, 7, 20, 32),  # D a multiple of 16 without a specialised copy
    (3, 1, 64, 300, 0, 32),  # more query rows than one tile holds
]


@pytest.mark.parametrize("hq,hkv,d,n,start,bs", ATTN_CASES)
def test_attention_matches_the_torch_reference(hq, hkv, d, n, start, bs):
    g = _gen(hq * 1000 + n * 10 + start)
    k_row, v_row = _row(hkv, start + n + 9, d, g)  # positions past start + n hold data the mask must hide
    pool, table = paged(k_row, v_row, bs, seed=start)
    q = torch.randn(n, hq, d, generator=g)
    got = A.attention(q, pool, table, start)
    assert got.shape == (n, hq, d) and got.dtype == torch.float32
    torch.testing.assert_close(got, A.attention_reference(q, pool, table, start), atol=ATOL, rtol=RTOL)


def test_the_same_stream_gives_the_same_bits_wherever_its_blocks_sit_in_the_pool():
    g = _gen(40)
    k_row, v_row = _row(3, 500, 64, g)
    q = torch.randn(9, 9, 64, generator=g)
    outs = [A.attention(q, *paged(k_row, v_row, 32, seed=s, spare=s), 480) for s in (1, 2, 7)]
    assert all(torch.equal(o, outs[0]) for o in outs[1:])


def test_the_bits_do_not_depend_on_the_block_size():
    """The online softmax steps over 32-key tiles at every block size (kernels_impl.inc), so a prefix cached at
    one block size and an engine configured with another agree bit for bit."""
    g = _gen(41)
    k_row, v_row = _row(3, 700, 64, g)
    q = torch.randn(9, 9, 64, generator=g)
    for window in (0, 100):
        outs = [A.attention(q, *paged(k_row, v_row, bs, seed=bs), 650, window) for bs in (32, 64, 128)]
        assert all(torch.equal(o, outs[0]) for o in outs[1:])


def test_the_row_prefetch_changes_no_bit_of_attention():
    """Where the row prefetch is on (``qmatmul.set_row_prefetch``), attention also asks for the next key tile's keys
    and values as it reads a tile (csrc/kernels_impl.inc): forced on and off, decode rows, a chunk across blocks and
    a window give the same bits."""
    from ringshm.model import qmatmul as qm

    g = _gen(42)
    k_row, v_row = _row(3, 700, 64, g)
    pool, table = paged(k_row, v_row, 32, seed=3)
    q = torch.randn(40, 9, 64, generator=g)
    runs = {}
    try:
        for on in (False, True):
            assert qm.set_row_prefetch(on) is on
            runs[on] = [A.attention(q[:n], pool, table, start, window)
                        for n, start, window in ((1, 0, 0), (1, 650, 0), (40, 600, 0), (7, 640, 100))]
    finally:
        qm.set_row_prefetch(None)
    assert all(torch.equal(a, b) for a, b in zip(runs[False], runs[True], strict=True))


def test_a_block_size_that_is_not_a_multiple_of_the_key_tile_is_refused():
    with pytest.raises(ValueError, match="multiple of 32"):
        A.KVPool(4, 1, 16, 16)
    with pytest.raises(ValueError, match="multiple of 32"):
        A.KVPool(4, 1, 256, 16)


def test_attention_reference_agrees_with_sdpa_given_a_bottom_right_mask():
    g = _gen(1)
    n, start, hq, hkv, d = 5, 11, 6, 2, 32
    k_row, v_row = _row(hkv, 20, d, g)
    q = torch.randn(n, hq, d, generator=g)
    mask = torch.ones(n, start + n, dtype=torch.bool).tril(start)  # query j sees keys <= start + j
    k = k_row[:, : start + n].repeat_interleave(hq // hkv, 0)[None]  # [1, Hq, L, D]
    v = v_row[:, : start + n].repeat_interleave(hq // hkv, 0)[None]
    sdpa = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1)[None], k, v, attn_mask=mask)
    torch.testing.assert_close(A.attention_reference(q, *paged(k_row, v_row, 32), start), sdpa[0].transpose(0, 1),
                               atol=ATOL, rtol=RTOL)


def test_attention_ignores_positions_past_start_plus_n_even_in_its_own_last_block():
    g = _gen(2)
    k_row, v_row = _row(3, 14, 64, g)
    q = torch.randn(4, 9, 64, generator=g)
    pool, table = paged(k_row, v_row, 32)
    before = A.attention(q, pool, table, 10)
    pool.k[int(table[0]), :, 14:] = float("nan")  # the rest of the block the chunk ends in
    pool.v[int(table[0]), :, 14:] = 1e30
    assert torch.equal(A.attention(q, pool, table, 10), before)


def test_attention_query_j_does_not_see_key_start_plus_j_plus_1():
    g = _gen(3)
    k_row, v_row = _row(1, 16, 16, g)
    q = torch.randn(3, 1, 16, generator=g)
    pool, table = paged(k_row, v_row, 32)
    before = A.attention(q, pool, table, 4)
    pool.v[int(table[0]), 0, 6] += 100.0  # only query 2 (position 6) sees position 6
    after = A.attention(q, pool, table, 4)
    assert torch.equal(after[:2], before[:2]) and not torch.allclose(after[2], before[2])


def test_attention_row_bits_do_not_depend_on_the_chunk_it_came_in():
    g = _gen(4)
    pool, table = paged(*_row(3, 300, 64, g), 32)
    q = torch.randn(40, 9, 64, generator=g)
    whole = A.attention(q, pool, table, 200)
    for j in (0, 13, 39):
        assert torch.equal(A.attention(q[j:j + 1].clone(), pool, table, 200 + j)[0], whole[j])


def test_attention_softmax_survives_scores_that_would_overflow_exp():
    g = _gen(5)
    k_row, v_row = _row(1, 40, 64, g)
    pool, table = paged(k_row * 1e3, v_row, 32)  # scores of order 1e4: without max subtraction, inf / nan
    q = torch.randn(3, 2, 64, generator=g) * 10
    got = A.attention(q, pool, table, 30)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, A.attention_reference(q, pool, table, 30), atol=ATOL, rtol=RTOL)


def test_attention_of_a_single_key_returns_its_value():
    g = _gen(6)
    k_row, v_row = _row(2, 8, 32, g)
    q = torch.randn(1, 4, 32, generator=g)
    out = A.attention(q, *paged(k_row, v_row, 32), 0)
    assert torch.equal(out[0, 0], v_row[0, 0]) and torch.equal(out[0, 3], v_row[1, 0])


def test_attention_bf16_runs_the_torch_path_and_keeps_the_dtype():
    g = _gen(7)
    k_row, v_row = _row(3, 20, 64, g)
    q = torch.randn(2, 9, 64, generator=g)
    pool, table = paged(k_row, v_row, 32)
    low = A.KVPool(pool.n_blocks, 3, 32, 64, dtype=torch.bfloat16)
    low.k.copy_(pool.k)
    low.v.copy_(pool.v)
    got = A.attention(q.bfloat16(), low, table, 5)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), A.attention(q, pool, table, 5), atol=3e-2, rtol=3e-2)


# --- sliding window and scale (Mistral, Gemma 3) -----------------------------------------------------------------
WINDOW_CASES = [
    # (Hq, Hkv, D, n, start, window, B)
    (9, 3, 64, 1, 300, 16, 32),  # decode: a window inside one block
    (9, 3, 64, 1, 300, 200, 32),  # decode: a window across blocks
    (8, 2, 64, 40, 120, 32, 32),  # a chunk whose rows' windows start in different blocks
    (4, 1, 128, 64, 0, 7, 32),  # prefill from 0: the first rows see fewer than the window
    (2, 1, 256, 7, 500, 129, 128),  # a window one past a block
    (6, 2, 48, 300, 10, 50, 64),  # more rows than a tile, D without a specialised copy
    (4, 4, 64, 3, 2, 1, 64),  # a window of one key: each row sees only itself
]


@pytest.mark.parametrize("hq,hkv,d,n,start,window,bs", WINDOW_CASES)
def test_windowed_attention_matches_the_reference_and_ignores_keys_before_the_window(hq, hkv, d, n, start, window,
                                                                                     bs):
    g = _gen(hq * 7 + n + window)
    k_row, v_row = _row(hkv, start + n + 5, d, g)
    q = torch.randn(n, hq, d, generator=g)
    scale = 0.07  # not 1 / sqrt(D): Gemma's query_pre_attn_scalar
    pool, table = paged(k_row, v_row, bs)
    got = A.attention(q, pool, table, start, window, scale)
    torch.testing.assert_close(got, A.attention_reference(q, pool, table, start, window, scale), atol=ATOL, rtol=RTOL)
    lo = max(0, start - window + 1)  # the first row's window: every key before it is out of every row's window
    k2, v2 = k_row.clone(), v_row.clone()
    k2[:, :lo], v2[:, :lo] = 1e4, -1e4
    assert torch.equal(A.attention(q, *paged(k2, v2, bs), start, window, scale), got)


def test_windowed_attention_row_bits_do_not_depend_on_the_chunk_it_came_in():
    g = _gen(11)
    pool, table = paged(*_row(3, 600, 64, g), 32)
    q = torch.randn(60, 9, 64, generator=g)
    whole = A.attention(q, pool, table, 400, 100)
    for j in (0, 27, 59):
        assert torch.equal(A.attention(q[j:j + 1].clone(), pool, table, 400 + j, 100)[0], whole[j])
    for lo, hi in ((0, 13), (13, 60)):  # the same rows cut into two chunks
        assert torch.equal(A.attention(q[lo:hi].clone(), pool, table, 400 + lo, 100), whole[lo:hi])


def test_a_window_as_long_as_the_context_is_no_window_bit_for_bit():
    g = _gen(12)
    pool, table = paged(*_row(3, 300, 64, g), 32)
    q = torch.randn(30, 9, 64, generator=g)
    assert torch.equal(A.attention(q, pool, table, 200, 230), A.attention(q, pool, table, 200))


@pytest.mark.parametrize("hq,hkv,d,n,start,window", [(4, 2, 64, 1, 40, 16), (4, 2, 64, 37, 0, 0), (8, 1, 64, 300, 5, 0),
                                                       (6, 2, 48, 7, 200, 16)])
def test_attention_sinks_match_transformers_and_keep_every_row_on_its_own(hq, hkv, d, n, start, window):
    """gpt-oss's sinks: one more logit per head in the softmax, weighing no value (transformers' eager form: the
    sink concatenated to the scores, softmax, its column dropped); each row's bits still its own."""
    g = _gen(hq + n + start)
    k_row, v_row = _row(hkv, start + n + 3, d, g)
    pool, table = paged(k_row, v_row, 32)
    q = torch.randn(n, hq, d, generator=g)
    sinks = torch.randn(hq, generator=g) * 3
    sinks[0] = 50.0  # a sink that dwarfs every key: that head's output goes to ~0
    got = A.attention(q, pool, table, start, window, None, sinks)
    torch.testing.assert_close(got, A.attention_reference(q, pool, table, start, window, None, sinks), atol=ATOL,
                               rtol=RTOL)
    assert got[:, 0].abs().max() < 1e-6 and not torch.allclose(got, A.attention(q, pool, table, start, window))
    assert torch.equal(A.attention(q[-1:].clone(), pool, table, start + n - 1, window, None, sinks)[0], got[-1])
    one = A.attention_segments(q, pool, table, torch.tensor([0, table.numel()]), torch.tensor([start]),
                               torch.tensor([n]), 2, window, None, sinks)  # the layer's path, 2 threads
    assert torch.equal(one, got)
    assert torch.equal(A.attention(q, pool, table, start, window, None, torch.full((hq,), float("-inf"))),
                       A.attention(q, pool, table, start, window))  # a sink at -inf weighs nothing: no sink
    with pytest.raises(ValueError, match="sinks"):
        A.attention(q, pool, table, start, window, None, sinks[:-1])


@pytest.mark.parametrize("window, scale", [(-1, None), (0, 0.0), (0, float("nan")), (2.5, None)])
def test_a_bad_window_or_scale_is_refused(window, scale):
    pool = A.KVPool(1, 1, 32, 16)
    with pytest.raises(ValueError, match="window|scale"):
        A.attention(torch.zeros(1, 1, 16), pool, torch.zeros(1, dtype=torch.int32), 0, window, scale)


# --- attention_segments ----------------------------------------------------------------------------------------
def _segments(tables: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    offs = torch.tensor([0, *torch.tensor([t.numel() for t in tables]).cumsum(0).tolist()], dtype=torch.int64)
    return torch.cat(tables), offs


@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (8, 1, 32), (4, 4, 128)])
@pytest.mark.parametrize("n_threads", [1, 2, 3])
def test_attention_segments_equals_attention_per_segment_whatever_the_threads(hq, hkv, d, n_threads):
    g = _gen(hq + d)
    bs = 32
    pool = A.KVPool(40, hkv, bs, d)
    pool.k.copy_(torch.randn(pool.k.shape, generator=g))
    pool.v.copy_(torch.randn(pool.v.shape, generator=g))
    starts = torch.tensor([17, 0, 82, 40], dtype=torch.int64)
    lens = torch.tensor([1, 8, 7, 3], dtype=torch.int64)  # a decode, a prefill chunk, a verify, ...
    perm = torch.randperm(40, generator=g).to(torch.int32)
    own = [perm[:2], perm[2:3], perm[3:9], perm[9:12]]
    own[3] = torch.cat([own[0][:1], own[3][1:]])  # segment 3 shares segment 0's first block (reads only)
    tables, offs = _segments(own)
    q = torch.randn(int(lens.sum()), hq, d, generator=g)
    got = A.attention_segments(q, pool, tables, offs, starts, lens, n_threads)
    o = 0
    for i in range(4):
        n, s = int(lens[i]), int(starts[i])
        assert torch.equal(got[o:o + n], A.attention(q[o:o + n], pool, own[i], s))  # bitwise
        o += n


def test_attention_segments_runs_every_item_in_the_callers_flush_to_zero_mode():
    """The FP mode is per thread; OpenMP's pool workers keep their own unless the call hands them the caller's."""
    n = 256  # enough items that the pool's worker takes some of them
    pool = A.KVPool(n * 32, 1, 32, 16)
    pool.v.fill_(1e-39)  # subnormal: read as zero, or not, depending on the mode
    q = torch.zeros(n, 1, 16)
    tables = torch.arange(n * 32, dtype=torch.int32)
    offs = torch.arange(0, n * 32 + 1, 32, dtype=torch.int64)
    starts, lens = torch.full((n,), 500), torch.ones(n, dtype=torch.int64)
    A.attention_segments(q, pool, tables, offs, starts, lens, n_threads=2)  # the pool exists first
    was = torch.set_flush_denormal(True)
    try:
        one = A.attention_segments(q, pool, tables, offs, starts, lens, n_threads=1)
        two = A.attention_segments(q, pool, tables, offs, starts, lens, n_threads=2)
    finally:
        torch.set_flush_denormal(False)
    assert was and torch.equal(one, two) and torch.equal(one, torch.zeros_like(q))


@pytest.mark.parametrize("table, start", [([0], 31), ([0, 9], 31), ([-1, 0], 0), ([0, 1], -1)])
def test_attention_refuses_a_short_table_a_block_outside_the_pool_or_a_negative_start(table, start):
    pool = A.KVPool(5, 1, 32, 16)
    with pytest.raises(ValueError):  # KVRangeError for the tables
        A.attention(torch.zeros(2, 2, 16), pool, torch.tensor(table, dtype=torch.int32), start)


@pytest.mark.parametrize("lens, match", [([0, 2], "lens"), ([1, 2], "sum to T"), (None, "int64")])
def test_attention_segments_rejects_a_bad_segment_table(lens, match):
    pool = A.KVPool(2, 1, 32, 16)
    lens_t = torch.tensor(lens) if lens is not None else torch.tensor([1, 1], dtype=torch.int32)
    tables, offs = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0, 1, 2])
    with pytest.raises(ValueError, match=match):
        A.attention_segments(torch.zeros(2, 1, 16), pool, tables, offs, torch.tensor([0, 0]), lens_t)


# --- KV append and what the blocks hold -------------------------------------------------------------------------
@pytest.mark.parametrize("d,start,n,bs", [(64, 0, 1, 32), (64, 29, 7, 32), (32, 3, 64, 64)])
def test_kv_append_writes_exactly_the_positions_asked(d, start, n, bs):
    g = _gen(start + n)
    hkv = 3
    cos, sin = kernels.rope_tables(d, 80, 1e5)
    pool, table = paged(*_row(hkv, start + n + 20, d, g), bs)
    k_before, v_before = pool.row(table, start + n + 20)
    k, v = torch.randn(n, hkv, d, generator=g), torch.randn(n, hkv, d, generator=g)
    other = torch.tensor([b for b in range(pool.n_blocks) if b not in table.tolist()]).long()
    untouched = pool.k[other].clone()
    A.kv_append(pool, table, k, v, start, cos, sin)
    k_after, v_after = pool.row(table, start + n + 20)
    end = start + n
    assert torch.equal(k_after[:, :start], k_before[:, :start]) and torch.equal(k_after[:, end:], k_before[:, end:])
    assert torch.equal(v_after[:, start:end], v.transpose(0, 1)) and torch.equal(pool.k[other], untouched)
    torch.testing.assert_close(k_after[:, start:end], kernels.apply_rope(k, start, cos, sin).transpose(0, 1),
                               atol=ATOL, rtol=RTOL)


def test_kv_append_then_attention_matches_the_reference_pipeline():
    g = _gen(11)
    hq, hkv, d, bs = 9, 3, 64, 32
    cos, sin = kernels.rope_tables(d, 128, 1e5)
    pool, ref = A.KVPool(6, hkv, bs, d), A.KVPool(6, hkv, bs, d)
    table = torch.tensor([4, 0, 5, 2], dtype=torch.int32)
    for start, n in ((0, 40), (40, 1), (41, 30)):
        q, k, v = (torch.randn(n, h, d, generator=g) for h in (hq, hkv, hkv))
        A.kv_append(pool, table, k, v, start, cos, sin)
        A.kv_append_reference(ref, table, k, v, start, cos, sin)
        got = A.attention(kernels.apply_rope(q, start, cos, sin), pool, table, start)
        want = A.attention_reference(kernels.apply_rope_reference(q, start, cos, sin), ref, table, start)
        torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


def test_kv_append_beyond_the_rope_tables_or_its_table_raises_and_writes_nothing():
    cos, sin = kernels.rope_tables(16, 40, 1e4)
    pool = A.KVPool(4, 1, 32, 16)
    k = torch.ones(3, 1, 16)
    with pytest.raises(KVRangeError, match="need 2 blocks"):
        A.kv_append(pool, torch.tensor([0], dtype=torch.int32), k, k, 30, cos, sin)
    with pytest.raises(KVRangeError, match="outside the pool"):
        A.kv_append(pool, torch.tensor([0, 7], dtype=torch.int32), k, k, 30, cos, sin)
    with pytest.raises(KVRangeError, match="RoPE tables"):
        A.kv_append(pool, torch.tensor([0, 1], dtype=torch.int32), k, k, 38, cos, sin)
    assert not pool.k.any() and not pool.v.any()


def test_kv_check_refuses_reading_what_no_op_wrote_and_mark_records_rollbacks():
    bs = 32
    fill = torch.zeros(4, dtype=torch.int32)
    tables, offs = torch.tensor([2, 0], dtype=torch.int32), torch.tensor([0, 2])
    starts, lens = torch.tensor([0]), torch.tensor([36])

    def check(start, n):  # the first segment that may not run, or -1
        return A.kv_check(fill, bs, tables, offs, torch.tensor([start]), torch.tensor([n]))

    assert check(5, 1) == 0  # nothing written yet: reading 5 positions is refused
    assert A.kv_check(fill, bs, tables, offs, starts, lens) == -1  # a prefill from 0 may run
    A.kv_mark(fill, bs, tables, offs, starts, lens)
    assert fill.tolist() == [4, 0, 32, 0]
    assert check(36, 1) == -1 and check(37, 1) == 0  # continue at 36, not past it
    A.kv_mark(fill, bs, tables, offs, torch.tensor([10]), torch.tensor([2]))  # a rollback to 12 positions
    assert fill.tolist() == [4, 0, 12, 0] and check(13, 1) == 0 and check(12, 1) == -1


def test_the_c_kernels_report_bad_arguments_as_a_status_not_a_crash():
    from ringshm._C import ffi, lib

    pool = A.KVPool(2, 1, 32, 16)
    p = ffi.cast("float *", torch.zeros(64).data_ptr())
    t = torch.tensor([0, 1], dtype=torch.int32)
    tp = ffi.cast("int32_t *", t.data_ptr())
    two_heads = A.KVPool(2, 2, 32, 16)
    no_sinks, shape, rng = ffi.NULL, lib.RINGSHM_KERNEL_ERR_SHAPE, lib.RINGSHM_KERNEL_ERR_RANGE
    assert lib.ringshm_attn_forward(p, p, two_heads.c, tp, 2, 1, 3, 0, 0, 0.25, no_sinks) == shape  # 3 % 2
    assert lib.ringshm_attn_forward(p, p, pool.c, tp, 2, 1, 1, 0, -1, 0.25, no_sinks) == shape  # window
    assert lib.ringshm_attn_forward(p, p, pool.c, tp, 2, 1, 1, 0, 0, 0.0, no_sinks) == shape  # scale
    assert lib.ringshm_attn_forward(p, p, pool.c, tp, 1, 2, 1, 31, 0, 0.25, no_sinks) == rng  # short
    assert lib.ringshm_kv_append(pool.c, tp, 2, p, p, p, p, 2, 63, 100) == lib.RINGSHM_KERNEL_ERR_RANGE


# --- 16-bit KV ----------------------------------------------------------------------------------------------------
KV16 = [torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", KV16)
@pytest.mark.parametrize("flush_denormal", [False, True])
def test_every_isa_path_widens_every_16_bit_pattern_to_its_exact_value(dtype, flush_denormal):
    """What attention reads of a 16-bit pool is the stored value itself, on every ISA path and FP mode (fp16
    subnormals included: the portable path builds them as normal fp32, F16C converts them exactly)."""
    from ringshm._C import ffi, lib
    from ringshm.model.qmatmul import ISA_NAMES

    src = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(dtype)
    want = src.float()
    nan = want.isnan()
    was = torch.set_flush_denormal(flush_denormal)
    try:
        for isa in (i for i in ISA_NAMES if lib.ringshm_isa_supported(i)):
            out = torch.empty(65536)
            assert lib.ringshm_kv_widen(ffi.cast("float *", out.data_ptr()), ffi.cast("void *", src.data_ptr()),
                                        65536, A.KV_DTYPES[dtype], isa) == 0
            assert torch.equal(out[~nan].view(torch.int32), want[~nan].view(torch.int32)), ISA_NAMES[isa]
            assert bool(out[nan].isnan().all()), ISA_NAMES[isa]
    finally:
        torch.set_flush_denormal(was)


@pytest.mark.parametrize("dtype", KV16)
def test_kv_append_rounds_to_nearest_even_as_torch_casts(dtype):
    g = _gen(50)
    cos, sin = kernels.rope_tables(64, 64, 1e4)
    pool, ref = A.KVPool(4, 2, 32, 64, dtype=dtype), A.KVPool(4, 2, 32, 64, dtype=dtype)
    table = torch.tensor([2, 0], dtype=torch.int32)
    # magnitudes from fp16's subnormals to past its range, ties included (x.5 ulps of small integers)
    k = torch.randn(40, 2, 64, generator=g) * torch.logspace(-9, 6, 64)
    v = torch.randn(40, 2, 64, generator=g) * torch.logspace(-9, 6, 64)
    v[0, 0, :6] = torch.tensor([float("nan"), float("inf"), -7e4, 2049.0, 2051.0, 1 + 2**-8])
    A.kv_append(pool, table, k, v, 0, cos, sin)
    A.kv_append_reference(ref, table, k, v, 0, cos, sin)
    for got, want in ((pool.k, ref.k), (pool.v, ref.v)):
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", KV16)
def test_attention_over_16_bit_kv_is_attention_over_its_exact_values(dtype):
    """A 16-bit pool reads as the fp32 pool of its values, bit for bit: rounding happens once, on append."""
    g = _gen(51)
    k_row, v_row = _row(3, 300, 64, g)
    pool32, table = paged(k_row, v_row, 32)
    pool16 = A.KVPool(pool32.n_blocks, 3, 32, 64, dtype=dtype)
    pool16.k.copy_(pool32.k)
    pool16.v.copy_(pool32.v)
    pool32.k.copy_(pool16.k.float())
    pool32.v.copy_(pool16.v.float())
    q = torch.randn(40, 9, 64, generator=g)
    for start, window in ((200, 0), (260, 0), (250, 100)):
        got = A.attention(q, pool16, table, start, window)
        assert torch.equal(got, A.attention(q, pool32, table, start, window))
        torch.testing.assert_close(got, A.attention_reference(q, pool16, table, start, window), atol=ATOL, rtol=RTOL)
    tables, offs = _segments([table, table])
    lens, starts = torch.tensor([1, 39]), torch.tensor([299, 200])
    both = A.attention_segments(q, pool16, tables, offs, starts, lens, n_threads=2)
    assert torch.equal(both[:1], A.attention(q[:1].clone(), pool16, table, 299))
    assert torch.equal(both[1:], A.attention(q[1:].clone(), pool16, table, 200))
