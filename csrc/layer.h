/* ringshm_layer_forward: one decoder layer on a ragged batch of segments, in one C call.
 *
 * Decode runs 30 layers per token, and calling ten kernels per layer from Python cost more than the layer's
 * own arithmetic apart from the matmuls. This strings the same kernels together (matmul.h, kernels.h), in the
 * same order, so a stage's per-layer overhead is one call. One loop serves every supported family: the
 * description (ringshm.model_config.ModelConfig) arrives as the shape's act / attn_scale and the weights' optional
 * parts (NULL: absent):
 *
 *     h    = rms_norm(x, attn_norm)                                     [T, hidden]
 *     qkv  = h . Wqkv^T (+ bqkv)                                        [T, q_dim + 2 kv_dim]
 *            (one matmul, or three when Q, K, V are in different encodings: the same bits either way)
 *     q, k = rms_norm per head (q_norm, k_norm: [D]; Qwen 3, Gemma 3)
 *     per segment s (start p, n tokens, its block table, its tokens at offset o of the op):
 *         kv_append(pool, its table, rope(k), v) at positions p .. p + n - 1;  q[o .. o + n) = rope(q)   (this
 *         layer's cos / sin: Gemma 3's sliding layers have their own base)
 *     attn = attention of every segment through its table, this layer's window (0: causal over every earlier
 *            key), the shape's attn_scale and the layer's sinks, if any (ringshm_attn_forward_segments: threads
 *            over (segment, kv head))
 *     o    = attn . Wo^T (+ bo)
 *     x2   = x + o,  or with post norms  x2 = x + rms_norm(o, post_attn_norm)                [T, hidden]
 *     gu   = rms_norm(x2, ffn_norm) . Wgate_up^T (+ bgate_up)          [T, 2 I]  rows [gate | up]
 *     m    = act(gate) * up . Wdown^T (+ bdown)      act: silu (SwiGLU), gelu_tanh (GeGLU) or gpt-oss's clamped
 *            SwiGLU (RINGSHM_ACT_SWIGLU_OAI: ringshm_swiglu_oai_mul, (clamp(up) + 1) * ..., kernels.h)
 *     x    = x2 + m,  or with post norms  x = x2 + rms_norm(m, post_ffn_norm)                written over x
 *
 * residual_scale != 1 (Granite's residual_multiplier): x2 = x + (o * residual_scale) and x = x2 + (m *
 * residual_scale), the product rounded, then the add (transformers' order); not with post norms.
 *
 * q_norm_full (OLMoE): the q / k norms cover each token's whole projection (q_norm [q_dim], k_norm [kv_dim])
 * instead of each head's D values.
 *
 * A routed mixture of experts (shape n_experts > 0) replaces gu / m, with h = rms_norm(x2, ffn_norm):
 *     logits = h . Wrouter^T (+ router_bias)                           [T, E] (the matmul: every row alike)
 *     per token, in fixed order (expf is libm's: a host's glibc picks its variant by CPU, so hosts of different
 *     CPUs could differ in its last bit; one host, or hosts of one kind, give one result):
 *         p = softmax(logits) (max subtracted, expf, the sum over e ascending, then one
 *         division each); the k = n_experts_used largest p, picked one at a time by a scan over e ascending that
 *         keeps the first of equal values (ties go to the lowest id); w_r = p of rank r, or with gating
 *         RINGSHM_GATE_SOFTMAX_NORM w_r = p_r / (p_0 + ... + p_{k-1}) (summed in rank order). Gating
 *         RINGSHM_GATE_TOPK_SOFTMAX (Granite) picks the k largest logits the same way and takes the softmax over
 *         those k alone (the first one's logit subtracted, expf, summed in rank order, one division each)
 *     per expert e ascending, on the rows of the tokens routed to it (ascending token order):
 *         y = (act(h . Wgate_e^T + bgate_e) * (h . Wup_e^T + bup_e)) . Wdown_e^T + bdown_e   [rows, hidden]
 *             (width expert_inter; the biases gpt-oss's, each one rounded add after its matmul, where present)
 *     m[tok] = 0, then m[tok] = m[tok] + (w * y[tok]) for each of its experts in ascending id (two roundings
 *         each: the product, then the add; transformers' eager experts loop and index_add_)
 *     with a shared expert (shared_inter > 0; Qwen2-MoE, Granite MoE Shared), after the routed terms:
 *         s = (act(gate) * up) . Wsh_down^T with [gate | up] = h . Wsh_gate_up^T   [T, hidden] (the matmul)
 *         m[tok] = m[tok] + (g * s[tok]), g = 1 / (1 + expf(-z)), z = sum_j h[tok, j] * sh_gate_inp[j] (one fmaf
 *         per j, ascending from 0); without shared_gate m[tok] = m[tok] + s[tok]
 *     x = x2 + m
 * The matmuls compute each row alone (matmul.h), so a token's y for an expert is the same bits whether the
 * expert serves it alone or beside any other tokens of any streams, and a token's m depends only on its own h:
 * batch invariance holds through the routing. Threads: with at least n_threads experts active, each expert runs
 * whole on one thread (a dynamic schedule over the experts, most rows first); with fewer, one expert at a time
 * with its panels split over the threads. Neither changes a bit (the matmul's rows do not depend on the thread
 * count). Limits: n_experts <= RINGSHM_MAX_EXPERTS, 1 <= n_experts_used <= min(n_experts,
 * RINGSHM_MAX_EXPERTS_USED), expert_inter % 16 == 0 (gate and up share a row of the scratch), shared_inter % 16 ==
 * 0 and <= 2^24. Scratch grows with t k rows of hidden + 3 expert_inter + hidden floats (a 512-token chunk of
 * Qwen3-30B-A3B: ~105 MB), and with a shared expert t rows of 3 shared_inter + hidden (+ 1 with its gate).
 *
 * act_q8 = 1 (opt-in): each matmul whose weight is quantized quantizes its x rows first (ringshm_q8_quantize, per
 * row: the invariances above hold) and runs matmul.h's 8-bit contract; float weights (F16 / BF16 / F32 tensors, a
 * GGUF's MoE router) stay fp32. The scratch then holds the quantized rows too.
 *
 * Shapes: x [T, hidden] fp32, contiguous, T = sum of the segments' n. Segments: starts, lens [n_seg] int64, at
 * most RINGSHM_ATTN_MAX_SEGMENTS; segment i's block table is tables[table_offs[i] .. table_offs[i + 1]) (int32,
 * kernels.h). The caller guarantees that no block is written by two segments of an op (every segment's KV is
 * appended before any attention runs, so a shared written block would not see the order of a serial run) and
 * that each segment reads only KV already written (ringshm_kv_check); the kernels re-check what would go out of
 * bounds. KV: this layer's pool [n_blocks, Hkv, B, D] fp32. cos, sin: [n_pos, D / 2]. work: at least
 * ringshm_layer_work_floats(shape, T) floats of scratch. Every step is batch-invariant (each row reduced in a
 * fixed order), so the result for a segment does not depend on the other segments of the op, and the matmuls
 * split output rows over n_threads. Limits: hidden % 16 == 0 and, for a dense FFN, inter % 8 == 0 (rows of the
 * intermediates are whole 16-float vectors; a mixture of experts reads expert_inter instead, a multiple of 16).
 */
