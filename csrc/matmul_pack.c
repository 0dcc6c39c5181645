/* ringshm_qmat_pack: a GGUF tensor's rows of blocks -> 16-row panels (the layouts are drawn in matmul.h, the
 * GGUF blocks in gguf_blocks.h). Each packer writes lane l (row l of the panel) of one packed block. */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "gguf_blocks.h"
#include "matmul.h"
#include "matmul_internal.h"

_Static_assert(16 * sizeof(struct block_q4_0) == 288 && 16 * sizeof(struct block_q4_1) == 320 &&
                   16 * sizeof(struct block_q5_0) == 352 && 16 * sizeof(struct block_q5_1) == 384 &&
                   16 * sizeof(struct block_q8_0) == 544 && 16 * sizeof(struct block_mxfp4) == 272,
               "a packed legacy block is 16 rows of the file's block");
_Static_assert(16 * sizeof(struct block_q4_K) == 2304 && 16 * sizeof(struct block_q5_K) == 2816 &&
                   16 * sizeof(struct block_q6_K) == 3360,
               "a packed K-quant super-block is 16 rows of the file's block");

/* Weight i (< 32) of a GGUF legacy block's nibbles: the low nibble of qs[i] for i < 16, else the high one of
 * qs[i - 16]. */
static inline unsigned nibble32(const uint8_t *qs, int i) { return i < 16 ? qs[i] & 15u : (unsigned)qs[i - 16] >> 4; }

/* Packed nibble bytes of one block of 32: byte (j, l) = weight 2j | weight 2j + 1 << 4, from `low4(i)`. */
#define NIBBLE_PAIR(low4, j) (uint8_t)((low4(2 * (j))) | (low4(2 * (j) + 1)) << 4)
#define PUT_NIBBLES(o, l, low4) for (int j = 0; j < 16; j++) (o)[j * 16 + (l)] = NIBBLE_PAIR(low4, j)
/* The Q4 types' words: the same bytes, row l's four of weights 8g .. 8g + 7 side by side (one little-endian
 * 32-bit word: nibble i = weight 8g + i), words of rows 0 .. 15 for g = 0 .. 3. */
#define PUT_NIBBLE_WORDS(o, l, low4)                                                                            \
    for (int j = 0; j < 16; j++) (o)[64 * (j / 4) + 4 * (l) + j % 4] = NIBBLE_PAIR(low4, j)

/* The fifth bits of a block of 32 (bit i of h = weight i) as packed: byte (r, l), r < 4, holds in bits 2a and
 * 2a + 1 those of weights 2 (4a + r) and 2 (4a + r) + 1, the two weights of nibble byte row j = 4a + r. */
static void put_q5_high(uint8_t *o, int l, uint32_t h) {
    for (int r = 0; r < 4; r++) {
        unsigned v = 0;
        for (int a = 0; a < 4; a++) v |= ((h >> 2 * (4 * a + r)) & 3u) << 2 * a;
        o[r * 16 + l] = (uint8_t)v;
    }
}

static void pack_legacy(int type, const uint8_t *blk, uint8_t *o, int l) {
    memcpy(o + 2 * l, blk, 2); /* d */
    switch (type) {
    case RINGSHM_W_Q8_0:
        for (int k = 0; k < 32; k++) o[32 + k * 16 + l] = blk[2 + k];
        return;
    case RINGSHM_W_Q4_0: {
        const uint8_t *qs = blk + 2;
#define LOW4(i) nibble32(qs, i)
        PUT_NIBBLE_WORDS(o + 32, l, LOW4);
        return;
    }
    case RINGSHM_W_Q4_1: {
        const uint8_t *qs = blk + 4;
        memcpy(o + 32 + 2 * l, blk + 2, 2); /* m */
        PUT_NIBBLE_WORDS(o + 64, l, LOW4);
        return;
    }
    case RINGSHM_W_Q5_0: {
        const uint8_t *qs = blk + 6;
        put_q5_high(o + 32, l, blk[2] | (uint32_t)blk[3] << 8 | (uint32_t)blk[4] << 16 | (uint32_t)blk[5] << 24);
        PUT_NIBBLES(o + 96, l, LOW4);
        return;
    }
    default: { /* Q5_1 */
        const uint8_t *qs = blk + 8;
        memcpy(o + 32 + 2 * l, blk + 2, 2); /* m */
        put_q5_high(o + 64, l, blk[4] | (uint32_t)blk[5] << 8 | (uint32_t)blk[6] << 16 | (uint32_t)blk[7] << 24);
        PUT_NIBBLES(o + 128, l, LOW4);
        return;
    }
#undef LOW4
    }
}

