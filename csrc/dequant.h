/*
 * GGUF block dequantization to float32 (ggml's ggml-common.h layouts; QK = 32 weights per block).
 *
 *   Q8_0  34 B: d f16 | qs int8[32]          w[j]      = d * qs[j]
 *   Q4_0  18 B: d f16 | qs u8[16]            w[j]      = d * ((qs[j] & 0xF) - 8)
 *                                            w[j + 16] = d * ((qs[j] >> 4) - 8)
 *   Q4_1  20 B: d f16 | m f16 | qs u8[16]    w[j]      = d * (qs[j] & 0xF) + m
 *                                            w[j + 16] = d * (qs[j] >> 4) + m
 *
 * src: n_blocks whole blocks; dst: 32 * n_blocks floats. Arithmetic is f32 with the f16 scales widened
 * exactly and no fused multiply-add, so results equal gguf.quants.dequantize bit for bit.
 * Returns 0, or -1 when n_blocks < 0.
 */
#ifndef RINGSHM_DEQUANT_H
#define RINGSHM_DEQUANT_H

#include <stdint.h>

/* CDEF BEGIN */
int ringshm_dequant_q8_0(const uint8_t *src, float *dst, int64_t n_blocks);
int ringshm_dequant_q4_0(const uint8_t *src, float *dst, int64_t n_blocks);
int ringshm_dequant_q4_1(const uint8_t *src, float *dst, int64_t n_blocks);
/* ringshm_dequant_rows: the embedding lookup, out[i, :] = row ids[i] of a GGUF tensor [n_rows, k], dequantized.
 *     type      a ringshm_wtype (Q8_0 / Q4_0 / Q4_1 by the functions above, bit-equal to gguf.quants; F16,
 *               BF16 widened exactly; F32 copied)
 *     src       the tensor's bytes as in the file, src_bytes == ringshm_qmat_src_bytes(type, n_rows, k)
 *     ids [n_ids] int64, out [n_ids, k] fp32
 * Returns 0; -1 for a bad type or shape, -2 when src_bytes differs, -3 for an id outside [0, n_rows)
 * (all checked before anything is written). */
int ringshm_dequant_rows(int type, const uint8_t *src, int64_t src_bytes, int64_t n_rows, int64_t k,
                         const int64_t *ids, int64_t n_ids, float *out);
/* CDEF END */

#endif /* RINGSHM_DEQUANT_H */
