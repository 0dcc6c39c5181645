/* ringshm matmul over GGUF weight encodings: out[M, N] = x[M, K] . W[N, K]^T (+ bias) (+ residual), and the
 * per-row ops around it (RMSNorm, SwiGLU), all batch-invariant by construction.
 *
 * Weights stay in their checkpoint encoding. ringshm_qmat_pack rearranges a GGUF tensor's bytes (N rows of K,
 * row-major, ggml's ggml-common.h block layouts: csrc/gguf_blocks.h) into panels of 16 output rows, so that SIMD
 * lanes run over output rows n and the reduction walks K one position at a time. Nothing is dequantized to a
 * full fp32 copy, and every quantized type packs into exactly the file's bytes (16 rows x its block):
 *
 *   type  GGUF block, per row                      packed, per panel (16 rows n) per block                    B
 *   Q4_0   32 w  18 B: d | qs[16]                  d f16[16] | qs u32[4 g][16 n]                            288
 *   Q4_1   32 w  20 B: d | m | qs[16]              d f16[16] | m f16[16] | qs u32[4 g][16 n]                320
 *   Q5_0   32 w  22 B: d | qh[4] | qs[16]          d f16[16] | qh u8[4 r][16 n] | qs u8[16 j][16 n]         352
 *   Q5_1   32 w  24 B: d | m | qh[4] | qs[16]      d f16[16] | m f16[16] | qh u8[4 r][16 n] | qs ..         384
 *   Q8_0   32 w  34 B: d | qs i8[32]               d f16[16] | qs i8[32 k][16 n]                            544
 *   MXFP4  32 w  17 B: e | qs[16]                  e u8[16] | qs u32[4 g][16 n]                             272
 *   Q4_K  256 w 144 B: d | dmin | scales[12] |     d f16[16] | dmin f16[16] | scales u8[12][16 n] |
 *                      qs[128]                       8 sub-blocks s x ( qs u32[4 g][16 n] )                2304
 *   Q5_K  256 w 176 B: Q4_K's | qh[32] | qs[128]   d f16[16] | dmin f16[16] | scales u8[12][16 n] |
 *                                                    8 sub-blocks s x ( qh u8[4 r][16 n] | qs u8[16 j][16 n] )
 *                                                                                                         2816
 *   Q6_K  256 w 210 B: ql[128] | qh[64] |          d f16[16] | sc i8[16 i][16 n] | 8 sub-blocks s x
 *                      scales i8[16] | d               ( ql u8[16 j][16 n] | qh u8[8 r][16 n] )             3360
 *   F16, BF16   2 B a weight                       w u16[32 k][16 n]                                       1024
 *   F32         4 B a weight                       w f32[32 k][16 n]                                       2048
 *
 *   Packed nibble byte (j, n): low nibble = the low 4 bits of weight 2j of row n in its block of 32 (a K-quant's
 *   sub-block s of 32), high nibble = weight 2j + 1, so the walk over k is in order (in GGUF, weights j and
 *   j + 16 share a byte; in a K-quant, sub-blocks 2c and 2c + 1 share 32 bytes). Q4_0, Q4_1, Q4_K and MXFP4 hold
 *   the same bytes as words: word (g, n) = bytes (j = 4g .. 4g + 3, n) in order, little-endian, so its nibble i is
 *   weight 8g + i of row n and one shift brings any of them to a lane's low bits. The high bits go where a byte
 *   SIMD op finds them for 64 nibble bytes (4 rows j) at once, with one shift for all:
 *   Q5 qh byte (r, n), r < 4: bits 2a, 2a + 1 = bit 4 of the two weights of nibble row j = 4a + r.
 *   Q6_K qh byte (r, n), r < 8: bits 0-3 hold nibble row j = 8 (r / 4) + r % 4, bits 4-7 row j + 4; each row as
 *   bits 4, 5 of weight 2j in its bits 0-1 and of weight 2j + 1 in bits 2-3. sc (i, n) = the file's int8 scale
 *   of the super-block's weights 16i .. 16i + 15 of row n.
 *   Q4_K / Q5_K scales: the file's 12 bytes of row n as they are; the 6-bit scales and mins are unpacked when
 *   a block is read (a few integer ops per 16 rows, csrc/gguf_blocks.h draws the packing).
 *   Panels come in groups of 8 (RINGSHM_PANEL_GROUP; the last group holds what is left: gw panels), stored one
 *   after another; a group holds its rows of blocks along K in order (K / 32, K / 256 for the K-quants, ceil(K / 32)
 *   for floats), a row being block b of each of its panels, field by field (ringshm_block_at): a panel block's
 *   head (the fields before its first row of weights above: d, m, e, the K-quant scales; 0 to 288 bytes) of each of
 *   the gw panels side by side, then its body (the rest) unit by unit: unit 0 of each panel, unit 1 of each, ...
 *   A unit is 64 bytes (one 64-byte load) where the kernels read a block 64 bytes at a time across the panels of a
 *   step (Q4_0, Q4_1, Q4_K, MXFP4, Q8_0, floats), so a thread that runs a group through K at M = 1 on AVX-512
 *   (8 panels a step) reads its weights as one stream in the order they are stored (AVX2's 4 panels a step read
 *   half of each row's units, then the other half); the whole body for the Q5 types and Q6_K, whose bytes are
 *   assembled panel by panel first (a unit of a block of 32 there read 1.2-1.4 x slower). M = 1 from memory, 2
 *   threads, 2048 -> 16384, AMD EPYC Zen 4, alternating processes against each panel block whole in a row (the
 *   layout before the units): Q8_0 0.80-1.63 against 2.11-3.11 ms, F16 2.45-2.91 against 4.21-6.95, BF16 2.09-2.73
 *   against 3.93-4.72, Q4_1 0.80-0.94 against 0.86-1.69; Q4_K, MXFP4, Q5_K, Q6_K within the noise (on one Zen 4,
 *   a read of 8 interleaved runs of 544 or 1,024 bytes, 64 bytes at a time, streamed 17-24 GB/s against 28-30 for
 *   a sequential read). Those whole panel blocks in rows had read 1.1-1.3 x the speed of each panel's blocks
 *   together (8 streams) on an AMD EPYC Zen 5; the units against them are not measured there (the units with and
 *   without the row prefetch are: matmul.c). Rows of the last panel past N
 *   are zero. Float types allow any K (the last block is cut short); Q4_0 .. Q8_0 and MXFP4 need K % 32 == 0, the
 *   K-quants K % 256 == 0.
 *
 * The reduction (the contract every path, every M and every thread count follows, lane by lane). K runs in
 * blocks b of 32 (for a K-quant, the 8 sub-blocks of each super-block in order); for each block:
 *
 *     type    q[n, k]                                    d[n, b]                m[n, b]
 *     Q4_0    nibble - 8                                 d                      -
 *     Q4_1    nibble                                     d                      m
 *     Q5_0    5-bit value - 16                           d                      -
 *     Q5_1    5-bit value                                d                      m
 *     Q8_0    int8                                       d                      -
 *     MXFP4   kvalues[nibble]                            2^(e - 128)            -
 *     Q4_K    nibble                                     d * sc[s]              (-dmin) * m[s]
 *     Q5_K    5-bit value                                d * sc[s]              (-dmin) * m[s]
 *     Q6_K    6-bit value - 32                           d * sc[k / 16], per half of 16 (below)
 *     floats  the weight itself                          1                      -
 *
 *     fp16 fields are widened to fp32 (exact). The K-quant products are exact in fp32 (an 11-bit significand
 *     times a 6- or 8-bit integer), so Q4_K / Q5_K's m is exactly -(dmin * m[s]) (a zero's sign included:
 *     ggml's w = d sc q - dmin m), and d * sc is the value ggml and gguf.quants compute.
 *     MXFP4 (ggml's block_mxfp4, the gpt-oss experts): kvalues = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6,
 *     -8, -12}, the e2m1 values doubled (ggml's kvalues_mxfp4; nibble 8 is +0, not -0), and d = 2^(e - 128), half
 *     the E8M0 scale 2^(e - 127) to undo the doubling, with ggml_e8m0_to_fp32_half's bits: (e - 1) << 23 for
 *     e >= 2, the subnormals 0x00200000 << e (2^-128, 2^-127) for e < 2, and e = 255 is 2^127 (not NaN). d is
 *     built from e's bits by integer ops, so flush-to-zero cannot change it (denormals-are-zero makes the fma read
 *     a subnormal d as 0, on every path alike: the caller's mode, below); q is a small integer and d a power of
 *     two, so ggml's w = d * q is exact in fp32 wherever it is finite (it overflows for e >= 253 and a large
 *     nibble, 8 x 2^125 = 2^128; the reduction forms d * t, never d * q).
 *
 *     acc = 0
 *     for each block b in order:
 *         t = 0;  for k in the block in order:  t = fma(x[m, k], q[n, k], t)
 *         acc = fma(d[n, b], t, acc)
 *         types with a min (Q4_1, Q5_1, Q4_K, Q5_K):  acc = fma(m[n, b], s[m, b], acc)   s = block sum of x, below
 *     Q6_K, whose scales cover 16 weights, runs each block of 32 as two such chains of 16 k in order, each closed
 *         by acc = fma(d * sc[half], t, acc): no sum of 16 is needed (it has no min), and no multiply per weight.
 *     out[m, n] = acc;  then out += bias[n];  then out += residual[m, n]       (each a rounded fp32 op)
 *
 *     s[m, b] = sum of x[m, 32b .. 32b + 31] by a fixed tree: v[l] = x[l] + x[l + 16] (l < 16), then pairs
 *               (l, l + 8), (l, l + 4), (l, l + 2), (l, l + 1).
 *
 * fma is the IEEE fused multiply-add (one rounding), so every path (AVX-512, AVX2 + FMA, portable C with
 * fmaf) computes the same bits; the SIMD files are built with fp-contract off so the compiler adds no fusions
 * of its own. Each (m, n) depends only on x[m, :], W[n, :] and bias/residual at (m, n): not on M, on the rows
 * next to it in the op, or on the thread count. Threads split the panels (output rows: whole groups) and, from 4
 * rows, a group's rows of x (matmul.c), never K.
 * Algebraically this is x . (d q + m) summed over k, i.e. the fp32-dequantized product up to rounding order.
 *
 * Memory: the caller owns every buffer; nothing here allocates, prints or keeps state. Scratch is on the stack
 * of each thread, sized to the call: one dequantized block of up to 8 panels when M <= 3 (17 KiB with its
 * scales), else a slab of up to 4 blocks of 4 panels (35 KiB), 4 KiB for the Q5 / Q6 bit fields and, for the
 * types with a min, the block sums of x for a chunk of rows (up to 48 KiB): at most ~90 KiB, under the 128 KiB
 * of a musl thread stack (glibc's default is 2-8 MiB).
 */
