"""The quantized, batch-invariant matmul (csrc/matmul.h, ringshm.model.qmatmul); RMSNorm and the MLP gates are
tests/test_kernels.py.

Closeness is bounded against an fp64 product of the exactly dequantized weights; invariance compares bits
(row i of an M-row product against the same row alone, over M and thread counts); every ISA path this CPU runs
gives the same bits as the portable C one.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf import quants

from ringshm._C import ffi, lib
from ringshm.errors import KernelError
from ringshm.model import dequant
from ringshm.model import qmatmul as qm

U = 2.0 ** -24  # fp32 unit roundoff
NEW_TYPES = [qm.Q5_0, qm.Q5_1, qm.Q4_K, qm.Q5_K, qm.Q6_K, qm.MXFP4]
GGUF_QUANT = {t: QT(t) for t in [qm.Q4_0, qm.Q4_1, qm.Q8_0, *NEW_TYPES]}
FLOAT = {qm.F32: torch.float32, qm.F16: torch.float16, qm.BF16: torch.bfloat16}
ALL_TYPES = [qm.Q4_0, qm.Q4_1, qm.Q8_0, qm.F16, qm.BF16, qm.F32, *NEW_TYPES]
ISAS = [isa for isa in qm.ISA_NAMES if lib.ringshm_isa_supported(isa)]
M_SWEEP = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 25, 32, 33, 64, 256)  # 6-32: the register decode in 2-8 tiles
# Bytes of each quantized block (ggml's GGML_QUANT_SIZES) and where its fp16 scales sit: the rest of a block
# built from random bytes is any integer the type can hold. MXFP4's scale is its E8M0 byte 0 (random_blocks).
BLOCK = {qm.Q5_0: (22, (0,)), qm.Q5_1: (24, (0, 2)), qm.Q4_K: (144, (0, 2)), qm.Q5_K: (176, (0, 2)),
         qm.Q6_K: (210, (208,)), qm.MXFP4: (17, ())}
# The bytes that hold q (zeroed, a block dequantizes to its min term alone: m, or -dmin * m).
Q_BYTES = {qm.Q4_1: slice(4, 20), qm.Q5_1: slice(4, 24), qm.Q4_K: slice(16, 144), qm.Q5_K: slice(16, 176)}


def kfit(qtype: int, k: int) -> int:
    """``k`` rounded up to whole blocks of ``qtype`` (K-quants: 256)."""
    b = qm.block_k(qtype)
    return (k + b - 1) // b * b


def random_blocks(qtype: int, n: int, k: int, seed: int = 0) -> np.ndarray:
    """GGUF bytes ``[n, row_bytes]`` of random blocks: random integers, finite fp16 scales of a sane size; MXFP4's
    E8M0 e near 2^-3 (d = 2^(e - 128), e in 118 .. 129), one block in 8 at e 0 .. 3 (d subnormal for e < 2)."""
    rng = np.random.default_rng(seed)
    size, scale_at = BLOCK[qtype]
    raw = rng.integers(0, 256, size=(n, k // qm.block_k(qtype), size), dtype=np.uint8)
    if qtype == qm.MXFP4:
        tiny = rng.random(raw.shape[:2]) < 0.125
        raw[:, :, 0] = np.where(tiny, rng.integers(0, 4, raw.shape[:2]), rng.integers(118, 130, raw.shape[:2]))
    amp = {qm.Q5_0: 0.1, qm.Q5_1: 0.1}.get(qtype, 0.01)  # K-quant scales multiply a 6-bit sc
    for at in scale_at:
        half = rng.uniform(-amp, amp, size=raw.shape[:2]).astype(np.float16)
        raw[:, :, at:at + 2] = half.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(n, -1)


def make_weight(qtype: int, n: int, k: int, seed: int = 0) -> tuple[qm.RawWeight, torch.Tensor, torch.Tensor]:
    """A random weight in ``qtype``: (RawWeight, its exact fp32 dequantization, |parts| for the error bound).

    Q4_0 / Q4_1 / Q8_0 / Q5_x come from ``gguf.quants.quantize`` of a normal tensor, the K-quants (gguf-py
    does not quantize them) from random blocks. The last item is ``|d q| + |m|`` per weight for the types with
    a min (their two terms are rounded apart), ``|w|`` otherwise.
    """
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    if qtype in GGUF_QUANT:
        gq = GGUF_QUANT[qtype]
        raw = random_blocks(qtype, n, k, seed) if qtype in qm.K_QUANTS else quants.quantize(w.numpy(), gq)
        exact = torch.from_numpy(quants.dequantize(raw, gq)).reshape(n, k).float()
        mag = exact.abs()
        if qtype in Q_BYTES:
            size = raw.shape[-1] // (k // qm.block_k(qtype))
            blocks = raw.reshape(n, -1, size).copy()
            blocks[:, :, Q_BYTES[qtype]] = 0
            m = torch.from_numpy(quants.dequantize(blocks.reshape(n, -1), gq)).reshape(n, k).float()
            mag = (exact - m).abs() + m.abs()
        return qm.RawWeight.from_bytes(qtype, n, k, raw.reshape(-1)), exact, mag
    t = w.to(FLOAT[qtype])
    return qm.RawWeight.from_tensor(t), t.float(), t.float().abs()


# ---- closeness to fp64 ------------------------------------------------------------------------------------

SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536), (1, 32), (7, 64), (33, 96), (16, 32)]


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=[qm.type_name(t) for t in ALL_TYPES])
@pytest.mark.parametrize("n,k", SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
def test_the_product_is_within_the_summation_bound_of_fp64(qtype, n, k):
    k = kfit(qtype, k)
    raw, exact, mag = make_weight(qtype, n, k)
    bias = torch.randn(n)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(1))
    out = qm.PackedWeight(raw, bias).matmul(x, threads=2)
    ref = x.double() @ exact.double().T + bias.double()
    # blocks of 32 summed serially, then one fma per block (+ one for the min): at most k + 40 roundings each
    bound = (k + 40) * U * (x.double().abs() @ mag.double().T + bias.double().abs()) + 1e-30
    err = (out.double() - ref).abs()
    assert out.shape == (5, n) and bool((err <= bound).all()), f"max err {err.max():.3g}, bound {bound.min():.3g}"


def test_the_tied_lm_head_shape_q8_0_576_to_49152_is_close_to_fp64():
    raw, exact, mag = make_weight(qm.Q8_0, 49152, 576)
    x = torch.randn(2, 576)
    out = qm.PackedWeight(raw).matmul(x)
    ref = x.double() @ exact.double().T
    assert bool(((out.double() - ref).abs() <= (576 + 40) * U * (x.double().abs() @ mag.double().T)).all())


def test_a_residual_is_added_after_the_bias():
    raw, exact, _ = make_weight(qm.Q4_1, 48, 64)
    pw, x, res = qm.PackedWeight(raw, torch.randn(48)), torch.randn(3, 64), torch.randn(3, 48)
    assert torch.equal(pw.matmul(x, residual=res), pw.matmul(x) + res)


# ---- batch invariance -------------------------------------------------------------------------------------


def rows_match_alone(matmul, x: torch.Tensor) -> bool:
    """True when every row of ``matmul(x[:m])`` is bitwise the row computed alone, for every m in M_SWEEP."""
    alone = torch.cat([matmul(x[i:i + 1]) for i in range(x.shape[0])])
    return all(torch.equal(matmul(x[:m]), alone[:m]) for m in M_SWEEP)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=[qm.type_name(t) for t in ALL_TYPES])
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("n", [200, 192])
def test_each_row_is_bitwise_the_same_for_every_batch_size_and_thread_count(qtype, threads, n):
    """n = 200: 13 panels, groups and thread splits fall unevenly; 192: 12, a layout group's last 4 panels, which take
    the register decode at the large width (AVX-512) where a whole group takes the small one (M <= 3; Q8_0 and the
    float types up to 12 rows; M <= 2 of the nibble types: one function per group, mm_decode_run). K-quants at two
    super-blocks, so that the sub-blocks of a second one meet the first's accumulators."""
    k = kfit(qtype, 512 if qm.block_k(qtype) == 256 else 96)
    raw, _, _ = make_weight(qtype, n, k)
    pw = qm.PackedWeight(raw, torch.randn(n))
    x = torch.randn(max(M_SWEEP), k)
    assert rows_match_alone(lambda a: pw.matmul(a, threads=threads), x)
    assert torch.equal(pw.matmul(x, threads=threads), pw.matmul(x, threads=1))


