/* GGUF quantized blocks as they lie in the file (ggml's ggml-common.h), one struct each with its size asserted,
 * and the few bit rules every reader of them shares. Not part of the cffi API.
 *
 * Legacy types, 32 weights a block; weight j < 16 sits in the low nibble of qs[j], weight j + 16 in its high
 * nibble; Q5_x add bit i of qh (read as a little-endian u32) as bit 4 of weight i:
 *
 *   block_q4_0   18 B   d f16 | qs u8[16]                        w = d * (q - 8)
 *   block_q4_1   20 B   d f16 | m f16 | qs u8[16]                w = d * q + m
 *   block_q5_0   22 B   d f16 | qh u8[4] | qs u8[16]             w = d * (q - 16)
 *   block_q5_1   24 B   d f16 | m f16 | qh u8[4] | qs u8[16]     w = d * q + m
 *   block_q8_0   34 B   d f16 | qs i8[32]                        w = d * q
 *   block_mxfp4  17 B   e u8 | qs u8[16]                         w = 2^(e - 128) * kvalues[q]
 *       e: an E8M0 scale (8 exponent bits, no sign, no mantissa); q: the nibble, an e2m1 value's bits, read
 *       doubled through RINGSHM_MXFP4_KVALUES (ggml's kvalues_mxfp4; q = 8 is +0) so that its halves are whole;
 *       2^(e - 128) (half the scale 2^(e - 127)) is ringshm_e8m0_to_float_half's float, exact for every e.
 *
 * K-quants, super-blocks of 256 weights (QK_K):
 *
 *   block_q4_K  144 B   d f16 | dmin f16 | scales u8[12] | qs u8[128]
 *   block_q5_K  176 B   d f16 | dmin f16 | scales u8[12] | qh u8[32] | qs u8[128]
 *       8 sub-blocks of 32, sub-block s has a 6-bit scale sc[s] and a 6-bit min m[s] packed into `scales`:
 *         s < 4:  sc = scales[s] & 63,                         m = scales[s + 4] & 63
 *         s >= 4: sc = (scales[s + 4] & 15) | (scales[s - 4] >> 6) << 4,
 *                 m  = (scales[s + 4] >> 4) | (scales[s] >> 6) << 4
 *       (bytes 0-3 hold the low 6 bits of sc[0..3] and, in their top 2 bits, the high bits of sc[4..7]; bytes
 *       4-7 the same for the mins; bytes 8-11 the low nibbles of sc[4..7] and, high nibbles, of m[4..7]).
 *       Weight l of sub-block s (l < 32): low 4 bits from qs[32 (s / 2) + l], low nibble when s is even, high
 *       nibble when odd; Q5_K adds bit s of qh[l] as bit 4.      w = (d * sc) * q - dmin * m
 *
 *   block_q6_K  210 B   ql u8[128] | qh u8[64] | scales i8[16] | d f16
 *       two halves of 128; weight 128 h + 32 c + l (c < 4, l < 32): low 4 bits from ql[64 h + 32 (c & 1) + l],
 *       low nibble for c < 2, high nibble for c >= 2; high 2 bits are bits 2c, 2c + 1 of qh[32 h + l];
 *       q = that 6-bit value - 32. 16 int8 scales, one per 16 weights (weight i has scales[i / 16]).
 *                                                                 w = (d * sc) * q
 */
#ifndef RINGSHM_GGUF_BLOCKS_H
#define RINGSHM_GGUF_BLOCKS_H

#include <stdint.h>
#include <string.h>

#define RINGSHM_QK 32    /* weights per legacy block */
#define RINGSHM_QK_K 256 /* weights per K-quant super-block */

typedef uint16_t ringshm_half; /* IEEE binary16 bits, little-endian in the file */

