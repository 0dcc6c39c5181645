/* What matmul.c shares with the per-ISA panel loops (matmul_impl.inc); not part of the cffi API. */
#ifndef RINGSHM_MATMUL_INTERNAL_H
#define RINGSHM_MATMUL_INTERNAL_H

#include <stdint.h>
#include <string.h>

/* Q4_1's block sums of x live on the stack (matmul_impl.inc): K may have at most this many blocks. */
#define RINGSHM_MM_MAX_Q4_1_BLOCKS 2048

/* One checked call of ringshm_qmat_matmul. */
struct ringshm_mm_args {
    int type;
    const uint8_t *packed;
    int64_t n, k, m;        /* out[m, n] = x[m, k] . W[n, k]^T */
    int64_t nb;             /* blocks of 32 k per row: ceil(k / 32) */
    int64_t block_bytes;    /* one block of one panel (16 rows) */
    int64_t panel_bytes;    /* nb * block_bytes */
    const float *x;         /* [m, k] */
    float *out;             /* [m, ldo] */
    int64_t ldo;
    const float *bias;      /* [n] or NULL */
    const float *residual;  /* [m, ldr] or NULL */
    int64_t ldr;
};

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
