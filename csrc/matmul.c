/* ringshm matmul: sizes, argument checks, the thread split and the ISA choice (see matmul.h).
 * Packing is in matmul_pack.c; the panel loops are in matmul_impl.inc, compiled once per ISA. */
#include "matmul.h"

#include <stdint.h>
#include <string.h>
#include <unistd.h>
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif
#include "fpenv.h"
#include "isa.h"
#include "matmul_internal.h"

int ringshm_isa_supported(int isa) {
    switch (isa) {
    case RINGSHM_ISA_PORTABLE: return 1;
#if RINGSHM_HAVE_X86_ISAS
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ < 12)
    case RINGSHM_ISA_AVX2:
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c") &&
               __builtin_cpu_supports("bmi2");
    case RINGSHM_ISA_AVX512:
        return ringshm_isa_supported(RINGSHM_ISA_AVX2) && __builtin_cpu_supports("avx512f") &&
               __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
               __builtin_cpu_supports("avx512vl");
#else
    case RINGSHM_ISA_AVX2: return __builtin_cpu_supports("x86-64-v3");
    case RINGSHM_ISA_AVX512: return __builtin_cpu_supports("x86-64-v4");
#endif
    case RINGSHM_ISA_AVX512_VNNI:
        return ringshm_isa_supported(RINGSHM_ISA_AVX512) && __builtin_cpu_supports("avx512vnni") &&
               __builtin_cpu_supports("avx512vbmi");
#endif
    default: return 0;
    }
}

int ringshm_isa_best(void) {
    static int best = -1; /* a pure function of the CPU: computed once, the same answer from any thread */
    if (best < 0) {
        int b = RINGSHM_ISA_PORTABLE;
        if (ringshm_isa_supported(RINGSHM_ISA_AVX512)) b = RINGSHM_ISA_AVX512;
        else if (ringshm_isa_supported(RINGSHM_ISA_AVX2)) b = RINGSHM_ISA_AVX2;
        best = b;
    }
    return best;
}

static int shape_ok(const struct ringshm_wtype_info *t, int64_t n, int64_t k) {
    return n > 0 && k > 0 && n < INT32_MAX && k < INT32_MAX && (!t->quantized || k % t->block_k == 0) &&
           (!t->has_min || (k + 31) / 32 <= RINGSHM_MM_MAX_SUM_BLOCKS) &&
           (n + 15) / 16 <= INT64_MAX / 2048 / ((k + 31) / 32); /* bytes fit an int64 (F32 the most) */
}

static int overlap(const void *a, int64_t na, const void *b, int64_t nb) {
    return (uintptr_t)a < (uintptr_t)b + (uint64_t)nb && (uintptr_t)b < (uintptr_t)a + (uint64_t)na;
}

int64_t ringshm_qmat_src_bytes(int type, int64_t n, int64_t k) {
    const struct ringshm_wtype_info *t = ringshm_wtype_info(type);
    if (!t) return RINGSHM_MATMUL_ERR_TYPE;
    if (!shape_ok(t, n, k)) return RINGSHM_MATMUL_ERR_SHAPE;
    return t->quantized ? n * (k / t->block_k) * t->row_block_bytes : n * k * (t->row_block_bytes / 32);
}

int64_t ringshm_qmat_packed_bytes(int type, int64_t n, int64_t k) {
    const struct ringshm_wtype_info *t = ringshm_wtype_info(type);
    if (!t) return RINGSHM_MATMUL_ERR_TYPE;
    if (!shape_ok(t, n, k)) return RINGSHM_MATMUL_ERR_SHAPE;
    return (n + 15) / 16 * ((k + t->block_k - 1) / t->block_k) * t->panel_block_bytes;
}

int ringshm_mm_slab_blocks(void) {
    static int blocks = 0; /* a pure function of the CPU: computed once, the same answer from any thread */
    if (blocks == 0) {
        long l1d = -1;
#ifdef _SC_LEVEL1_DCACHE_SIZE
        l1d = sysconf(_SC_LEVEL1_DCACHE_SIZE);
#endif
        const long b = l1d > 0 ? l1d * 2 / 3 / 8192 : 2;
        blocks = b < 1 ? 1 : b > 4 ? 4 : (int)b;
    }
    return blocks;
}

