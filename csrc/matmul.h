/* ringshm matmul over GGUF weight encodings: out[M, N] = x[M, K] . W[N, K]^T (+ bias) (+ residual), and the
 * per-row ops around it (RMSNorm, SwiGLU), all batch-invariant by construction.
 *
 * Weights stay in their checkpoint encoding. ringshm_qmat_pack rearranges a GGUF tensor's bytes (N rows of K,
 * row-major, ggml's ggml-common.h block layouts) into panels of 16 output rows, so that SIMD lanes run over
 * output rows n and the reduction walks K one position at a time. Nothing is dequantized to a full fp32 copy:
 *
 *   type   GGUF block (per row, 32 weights)           packed, per panel (16 rows) per block of 32 k
 *   Q4_0   18 B: d f16 | qs u8[16]                    d f16[16] | qs u8[16 j][16 n]                288 B
 *   Q4_1   20 B: d f16 | m f16 | qs u8[16]            d f16[16] | m f16[16] | qs u8[16 j][16 n]    320 B
 *   Q8_0   34 B: d f16 | qs i8[32]                    d f16[16] | qs i8[32 k][16 n]                544 B
 *   F16, BF16   2 B a weight                          w u16[32 k][16 n]                           1024 B
 *   F32         4 B a weight                          w f32[32 k][16 n]                           2048 B
 *
 *   GGUF Q4 nibbles: low nibble of qs[j] = weight j, high nibble = weight j + 16 (ggml's order);
 *   packed Q4 byte (j, n): low nibble = weight 2j of row n, high nibble = weight 2j + 1 (so the walk over k is in
 *   order). Panels are stored one after another, each holding its nb = ceil(K / 32) blocks in order. Rows of
 *   the last panel past N are zero. Float types allow any K (the last block is cut short); quantized types
 *   need K % 32 == 0.
 *
 * The reduction (the contract every path, every M and every thread count follows, lane by lane):
 *
 *     q[n, k]  the block's integer (Q4_1: nibble; Q4_0: nibble - 8; Q8_0: int8) or the float weight itself
 *     d, m     the block's fp16 scale and min widened to fp32 (float types: d = 1, no m)
 *     acc = 0
 *     for each block b in order:
 *         t = 0;  for k in the block in order:  t = fma(x[m, k], q[n, k], t)
 *         acc = fma(d[n, b], t, acc)
 *         Q4_1 only:  acc = fma(m[n, b], s[m, b], acc)     s[m, b] = block sum of x, below
 *     out[m, n] = acc;  then out += bias[n];  then out += residual[m, n]       (each a rounded fp32 op)
 *
 *     s[m, b] = sum of x[m, 32b .. 32b + 31] by a fixed tree: v[l] = x[l] + x[l + 16] (l < 16), then pairs
 *               (l, l + 8), (l, l + 4), (l, l + 2), (l, l + 1).
 *
 * fma is the IEEE fused multiply-add (one rounding), so every path (AVX-512, AVX2 + FMA, portable C with
 * fmaf) computes the same bits; the SIMD files are built with fp-contract off so the compiler adds no fusions
 * of its own. Each (m, n) depends only on x[m, :], W[n, :] and bias/residual at (m, n): not on M, on the rows
 * next to it in the op, or on the thread count. Threads split the panels (output rows), never K.
 * Algebraically this is x . (d q + m) summed over k, i.e. the fp32-dequantized product up to rounding order.
 *
 * Memory: the caller owns every buffer; nothing here allocates, prints or keeps state. Scratch is on the stack
 * of each thread, about 68 KiB: one dequantized block of up to 8 panels (16 KiB) and Q4_1's block sums of x
 * for a chunk of rows (48 KiB).
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
    RINGSHM_W_Q8_0 = 8,
    RINGSHM_W_BF16 = 30
};

/* Instruction-set paths; ringshm_isa_best() picks the best this CPU runs (cpuid), once per process. */
enum ringshm_isa {
    RINGSHM_ISA_PORTABLE = 0, /* plain C (fmaf); any CPU */
    RINGSHM_ISA_AVX2 = 1,     /* x86-64-v3: AVX2 + FMA + F16C */
    RINGSHM_ISA_AVX512 = 2    /* x86-64-v4: AVX-512 F/BW/DQ/VL */
};

/* Status codes; distinct from the ring's (-1 .. -7) and the attention kernels' (-16, -17). */
enum ringshm_matmul_status {
    RINGSHM_MATMUL_OK = 0,
    RINGSHM_MATMUL_ERR_TYPE = -32,  /* unknown weight type or ISA, or an ISA this CPU cannot run */
    RINGSHM_MATMUL_ERR_SHAPE = -33, /* M, N or K <= 0, K % 32 != 0 for a quantized type, ldo < 16 * panels */
    RINGSHM_MATMUL_ERR_SIZE = -34,  /* a buffer size given does not match what the shape needs */
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
 * Returns RINGSHM_MATMUL_ERR_SIZE when a size differs (nothing written). */
int ringshm_qmat_pack(int type, const uint8_t *src, int64_t src_bytes, int64_t n, int64_t k, uint8_t *dst,
                      int64_t dst_bytes);

/* ringshm_qmat_matmul: out[M, N] = x[M, K] . W[N, K]^T (+ bias[N]) (+ residual[M, N]), reduction as above.
 *
 *     packed    packed_bytes == ringshm_qmat_packed_bytes(type, n, k)
 *     x         [M, K] fp32, row stride K
 *     out       [M, ldo] fp32, ldo >= 16 * ceil(N / 16): columns [N, 16 * panels) are scratch, clobbered
 *     bias      [N] or NULL;  residual  [M, ldr] or NULL (ldr >= N). Neither x nor residual may overlap out:
 *               out holds the running sums between blocks (RINGSHM_MATMUL_ERR_ALIAS)
 *     n_threads threads that split the panels (OpenMP); <= 1 runs on the calling thread. Every thread runs in
 *               the caller's floating-point mode (MXCSR / FPCR: flush-to-zero, rounding), which is part of
 *               the contract: the same mode gives the same bits
 *     isa       a ringshm_isa this CPU runs (ringshm_isa_best() or below)
 * Limits: M, N, K < 2^31; Q4_1: K <= 65536 (its block sums of x live on the stack). Returns RINGSHM_MATMUL_ERR_* before writing anything on bad arguments. */
int ringshm_qmat_matmul(int type, const uint8_t *packed, int64_t packed_bytes, int64_t n, int64_t k,
                        const float *x, int64_t m, float *out, int64_t ldo, const float *bias,
                        const float *residual, int64_t ldr, int n_threads, int isa);

/* CDEF END */

#endif /* RINGSHM_MATMUL_H */
