/* ringshm kernels: RoPE, KV-append and causal GQA attention over paged KV, RMSNorm and the MLP gates; fp32
 * activations, KV stored in fp32, fp16 or bf16.
 *
 * These are the hot path of a stage process: decode (n = 1) and speculative verify (n = 8) run one
 * attention call per layer per op. The caller (ringshm/model/kernels.py) checks shapes, dtypes, devices and
 * contiguity before every call; the C side re-checks only what a wrong value would turn into an
 * out-of-bounds access, and answers with a status. Nothing here prints, exits, allocates or keeps state.
 *
 * Tensor layout (row-major, contiguous, fp32; names as in the Python docstrings):
 *
 *     q, out       [n, Hq, D]             query j of the chunk sits at absolute position start + j
 *     k, v         [n, Hkv, D]            new keys/values of the chunk, k not yet rotated
 *     KV pool      [n_blocks, Hkv, B, D]  one layer's keys (and as many values), in the pool's KV type (fp32,
 *                                         or fp16 / bf16: rounded to nearest-even once, on append, and widened
 *                                         exactly to fp32 when read): block b holds B consecutive
 *                                         positions of whichever stream's table names it, head by head
 *     table        [ceil((start + n) / B)] int32: the blocks of one stream, in position order: position p
 *                                         lives in block table[p / B] at offset p % B
 *     cos, sin     [P, D/2]               RoPE tables, row p = position p (ringshm.model.kernels.rope_tables)
 *
 * RoPE is the rotate-half (NeoX / Hugging Face Llama) layout: dims i and i + D/2 form a pair,
 *     x'[i]       = x[i]       * cos[p, i] - x[i + D/2] * sin[p, i]
 *     x'[i + D/2] = x[i + D/2] * cos[p, i] + x[i]       * sin[p, i]        for 0 <= i < D/2.
 *
 * Limits: 0 < D <= ringshm_attn_max_head_dim() and D % 16 == 0 for attention (vector width); Hq % Hkv == 0;
 * B a multiple of RINGSHM_KV_KEY_TILE (32), at most RINGSHM_KV_MAX_BLOCK.
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
/* Largest KV block (positions). */
#define RINGSHM_KV_MAX_BLOCK 128
/* Keys per online-softmax step of the attention, whatever the block size: a block is a whole number of key
 * tiles, so a row's sums run in the same order (and give the same bits) at every block size. */
#define RINGSHM_KV_KEY_TILE 32

/* CDEF BEGIN */
/* Status codes of the kernels; distinct from the ring's (-1 .. -7) so one table can map both. */
enum ringshm_kernel_status {
    RINGSHM_KERNEL_OK = 0,
    RINGSHM_KERNEL_ERR_SHAPE = -16,  /* a dimension is <= 0, D odd or too large, Hq % Hkv != 0 */
    RINGSHM_KERNEL_ERR_RANGE = -17,  /* positions past the RoPE table, a block id outside the pool, a table too
                                        short for its positions, or KV read before it was written */
    RINGSHM_KERNEL_ERR_LENGTH = -18  /* a tensor holds another number of elements than the shape the kernel
                                        reads from it (a norm weight of fewer than k floats, say) */
};

/* Element types of a KV pool. */
enum ringshm_kv_type { RINGSHM_KV_F32 = 0, RINGSHM_KV_F16 = 1, RINGSHM_KV_BF16 = 2 };

/* One layer's paged KV: keys and values [n_blocks, Hkv, B, D] each, elements of type kv_type; n_elems: the
 * elements each of k and v holds, which every kernel taking the pool checks against n_blocks * Hkv * B * D. */
struct ringshm_kv_pool {
    void *k, *v;
    int n_blocks, block_size, n_kv_heads, head_dim, kv_type;
    int64_t n_elems;
};

/* Largest head_dim (D) the attention kernel accepts (RINGSHM_ATTN_MAX_HEAD_DIM). */
int ringshm_attn_max_head_dim(void);
/* Most segments of one ringshm_attn_forward_segments / ringshm_layer_forward call (RINGSHM_ATTN_MAX_SEGMENTS). */
int ringshm_attn_max_segments(void);
/* Largest KV block size in positions (RINGSHM_KV_MAX_BLOCK). */
int ringshm_kv_max_block(void);
/* The attention's key tile (RINGSHM_KV_KEY_TILE): block sizes are multiples of it. */
int ringshm_kv_key_tile(void);