@pytest.mark.parametrize("act", ["float32", "int8"])
@pytest.mark.parametrize("qtype", [qm.Q4_1, qm.Q8_0], ids=["Q4_1", "Q8_0"])
@pytest.mark.parametrize("n", [576, 200, 80])
def test_ops_of_4_rows_or_more_split_groups_by_rows_between_threads_and_change_no_bit(n, qtype, act):
    """From 4 rows an op is split between threads by panels x rows (csrc/matmul.c), so a group of panels can be
    shared: its first rows on one thread, the rest on the next. n = 576: 36 panels, 5 groups, the last of 4 (SmolLM2's
    width); 200: 13 panels; 80: 5 panels, one group, so every thread past the first runs rows of it alone. With a
    bias and a residual, each thread count equals one thread bit for bit, and so does each row alone (Q4_1: a min,
    so block sums of x per row; Q8_0: the small width up to 12 rows)."""
    k = kfit(qtype, 512)
    raw, _, _ = make_weight(qtype, n, k)
    pw = qm.PackedWeight(raw, torch.randn(n))
    x, res = torch.randn(37, k), torch.randn(37, n)
    for m in (4, 5, 7, 13, 16, 37):
        one = pw.matmul(x[:m], residual=res[:m], threads=1, activations=act)
        alone = torch.cat([pw.matmul(x[i:i + 1], residual=res[i:i + 1], threads=1, activations=act) for i in range(m)])
        assert torch.equal(one, alone), m
        for threads in (2, 3, 5):
            assert torch.equal(pw.matmul(x[:m], residual=res[:m], threads=threads, activations=act), one), (m, threads)


def test_the_invariance_check_catches_a_split_k_reduction():
    """The deliberate mutation: split K in two halves for M > 1 (what a split-K GEMM does). Same math, other
    rounding order, so the check above must fail on it."""
    raw, _, _ = make_weight(qm.Q8_0, 64, 256)
    lo = qm.PackedWeight(qm.RawWeight.from_tensor(raw.dequantize()[:, :128]))
    hi = qm.PackedWeight(qm.RawWeight.from_tensor(raw.dequantize()[:, 128:]))
    whole = qm.PackedWeight(qm.RawWeight.from_tensor(raw.dequantize()))

    def split_k_when_batched(a):
        return whole.matmul(a) if a.shape[0] == 1 else lo.matmul(a[:, :128]) + hi.matmul(a[:, 128:])

    x = torch.randn(max(M_SWEEP), 256)
    assert rows_match_alone(whole.matmul, x)
    assert not rows_match_alone(split_k_when_batched, x)


def test_torch_linear_is_the_kind_of_kernel_this_replaces():
    """F.linear on the same fp32 weights: rows of a batch need not equal the row alone (here they do not)."""
    w, x = torch.randn(576, 1536), torch.randn(64, 1536)
    alone = torch.cat([torch.nn.functional.linear(x[i:i + 1], w) for i in range(64)])
    assert not torch.equal(torch.nn.functional.linear(x, w), alone)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=[qm.type_name(t) for t in ALL_TYPES])
