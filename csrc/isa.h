/* One copy of the SIMD code per instruction set, chosen at run time.
 *
 * kernels_impl.inc and matmul_impl.inc are compiled three times (csrc/simd_v4.c, simd_v3.c, simd_v1.c), each
 * time with its own target (#pragma GCC target) and its own name suffix (RS_ISA): _v4 = x86-64-v4 (AVX-512),
 * _v3 = x86-64-v3 (AVX2 + FMA + F16C), _v1 = the compiler's baseline (any CPU, arm64 included). The rest of the
 * extension is built for the baseline too, so the same build runs on every CPU of its architecture, and
 * ringshm_isa_best() (cpuid, once) picks the copy. On other architectures only _v1 exists, and so with
 * -DRINGSHM_PORTABLE_ONLY (the C-only sanitizer test, `make test-c`).
 */
#ifndef RINGSHM_ISA_H
#define RINGSHM_ISA_H

#include <stdint.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(RINGSHM_PORTABLE_ONLY)
#define RINGSHM_HAVE_X86_ISAS 1
#else
#define RINGSHM_HAVE_X86_ISAS 0
#endif

#define RS_CAT2(a, b) a##_##b
#define RS_CAT(a, b) RS_CAT2(a, b)
#define RS_ISA(name) RS_CAT(name, RINGSHM_ISA_SUFFIX)

/* ringshm_isa_best and ringshm_isa_supported are declared in matmul.h (the cffi API). */

struct ringshm_mm_args;  /* matmul_impl.inc */
struct ringshm_q8_block; /* matmul_internal.h */
struct ringshm_kv_pool; /* kernels.h */

#define RINGSHM_ISA_DECLS(S)                                                                                   \
    void ringshm_attn_chunk_##S(float *out, const float *q, const struct ringshm_kv_pool *pool,               \
                                const int32_t *table, int n, int hq, int d, int start, int window, float scale, \
                                const float *sinks, int h0, int h1);                                          \
    void ringshm_rms_norm_rows_##S(float *out, const float *x, const float *w, int64_t m, int64_t k,          \
                                   float eps);                                                                \
    void ringshm_silu_mul_rows_##S(float *out, const float *gu, int64_t m, int64_t inter);                   \
    void ringshm_gelu_tanh_mul_rows_##S(float *out, const float *gu, int64_t m, int64_t inter);              \
    void ringshm_swiglu_oai_mul_rows_##S(float *out, const float *gu, int64_t m, int64_t inter, float alpha,  \
                                         float limit);                                                        \
    void ringshm_kv_widen_rows_##S(float *out, const void *src, int64_t n, int kv_type);                     \
    void ringshm_argmax_rows_impl_##S(int64_t *out, const float *logits, const uint32_t *words, int64_t m,     \
                                      int64_t vocab, int64_t width);                                          \
    void ringshm_mm_panels_##S(const struct ringshm_mm_args *a, int64_t p_begin, int64_t p_end);           \
    void ringshm_q8_panels_##S(const struct ringshm_mm_args *a, int64_t p_begin, int64_t p_end);           \
    void ringshm_q8_quantize_blocks_##S(const float *x, int64_t n_blocks, struct ringshm_q8_block *out);      \
    int ringshm_fma_chains_##S(int64_t iters, float *sink);                                                  \
    void ringshm_read_chains_##S(const float *p, int64_t n, float *sink);
RINGSHM_ISA_DECLS(v1)
RINGSHM_ISA_DECLS(v3)
RINGSHM_ISA_DECLS(v4)
/* The AVX-512 copy of the 8-bit-activation loops with VNNI (csrc/simd_v4n.c: matmul_q8.inc alone). */
void ringshm_q8_panels_v4n(const struct ringshm_mm_args *a, int64_t p_begin, int64_t p_end);

#endif /* RINGSHM_ISA_H */
