/* C-only checks of the kernels' length contract (issue 27), built with AddressSanitizer + UBSan (make test-c):
 * every vector a kernel reads from a checkpoint (a norm weight, a bias, the RoPE tables, the KV pool) comes with
 * its length, and a length that is not what the shape reads is refused with a status before anything is read.
 * Each short buffer here is malloc'd at exactly its length, so a kernel that read past it would stop the run
 * with a heap-buffer-overflow report instead of passing.
 *
 * The layer: hidden 16, one query head and one KV head of 16, intermediate 8, 4 positions, F32 weights (and as a
 * mixture of 2 experts with a shared expert: check_shared_expert). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "layer.h"
#include "matmul.h"

#define FAIL(...)                                                                                              \
    do {                                                                                                       \
        fprintf(stderr, "test_lengths: " __VA_ARGS__);                                                         \
        exit(1);                                                                                               \
    } while (0)

enum { HID = 16, D = 16, INTER = 8, NPOS = 4, BLOCK = 32 };

static float *floats(int64_t n, float value) {
    float *p = malloc(sizeof(float) * (size_t)n);
    for (int64_t i = 0; i < n; i++) p[i] = value;
    return p;
}

/* An F32 weight [n, k] packed for the matmul; *bytes its packed size. */
static uint8_t *packed_f32(int64_t n, int64_t k, int64_t *bytes) {
    float *src = floats(n * k, 0.01f);
    *bytes = ringshm_qmat_packed_bytes(RINGSHM_W_F32, n, k);
    uint8_t *dst = malloc((size_t)*bytes);
    if (ringshm_qmat_pack(RINGSHM_W_F32, (const uint8_t *)src, n * k * 4, n, k, dst, *bytes)) FAIL("pack\n");
    free(src);
    return dst;
}

static void check_rms_norm(void) {
    float *x = floats(2 * 64, 1.0f), *out = floats(2 * 64, 0.0f), *w_short = floats(32, 1.0f), *w = floats(64, 1.0f);
    if (ringshm_rms_norm(out, x, w_short, 32, 2, 64, 1e-5f) != RINGSHM_KERNEL_ERR_LENGTH)
        FAIL("rms_norm read a 32-float weight for rows of 64\n");
    if (ringshm_rms_norm(out, x, NULL, 0, 2, 64, 1e-5f) != RINGSHM_KERNEL_ERR_LENGTH) FAIL("rms_norm took no weight\n");
    if (ringshm_rms_norm(out, x, w, 64, 2, 64, 1e-5f) != RINGSHM_KERNEL_OK) FAIL("rms_norm refused a good weight\n");
    free(x), free(out), free(w_short), free(w);
}

static void check_matmul_bias(void) {
    int64_t bytes;
    uint8_t *wp = packed_f32(16, 32, &bytes);
    float *x = floats(32, 1.0f), *out = floats(16, 0.0f), *bias = floats(5, 1.0f);
    if (ringshm_qmat_matmul(RINGSHM_W_F32, wp, bytes, 16, 32, x, 1, out, 16, bias, 5, NULL, 0, 1,
                            RINGSHM_ISA_PORTABLE) != RINGSHM_MATMUL_ERR_SIZE)
        FAIL("matmul read a 5-float bias for 16 output rows\n");
    if (ringshm_qmat_matmul(RINGSHM_W_F32, wp, bytes, 16, 32, x, 1, out, 16, NULL, 16, NULL, 0, 1,
                            RINGSHM_ISA_PORTABLE) != RINGSHM_MATMUL_ERR_SIZE)
        FAIL("matmul took a length for no bias\n");
    if (ringshm_qmat_matmul(RINGSHM_W_F32, wp, bytes, 16, 32, x, 1, out, 16, NULL, 0, NULL, 0, 1,
                            RINGSHM_ISA_PORTABLE))
        FAIL("matmul refused a good call\n");
    free(wp), free(x), free(out), free(bias);
}

struct layer {
    struct ringshm_layer_shape shape;
    struct ringshm_layer_weights w;
    float *x, *work;
    int64_t work_floats;
};

