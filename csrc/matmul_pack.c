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

/* The nibbles at bits sh .. sh + 3 of the bytes p[0 .. 7], as one 32-bit word (nibble i from p[i]), so byte c
 * = nibble 2c | nibble 2c + 1 << 4: eight weights' packed bytes at once, by shifts and masks on a 64-bit word,
 * where a byte loop took ~4 ops a weight (4096 x 2048 Q4_K, one thread, AMD EPYC Zen 5: 1.39 GB/s of packed
 * bytes with the byte loop). Byte i of x is its bits 8i .. 8i + 7: the host is little-endian (asserted). */
static inline uint32_t nibbles8(const uint8_t *p, int sh) {
    uint64_t x;
    memcpy(&x, p, 8);
    x = (x >> sh) & 0x0F0F0F0F0F0F0F0Full;    /* byte i: n_i */
    x = (x | x >> 4) & 0x00FF00FF00FF00FFull; /* byte 2m: n_2m | n_2m+1 << 4 */
    x = (x | x >> 8) & 0x0000FFFF0000FFFFull; /* 16 bits at 0 and at 32: n_0 .. n_3, n_4 .. n_7 */
    return (uint32_t)(x | x >> 16);
}
_Static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "nibbles8 reads a 64-bit word's bytes little-endian");

/* Where a block of 32's low nibbles come from: weights 8g .. 8g + 7 are the nibbles at bit sh[g] of the eight
 * bytes from src[g]. */
struct nibbles {
    const uint8_t *src[4];
    int sh[4];
};
/* A GGUF legacy block's (Q4_0, Q4_1, Q5_0, Q5_1, MXFP4): weight i < 16 the low nibble of qs[i], else the high one
 * of qs[i - 16]. */
static inline struct nibbles legacy_nibbles(const uint8_t *qs) { return (struct nibbles){{qs, qs + 8, qs, qs + 8},
                                                                                         {0, 0, 4, 4}}; }
/* A K-quant's block of 32 (Q4_K, Q5_K, Q6_K's low bits): weight i the nibble at bit sh of q[i]. */
static inline struct nibbles shifted_nibbles(const uint8_t *q, int sh) {
    return (struct nibbles){{q, q + 8, q + 16, q + 24}, {sh, sh, sh, sh}};
}

/* Row l's packed nibbles (matmul.h): byte j = weight 2j | weight 2j + 1 << 4. As the Q4 types' words (word g of
 * row l at 64 g + 4 l: nibble i = weight 8g + i) or as the Q5 types' and Q6_K's bytes (byte j at 16 j + l). */
static inline void put_nibble_words(uint8_t *o, int l, struct nibbles n) {
    for (int g = 0; g < 4; g++) {
        const uint32_t w = nibbles8(n.src[g], n.sh[g]);
        memcpy(o + 64 * g + 4 * l, &w, 4);
    }
}
static inline void put_nibble_bytes(uint8_t *o, int l, struct nibbles n) {
    for (int g = 0; g < 4; g++) {
        const uint32_t w = nibbles8(n.src[g], n.sh[g]);
        for (int c = 0; c < 4; c++) o[(4 * g + c) * 16 + l] = (uint8_t)(w >> 8 * c);
    }
}

/* The fifth bits of a block of 32 (bit i of h = weight i) as packed: byte (r, l), r < 4, holds in bits 2a and
 * 2a + 1 those of weights 2 (4a + r) and 2 (4a + r) + 1, the two weights of nibble byte row j = 4a + r. */
static void put_q5_high(uint8_t *o, int l, uint32_t h) {
    for (int r = 0; r < 4; r++) {
        uint32_t u = (h >> 2 * r) & 0x03030303u; /* byte a: the pair of row j = 4a + r */
        u = (u | u >> 6) & 0x000F000Fu;          /* bits 0-3: a = 0, 1; bits 16-19: a = 2, 3 */
        o[r * 16 + l] = (uint8_t)(u | u >> 12);
    }
}

/* Bit s of each of the bytes qh[0 .. 31] as bit i of a word (Q5_K's fifth bits of a block of 32): eight bytes a
 * step, each byte's bit moved to its bottom and the eight gathered into the top byte by one multiply (the
 * partial products that land there never carry into one another). */
static inline uint32_t bits32(const uint8_t *qh, int s) {
    uint32_t h = 0;
    for (int q = 0; q < 4; q++) {
        uint64_t x;
        memcpy(&x, qh + 8 * q, 8);
        h |= (uint32_t)((((x >> s) & 0x0101010101010101ull) * 0x0102040810204080ull) >> 56) << 8 * q;
    }
    return h;
}

