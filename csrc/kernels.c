/* ringshm kernels: argument checks and the run-time choice of ISA (see kernels.h); the attention loops are in
 * kernels_impl.inc, RMSNorm, the MLP gates and argmax in kernels_rows.inc, compiled once per ISA by csrc/simd_*.c. */
#define _GNU_SOURCE /* sched_getcpu, sched_setaffinity and the CPU_* macros */
#include "kernels.h"

#include <errno.h>
#include <sched.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "fpenv.h"
#include "isa.h"
#include "matmul.h"

#ifdef _OPENMP
#include <omp.h>
#endif

#define VW RINGSHM_ATTN_HEAD_DIM_MULTIPLE

typedef void (*attn_fn)(float *, const float *, const struct ringshm_kv_pool *, const int32_t *, int, int, int, int,
                        int, float, const float *, int, int);
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

static int pool_ok(const struct ringshm_kv_pool *p) {
    return p && p->k && p->v && p->n_blocks > 0 && p->n_kv_heads > 0 && p->block_size > 0 &&
           p->block_size % RINGSHM_KV_KEY_TILE == 0 && p->block_size <= RINGSHM_KV_MAX_BLOCK && p->head_dim > 0 &&
           p->head_dim <= RINGSHM_ATTN_MAX_HEAD_DIM && p->head_dim % VW == 0 && p->kv_type >= RINGSHM_KV_F32 &&
           p->kv_type <= RINGSHM_KV_BF16 &&
           p->n_elems == (int64_t)p->n_blocks * p->n_kv_heads * p->block_size * p->head_dim;
}

static int attn_params_ok(const struct ringshm_kv_pool *p, int n_q_heads, int window, float scale) {
    return pool_ok(p) && n_q_heads > 0 && n_q_heads % p->n_kv_heads == 0 && window >= 0 && scale > 0.0f &&
           scale < 1e30f;
}

/* A table of n_table ids covers positions [0, end) and names blocks of the pool only. */
static int table_ok(const int32_t *table, int64_t n_table, int64_t end, const struct ringshm_kv_pool *p) {
    if (end <= 0 || n_table < (end + p->block_size - 1) / p->block_size) return 0;
    for (int64_t j = 0; j < (end + p->block_size - 1) / p->block_size; j++)
        if (table[j] < 0 || table[j] >= p->n_blocks) return 0;
    return 1;
}

int ringshm_attn_max_head_dim(void) { return RINGSHM_ATTN_MAX_HEAD_DIM; }
int ringshm_attn_max_segments(void) { return RINGSHM_ATTN_MAX_SEGMENTS; }
int ringshm_kv_max_block(void) { return RINGSHM_KV_MAX_BLOCK; }
int ringshm_kv_key_tile(void) { return RINGSHM_KV_KEY_TILE; }

static inline uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* fp32 -> bf16, round to nearest even; every NaN becomes the quiet NaN 0x7fc0 (as torch converts). */
static inline uint16_t to_bf16(float f) {
    uint32_t u = f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* fp32 -> fp16 (IEEE binary16), round to nearest even: overflow to inf, subnormals by letting the FPU round
 * an addition at the subnormals' spacing (F. Giesen's float_to_half_fast3_rtne). */