static void layer_init(struct layer *l) {
    memset(l, 0, sizeof *l);
    l->shape = (struct ringshm_layer_shape){.hidden = HID, .n_heads = 1, .n_kv_heads = 1, .head_dim = D,
                                            .inter = INTER, .n_pos = NPOS, .rms_eps = 1e-5f,
                                            .act = RINGSHM_ACT_SILU, .attn_scale = 0.25f, .residual_scale = 1.0f};
    struct ringshm_layer_weights *w = &l->w;
    w->type_qkv = w->type_o = w->type_gate_up = w->type_down = RINGSHM_W_F32;
    w->qkv = packed_f32(3 * D, HID, &w->qkv_bytes);
    w->o = packed_f32(HID, D, &w->o_bytes);
    w->gate_up = packed_f32(2 * INTER, HID, &w->gate_up_bytes);
    w->down = packed_f32(HID, INTER, &w->down_bytes);
    w->attn_norm = floats(HID, 1.0f), w->attn_norm_len = HID;
    w->ffn_norm = floats(HID, 1.0f), w->ffn_norm_len = HID;
    w->cos = floats(NPOS * D / 2, 1.0f), w->cos_len = NPOS * D / 2;
    w->sin = floats(NPOS * D / 2, 0.0f), w->sin_len = NPOS * D / 2;
    const int64_t pool = (int64_t)1 * 1 * BLOCK * D; /* one block, one KV head */
    w->kv = (struct ringshm_kv_pool){.k = floats(pool, 0.0f), .v = floats(pool, 0.0f), .n_blocks = 1,
                                     .block_size = BLOCK, .n_kv_heads = 1, .head_dim = D,
                                     .kv_type = RINGSHM_KV_F32, .n_elems = pool};
    l->x = floats(2 * HID, 0.5f);
    l->work_floats = ringshm_layer_work_floats(&l->shape, 2);
    l->work = floats(l->work_floats, 0.0f);
}

static void layer_free(struct layer *l) {
    free((void *)l->w.qkv), free((void *)l->w.o), free((void *)l->w.gate_up), free((void *)l->w.down);
    free((void *)l->w.attn_norm), free((void *)l->w.ffn_norm), free((void *)l->w.cos), free((void *)l->w.sin);
    free(l->w.kv.k), free(l->w.kv.v), free(l->x), free(l->work);
}

static int layer_run(struct layer *l) {
    const int64_t starts[1] = {0}, lens[1] = {2}, offs[2] = {0, 1};
    const int32_t table[1] = {0};
    return ringshm_layer_forward(&l->shape, &l->w, l->x, 2, starts, lens, table, offs, 1, l->work, l->work_floats, 1,
                                 RINGSHM_ISA_PORTABLE);
}

