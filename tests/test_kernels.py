"""The C kernels (csrc/kernels.c via ringshm.model.kernels) against the plain torch reference, and their contracts.

The reference is an independent implementation (matmul, boolean mask, torch.softmax); the C path is an online
softmax with a hand-written exp, so agreement to 1e-5 is a real check, not a tautology.
"""

from __future__ import annotations

import math

import pytest
import torch

from ringshm.errors import KVRangeError
from ringshm.model import kernels

ATOL = RTOL = 1e-5


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _row(hkv: int, smax: int, d: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(hkv, smax, d, generator=g), torch.randn(hkv, smax, d, generator=g)


# --- attention --------------------------------------------------------------------------------------------------

ATTN_CASES = [
    # (Hq, Hkv, D, n, start)
    (9, 3, 64, 1, 0),  # SmolLM2 decode of the first token
    (9, 3, 64, 1, 300),  # SmolLM2 decode
    (9, 3, 64, 7, 129),  # verify-sized chunk across a key-block boundary
    (9, 3, 64, 64, 0),  # prefill chunk from the start
    (9, 3, 64, 64, 200),
    (4, 4, 64, 7, 33),  # GQA ratio 1 (plain multi-head)
    (8, 2, 64, 1, 77),  # ratio 4
    (8, 1, 64, 64, 5),  # ratio 8 (multi-query)
    (8, 1, 32, 7, 0),  # another D
    (12, 3, 128, 7, 40),
    (4, 1, 128, 64, 100),
    (2, 1, 256, 1, 150),  # the largest D the C kernel takes
    (6, 2, 48, 7, 20),  # D a multiple of 16 without a specialised copy
    (3, 1, 64, 300, 0),  # more query rows than one tile holds
]


@pytest.mark.parametrize("hq,hkv,d,n,start", ATTN_CASES)
def test_attention_matches_the_torch_reference(hq, hkv, d, n, start):
    g = _gen(hq * 1000 + n * 10 + start)
    smax = start + n + 9  # positions past start + n hold data the mask must hide
    k_cache, v_cache = _row(hkv, smax, d, g)
    q = torch.randn(n, hq, d, generator=g)
    got = kernels.attention(q, k_cache, v_cache, start)
    want = kernels.attention_reference(q, k_cache, v_cache, start)
    assert got.shape == (n, hq, d) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


def test_attention_reference_agrees_with_sdpa_given_a_bottom_right_mask():
    g = _gen(1)
    n, start, hq, hkv, d = 5, 11, 6, 2, 32
    k_cache, v_cache = _row(hkv, 20, d, g)
    q = torch.randn(n, hq, d, generator=g)
    mask = torch.ones(n, start + n, dtype=torch.bool).tril(start)  # query j sees keys <= start + j
    k = k_cache[:, : start + n].repeat_interleave(hq // hkv, 0)[None]  # [1, Hq, L, D]
    v = v_cache[:, : start + n].repeat_interleave(hq // hkv, 0)[None]
    sdpa = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1)[None], k, v, attn_mask=mask)
    torch.testing.assert_close(kernels.attention_reference(q, k_cache, v_cache, start), sdpa[0].transpose(0, 1),
                               atol=ATOL, rtol=RTOL)


def test_attention_ignores_cache_positions_past_start_plus_n():
    g = _gen(2)
    k_cache, v_cache = _row(3, 64, 64, g)
    q = torch.randn(4, 9, 64, generator=g)
    before = kernels.attention(q, k_cache, v_cache, 10)
    k_cache[:, 14:] = float("nan")
    v_cache[:, 14:] = 1e30
    assert torch.equal(kernels.attention(q, k_cache, v_cache, 10), before)


def test_attention_query_j_does_not_see_key_start_plus_j_plus_1():
    g = _gen(3)
    k_cache, v_cache = _row(1, 16, 16, g)
    q = torch.randn(3, 1, 16, generator=g)
    before = kernels.attention(q, k_cache, v_cache, 4)
    v_cache[0, 6] += 100.0  # only query 2 (position 6) sees position 6
    after = kernels.attention(q, k_cache, v_cache, 4)
    assert torch.equal(after[:2], before[:2])
    assert not torch.allclose(after[2], before[2])


def test_attention_row_bits_do_not_depend_on_the_chunk_it_came_in():
    g = _gen(4)
    k_cache, v_cache = _row(3, 300, 64, g)
    q = torch.randn(40, 9, 64, generator=g)
    whole = kernels.attention(q, k_cache, v_cache, 200)
    for j in (0, 13, 39):
        alone = kernels.attention(q[j : j + 1].clone(), k_cache, v_cache, 200 + j)
        assert torch.equal(alone[0], whole[j])


def test_attention_softmax_survives_scores_that_would_overflow_exp():
    g = _gen(5)
    k_cache, v_cache = _row(1, 40, 64, g)
    k_cache *= 1e3  # scores of order 1e4: a softmax without max subtraction gives inf / nan
    q = torch.randn(3, 2, 64, generator=g) * 10
    got = kernels.attention(q, k_cache, v_cache, 30)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, kernels.attention_reference(q, k_cache, v_cache, 30), atol=ATOL, rtol=RTOL)


