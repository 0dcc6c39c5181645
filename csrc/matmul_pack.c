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

/* Packed nibble byte (j, l) of one block of 32: weight 2j | weight 2j + 1 << 4, from `low4(i)`. */
#define NIBBLE_PAIR(low4, j) (uint8_t)((low4(2 * (j))) | (low4(2 * (j) + 1)) << 4)
/* The Q4 types' words: row l's nibble bytes of weights 8g .. 8g + 7 side by side (one little-endian 32-bit word:
 * nibble i = weight 8g + i), words of rows 0 .. 15 for g = 0 .. 3. */
#define PUT_NIBBLE_WORDS(o, l, low4)                                                                            \
    for (int j = 0; j < 16; j++) (o)[64 * (j / 4) + 4 * (l) + j % 4] = NIBBLE_PAIR(low4, j)

/* The words of one block of 32 (Q5_*, BITS 5) or of a Q6_K sub-block (BITS 6) of row l: v[i] = the value of weight
 * i, its field groups (matmul_internal.h's RINGSHM_FIELD_*) one after another, each word a little-endian u32 of a
 * unit of 16 rows (64 bytes). */
static void put_fields(uint8_t *o, int l, const int bits, const uint32_t v[32]) {
    const int f = RINGSHM_FIELDS(bits), nw = RINGSHM_FIELD_WORDS(bits), group = RINGSHM_FIELD_GROUP(bits);
    for (int g = 0; g < 32 / group; g++) {
        uint32_t w[5] = {0};
        for (int kk = 0; kk < group; kk++) {
            const uint32_t x = v[g * group + kk];
            if (kk < f * nw) {
                w[kk / f] |= x << bits * (kk % f);
            } else {
                for (int t = 0; t < bits; t++) { /* the stream of spare bits: bit 2i + t at bit 30 + t of word i */
                    const int bit = (kk - f * nw) * bits + t;
                    w[bit / 2] |= (x >> t & 1u) << (30 + bit % 2);
                }
            }
        }
        for (int i = 0; i < nw; i++)
            for (int t = 0; t < 4; t++) o[64 * (g * nw + i) + 4 * l + t] = (uint8_t)(w[i] >> 8 * t);
    }
}

/* Q5_0 / Q5_1: the 5-bit value of weight i of a block: its nibble and bit i of qh (a little-endian u32). */
static void q5_values(const uint8_t *qh4, const uint8_t *qs, uint32_t v[32]) {
    const uint32_t qh = qh4[0] | (uint32_t)qh4[1] << 8 | (uint32_t)qh4[2] << 16 | (uint32_t)qh4[3] << 24;
    for (int i = 0; i < 32; i++) v[i] = nibble32(qs, i) | (qh >> i & 1u) << 4;
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
        uint32_t v[32];
        q5_values(blk + 2, blk + 6, v);
        put_fields(o + 32, l, 5, v);
        return;
    }
    default: { /* Q5_1 */
        uint32_t v[32];
        memcpy(o + 32 + 2 * l, blk + 2, 2); /* m */
        q5_values(blk + 4, blk + 8, v);
        put_fields(o + 64, l, 5, v);
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

/* Q4_K / Q5_K: d | dmin | scales[12][16] at 0, 32, 64; sub-block s at 256 + s * (Q5_K ? 320 : 256): Q4_K's nibble
 * words, Q5_K's words of fields. */
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
            uint32_t v[32];
            for (int i = 0; i < 32; i++) v[i] = (uint32_t)LOW4(i) | (uint32_t)(qh[i] >> s & 1) << 4;
            put_fields(so, l, 5, v);
        } else {
            PUT_NIBBLE_WORDS(so, l, LOW4);
        }
#undef LOW4
    }
}

/* Q6_K: d | sc[16][16] at 0, 32; sub-block s (of 32) at 288 + 384 s: its two field groups of 16 weights (6
 * units of words). */
static void pack_q6_k(const uint8_t *blk, uint8_t *o, int l) {
    const struct block_q6_K *b = (const struct block_q6_K *)blk;
    memcpy(o + 2 * l, blk + offsetof(struct block_q6_K, d), 2);
    for (int i = 0; i < 16; i++) o[32 + i * 16 + l] = (uint8_t)b->scales[i];
    for (int s = 0; s < 8; s++) {
        uint32_t v[32];
        for (int i = 0; i < 32; i++) v[i] = (uint32_t)ringshm_q6_k_value(b, 32 * s + i);
        put_fields(o + 288 + 384 * s, l, 6, v);
    }
}

int ringshm_qmat_pack(int type, const uint8_t *src, int64_t src_bytes, int64_t n, int64_t k, uint8_t *dst,
                      int64_t dst_bytes) {
    const struct ringshm_wtype_info *t = ringshm_wtype_info(type);
    const int64_t want_src = ringshm_qmat_src_bytes(type, n, k), want_dst = ringshm_qmat_packed_bytes(type, n, k);
    if (want_src < 0) return (int)want_src; /* unknown type or bad shape */
    if (src_bytes != want_src || dst_bytes != want_dst) return RINGSHM_MATMUL_ERR_SIZE;
    const int64_t nb = (k + t->block_k - 1) / t->block_k, n_panels = (n + 15) / 16, pb = t->panel_block_bytes;
    const int64_t row_bytes = want_src / n;
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
                const uint8_t *row = src + (p * 16 + l) * row_bytes;
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
            for (int64_t u = 0; u * RINGSHM_UNIT_BYTES < pb - t->head_bytes; u++)
                memcpy(dst + at.body + u * at.stride, o + t->head_bytes + u * RINGSHM_UNIT_BYTES, RINGSHM_UNIT_BYTES);
        }
    }
    return RINGSHM_MATMUL_OK;
}
