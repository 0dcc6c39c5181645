/* ringshm kernels: RoPE, KV-append and causal GQA attention over one KV-cache row, fp32, single thread.
 *
 * These are the hot path of a stage process: decode (n = 1) and speculative verify (n = 8) run one
 * attention call per layer per op. The caller (ringshm/kernels.py) checks shapes, dtypes, devices and
 * contiguity before every call; the C side re-checks only what a wrong value would turn into an
 * out-of-bounds access, and answers with a status. Nothing here prints, exits, allocates or keeps state.
 *
 * Tensor layout (row-major, contiguous, fp32; names as in the Python docstrings):
 *
 *     q, out       [n, Hq, D]          query j of the chunk sits at absolute position start + j
 *     k, v         [n, Hkv, D]         new keys/values of the chunk, k not yet rotated
 *     cache row    [Hkv, S_max, D]     one row of the per-layer cache [R, Hkv, S_max, D]
 *     cos, sin     [P, D/2]            RoPE tables, row p = position p (ringshm.kernels.rope_tables)
 *
 * RoPE is the rotate-half (NeoX / Hugging Face Llama) layout: dims i and i + D/2 form a pair,
 *     x'[i]       = x[i]       * cos[p, i] - x[i + D/2] * sin[p, i]
 *     x'[i + D/2] = x[i + D/2] * cos[p, i] + x[i]       * sin[p, i]        for 0 <= i < D/2.
 *
 * Limits: 0 < D <= ringshm_attn_max_head_dim() and D % 16 == 0 for attention (vector width); Hq % Hkv == 0.
 */
#ifndef RINGSHM_KERNELS_H
#define RINGSHM_KERNELS_H

#include <stdint.h>

/* Largest head_dim the attention kernel accepts; its per-call state lives in fixed stack buffers sized by it. */
#define RINGSHM_ATTN_MAX_HEAD_DIM 256
/* head_dim must be a multiple of this (one 16-float vector). */
#define RINGSHM_ATTN_HEAD_DIM_MULTIPLE 16
/* Most segments of one ragged attention call (its per-call offsets table lives on the stack). */
#define RINGSHM_ATTN_MAX_SEGMENTS 4096

/* CDEF BEGIN */
/* Status codes of the kernels; distinct from the ring's (-1 .. -7) so one table can map both. */
enum ringshm_kernel_status {
    RINGSHM_KERNEL_OK = 0,
    RINGSHM_KERNEL_ERR_SHAPE = -16, /* a dimension is <= 0, D odd or too large, Hq % Hkv != 0 */
    RINGSHM_KERNEL_ERR_RANGE = -17  /* start + n past S_max or past the RoPE table, or a row index out of range */
};

/* Largest head_dim (D) the attention kernel accepts (RINGSHM_ATTN_MAX_HEAD_DIM). */
int ringshm_attn_max_head_dim(void);
/* Most segments of one ringshm_attn_forward_segments / ringshm_layer_forward call (RINGSHM_ATTN_MAX_SEGMENTS). */
int ringshm_attn_max_segments(void);

/* ringshm_rope_apply: rotate n x H vectors by RoPE at positions start .. start + n - 1.
 *
 *     x, out    [n, H, D]      out may be x itself (in place); otherwise they must not overlap
 *     cos, sin  [n_pos, D/2]   row p holds the angle terms of position p
 *
 * out[j, h] = rope(x[j, h], position start + j). D must be even.
 * Returns RINGSHM_KERNEL_ERR_RANGE if start + n > n_pos.
 */
int ringshm_rope_apply(float *out, const float *x, const float *cos, const float *sin,
                       int n, int n_heads, int head_dim, int start, int n_pos);

/* ringshm_kv_append: rotate the chunk's keys by RoPE and write keys and values into one cache row.
 *
 *     k_cache, v_cache  [Hkv, S_max, D]   one row of the layer's cache; written in place
 *     k, v              [n, Hkv, D]       the chunk's new keys (unrotated) and values
 *     cos, sin          [n_pos, D/2]      RoPE tables
 *
 * For 0 <= j < n, 0 <= h < Hkv:
 *     k_cache[h, start + j] = rope(k[j, h], start + j)
 *     v_cache[h, start + j] = v[j, h]
 * Positions outside [start, start + n) are not touched. Writing at start < the row's length overwrites
 * (speculative rollback). Returns RINGSHM_KERNEL_ERR_RANGE if start + n > S_max or > n_pos.
 */
int ringshm_kv_append(float *k_cache, float *v_cache, const float *k, const float *v,
                      const float *cos, const float *sin,
                      int n, int n_kv_heads, int max_seq_len, int head_dim, int start, int n_pos);

