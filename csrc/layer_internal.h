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
 * (p: one token's softmax; the int32 arrays take a float's room each). */
struct layout {
    int64_t h, qkv, q, k, v, attn, x2, gu, act, logits, wsel, isel, xs, ys, m, order, where, offs, active, p;
    int64_t sgu, sact, sy, sg, total;
    int64_t qkv_w, gu_w, logits_w;
};

/* The shape's gate (act) on gu [m, 2 inter] rows [gate | up] into out [m, inter] (layer.c); a status. */
int ringshm_layer_act(const struct ringshm_layer_shape *s, float *out, const float *gu, int64_t m, int64_t inter);

/* x[i] = a[i] + b[i] * scale over n floats (layer.c). */
void ringshm_add_scaled_rows(float *x, const float *a, const float *b, float scale, int64_t n);

/* The routed experts' FFN on h [t, hidden] (layer.h), the result added to x2 into x (layer_moe.c); a status. */
int ringshm_moe_ffn(const struct ringshm_layer_shape *s, const struct ringshm_layer_weights *w, const struct layout *l,
                    float *work, const float *h, const float *x2, float *x, int64_t t, int n_threads, int isa);

#endif
