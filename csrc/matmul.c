/* ringshm matmul: sizes, packing, argument checks, the thread split and the ISA choice (see matmul.h).
 * The panel loops are in matmul_impl.inc, compiled once per ISA. */
#include "matmul.h"

#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include "fpenv.h"
#include "isa.h"
#include "matmul_internal.h"

int ringshm_isa_supported(int isa) {
    switch (isa) {
    case RINGSHM_ISA_PORTABLE: return 1;
#if RINGSHM_HAVE_X86_ISAS
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ < 12)
    case RINGSHM_ISA_AVX2:
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c") &&
               __builtin_cpu_supports("bmi2");
    case RINGSHM_ISA_AVX512:
        return ringshm_isa_supported(RINGSHM_ISA_AVX2) && __builtin_cpu_supports("avx512f") &&
               __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
               __builtin_cpu_supports("avx512vl");
#else
    case RINGSHM_ISA_AVX2: return __builtin_cpu_supports("x86-64-v3");
    case RINGSHM_ISA_AVX512: return __builtin_cpu_supports("x86-64-v4");
#endif
#endif
    default: return 0;
    }
}

int ringshm_isa_best(void) {
    static int best = -1; /* a pure function of the CPU: computed once, the same answer from any thread */
    if (best < 0) {
        int b = RINGSHM_ISA_PORTABLE;
        if (ringshm_isa_supported(RINGSHM_ISA_AVX512)) b = RINGSHM_ISA_AVX512;
        else if (ringshm_isa_supported(RINGSHM_ISA_AVX2)) b = RINGSHM_ISA_AVX2;
        best = b;
    }
    return best;
}

/* Bytes of one block (32 k) of one row in the GGUF file, and of one block of one 16-row panel packed. */
static int block_sizes(int type, int64_t *src_row_block, int64_t *panel_block) {
    switch (type) {
    case RINGSHM_W_Q4_0: *src_row_block = 18, *panel_block = 288; return 1;
    case RINGSHM_W_Q4_1: *src_row_block = 20, *panel_block = 320; return 1;
    case RINGSHM_W_Q8_0: *src_row_block = 34, *panel_block = 544; return 1;
    case RINGSHM_W_F16:
    case RINGSHM_W_BF16: *src_row_block = 64, *panel_block = 1024; return 1;
    case RINGSHM_W_F32: *src_row_block = 128, *panel_block = 2048; return 1;
    default: return 0;
    }
}

static int is_quant(int type) { return type == RINGSHM_W_Q4_0 || type == RINGSHM_W_Q4_1 || type == RINGSHM_W_Q8_0; }

static int shape_ok(int type, int64_t n, int64_t k) {
    return n > 0 && k > 0 && n < INT32_MAX && k < INT32_MAX && (!is_quant(type) || k % 32 == 0) &&
           (type != RINGSHM_W_Q4_1 || k / 32 <= RINGSHM_MM_MAX_Q4_1_BLOCKS) &&
           (n + 15) / 16 <= INT64_MAX / 2048 / ((k + 31) / 32); /* packed and file bytes fit an int64 */
}

static int overlap(const void *a, int64_t na, const void *b, int64_t nb) {
    return (uintptr_t)a < (uintptr_t)b + (uint64_t)nb && (uintptr_t)b < (uintptr_t)a + (uint64_t)na;
}

int64_t ringshm_qmat_src_bytes(int type, int64_t n, int64_t k) {
    int64_t sb, pb;
    if (!block_sizes(type, &sb, &pb)) return RINGSHM_MATMUL_ERR_TYPE;
    if (!shape_ok(type, n, k)) return RINGSHM_MATMUL_ERR_SHAPE;
    return is_quant(type) ? n * (k / 32) * sb : n * k * (sb / 32);
}

int64_t ringshm_qmat_packed_bytes(int type, int64_t n, int64_t k) {
    int64_t sb, pb;
    if (!block_sizes(type, &sb, &pb)) return RINGSHM_MATMUL_ERR_TYPE;
    if (!shape_ok(type, n, k)) return RINGSHM_MATMUL_ERR_SHAPE;
    return (n + 15) / 16 * ((k + 31) / 32) * pb;
}

/* Weight k of GGUF row `row` (its bytes), as the packed layout stores it: Q4 nibble, int8 byte, or 2 / 4 bytes. */
static inline uint8_t q4_nibble(const uint8_t *qs, int k) { return k < 16 ? qs[k] & 15 : qs[k - 16] >> 4; }

