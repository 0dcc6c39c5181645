/* ringshm kernels: RoPE, KV-append and causal GQA attention over one cache row (see kernels.h).
 *
 * Attention is a flash-style loop written for a single CPU core:
 *
 *   for each kv head h:
 *     the n * G query rows that read h (G = Hq / Hkv), in order (j, g), are cut into tiles of <= TILE_ROWS
 *     for each tile, for each block of BLOCK_KEYS keys:
 *       scores  for each 16-key group (read from L2 once, then L1), for each row that sees it:
 *                 s = q . k / sqrt(D): 16 dot products, one tree reduction (reduce16)
 *       softmax for each row: m_new = max(m, max s); p = exp(s - m_new)    vector exp (Cephes polynomial)
 *                 l = l * exp(m - m_new) + sum p
 *       values  for groups of rows sharing each V load (accumulators in registers):
 *                 acc = acc * exp(m - m_new) + sum p v
 *     out = acc / l
 *
 * Blocks start at absolute key multiples of BLOCK_KEYS, a row only visits keys it sees, and its sums run in
 * an order fixed by its own key count: a row's bits depend only on its query, its position and the cache,
 * never on n, on the other rows of the chunk or on the batch (decode of position p == verify row at p).
 *
 * Vectors are GCC/Clang vector extensions of 16 floats: one zmm on AVX-512, two ymm on AVX2, four q-registers
 * on NEON; -O3 -march=native picks the instructions. No intrinsics, no allocation: per-call state is on the
 * stack (accumulators TILE_ROWS * RINGSHM_ATTN_MAX_HEAD_DIM floats = 32 KiB, scores 16 KiB).
 *
 * Measured on this project's 2-core AVX-512 machine (bench/bench_kernels.py): decode and verify run near the
 * limit of this scheme (FMA and shuffle ports at mid contexts, L3 bandwidth at 4096 keys for decode).
 */
#include "kernels.h"

#include <math.h>
#include <stddef.h>
#include <string.h>

#define VW 16          /* floats per vector */
#define BLOCK_KEYS 128 /* keys per block: a V block of D = 64 is 32 KiB, within L1d (48 KiB here) */
#define TILE_ROWS 32   /* query rows per tile: verify (n = 8) of SmolLM2 (G = 3) is one tile per kv head */
#define MAX_VECS (RINGSHM_ATTN_MAX_HEAD_DIM / VW)

_Static_assert(RINGSHM_ATTN_MAX_HEAD_DIM % VW == 0, "max head_dim must be a whole number of vectors");
_Static_assert(RINGSHM_ATTN_HEAD_DIM_MULTIPLE == VW, "head_dim multiple is the vector width");
_Static_assert(BLOCK_KEYS % VW == 0, "a key block is a whole number of 16-key groups");

typedef float vf16 __attribute__((vector_size(VW * sizeof(float))));
typedef float vf16u __attribute__((vector_size(VW * sizeof(float)), aligned(4), may_alias));
typedef int32_t vi16 __attribute__((vector_size(VW * sizeof(int32_t))));

static inline vf16 load16(const float *p) { return *(const vf16u *)p; }
static inline void store16(float *p, vf16 x) { *(vf16u *)p = x; }
static inline vf16 splat16(float x) { return (vf16){0} + x; }

/* Lane-wise a < b ? b : a (NaN in b leaves a). */
static inline vf16 max16(vf16 a, vf16 b) {
    vi16 take_b = (vi16)(a < b);
    return (vf16)(((vi16)b & take_b) | ((vi16)a & ~take_b));
}

/* Horizontal sum by halving: lanes (l, l+8), then (l, l+4), (l, l+2), (l, l+1). reduce16 adds in the same
 * pairs, so a dot product has the same bits whichever of the two finishes it. */
static inline float hsum16(vf16 a) {
    float h[8];
    for (int l = 0; l < 8; l++) h[l] = a[l] + a[l + 8];
    for (int l = 0; l < 4; l++) h[l] = h[l] + h[l + 4];
    for (int l = 0; l < 2; l++) h[l] = h[l] + h[l + 2];
    return h[0] + h[1];
}

static inline float hmax16(vf16 a) {
    float m = a[0];
    for (int l = 1; l < VW; l++) m = a[l] > m ? a[l] : m;
    return m;
}

/* Key order that makes reduce16's tree come out in lane order: slot s holds key BITREV4[s] (an involution). */
static const int BITREV4[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};

/* Sixteen horizontal sums at once: lane i of the result is hsum16(a[BITREV4[i]]) (15 adds, 15 shuffles, 15
 * blends). Each level pairs vectors u, v: lanes with bit w clear keep u's pair sums (l, l + w), lanes with bit w
 * set keep v's; the blend and the one shuffle feed both halves of the same add. */
