/* GGUF block dequantization: see dequant.h. */
#include "dequant.h"

#include <string.h>

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