int ringshm_qmat_pack(int type, const uint8_t *src, int64_t src_bytes, int64_t n, int64_t k, uint8_t *dst,
                      int64_t dst_bytes) {
    int64_t sb, pb;
    if (!block_sizes(type, &sb, &pb)) return RINGSHM_MATMUL_ERR_TYPE;
    if (!shape_ok(type, n, k)) return RINGSHM_MATMUL_ERR_SHAPE;
    if (src_bytes != ringshm_qmat_src_bytes(type, n, k) || dst_bytes != ringshm_qmat_packed_bytes(type, n, k))
        return RINGSHM_MATMUL_ERR_SIZE;
    memset(dst, 0, (size_t)dst_bytes); /* rows past n and k past the end stay zero */
    const int64_t nb = (k + 31) / 32, n_panels = (n + 15) / 16;
    const int64_t row_bytes = is_quant(type) ? nb * sb : k * (sb / 32);
    for (int64_t p = 0; p < n_panels; p++)
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *o = dst + (p * nb + b) * pb;
            for (int l = 0; l < 16 && p * 16 + l < n; l++) {
                const uint8_t *row = src + (p * 16 + l) * row_bytes;
                if (is_quant(type)) {
                    const uint8_t *blk = row + b * sb;
                    memcpy(o + 2 * l, blk, 2); /* d */
                    if (type == RINGSHM_W_Q8_0) {
                        for (int kk = 0; kk < 32; kk++) o[32 + kk * 16 + l] = blk[2 + kk];
                    } else {
                        const int has_m = type == RINGSHM_W_Q4_1;
                        const uint8_t *qs = blk + (has_m ? 4 : 2);
                        uint8_t *oq = o + (has_m ? 64 : 32);
                        if (has_m) memcpy(o + 32 + 2 * l, blk + 2, 2); /* m */
                        for (int j = 0; j < 16; j++)
                            oq[j * 16 + l] = (uint8_t)(q4_nibble(qs, 2 * j) | (q4_nibble(qs, 2 * j + 1) << 4));
                    }
                } else {
                    const int64_t wb = sb / 32; /* bytes per weight */
                    for (int64_t kk = 0; kk < 32 && b * 32 + kk < k; kk++)
                        memcpy(o + (kk * 16 + l) * wb, row + (b * 32 + kk) * wb, (size_t)wb);
                }
            }
        }
    return RINGSHM_MATMUL_OK;
}

typedef void (*mm_panels_fn)(const struct ringshm_mm_args *, int64_t, int64_t);

static mm_panels_fn panels_for(int isa) {
    switch (isa) {
#if RINGSHM_HAVE_X86_ISAS
    case RINGSHM_ISA_AVX512: return ringshm_mm_panels_v4;
    case RINGSHM_ISA_AVX2: return ringshm_mm_panels_v3;
#endif
    case RINGSHM_ISA_PORTABLE: return ringshm_mm_panels_v1;
    default: return NULL;
    }
}

int ringshm_qmat_matmul(int type, const uint8_t *packed, int64_t packed_bytes, int64_t n, int64_t k,
                        const float *x, int64_t m, float *out, int64_t ldo, const float *bias,
                        const float *residual, int64_t ldr, int n_threads, int isa) {
    int64_t sb, pb;
    if (!block_sizes(type, &sb, &pb) || !ringshm_isa_supported(isa) || !panels_for(isa))
        return RINGSHM_MATMUL_ERR_TYPE;
    const int64_t n_panels = (n + 15) / 16;
    if (!shape_ok(type, n, k) || m <= 0 || m >= INT32_MAX || ldo < n_panels * 16 || (residual && ldr < n))
        return RINGSHM_MATMUL_ERR_SHAPE;
    if (packed_bytes != ringshm_qmat_packed_bytes(type, n, k)) return RINGSHM_MATMUL_ERR_SIZE;
    const int64_t out_bytes = ((m - 1) * ldo + n_panels * 16) * 4; /* out holds the running sums */
    if (overlap(out, out_bytes, x, m * k * 4) || (residual && overlap(out, out_bytes, residual, ((m - 1) * ldr + n) * 4)))
        return RINGSHM_MATMUL_ERR_ALIAS;
    const struct ringshm_mm_args a = {
        .type = type, .packed = packed, .n = n, .k = k, .m = m, .nb = (k + 31) / 32, .block_bytes = pb,
        .panel_bytes = (k + 31) / 32 * pb, .x = x, .out = out, .ldo = ldo, .bias = bias, .residual = residual,
        .ldr = ldr};
    const mm_panels_fn fn = panels_for(isa);
    int nt = n_threads < 1 ? 1 : n_threads;
    if (nt > n_panels) nt = (int)n_panels;
#ifdef _OPENMP
    if (nt > 1) {
        /* The FP mode (FTZ / DAZ / rounding) is per thread and pool workers keep theirs: run every panel in the
         * caller's, or a row's bits would depend on which thread computed it. */
        fpenv_t caller;
        FPENV_GET(caller);
#pragma omp parallel num_threads(nt)
        {
            FPENV_WORKER_BEGIN(caller);
            const int64_t t = omp_get_thread_num(), T = omp_get_num_threads();
            fn(&a, n_panels * t / T, n_panels * (t + 1) / T);
            FPENV_WORKER_END();
        }
        return RINGSHM_MATMUL_OK;
    }
#endif
    fn(&a, 0, n_panels);
    return RINGSHM_MATMUL_OK;
}