static inline vf16 reduce16(const vf16 a[16]) {
    vf16 b[8], c[4], d[2];
    for (int k = 0; k < 8; k++)
        b[k] = __builtin_shufflevector(a[2 * k], a[2 * k + 1], 0, 1, 2, 3, 4, 5, 6, 7, 24, 25, 26, 27, 28, 29, 30, 31) +
               __builtin_shufflevector(a[2 * k], a[2 * k + 1], 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23);
    for (int k = 0; k < 4; k++)
        c[k] = __builtin_shufflevector(b[2 * k], b[2 * k + 1], 0, 1, 2, 3, 20, 21, 22, 23, 8, 9, 10, 11, 28, 29, 30, 31) +
               __builtin_shufflevector(b[2 * k], b[2 * k + 1], 4, 5, 6, 7, 16, 17, 18, 19, 12, 13, 14, 15, 24, 25, 26, 27);
    for (int k = 0; k < 2; k++)
        d[k] = __builtin_shufflevector(c[2 * k], c[2 * k + 1], 0, 1, 18, 19, 4, 5, 22, 23, 8, 9, 26, 27, 12, 13, 30, 31) +
               __builtin_shufflevector(c[2 * k], c[2 * k + 1], 2, 3, 16, 17, 6, 7, 20, 21, 10, 11, 24, 25, 14, 15, 28, 29);
    return __builtin_shufflevector(d[0], d[1], 0, 17, 2, 19, 4, 21, 6, 23, 8, 25, 10, 27, 12, 29, 14, 31) +
           __builtin_shufflevector(d[0], d[1], 1, 16, 3, 18, 5, 20, 7, 22, 9, 24, 11, 26, 13, 28, 15, 30);
}

/* exp(x) for x <= 0 (softmax arguments), relative error ~1e-7; x below ln(FLT_MIN) (and -inf) gives 0.
 * Cephes expf: x = n ln2 + r, |r| <= ln2 / 2, exp(r) by a degree-7 polynomial, 2^n from the exponent bits. */