/* ringshm_kv_widen: n KV elements of kv_type at src, as fp32 into out, through the given ISA's path
 * (enum ringshm_isa, matmul.h): exactly what that path's attention reads. Every path must give the exact value
 * of each element (fp16 and bf16 widen without rounding); the tests hold them to it over all 65536 patterns.
 * Returns RINGSHM_KERNEL_ERR_SHAPE for n < 0 or not a multiple of 16, an unknown type, or an ISA this CPU lacks. */
int ringshm_kv_widen(float *out, const void *src, int64_t n, int kv_type, int isa);

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

/* ringshm_kv_append: rotate a chunk's keys by RoPE and write keys and values into its stream's blocks.
 *
 *     pool         the layer's KV; written in place at the chunk's positions only
 *     table        [n_table] block ids of the stream, n_table >= ceil((start + n) / B)
 *     k, v         [n, Hkv, D] the chunk's new keys (unrotated) and values;  cos, sin [n_pos, D/2]
 *
 * For 0 <= j < n, 0 <= h < Hkv, p = start + j:  K[table[p / B], h, p % B] = rope(k[j, h], p),  V[...] = v[j, h]
 * (each rounded to the pool's KV type, to nearest even: fp16 overflows to inf and has subnormals, NaN stays NaN).
 * Writing at positions a stream wrote before overwrites them (speculative rollback). Returns
 * RINGSHM_KERNEL_ERR_RANGE if start + n > n_pos, the table is too short or names a block outside the pool. */
int ringshm_kv_append(const struct ringshm_kv_pool *pool, const int32_t *table, int n_table, const float *k,
                      const float *v, const float *cos, const float *sin, int n, int start, int n_pos);

/* ringshm_attn_forward: causal GQA attention of a chunk of n queries against its stream's paged KV.
 *
 *     q, out   [n, Hq, D]   q already rotated; out is written, must not overlap q
 *     pool     the layer's KV;  table [n_table], n_table >= ceil((start + n) / B): positions [0, start + n) are
 *              read (the chunk's own keys included)
 *
 * Mask: causal, aligned bottom-right: query j (absolute position p = start + j) sees keys lo(p) .. p, where
 * lo(p) = 0, or with a sliding window of W > 0 keys, max(0, p - W + 1) (transformers' sliding-window mask:
 * the W latest keys, itself included).
 * GQA:  query head h reads kv head h / (Hq / Hkv).
 *
 *     out[j, h] = sum_t softmax_t(q[j, h] . k[h', t] * scale) v[h', t],  lo(p) <= t <= p,  h' = h / (Hq / Hkv)
 *
 * scale: the factor on q . k (1 / sqrt(D) for Llama; Gemma's query_pre_attn_scalar^-1/2).
 * sinks: [Hq] fp32 or NULL. With sinks (gpt-oss's attention sinks), query head h's softmax has one more logit,
 *     sinks[h] (not scaled), that weighs no value: out = sum_t exp(s_t - M) v_t / (exp(sinks[h] - M) + sum_t
 *     exp(s_t - M)), M the largest of them all (transformers' GptOss eager_attention_forward: the sink
 *     concatenated to the scores, softmax, the sink's column dropped). The online softmax starts from m =
 *     sinks[h], l = 1 instead of m = -inf, l = 0. The caller guarantees Hq floats behind it.
 * Keys and values are widened to fp32 as they are read; accumulation in fp32 with an online (flash-style,
 * max-subtracted) softmax over key tiles of RINGSHM_KV_KEY_TILE positions in position order, from the tile
 * holding lo(p); keys before lo(p) in it weigh exactly 0. Each output row depends only on its own query, its
 * position and the keys: it is bitwise the same whatever n, the other rows in the chunk, the batch, B, or where
 * the table's blocks sit in the pool (decode of position p == verify row at p). Returns
 * RINGSHM_KERNEL_ERR_SHAPE for a bad D, B or KV type, Hq % Hkv != 0, window < 0 or scale not finite > 0,
 * RINGSHM_KERNEL_ERR_RANGE for a table too short or naming a block outside the pool. */