def test_attention_of_a_single_key_returns_its_value():
    g = _gen(6)
    k_cache, v_cache = _row(2, 8, 32, g)
    q = torch.randn(1, 4, 32, generator=g)
    out = kernels.attention(q, k_cache, v_cache, 0)
    assert torch.equal(out[0, 0], v_cache[0, 0]) and torch.equal(out[0, 3], v_cache[1, 0])


def test_attention_bf16_runs_the_torch_path_and_keeps_the_dtype():
    g = _gen(7)
    k_cache, v_cache = _row(3, 20, 64, g)
    q = torch.randn(2, 9, 64, generator=g)
    got = kernels.attention(q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16(), 5)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), kernels.attention(q, k_cache, v_cache, 5), atol=3e-2, rtol=3e-2)


# --- sliding window and scale (Mistral, Gemma 3) -----------------------------------------------------------------

WINDOW_CASES = [
    # (Hq, Hkv, D, n, start, window)
    (9, 3, 64, 1, 300, 16),  # decode: a window inside one key block
    (9, 3, 64, 1, 300, 200),  # decode: a window across key blocks
    (8, 2, 64, 40, 120, 32),  # a chunk whose rows' windows start in different blocks
    (4, 1, 128, 64, 0, 7),  # prefill from 0: the first rows see fewer than the window
    (2, 1, 256, 7, 500, 129),  # a window one past a block
    (6, 2, 48, 300, 10, 50),  # more rows than a tile, D without a specialised copy
    (4, 4, 64, 3, 2, 1),  # a window of one key: each row sees only itself
]


@pytest.mark.parametrize("hq,hkv,d,n,start,window", WINDOW_CASES)
def test_windowed_attention_matches_the_torch_reference_and_ignores_keys_before_the_window(hq, hkv, d, n, start,
                                                                                         window):
    g = _gen(hq * 7 + n + window)
    k_cache, v_cache = _row(hkv, start + n + 5, d, g)
    q = torch.randn(n, hq, d, generator=g)
    scale = 0.07  # not 1 / sqrt(D): Gemma's query_pre_attn_scalar
    got = kernels.attention(q, k_cache, v_cache, start, window, scale)
    torch.testing.assert_close(got, kernels.attention_reference(q, k_cache, v_cache, start, window, scale),
                               atol=ATOL, rtol=RTOL)
    lo = max(0, start - window + 1)  # the first row's window: every key before it is out of every row's window
    k2, v2 = k_cache.clone(), v_cache.clone()
    k2[:, :lo], v2[:, :lo] = 1e4, -1e4
    assert torch.equal(kernels.attention(q, k2, v2, start, window, scale), got)


def test_windowed_attention_row_bits_do_not_depend_on_the_chunk_it_came_in():
    g = _gen(11)
    k_cache, v_cache = _row(3, 600, 64, g)
    q = torch.randn(60, 9, 64, generator=g)
    whole = kernels.attention(q, k_cache, v_cache, 400, 100)
    for j in (0, 27, 59):
        assert torch.equal(kernels.attention(q[j:j + 1].clone(), k_cache, v_cache, 400 + j, 100)[0], whole[j])
    for lo, hi in ((0, 13), (13, 60)):  # the same rows cut into two chunks
        assert torch.equal(kernels.attention(q[lo:hi].clone(), k_cache, v_cache, 400 + lo, 100), whole[lo:hi])