static inline vf16 exp16(vf16 x) {
    const float lo = -87.33654475f; /* ln(FLT_MIN): 2^n stays a normal float */
    vi16 under = (vi16)(x < splat16(lo));
    x = max16(x, splat16(lo));
    const float magic = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer held in the low bits */
    vf16 t = x * 1.44269504088896341f + magic;
    vf16 fn = t - magic;
    vi16 n = (vi16)t - 0x4B400000;
    vf16 r = x - fn * 0.693359375f;
    r = r - fn * -2.12194440e-4f;
    vf16 p = splat16(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    vf16 y = p * r * r + r + 1.0f;
    vf16 two_n = (vf16)((n + 127) << 23);
    return (vf16)((vi16)(y * two_n) & ~under);
}

#define INLINE static inline __attribute__((always_inline))

/* Scores of one row against keys [j, j + 16) of the cache: lane i = q . K[j + i] * scale. */
INLINE vf16 scores16(const float *q, const float *K, const int d, float scale) {
    const int nv = d / VW;
    vf16 qv[MAX_VECS];
    for (int c = 0; c < nv; c++) qv[c] = load16(q + c * VW);
    vf16 a[16];
#pragma GCC unroll 16
    for (int key = 0; key < 16; key++) { /* keys in memory order, each into its slot */
        const float *kr = K + (size_t)key * d;
        vf16 t = qv[0] * load16(kr);
        for (int c = 1; c < nv; c++) t += qv[c] * load16(kr + c * VW);
        a[BITREV4[key]] = t;
    }
    return reduce16(a) * scale;
}

/* One score the same way, for the last keys of a row (bits equal to the matching lane of scores16). */
INLINE float score1(const float *q, const float *kr, const int d, float scale) {
    const int nv = d / VW;
    vf16 t = load16(q) * load16(kr);
    for (int c = 1; c < nv; c++) t += load16(q + c * VW) * load16(kr + c * VW);
    return hsum16(t) * scale;
}

/* Online-softmax step of one row over the scores s[0, valid) of a block (s is padded with -inf to a multiple
 * of 16): s becomes p = exp(s - m_new); m, l are updated; returns exp(m_old - m_new), the factor for acc. */
INLINE float softmax_step(float *s, int valid, float *m, float *l) {
    const int padded = (valid + VW - 1) & ~(VW - 1);
    vf16 vmax = load16(s);
    for (int j = VW; j < padded; j += VW) vmax = max16(vmax, load16(s + j));
    const float m_old = *m, block_max = hmax16(vmax);
    const float m_new = block_max > m_old ? block_max : m_old;
    const float corr = m_old == -INFINITY ? 0.0f : expf(m_old - m_new);
    vf16 psum = splat16(0.0f);
    for (int j = 0; j < padded; j += VW) {
        vf16 p = exp16(load16(s + j) - m_new);
        store16(s + j, p);
        psum += p;
    }
    *l = *l * corr + hsum16(psum);
    *m = m_new;
    return corr;
}

/* acc[r] = acc[r] * corr[r] + sum_{j < valid[r]} p[r][j] V[j] for R rows at once (V loads shared), valid
 * non-decreasing. Each row is one chain over j in order, so its bits do not depend on R. */
INLINE void rows_pv(const float *V, const int d, const int R, const int *valid, float (*p)[BLOCK_KEYS],
                    const float *corr, float *acc) {
    const int nv = d / VW;
    vf16 a[8][MAX_VECS];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
        for (int c = 0; c < nv; c++) a[r][c] = load16(acc + (size_t)r * d + c * VW) * corr[r];
    const int common = valid[0];
    for (int j = 0; j < common; j++) {
        const float *vr = V + (size_t)j * d;
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            const float pj = p[r][j];
            for (int c = 0; c < nv; c++) a[r][c] += pj * load16(vr + c * VW);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) {
        for (int j = common; j < valid[r]; j++) {
            const float pj = p[r][j];
            for (int c = 0; c < nv; c++) a[r][c] += pj * load16(V + (size_t)j * d + c * VW);
        }
        for (int c = 0; c < nv; c++) store16(acc + (size_t)r * d + c * VW, a[r][c]);
    }
}

/* Attention of one chunk against one cache row; d is a compile-time constant in the specialised callers. */
INLINE void attn_row(float *out, const float *q, const float *k_cache, const float *v_cache, int n, int hq, int hkv,
                     int smax, const int d, int start) {
    const int g = hq / hkv;
    const int n_rows = n * g;
    const float scale = 1.0f / sqrtf((float)d);
    /* rows of V shared per PV pass: R * d / 16 accumulators stay within 16 vector registers */
    const int group = d <= 32 ? 8 : d <= 64 ? 4 : d <= 128 ? 2 : 1;
    float acc[TILE_ROWS * RINGSHM_ATTN_MAX_HEAD_DIM] __attribute__((aligned(64)));
    float s[TILE_ROWS][BLOCK_KEYS] __attribute__((aligned(64)));
    float m[TILE_ROWS], l[TILE_ROWS], corr[TILE_ROWS];
    int valid[TILE_ROWS];
    const float *qrow[TILE_ROWS];

    for (int h = 0; h < hkv; h++) {
        const float *K = k_cache + (size_t)h * smax * d; /* [S_max, D] */
        const float *V = v_cache + (size_t)h * smax * d;
        for (int r0 = 0; r0 < n_rows; r0 += TILE_ROWS) {
            const int rt = n_rows - r0 < TILE_ROWS ? n_rows - r0 : TILE_ROWS; /* 1 .. TILE_ROWS */
            for (int r = 0; r < rt; r++) {
                const int i = (r0 + r) / g, head = h * g + (r0 + r) % g; /* row r is query i, head `head` */
                qrow[r] = q + ((size_t)i * hq + head) * d;
                m[r] = -INFINITY, l[r] = 0.0f;
                for (int c = 0; c < d; c += VW) store16(acc + (size_t)r * d + c, splat16(0.0f));
            }
            const int n_keys = start + (r0 + rt - 1) / g + 1; /* the tile's last row sees the most keys */
            for (int j0 = 0; j0 < n_keys; j0 += BLOCK_KEYS) {
                const int jn = n_keys - j0 < BLOCK_KEYS ? n_keys - j0 : BLOCK_KEYS;
                const float *Kb = K + (size_t)j0 * d, *Vb = V + (size_t)j0 * d;
                /* rows are in query order, so valid is non-decreasing and rows that see nothing are a prefix */
                int r_first = rt;
                for (int r = rt - 1; r >= 0; r--) {
                    const int v = start + (r0 + r) / g + 1 - j0;
                    valid[r] = v <= 0 ? 0 : v < jn ? v : jn;
                    if (v > 0) r_first = r;
                }
                /* scores, 16 keys at a time across the rows so each K group is read from L1 after the first */
                for (int jg = 0; jg < jn; jg += VW)
                    for (int r = r_first; r < rt; r++) {
                        if (valid[r] >= jg + VW) {
                            store16(s[r] + jg, scores16(qrow[r], Kb + (size_t)jg * d, d, scale));
                        } else if (valid[r] > jg) {
                            int j = jg;
                            for (; j < valid[r]; j++) s[r][j] = score1(qrow[r], Kb + (size_t)j * d, d, scale);
                            for (; j < jg + VW; j++) s[r][j] = -INFINITY;
                        }
                    }
                for (int r = r_first; r < rt; r++) corr[r] = softmax_step(s[r], valid[r], &m[r], &l[r]);
                for (int r = r_first; r < rt; r += group) {
                    const int rows = rt - r < group ? rt - r : group;
#define PV(R) rows_pv(Vb, d, R, valid + r, s + r, corr + r, acc + (size_t)r * d)
                    switch (rows) { /* R a constant in each copy, so the R x D / 16 accumulators are registers */
                    case 8: PV(8); break;
                    case 7: PV(7); break;
                    case 6: PV(6); break;
                    case 5: PV(5); break;
                    case 4: PV(4); break;
                    case 3: PV(3); break;
                    case 2: PV(2); break;
                    default: PV(1); break;
                    }
#undef PV
                }
            }
            for (int r = 0; r < rt; r++) {
                const int i = (r0 + r) / g, head = h * g + (r0 + r) % g;
                float *o = out + ((size_t)i * hq + head) * d;
                for (int c = 0; c < d; c++) o[c] = acc[(size_t)r * d + c] / l[r];
            }
        }
    }
}

typedef void (*attn_fn)(float *, const float *, const float *, const float *, int, int, int, int, int, int);

#define ATTN_SPECIALISED(D)                                                                                      \
    static void attn_d##D(float *out, const float *q, const float *kc, const float *vc, int n, int hq, int hkv, \
                          int smax, int d, int start) {                                                         \
        (void)d;                                                                                                \
        attn_row(out, q, kc, vc, n, hq, hkv, smax, D, start);                                                   \
    }