#ifndef RINGSHM_MATMUL_H
#define RINGSHM_MATMUL_H

#include <stdint.h>

/* CDEF BEGIN */
/* Weight encodings: ggml's type codes (gguf.GGMLQuantizationType). */
enum ringshm_wtype {
    RINGSHM_W_F32 = 0,
    RINGSHM_W_F16 = 1,
    RINGSHM_W_Q4_0 = 2,
    RINGSHM_W_Q4_1 = 3,
    RINGSHM_W_Q5_0 = 6,
    RINGSHM_W_Q5_1 = 7,
    RINGSHM_W_Q8_0 = 8,
    RINGSHM_W_Q4_K = 12,
    RINGSHM_W_Q5_K = 13,
    RINGSHM_W_Q6_K = 14,
    RINGSHM_W_BF16 = 30,
    RINGSHM_W_MXFP4 = 39
};

/* Instruction-set paths; ringshm_isa_best() picks the best this CPU runs (cpuid), once per process. */
enum ringshm_isa {
    RINGSHM_ISA_PORTABLE = 0, /* plain C (fmaf); any CPU */
    RINGSHM_ISA_AVX2 = 1,     /* x86-64-v3: AVX2 + FMA + F16C */
    RINGSHM_ISA_AVX512 = 2,   /* x86-64-v4: AVX-512 F/BW/DQ/VL */
    RINGSHM_ISA_AVX512_VNNI = 3 /* the 8-bit functions only: AVX-512 with VNNI's 4-byte dot products and VBMI */
};