#ifndef RINGSHM_LAYER_H
#define RINGSHM_LAYER_H

#include <stdint.h>

#include "kernels.h"

/* CDEF BEGIN */
/* The MLP's gate (ringshm.model_config.ACTIVATIONS). */
enum ringshm_act { RINGSHM_ACT_SILU = 0, RINGSHM_ACT_GELU_TANH = 1, RINGSHM_ACT_SWIGLU_OAI = 2 };
/* How a routed MoE weighs its top-k experts (ringshm.model_config.EXPERT_GATINGS). */
enum ringshm_gating { RINGSHM_GATE_SOFTMAX = 0, RINGSHM_GATE_SOFTMAX_NORM = 1, RINGSHM_GATE_TOPK_SOFTMAX = 2 };
#define RINGSHM_MAX_EXPERTS 1024
#define RINGSHM_MAX_EXPERTS_USED 64

struct ringshm_layer_shape {
    int hidden, n_heads, n_kv_heads, head_dim, inter;
    int n_pos;        /* RoPE table rows: the most positions a stream may have */
    float rms_eps;
    int act;          /* enum ringshm_act */
    float attn_scale; /* the factor on q . k */
    int qk_norm_full; /* 1: q / k norms over the whole projection (OLMoE), 0: per head */
    int n_experts;    /* routed experts (0: the dense FFN gate_up / down) */
    int n_experts_used, expert_inter, gating; /* top-k, one expert's width, enum ringshm_gating */
    float residual_scale; /* each branch's output times this before its residual add (Granite); 1: none */
    int shared_inter;     /* with experts: a shared expert of this width beside the routed ones (0: none) */
    int shared_gate;      /* 1: the shared expert's output times sigmoid(h . sh_gate_inp) (Qwen2-MoE; Granite: 0) */
    float swiglu_alpha, swiglu_limit; /* act RINGSHM_ACT_SWIGLU_OAI: its alpha and limit (gpt-oss: 1.702, 7) */
    int act_q8; /* 1: every matmul of a quantized weight takes its x quantized to 8 bits (matmul.h's 8-bit contract,
                 * ringshm_qmat_matmul_q8; EngineConfig.matmul_activations "int8"); 0: fp32 x (the default) */
};

