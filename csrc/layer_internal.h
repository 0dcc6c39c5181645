/* What layer.c and layer_moe.c share (not part of the cffi API): the scratch layout of one layer call and the
 * routed experts' FFN. */
#ifndef RINGSHM_LAYER_INTERNAL_H
#define RINGSHM_LAYER_INTERNAL_H

#include <stdint.h>

#include "layer.h"

/* Scratch layout, in floats, each [t, width] with rows of `width`:
 *   h [hidden] | qkv [round16(q + 2 kv)] | q [q] | k [kv] | v [kv] | attn [q] | x2 [hidden] | gu [2 I] | act [I]
 * (2 I is a multiple of 16: inter % 8 == 0). With routed experts (k of them per token), gu and act hold a row per
 * (token, rank) pair, t k rows of 2 expert_inter and expert_inter, and after act come
 *   logits [t, round16(E)] | wsel [t k] | isel [t k] (int32) | xs [t k, hidden] | ys [t k, hidden] | m [t, hidden]
 *   | order [t k] (int32) | where [t k] (int32) | offs [E + 1] (int32) | active [E] (int32) | p [E]
 *   and with a shared expert | sgu [t, 2 shared_inter] | sact [t, shared_inter] | sy [t, hidden] (| sg [t]: gated)
 * (p: one token's softmax; the int32 arrays take a float's room each), and with act_q8 last
 *   xq [max(t, t k) rows of the widest K / 32 blocks of 48 bytes] (the quantized rows of a matmul's x). */
struct layout {
    int64_t h, qkv, q, k, v, attn, x2, gu, act, logits, wsel, isel, xs, ys, m, order, where, offs, active, p;
    int64_t sgu, sact, sy, sg, total;
    int64_t qkv_w, gu_w, logits_w;
    int64_t xq, xq_row_bytes; /* act_q8: the quantized rows of a matmul's x, xq_row_bytes apart (the widest K) */
};

/* One matmul of the layer, x [m, k] . W^T (ringshm_qmat_matmul's arguments): with the shape's act_q8 and a quantized
 * weight, x's rows are quantized into the scratch's xq from row `row0` on (an expert's rows: experts on different
 * threads use disjoint rows) and the 8-bit matmul runs; otherwise the fp32 one. A status. */
int ringshm_layer_mm(const struct ringshm_layer_shape *s, const struct layout *l, float *work, int64_t row0, int type,
                     const uint8_t *packed, int64_t packed_bytes, int64_t n, int64_t k, const float *x, int64_t m,
                     float *out, int64_t ldo, const float *bias, int64_t bias_len, const float *residual,
                     int64_t ldr, int n_threads, int isa);

/* The shape's gate (act) on gu [m, 2 inter] rows [gate | up] into out [m, inter] (layer.c); a status. */
int ringshm_layer_act(const struct ringshm_layer_shape *s, float *out, const float *gu, int64_t m, int64_t inter);

/* x[i] = a[i] + b[i] * scale over n floats (layer.c). */
void ringshm_add_scaled_rows(float *x, const float *a, const float *b, float scale, int64_t n);

/* The routed experts' FFN on h [t, hidden] (layer.h), the result added to x2 into x (layer_moe.c); a status. */
int ringshm_moe_ffn(const struct ringshm_layer_shape *s, const struct ringshm_layer_weights *w, const struct layout *l,
                    float *work, const float *h, const float *x2, float *x, int64_t t, int n_threads, int isa);

#endif