/* Status codes; distinct from the ring's (-1 .. -7) and the attention kernels' (-16, -17). */
enum ringshm_matmul_status {
    RINGSHM_MATMUL_OK = 0,
    RINGSHM_MATMUL_ERR_TYPE = -32,  /* unknown weight type or ISA, or an ISA this CPU cannot run */
    RINGSHM_MATMUL_ERR_SHAPE = -33, /* M, N or K <= 0, K not whole blocks (32; 256 for K-quants), ldo too small */
    RINGSHM_MATMUL_ERR_SIZE = -34,  /* a buffer size given (packed bytes, bias length) does not match the shape */
    RINGSHM_MATMUL_ERR_ALIAS = -35  /* out overlaps x or residual */
};

int ringshm_isa_best(void);
/* 1 when this CPU runs `isa` (cpuid, and the OS saves its registers), else 0. */
int ringshm_isa_supported(int isa);

/* Bytes a GGUF tensor of N rows x K takes in the file (row-major blocks), and packed; < 0 on a bad shape. */
int64_t ringshm_qmat_src_bytes(int type, int64_t n, int64_t k);
int64_t ringshm_qmat_packed_bytes(int type, int64_t n, int64_t k);

/* ringshm_qmat_pack: GGUF bytes [N rows of K] -> panels (layout above).
 *     src  src_bytes == ringshm_qmat_src_bytes(type, n, k)
 *     dst  dst_bytes == ringshm_qmat_packed_bytes(type, n, k); must not overlap src
 * Panels are split over OpenMP's default thread count (OMP_NUM_THREADS, else the CPUs the process may run on);
 * each is written by one thread, so the bytes do not depend on the count.
 * Returns RINGSHM_MATMUL_ERR_SIZE when a size differs (nothing written). */
