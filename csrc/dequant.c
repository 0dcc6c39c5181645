/* GGUF block dequantization: see dequant.h. */
#include "dequant.h"

#include <stddef.h>
#include <string.h>

#include "gguf_blocks.h"
#include "matmul.h"
#include "matmul_internal.h"

#define NO_FMA __attribute__((optimize("fp-contract=off")))

#define half_to_float ringshm_half_to_float

NO_FMA int ringshm_dequant_q8_0(const uint8_t *src, float *dst, int64_t n_blocks) {
    if (n_blocks < 0) return -1;
    for (int64_t b = 0; b < n_blocks; b++, src += 34, dst += 32) {
        float d = half_to_float(src);
        const int8_t *qs = (const int8_t *)(src + 2);
        for (int j = 0; j < 32; j++) dst[j] = d * (float)qs[j];
    }
    return 0;
}

NO_FMA int ringshm_dequant_q4_0(const uint8_t *src, float *dst, int64_t n_blocks) {
    if (n_blocks < 0) return -1;
    for (int64_t b = 0; b < n_blocks; b++, src += 18, dst += 32) {
        float d = half_to_float(src);
        const uint8_t *qs = src + 2;
        for (int j = 0; j < 16; j++) {
            dst[j] = d * (float)((qs[j] & 0x0F) - 8);
            dst[j + 16] = d * (float)((qs[j] >> 4) - 8);
        }
    }
    return 0;
}

NO_FMA int ringshm_dequant_q4_1(const uint8_t *src, float *dst, int64_t n_blocks) {
    if (n_blocks < 0) return -1;
    for (int64_t b = 0; b < n_blocks; b++, src += 20, dst += 32) {
        float d = half_to_float(src), m = half_to_float(src + 2);
        const uint8_t *qs = src + 4;
        for (int j = 0; j < 16; j++) {
            dst[j] = d * (float)(qs[j] & 0x0F) + m;
            dst[j + 16] = d * (float)(qs[j] >> 4) + m;
        }
    }
    return 0;
}

/* MXFP4: w = d * kvalues[q], d = 2^(e - 128) from e's bits (gguf_blocks.h): the product is exact, or inf where it
 * overflows (e >= 253 and a large nibble), as gguf.quants' float32 product. */
NO_FMA int ringshm_dequant_mxfp4(const uint8_t *src, float *dst, int64_t n_blocks) {
    static const float kvalues[16] = {RINGSHM_MXFP4_KVALUES};
    if (n_blocks < 0) return -1;
    for (int64_t b = 0; b < n_blocks; b++, src += sizeof(struct block_mxfp4), dst += 32) {
        const struct block_mxfp4 *blk = (const struct block_mxfp4 *)src;
        const float d = ringshm_e8m0_to_float_half(blk->e);
        for (int j = 0; j < 16; j++) {
            dst[j] = d * kvalues[blk->qs[j] & 0x0F];
            dst[j + 16] = d * kvalues[blk->qs[j] >> 4];
        }
    }
    return 0;
}

/* The fifth bit of weight i of a Q5_0 / Q5_1 block: bit i of its qh read as a little-endian u32. */
static inline unsigned q5_high(const uint8_t *qh, int i) { return (qh[i / 8] >> (i % 8)) & 1u; }

NO_FMA int ringshm_dequant_q5_0(const uint8_t *src, float *dst, int64_t n_blocks) {
    if (n_blocks < 0) return -1;
    for (int64_t b = 0; b < n_blocks; b++, src += sizeof(struct block_q5_0), dst += 32) {
        const struct block_q5_0 *blk = (const struct block_q5_0 *)src;
        const float d = half_to_float(src);
        for (int j = 0; j < 16; j++) {
            dst[j] = d * (float)((int)((blk->qs[j] & 0x0F) | q5_high(blk->qh, j) << 4) - 16);
            dst[j + 16] = d * (float)((int)((blk->qs[j] >> 4) | q5_high(blk->qh, j + 16) << 4) - 16);
        }
    }
    return 0;
}

NO_FMA int ringshm_dequant_q5_1(const uint8_t *src, float *dst, int64_t n_blocks) {
    if (n_blocks < 0) return -1;
    for (int64_t b = 0; b < n_blocks; b++, src += sizeof(struct block_q5_1), dst += 32) {
        const struct block_q5_1 *blk = (const struct block_q5_1 *)src;
        const float d = half_to_float(src), m = half_to_float(src + 2);
        for (int j = 0; j < 16; j++) {
            dst[j] = d * (float)((blk->qs[j] & 0x0F) | q5_high(blk->qh, j) << 4) + m;
            dst[j + 16] = d * (float)((blk->qs[j] >> 4) | q5_high(blk->qh, j + 16) << 4) + m;
        }
    }
    return 0;
}

/* Q4_K (qh NULL) and Q5_K: w = (d * sc) * q - dmin * m per sub-block of 32, each product rounded to fp32 as
 * gguf.quants computes it (both products are exact; the subtraction rounds once). */