int ringshm_attn_forward(float *out, const float *q, const struct ringshm_kv_pool *pool, const int32_t *table,
                         int n_table, int n, int n_q_heads, int start, int window, float scale, const float *sinks);

/* ringshm_attn_forward_segments: ringshm_attn_forward for a ragged batch of segments, each on its own table.
 *
 *     q, out       [T, Hq, D]            segment i's lens[i] queries follow segment i-1's (T = sum of lens)
 *     tables       int32, segment i's table at tables[table_offs[i] .. table_offs[i + 1])
 *     table_offs   [n_seg + 1] int64;  starts, lens [n_seg] int64
 *
 * out[segment i] = attn_forward(q[segment i], pool, its table, lens[i], starts[i], window, scale, sinks). The work
 * items are (segment, kv head) pairs spread over up to n_threads OpenMP threads, each run in the caller's FP mode; an
 * item is computed exactly as attn_forward computes it, so the bits do not depend on n_threads or on the other
 * segments (batch invariance). Tables may share blocks (reads only). Everything is checked before anything is
 * written: RINGSHM_KERNEL_ERR_SHAPE for a bad shape, window or scale, lens[i] < 1, or n_seg >
 * RINGSHM_ATTN_MAX_SEGMENTS; RINGSHM_KERNEL_ERR_RANGE for starts[i] < 0, a table too short or naming a block
 * outside the pool. */
int ringshm_attn_forward_segments(float *out, const float *q, const struct ringshm_kv_pool *pool,
                                  const int32_t *tables, const int64_t *table_offs, const int64_t *starts,
                                  const int64_t *lens, int n_seg, int n_q_heads, int window, float scale,
                                  const float *sinks, int n_threads);

/* ringshm_kv_check: may a step op's segments read and write the KV their tables name? Positions a block holds
 * are tracked in fill [n_blocks] (written by ringshm_kv_mark): segment i (start s, n tokens, its table T) needs
 * len(T) >= ceil((s + n) / B), every id of T in the pool, fill[T[j]] == B for j < s / B and
 * fill[T[s / B]] >= s % B (it reads every position before s and writes from s). Returns 0, or
 * RINGSHM_KERNEL_ERR_RANGE with *bad_segment = the first segment that fails (nothing is changed). */
int ringshm_kv_check(const int32_t *fill, int n_blocks, int block_size, const int32_t *tables,
                     const int64_t *table_offs, const int64_t *starts, const int64_t *lens, int n_seg,
                     int *bad_segment);

/* ringshm_kv_mark: record the positions a checked op wrote: for each segment, the blocks holding [s, s + n)
 * get fill = min(B, s + n - j B) (a block written from the middle keeps what came before; a write below a
 * block's fill cuts it back, as a rolled-back draft does). */
void ringshm_kv_mark(int32_t *fill, int block_size, const int32_t *tables, const int64_t *table_offs,
                     const int64_t *starts, const int64_t *lens, int n_seg);
/* ringshm_rms_norm: RMSNorm of each row (Zhang & Sennrich 2019; Hugging Face LlamaRMSNorm's order of ops).
 *
 *     x, out  [m, k] fp32 (out may be x: each row is read before it is written)
 *     w       [w_len] fp32, the weight (a checkpoint's tensor): w_len must be k
 *
 *     out[r, j] = (x[r, j] * s) * w[j],   s = 1 / sqrtf(ss / k + eps)
 *     ss = sum of x[r, j]^2 in 16 lanes (lane l takes j = l, l + 16, ... in order; a short tail is zero-padded),
 *          then the fixed halving tree of hsum16.
 * Row r depends only on x[r, :] and w: the same bits whatever m (batch invariance).
 * Returns RINGSHM_KERNEL_ERR_SHAPE if m or k <= 0 or eps < 0 (or NaN), RINGSHM_KERNEL_ERR_LENGTH if w_len != k
 * (nothing written). */
int ringshm_rms_norm(float *out, const float *x, const float *w, int64_t w_len, int64_t m, int64_t k, float eps);