static inline uint16_t to_f16(float f) {
    uint32_t u = f32_bits(f);
    const uint32_t sign = (u >> 16) & 0x8000u;
    u &= 0x7fffffffu;
    if (u >= 0x7f800000u) return (uint16_t)(sign | (u > 0x7f800000u ? 0x7e00u : 0x7c00u)); /* inf, NaN */
    if (u >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* rounds past 65504: inf */
    if (u < 0x38800000u) /* below 2^-14: the sum's low bits are the subnormal, rounded to nearest even */
        return (uint16_t)(sign | (f32_bits(bits_f32(u) + 0.5f) - 0x3f000000u));
    const uint32_t odd = (u >> 13) & 1u;
    u += 0xc8000fffu + odd; /* rebias the exponent (15 - 127) and round the 13 dropped bits to nearest even */
    return (uint16_t)(sign | (u >> 13));
}

int ringshm_kv_widen(float *out, const void *src, int64_t n, int kv_type, int isa) {
    if (n < 0 || n % VW || kv_type < RINGSHM_KV_F32 || kv_type > RINGSHM_KV_BF16 || !ringshm_isa_supported(isa))
        return RINGSHM_KERNEL_ERR_SHAPE;
#if RINGSHM_HAVE_X86_ISAS
    if (isa == RINGSHM_ISA_AVX512) return ringshm_kv_widen_rows_v4(out, src, n, kv_type), RINGSHM_KERNEL_OK;
    if (isa == RINGSHM_ISA_AVX2) return ringshm_kv_widen_rows_v3(out, src, n, kv_type), RINGSHM_KERNEL_OK;
#endif
    ringshm_kv_widen_rows_v1(out, src, n, kv_type);
    return RINGSHM_KERNEL_OK;
}

/* Store n floats at dst (element index at) in the pool's type. */
static inline void kv_store(void *dst, size_t at, const float *x, int n, int kv_type) {
    if (kv_type == RINGSHM_KV_F32) {
        memcpy((float *)dst + at, x, sizeof(float) * (size_t)n);
    } else if (kv_type == RINGSHM_KV_F16) {
        for (int i = 0; i < n; i++) ((uint16_t *)dst)[at + i] = to_f16(x[i]);
    } else {
        for (int i = 0; i < n; i++) ((uint16_t *)dst)[at + i] = to_bf16(x[i]);
    }
}

int ringshm_attn_forward(float *out, const float *q, const struct ringshm_kv_pool *pool, const int32_t *table,
                         int n_table, int n, int n_q_heads, int start, int window, float scale, const float *sinks) {
    if (n <= 0 || !attn_params_ok(pool, n_q_heads, window, scale)) return RINGSHM_KERNEL_ERR_SHAPE;
    if (start < 0 || !table_ok(table, n_table, (int64_t)start + n, pool)) return RINGSHM_KERNEL_ERR_RANGE;
    ISA_PICK(ringshm_attn_chunk)(out, q, pool, table, n, n_q_heads, pool->head_dim, start, window, scale, sinks, 0,
                                 pool->n_kv_heads);
    return RINGSHM_KERNEL_OK;
}

/* ringshm_attn_forward_segments' (segment, kv head) items: item it = segment it / hkv, kv head it % hkv. */
struct attn_job {
    attn_fn fn;
    float *out;
    const float *q;
    const struct ringshm_kv_pool *pool;
    const int32_t *tables;
    const int64_t *table_offs, *starts, *lens, *offsets; /* offsets: each segment's first token */
    int n_q_heads, d, hkv;
    size_t tok; /* floats of one query / output token */
    int window;
    float scale;
    const float *sinks;
};

static void attn_items(const void *ctx, int64_t lo, int64_t hi) {
    const struct attn_job *j = ctx;
    for (int64_t it = lo; it < hi; it++) {
        const int i = (int)(it / j->hkv), h = (int)(it % j->hkv);
        const int64_t o = j->offsets[i];
        j->fn(j->out + o * j->tok, j->q + o * j->tok, j->pool, j->tables + j->table_offs[i], (int)j->lens[i],
              j->n_q_heads, j->d, (int)j->starts[i], j->window, j->scale, j->sinks, h, h + 1);
    }
}

int ringshm_attn_forward_segments(float *out, const float *q, const struct ringshm_kv_pool *pool,
                                  const int32_t *tables, const int64_t *table_offs, const int64_t *starts,
                                  const int64_t *lens, int n_seg, int n_q_heads, int window, float scale,
                                  const float *sinks, int n_threads) {
    if (n_seg < 0 || n_seg > RINGSHM_ATTN_MAX_SEGMENTS || !attn_params_ok(pool, n_q_heads, window, scale))
        return RINGSHM_KERNEL_ERR_SHAPE;
    for (int i = 0; i < n_seg; i++) {
        if (lens[i] < 1) return RINGSHM_KERNEL_ERR_SHAPE;
        if (starts[i] < 0 || table_offs[i] < 0 || table_offs[i + 1] < table_offs[i] ||
            !table_ok(tables + table_offs[i], table_offs[i + 1] - table_offs[i], starts[i] + lens[i], pool))
            return RINGSHM_KERNEL_ERR_RANGE;
    }
    if (n_seg == 0) return RINGSHM_KERNEL_OK;
    const attn_fn fn = ISA_PICK(ringshm_attn_chunk);
    const int hkv = pool->n_kv_heads, d = pool->head_dim;
    const size_t tok = (size_t)n_q_heads * d; /* one query / output token */
    const int64_t n_items = (int64_t)n_seg * hkv;
    int64_t offsets[RINGSHM_ATTN_MAX_SEGMENTS]; /* token offset of each segment */
    for (int i = 0; i < n_seg; i++) offsets[i] = i ? offsets[i - 1] + lens[i - 1] : 0;
    int nt = n_threads < 1 ? 1 : n_threads;
    if (nt > n_items) nt = (int)n_items;
    const struct attn_job job = {fn,         out,       q,     pool,  tables, table_offs, starts, lens,
                                 offsets,    n_q_heads, d,     hkv,   tok,    window,     scale,  sinks};
    ringshm_parallel_in_caller_mode(nt, n_items, 1, attn_items, &job); /* threads free up unevenly: dynamic */
    return RINGSHM_KERNEL_OK;
}

int ringshm_kv_check(const int32_t *fill, int n_blocks, int block_size, const int32_t *tables,
                     const int64_t *table_offs, const int64_t *starts, const int64_t *lens, int n_seg,
                     int *bad_segment) {
    for (int i = 0; i < n_seg; i++) {
        const int64_t s = starts[i], end = s + lens[i], n_table = table_offs[i + 1] - table_offs[i];
        const int32_t *t = tables + table_offs[i];
        int ok = s >= 0 && lens[i] >= 1 && block_size > 0 && n_table >= (end + block_size - 1) / block_size;
        for (int64_t j = 0; ok && j < (end + block_size - 1) / block_size; j++) ok = t[j] >= 0 && t[j] < n_blocks;
        for (int64_t j = 0; ok && j < s / block_size; j++) ok = fill[t[j]] == block_size;
        if (ok && s % block_size) ok = fill[t[s / block_size]] >= s % block_size;
        if (!ok) {
            if (bad_segment) *bad_segment = i;
            return RINGSHM_KERNEL_ERR_RANGE;
        }
    }
    return RINGSHM_KERNEL_OK;
}

void ringshm_kv_mark(int32_t *fill, int block_size, const int32_t *tables, const int64_t *table_offs,
                     const int64_t *starts, const int64_t *lens, int n_seg) {
    for (int i = 0; i < n_seg; i++) {
        const int64_t s = starts[i], end = s + lens[i];
        const int32_t *t = tables + table_offs[i];
        for (int64_t j = s / block_size; j * block_size < end; j++) {
            const int64_t f = end - j * block_size;
            fill[t[j]] = (int32_t)(f < block_size ? f : block_size);
        }
    }
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

int ringshm_kv_append(const struct ringshm_kv_pool *pool, const int32_t *table, int n_table, const float *k,
                      const float *v, const float *cos, const float *sin, int n, int start, int n_pos) {
    if (n <= 0 || !pool_ok(pool) || pool->head_dim % 2 != 0) return RINGSHM_KERNEL_ERR_SHAPE;
    if (start < 0 || start > n_pos - n || !table_ok(table, n_table, (int64_t)start + n, pool))
        return RINGSHM_KERNEL_ERR_RANGE;
    const int hkv = pool->n_kv_heads, d = pool->head_dim, bs = pool->block_size, half = d / 2;
    float rotated[RINGSHM_ATTN_MAX_HEAD_DIM];
    for (int j = 0; j < n; j++) {
        const int p = start + j;
        const size_t block = (size_t)table[p / bs] * hkv; /* block [Hkv, B, D] */
        for (int h = 0; h < hkv; h++) {
            const size_t src = ((size_t)j * hkv + h) * d;             /* k, v [n, Hkv, D] */
            const size_t dst = ((block + h) * bs + p % bs) * d;        /* pool [n_blocks, Hkv, B, D] */
            rope_one(rotated, k + src, cos + (size_t)p * half, sin + (size_t)p * half, half);
            kv_store(pool->k, dst, rotated, d, pool->kv_type);
            kv_store(pool->v, dst, v + src, d, pool->kv_type);
        }
    }
    return RINGSHM_KERNEL_OK;
}

int ringshm_rms_norm(float *out, const float *x, const float *w, int64_t w_len, int64_t m, int64_t k, float eps) {
    if (m <= 0 || k <= 0 || !(eps >= 0.0f)) return RINGSHM_KERNEL_ERR_SHAPE;
    if (!w || w_len != k) return RINGSHM_KERNEL_ERR_LENGTH;
    ISA_PICK(ringshm_rms_norm_rows)(out, x, w, m, k, eps);
    return RINGSHM_KERNEL_OK;
}

int ringshm_argmax_rows(int64_t *out, const float *logits, const int32_t *words, int64_t m, int64_t vocab,
                        int64_t width, int isa) {
    if (m <= 0 || vocab <= 0 || (words && width < (vocab + 31) / 32)) return RINGSHM_KERNEL_ERR_SHAPE;
    if (isa >= 0 && !ringshm_isa_supported(isa)) return RINGSHM_KERNEL_ERR_SHAPE;
    void (*fn)(int64_t *, const float *, const uint32_t *, int64_t, int64_t, int64_t) =
        isa < 0 ? ISA_PICK(ringshm_argmax_rows_impl) : ringshm_argmax_rows_impl_v1;
#if RINGSHM_HAVE_X86_ISAS
    if (isa == RINGSHM_ISA_AVX512) fn = ringshm_argmax_rows_impl_v4;
    if (isa == RINGSHM_ISA_AVX2) fn = ringshm_argmax_rows_impl_v3;
#endif
    fn(out, logits, (const uint32_t *)words, m, vocab, width);
    return RINGSHM_KERNEL_OK;
}

int ringshm_swiglu_oai_mul(float *out, const float *gu, int64_t m, int64_t inter, float alpha, float limit) {
    if (m <= 0 || inter <= 0 || !(alpha > 0.0f) || !(alpha < 1e30f) || !(limit > 0.0f) || !(limit < 1e30f))
        return RINGSHM_KERNEL_ERR_SHAPE;
    ISA_PICK(ringshm_swiglu_oai_mul_rows)(out, gu, m, inter, alpha, limit);
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

int ringshm_pin_threads(const int *cpus, int n, int pin) {
    if (!cpus || n < 1 || n > 1024 || (pin != 0 && pin != 1)) return EINVAL;
    for (int i = 0; i < n; i++) {
        if (cpus[i] < 0 || cpus[i] >= 1024 || cpus[i] >= CPU_SETSIZE) return EINVAL;
        for (int j = 0; j < i; j++)
            if (cpus[j] == cpus[i]) return EINVAL;
    }
    int mine = 0; /* the index of the caller's CPU */
    const int now = sched_getcpu();
    for (int i = 0; i < n; i++)
        if (cpus[i] == now) mine = i;
    int first = 0, got = n;
#ifdef _OPENMP
#pragma omp parallel num_threads(n)
#endif
    {
#ifdef _OPENMP
        const int t = omp_get_thread_num();
        if (t == 0) got = omp_get_num_threads();
#pragma omp barrier
#else
        const int t = 0;
#endif
        if (!pin || got == n) { /* a short team (OMP_THREAD_LIMIT, nested, ...) pins nobody */
            cpu_set_t set;
            CPU_ZERO(&set);
            if (pin) /* thread t >= 1 takes the t-th of the CPUs other than the caller's */
                CPU_SET(cpus[t == 0 ? mine : t - 1 < mine ? t - 1 : t], &set);
            else
                for (int i = 0; i < n; i++) CPU_SET(cpus[i], &set);
            if (sched_setaffinity(0, sizeof set, &set)) {
                const int e = errno;
#ifdef _OPENMP
#pragma omp critical(ringshm_pin_status)
#endif
                if (!first) first = e;
            }
        }
    }
    return got != n ? EAGAIN : first;
}