NO_FMA static void kq_super(const uint8_t *hdr, const uint8_t *qh, const uint8_t *qs, float *dst) {
    const float d = half_to_float(hdr), dmin = half_to_float(hdr + 2);
    for (int s = 0; s < 8; s++) {
        int sc, m;
        ringshm_kq_scale_min(hdr + 4, s, &sc, &m);
        const float ds = d * (float)sc, dm = dmin * (float)m;
        const uint8_t *q = qs + 32 * (s / 2);
        for (int l = 0; l < 32; l++) {
            const unsigned v = ((q[l] >> 4 * (s & 1)) & 15u) | (qh ? ((qh[l] >> s) & 1u) << 4 : 0u);
            dst[32 * s + l] = ds * (float)v - dm;
        }
    }
}

int ringshm_dequant_q4_k(const uint8_t *src, float *dst, int64_t n_blocks) {
    if (n_blocks < 0) return -1;
    for (int64_t b = 0; b < n_blocks; b++, src += sizeof(struct block_q4_K), dst += 256)
        kq_super(src, NULL, src + offsetof(struct block_q4_K, qs), dst);
    return 0;
}

int ringshm_dequant_q5_k(const uint8_t *src, float *dst, int64_t n_blocks) {
    if (n_blocks < 0) return -1;
    for (int64_t b = 0; b < n_blocks; b++, src += sizeof(struct block_q5_K), dst += 256)
        kq_super(src, src + offsetof(struct block_q5_K, qh), src + offsetof(struct block_q5_K, qs), dst);
    return 0;
}

/* Q6_K: w = (d * sc) * (q - 32), both products exact. */
NO_FMA int ringshm_dequant_q6_k(const uint8_t *src, float *dst, int64_t n_blocks) {
    if (n_blocks < 0) return -1;
    for (int64_t b = 0; b < n_blocks; b++, src += sizeof(struct block_q6_K), dst += 256) {
        const struct block_q6_K *blk = (const struct block_q6_K *)src;
        const float d = half_to_float(src + offsetof(struct block_q6_K, d));
        for (int i = 0; i < 256; i++) {
            const int h = i / 128, c = (i % 128) / 32, l = i % 32;
            const int lo = (blk->ql[64 * h + 32 * (c & 1) + l] >> 4 * (c >> 1)) & 15;
            const int hi = (blk->qh[32 * h + l] >> 2 * c) & 3;
            dst[i] = (d * (float)blk->scales[i / 16]) * (float)((lo | hi << 4) - 32);
        }
    }
    return 0;
}

int ringshm_dequant_rows(int type, const uint8_t *src, int64_t src_bytes, int64_t n_rows, int64_t k,
                         const int64_t *ids, int64_t n_ids, float *out) {
    const int64_t want = ringshm_qmat_src_bytes(type, n_rows, k);
    if (want < 0 || n_ids < 0) return -1;
    if (src_bytes != want) return -2;
    for (int64_t i = 0; i < n_ids; i++)
        if (ids[i] < 0 || ids[i] >= n_rows) return -3;
    const int64_t row_bytes = want / n_rows;
    for (int64_t i = 0; i < n_ids; i++) {
        const uint8_t *row = src + ids[i] * row_bytes;
        float *o = out + i * k;
        switch (type) {
        case RINGSHM_W_Q8_0: ringshm_dequant_q8_0(row, o, k / 32); break;
        case RINGSHM_W_Q4_0: ringshm_dequant_q4_0(row, o, k / 32); break;
        case RINGSHM_W_Q4_1: ringshm_dequant_q4_1(row, o, k / 32); break;
        case RINGSHM_W_Q5_0: ringshm_dequant_q5_0(row, o, k / 32); break;
        case RINGSHM_W_Q5_1: ringshm_dequant_q5_1(row, o, k / 32); break;
        case RINGSHM_W_MXFP4: ringshm_dequant_mxfp4(row, o, k / 32); break;
        case RINGSHM_W_Q4_K: ringshm_dequant_q4_k(row, o, k / 256); break;
        case RINGSHM_W_Q5_K: ringshm_dequant_q5_k(row, o, k / 256); break;
        case RINGSHM_W_Q6_K: ringshm_dequant_q6_k(row, o, k / 256); break;
        case RINGSHM_W_F32: memcpy(o, row, sizeof(float) * (size_t)k); break;
        case RINGSHM_W_F16:
            for (int64_t j = 0; j < k; j++) o[j] = half_to_float(row + 2 * j);
            break;
        default: /* BF16 */
            for (int64_t j = 0; j < k; j++) {
                const uint32_t bits = (uint32_t)(row[2 * j] | (row[2 * j + 1] << 8)) << 16;
                memcpy(o + j, &bits, sizeof bits);
            }
        }
    }
    return 0;
}