def test_a_window_as_long_as_the_context_is_no_window_bit_for_bit():
    g = _gen(12)
    k_cache, v_cache = _row(3, 300, 64, g)
    q = torch.randn(30, 9, 64, generator=g)
    assert torch.equal(kernels.attention(q, k_cache, v_cache, 200, 230), kernels.attention(q, k_cache, v_cache, 200))


@pytest.mark.parametrize("window, scale", [(-1, None), (0, 0.0), (0, float("nan")), (2.5, None)])
def test_a_bad_window_or_scale_is_refused(window, scale):
    k_cache = torch.zeros(1, 8, 16)
    with pytest.raises(ValueError, match="window|scale"):
        kernels.attention(torch.zeros(1, 1, 16), k_cache, k_cache, 0, window, scale)


# --- attention_segments ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (8, 1, 32), (4, 4, 128)])
@pytest.mark.parametrize("n_threads", [1, 2, 3])
def test_attention_segments_equals_attention_per_segment_whatever_the_threads(hq, hkv, d, n_threads):
    g = _gen(hq + d)
    n_rows, smax = 5, 90
    k_cache = torch.randn(n_rows, hkv, smax, d, generator=g)
    v_cache = torch.randn(n_rows, hkv, smax, d, generator=g)
    rows = torch.tensor([3, 0, 3, 4], dtype=torch.int64)  # row 3 twice (reads only), rows 1 and 2 unused
    starts = torch.tensor([17, 0, 82, 40], dtype=torch.int64)
    lens = torch.tensor([1, 8, 7, 3], dtype=torch.int64)  # a decode, a prefill chunk, a verify, ...
    q = torch.randn(int(lens.sum()), hq, d, generator=g)
    got = kernels.attention_segments(q, k_cache, v_cache, rows, starts, lens, n_threads)
    assert got.shape == q.shape
    o = 0
    for r, s, n in zip(rows.tolist(), starts.tolist(), lens.tolist()):
        assert torch.equal(got[o:o + n], kernels.attention(q[o:o + n], k_cache[r], v_cache[r], s))  # bitwise
        o += n
    torch.testing.assert_close(got, kernels.attention_segments_reference(q, k_cache, v_cache, rows, starts, lens),
                               atol=ATOL, rtol=RTOL)


def test_attention_segments_runs_every_item_in_the_callers_flush_to_zero_mode():
    """OpenMP's pool workers keep their own FP mode unless the call hands them the caller's."""
    n = 256  # enough items that the pool's worker takes some of them
    k_cache = torch.zeros(n, 1, 512, 16)
    v_cache = torch.full((n, 1, 512, 16), 1e-39)  # subnormal: read as zero, or not, depending on the mode
    q = torch.zeros(n, 1, 16)
    rows, starts, lens = torch.arange(n), torch.full((n,), 500), torch.ones(n, dtype=torch.int64)
    kernels.attention_segments(q, k_cache, v_cache, rows, starts, lens, n_threads=2)  # the pool exists first
    was = torch.set_flush_denormal(True)
    try:
        one = kernels.attention_segments(q, k_cache, v_cache, rows, starts, lens, n_threads=1)
        two = kernels.attention_segments(q, k_cache, v_cache, rows, starts, lens, n_threads=2)
    finally:
        torch.set_flush_denormal(False)
    assert was and torch.equal(one, two) and torch.equal(one, torch.zeros_like(q))


@pytest.mark.parametrize("rows,starts,lens", [([0, 5], [0, 0], [1, 1]), ([-1, 0], [0, 0], [1, 1]),
                                              ([0, 1], [0, 30], [1, 3]), ([0, 1], [-1, 0], [2, 2])])
def test_attention_segments_rejects_a_row_or_start_out_of_range(rows, starts, lens):
    k_cache = torch.zeros(5, 1, 32, 16)
    q = torch.zeros(sum(lens), 2, 16)
    with pytest.raises(KVRangeError):
        kernels.attention_segments(q, k_cache, k_cache.clone(), torch.tensor(rows), torch.tensor(starts),
                                   torch.tensor(lens))