/* ringshm_attn_forward: causal GQA attention of a chunk of n queries against one cache row.
 *
 *     q, out            [n, Hq, D]        q already rotated; out is written, must not overlap q
 *     k_cache, v_cache  [Hkv, S_max, D]   positions [0, start + n) are read (the chunk's own keys included)
 *
 * Mask: causal, aligned bottom-right: query j (absolute position p = start + j) sees keys lo(p) .. p, where
 * lo(p) = 0, or with a sliding window of W > 0 keys, max(0, p - W + 1) (transformers' sliding-window mask:
 * the W latest keys, itself included).
 * GQA:  query head h reads kv head h / (Hq / Hkv).
 *
 *     out[j, h] = sum_t softmax_t(q[j, h] . k[h', t] * scale) v[h', t],  lo(p) <= t <= p,  h' = h / (Hq / Hkv)
 *
 * scale: the factor on q . k (1 / sqrt(D) for Llama; Gemma's query_pre_attn_scalar^-1/2).
 * Accumulation in fp32 with an online (flash-style, max-subtracted) softmax over blocks of keys that start at
 * absolute multiples of the block size; a row visits the blocks from the one holding lo(p), and keys before
 * lo(p) in it weigh exactly 0. Each output row depends only on its own query, its position and the cache: it
 * is bitwise the same whatever n, the other rows in the chunk or the batch (decode of position p == verify row
 * at p). Returns RINGSHM_KERNEL_ERR_SHAPE for a bad D, Hq % Hkv != 0, window < 0 or scale not finite > 0,
 * RINGSHM_KERNEL_ERR_RANGE if start + n > S_max.
 */
int ringshm_attn_forward(float *out, const float *q, const float *k_cache, const float *v_cache,
                         int n, int n_q_heads, int n_kv_heads, int max_seq_len, int head_dim, int start, int window,
                         float scale);

/* ringshm_attn_forward_segments: ringshm_attn_forward for a ragged batch of segments, each on its own cache row.
 *
 *     q, out            [T, Hq, D]            segment i's lens[i] queries follow segment i-1's (T = sum of lens)
 *     k_cache, v_cache  [R, Hkv, S_max, D]    the layer's whole cache
 *     rows, starts, lens [n_seg] int64        segment i reads cache row rows[i]; its queries sit at starts[i] ..
 *
 * out[segment i] = attn_forward(q[segment i], k_cache[rows[i]], v_cache[rows[i]], starts[i], window, scale). The
 * work items are (segment, kv head) pairs spread over up to n_threads OpenMP threads, each run in the caller's
 * FP mode; an item is computed exactly as attn_forward computes it, so the bits do not depend on n_threads or on
 * the other segments (batch invariance). Rows may repeat (reads only). Everything is checked before anything is
 * written: RINGSHM_KERNEL_ERR_SHAPE for a bad shape, window or scale, lens[i] < 1 or > S_max, or n_seg >
 * RINGSHM_ATTN_MAX_SEGMENTS; RINGSHM_KERNEL_ERR_RANGE for a row outside [0, R) or starts[i] < 0 or starts[i] +
 * lens[i] > S_max.
 */
int ringshm_attn_forward_segments(float *out, const float *q, const float *k_cache, const float *v_cache,
                                  const int64_t *rows, const int64_t *starts, const int64_t *lens, int n_seg,
                                  int n_cache_rows, int n_q_heads, int n_kv_heads, int max_seq_len, int head_dim,
                                  int window, float scale, int n_threads);
/* ringshm_rms_norm: RMSNorm of each row (Zhang & Sennrich 2019; Hugging Face LlamaRMSNorm's order of ops).
 *
 *     x, out  [m, k] fp32 (out may be x: each row is read before it is written)     w  [k]
 *
 *     out[r, j] = (x[r, j] * s) * w[j],   s = 1 / sqrtf(ss / k + eps)
 *     ss = sum of x[r, j]^2 in 16 lanes (lane l takes j = l, l + 16, ... in order; a short tail is zero-padded),
 *          then the fixed halving tree of hsum16.
 * Row r depends only on x[r, :] and w: the same bits whatever m (batch invariance).
 * Returns RINGSHM_KERNEL_ERR_SHAPE if m or k <= 0 or eps < 0 (or NaN). */
int ringshm_rms_norm(float *out, const float *x, const float *w, int64_t m, int64_t k, float eps);

/* ringshm_silu_mul: the SwiGLU gate, out[r, j] = silu(gu[r, j]) * gu[r, inter + j] for j < inter.
 *
 *     gu   [m, 2 * inter] fp32: each row is [gate | up] (the fused gate-up matmul's output)
 *     out  [m, inter] fp32, must not overlap gu
 *
 * silu(g) = g / (1 + e), e = exp(-g) (for g < 0, 1 / exp(g)), exp by the vector polynomial of the attention's
 * softmax for every element, tails zero-padded into a vector: each element depends only on its own two inputs.
 * Returns RINGSHM_KERNEL_ERR_SHAPE if m or inter <= 0. */
int ringshm_silu_mul(float *out, const float *gu, int64_t m, int64_t inter);

/* ringshm_gelu_tanh_mul: the GeGLU gate (Gemma), out[r, j] = gelu_tanh(gu[r, j]) * gu[r, inter + j], j < inter.
 *
 *     gu   [m, 2 * inter] fp32: each row is [gate | up];  out  [m, inter] fp32, must not overlap gu
 *
 * gelu_tanh(g) = 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))) (Hendrycks & Gimpel 2016; transformers'
 * gelu_pytorch_tanh), tanh through the vector exp of the softmax: within a few ulp of torch's, and each element
 * depends only on its own two inputs (batch invariance). Returns RINGSHM_KERNEL_ERR_SHAPE if m or inter <= 0. */
int ringshm_gelu_tanh_mul(float *out, const float *gu, int64_t m, int64_t inter);
/* CDEF END */

#endif /* RINGSHM_KERNELS_H */
