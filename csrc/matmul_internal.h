/* What matmul.c, matmul_pack.c and dequant.c share with the per-ISA panel loops (matmul_impl.inc); not part of
 * the cffi API. */
#ifndef RINGSHM_MATMUL_INTERNAL_H
#define RINGSHM_MATMUL_INTERNAL_H

#include <stdint.h>
#include <string.h>

#include "matmul.h"

/* The block sums of x of the types with a min live on the stack (matmul_impl.inc): K may have at most this
 * many blocks of 32. */
#define RINGSHM_MM_MAX_SUM_BLOCKS 2048

/* One weight encoding (matmul.h's table). Float types: block_k = 32 and the last block may be cut short. */
struct ringshm_wtype_info {
    int block_k;           /* weights of a block along K: 32, or 256 for the K-quants */
    int row_block_bytes;   /* bytes of one block of one row in the GGUF file */
    int panel_block_bytes; /* bytes of one block of one packed 16-row panel */
    int quantized;         /* K must be whole blocks */
    int has_min;           /* the reduction adds fma(m, block sum of x) per block of 32 */
    int head_bytes;        /* a panel block's leading fields (scales), stored whole; the rest in units (below) */
    int unit_bytes;        /* the rest (the body) is units of this many bytes, each read whole by a kernel step */
};

/* The encoding of a ringshm_wtype, or NULL for an unknown type. */
static inline const struct ringshm_wtype_info *ringshm_wtype_info(int type) {
    /* units: 64 bytes where the kernels read a block 64 bytes at a time for all the panels of a step (the nibble
     * words, int8 and float rows); the whole body where mm_prepare_t first assembles one panel's bytes block of 32
     * by block of 32 (the Q5 types' qh | qs, Q6_K's ql | qh) */
    static const struct ringshm_wtype_info f32 = {32, 128, 2048, 0, 0, 0, 64}, f16 = {32, 64, 1024, 0, 0, 0, 64};
    static const struct ringshm_wtype_info q4_0 = {32, 18, 288, 1, 0, 32, 64}, q4_1 = {32, 20, 320, 1, 1, 64, 64};
    static const struct ringshm_wtype_info q5_0 = {32, 22, 352, 1, 0, 32, 320}, q5_1 = {32, 24, 384, 1, 1, 64, 320};
    static const struct ringshm_wtype_info q8_0 = {32, 34, 544, 1, 0, 32, 64}, mxfp4 = {32, 17, 272, 1, 0, 16, 64};
    static const struct ringshm_wtype_info q4_k = {256, 144, 2304, 1, 1, 256, 64};
    static const struct ringshm_wtype_info q5_k = {256, 176, 2816, 1, 1, 256, 2560};
    static const struct ringshm_wtype_info q6_k = {256, 210, 3360, 1, 0, 288, 3072};
    switch (type) {
    case RINGSHM_W_F32: return &f32;
    case RINGSHM_W_F16:
    case RINGSHM_W_BF16: return &f16;
    case RINGSHM_W_Q4_0: return &q4_0;
    case RINGSHM_W_Q4_1: return &q4_1;
    case RINGSHM_W_Q5_0: return &q5_0;
    case RINGSHM_W_Q5_1: return &q5_1;
    case RINGSHM_W_Q8_0: return &q8_0;
    case RINGSHM_W_MXFP4: return &mxfp4;
    case RINGSHM_W_Q4_K: return &q4_k;
    case RINGSHM_W_Q5_K: return &q5_k;
    case RINGSHM_W_Q6_K: return &q6_k;
    default: return 0;
    }
}

/* One block of 32 k of a row of x quantized for ringshm_qmat_matmul_q8 (matmul.h's 8-bit contract): x ~ d * q,
 * xs the sums of q over weights 0 .. 15 and 16 .. 31, s = d * (xs[0] + xs[1]) (the min term's block sum). q in the
 * order of the nibble words: q[8 g + c] is weight 8 g + 2 c, q[8 g + 4 + c] weight 8 g + 2 c + 1 (g, c < 4). */
struct ringshm_q8_block {
    float d, s;
    int32_t xs[2];
    int8_t q[32];
};