@pytest.mark.parametrize("lens, match", [([0, 2], "lens"), ([1, 2], "sum to T"), (None, "int64")])
def test_attention_segments_rejects_a_bad_segment_table(lens, match):
    k_cache = torch.zeros(2, 1, 8, 16)
    rows = torch.tensor([0, 1])
    lens_t = torch.tensor(lens) if lens is not None else torch.tensor([1, 1], dtype=torch.int32)
    with pytest.raises(ValueError, match=match):
        kernels.attention_segments(torch.zeros(2, 1, 16), k_cache, k_cache, rows, torch.tensor([0, 0]), lens_t)


# --- RoPE and kv_append -----------------------------------------------------------------------------------------


def test_rope_of_position_0_is_the_identity():
    cos, sin = kernels.rope_tables(64, 16, 1e5)
    x = torch.randn(1, 3, 64, generator=_gen(8))
    assert torch.equal(kernels.apply_rope(x, 0, cos, sin), x)


def test_rope_tables_follow_theta_to_the_minus_2i_over_d():
    cos, sin = kernels.rope_tables(8, 5, 10000.0)
    assert cos.shape == sin.shape == (5, 4) and cos.dtype == torch.float32
    angle = 3 * 10000.0 ** (-2 / 8)  # position 3, pair 1
    assert cos[3, 1].item() == pytest.approx(math.cos(angle), abs=1e-6)
    assert sin[3, 1].item() == pytest.approx(math.sin(angle), abs=1e-6)


def test_rope_rotates_pairs_i_and_i_plus_half_d():
    cos, sin = kernels.rope_tables(4, 4, 100.0)
    x = torch.tensor([[[1.0, 0.0, 0.0, 0.0]]])  # only dim 0 set: it rotates into dim 2 (its pair), never dim 1
    y = kernels.apply_rope(x, 2, cos, sin)[0, 0]
    assert y[1].item() == 0.0 and y[3].item() == 0.0
    assert y[0].item() == pytest.approx(math.cos(2.0)) and y[2].item() == pytest.approx(math.sin(2.0))


@pytest.mark.parametrize("d", [32, 64, 6])
def test_apply_rope_matches_the_torch_reference_and_keeps_norms(d):
    cos, sin = kernels.rope_tables(d, 100, 1e5)
    x = torch.randn(7, 5, d, generator=_gen(d))
    y = kernels.apply_rope(x, 50, cos, sin)
    torch.testing.assert_close(y, kernels.apply_rope_reference(x, 50, cos, sin), atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1), atol=1e-4, rtol=1e-5)
    assert not torch.equal(y, x)


