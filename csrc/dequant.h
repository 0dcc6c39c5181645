/*
 * GGUF block dequantization to float32 (ggml's ggml-common.h layouts, drawn in gguf_blocks.h; 32 weights a
 * block, 256 a K-quant super-block). q is the block's integer as gguf_blocks.h reads it:
 *
 *   Q8_0  34 B   w = d * q                     Q5_0  22 B   w = d * (q - 16)
 *   Q4_0  18 B   w = d * (q - 8)               Q5_1  24 B   w = d * q + m
 *   Q4_1  20 B   w = d * q + m                 MXFP4 17 B   w = 2^(e - 128) * kvalues[q]
 *   Q4_K 144 B, Q5_K 176 B   w = (d * sc) * q - dmin * m    (sc, m: the sub-block's 6-bit scale and min)
 *   Q6_K 210 B               w = (d * sc) * (q - 32)        (sc: the int8 scale of 16 weights)
 *
 * src: n_blocks whole blocks; dst: 32 * n_blocks floats (256 * n_blocks for the K-quants). Arithmetic is f32,
 * one rounding per operation in the order written (f16 fields widened exactly, integers converted exactly, no
 * fused multiply-add), which is gguf.quants.dequantize's numpy float32 order: results equal it bit for bit. MXFP4's
 * e is an E8M0 byte (every e a finite power of two, the subnormals 2^-128, 2^-127 included) and kvalues its e2m1
 * values doubled (gguf_blocks.h): w is exact, or inf for e >= 253 and a large nibble, as in gguf.quants.
 * Returns 0, or -1 when n_blocks < 0.
 */
#ifndef RINGSHM_DEQUANT_H
#define RINGSHM_DEQUANT_H

#include <stdint.h>

/* CDEF BEGIN */
int ringshm_dequant_q8_0(const uint8_t *src, float *dst, int64_t n_blocks);
int ringshm_dequant_q4_0(const uint8_t *src, float *dst, int64_t n_blocks);
int ringshm_dequant_q4_1(const uint8_t *src, float *dst, int64_t n_blocks);
int ringshm_dequant_q5_0(const uint8_t *src, float *dst, int64_t n_blocks);
int ringshm_dequant_q5_1(const uint8_t *src, float *dst, int64_t n_blocks);
int ringshm_dequant_mxfp4(const uint8_t *src, float *dst, int64_t n_blocks);
int ringshm_dequant_q4_k(const uint8_t *src, float *dst, int64_t n_blocks);
int ringshm_dequant_q5_k(const uint8_t *src, float *dst, int64_t n_blocks);
int ringshm_dequant_q6_k(const uint8_t *src, float *dst, int64_t n_blocks);
/* ringshm_dequant_rows: the embedding lookup, out[i, :] = row ids[i] of a GGUF tensor [n_rows, k], dequantized.
 *     type      a ringshm_wtype (the quantized ones by the functions above, bit-equal to gguf.quants; F16,
 *               BF16 widened exactly; F32 copied)
 *     src       the tensor's bytes as in the file, src_bytes == ringshm_qmat_src_bytes(type, n_rows, k)
 *     ids [n_ids] int64, out [n_ids, k] fp32
 * Returns 0; -1 for a bad type or shape, -2 when src_bytes differs, -3 for an id outside [0, n_rows)
 * (all checked before anything is written). */
int ringshm_dequant_rows(int type, const uint8_t *src, int64_t src_bytes, int64_t n_rows, int64_t k,
                         const int64_t *ids, int64_t n_ids, float *out);
/* CDEF END */

#endif /* RINGSHM_DEQUANT_H */