int ringshm_qmat_pack(int type, const uint8_t *src, int64_t src_bytes, int64_t n, int64_t k, uint8_t *dst,
                      int64_t dst_bytes);
/* ringshm_qmat_pack_rows: the same panels from rows that need not lie together: row r's GGUF bytes
 * (ringshm_qmat_src_bytes(type, 1, k) of them) at rows[r], r < n, so that rows of several tensors (Q | K | V, gate |
 * up) or a reordering of one are packed as one weight without first being copied into one buffer. Bytes equal to
 * ringshm_qmat_pack's of those rows laid end to end, split over threads as it is. The caller vouches for each
 * rows[r]'s bytes. Returns ringshm_qmat_src_bytes's error for an unknown type or a bad shape, and
 * RINGSHM_MATMUL_ERR_SIZE for a NULL table, a NULL row or a dst_bytes that differs (nothing written either way). */
int ringshm_qmat_pack_rows(int type, const uint8_t *const *rows, int64_t n, int64_t k, uint8_t *dst,
                           int64_t dst_bytes);

/* ringshm_qmat_matmul: out[M, N] = x[M, K] . W[N, K]^T (+ bias[N]) (+ residual[M, N]), reduction as above.
 *
 *     packed    packed_bytes == ringshm_qmat_packed_bytes(type, n, k)
 *     x         [M, K] fp32, row stride K
 *     out       [M, ldo] fp32, ldo >= 16 * ceil(N / 16): columns [N, 16 * panels) are scratch, clobbered
 *     bias      [bias_len] or NULL (bias_len 0): bias_len must be N
 *     residual  [M, ldr] or NULL (ldr >= N). Neither x nor residual may overlap out:
 *               out holds the running sums between blocks (RINGSHM_MATMUL_ERR_ALIAS)
 *     n_threads threads that split the panels (OpenMP); <= 1 runs on the calling thread. Every thread runs in
 *               the caller's floating-point mode (MXCSR / FPCR: flush-to-zero, rounding), which is part of
 *               the contract: the same mode gives the same bits
 *     isa       a ringshm_isa this CPU runs (ringshm_isa_best() or below)
 * Limits: M, N, K < 2^31; types with a min (Q4_1, Q5_1, Q4_K, Q5_K): K <= 65536 (their block sums of x live on
 * the stack). Returns RINGSHM_MATMUL_ERR_* before writing anything on bad arguments. */