@pytest.mark.slow  # importing transformers' Llama takes seconds; the rest of this file runs in about two
def test_rope_matches_transformers_llama_rotary_embedding():
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    config = llama.LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, rope_theta=1e5,
                               max_position_embeddings=64)
    rotary = llama.LlamaRotaryEmbedding(config=config)
    x = torch.randn(1, 9, 6, 64, generator=_gen(9))  # [B, H, T, D], HF layout
    pos = torch.arange(10, 16)[None]
    hf_cos, hf_sin = rotary(x, pos)
    want, _ = llama.apply_rotary_pos_emb(x, x, hf_cos, hf_sin)
    cos, sin = kernels.rope_tables(64, 64, 1e5)
    got = kernels.apply_rope(x[0].transpose(0, 1).contiguous(), 10, cos, sin)  # [T, H, D]
    torch.testing.assert_close(got, want[0].transpose(0, 1), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("d,start,n", [(64, 0, 1), (64, 13, 7), (32, 3, 64)])
def test_kv_append_writes_exactly_the_positions_asked(d, start, n):
    g = _gen(start + n)
    hkv, smax = 3, 80
    cos, sin = kernels.rope_tables(d, smax, 1e5)
    k_cache, v_cache = _row(hkv, smax, d, g)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    k, v = torch.randn(n, hkv, d, generator=g), torch.randn(n, hkv, d, generator=g)
    kernels.kv_append(k_cache, v_cache, k, v, start, cos, sin)
    end = start + n
    assert torch.equal(k_cache[:, :start], k_before[:, :start]) and torch.equal(k_cache[:, end:], k_before[:, end:])
    assert torch.equal(v_cache[:, :start], v_before[:, :start]) and torch.equal(v_cache[:, end:], v_before[:, end:])
    assert torch.equal(v_cache[:, start:end], v.transpose(0, 1))
    torch.testing.assert_close(k_cache[:, start:end], kernels.apply_rope(k, start, cos, sin).transpose(0, 1),
                               atol=ATOL, rtol=RTOL)


def test_kv_append_into_one_row_of_a_full_cache_leaves_other_rows_alone():
    g = _gen(10)
    cache_k, cache_v = torch.randn(4, 2, 30, 16, generator=g), torch.randn(4, 2, 30, 16, generator=g)
    before_k, before_v = cache_k.clone(), cache_v.clone()
    cos, sin = kernels.rope_tables(16, 30, 1e4)
    kernels.kv_append(cache_k[2], cache_v[2], torch.randn(5, 2, 16, generator=g), torch.randn(5, 2, 16, generator=g),
                      10, cos, sin)
    for r in (0, 1, 3):
        assert torch.equal(cache_k[r], before_k[r]) and torch.equal(cache_v[r], before_v[r])
    assert not torch.equal(cache_k[2], before_k[2])


def test_kv_append_at_an_earlier_start_overwrites_like_a_rollback():
    cos, sin = kernels.rope_tables(16, 20, 1e4)
    k_cache, v_cache = torch.zeros(1, 20, 16), torch.zeros(1, 20, 16)
    kernels.kv_append(k_cache, v_cache, torch.ones(8, 1, 16), torch.ones(8, 1, 16), 0, cos, sin)
    kernels.kv_append(k_cache, v_cache, torch.full((2, 1, 16), 2.0), torch.full((2, 1, 16), 2.0), 5, cos, sin)
    assert v_cache[0, :, 0].tolist() == [1, 1, 1, 1, 1, 2, 2, 1] + [0] * 12


def test_kv_append_then_attention_matches_the_reference_pipeline():
    g = _gen(11)
    hq, hkv, d, smax = 9, 3, 64, 64
    cos, sin = kernels.rope_tables(d, smax, 1e5)
    k_c, v_c = torch.zeros(hkv, smax, d), torch.zeros(hkv, smax, d)
    k_r, v_r = k_c.clone(), v_c.clone()
    for start, n in ((0, 20), (20, 1), (21, 8)):
        q, k, v = (torch.randn(n, h, d, generator=g) for h in (hq, hkv, hkv))
        kernels.kv_append(k_c, v_c, k, v, start, cos, sin)
        kernels.kv_append_reference(k_r, v_r, k, v, start, cos, sin)
        got = kernels.attention(kernels.apply_rope(q, start, cos, sin), k_c, v_c, start)
        want = kernels.attention_reference(kernels.apply_rope_reference(q, start, cos, sin), k_r, v_r, start)
        torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


def test_kv_append_bf16_runs_the_torch_path():
    cos, sin = kernels.rope_tables(16, 10, 1e4)
    k_cache, v_cache = torch.zeros(2, 10, 16, dtype=torch.bfloat16), torch.zeros(2, 10, 16, dtype=torch.bfloat16)
    k = torch.randn(3, 2, 16, generator=_gen(12))
    kernels.kv_append(k_cache, v_cache, k.bfloat16(), k.bfloat16(), 4, cos, sin)
    torch.testing.assert_close(k_cache[:, 4:7].float(), kernels.apply_rope(k, 4, cos, sin).transpose(0, 1),
                               atol=2e-2, rtol=2e-2)


# --- errors -----------------------------------------------------------------------------------------------------


def test_kv_append_past_s_max_raises_and_writes_nothing():
    cos, sin = kernels.rope_tables(16, 64, 1e4)
    k_cache, v_cache = torch.zeros(1, 10, 16), torch.zeros(1, 10, 16)
    with pytest.raises(KVRangeError, match="overflows"):
        kernels.kv_append(k_cache, v_cache, torch.ones(3, 1, 16), torch.ones(3, 1, 16), 8, cos, sin)
    assert not k_cache.any() and not v_cache.any()
    assert issubclass(KVRangeError, ValueError)


def test_kv_append_beyond_the_rope_tables_raises():
    cos, sin = kernels.rope_tables(16, 4, 1e4)
    with pytest.raises(KVRangeError, match="RoPE tables"):
        kernels.kv_append(torch.zeros(1, 10, 16), torch.zeros(1, 10, 16), torch.ones(2, 1, 16), torch.ones(2, 1, 16),
                          3, cos, sin)


@pytest.mark.parametrize(
    "k_shape,v_shape,match",
    [((2, 2, 16), (2, 1, 16), "k and v"), ((2, 1, 8), (2, 1, 8), "k and v"), ((2, 16), (2, 16), "k and v")],
)
def test_kv_append_rejects_mismatched_shapes(k_shape, v_shape, match):
    cos, sin = kernels.rope_tables(16, 10, 1e4)
    with pytest.raises(ValueError, match=match):
        kernels.kv_append(torch.zeros(1, 10, 16), torch.zeros(1, 10, 16), torch.ones(k_shape), torch.ones(v_shape),
                          0, cos, sin)


def test_kv_append_rejects_a_dtype_mismatch_and_a_non_contiguous_row():
    cos, sin = kernels.rope_tables(16, 10, 1e4)
    k = torch.ones(1, 1, 16)
    with pytest.raises(ValueError, match="dtype|float"):
        kernels.kv_append(torch.zeros(1, 10, 16), torch.zeros(1, 10, 16), k.double(), k, 0, cos, sin)
    strided = torch.zeros(1, 16, 10).transpose(1, 2)  # [1, 10, 16] but not contiguous
    with pytest.raises(ValueError, match="contiguous"):
        kernels.kv_append(strided, strided, k, k, 0, cos, sin)


def test_attention_rejects_bad_shapes_with_a_message_saying_what_to_change():
    k_cache = torch.zeros(2, 10, 16)
    with pytest.raises(ValueError, match=r"multiple of kv heads"):
        kernels.attention(torch.zeros(1, 3, 16), k_cache, k_cache, 0)
    with pytest.raises(ValueError, match="head_dim"):
        kernels.attention(torch.zeros(1, 4, 32), k_cache, k_cache, 0)
    with pytest.raises(ValueError, match=r"\[n, Hq, D\]"):
        kernels.attention(torch.zeros(4, 16), k_cache, k_cache, 0)
    with pytest.raises(KVRangeError):
        kernels.attention(torch.zeros(3, 4, 16), k_cache, k_cache, 8)


def test_attention_c_kernel_reports_a_bad_shape_as_a_status_not_a_crash():
    from ringshm._C import ffi, lib

    buf = torch.zeros(64)
    p = ffi.cast("float *", buf.data_ptr())
    assert lib.ringshm_attn_forward(p, p, p, p, 1, 3, 2, 4, 16, 0, 0, 0.25) == lib.RINGSHM_KERNEL_ERR_SHAPE  # 3 % 2
    assert lib.ringshm_attn_forward(p, p, p, p, 1, 2, 1, 4, 8, 0, 0, 0.25) == lib.RINGSHM_KERNEL_ERR_SHAPE  # D % 16
    assert lib.ringshm_attn_forward(p, p, p, p, 2, 1, 1, 4, 16, 3, 0, 0.25) == lib.RINGSHM_KERNEL_ERR_RANGE  # 3+2 > 4
    assert lib.ringshm_attn_forward(p, p, p, p, 1, 1, 1, 4, 16, 0, -1, 0.25) == lib.RINGSHM_KERNEL_ERR_SHAPE  # window
    assert lib.ringshm_attn_forward(p, p, p, p, 1, 1, 1, 4, 16, 0, 0, 0.0) == lib.RINGSHM_KERNEL_ERR_SHAPE  # scale
    assert lib.ringshm_kv_append(p, p, p, p, p, p, 2, 1, 4, 16, 3, 100) == lib.RINGSHM_KERNEL_ERR_RANGE