/* MXFP4: e u8[16] at 0, the nibble words at 16 (Q4_0's: the same qs order). */
static void pack_mxfp4(const uint8_t *blk, uint8_t *o, int l) {
    const struct block_mxfp4 *b = (const struct block_mxfp4 *)blk;
    const uint8_t *qs = b->qs;
    o[l] = b->e;
#define LOW4(i) nibble32(qs, i)
    PUT_NIBBLE_WORDS(o + 16, l, LOW4);
#undef LOW4
}

/* Q4_K / Q5_K: d | dmin | scales[12][16] at 0, 32, 64; sub-block s at 256 + s * (Q5_K ? 320 : 256). */
static void pack_q45_k(int type, const uint8_t *blk, uint8_t *o, int l) {
    const int q5 = type == RINGSHM_W_Q5_K, sub_bytes = q5 ? 320 : 256;
    const uint8_t *qh = blk + 16, *qs = blk + (q5 ? 48 : 16);
    memcpy(o + 2 * l, blk, 2);
    memcpy(o + 32 + 2 * l, blk + 2, 2);
    for (int i = 0; i < 12; i++) o[64 + i * 16 + l] = blk[4 + i];
    for (int s = 0; s < 8; s++) {
        uint8_t *so = o + 256 + s * sub_bytes;
        const uint8_t *q = qs + 32 * (s / 2);
        const int shift = 4 * (s & 1);
#define LOW4(i) ((q[i] >> shift) & 15)
        if (q5) {
            uint32_t h = 0;
            for (int i = 0; i < 32; i++) h |= (uint32_t)((qh[i] >> s) & 1) << i;
            put_q5_high(so, l, h);
            so += 64;
            PUT_NIBBLES(so, l, LOW4);
        } else {
            PUT_NIBBLE_WORDS(so, l, LOW4);
        }
#undef LOW4
    }
}

/* Q6_K: d | sc[16][16] at 0, 32; sub-block s at 288 + 384 s: ql [16 j][16] | qh [8 r][16]. */
static void pack_q6_k(const uint8_t *blk, uint8_t *o, int l) {
    const struct block_q6_K *b = (const struct block_q6_K *)blk;
    memcpy(o + 2 * l, blk + offsetof(struct block_q6_K, d), 2);
    for (int i = 0; i < 16; i++) o[32 + i * 16 + l] = (uint8_t)b->scales[i];
    for (int s = 0; s < 8; s++) {
        uint8_t *so = o + 288 + s * 384;
        const int h = s / 4, c = s % 4; /* weights 32 s + i = 128 h + 32 c + i */
        const uint8_t *ql = b->ql + 64 * h + 32 * (c & 1), *qh = b->qh + 32 * h;
        const int shift = 4 * (c >> 1);
#define LOW4(i) ((ql[i] >> shift) & 15)
        PUT_NIBBLES(so, l, LOW4);
#undef LOW4
        /* high pairs: byte (r, l) holds nibble rows j = 8 (r / 4) + r % 4 (bits 0-3) and j + 4 (bits 4-7), each
         * as weight 2j in its bits 0-1 and weight 2j + 1 in bits 2-3 */
        for (int r = 0; r < 8; r++) {
            const int j = 8 * (r / 4) + r % 4;
            unsigned v = 0;
            for (int t = 0; t < 4; t++) { /* weights 2j, 2j + 1, 2 (j + 4), 2 (j + 4) + 1 */
                const int i = t < 2 ? 2 * j + t : 2 * (j + 4) + t - 2;
                v |= ((qh[i] >> 2 * c) & 3u) << 2 * t;
            }
            so[256 + r * 16 + l] = (uint8_t)v;
        }
    }
}

/* The panels of N rows of K, row r's GGUF bytes at rows ? rows[r] : src + r * row_bytes (the callers checked the
 * shape and sizes). */