int ringshm_qmat_matmul(int type, const uint8_t *packed, int64_t packed_bytes, int64_t n, int64_t k,
                        const float *x, int64_t m, float *out, int64_t ldo, const float *bias, int64_t bias_len,
                        const float *residual, int64_t ldr, int n_threads, int isa);

/* 8-bit activations (opt-in: EngineConfig.matmul_activations = "int8"; never the default). For users who prefer speed
 * to equality with the fp32 oracle, as llama.cpp runs its CPU matmuls: each row of x is quantized on its own,
 * per block of 32 k, and the products of a block are summed as exact integers. A row's result still depends
 * only on that row (batch invariance) and is the same bits on every ISA path and thread count; it is not the
 * fp32 contract's result (relative error ~5e-3 of the output on random data: tests/test_int8_activations.py).
 *
 * Quantizing row r, block b (x[r, 32 b .. 32 b + 31], K % 32 == 0):
 *     a = max |x| (as the bits of |x|: NaN and inf compare above every finite value)
 *     a is inf or NaN:          d = NaN, q = 0 (the row's outputs turn NaN: non-finite stays visible)
 *     a < 2^-120 (zero too):    d = 0, q = 0 (127 / a overflows below ~2^-121: one cutoff with room)
 *     else:                     q[k] = nearbyintf(x[k] * (127 / a)) (|q| <= 127), d = a / 127
 *     xs[h] = sum of q over weights 16 h .. 16 h + 15, s = d * (float)(xs[0] + xs[1]): the quantized block's sum
 *     (as llama.cpp's Q8_1; against the fp32 block sum, the min term would not cancel the quantization error of the
 *     d q term: Q4_1's outputs moved 1.2e-2 from fp32's instead of 5e-3)
 * (each a rounded fp32 op; nearbyintf rounds in the caller's mode, to nearest even by default).
 *
 * The reduction, per (r, n), blocks b in order; u[n, k] the weight's q of matmul.h plus the type's offset o
 * (Q4_0 8, MXFP4 12: kvalues + 12, Q5_0 16, Q6_K 32, the others 0), an exact integer sum per chain of 32 k (Q6_K:
 * two chains of 16, its scales' halves):
 *     i = sum over k of u[n, k] * q[r, k]  -  o * (sum of q over the chain)        (exact, int32)
 *     acc = fma(d[n, b], d_x[r, b] * (float)i, acc);  types with a min:  acc = fma(m[n, b], s[r, b], acc)
 *     out[r, n] = acc; then + bias[n]; then + residual[r, n]
 * with d and m of matmul.h's table. Types: every quantized one (ringshm_q8_supported); F32 / F16 / BF16 have no
 * integer path (their callers use ringshm_qmat_matmul). */
int ringshm_q8_supported(int type);
/* Bytes of the quantized rows of x [M, K] (48 a block of 32), or RINGSHM_MATMUL_ERR_SHAPE (K % 32, M or K <= 0). */
int64_t ringshm_q8_act_bytes(int64_t m, int64_t k);
/* x [M, K] fp32 -> xq (xq_bytes == ringshm_q8_act_bytes(m, k)), blocks split over n_threads (each in the caller's
 * FP mode; one thread below 2048 blocks) on the ISA path isa (any; the same bits on each). Returns
 * RINGSHM_MATMUL_ERR_TYPE / _SHAPE / _SIZE / _ALIAS (xq overlapping x) before writing anything. */
int ringshm_q8_quantize(const float *x, int64_t m, int64_t k, uint8_t *xq, int64_t xq_bytes, int n_threads,
                        int isa);
/* ringshm_qmat_matmul_q8: ringshm_qmat_matmul's product with x given quantized (ringshm_q8_quantize), arguments
 * and checks as there; isa RINGSHM_ISA_AVX512_VNNI where ringshm_isa_supported says so (ringshm_q8_isa picks),
 * else any ringshm_isa. RINGSHM_MATMUL_ERR_TYPE also for a type without the path. out must not overlap xq. */