@pytest.mark.parametrize("isa", ISAS, ids=[qm.ISA_NAMES[i] for i in ISAS])
def test_every_isa_path_gives_the_portable_bits(qtype, isa):
    """n = 299: two whole groups of the packed layout (the small width's paths on AVX-512) and a short one; M = 1, 2
    and 3 take the decode's one-tile paths, 9 its tiles."""
    k = kfit(qtype, 512 if qm.block_k(qtype) == 256 else 160)
    raw, _, _ = make_weight(qtype, 299, k)
    pw = qm.PackedWeight(raw, torch.randn(299))
    x = torch.randn(9, k)
    for m in (1, 2, 3, 9):
        assert torch.equal(pw.matmul(x[:m], isa=isa), pw.matmul(x[:m], isa=lib.RINGSHM_ISA_PORTABLE)), m


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=[qm.type_name(t) for t in ALL_TYPES])
def test_the_row_prefetch_changes_no_bit_on_any_path(qtype):
    """The prefetch of the rows ahead (the CPU's choice per op: ``qm.row_prefetch_for``; forced here) only asks for
    bytes: forced on and forced off, every ISA path this CPU runs (the 8-bit VNNI one too), M = 1 and 3 (one tile of
    the register decode), 8 and 16 (its tiles; the 8-bit slab) and 40 (the slab), 1 and 2 threads, fp32 and, for
    the quantized types, 8-bit activations, give the same bits; over 3 groups of panels, the last one short."""
    k = kfit(qtype, 512)
    raw, _, _ = make_weight(qtype, 16 * 8 * 2 + 16 * 3 - 5, k, seed=5)
    pw = qm.PackedWeight(raw, torch.randn(raw.n))
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(6))
    isas = ISAS + [lib.RINGSHM_ISA_AVX512_VNNI] * bool(lib.ringshm_isa_supported(lib.RINGSHM_ISA_AVX512_VNNI))
    acts = ("float32", "int8") if qtype in qm.QUANTIZED else ("float32",)
    runs = {}
    try:
        for on in (False, True):
            assert qm.set_row_prefetch(on) is on and qm.row_prefetch() is on
            runs[on] = [pw.matmul(x[:m], threads=t, isa=isa, activations=act)
                        for isa in isas for act in acts for t in (1, 2) for m in (1, 3, 8, 16, 40)]
    finally:
        qm.set_row_prefetch(None)
    assert all(torch.equal(a, b) for a, b in zip(runs[False], runs[True], strict=True))


def test_the_row_prefetch_is_the_cpus_choice_unless_forced():
    """The CPU's choice per op (csrc/matmul.c): every op on AMD family 26 (Zen 5) and later; on AMD family 25 with
    AVX-512 (Zen 4) the fp32 ops of 4 rows or more, 6 or more of a float weight, no 8-bit op; no op on any other CPU.
    A forced setting covers every op until None gives it back; anything but a bool or None is refused, in Python and
    in C."""
    info = dict(line.split(":", 1) for line in open("/proc/cpuinfo").read().split("\n\n")[0].splitlines()
                if ":" in line)
    info = {key.strip(): value.strip() for key, value in info.items()}
    amd = info.get("vendor_id") == "AuthenticAMD"
    family = int(info.get("cpu family", 0))
    zen5_or_later = amd and family >= 26
    zen4 = amd and family == 25 and "avx512f" in info.get("flags", "").split()

    def cpus_choice(qtype, m, act):
        return zen5_or_later or (zen4 and act == "float32" and m >= (6 if qtype in (qm.F32, qm.F16, qm.BF16) else 4))

    cases = [(t, m, a) for t in (qm.Q4_K, qm.Q8_0, qm.Q6_K, qm.F16, qm.BF16, qm.F32) for m in (1, 2, 3, 4, 5, 6, 16, 64)
             for a in (("float32", "int8") if t in qm.QUANTIZED else ("float32",))]
    try:
        assert qm.set_row_prefetch(None) is zen5_or_later and qm.row_prefetch() is zen5_or_later
        assert [qm.row_prefetch_for(*c) for c in cases] == [cpus_choice(*c) for c in cases]
        for forced in (True, False):
            assert qm.set_row_prefetch(forced) is forced
            assert all(qm.row_prefetch_for(*c) is forced for c in cases)
        with pytest.raises(TypeError, match="True, False or None"):
            qm.set_row_prefetch(1)
        with pytest.raises(ValueError, match="m >= 1"):
            qm.row_prefetch_for(qm.Q4_K, 0)
        assert lib.ringshm_mm_set_row_prefetch(2) == lib.RINGSHM_MATMUL_ERR_SHAPE
        assert qm.row_prefetch() is False  # a refused mode changes nothing
    finally:
        qm.set_row_prefetch(None)
    assert qm.row_prefetch() is zen5_or_later
    assert [qm.row_prefetch_for(*c) for c in cases] == [cpus_choice(*c) for c in cases]


M_SWEEP_NEW = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 17, 33, 100)


@pytest.mark.parametrize("qtype", NEW_TYPES, ids=[qm.type_name(t) for t in NEW_TYPES])
def test_new_types_give_each_row_its_alone_bits_for_every_m_thread_count_and_isa(qtype):
    """Row m of an M-row product is bitwise the row alone, over M in M_SWEEP_NEW and 1-3 threads, on every ISA
    this CPU runs; and every ISA gives the portable path's bits."""
    k = kfit(qtype, 512)  # two super-blocks: a K-quant's scales change between them
    raw, _, _ = make_weight(qtype, 200, k, seed=3)
    pw = qm.PackedWeight(raw, torch.randn(200))
    x = torch.randn(max(M_SWEEP_NEW), k, generator=torch.Generator().manual_seed(4))
    portable = pw.matmul(x, threads=1, isa=lib.RINGSHM_ISA_PORTABLE)
    for isa in ISAS:
        alone = torch.cat([pw.matmul(x[i:i + 1], threads=1, isa=isa) for i in range(x.shape[0])])
        assert torch.equal(alone, portable), qm.ISA_NAMES[isa]
        for threads in (1, 2, 3):
            for m in M_SWEEP_NEW:
                assert torch.equal(pw.matmul(x[:m], threads=threads, isa=isa), alone[:m]), \
                    (qm.ISA_NAMES[isa], threads, m)


def test_the_best_isa_is_one_this_cpu_runs():
    assert qm.BEST_ISA in ISAS and lib.ringshm_isa_supported(qm.BEST_ISA)