static void pack_panels(const struct ringshm_wtype_info *t, int type, const uint8_t *src, int64_t row_bytes,
                        const uint8_t *const *rows, int64_t n, int64_t k, uint8_t *dst) {
    const int64_t nb = (k + t->block_k - 1) / t->block_k, n_panels = (n + 15) / 16, pb = t->panel_block_bytes;
    /* Panels in parallel (OpenMP's default thread count): each is written by one thread, the same bytes whatever
     * the count. The thread that zeroes a panel first touches its pages, so the kernel's zeroing of fresh memory
     * runs in parallel too: loading the OLMoE-shape Q4_K_M (4.2 GB) in one process spent 38 % of its samples in
     * the kernel clearing pages and 31 % packing, one thread (AMD EPYC Zen 5, perf). */
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < n_panels; p++) {
        uint8_t o[16 * sizeof(struct block_q6_K)]; /* one panel block (the largest type), then stored field by field */
        for (int64_t b = 0; b < nb; b++) {
            memset(o, 0, (size_t)pb); /* rows past n and k past the end stay zero */
            for (int l = 0; l < 16 && p * 16 + l < n; l++) {
                const uint8_t *row = rows ? rows[p * 16 + l] : src + (p * 16 + l) * row_bytes;
                if (!t->quantized) {
                    const int64_t wb = t->row_block_bytes / 32; /* bytes per weight */
                    for (int64_t kk = 0; kk < 32 && b * 32 + kk < k; kk++)
                        memcpy(o + (kk * 16 + l) * wb, row + (b * 32 + kk) * wb, (size_t)wb);
                } else if (type == RINGSHM_W_Q4_K || type == RINGSHM_W_Q5_K) {
                    pack_q45_k(type, row + b * t->row_block_bytes, o, l);
                } else if (type == RINGSHM_W_Q6_K) {
                    pack_q6_k(row + b * t->row_block_bytes, o, l);
                } else if (type == RINGSHM_W_MXFP4) {
                    pack_mxfp4(row + b * t->row_block_bytes, o, l);
                } else {
                    pack_legacy(type, row + b * t->row_block_bytes, o, l);
                }
            }
            const struct ringshm_block_at at = ringshm_block_at(t, n_panels, nb, p, b);
            memcpy(dst + at.head, o, (size_t)t->head_bytes);
            for (int64_t u = 0; u * t->unit_bytes < pb - t->head_bytes; u++)
                memcpy(dst + at.body + u * at.stride, o + t->head_bytes + u * t->unit_bytes, (size_t)t->unit_bytes);
        }
    }
}

int ringshm_qmat_pack(int type, const uint8_t *src, int64_t src_bytes, int64_t n, int64_t k, uint8_t *dst,
                      int64_t dst_bytes) {
    const struct ringshm_wtype_info *t = ringshm_wtype_info(type);
    const int64_t want_src = ringshm_qmat_src_bytes(type, n, k), want_dst = ringshm_qmat_packed_bytes(type, n, k);
    if (want_src < 0) return (int)want_src; /* unknown type or bad shape */
    if (src_bytes != want_src || dst_bytes != want_dst) return RINGSHM_MATMUL_ERR_SIZE;
    pack_panels(t, type, src, want_src / n, NULL, n, k, dst);
    return RINGSHM_MATMUL_OK;
}

int ringshm_qmat_pack_rows(int type, const uint8_t *const *rows, int64_t n, int64_t k, uint8_t *dst,
                           int64_t dst_bytes) {
    const struct ringshm_wtype_info *t = ringshm_wtype_info(type);
    const int64_t want_src = ringshm_qmat_src_bytes(type, n, k), want_dst = ringshm_qmat_packed_bytes(type, n, k);
    if (want_src < 0) return (int)want_src; /* unknown type or bad shape */
    if (!rows || dst_bytes != want_dst) return RINGSHM_MATMUL_ERR_SIZE;
    for (int64_t r = 0; r < n; r++)
        if (!rows[r]) return RINGSHM_MATMUL_ERR_SIZE;
    pack_panels(t, type, NULL, 0, rows, n, k, dst);
    return RINGSHM_MATMUL_OK;
}