/* The CPU's choice of the row prefetch (matmul.h), as the fewest rows of an op that asks (0: none) for fp32 ops of a
 * quantized weight, fp32 ops of a float weight (F32, F16, BF16) and 8-bit ops. Measured with the packed layout of
 * matmul.h (2048 -> 16384 or 8192 from a ring of 80-400 MiB, 2 threads, the two settings alternating in one process,
 * medians of 4-12 rounds, time on / off unless named):
 *   AMD EPYC Zen 5 (family 26 model 2), 2026-12-06: off / on, GB/s of weights at M = 1: Q4_0 34.3 / 38.7,
 *   Q4_1 31.4 / 45.9, Q4_K 38.6 / 45.8, MXFP4 38.9 / 47.3, F16 38.6 / 48.1, Q8_0 and BF16 even (Q8_0 1.16-1.19 x
 *   the time on, in a slower phase: its fp32 ops of 1-3 rows did not ask then); at M = 16 Q4_0 3.9 / 5.2,
 *   Q4_K 4.0 / 6.1, Q8_0 6.5 / 8.6, MXFP4 3.7 / 5.3; M = 64 and 256 even; one thread Q4_K 19.0 / 22.5,
 *   F16 15.2 / 20.5. 8-bit activations, M = 1: Q4_K 20.6 / 49.1, Q4_1 37.1 / 52.8, Q8_0 31.2 / 36.0, MXFP4 32.3 /
 *   37.9 (one thread Q4_K 11.1 / 28.9); M = 3 Q4_K 18.6 / 38.3; M = 16 Q4_K 7.7 / 11.8, MXFP4 7.0 / 10.8.
 *   Every op asks.
 *   AMD EPYC Zen 4 (family 25 model 17), 2026-12-07, 8192 x 2048 from 80 MiB, 12 rounds, the row asked for one unit
 *   beside each load (matmul_dequant.inc): fp32 Q4_0 / Q4_1 / Q4_K / MXFP4 / Q8_0 at M = 1-3 0.90-1.04, at M = 4
 *   0.86-0.96, 6 0.86-0.91, 8 0.84-0.91, 16 0.87-0.95, 32 0.93-0.98, 64 1.00; F16 / BF16 at M = 1-5 1.04-1.35, at 6
 *   0.84-0.88, 8-32 0.90-0.97, 64 0.99-1.00 (Q5_K / Q6_K, which always ask, 0.98-1.01). 8-bit: 1.02-1.78 at M = 1-4,
 *   0.92-1.02 at 8-32. So fp32 ops of 4 rows or more ask (float weights from 6); 8-bit ops and one-row fp32 ops do
 *   not (nor attention). The Zen 4 rule applies to family 25 with AVX-512 (Zen 3, family 25 too, has none: off).
 *   Intel CPUs and older AMD ones were not measured with this layout: off. */