int ringshm_qmat_matmul_q8(int type, const uint8_t *packed, int64_t packed_bytes, int64_t n, int64_t k,
                           const uint8_t *xq, int64_t xq_bytes, int64_t m, float *out, int64_t ldo, const float *bias,
                           int64_t bias_len, const float *residual, int64_t ldr, int n_threads, int isa);
/* The 8-bit path for the fp32 path `isa`: RINGSHM_ISA_AVX512_VNNI for RINGSHM_ISA_AVX512 where the CPU has VNNI and
 * VBMI (AMD Zen 4 / 5, Intel Ice Lake and later; not Cascade Lake), else isa. */
int ringshm_q8_isa(int isa);

/* Software prefetch of the packed rows ahead (matmul_dequant.inc) for the types whose loops read a group's rows in the
 * order they are stored (Q4_0, Q4_1, Q4_K, MXFP4, Q8_0 and the float types; Q5_0, Q5_1, Q5_K and Q6_K always ask):
 * on where the CPU streams them faster with it, off where its hardware prefetcher does better alone; attention
 * (kernels_impl.inc) asks for its next fp32 KV tile where one-row ops ask. The CPU's choice (cpuid, once; matmul.c
 * gives the measurements): every op on AMD family 26 and later (Zen 5); on AMD Zen 4 (family 25 with AVX-512) the
 * fp32 ops of 4 rows or more (of a float weight, 6 or more), no 8-bit op; off elsewhere. No bit of any result depends
 * on it.
 * ringshm_mm_row_prefetch_for: 1 when a matmul of m rows of weight type `type` (q8: with 8-bit activations) started
 * from now on asks for the rows ahead of the types read in order, else 0 (the Q5 types and Q6_K ask for their own
 * bytes either way, the 8-bit slab for Q4_K's). ringshm_mm_row_prefetch: the same for a one-row fp32 op of a float
 * weight (and attention).
 * ringshm_mm_set_row_prefetch, for tests and benches: mode 1 on, 0 off (for every op), -1 the CPU's choice again, for
 * every later matmul of the process (not while another thread runs one); returns ringshm_mm_row_prefetch() after it,
 * or RINGSHM_MATMUL_ERR_SHAPE (nothing changed) for another mode. */
int ringshm_mm_row_prefetch_for(int type, int64_t m, int q8);
int ringshm_mm_row_prefetch(void);
int ringshm_mm_set_row_prefetch(int mode);

/* ringshm_fma_probe: the fp32 FMA peak of one ISA path (the roofline of bench/bench_roofline.py). Each of
 * `n_threads` OpenMP threads runs `iters` rounds of independent 16-lane fma chains (enough chains to cover the
 * fma latency on two ports: 12 zmm on AVX-512, 6 pairs of ymm on AVX2, 6 on the portable path), on values that
 * stay finite and normal; the chains' sum goes to sink[0] so nothing is optimised away. Returns the flops
 * executed (2 per lane per fma), or RINGSHM_MATMUL_ERR_TYPE for an ISA this CPU cannot run,
 * RINGSHM_MATMUL_ERR_SHAPE for iters < 1 or n_threads < 1. */
int64_t ringshm_fma_probe(int isa, int n_threads, int64_t iters, float *sink);

/* ringshm_read_probe: the memory read bandwidth one ISA path can stream (the other roofline bound). The
 * `n` floats of buf (n a multiple of 128) are split into one contiguous part per OpenMP thread (`n_threads`), and
 * each thread sums its part, read as 4 streams, with 8 independent 16-lane add chains (loads are what limit it;
 * the sum is exact for a buffer of ones below 2^24 per lane, which tests/test_matmul.py reads back); the total goes to
 * sink[0]. Returns the bytes read, or RINGSHM_MATMUL_ERR_TYPE / RINGSHM_MATMUL_ERR_SHAPE as ringshm_fma_probe
 * (n not a positive multiple of 128). */
int64_t ringshm_read_probe(int isa, int n_threads, const float *buf, int64_t n, float *sink);

/* CDEF END */

#endif /* RINGSHM_MATMUL_H */