@pytest.mark.parametrize("isa", ISAS)
def test_the_roofline_probes_count_what_they_ran_and_refuse_bad_arguments(isa):
    """The probes bench/bench_roofline.py times: flops = threads x iters x chains x 16 lanes x 2 (12 chains on
    AVX-512, 6 elsewhere), bytes = the buffer's; a bad ISA, size or thread count is refused."""
    chains = 12 if isa == qm.lib.RINGSHM_ISA_AVX512 else 6
    assert qm.fma_probe(1000, 2, isa) == 2 * 1000 * chains * 32
    buf = torch.ones(128 * 1001)  # 4 streams of 250 blocks of 128 floats per thread at 1 thread, and 1 left over
    for threads in (1, 3):
        assert qm.read_probe(buf, threads, isa) == buf.numel() * 4
    sink = ffi.new("float[1]")
    assert lib.ringshm_read_probe(isa, 1, ffi.cast("float *", buf.data_ptr()), buf.numel(), sink) > 0
    assert sink[0] == buf.numel() // 16, "the probe did not read every float once"  # lane 0 of 16: its share
    for bad in (lambda: qm.fma_probe(0, 1, isa), lambda: qm.fma_probe(10, 0, isa), lambda: qm.fma_probe(10, 1, 7),
                lambda: qm.read_probe(torch.ones(100), 1, isa), lambda: qm.read_probe(buf, 0, isa)):
        with pytest.raises(KernelError):
            bad()
    with pytest.raises(ValueError, match="contiguous CPU fp32"):
        qm.read_probe(torch.ones(256, dtype=torch.float64), 1, isa)


# ---- the embedding lookup and dequantization --------------------------------------------------------------


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=[qm.type_name(t) for t in ALL_TYPES])
def test_embedding_rows_are_bitwise_the_gguf_dequantization(qtype):
    raw, exact, _ = make_weight(qtype, 50, kfit(qtype, 64))
    ids = torch.tensor([3, 0, 49, 3], dtype=torch.int64)
    assert torch.equal(qm.embed_rows(raw, ids), exact[ids])
    assert torch.equal(raw.dequantize(), exact)


@pytest.mark.parametrize("qtype", NEW_TYPES, ids=[qm.type_name(t) for t in NEW_TYPES])
def test_new_types_dequantize_bitwise_as_gguf_from_random_blocks(qtype):
    """Every bit pattern of q (random bytes) with finite scales: the loader's dequantize (whole tensor, the C
    block loops), RawWeight.dequantize and the embedding lookup (ringshm_dequant_rows) all equal gguf.quants."""
    n, k = 24, 2 * qm.QK_K
    raw = random_blocks(qtype, n, k, seed=5)
    ref = torch.from_numpy(quants.dequantize(raw, GGUF_QUANT[qtype])).reshape(n, k)
    w = qm.RawWeight.from_bytes(qtype, n, k, raw.reshape(-1))
    assert torch.equal(dequant.dequantize(raw.reshape(-1), qtype, (n, k)), ref)
    assert torch.equal(w.dequantize(), ref)
    ids = torch.tensor([23, 0, 7, 7], dtype=torch.int64)
    assert torch.equal(qm.embed_rows(w, ids), ref[ids])


# ---- MXFP4 (ggml type 39, gpt-oss's experts): E8M0 scale, e2m1 nibbles -----------------------------------


def mxfp4_every_e_and_nibble() -> np.ndarray:
    """256 MXFP4 blocks ``[256, 17]``: block e has scale byte e, and weight j < 16 nibble j, weight j + 16 nibble
    15 - j, so every (E8M0 byte, nibble) pair appears once on each half."""
    blocks = np.zeros((256, 17), dtype=np.uint8)
    blocks[:, 0] = np.arange(256)
    blocks[:, 1:] = np.arange(16, dtype=np.uint8) | (15 - np.arange(16, dtype=np.uint8)) << 4
    return blocks


def test_mxfp4_dequantizes_to_ggufs_bits_at_every_e8m0_byte_and_nibble():
    """Bits, not ==: +0 and -0 compare equal, and nibble 8 must give +0. Every E8M0 byte is a finite power of two
    (e < 2 the subnormals 2^-128, 2^-127; e = 255 is 2^127, not NaN); d * q overflows to inf for e >= 253 and a
    large nibble, as gguf.quants' float32 product does."""
    blocks = mxfp4_every_e_and_nibble()
    with np.errstate(over="ignore"):  # the infs are wanted
        ref = quants.dequantize(blocks, QT.MXFP4).reshape(256, 32).astype(np.float32)  # [e, weight]
    ref_bits = torch.from_numpy(ref.view(np.int32))
    w = qm.RawWeight.from_bytes(qm.MXFP4, 256, 32, blocks.reshape(-1))
    for got in (dequant.dequantize(blocks.reshape(-1), QT.MXFP4, (256, 32)), w.dequantize(),
                qm.embed_rows(w, torch.arange(256))):
        assert torch.equal(got.view(torch.int32), ref_bits)
    bits = ref_bits.numpy().view(np.uint32)
    assert [hex(bits[e, 1]) for e in (0, 1, 2, 128, 254, 255)] == \
        ["0x200000", "0x400000", "0x800000", "0x3f800000", "0x7e800000", "0x7f000000"]  # nibble 1: d itself
    assert (bits[:, [0, 8]] == 0).all()  # nibbles 0 and 8: +0 at every e
    assert np.isinf(ref[253:]).any() and np.isfinite(ref[:253]).all()