static void pack_legacy(int type, const uint8_t *blk, uint8_t *o, int l) {
    memcpy(o + 2 * l, blk, 2); /* d */
    switch (type) {
    case RINGSHM_W_Q8_0:
        for (int k = 0; k < 32; k++) o[32 + k * 16 + l] = blk[2 + k];
        return;
    case RINGSHM_W_Q4_0: put_nibble_words(o + 32, l, legacy_nibbles(blk + 2)); return;
    case RINGSHM_W_Q4_1:
        memcpy(o + 32 + 2 * l, blk + 2, 2); /* m */
        put_nibble_words(o + 64, l, legacy_nibbles(blk + 4));
        return;
    case RINGSHM_W_Q5_0:
        put_q5_high(o + 32, l, blk[2] | (uint32_t)blk[3] << 8 | (uint32_t)blk[4] << 16 | (uint32_t)blk[5] << 24);
        put_nibble_bytes(o + 96, l, legacy_nibbles(blk + 6));
        return;
    default: /* Q5_1 */
        memcpy(o + 32 + 2 * l, blk + 2, 2); /* m */
        put_q5_high(o + 64, l, blk[4] | (uint32_t)blk[5] << 8 | (uint32_t)blk[6] << 16 | (uint32_t)blk[7] << 24);
        put_nibble_bytes(o + 128, l, legacy_nibbles(blk + 8));
        return;
    }
}

/* MXFP4: e u8[16] at 0, the nibble words at 16 (Q4_0's: the same qs order). */
static void pack_mxfp4(const uint8_t *blk, uint8_t *o, int l) {
    const struct block_mxfp4 *b = (const struct block_mxfp4 *)blk;
    o[l] = b->e;
    put_nibble_words(o + 16, l, legacy_nibbles(b->qs));
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
        const struct nibbles n = shifted_nibbles(qs + 32 * (s / 2), 4 * (s & 1));
        if (q5) {
            put_q5_high(so, l, bits32(qh, s));
            put_nibble_bytes(so + 64, l, n);
        } else {
            put_nibble_words(so, l, n);
        }
    }
}

/* Q6_K's high pairs of a block of 32 as packed: byte (r, l) at 16 r + l holds nibble rows j = 8 (r / 4) + r % 4
 * (bits 0-3) and j + 4 (bits 4-7), each as weight 2j in its bits 0-1 and weight 2j + 1 in bits 2-3: the 2-bit
 * fields at bit 2c of qh[i] for i = 2j, 2j + 1, 2j + 8, 2j + 9. Four rows r a 64-bit step (qh[16 h .. 16 h + 15]
 * for rows 4h .. 4h + 3): byte m of z = field(m) | field(8 + m) << 4, and z | z >> 6 puts the next byte's two
 * fields above them, so its even bytes are the four packed bytes. */
static inline void put_q6_high(uint8_t *o, int l, const uint8_t *qh, int c) {
    for (int h = 0; h < 2; h++) {
        uint64_t x, y;
        memcpy(&x, qh + 16 * h, 8);
        memcpy(&y, qh + 16 * h + 8, 8);
        const uint64_t z = ((x >> 2 * c) & 0x0303030303030303ull) | ((y >> 2 * c) & 0x0303030303030303ull) << 4;
        const uint64_t w = z | z >> 6;
        for (int r = 0; r < 4; r++) o[(4 * h + r) * 16 + l] = (uint8_t)(w >> 16 * r);
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
        put_nibble_bytes(so, l, shifted_nibbles(ql, 4 * (c >> 1)));
        put_q6_high(so + 256, l, qh, c);
    }
}

/* The panels of N rows of K, row r's GGUF bytes (row_len of them) at rows ? rows[r] : src + r * row_len (the
 * callers checked the shape and sizes). */
static void pack_panels(const struct ringshm_wtype_info *t, int type, const uint8_t *src, int64_t row_len,
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
                const uint8_t *row = rows ? rows[p * 16 + l] : src + (p * 16 + l) * row_len;
                if (p * 16 + 16 + l < n) { /* the next panel's row at this block: 16 rows' blocks apart, which
                                            * the hardware prefetcher did not follow (a Q4_K pack waited on these
                                            * loads ~half its time); within the row (a float row's last block
                                            * may be short) */
                    const uint8_t *next = rows ? rows[p * 16 + 16 + l] : src + (p * 16 + 16 + l) * row_len;
                    for (int64_t off = b * t->row_block_bytes; off < (b + 1) * t->row_block_bytes && off < row_len;
                         off += 64)
                        __builtin_prefetch(next + off, 0, 0);
                }
                if (!t->quantized) { /* 2 or 4 bytes a weight, each copy of a constant size (one move, no call) */
                    const int64_t kn = k - b * 32 < 32 ? k - b * 32 : 32; /* a float block may end short of 32 */
                    if (t->row_block_bytes == 64)
                        for (int64_t kk = 0; kk < kn; kk++) memcpy(o + (kk * 16 + l) * 2, row + (b * 32 + kk) * 2, 2);
                    else
                        for (int64_t kk = 0; kk < kn; kk++) memcpy(o + (kk * 16 + l) * 4, row + (b * 32 + kk) * 4, 4);
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
    pack_panels(t, type, NULL, want_src / n, rows, n, k, dst);
    return RINGSHM_MATMUL_OK;
}