/* One layer's weights (packed, matmul.h), RoPE tables and KV cache; pointers stay owned by the caller. */
struct ringshm_layer_weights {
    int type_qkv, type_o, type_gate_up, type_down;              /* ringshm_wtype */
    const uint8_t *qkv, *o, *gate_up, *down;                    /* packed panels */
    int64_t qkv_bytes, o_bytes, gate_up_bytes, down_bytes;
    /* Q, K and V in encodings of their own (a Q4_K_M file keeps V in Q6_K in some layers and Q, K in Q4_K):
     * when qkv_split is 1, qkv / type_qkv / qkv_bytes hold Q's rows alone and wk / wv K's and V's, three
     * matmuls whose outputs sit where the fused one's would (bqkv stays [q_dim + 2 kv_dim]). */
    int qkv_split;
    int type_wk, type_wv;
    const uint8_t *wk, *wv;
    int64_t wk_bytes, wv_bytes;
    const float *bqkv, *bo, *bgate_up, *bdown;                  /* biases [rows of the matmul] or NULL */
    const float *attn_norm, *ffn_norm;                          /* [hidden] */
    const float *q_norm, *k_norm;                               /* [D] or NULL: no per-head q / k norm */
    const float *post_attn_norm, *post_ffn_norm;                /* [hidden] or NULL: no post norms */
    const float *cos, *sin;                                     /* [n_pos, D / 2]: this layer's RoPE */
    /* The elements each of the vectors above holds (0 for a NULL one), checked against the shape before the
     * layer reads anything: a checkpoint's norm of fewer than hidden floats must not be read past its end. */
    int64_t bqkv_len, bo_len, bgate_up_len, bdown_len;
    int64_t attn_norm_len, ffn_norm_len, q_norm_len, k_norm_len, post_attn_norm_len, post_ffn_norm_len;
    int64_t cos_len, sin_len;
    /* Routed experts (shape n_experts > 0; gate_up / down unused): the router [E, hidden] packed, and per role
     * the E experts' packed weights one after another, exp_*_bytes apart (one expert's packed size, which the
     * matmul checks); the caller guarantees E of them behind each pointer. */
    int type_router, type_exp_gate, type_exp_up, type_exp_down;
    const uint8_t *router, *exp_gate, *exp_up, *exp_down;
    int64_t router_bytes, exp_gate_bytes, exp_up_bytes, exp_down_bytes;
    /* The shared expert (shape shared_inter > 0): gate and up fused [2 shared_inter, hidden] rows [gate | up],
     * down [hidden, shared_inter], packed; its gate's weights [hidden] (shape shared_gate) or NULL. */
    int type_sh_gate_up, type_sh_down;
    const uint8_t *sh_gate_up, *sh_down;
    int64_t sh_gate_up_bytes, sh_down_bytes;
    const float *sh_gate_inp;
    int64_t sh_gate_inp_len;
    /* gpt-oss: attention sinks [n_heads] (kernels.h), the router's bias [E], and each expert's biases, E after
     * one another: gate and up [E, expert_inter] each, down [E, hidden]; NULL (length 0) where absent */
    const float *sinks, *router_bias, *exp_gate_bias, *exp_up_bias, *exp_down_bias;
    int64_t sinks_len, router_bias_len, exp_gate_bias_len, exp_up_bias_len, exp_down_bias_len;
    int window;                                                 /* sliding-window keys, 0: none */
    struct ringshm_kv_pool kv;                                  /* this layer's blocks (kernels.h) */
};

/* Scratch floats ringshm_layer_forward needs for an op of t tokens (< 0 on a bad shape). */
int64_t ringshm_layer_work_floats(const struct ringshm_layer_shape *s, int64_t t);

/* Returns 0, a RINGSHM_MATMUL_ERR_* / RINGSHM_KERNEL_ERR_* status from the step that refused (before that
 * step wrote anything), RINGSHM_KERNEL_ERR_SHAPE for a bad shape or segment table, or RINGSHM_KERNEL_ERR_LENGTH
 * for a vector of the weights whose length is not what the shape reads: norms hidden (q / k norms D), biases
 * their matmul's rows, cos and sin n_pos * D / 2 (these two before anything). */
int ringshm_layer_forward(const struct ringshm_layer_shape *s, const struct ringshm_layer_weights *w, float *x,
                          int64_t t, const int64_t *starts, const int64_t *lens, const int32_t *tables,
                          const int64_t *table_offs, int n_seg, float *work, int64_t work_floats, int n_threads,
                          int isa);

/* ringshm_layer_kv: the layer's steps up to each segment's kv_append alone (h, the Q / K / V matmul, the k norm),
 * the same bits as ringshm_layer_forward writes into the pool; x is only read. For the last layer of an op whose
 * outputs need few of its tokens (a prefill chunk that wants the last position's logits, or none): the pool gets
 * every token's keys and values here, and ringshm_layer_forward then runs the tokens that are wanted, each a
 * segment of its own at its position (their keys and values written again, the same bits: a token's rows do not
 * depend on the tokens beside it). Returns as ringshm_layer_forward. */
int ringshm_layer_kv(const struct ringshm_layer_shape *s, const struct ringshm_layer_weights *w, const float *x,
                     int64_t t, const int64_t *starts, const int64_t *lens, const int32_t *tables,
                     const int64_t *table_offs, int n_seg, float *work, int64_t work_floats, int n_threads, int isa);
/* CDEF END */

#endif /* RINGSHM_LAYER_H */