def test_mxfp4_scale_is_exactly_two_to_the_e_minus_128_in_the_matmul_for_every_e8m0_byte():
    """Row r of the weight has scale byte r in both its blocks; x holds small integers times 2^-20, so every
    product and sum is exact and out[m, r] = 2^(r - 128) * (x . q): the subnormal d of e < 2 and the 2^127 of
    e = 255 included, on every ISA path, in the register decode (M <= 24) and the slab (M = 30), 1 and 3 threads."""
    rng = np.random.default_rng(7)
    blocks = rng.integers(0, 256, size=(256, 2, 17), dtype=np.uint8)
    blocks[:, :, 0] = np.arange(256)[:, None]
    nibbles = np.stack([blocks[:, :, 1:] & 15, blocks[:, :, 1:] >> 4], axis=2).reshape(256, 64)  # weight order
    d = torch.pow(2.0, torch.arange(256, dtype=torch.float64) - 128)  # [256]
    w64 = torch.tensor(qm.MXFP4_KVALUES, dtype=torch.float64)[torch.from_numpy(nibbles.astype(np.int64))] * d[:, None]
    x = torch.from_numpy(rng.integers(-2, 3, size=(30, 64)).astype(np.float32)) * 2.0 ** -20
    want = x.double() @ w64.T  # exact in fp64, and representable in fp32
    assert torch.equal(want.float().double(), want)
    pw = qm.PackedWeight(qm.RawWeight.from_bytes(qm.MXFP4, 256, 64, blocks.reshape(-1)))
    for isa in ISAS:
        for m in (1, 2, 5, 24, 30):
            for threads in (1, 3):
                assert torch.equal(pw.matmul(x[:m], threads=threads, isa=isa).double(), want[:m]), \
                    (qm.ISA_NAMES[isa], m, threads)


def test_mxfp4_gives_the_bits_of_its_exact_f32_dequantization():
    """d is a power of two, so the contract's d * (sum of x q) is the F32 weight's sum of x (d q) step for step
    (scaling by 2^j commutes with each rounding while nothing is subnormal or overflows): an MXFP4 weight and
    its exact dequantization give the same bits, at every M and on every ISA path."""
    raw, exact, _ = make_weight(qm.MXFP4, 200, 512, seed=8)
    mx, f32 = qm.PackedWeight(raw), qm.PackedWeight(qm.RawWeight.from_tensor(exact))
    x = torch.randn(40, 512, generator=torch.Generator().manual_seed(9))
    for isa in ISAS:
        for m in (1, 4, 13, 40):
            assert torch.equal(mx.matmul(x[:m], isa=isa), f32.matmul(x[:m], isa=isa)), (qm.ISA_NAMES[isa], m)


# matmul.h's layout: the bytes of a panel block's head (the fields before its first row of weights), and of each
# unit of the rest (64, or the whole rest where it is assembled as bytes first: the Q5 types, Q6_K)
HEAD_BYTES = {qm.F32: 0, qm.F16: 0, qm.BF16: 0, qm.Q4_0: 32, qm.Q4_1: 64, qm.Q5_0: 32, qm.Q5_1: 64, qm.Q8_0: 32,
              qm.MXFP4: 16, qm.Q4_K: 256, qm.Q5_K: 256, qm.Q6_K: 288}
UNIT_BYTES = {qm.Q5_0: 320, qm.Q5_1: 320, qm.Q5_K: 2560, qm.Q6_K: 3072}


