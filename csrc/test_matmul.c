/* C-only test of the matmul under AddressSanitizer + UBSan (make test-c): the portable path against a scalar
 * reference of matmul.h's contract written from the GGUF bytes, bit for bit, for every weight type, odd shapes,
 * padded strides, bias and residual, 1-3 OpenMP threads; and each row alone against the same row in a batch.
 * Built with -DRINGSHM_PORTABLE_ONLY (no SIMD copies). Exits non-zero on the first mismatch. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "matmul.h"
#include "matmul_internal.h"

/* Report on stderr and leave at once (no leak report about the buffers of the failing case). */
#define FAIL(...) (fprintf(stderr, __VA_ARGS__), fflush(stderr), _Exit(1))

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static uint32_t next(void) {
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return (uint32_t)(rng >> 11);
}
static float uniform(void) { return (float)((int)(next() % 4001) - 2000) / 1000.0f; }
static void put_half(uint8_t *p, float f) { /* f in [2^-8, 2): exact enough, any finite half works */
    int e = 0;
    float a = fabsf(f);
    if (a < 1.0f / 256) a = 1.0f / 256;
    while (a >= 2) a /= 2, e++;
    while (a < 1) a *= 2, e--;
    const uint16_t h = (uint16_t)((f < 0) << 15 | (e + 15) << 10 | (int)((a - 1) * 1024));
    p[0] = h & 255, p[1] = h >> 8;
}

/* The contract, one element: q, d, m of weight kk of a GGUF row. */
static void weight_at(int type, const uint8_t *row, int64_t kk, float *q, float *d, float *m) {
    const int64_t b = kk / 32, j = kk % 32;
    *d = 1, *m = 0;
    switch (type) {
    case RINGSHM_W_Q4_0: {
        const uint8_t *blk = row + b * 18;
        *d = ringshm_half_to_float(blk);
        *q = (float)((j < 16 ? blk[2 + j] & 15 : blk[2 + j - 16] >> 4) - 8);
        break;
    }
    case RINGSHM_W_Q4_1: {
        const uint8_t *blk = row + b * 20;
        *d = ringshm_half_to_float(blk), *m = ringshm_half_to_float(blk + 2);
        *q = (float)(j < 16 ? blk[4 + j] & 15 : blk[4 + j - 16] >> 4);
        break;
    }
    case RINGSHM_W_Q8_0: {
        const uint8_t *blk = row + b * 34;
        *d = ringshm_half_to_float(blk);
        *q = (float)(int8_t)blk[2 + j];
        break;
    }
    case RINGSHM_W_F16: *q = ringshm_half_to_float(row + 2 * kk); break;
    case RINGSHM_W_BF16: {
        const uint32_t bits = (uint32_t)(row[2 * kk] | row[2 * kk + 1] << 8) << 16;
        memcpy(q, &bits, 4);
        break;
    }
    default: memcpy(q, row + 4 * kk, 4);
    }
}

static float reference(int type, const uint8_t *row, const float *x, int64_t k) {
    float acc = 0;
    for (int64_t b = 0; b * 32 < k; b++) {
        float t = 0, d = 1, m = 0, q;
        for (int64_t kk = b * 32; kk < k && kk < b * 32 + 32; kk++) {
            weight_at(type, row, kk, &q, &d, &m);
            t = fmaf(x[kk], q, t);
        }
        acc = fmaf(d, t, acc);
        if (type == RINGSHM_W_Q4_1) {
            float v[16];
            for (int l = 0; l < 16; l++) v[l] = x[b * 32 + l] + x[b * 32 + l + 16];
            for (int w = 8; w >= 1; w /= 2)
                for (int l = 0; l < w; l++) v[l] = v[l] + v[l + w];
            acc = fmaf(m, v[0], acc);
        }
    }
    return acc;
}