ATTN_SPECIALISED(32)
ATTN_SPECIALISED(64)
ATTN_SPECIALISED(128)
ATTN_SPECIALISED(256)

static void attn_any(float *out, const float *q, const float *kc, const float *vc, int n, int hq, int hkv, int smax,
                     int d, int start) {
    attn_row(out, q, kc, vc, n, hq, hkv, smax, d, start);
}

static attn_fn attn_for(int d) {
    switch (d) {
    case 32: return attn_d32;
    case 64: return attn_d64;
    case 128: return attn_d128;
    case 256: return attn_d256;
    default: return attn_any;
    }
}

static int attn_shape_ok(int n, int hq, int hkv, int smax, int d) {
    return n > 0 && hq > 0 && hkv > 0 && smax > 0 && hq % hkv == 0 && d > 0 && d <= RINGSHM_ATTN_MAX_HEAD_DIM &&
           d % VW == 0;
}

int ringshm_attn_max_head_dim(void) { return RINGSHM_ATTN_MAX_HEAD_DIM; }

int ringshm_attn_forward(float *out, const float *q, const float *k_cache, const float *v_cache, int n,
                         int n_q_heads, int n_kv_heads, int max_seq_len, int head_dim, int start) {
    if (!attn_shape_ok(n, n_q_heads, n_kv_heads, max_seq_len, head_dim)) return RINGSHM_KERNEL_ERR_SHAPE;
    if (start < 0 || start > max_seq_len - n) return RINGSHM_KERNEL_ERR_RANGE;
    attn_for(head_dim)(out, q, k_cache, v_cache, n, n_q_heads, n_kv_heads, max_seq_len, head_dim, start);
    return RINGSHM_KERNEL_OK;
}

int ringshm_attn_forward_batched(float *out, const float *q, const float *k_cache, const float *v_cache,
                                 const int64_t *rows, const int64_t *starts, int n_batch, int n_cache_rows, int n,
                                 int n_q_heads, int n_kv_heads, int max_seq_len, int head_dim) {
    if (n_batch < 0 || n_cache_rows <= 0 || !attn_shape_ok(n, n_q_heads, n_kv_heads, max_seq_len, head_dim))
        return RINGSHM_KERNEL_ERR_SHAPE;
    for (int b = 0; b < n_batch; b++)
        if (rows[b] < 0 || rows[b] >= n_cache_rows || starts[b] < 0 || starts[b] > max_seq_len - n)
            return RINGSHM_KERNEL_ERR_RANGE;
    const attn_fn fn = attn_for(head_dim);
    const size_t chunk = (size_t)n * n_q_heads * head_dim;           /* one entry of q / out */
    const size_t row = (size_t)n_kv_heads * max_seq_len * head_dim; /* one cache row */
    for (int b = 0; b < n_batch; b++)
        fn(out + b * chunk, q + b * chunk, k_cache + rows[b] * row, v_cache + rows[b] * row, n, n_q_heads,
           n_kv_heads, max_seq_len, head_dim, (int)starts[b]);
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