def panel_blocks(packed: np.ndarray, qtype: int, n: int, k: int) -> np.ndarray:
    """The packed bytes as ``[panel, block, panel block bytes]``, each panel block whole, read by matmul.h's
    layout: groups of 8 panels (the last one shorter: gw), a group's rows of blocks, a row the gw heads side by side
    and then the bodies' units, unit u of every panel before unit u + 1."""
    bk = max(qm.block_k(qtype), 32)  # a float type's packed block: 32 k
    pbb, nb, n_panels, hb = lib.ringshm_qmat_packed_bytes(qtype, 16, bk), -(-k // bk), -(-n // 16), HEAD_BYTES[qtype]
    ub = UNIT_BYTES.get(qtype, 64)
    assert packed.size == n_panels * nb * pbb and (pbb - hb) % ub == 0
    out = np.zeros((n_panels, nb, pbb), dtype=np.uint8)
    for g0 in range(0, n_panels, 8):
        gw = min(8, n_panels - g0)
        for b in range(nb):
            row = packed[(g0 * nb + b * gw) * pbb:(g0 * nb + (b + 1) * gw) * pbb]
            out[g0:g0 + gw, b, :hb] = row[:gw * hb].reshape(gw, hb)
            out[g0:g0 + gw, b, hb:] = row[gw * hb:].reshape(-1, gw, ub).transpose(1, 0, 2).reshape(gw, -1)
    return out


def test_mxfp4_packs_into_the_files_bytes_e_bytes_then_q4_0s_nibble_words():
    """matmul.h's layout: a panel block is e u8[16] | the nibble words exactly as Q4_0 packs the same qs bytes
    (272 = 16 x 17 bytes), rows past N zero; the sizes are the file's (17 B a block) and 16-row panels of it."""
    n, k = 20, 64
    mx = random_blocks(qm.MXFP4, n, k, seed=10).reshape(n, k // 32, 17)
    q40 = np.zeros((n, k // 32, 18), dtype=np.uint8)
    q40[:, :, 2:] = mx[:, :, 1:]  # the same nibbles, d = 0
    assert lib.ringshm_qmat_src_bytes(qm.MXFP4, n, k) == n * 2 * 17 == qm.row_bytes(qm.MXFP4, k) * n
    assert lib.ringshm_qmat_packed_bytes(qm.MXFP4, n, k) == 2 * 2 * 272  # 2 panels x 2 blocks
    pm = panel_blocks(qm.PackedWeight(qm.RawWeight.from_bytes(qm.MXFP4, n, k, mx.reshape(-1))).packed.numpy(),
                      qm.MXFP4, n, k)
    p4 = panel_blocks(qm.PackedWeight(qm.RawWeight.from_bytes(qm.Q4_0, n, k, q40.reshape(-1))).packed.numpy(),
                      qm.Q4_0, n, k)
    assert (pm[:, :, 16:] == p4[:, :, 32:]).all()
    e = np.zeros((32, 2), dtype=np.uint8)
    e[:n] = mx[:, :, 0]
    assert (pm[:, :, :16] == e.reshape(2, 16, 2).transpose(0, 2, 1)).all()  # [panel, row, block] -> [.., block, row]


@pytest.mark.parametrize("qtype", [qm.Q5_0, qm.Q8_0, qm.Q4_K, qm.Q5_K, qm.Q6_K, qm.F16, qm.F32])
@pytest.mark.parametrize("n", [16 * 11 - 5, 16 * 8, 16 * 3])
def test_panels_pack_in_groups_of_8_each_row_field_by_field(qtype, n):
    """matmul.h's layout: each panel block of an N-row weight, read back from its group's row (heads side by side,
    then the units of the bodies panel by panel), is the block that panel packs into on its own (16 rows:
    a group of one, stored whole); a row of a group starts with the d of its panels' rows (f16 [16] each)."""
    k = kfit(qtype, 96)
    raw = random_blocks(qtype, n, k, seed=11) if qtype in BLOCK else \
        make_weight(qtype, n, k, seed=11)[0].data.numpy().reshape(n, -1)
    packed = qm.PackedWeight(qm.RawWeight.from_bytes(qtype, n, k, raw.reshape(-1))).packed.numpy()
    blocks = panel_blocks(packed, qtype, n, k)
    for p in range(blocks.shape[0]):
        rows = np.zeros((16, raw.shape[1]), dtype=np.uint8)
        rows[:min(16, n - 16 * p)] = raw[16 * p:16 * p + 16]
        alone = qm.PackedWeight(qm.RawWeight.from_bytes(qtype, 16, k, rows.reshape(-1))).packed.numpy()
        assert (blocks[p] == alone.reshape(blocks.shape[1:])).all(), p
    if qtype in (qm.Q5_0, qm.Q8_0):  # the heads of row (group 0, block 0): d f16 of rows 0 .. 16 gw - 1
        gw = min(8, blocks.shape[0])  # every case fills its first group's rows
        assert (packed[:32 * gw].reshape(16 * gw, 2) == raw.reshape(n, k // 32, -1)[:16 * gw, 0, :2]).all()


def test_count_nonfinite_counts_the_mxfp4_blocks_whose_weights_overflow():
    """An E8M0 scale is never NaN or Inf as ggml reads it; a block counts when a weight of it dequantizes to inf:
    e >= 253 with |kvalue| >= 2^(256 - e) (e = 253: 8 and 12; 254: 4 and up; 255: 2 and up), checked against
    gguf.quants over random nibbles at e 248 .. 255 and the edges written out."""
    rng = np.random.default_rng(11)
    blocks = rng.integers(0, 256, size=(4000, 17), dtype=np.uint8)
    blocks[:, 1:] &= rng.choice(np.array([0x33, 0x77, 0xFF], dtype=np.uint8), size=(4000, 1))  # small nibbles too
    blocks[:, 0] = rng.integers(248, 256, size=4000)
    # one nonzero nibble each: 12 x 2^124, 6 x 2^125 finite; 8 x 2^125 inf; 3 x 2^126, -1 x 2^127 finite;
    # -2 x 2^127 -inf
    edges = np.zeros((6, 17), dtype=np.uint8)
    edges[:, 0] = [252, 253, 253, 254, 255, 255]
    edges[:, 1] = [0x07, 0x05, 0x60, 0x03, 0x09, 0xA0]
    blocks = np.concatenate([blocks, edges])
    with np.errstate(over="ignore"):
        want = int((~np.isfinite(quants.dequantize(blocks, QT.MXFP4))).any(axis=-1).sum())
    got = qm.count_nonfinite(qm.RawWeight.from_bytes(qm.MXFP4, len(blocks), 32, blocks.reshape(-1)))
    assert got == (want, "blocks") and 0 < want < len(blocks)
    assert qm.count_nonfinite(qm.RawWeight.from_bytes(qm.MXFP4, 6, 32, edges.reshape(-1))) == (2, "blocks")
    fine = random_blocks(qm.MXFP4, 8, 64)  # realistic and subnormal scales: nothing counted
    assert qm.count_nonfinite(qm.RawWeight.from_bytes(qm.MXFP4, 8, 64, fine.reshape(-1))) == (0, "blocks")


def test_concatenated_rows_keep_their_encoding_and_mixed_ones_become_f32():
    a, _, _ = make_weight(qm.Q4_1, 16, 64)
    b, _, _ = make_weight(qm.Q4_1, 8, 64, seed=1)
    c, _, _ = make_weight(qm.Q8_0, 8, 64, seed=2)
    same = qm.concat_rows([a, b])
    assert same.qtype == qm.Q4_1 and same.n == 24 and torch.equal(same.dequantize(),
                                                                   torch.cat([a.dequantize(), b.dequantize()]))
    mixed = qm.concat_rows([a, c])
    assert mixed.qtype == qm.F32 and torch.equal(mixed.dequantize(), torch.cat([a.dequantize(), c.dequantize()]))


@pytest.mark.parametrize("qtype", [qm.Q4_0, qm.Q4_1, qm.Q5_0, qm.Q5_1, qm.Q8_0, qm.Q4_K, qm.Q5_K, qm.Q6_K, qm.MXFP4,
                                   qm.F16, qm.BF16, qm.F32])
def test_stacked_parts_pack_to_the_bytes_of_their_concatenation(qtype):
    """PackedWeight([a, b, c, d]) packs each part's rows from where they lie (ringshm_qmat_pack_rows): byte for
    byte what packing concat_rows of them gives, with part sizes that split panels (5, 19, 40, 3 rows), a part that
    is a view of rows of a larger tensor (RawWeight.rows of a run: no copy), one that is a reordering (a copy) and
    one whose rows sit further apart than their length (a strided view); floats at a K that ends in a short block."""
    k = kfit(qtype, 96) if qtype not in (qm.F16, qm.BF16, qm.F32) else 100
    big = make_weight(qtype, 64, k, seed=3)[0]
    a, b = make_weight(qtype, 5, k, seed=4)[0], big.rows(torch.arange(7, 26))
    c = big.rows(torch.randperm(64, generator=torch.Generator().manual_seed(5))[:40])
    wide = torch.zeros(3, big.data.shape[1] + 24, dtype=torch.uint8)
    wide[:, :big.data.shape[1]] = make_weight(qtype, 3, k, seed=6)[0].data
    d = qm.RawWeight(qtype, 3, k, wide[:, :big.data.shape[1]])
    assert b.data.data_ptr() == big.data[7:].data_ptr() and d.data.stride(0) > d.data.shape[1]
    bias = torch.randn(67)
    stacked, whole = qm.PackedWeight([a, b, c, d], bias), qm.PackedWeight(qm.concat_rows([a, b, c, d]), bias)
    assert stacked.n == whole.n == 67 and torch.equal(stacked.packed, whole.packed)
    x = torch.randn(3, k)
    assert torch.equal(stacked.matmul(x), whole.matmul(x))


def test_stacked_parts_of_two_encodings_pack_as_their_f32_concatenation():
    a, b = make_weight(qm.Q4_K, 5, 256)[0], make_weight(qm.Q6_K, 3, 256, seed=1)[0]
    mixed = qm.PackedWeight([a, b])
    assert mixed.qtype == qm.F32 and torch.equal(mixed.packed, qm.PackedWeight(qm.concat_rows([a, b])).packed)


def test_rows_of_a_run_is_a_view_and_any_other_order_indexes():
    w = make_weight(qm.Q4_1, 6, 64)[0]
    assert w.rows(torch.arange(2, 5)).data.data_ptr() == w.data[2:].data_ptr()
    assert torch.equal(w.rows(torch.arange(-2, 0)).data, w.data[4:])  # negative: as indexing reads them
    with pytest.raises(IndexError):
        w.rows(torch.tensor([5, 6, 7]))  # past the end: indexing's error, not a shape one


def test_pack_rows_refuses_a_null_row_or_table_a_wrong_size_and_parts_of_different_k():
    w = make_weight(qm.Q4_1, 2, 64)[0]
    dst = torch.zeros(lib.ringshm_qmat_packed_bytes(qm.Q4_1, 2, 64), dtype=torch.uint8)
    out = ffi.cast("uint8_t *", dst.data_ptr())
    rows = ffi.new("const uint8_t *[2]", [ffi.cast("uint8_t *", w.data.data_ptr()), ffi.NULL])
    assert lib.ringshm_qmat_pack_rows(qm.Q4_1, rows, 2, 64, out, dst.numel()) == lib.RINGSHM_MATMUL_ERR_SIZE
    assert lib.ringshm_qmat_pack_rows(qm.Q4_1, ffi.NULL, 2, 64, out, dst.numel()) == lib.RINGSHM_MATMUL_ERR_SIZE
    rows[1] = ffi.cast("uint8_t *", w.data.data_ptr()) + w.data.shape[1]
    assert lib.ringshm_qmat_pack_rows(qm.Q4_1, rows, 2, 64, out, dst.numel() - 1) == lib.RINGSHM_MATMUL_ERR_SIZE
    assert not dst.any()  # nothing written by a refusal
    with pytest.raises(ValueError, match="parts of one K"):
        qm.PackedWeight([w, make_weight(qm.Q4_1, 2, 96)[0]])
    with pytest.raises(ValueError, match="got none"):
        qm.PackedWeight([])


# ---- bad input --------------------------------------------------------------------------------------------


def test_k_not_a_multiple_of_the_block_is_refused_for_quantized_types():
    with pytest.raises(ValueError, match="multiple of 32"):
        qm.RawWeight(qm.Q4_1, 4, 48, torch.zeros(4, 30, dtype=torch.uint8))


def test_a_buffer_shorter_than_the_shape_needs_is_refused():
    with pytest.raises(ValueError, match="takes 160 bytes, got 150"):
        qm.RawWeight.from_bytes(qm.Q4_1, 4, 64, np.zeros(150, dtype=np.uint8))


def test_an_unknown_gguf_type_is_refused_with_the_supported_list():
    with pytest.raises(ValueError, match="Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, BF16, MXFP4"):
        qm.row_bytes(int(QT.Q3_K), 256)


def test_a_k_quant_row_that_is_not_whole_super_blocks_is_refused_and_left_to_dequantize():
    """Gemma 3 270M's 640-wide rows: ggml stores them as Q5_0; a K-quant of that width is not read natively."""
    with pytest.raises(ValueError, match="multiple of 256"):
        qm.row_bytes(qm.Q4_K, 640)
    assert not qm.native_ok(qm.Q6_K, 16, 640) and qm.native_ok(qm.Q5_0, 16, 640)
    assert qm.native_ok(qm.Q4_K, 16, 768) and qm.row_bytes(qm.Q4_K, 768) == 3 * 144


def test_x_of_the_wrong_dtype_or_width_is_refused():
    pw = qm.PackedWeight(make_weight(qm.Q8_0, 16, 64)[0])
    with pytest.raises(ValueError, match=r"fp32 CPU x \[M, 64\]"):
        pw.matmul(torch.zeros(2, 64, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"fp32 CPU x \[M, 64\]"):
        pw.matmul(torch.zeros(2, 32))
    with pytest.raises(ValueError, match="residual"):
        pw.matmul(torch.zeros(2, 64), residual=torch.zeros(3, 16))


def test_token_ids_outside_the_table_are_refused_before_anything_is_written():
    with pytest.raises(ValueError, match="token id 50 outside the vocabulary"):
        qm.embed_rows(make_weight(qm.Q8_0, 50, 32)[0], torch.tensor([1, 50]))


def test_the_c_side_rechecks_sizes_shapes_and_isas():
    raw = make_weight(qm.Q4_1, 16, 64)[0]
    pw = qm.PackedWeight(raw)
    x, out = torch.zeros(1, 64), torch.zeros(1, 16)

    bias = torch.zeros(16)

    def call(packed_bytes=pw.nbytes, k=64, ldo=16, isa=lib.RINGSHM_ISA_PORTABLE, qtype=qm.Q4_1, bias_len=None):
        return lib.ringshm_qmat_matmul(qtype, ffi.cast("uint8_t *", pw.packed.data_ptr()), packed_bytes, 16, k,
                                       ffi.cast("float *", x.data_ptr()), 1, ffi.cast("float *", out.data_ptr()),
                                       ldo, ffi.NULL if bias_len is None else ffi.cast("float *", bias.data_ptr()),
                                       bias_len or 0, ffi.NULL, 0, 1, isa)

    assert call() == lib.RINGSHM_MATMUL_OK
    assert call(bias_len=16) == lib.RINGSHM_MATMUL_OK
    assert call(bias_len=15) == lib.RINGSHM_MATMUL_ERR_SIZE  # a bias of another width than N is never read
    assert call(packed_bytes=pw.nbytes - 1) == lib.RINGSHM_MATMUL_ERR_SIZE
    assert call(k=48) == lib.RINGSHM_MATMUL_ERR_SHAPE
    assert call(ldo=15) == lib.RINGSHM_MATMUL_ERR_SHAPE
    assert call(isa=7) == lib.RINGSHM_MATMUL_ERR_TYPE
    assert call(qtype=int(QT.Q3_K)) == lib.RINGSHM_MATMUL_ERR_TYPE
    src = raw.data.contiguous()
    dst = torch.empty(pw.nbytes, dtype=torch.uint8)
    assert lib.ringshm_qmat_pack(qm.Q4_1, ffi.cast("uint8_t *", src.data_ptr()), src.numel() - 20, 16, 64,
                                 ffi.cast("uint8_t *", dst.data_ptr()), dst.numel()) == lib.RINGSHM_MATMUL_ERR_SIZE


# ---- findings of a hostile review (each reproduced on the code before its fix) ---------------------------


def test_every_thread_count_gives_the_same_bits_in_the_callers_flush_to_zero_mode():
    """The FP mode is per thread; OpenMP's pool workers keep their own unless the call hands them the caller's."""
    pw = qm.PackedWeight(qm.RawWeight.from_tensor(torch.full((64, 32), 0.5)))
    x = torch.full((1, 32), 1e-39)  # products are subnormal: flushed or not depending on the mode
    pw.matmul(x, threads=2)  # the pool exists before the mode changes
    was = torch.set_flush_denormal(True)
    try:
        one, two = pw.matmul(x, threads=1), pw.matmul(x, threads=2)
    finally:
        torch.set_flush_denormal(False)
    assert was and torch.equal(one, two) and torch.equal(one, torch.zeros(1, 64))


def test_mxfp4_subnormal_scales_follow_the_callers_denormals_are_zero_mode_on_every_path():
    """e < 2 gives a subnormal d (2^-128, 2^-127), assembled from bits, so no FP mode changes d itself; the fma
    that reads it follows the caller's mode (torch's flush_denormal sets FTZ and DAZ: d reads as 0) alike on every
    ISA path and thread count, and with the mode off the product is nonzero."""
    rng = np.random.default_rng(12)
    blocks = rng.integers(0, 256, size=(64, 2, 17), dtype=np.uint8)
    blocks[:, :, 0] = rng.integers(0, 2, size=(64, 2))
    pw = qm.PackedWeight(qm.RawWeight.from_bytes(qm.MXFP4, 64, 64, blocks.reshape(-1)))
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(13)) * 2.0 ** 100  # x d q ~ 2^-25: normal
    pw.matmul(x, threads=2)  # the pool exists before the mode changes
    was = torch.set_flush_denormal(True)
    try:
        daz = [pw.matmul(x, isa=isa, threads=t) for isa in ISAS for t in (1, 2)]
    finally:
        torch.set_flush_denormal(False)
    plain = [pw.matmul(x, isa=isa, threads=t) for isa in ISAS for t in (1, 2)]
    assert was and all(torch.equal(o, torch.zeros(5, 64)) for o in daz)
    assert all(torch.equal(o, plain[0]) for o in plain) and bool((plain[0] != 0).any())


def test_an_output_overlapping_x_or_the_residual_is_refused_in_c():
    pw = qm.PackedWeight(make_weight(qm.F32, 32, 64)[0])
    x, res = torch.randn(3, 64), torch.randn(3, 32)

    def call(out, residual):
        p = ffi.cast("float *", out.data_ptr())
        return lib.ringshm_qmat_matmul(pw.qtype, pw._ptr, pw.nbytes, 32, 64, ffi.cast("float *", x.data_ptr()), 3,
                                       p, 32, ffi.NULL, 0, ffi.cast("float *", residual.data_ptr()), 32, 1, 0)

    assert call(res, res) == lib.RINGSHM_MATMUL_ERR_ALIAS  # the sums would overwrite the residual
    assert call(x[:, :32], res) == lib.RINGSHM_MATMUL_ERR_ALIAS  # nor x
    assert call(torch.empty(3, 32), res) == lib.RINGSHM_MATMUL_OK


def test_ids_and_residuals_on_another_device_or_broadcast_are_handled_before_c():
    raw = make_weight(qm.Q8_0, 10, 32)[0]
    with pytest.raises(ValueError, match="on meta"):
        qm.PackedWeight(raw).matmul(torch.randn(3, 32), residual=torch.empty(3, 10, device="meta"))
    with pytest.raises((ValueError, RuntimeError, NotImplementedError)):
        qm.embed_rows(raw, torch.tensor([1, 2], device="meta"))  # copied to the CPU first: no device pointer in C
    pw, x, row = qm.PackedWeight(raw), torch.randn(3, 32), torch.randn(10)
    assert torch.equal(pw.matmul(x, residual=row.expand(3, 10)), pw.matmul(x) + row)


def test_a_q4_1_weight_too_wide_for_the_kernel_is_dequantized_at_load_with_a_reason():
    assert not qm.native_ok(qm.Q4_1, 4, 65568) and qm.native_ok(qm.Q4_1, 4, 65536)
    with pytest.raises(ValueError, match="K <= 65536"):
        qm.row_bytes(qm.Q4_1, 65568)
    assert lib.ringshm_qmat_packed_bytes(qm.F32, 2**31 - 2, 2**31 - 2) < 0  # sizes that overflow int64 are refused


def test_the_c_layer_refuses_a_shape_it_cannot_attend_before_writing_the_cache():
    shape = ffi.new("struct ringshm_layer_shape *", dict(hidden=16, n_heads=3, n_kv_heads=2, head_dim=16, inter=8,
                                                         n_pos=4, rms_eps=1e-5))
    assert lib.ringshm_layer_work_floats(shape, 1) == lib.RINGSHM_KERNEL_ERR_SHAPE  # 3 heads over 2 KV heads