#define RP_RULE(quant, floats, q8) ((quant) | (floats) << 8 | (q8) << 16)
static int row_prefetch_rule_of_cpu(void) {
#if RINGSHM_HAVE_X86_ISAS
    unsigned eax, ebx, ecx, edx;
    if (!__get_cpuid(0, &eax, &ebx, &ecx, &edx)) return 0;
    const int amd = ebx == 0x68747541u && edx == 0x69746e65u && ecx == 0x444d4163u; /* "AuthenticAMD" */
    if (!amd || !__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return 0;
    unsigned family = (eax >> 8) & 15;
    if (family == 15) family += (eax >> 20) & 255; /* the extended family */
    if (family >= 26) return RP_RULE(1, 1, 1);
    if (family == 25 && __builtin_cpu_supports("avx512f")) return RP_RULE(4, 6, 0);
    return 0;
#else
    return 0;
#endif
}

static int row_prefetch_mode = -1; /* ringshm_mm_set_row_prefetch's mode: -1 the CPU's choice */

int ringshm_mm_row_prefetch_for(int type, int64_t m, int q8) {
    static int cached = -1; /* a pure function of the CPU: computed once, the same answer from any thread */
    int rule = __atomic_load_n(&cached, __ATOMIC_RELAXED);
    if (rule < 0) __atomic_store_n(&cached, rule = row_prefetch_rule_of_cpu(), __ATOMIC_RELAXED);
    const int mode = __atomic_load_n(&row_prefetch_mode, __ATOMIC_RELAXED);
    if (mode >= 0) return mode;
    const int is_float = type == RINGSHM_W_F32 || type == RINGSHM_W_F16 || type == RINGSHM_W_BF16;
    const int from = (rule >> (q8 ? 16 : is_float ? 8 : 0)) & 255;
    return from > 0 && m >= from;
}

int ringshm_mm_row_prefetch(void) { return ringshm_mm_row_prefetch_for(RINGSHM_W_F32, 1, 0); }

int ringshm_mm_set_row_prefetch(int mode) {
    if (mode < -1 || mode > 1) return RINGSHM_MATMUL_ERR_SHAPE;
    __atomic_store_n(&row_prefetch_mode, mode, __ATOMIC_RELAXED);
    return ringshm_mm_row_prefetch();
}

typedef void (*mm_panels_fn)(const struct ringshm_mm_args *, int64_t, int64_t);

static mm_panels_fn panels_for(int isa) {
    switch (isa) {
#if RINGSHM_HAVE_X86_ISAS
    case RINGSHM_ISA_AVX512: return ringshm_mm_panels_v4;
    case RINGSHM_ISA_AVX2: return ringshm_mm_panels_v3;
#endif
    case RINGSHM_ISA_PORTABLE: return ringshm_mm_panels_v1;
    default: return NULL;
    }
}

static mm_panels_fn q8_panels_for(int isa) {
    switch (isa) {
#if RINGSHM_HAVE_X86_ISAS
    case RINGSHM_ISA_AVX512_VNNI: return ringshm_q8_panels_v4n;
    case RINGSHM_ISA_AVX512: return ringshm_q8_panels_v4;
    case RINGSHM_ISA_AVX2: return ringshm_q8_panels_v3;
#endif
    case RINGSHM_ISA_PORTABLE: return ringshm_q8_panels_v1;
    default: return NULL;
    }
}

int ringshm_q8_isa(int isa) {
    return isa == RINGSHM_ISA_AVX512 && ringshm_isa_supported(RINGSHM_ISA_AVX512_VNNI) ? RINGSHM_ISA_AVX512_VNNI : isa;
}

int ringshm_q8_supported(int type) {
    const struct ringshm_wtype_info *t = ringshm_wtype_info(type);
    return t && t->quantized;
}

int64_t ringshm_q8_act_bytes(int64_t m, int64_t k) {
    if (m <= 0 || k <= 0 || k % 32 || m >= INT32_MAX || k >= INT32_MAX) return RINGSHM_MATMUL_ERR_SHAPE;
    return m * (k / 32) * (int64_t)sizeof(struct ringshm_q8_block);
}

void ringshm_parallel_in_caller_mode(int nt, int64_t total, int dynamic, void (*fn)(const void *, int64_t, int64_t),
                                     const void *ctx) {
#ifdef _OPENMP
    if (nt > 1) {
        fpenv_t caller;
        FPENV_GET(caller);
#pragma omp parallel num_threads(nt)
        {
            FPENV_WORKER_BEGIN(caller);
            if (dynamic) {
#pragma omp for schedule(dynamic, 1)
                for (int64_t it = 0; it < total; it++) fn(ctx, it, it + 1);
            } else {
                const int64_t t = omp_get_thread_num(), T = omp_get_num_threads();
                fn(ctx, total * t / T, total * (t + 1) / T);
            }
            FPENV_WORKER_END();
        }
        return;
    }
#endif
    (void)nt, (void)dynamic;
    fn(ctx, 0, total);
}

typedef void (*q8_quantize_fn)(const float *, int64_t, struct ringshm_q8_block *);

static q8_quantize_fn q8_quantize_for(int isa) {
    switch (isa) {
#if RINGSHM_HAVE_X86_ISAS
    case RINGSHM_ISA_AVX512_VNNI:
    case RINGSHM_ISA_AVX512: return ringshm_q8_quantize_blocks_v4;
    case RINGSHM_ISA_AVX2: return ringshm_q8_quantize_blocks_v3;
#endif
    case RINGSHM_ISA_PORTABLE: return ringshm_q8_quantize_blocks_v1;
    default: return NULL;
    }
}

struct q8_job {
    q8_quantize_fn fn;
    const float *x;
    struct ringshm_q8_block *out;
};

static void q8_job_run(const void *ctx, int64_t lo, int64_t hi) {
    const struct q8_job *j = ctx;
    if (hi > lo) j->fn(j->x + lo * 32, hi - lo, j->out + lo);
}

int ringshm_q8_quantize(const float *x, int64_t m, int64_t k, uint8_t *xq, int64_t xq_bytes, int n_threads,
                        int isa) {
    const q8_quantize_fn fn = q8_quantize_for(isa);
    if (!fn || !ringshm_isa_supported(isa)) return RINGSHM_MATMUL_ERR_TYPE;
    const int64_t want = ringshm_q8_act_bytes(m, k);
    if (want < 0) return (int)want;
    if (xq_bytes != want) return RINGSHM_MATMUL_ERR_SIZE;
    if (overlap(xq, xq_bytes, x, m * k * 4)) return RINGSHM_MATMUL_ERR_ALIAS;
    const int64_t nb = k / 32;
    /* a decode's rows (a few blocks each) quantize in far less than a parallel region's start and join: threads only
     * from 2048 blocks (64 Ki floats) on */
    int nt = n_threads < 1 || m * nb < 2048 ? 1 : n_threads;
    if (nt > m) nt = (int)m;
    const struct q8_job job = {fn, x, (struct ringshm_q8_block *)xq};
    ringshm_parallel_in_caller_mode(nt, m * nb, 0, q8_job_run, &job);
    return RINGSHM_MATMUL_OK;
}

typedef int (*fma_chains_fn)(int64_t, float *);

int64_t ringshm_fma_probe(int isa, int n_threads, int64_t iters, float *sink) {
    fma_chains_fn f = NULL;
    switch (isa) {
#if RINGSHM_HAVE_X86_ISAS
    case RINGSHM_ISA_AVX512: f = ringshm_fma_chains_v4; break;
    case RINGSHM_ISA_AVX2: f = ringshm_fma_chains_v3; break;
#endif
    case RINGSHM_ISA_PORTABLE: f = ringshm_fma_chains_v1; break;
    default: break;
    }
    if (!f || !ringshm_isa_supported(isa)) return RINGSHM_MATMUL_ERR_TYPE;
    if (iters < 1 || n_threads < 1) return RINGSHM_MATMUL_ERR_SHAPE;
    int chains = 0;
#pragma omp parallel num_threads(n_threads) reduction(max : chains)
    {
        float local = 0.0f;
        chains = f(iters, &local);
#pragma omp critical
        sink[0] += local;
    }
    return (int64_t)n_threads * iters * chains * 16 * 2;
}

typedef void (*read_chains_fn)(const float *, int64_t, float *);

int64_t ringshm_read_probe(int isa, int n_threads, const float *buf, int64_t n, float *sink) {
    read_chains_fn f = NULL;
    switch (isa) {
#if RINGSHM_HAVE_X86_ISAS
    case RINGSHM_ISA_AVX512: f = ringshm_read_chains_v4; break;
    case RINGSHM_ISA_AVX2: f = ringshm_read_chains_v3; break;
#endif
    case RINGSHM_ISA_PORTABLE: f = ringshm_read_chains_v1; break;
    default: break;
    }
    if (!f || !ringshm_isa_supported(isa)) return RINGSHM_MATMUL_ERR_TYPE;
    if (n < 128 || n % 128 || n_threads < 1) return RINGSHM_MATMUL_ERR_SHAPE;
    const int64_t chunks = n / 128;
#pragma omp parallel num_threads(n_threads)
    {
        const int64_t t = omp_get_thread_num(), T = omp_get_num_threads();
        const int64_t c0 = chunks * t / T, c1 = chunks * (t + 1) / T;
        float local = 0.0f;
        if (c1 > c0) f(buf + c0 * 128, (c1 - c0) * 128, &local);
#pragma omp critical
        sink[0] += local;
    }
    return n * (int64_t)sizeof(float);
}

struct panels_job {
    mm_panels_fn fn;
    const struct ringshm_mm_args *a;
};

/* An op is split between threads by its work, panels x rows, at points between groups of the packed layout
 * (RINGSHM_PANEL_GROUP panels, matmul_internal.h; a thread whose panels start a group reads its weights as one
 * stream) and, from MM_SPLIT_QUANTUM rows on, between rows of a group in multiples of that quantum (the register
 * decode's tiles of 4 rows on AVX-512): a group can then be shared, its rows [0, r) on one thread, [r, m) on the
 * next, each reading the group's weights (one group more read an op: where a tile's weights serve 4 rows or more,
 * the fmas bound it, not the weights). Split by whole groups alone, where the groups do not divide evenly (36
 * panels, SmolLM2's 576 columns: 5 groups, the last of 4 panels; 40, Gemma 3 270M's 640), the thread with more
 * groups had 20 / 36 or 24 / 40 of the work and the other waited. Each output element is the same function of its
 * row of x and its weight row whatever rows run beside it (matmul.h), so the split changes no bit. Measured on an
 * AMD EPYC Zen 5 against whole groups alone (2 threads, StageModel in one process, the two alternating over 8
 * rounds, 2026-12-07): SmolLM2's 256-token prefill 0.976 x the time, Gemma 3 270M's 0.958; a 16-row decode step
 * 1.024 x the tok/s (SmolLM2), 1.004 (Gemma, whose head is most of it); 8 rows 1.004. Widths of whole groups a
 * thread (the 1B's 2048) split where they did before; ops of fewer rows than the quantum split between groups, the
 * threads' shares as even as whole groups allow (as before, though not always the same thread takes the larger). */
#define MM_SPLIT_QUANTUM 4

/* Work w (panel-rows, 0 <= w <= all of them, group-major: a group holds its panels x m) as a position g * m + r: the
 * group it falls in and its rows before w, rounded to the nearest multiple of the quantum, or of m where m is less
 * (then r is 0 or m: a group boundary); r = m is the next group's start. */
static int64_t split_pos(int64_t n_panels, int64_t m, int64_t w) {
    const int64_t G = RINGSHM_PANEL_GROUP, n_groups = (n_panels + G - 1) / G, g = w / (G * m);
    if (g >= n_groups || w >= n_panels * m) return n_groups * m;
    const int64_t rows = m < MM_SPLIT_QUANTUM ? m : MM_SPLIT_QUANTUM;
    const int64_t pg = g == n_groups - 1 ? n_panels - g * G : G, q = pg * rows;
    const int64_t r = (w - g * G * m + q / 2) / q * rows;
    return g * m + (r < m ? r : m);
}

/* The thread's share [lo, hi) of the panel-rows: its whole groups in one call, a group it shares by rows alone. */
static void panels_rows_run(const void *ctx, int64_t lo, int64_t hi) {
    const struct panels_job *j = ctx;
    const struct ringshm_mm_args *a = j->a;
    const int64_t m = a->m, n_panels = (a->n + 15) / 16, G = RINGSHM_PANEL_GROUP;
    const int64_t pos1 = split_pos(n_panels, m, hi);
    for (int64_t pos = split_pos(n_panels, m, lo); pos < pos1;) {
        const int64_t g = pos / m, r0 = pos % m, r1 = pos1 - g * m < m ? pos1 - g * m : m;
        if (r0 == 0 && r1 == m) { /* groups [g, g1) whole */
            const int64_t g1 = pos1 / m;
            j->fn(a, g * G, g1 * G < n_panels ? g1 * G : n_panels);
            pos = g1 * m;
            continue;
        }
        struct ringshm_mm_args b = *a; /* rows [r0, r1) of group g */
        b.m = r1 - r0, b.out = a->out + r0 * a->ldo;
        if (a->x) b.x = a->x + r0 * a->k;
        if (a->xq) b.xq = a->xq + r0 * a->nb;
        if (a->residual) b.residual = a->residual + r0 * a->ldr;
        j->fn(&b, g * G, (g + 1) * G < n_panels ? (g + 1) * G : n_panels);
        pos = g * m + r1;
    }
}

/* The checks and the thread split shared by ringshm_qmat_matmul and ringshm_qmat_matmul_q8: x (fp32) or xq. */
static int run_matmul(int type, const uint8_t *packed, int64_t packed_bytes, int64_t n, int64_t k, const float *x,
                      const uint8_t *xq, int64_t xq_bytes, int64_t m, float *out, int64_t ldo, const float *bias,
                      int64_t bias_len, const float *residual, int64_t ldr, int n_threads, mm_panels_fn fn,
                      int isa) {
    const struct ringshm_wtype_info *ti = ringshm_wtype_info(type);
    if (!ti || !ringshm_isa_supported(isa) || !fn || (xq && !ringshm_q8_supported(type)))
        return RINGSHM_MATMUL_ERR_TYPE;
    const int64_t n_panels = (n + 15) / 16;
    if (!shape_ok(ti, n, k) || m <= 0 || m >= INT32_MAX || ldo < n_panels * 16 || (residual && ldr < n))
        return RINGSHM_MATMUL_ERR_SHAPE;
    if (packed_bytes != ringshm_qmat_packed_bytes(type, n, k) || (bias ? bias_len != n : bias_len != 0) ||
        (xq && xq_bytes != ringshm_q8_act_bytes(m, k)))
        return RINGSHM_MATMUL_ERR_SIZE;
    const int64_t out_bytes = ((m - 1) * ldo + n_panels * 16) * 4; /* out holds the running sums */
    if ((x && overlap(out, out_bytes, x, m * k * 4)) || (xq && overlap(out, out_bytes, xq, xq_bytes)) ||
        (residual && overlap(out, out_bytes, residual, ((m - 1) * ldr + n) * 4)))
        return RINGSHM_MATMUL_ERR_ALIAS;
    const int64_t bk = ti->block_k;
    const struct ringshm_mm_args a = {
        .type = type, .packed = packed, .n = n, .k = k, .m = m, .nb = (k + 31) / 32, .block_k = bk,
        .block_bytes = ti->panel_block_bytes, .panel_bytes = (k + bk - 1) / bk * ti->panel_block_bytes, .x = x,
        .out = out, .ldo = ldo, .bias = bias, .residual = residual, .ldr = ldr,
        .slab_blocks = ringshm_mm_slab_blocks(), .xq = (const struct ringshm_q8_block *)xq,
        .row_prefetch = ringshm_mm_row_prefetch_for(type, m, xq != NULL)};
    const int64_t n_groups = (n_panels + RINGSHM_PANEL_GROUP - 1) / RINGSHM_PANEL_GROUP;
    const struct panels_job job = {fn, &a};
    /* every thread at least a quantum of a group's rows (a whole group below the quantum) */
    const int64_t quanta = n_groups * ((m + MM_SPLIT_QUANTUM - 1) / MM_SPLIT_QUANTUM);
    int nt = n_threads < 1 ? 1 : n_threads;
    if (nt > quanta) nt = (int)quanta;
    ringshm_parallel_in_caller_mode(nt, n_panels * m, 0, panels_rows_run, &job);
    return RINGSHM_MATMUL_OK;
}

int ringshm_qmat_matmul(int type, const uint8_t *packed, int64_t packed_bytes, int64_t n, int64_t k,
                        const float *x, int64_t m, float *out, int64_t ldo, const float *bias, int64_t bias_len,
                        const float *residual, int64_t ldr, int n_threads, int isa) {
    return run_matmul(type, packed, packed_bytes, n, k, x, NULL, 0, m, out, ldo, bias, bias_len, residual, ldr,
                      n_threads, panels_for(isa), isa);
}

int ringshm_qmat_matmul_q8(int type, const uint8_t *packed, int64_t packed_bytes, int64_t n, int64_t k,
                           const uint8_t *xq, int64_t xq_bytes, int64_t m, float *out, int64_t ldo, const float *bias,
                           int64_t bias_len, const float *residual, int64_t ldr, int n_threads, int isa) {
    if (!xq) return RINGSHM_MATMUL_ERR_SIZE;
    return run_matmul(type, packed, packed_bytes, n, k, NULL, xq, xq_bytes, m, out, ldo, bias, bias_len, residual,
                      ldr, n_threads, q8_panels_for(isa), isa);
}
