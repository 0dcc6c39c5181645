/* GGUF block dequantization: see dequant.h. */
#include "dequant.h"

#include <string.h>

#define NO_FMA __attribute__((optimize("fp-contract=off")))

/* IEEE half -> float, exact (every half is representable as a float). */
static inline float half_to_float(const uint8_t *p) {
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