static void check_layer(void) {
    struct layer l;
    layer_init(&l);
    if (layer_run(&l)) FAIL("the layer refused good weights\n");

    const float *good = l.w.attn_norm;
    float *short_norm = floats(HID / 2, 1.0f); /* a checkpoint's norm of 8 floats where hidden is 16 */
    l.w.attn_norm = short_norm, l.w.attn_norm_len = HID / 2;
    if (layer_run(&l) != RINGSHM_KERNEL_ERR_LENGTH) FAIL("the layer read an 8-float attn_norm for hidden 16\n");
    l.w.attn_norm = good, l.w.attn_norm_len = HID;

    float *post = floats(1, 1.0f); /* post norms of one float (Gemma's sandwich norms, malformed) */
    l.w.post_attn_norm = post, l.w.post_ffn_norm = post, l.w.post_attn_norm_len = 1, l.w.post_ffn_norm_len = 1;
    if (layer_run(&l) != RINGSHM_KERNEL_ERR_LENGTH) FAIL("the layer read 1-float post norms\n");
    l.w.post_attn_norm = l.w.post_ffn_norm = NULL, l.w.post_attn_norm_len = l.w.post_ffn_norm_len = 0;

    float *qn = floats(D - 1, 1.0f);
    l.w.q_norm = l.w.k_norm = qn, l.w.q_norm_len = l.w.k_norm_len = D - 1;
    if (layer_run(&l) != RINGSHM_KERNEL_ERR_LENGTH) FAIL("the layer read a q / k norm shorter than head_dim\n");
    l.w.q_norm = l.w.k_norm = NULL, l.w.q_norm_len = l.w.k_norm_len = 0;

    float *bias = floats(3, 0.0f);
    l.w.bqkv = bias, l.w.bqkv_len = 3;
    if (layer_run(&l) != RINGSHM_KERNEL_ERR_LENGTH) FAIL("the layer read a 3-float qkv bias\n");
    l.w.bqkv = NULL, l.w.bqkv_len = 0;
    l.w.bdown = bias, l.w.bdown_len = 3;
    if (layer_run(&l) != RINGSHM_KERNEL_ERR_LENGTH) FAIL("the layer read a 3-float down bias\n");
    l.w.bdown = NULL, l.w.bdown_len = 0;

    l.w.cos_len = NPOS * D / 2 - 1;
    if (layer_run(&l) != RINGSHM_KERNEL_ERR_LENGTH) FAIL("the layer read RoPE tables shorter than n_pos rows\n");
    l.w.cos_len = NPOS * D / 2;

    l.w.kv.n_elems -= 1; /* a pool smaller than its shape says */
    if (layer_run(&l) == RINGSHM_KERNEL_OK) FAIL("the layer wrote a KV pool smaller than its shape\n");
    l.w.kv.n_elems += 1;

    if (layer_run(&l)) FAIL("the layer refused good weights after the bad ones\n");
    free(short_norm), free(post), free(qn), free(bias);
    layer_free(&l);
}

/* The layer as a mixture of 2 experts (top 1, width 16) with a gated shared expert of width 16: a shared gate's
 * weights shorter than hidden, missing, or present without a gate are refused; so is a shape whose shared width
 * is not whole 16-float vectors or that has a shared expert but no routed ones. */