/* ringshm_argmax_rows: each row's greedy choice, optionally restricted to the tokens a bitmask allows (the last
 * stage's head: a structured-output row's mask rides in its step op).
 *
 *     logits  [m, vocab] fp32
 *     words   [m, width] int32, or NULL (every token allowed): token t of row r is allowed iff bit t % 32 of
 *             words[r, t / 32] is set; width >= ceil(vocab / 32), bits at t >= vocab are ignored
 *     out     [m] int64
 *
 * out[r] = the smallest allowed t whose logit is the largest allowed one (torch.argmax's rule, NaN counted as the
 * largest: the first allowed NaN wins); with a mask, masked_fill(~allowed, -inf).argmax() whenever some allowed
 * logit is above -inf (all allowed at -inf: the first allowed token, where masked_fill would give token 0); a row
 * that allows no token gets -1. Two passes per row in token order: the largest allowed value (a compare-select
 * per element, any NaN noted), then the first allowed token equal to it. Row r reads only row r (batch
 * invariance); comparisons only, so the answer is exact whatever the ISA.
 * isa: a RINGSHM_ISA_* path (the tests run each; every path gives the same answer), or -1 for the CPU's best.
 * Returns RINGSHM_KERNEL_ERR_SHAPE if m or vocab <= 0, words is given with width < ceil(vocab / 32), or the isa is
 * not supported here. */
int ringshm_argmax_rows(int64_t *out, const float *logits, const int32_t *words, int64_t m, int64_t vocab,
                        int64_t width, int isa);

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

/* ringshm_swiglu_oai_mul: gpt-oss's clamped SwiGLU, out[r, j] = (u + 1) * (g * sigmoid(alpha * g)) with
 * g = min(gu[r, j], limit), u = clamp(gu[r, inter + j], -limit, limit), j < inter (transformers'
 * GptOssExperts._apply_gate after its gate / up columns are de-interleaved; llama.cpp's swiglu_oai; gpt-oss:
 * alpha 1.702, limit 7).
 *
 *     gu   [m, 2 * inter] fp32: each row is [gate | up];  out  [m, inter] fp32, must not overlap gu
 *
 * sigmoid(z) = 1 / (1 + e), e = exp(-z) by the softmax's vector exp (as silu), each element on its own two inputs.
 * Returns RINGSHM_KERNEL_ERR_SHAPE if m or inter <= 0, or alpha or limit is not finite > 0. */
int ringshm_swiglu_oai_mul(float *out, const float *gu, int64_t m, int64_t inter, float alpha, float limit);

/* ringshm_pin_threads: where the calling thread and the OpenMP pool's workers may run, for the regions from now on.
 *
 *     cpus  [n] CPU numbers (0 <= cpus[i] < 1024, no repeats), n >= 1: the threads of a region of n threads
 *
 * pin 1: one thread a CPU: the caller keeps the CPU it runs on when it is one of cpus (else it takes cpus[0]) and
 * the pool's first n - 1 workers take the others in order. pin 0: the caller and those workers may each run on
 * any of cpus. Runs one OpenMP region of n threads. Returns 0, EINVAL for bad arguments (nothing changed), EAGAIN
 * when the region got fewer than n threads (pin 1: nothing changed; pin 0: those it got freed), or the errno of the
 * first sched_setaffinity(2) that failed (the other threads as asked). Workers libgomp starts later inherit the
 * caller's mask: it ends the spare ones when a region asks for fewer threads than its pool holds (but more than
 * one), so ringshm pins only stages of 2 CPUs.
 *
 * Why: a stage that sleeps on its ring between ops has its pool workers asleep too. On these 2-vCPU VMs the
 * scheduler often wakes a worker onto the caller's CPU, and the caller, spinning at the region's end for the
 * worker, keeps it off that CPU until its spin gives up: measured with GOMP_SPINCOUNT 5000, after the caller slept
 * 1-3 ms, every one of the next six 2-thread regions took 170-290 us where it takes 0.6 us; pinned, the first
 * took 36-52 us (one wake of the idle CPU) and the rest 0.6-1.7 us (ringshm/runtime/stage_threads.py). */
int ringshm_pin_threads(const int *cpus, int n, int pin);
/* CDEF END */

#endif /* RINGSHM_KERNELS_H */
