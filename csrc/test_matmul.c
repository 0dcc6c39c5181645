/* C-only test of the matmul under AddressSanitizer + UBSan (make test-c): the portable path against a scalar
 * reference of matmul.h's contract written from the GGUF bytes, bit for bit, for every weight type, odd shapes,
 * padded strides, bias and residual, 1-3 OpenMP threads; and each row alone against the same row in a batch.
 * The 8-bit-activation path the same way against its own reference (reference_q8). The embedding lookup (dequant.c)
 * against the same reference decode, weight by weight.
 * Built with -DRINGSHM_PORTABLE_ONLY (no SIMD copies). Exits non-zero on the first mismatch. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dequant.h"
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

/* Weight kk of a GGUF row, decoded straight from its bytes (ggml-common.h's layouts, written out here on their
 * own rather than taken from gguf_blocks.h): the contract's q, d, m (matmul.h's table) and the weight w as
 * gguf.quants computes it in float32 (one rounding per operation, in its order). */
static void weight_at(int type, const uint8_t *row, int64_t kk, float *q, float *d, float *m, float *w) {
    const int64_t b = kk / 32, j = kk % 32;
    *d = 1, *m = 0;
    switch (type) {
    case RINGSHM_W_Q4_0: {
        const uint8_t *blk = row + b * 18;
        *d = ringshm_half_to_float(blk);
        *q = (float)((j < 16 ? blk[2 + j] & 15 : blk[2 + j - 16] >> 4) - 8);
        *w = *d * *q;
        return;
    }
    case RINGSHM_W_Q4_1: {
        const uint8_t *blk = row + b * 20;
        *d = ringshm_half_to_float(blk), *m = ringshm_half_to_float(blk + 2);
        *q = (float)(j < 16 ? blk[4 + j] & 15 : blk[4 + j - 16] >> 4);
        *w = *d * *q + *m;
        return;
    }
    case RINGSHM_W_Q5_0:
    case RINGSHM_W_Q5_1: {
        const int q51 = type == RINGSHM_W_Q5_1;
        const uint8_t *blk = row + b * (q51 ? 24 : 22), *qh = blk + (q51 ? 4 : 2), *qs = qh + 4;
        const uint32_t hbits = (uint32_t)qh[0] | (uint32_t)qh[1] << 8 | (uint32_t)qh[2] << 16 | (uint32_t)qh[3] << 24;
        const int v = (j < 16 ? qs[j] & 15 : qs[j - 16] >> 4) | (int)((hbits >> j) & 1) << 4;
        *d = ringshm_half_to_float(blk);
        if (q51) *m = ringshm_half_to_float(blk + 2);
        *q = (float)(q51 ? v : v - 16);
        *w = q51 ? *d * *q + *m : *d * *q;
        return;
    }
    case RINGSHM_W_MXFP4: { /* ggml's kvalues_mxfp4 and ggml_e8m0_to_fp32_half */
        static const float kvalues[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
        const uint8_t *blk = row + b * 17, e = blk[0];
        const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
        memcpy(d, &bits, 4);
        *q = kvalues[j < 16 ? blk[1 + j] & 15 : blk[1 + j - 16] >> 4];
        *w = *d * *q;
        return;
    }
    case RINGSHM_W_Q8_0: {
        const uint8_t *blk = row + b * 34;
        *d = ringshm_half_to_float(blk);
        *q = (float)(int8_t)blk[2 + j];
        *w = *d * *q;
        return;
    }
    case RINGSHM_W_Q4_K:
    case RINGSHM_W_Q5_K: {
        const int q5 = type == RINGSHM_W_Q5_K;
        const uint8_t *blk = row + kk / 256 * (q5 ? 176 : 144), *sc = blk + 4, *qh = blk + 16;
        const uint8_t *qs = blk + (q5 ? 48 : 16);
        const int s = (int)(kk % 256 / 32);
        const int scale = s < 4 ? sc[s] & 63 : (sc[s + 4] & 15) | (sc[s - 4] >> 6) << 4;
        const int min = s < 4 ? sc[s + 4] & 63 : (sc[s + 4] >> 4) | (sc[s] >> 6) << 4;
        int v = (qs[32 * (s / 2) + j] >> (s % 2 ? 4 : 0)) & 15;
        if (q5) v |= ((qh[j] >> s) & 1) << 4;
        const float dd = ringshm_half_to_float(blk), dmin = ringshm_half_to_float(blk + 2);
        *q = (float)v, *d = dd * (float)scale, *m = -(dmin * (float)min);
        *w = *d * *q - dmin * (float)min;
        return;
    }
    case RINGSHM_W_Q6_K: {
        const uint8_t *blk = row + kk / 256 * 210;
        const int i = (int)(kk % 256), h = i / 128, c = i % 128 / 32, l = i % 32;
        const int lo = (blk[64 * h + 32 * (c % 2) + l] >> (c < 2 ? 0 : 4)) & 15;
        const int hi = (blk[128 + 32 * h + l] >> 2 * c) & 3;
        const int scale = (int8_t)blk[192 + i / 16], v = (lo | hi << 4) - 32;
        const float dd = ringshm_half_to_float(blk + 208);
        *q = (float)v, *d = dd * (float)scale; /* the d of its half-block of 16 */
        *w = *d * *q;
        return;
    }
    case RINGSHM_W_F16: *q = ringshm_half_to_float(row + 2 * kk); break;
    case RINGSHM_W_BF16: {
        const uint32_t bits = (uint32_t)(row[2 * kk] | row[2 * kk + 1] << 8) << 16;
        memcpy(q, &bits, 4);
        break;
    }
    default: memcpy(q, row + 4 * kk, 4);
    }
    *w = *q;
}

static int has_min(int type) {
    return type == RINGSHM_W_Q4_1 || type == RINGSHM_W_Q5_1 || type == RINGSHM_W_Q4_K || type == RINGSHM_W_Q5_K;
}

/* The block sum of x[0 .. 31] by matmul.h's tree. */
static float block_sum(const float *x) {
    float v[16];
    for (int l = 0; l < 16; l++) v[l] = x[l] + x[l + 16];
    for (int sw = 8; sw >= 1; sw /= 2)
        for (int l = 0; l < sw; l++) v[l] = v[l] + v[l + sw];
    return v[0];
}

/* matmul.h's reduction for one output element, with plain loops (chains of 32; Q6_K's of 16). */
static float reference(int type, const uint8_t *row, const float *x, int64_t k) {
    const int64_t len = type == RINGSHM_W_Q6_K ? 16 : 32;
    float acc = 0;
    for (int64_t b = 0; b * len < k; b++) {
        float t = 0, d = 1, m = 0, q, w;
        for (int64_t kk = b * len; kk < k && kk < b * len + len; kk++) {
            weight_at(type, row, kk, &q, &d, &m, &w);
            t = fmaf(x[kk], q, t);
        }
        acc = fmaf(d, t, acc);
        if (has_min(type)) acc = fmaf(m, block_sum(x + b * 32), acc);
    }
    return acc;
}

/* matmul.h's 8-bit rules for one block of 32 of x, written out on their own: d and q[32] in natural order. */
static void reference_q8_block(const float *x, float *d, int *q) {
    uint32_t amax = 0;
    for (int i = 0; i < 32; i++) {
        uint32_t bits;
        memcpy(&bits, x + i, 4);
        if ((bits & 0x7FFFFFFFu) > amax) amax = bits & 0x7FFFFFFFu;
    }
    float a;
    memcpy(&a, &amax, 4);
    const int ok = amax < 0x7F800000u && amax >= 0x03800000u;
    *d = amax >= 0x7F800000u ? NAN : ok ? a / 127.0f : 0.0f;
    for (int i = 0; i < 32; i++) {
        const float r = ok ? nearbyintf(x[i] * (127.0f / a)) : 0.0f;
        q[i] = r > 127 ? 127 : r < -127 ? -127 : (int)r;
    }
}

/* matmul.h's 8-bit reduction for one output element: per chain (32; Q6_K 16) the exact integer sum of q_w * q_x,
 * then acc = fma(d, d_x * i, acc) and, with a min, acc = fma(m, d_x * sum of q_x, acc) once a block of 32. */
static float reference_q8(int type, const uint8_t *row, const float *x, int64_t k) {
    const int64_t len = type == RINGSHM_W_Q6_K ? 16 : 32;
    float acc = 0;
    for (int64_t b = 0; b < k / 32; b++) {
        float dx, q, d, m = 0, w;
        int qx[32];
        reference_q8_block(x + b * 32, &dx, qx);
        for (int64_t c = 0; c < 32; c += len) {
            int32_t i = 0;
            for (int64_t j = c; j < c + len; j++) {
                weight_at(type, row, b * 32 + j, &q, &d, &m, &w);
                i += (int32_t)q * qx[j];
            }
            acc = fmaf(d, dx * (float)i, acc);
        }
        if (has_min(type)) {
            int32_t sum = 0;
            for (int j = 0; j < 32; j++) sum += qx[j];
            acc = fmaf(m, dx * (float)sum, acc);
        }
    }
    return acc;
}

/* Random GGUF rows of `type` with finite fp16 scales (the rest of each block random bytes); MXFP4's e near 2^-3
 * (118 .. 129: products that neither overflow nor flush), one block in 8 at e 0 .. 3 (d subnormal for e < 2). */
static void random_rows(int type, uint8_t *src, int64_t n, int64_t k, int64_t row_bytes) {
    for (int64_t i = 0; i < n * row_bytes; i++) src[i] = (uint8_t)next();
    for (int64_t r = 0; r < n; r++) {
        uint8_t *row = src + r * row_bytes;
        switch (type) {
        case RINGSHM_W_Q4_0:
        case RINGSHM_W_Q4_1:
        case RINGSHM_W_Q5_0:
        case RINGSHM_W_Q5_1:
        case RINGSHM_W_Q8_0: {
            const int bs = (int)(row_bytes / (k / 32)), two = type == RINGSHM_W_Q4_1 || type == RINGSHM_W_Q5_1;
            for (int64_t b = 0; b < k / 32; b++) {
                put_half(row + b * bs, uniform() * 0.1f);
                if (two) put_half(row + b * bs + 2, uniform() * 0.1f);
            }
            break;
        }
        case RINGSHM_W_MXFP4:
            for (int64_t b = 0; b < k / 32; b++) row[b * 17] = (uint8_t)(next() % 8 ? 118 + next() % 12 : next() % 4);
            break;
        case RINGSHM_W_Q4_K:
        case RINGSHM_W_Q5_K:
        case RINGSHM_W_Q6_K: {
            const int bs = (int)(row_bytes / (k / 256));
            for (int64_t b = 0; b < k / 256; b++) {
                if (type == RINGSHM_W_Q6_K) {
                    put_half(row + b * bs + 208, uniform() * 0.01f);
                } else {
                    put_half(row + b * bs, uniform() * 0.01f), put_half(row + b * bs + 2, uniform() * 0.01f);
                }
            }
            break;
        }
        default:
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
}

/* MXFP4's dequantization at every E8M0 byte and nibble (dequant.c, straight and as rows): bitwise the reference
 * decode, and at the edges the bits ggml gives: d's subnormals (e 0, 1), the least normal (e 2), 2^126 and 2^127
 * (e 254, 255: finite, not NaN), inf where d * q overflows, and +0 for nibbles 0 and 8 at every e. */
static void check_mxfp4_dequant_edges(void) {
    uint8_t src[256 * 17];
    float out[256 * 32], rows[256 * 32];
    for (int e = 0; e < 256; e++) {
        src[e * 17] = (uint8_t)e;
        for (int j = 0; j < 16; j++) src[e * 17 + 1 + j] = (uint8_t)(j | (15 - j) << 4); /* nibble j, 15 - j */
    }
    if (ringshm_dequant_mxfp4(src, out, 256)) FAIL("dequant_mxfp4 refused\n");
    int64_t ids[256];
    for (int i = 0; i < 256; i++) ids[i] = i;
    if (ringshm_dequant_rows(RINGSHM_W_MXFP4, src, sizeof src, 256, 32, ids, 256, rows))
        FAIL("dequant_rows refused\n");
    for (int e = 0; e < 256; e++)
        for (int kk = 0; kk < 32; kk++) {
            float q, d, m, w;
            weight_at(RINGSHM_W_MXFP4, src + e * 17, kk, &q, &d, &m, &w);
            if (memcmp(&w, &out[e * 32 + kk], 4) || memcmp(&w, &rows[e * 32 + kk], 4))
                FAIL("mxfp4 dequant: e %d weight %d: want %a, got %a / %a\n", e, kk, w, out[e * 32 + kk],
                     rows[e * 32 + kk]);
        }
    /* weight j < 16 of block e holds nibble j; nibble 1 (kvalue 1) gives d itself */
    const struct {
        int e, nibble;
        uint32_t bits;
    } want[] = {{0, 1, 0x00200000u}, {1, 1, 0x00400000u}, {2, 1, 0x00800000u}, {3, 1, 0x01000000u},
                {128, 1, 0x3F800000u}, {254, 1, 0x7E800000u}, {255, 1, 0x7F000000u},
                {255, 2, 0x7F800000u},  /* 2 x 2^127 = inf */
                {255, 10, 0xFF800000u}, /* -2 x 2^127 = -inf */
                {253, 7, 0x7F800000u},  /* 12 x 2^125 */
                {253, 5, 0x7F400000u},  /* 6 x 2^125 = 1.5 x 2^127: finite */
                {0, 15, 0x81400000u},   /* -12 x 2^-128 = -1.5 x 2^-125 */
                {0, 0, 0}, {0, 8, 0}, {255, 0, 0}, {255, 8, 0}}; /* +0, never -0 */
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        uint32_t got;
        memcpy(&got, &out[want[i].e * 32 + want[i].nibble], 4);
        if (got != want[i].bits)
            FAIL("mxfp4 dequant: e %d nibble %d: want bits %08x, got %08x\n", want[i].e, want[i].nibble,
                 want[i].bits, got);
    }
}

/* The matmul's MXFP4 d at every E8M0 byte: row r has scale byte r in both its blocks and x holds integers -2 .. 2
 * times 2^-20, so every product and sum is exact and out[m, r] = 2^(r - 128) * (x . q) with no rounding to hide a
 * wrong d (the subnormal d of e < 2, the 2^127 of e = 255 included): bitwise the reference, in the register decode
 * (M = 1) and the slab (M = 30), 1 and 3 threads. */
static void check_mxfp4_every_scale_in_the_matmul(void) {
    enum { N = 256, K = 64, M = 30 };
    static uint8_t src[N * K / 32 * 17], packed[N / 16 * K / 32 * 272];
    static float x[M * K], out[M * N];
    for (int r = 0; r < N; r++)
        for (int b = 0; b < K / 32; b++) {
            uint8_t *blk = src + (r * K / 32 + b) * 17;
            blk[0] = (uint8_t)r;
            for (int j = 1; j < 17; j++) blk[j] = (uint8_t)next();
        }
    for (int i = 0; i < M * K; i++) x[i] = (float)((int)(next() % 5) - 2) / (float)(1 << 20);
    if (ringshm_qmat_pack(RINGSHM_W_MXFP4, src, sizeof src, N, K, packed, sizeof packed)) FAIL("pack refused\n");
    const int ms[] = {1, M};
    for (int mi = 0; mi < 2; mi++)
        for (int threads = 1; threads <= 3; threads += 2) {
            if (ringshm_qmat_matmul(RINGSHM_W_MXFP4, packed, sizeof packed, N, K, x, ms[mi], out, N, NULL, 0, NULL, 0,
                                    threads, RINGSHM_ISA_PORTABLE))
                FAIL("matmul refused\n");
            for (int r = 0; r < ms[mi]; r++)
                for (int c = 0; c < N; c++) {
                    const float want = reference(RINGSHM_W_MXFP4, src + c * K / 32 * 17, x + r * K, K);
                    if (memcmp(&want, &out[r * N + c], 4))
                        FAIL("mxfp4 matmul at e %d: m %d row %d threads %d: want %a, got %a\n", c, ms[mi], r,
                             threads, want, out[r * N + c]);
                }
        }
}

int main(void) {
    const int types[] = {RINGSHM_W_F32,  RINGSHM_W_F16,  RINGSHM_W_BF16, RINGSHM_W_Q4_0,
                         RINGSHM_W_Q4_1, RINGSHM_W_Q8_0, RINGSHM_W_Q5_0, RINGSHM_W_Q5_1,
                         RINGSHM_W_Q4_K, RINGSHM_W_Q5_K, RINGSHM_W_Q6_K, RINGSHM_W_MXFP4};
    const int n_types = (int)(sizeof types / sizeof types[0]);
    int cases = 0, dequant_rows = 0, q8_cases = 0;
    for (int it = 0; it < 16 * n_types; it++) {
        const int type = types[it % n_types], c = it / n_types; /* c: the type's case, 0-15, for what varies */
        const int kquant = type == RINGSHM_W_Q4_K || type == RINGSHM_W_Q5_K || type == RINGSHM_W_Q6_K;
        const int quant = kquant || (type >= RINGSHM_W_Q4_0 && type <= RINGSHM_W_Q8_0) || type == RINGSHM_W_MXFP4;
        /* one case in 4 has 9-19 panels: 2 or 3 groups of the packed layout (the last one short), split over the
         * threads; the others 1-5 panels (one group) */
        const int64_t n = c % 4 == 3 ? 129 + next() % 172 : 1 + next() % 70;
        const int64_t k = kquant ? 256 * (1 + next() % 3) : quant ? 32 * (1 + next() % 5) : 1 + next() % 150;
        /* to 34 rows: 1-4 tiles of the register decode (AVX2: 1-8), then the slab */
        const int64_t m = c % 5 == 0 ? 200 + next() % 20 : 1 + next() % 34;
        const int64_t sbytes = ringshm_qmat_src_bytes(type, n, k), pbytes = ringshm_qmat_packed_bytes(type, n, k);
        if (sbytes <= 0 || pbytes <= 0)
            FAIL("sizes refused: type %d n %lld k %lld\n", type, (long long)n, (long long)k);
        uint8_t *src = malloc((size_t)sbytes), *packed = malloc((size_t)pbytes);
        const int64_t row_bytes = sbytes / n;
        random_rows(type, src, n, k, row_bytes);
        if (ringshm_qmat_pack(type, src, sbytes, n, k, packed, pbytes)) FAIL("pack refused\n");
        const int64_t ldo = (n + 15) / 16 * 16 + 16 * (next() % 2), ldr = n + next() % 3;
        float *x = malloc(sizeof(float) * (size_t)(m * k)), *out = malloc(sizeof(float) * (size_t)(m * ldo));
        float *one = malloc(sizeof(float) * (size_t)ldo), *bias = malloc(sizeof(float) * (size_t)n);
        float *res = malloc(sizeof(float) * (size_t)((m - 1) * ldr + n));
        for (int64_t i = 0; i < m * k; i++) x[i] = uniform();
        for (int64_t i = 0; i < n; i++) bias[i] = uniform();
        for (int64_t i = 0; i < (m - 1) * ldr + n; i++) res[i] = uniform();
        const int use_bias = c % 2, use_res = (c / 2) % 2, threads = 1 + c % 3;
        if (ringshm_mm_set_row_prefetch((c / 4) % 2) != (c / 4) % 2) FAIL("row prefetch not set\n"); /* half on */
        if (ringshm_qmat_matmul(type, packed, pbytes, n, k, x, m, out, ldo, use_bias ? bias : NULL, use_bias ? n : 0,
                                use_res ? res : NULL, ldr, threads, RINGSHM_ISA_PORTABLE))
            FAIL("matmul refused\n");
        for (int64_t r = 0; r < m; r++) {
            if (ringshm_qmat_matmul(type, packed, pbytes, n, k, x + r * k, 1, one, ldo, use_bias ? bias : NULL,
                                    use_bias ? n : 0, use_res ? res + r * ldr : NULL, ldr, 1, RINGSHM_ISA_PORTABLE))
                FAIL("matmul refused\n");
            for (int64_t c = 0; c < n; c++) {
                float want = reference(type, src + c * row_bytes, x + r * k, k);
                if (use_bias) want = want + bias[c];
                if (use_res) want = want + res[r * ldr + c];
                if (memcmp(&want, &out[r * ldo + c], 4) || memcmp(&want, &one[c], 4)) {
                    FAIL("mismatch: type %d n %lld k %lld m %lld at (%lld, %lld): want %a, batch %a, alone %a\n",
                         type, (long long)n, (long long)k, (long long)m, (long long)r, (long long)c, want,
                         out[r * ldo + c], one[c]);
                }
            }
        }
        if (quant) { /* the 8-bit path: the same rows quantized, batched and each row alone, against reference_q8 */
            const int64_t qbytes = ringshm_q8_act_bytes(m, k), qone = ringshm_q8_act_bytes(1, k);
            uint8_t *xq = malloc((size_t)qbytes);
            if (ringshm_q8_quantize(x, m, k, xq, qbytes, threads, RINGSHM_ISA_PORTABLE) ||
                ringshm_qmat_matmul_q8(type, packed, pbytes, n, k, xq, qbytes, m, out, ldo, use_bias ? bias : NULL,
                                       use_bias ? n : 0, use_res ? res : NULL, ldr, threads, RINGSHM_ISA_PORTABLE))
                FAIL("q8 refused\n");
            for (int64_t r = 0; r < m; r++) {
                if (ringshm_qmat_matmul_q8(type, packed, pbytes, n, k, xq + r * qone, qone, 1, one, ldo,
                                           use_bias ? bias : NULL, use_bias ? n : 0, use_res ? res + r * ldr : NULL,
                                           ldr, 1, RINGSHM_ISA_PORTABLE))
                    FAIL("q8 refused\n");
                for (int64_t c = 0; c < n; c++) {
                    float want = reference_q8(type, src + c * row_bytes, x + r * k, k);
                    if (use_bias) want = want + bias[c];
                    if (use_res) want = want + res[r * ldr + c];
                    if (memcmp(&want, &out[r * ldo + c], 4) || memcmp(&want, &one[c], 4))
                        FAIL("q8 mismatch: type %d n %lld k %lld m %lld at (%lld, %lld): want %a, batch %a, alone %a\n",
                             type, (long long)n, (long long)k, (long long)m, (long long)r, (long long)c, want,
                             out[r * ldo + c], one[c]);
                }
            }
            free(xq);
            q8_cases++;
        }
        /* the embedding lookup (dequant.c): every weight of every row, bitwise the reference decode */
        int64_t *ids = malloc(sizeof(int64_t) * (size_t)n);
        float *rows = malloc(sizeof(float) * (size_t)(n * k));
        for (int64_t i = 0; i < n; i++) ids[i] = n - 1 - i;
        if (ringshm_dequant_rows(type, src, sbytes, n, k, ids, n, rows)) FAIL("dequant_rows refused\n");
        for (int64_t i = 0; i < n; i++)
            for (int64_t kk = 0; kk < k; kk++) {
                float q, d, mm, w;
                weight_at(type, src + ids[i] * row_bytes, kk, &q, &d, &mm, &w);
                if (memcmp(&w, &rows[i * k + kk], 4))
                    FAIL("dequant mismatch: type %d k %lld row %lld weight %lld: want %a, got %a\n", type,
                         (long long)k, (long long)ids[i], (long long)kk, w, rows[i * k + kk]);
            }
        dequant_rows += (int)n;
        free(ids), free(rows);
        free(src), free(packed), free(x), free(out), free(one), free(bias), free(res);
        cases++;
    }
    if (ringshm_mm_set_row_prefetch(2) != RINGSHM_MATMUL_ERR_SHAPE || ringshm_mm_set_row_prefetch(-1) != 0 ||
        ringshm_mm_row_prefetch_for(RINGSHM_W_Q4_K, 64, 0) != 0)
        FAIL("row prefetch: mode 2 not refused, or the portable build's CPU choice not off for every op\n");
    check_mxfp4_dequant_edges();
    check_mxfp4_every_scale_in_the_matmul();
    printf("test_matmul: %d cases over %d types, every element bitwise the contract's, alone and batched (%d of "
           "them also with 8-bit activations; half of all with the row prefetch on); %d dequantized rows bitwise the "
           "reference decode; MXFP4 at every E8M0 byte, dequantized and multiplied\n", cases, n_types, q8_cases,
           dequant_rows);
    return 0;
}