static void check_shared_expert(void) {
    struct layer l;
    layer_init(&l);
    l.shape.n_experts = 2, l.shape.n_experts_used = 1, l.shape.expert_inter = 16;
    l.shape.gating = RINGSHM_GATE_SOFTMAX_NORM, l.shape.shared_inter = 16, l.shape.shared_gate = 1;
    struct ringshm_layer_weights *w = &l.w;
    int64_t both;
    w->type_router = w->type_exp_gate = w->type_exp_up = w->type_exp_down = RINGSHM_W_F32;
    w->type_sh_gate_up = w->type_sh_down = RINGSHM_W_F32;
    w->router = packed_f32(2, HID, &w->router_bytes);
    w->exp_gate = packed_f32(2 * 16, HID, &both), w->exp_gate_bytes = both / 2; /* two experts, one after another */
    w->exp_up = packed_f32(2 * 16, HID, &both), w->exp_up_bytes = both / 2;
    w->exp_down = packed_f32(2 * HID, 16, &both), w->exp_down_bytes = both / 2;
    w->sh_gate_up = packed_f32(2 * 16, HID, &w->sh_gate_up_bytes);
    w->sh_down = packed_f32(HID, 16, &w->sh_down_bytes);
    float *gate = floats(HID, 0.1f), *short_gate = floats(HID - 1, 0.1f);
    free(l.work);
    l.work_floats = ringshm_layer_work_floats(&l.shape, 2);
    l.work = floats(l.work_floats, 0.0f);
    w->sh_gate_inp = gate, w->sh_gate_inp_len = HID;
    if (layer_run(&l)) FAIL("the layer refused a good shared expert\n");
    w->sh_gate_inp = short_gate, w->sh_gate_inp_len = HID - 1;
    if (layer_run(&l) != RINGSHM_KERNEL_ERR_LENGTH) FAIL("the layer read a 15-float shared gate for hidden 16\n");
    w->sh_gate_inp = NULL, w->sh_gate_inp_len = 0;
    if (layer_run(&l) != RINGSHM_KERNEL_ERR_LENGTH) FAIL("the layer ran a gated shared expert without its gate\n");
    l.shape.shared_gate = 0, w->sh_gate_inp = gate, w->sh_gate_inp_len = HID;
    if (layer_run(&l) != RINGSHM_KERNEL_ERR_LENGTH) FAIL("the layer took a gate for an ungated shared expert\n");
    w->sh_gate_inp = NULL, w->sh_gate_inp_len = 0;
    if (layer_run(&l)) FAIL("the layer refused a good ungated shared expert\n");

    /* gpt-oss's vectors: sinks [n_heads], router bias [E], expert biases [E, expert_inter] / [E, hidden] */
    float *sinks = floats(1, 0.5f), *rb = floats(2, 0.1f), *eb = floats(2 * 16, 0.1f), *db = floats(2 * HID, 0.1f);
    w->sinks = sinks, w->sinks_len = 1, w->router_bias = rb, w->router_bias_len = 2;
    w->exp_gate_bias = w->exp_up_bias = eb, w->exp_gate_bias_len = w->exp_up_bias_len = 2 * 16;
    w->exp_down_bias = db, w->exp_down_bias_len = 2 * HID;
    l.shape.act = RINGSHM_ACT_SWIGLU_OAI, l.shape.swiglu_alpha = 1.702f, l.shape.swiglu_limit = 7.0f;
    if (layer_run(&l)) FAIL("the layer refused good gpt-oss vectors\n");
    w->sinks_len = 2;
    if (layer_run(&l) != RINGSHM_KERNEL_ERR_LENGTH) FAIL("the layer took 2 sinks for 1 head\n");
    w->sinks_len = 1, w->exp_down_bias_len = 2 * HID - 1;
    if (layer_run(&l) != RINGSHM_KERNEL_ERR_LENGTH) FAIL("the layer read a short expert down bias\n");
    w->exp_down_bias_len = 2 * HID, w->exp_gate_bias_len = 16;
    if (layer_run(&l) != RINGSHM_KERNEL_ERR_LENGTH) FAIL("the layer read one expert's gate bias for two\n");
    w->exp_gate_bias_len = 2 * 16, w->router_bias_len = 1;
    if (layer_run(&l) != RINGSHM_KERNEL_ERR_LENGTH) FAIL("the layer read a 1-float router bias for 2 experts\n");
    w->router_bias_len = 2, l.shape.swiglu_limit = 0.0f;
    if (ringshm_layer_work_floats(&l.shape, 2) >= 0) FAIL("a clamped SwiGLU with limit 0 was taken\n");
    l.shape.swiglu_limit = 7.0f, l.shape.act = RINGSHM_ACT_SILU;
    w->sinks = w->router_bias = w->exp_gate_bias = w->exp_up_bias = w->exp_down_bias = NULL;
    w->sinks_len = w->router_bias_len = w->exp_gate_bias_len = w->exp_up_bias_len = w->exp_down_bias_len = 0;
    free(sinks), free(rb), free(eb), free(db);
    l.shape.shared_inter = 8;
    if (ringshm_layer_work_floats(&l.shape, 2) >= 0) FAIL("a shared width of 8 floats was taken\n");
    l.shape.shared_inter = 16, l.shape.n_experts = 0;
    if (ringshm_layer_work_floats(&l.shape, 2) >= 0) FAIL("a shared expert without routed ones was taken\n");
    free((void *)w->router), free((void *)w->exp_gate), free((void *)w->exp_up), free((void *)w->exp_down);
    free((void *)w->sh_gate_up), free((void *)w->sh_down), free(gate), free(short_gate);
    layer_free(&l);
}

int main(void) {
    check_rms_norm();
    check_matmul_bias();
    check_layer();
    check_shared_expert();
    printf("test_lengths: short norms, biases, RoPE tables and KV pools refused by status, nothing read past them\n");
    return 0;
}