#define RINGSHM_PANEL_GROUP 8
/* Where packed block b (nbk blocks per panel) of panel p among n_panels lives (matmul.h's layout): panels in
 * groups of RINGSHM_PANEL_GROUP (the last one shorter: gw panels), a group's blocks in rows [b], a row field by
 * field: the gw panels' heads (head_bytes each) side by side, then unit u of each of the gw panels' bodies for
 * u = 0, 1, ... (unit_bytes each). head / body: byte offsets of the panel's head and of its body's
 * unit 0; unit u of the body is at body + u * stride. */
struct ringshm_block_at {
    int64_t head, body, stride;
};
static inline struct ringshm_block_at ringshm_block_at(const struct ringshm_wtype_info *t, int64_t n_panels,
                                                       int64_t nbk, int64_t p, int64_t b) {
    const int64_t g0 = p - p % RINGSHM_PANEL_GROUP, pi = p - g0;
    const int64_t gw = n_panels - g0 < RINGSHM_PANEL_GROUP ? n_panels - g0 : RINGSHM_PANEL_GROUP;
    const int64_t row = (g0 * nbk + b * gw) * t->panel_block_bytes;
    return (struct ringshm_block_at){row + pi * t->head_bytes, row + gw * t->head_bytes + pi * t->unit_bytes,
                                     gw * t->unit_bytes};
}

/* One checked call of ringshm_qmat_matmul or ringshm_qmat_matmul_q8. */
struct ringshm_mm_args {
    int type;
    const uint8_t *packed;
    int64_t n, k, m;        /* out[m, n] = x[m, k] . W[n, k]^T */
    int64_t nb;             /* blocks of 32 k per row: ceil(k / 32) (a K-quant's sub-blocks) */
    int64_t block_k;        /* weights of one packed block: 32, or 256 for a K-quant's super-block */
    int64_t block_bytes;    /* one packed block of one panel (16 rows) */
    int64_t panel_bytes;    /* ceil(k / block_k) * block_bytes */
    const float *x;         /* [m, k] */
    float *out;             /* [m, ldo] */
    int64_t ldo;
    const float *bias;      /* [n] or NULL */
    const float *residual;  /* [m, ldr] or NULL */
    int64_t ldr;
    int slab_blocks;        /* blocks of 32 k the scratch dequantizes at a time (1 .. 4): ringshm_mm_slab_blocks */
    const struct ringshm_q8_block *xq; /* ringshm_qmat_matmul_q8: [m][nb] (x is NULL), else NULL */
    int row_prefetch;       /* ringshm_mm_row_prefetch_for(type, m, q8) for this call: ask for the rows ahead */
};

/* Blocks of 32 k a slab of the matmul's scratch holds (matmul_impl.inc), from the L1 data cache: a slab of a group
 * of 4 panels takes 8 KiB a block, and 2/3 of L1 keeps room for the rows of x beside it: 4 for 48 KiB (measured
 * on an AMD EPYC Zen 5: 2 blocks 0.93 x, 3 0.98 x, 6 0.91 x the speed of 4, Q4_K 8192 x 2048, M = 256), 2 for 32
 * KiB, 2 where the size is unknown. The bits do not depend on it. */
int ringshm_mm_slab_blocks(void);

/* IEEE half -> float, exact (every half is a float). */
static inline float ringshm_half_to_float(const uint8_t *p) {
    uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, mant = h & 0x3FFu, bits;
    if (exp == 0x1F) {
        bits = sign | 0x7F800000u | (mant << 13); /* inf / nan */
    } else if (exp != 0) {
        bits = sign | ((exp + 112u) << 23) | (mant << 13); /* normal: rebias 15 -> 127 */
    } else if (mant == 0) {
        bits = sign; /* zero */
    } else {          /* subnormal half: normalise */
        exp = 113;
        while (!(mant & 0x400u)) {
            mant <<= 1;
            exp--;
        }
        bits = sign | (exp << 23) | ((mant & 0x3FFu) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

#endif /* RINGSHM_MATMUL_INTERNAL_H */