int main(void) {
    const int types[] = {RINGSHM_W_F32, RINGSHM_W_F16, RINGSHM_W_BF16, RINGSHM_W_Q4_0, RINGSHM_W_Q4_1, RINGSHM_W_Q8_0};
    int cases = 0;
    for (int it = 0; it < 120; it++) {
        const int type = types[it % 6], quant = type >= RINGSHM_W_Q4_0 && type <= RINGSHM_W_Q8_0;
        const int64_t n = 1 + next() % 70, k = quant ? 32 * (1 + next() % 5) : 1 + next() % 150;
        const int64_t m = it % 10 == 0 ? 200 + next() % 20 : 1 + next() % 9;
        const int64_t sbytes = ringshm_qmat_src_bytes(type, n, k), pbytes = ringshm_qmat_packed_bytes(type, n, k);
        uint8_t *src = malloc((size_t)sbytes), *packed = malloc((size_t)pbytes);
        for (int64_t i = 0; i < sbytes; i++) src[i] = (uint8_t)next();
        const int64_t row_bytes = sbytes / n;
        for (int64_t r = 0; r < n; r++) { /* finite scales and weights */
            uint8_t *row = src + r * row_bytes;
            if (quant) {
                const int bs = type == RINGSHM_W_Q4_0 ? 18 : type == RINGSHM_W_Q4_1 ? 20 : 34;
                for (int64_t b = 0; b < k / 32; b++) {
                    put_half(row + b * bs, uniform() * 0.1f);
                    if (type == RINGSHM_W_Q4_1) put_half(row + b * bs + 2, uniform() * 0.1f);
                }
            } else {
                for (int64_t kk = 0; kk < k; kk++) {
                    float f = uniform();
                    uint32_t bits;
                    memcpy(&bits, &f, 4);
                    if (type == RINGSHM_W_F32) memcpy(row + 4 * kk, &f, 4);
                    else if (type == RINGSHM_W_F16) put_half(row + 2 * kk, f);
                    else row[2 * kk] = (bits >> 16) & 255, row[2 * kk + 1] = bits >> 24;
                }
            }
        }
        if (ringshm_qmat_pack(type, src, sbytes, n, k, packed, pbytes)) FAIL("pack refused\n");
        const int64_t ldo = (n + 15) / 16 * 16 + 16 * (next() % 2), ldr = n + next() % 3;
        float *x = malloc(sizeof(float) * (size_t)(m * k)), *out = malloc(sizeof(float) * (size_t)(m * ldo));
        float *one = malloc(sizeof(float) * (size_t)ldo), *bias = malloc(sizeof(float) * (size_t)n);
        float *res = malloc(sizeof(float) * (size_t)((m - 1) * ldr + n));
        for (int64_t i = 0; i < m * k; i++) x[i] = uniform();
        for (int64_t i = 0; i < n; i++) bias[i] = uniform();
        for (int64_t i = 0; i < (m - 1) * ldr + n; i++) res[i] = uniform();
        const int use_bias = it % 2, use_res = (it / 2) % 2, threads = 1 + it % 3;
        if (ringshm_qmat_matmul(type, packed, pbytes, n, k, x, m, out, ldo, use_bias ? bias : NULL,
                                use_res ? res : NULL, ldr, threads, RINGSHM_ISA_PORTABLE))
            FAIL("matmul refused\n");
        for (int64_t r = 0; r < m; r++) {
            if (ringshm_qmat_matmul(type, packed, pbytes, n, k, x + r * k, 1, one, ldo, use_bias ? bias : NULL,
                                    use_res ? res + r * ldr : NULL, ldr, 1, RINGSHM_ISA_PORTABLE))
                FAIL("matmul refused\n");
            for (int64_t c = 0; c < n; c++) {
                float want = reference(type, src + c * row_bytes, x + r * k, k);
                if (use_bias) want = want + bias[c];
                if (use_res) want = want + res[r * ldr + c];
                if (memcmp(&want, &out[r * ldo + c], 4) || memcmp(&want, &one[c], 4)) {
                    FAIL("mismatch: type %d n %lld k %lld m %lld at (%lld, %lld): want %a, batch %a, alone %a\n", type,
                         (long long)n, (long long)k, (long long)m, (long long)r, (long long)c, want, out[r * ldo + c],
                         one[c]);
                }
            }
        }
        free(src), free(packed), free(x), free(out), free(one), free(bias), free(res);
        cases++;
    }
    printf("test_matmul: %d cases, every element bitwise the contract's, alone and batched\n", cases);
    return 0;
}