struct block_q4_0 {
    ringshm_half d;
    uint8_t qs[RINGSHM_QK / 2];
};
struct block_q4_1 {
    ringshm_half d, m;
    uint8_t qs[RINGSHM_QK / 2];
};
struct block_q5_0 {
    ringshm_half d;
    uint8_t qh[4];
    uint8_t qs[RINGSHM_QK / 2];
};
struct block_q5_1 {
    ringshm_half d, m;
    uint8_t qh[4];
    uint8_t qs[RINGSHM_QK / 2];
};
struct block_q8_0 {
    ringshm_half d;
    int8_t qs[RINGSHM_QK];
};
struct block_mxfp4 {
    uint8_t e; /* E8M0 */
    uint8_t qs[RINGSHM_QK / 2];
};
struct block_q4_K {
    ringshm_half d, dmin;
    uint8_t scales[12];
    uint8_t qs[RINGSHM_QK_K / 2];
};
struct block_q5_K {
    ringshm_half d, dmin;
    uint8_t scales[12];
    uint8_t qh[RINGSHM_QK_K / 8];
    uint8_t qs[RINGSHM_QK_K / 2];
};
struct block_q6_K {
    uint8_t ql[RINGSHM_QK_K / 2];
    uint8_t qh[RINGSHM_QK_K / 4];
    int8_t scales[RINGSHM_QK_K / 16];
    ringshm_half d;
};

_Static_assert(sizeof(struct block_q4_0) == 18, "block_q4_0: d f16, 16 B of nibbles");
_Static_assert(sizeof(struct block_q4_1) == 20, "block_q4_1: d, m f16, 16 B of nibbles");
_Static_assert(sizeof(struct block_q5_0) == 22, "block_q5_0: d f16, 4 B of high bits, 16 B of nibbles");
_Static_assert(sizeof(struct block_q5_1) == 24, "block_q5_1: d, m f16, 4 B of high bits, 16 B of nibbles");
_Static_assert(sizeof(struct block_q8_0) == 34, "block_q8_0: d f16, 32 int8");
_Static_assert(sizeof(struct block_mxfp4) == 17, "block_mxfp4: e u8, 16 B of nibbles");
_Static_assert(sizeof(struct block_q4_K) == 144, "block_q4_K: d, dmin f16, 12 B of scales, 128 B of nibbles");
_Static_assert(sizeof(struct block_q5_K) == 176, "block_q5_K: block_q4_K's fields and 32 B of high bits");
_Static_assert(sizeof(struct block_q6_K) == 210, "block_q6_K: 128 B low nibbles, 64 B high pairs, 16 scales, d");

/* The 6-bit scale and min of sub-block s (0..7) of a Q4_K / Q5_K super-block (layout above). */
static inline void ringshm_kq_scale_min(const uint8_t *scales, int s, int *sc, int *m) {
    if (s < 4) {
        *sc = scales[s] & 63, *m = scales[s + 4] & 63;
    } else {
        *sc = (scales[s + 4] & 15) | (scales[s - 4] >> 6) << 4;
        *m = (scales[s + 4] >> 4) | (scales[s] >> 6) << 4;
    }
}

/* MXFP4's 16 weights a nibble can give, as an initializer list: e2m1 (sign, 2 exponent bits, 1 mantissa bit) times
 * 2 (ggml's kvalues_mxfp4). Nibble 8 is +0 (e2m1's -0), as in ggml and gguf.quants. */
#define RINGSHM_MXFP4_KVALUES 0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12

/* An MXFP4 block's d = 2^(e - 128) (ggml's ggml_e8m0_to_fp32_half: half the E8M0 scale 2^(e - 127), as the
 * kvalues are doubled), built from bits: (e - 1) << 23 (a normal float, 2^-126 .. 2^127) for e >= 2, and
 * 0x00200000 << e for e < 2 (the subnormals 2^-128, 2^-127). Exact for every e; no float op, so no FP mode. */
static inline float ringshm_e8m0_to_float_half(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

#endif /* RINGSHM_GGUF_BLOCKS_H */
