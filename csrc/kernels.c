/* ringshm kernels: argument checks and the run-time choice of ISA (see kernels.h); the attention loops,
 * RMSNorm and SwiGLU are in kernels_impl.inc, compiled once per ISA by csrc/simd_*.c. */
#include "kernels.h"

#include <stddef.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "fpenv.h"
#include "isa.h"
#include "matmul.h"

#define VW RINGSHM_ATTN_HEAD_DIM_MULTIPLE

typedef void (*attn_fn)(float *, const float *, const float *, const float *, int, int, int, int, int, int, int,
                        float, int, int);
typedef void (*rms_fn)(float *, const float *, const float *, int64_t, int64_t, float);
typedef void (*silu_fn)(float *, const float *, int64_t, int64_t);

/* The copies for this CPU's ISA (ringshm_isa_best, one answer per process). */
#define ISA_PICK(name)                                                                                         \
    (RINGSHM_HAVE_X86_ISAS && ringshm_isa_best() == 2   ? ISA_V4(name)                                        \
     : RINGSHM_HAVE_X86_ISAS && ringshm_isa_best() == 1 ? ISA_V3(name)                                        \
                                                        : name##_v1)
#if RINGSHM_HAVE_X86_ISAS
#define ISA_V4(name) name##_v4
#define ISA_V3(name) name##_v3
#else
#define ISA_V4(name) name##_v1
#define ISA_V3(name) name##_v1
#endif

static int attn_shape_ok(int n, int hq, int hkv, int smax, int d) {
    return n > 0 && hq > 0 && hkv > 0 && smax > 0 && hq % hkv == 0 && d > 0 && d <= RINGSHM_ATTN_MAX_HEAD_DIM &&
           d % VW == 0;
}

int ringshm_attn_max_head_dim(void) { return RINGSHM_ATTN_MAX_HEAD_DIM; }
int ringshm_attn_max_segments(void) { return RINGSHM_ATTN_MAX_SEGMENTS; }

static int attn_params_ok(int window, float scale) { return window >= 0 && scale > 0.0f && scale < 1e30f; }

int ringshm_attn_forward(float *out, const float *q, const float *k_cache, const float *v_cache, int n,
                         int n_q_heads, int n_kv_heads, int max_seq_len, int head_dim, int start, int window,
                         float scale) {
    if (!attn_shape_ok(n, n_q_heads, n_kv_heads, max_seq_len, head_dim) || !attn_params_ok(window, scale))
        return RINGSHM_KERNEL_ERR_SHAPE;
    if (start < 0 || start > max_seq_len - n) return RINGSHM_KERNEL_ERR_RANGE;
    ISA_PICK(ringshm_attn_chunk)(out, q, k_cache, v_cache, n, n_q_heads, n_kv_heads, max_seq_len, head_dim, start,
                                 window, scale, 0, n_kv_heads);
    return RINGSHM_KERNEL_OK;
}

int ringshm_attn_forward_segments(float *out, const float *q, const float *k_cache, const float *v_cache,
                                  const int64_t *rows, const int64_t *starts, const int64_t *lens, int n_seg,
                                  int n_cache_rows, int n_q_heads, int n_kv_heads, int max_seq_len, int head_dim,
                                  int window, float scale, int n_threads) {
    if (n_seg < 0 || n_seg > RINGSHM_ATTN_MAX_SEGMENTS || n_cache_rows <= 0 ||
        !attn_shape_ok(1, n_q_heads, n_kv_heads, max_seq_len, head_dim) || !attn_params_ok(window, scale))
        return RINGSHM_KERNEL_ERR_SHAPE;
    for (int i = 0; i < n_seg; i++) {
        if (lens[i] < 1 || lens[i] > max_seq_len) return RINGSHM_KERNEL_ERR_SHAPE;
        if (rows[i] < 0 || rows[i] >= n_cache_rows || starts[i] < 0 || starts[i] > max_seq_len - lens[i])
            return RINGSHM_KERNEL_ERR_RANGE;
    }
    if (n_seg == 0) return RINGSHM_KERNEL_OK;
    const attn_fn fn = ISA_PICK(ringshm_attn_chunk);
    const size_t tok = (size_t)n_q_heads * head_dim;                  /* one query / output token */
    const size_t row = (size_t)n_kv_heads * max_seq_len * head_dim; /* one cache row */
    const int64_t n_items = (int64_t)n_seg * n_kv_heads;
    int64_t offsets[RINGSHM_ATTN_MAX_SEGMENTS]; /* token offset of each segment */
    for (int i = 0; i < n_seg; i++) offsets[i] = i ? offsets[i - 1] + lens[i - 1] : 0;
    int nt = n_threads < 1 ? 1 : n_threads;
    if (nt > n_items) nt = (int)n_items;
#define ITEM(it)                                                                                                \
    do {                                                                                                       \
        const int i = (int)((it) / n_kv_heads), h = (int)((it) % n_kv_heads);                                   \
        const int64_t o = offsets[i];                                                                          \
        fn(out + o * tok, q + o * tok, k_cache + rows[i] * row, v_cache + rows[i] * row, (int)lens[i], n_q_heads, \
           n_kv_heads, max_seq_len, head_dim, (int)starts[i], window, scale, h, h + 1);                         \
    } while (0)
#ifdef _OPENMP
    if (nt > 1) {
        fpenv_t caller;
        FPENV_GET(caller);
#pragma omp parallel num_threads(nt)
        {
            FPENV_WORKER_BEGIN(caller);
#pragma omp for schedule(dynamic, 1)
            for (int64_t it = 0; it < n_items; it++) ITEM(it);
            FPENV_WORKER_END();
        }
        return RINGSHM_KERNEL_OK;
    }
#endif
    for (int64_t it = 0; it < n_items; it++) ITEM(it);
#undef ITEM
    return RINGSHM_KERNEL_OK;
}

/* out may be x itself: each pair is read before it is written. */
static inline void rope_one(float *out, const float *x, const float *cos, const float *sin, int half) {
    for (int i = 0; i < half; i++) {
        const float x0 = x[i], x1 = x[i + half];
        out[i] = x0 * cos[i] - x1 * sin[i];
        out[i + half] = x1 * cos[i] + x0 * sin[i];
    }
}

int ringshm_rope_apply(float *out, const float *x, const float *cos, const float *sin, int n, int n_heads,
                       int head_dim, int start, int n_pos) {
    if (n <= 0 || n_heads <= 0 || head_dim <= 0 || head_dim % 2 != 0) return RINGSHM_KERNEL_ERR_SHAPE;
    if (start < 0 || start > n_pos - n) return RINGSHM_KERNEL_ERR_RANGE;
    const int half = head_dim / 2;
    for (int j = 0; j < n; j++)
        for (int h = 0; h < n_heads; h++) {
            const size_t at = ((size_t)j * n_heads + h) * head_dim;
            rope_one(out + at, x + at, cos + (size_t)(start + j) * half, sin + (size_t)(start + j) * half, half);
        }
    return RINGSHM_KERNEL_OK;
}

int ringshm_kv_append(float *k_cache, float *v_cache, const float *k, const float *v, const float *cos,
                      const float *sin, int n, int n_kv_heads, int max_seq_len, int head_dim, int start, int n_pos) {
    if (n <= 0 || n_kv_heads <= 0 || max_seq_len <= 0 || head_dim <= 0 || head_dim % 2 != 0)
        return RINGSHM_KERNEL_ERR_SHAPE;
    if (start < 0 || start > max_seq_len - n || start > n_pos - n) return RINGSHM_KERNEL_ERR_RANGE;
    const int half = head_dim / 2;
    for (int j = 0; j < n; j++)
        for (int h = 0; h < n_kv_heads; h++) {
            const size_t src = ((size_t)j * n_kv_heads + h) * head_dim;           /* k, v [n, Hkv, D] */
            const size_t dst = ((size_t)h * max_seq_len + start + j) * head_dim; /* cache [Hkv, S_max, D] */
            rope_one(k_cache + dst, k + src, cos + (size_t)(start + j) * half, sin + (size_t)(start + j) * half,
                     half);
            memcpy(v_cache + dst, v + src, sizeof(float) * (size_t)head_dim);
        }
    return RINGSHM_KERNEL_OK;
}

int ringshm_rms_norm(float *out, const float *x, const float *w, int64_t m, int64_t k, float eps) {
    if (m <= 0 || k <= 0 || !(eps >= 0.0f)) return RINGSHM_KERNEL_ERR_SHAPE;
    ISA_PICK(ringshm_rms_norm_rows)(out, x, w, m, k, eps);
    return RINGSHM_KERNEL_OK;
}

int ringshm_silu_mul(float *out, const float *gu, int64_t m, int64_t inter) {
    if (m <= 0 || inter <= 0) return RINGSHM_KERNEL_ERR_SHAPE;
    ISA_PICK(ringshm_silu_mul_rows)(out, gu, m, inter);
    return RINGSHM_KERNEL_OK;
}

int ringshm_gelu_tanh_mul(float *out, const float *gu, int64_t m, int64_t inter) {
    if (m <= 0 || inter <= 0) return RINGSHM_KERNEL_ERR_SHAPE;
    ISA_PICK(ringshm_gelu_tanh_mul_rows)(out, gu, m, inter);
    return RINGSHM_KERNEL_OK;
}
