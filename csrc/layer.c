/* One decoder layer in one call (see layer.h): the kernels of matmul.h and kernels.h strung together; a routed
 * mixture of experts' FFN is layer_moe.c. */
#include "layer.h"

#include <math.h>
#include <string.h>

#include "kernels.h"
#include "matmul.h"
#include "matmul_internal.h"

static int64_t round16(int64_t n) { return (n + 15) / 16 * 16; }

#include "layer_internal.h"

static int layout_of(const struct ringshm_layer_shape *s, int64_t t, struct layout *l) {
    if (!s || t <= 0 || s->hidden <= 0 || s->hidden % 16 || (!s->n_experts && (s->inter <= 0 || s->inter % 8)) ||
        s->n_heads <= 0 ||
        s->n_kv_heads <= 0 || s->head_dim <= 0 || s->n_pos <= 0 ||
        s->n_heads % s->n_kv_heads || s->head_dim % RINGSHM_ATTN_HEAD_DIM_MULTIPLE ||
        s->head_dim > RINGSHM_ATTN_MAX_HEAD_DIM ||
        (s->act != RINGSHM_ACT_SILU && s->act != RINGSHM_ACT_GELU_TANH && s->act != RINGSHM_ACT_SWIGLU_OAI) ||
        (s->act == RINGSHM_ACT_SWIGLU_OAI && !(s->swiglu_alpha > 0.0f && s->swiglu_alpha < 1e30f &&
                                               s->swiglu_limit > 0.0f && s->swiglu_limit < 1e30f)) ||
        !(s->attn_scale > 0.0f) || (s->qk_norm_full != 0 && s->qk_norm_full != 1) || s->n_experts < 0 ||
        s->n_experts > RINGSHM_MAX_EXPERTS ||
        (s->n_experts && (s->n_experts_used < 1 || s->n_experts_used > s->n_experts ||
                          s->n_experts_used > RINGSHM_MAX_EXPERTS_USED || s->expert_inter <= 0 ||
                          s->expert_inter % 16 ||
                          (s->gating != RINGSHM_GATE_SOFTMAX && s->gating != RINGSHM_GATE_SOFTMAX_NORM &&
                           s->gating != RINGSHM_GATE_TOPK_SOFTMAX))) ||
        s->shared_inter < 0 || s->shared_inter % 16 || s->shared_inter > (1 << 24) ||
        (s->shared_inter && !s->n_experts) ||
        (s->shared_gate != 0 && s->shared_gate != 1) || (s->shared_gate && !s->shared_inter) ||
        !(s->residual_scale > 0.0f) || !(s->residual_scale < 1e30f) || (s->act_q8 != 0 && s->act_q8 != 1))
        return 0;
    const int64_t qd = (int64_t)s->n_heads * s->head_dim, kvd = (int64_t)s->n_kv_heads * s->head_dim;
    const int64_t inter = s->n_experts ? s->expert_inter : s->inter, k = s->n_experts_used;
    const int64_t rows = s->n_experts ? t * k : t; /* rows of gu and act */
    l->qkv_w = round16(qd + 2 * kvd), l->gu_w = 2 * inter, l->logits_w = round16(s->n_experts);
    int64_t at = 0;
    l->h = at, at += t * s->hidden;
    l->qkv = at, at += t * l->qkv_w;
    l->q = at, at += t * qd;
    l->k = at, at += t * kvd;
    l->v = at, at += t * kvd;
    l->attn = at, at += t * qd;
    l->x2 = at, at += t * s->hidden;
    l->gu = at, at += rows * l->gu_w;
    l->act = at, at += rows * inter;
    l->logits = l->wsel = l->isel = l->xs = l->ys = l->m = l->order = l->where = l->offs = l->active = l->p = at;
    l->sgu = l->sact = l->sy = l->sg = at;
    if (s->n_experts) {
        l->logits = at, at += t * l->logits_w;
        l->wsel = at, at += t * k;
        l->isel = at, at += t * k;
        l->xs = at, at += t * k * s->hidden;
        l->ys = at, at += t * k * s->hidden;
        l->m = at, at += t * s->hidden;
        l->order = at, at += t * k;
        l->where = at, at += t * k;
        l->offs = at, at += s->n_experts + 1;
        l->active = at, at += s->n_experts;
        l->p = at, at += s->n_experts;
    }
    if (s->shared_inter) {
        l->sgu = at, at += t * 2 * (int64_t)s->shared_inter;
        l->sact = at, at += t * s->shared_inter;
        l->sy = at, at += t * s->hidden;
        if (s->shared_gate) l->sg = at, at += t;
    }
    l->xq = at, l->xq_row_bytes = 0;
    if (s->act_q8) { /* the widest K of any matmul: hidden, q_dim, inter / expert_inter, shared_inter */
        int64_t kmax = s->hidden > qd ? s->hidden : qd;
        kmax = inter > kmax ? inter : kmax;
        kmax = s->shared_inter > kmax ? s->shared_inter : kmax;
        kmax = (kmax + 31) / 32 * 32;
        l->xq_row_bytes = kmax / 32 * (int64_t)sizeof(struct ringshm_q8_block);
        at += (rows > t ? rows : t) * l->xq_row_bytes / 4;
    }
    l->total = at;
    return 1;
}

int ringshm_layer_mm(const struct ringshm_layer_shape *s, const struct layout *l, float *work, int64_t row0, int type,
                     const uint8_t *packed, int64_t packed_bytes, int64_t n, int64_t k, const float *x, int64_t m,
                     float *out, int64_t ldo, const float *bias, int64_t bias_len, const float *residual,
                     int64_t ldr, int n_threads, int isa) {
    if (!s->act_q8 || !ringshm_q8_supported(type))
        return ringshm_qmat_matmul(type, packed, packed_bytes, n, k, x, m, out, ldo, bias, bias_len, residual, ldr,
                                   n_threads, isa);
    uint8_t *xq = (uint8_t *)(work + l->xq) + row0 * l->xq_row_bytes;
    const int64_t bytes = ringshm_q8_act_bytes(m, k);
    int st;
    if (bytes < 0 || bytes > m * l->xq_row_bytes) return RINGSHM_MATMUL_ERR_SHAPE;
    if ((st = ringshm_q8_quantize(x, m, k, xq, bytes, n_threads, isa))) return st;
    return ringshm_qmat_matmul_q8(type, packed, packed_bytes, n, k, xq, bytes, m, out, ldo, bias, bias_len, residual,
                                  ldr, n_threads, ringshm_q8_isa(isa));
}

/* Every vector of w holds what the shape reads from it: 1, else 0. A NULL optional vector has length 0. */
static int lengths_ok(const struct ringshm_layer_shape *s, const struct ringshm_layer_weights *w) {
    const int64_t hid = s->hidden, d = s->head_dim, qd = (int64_t)s->n_heads * d, kvd = (int64_t)s->n_kv_heads * d;
    const int64_t qn = s->qk_norm_full ? qd : d, kn = s->qk_norm_full ? kvd : d;
#define LEN_OK(ptr, len, want) ((ptr) ? (len) == (want) : (len) == 0)
    return w->attn_norm && w->ffn_norm && w->cos && w->sin && w->attn_norm_len == hid && w->ffn_norm_len == hid &&
           LEN_OK(w->q_norm, w->q_norm_len, qn) && LEN_OK(w->k_norm, w->k_norm_len, kn) &&
           LEN_OK(w->post_attn_norm, w->post_attn_norm_len, hid) &&
           LEN_OK(w->post_ffn_norm, w->post_ffn_norm_len, hid) && LEN_OK(w->bqkv, w->bqkv_len, qd + 2 * kvd) &&
           LEN_OK(w->bo, w->bo_len, hid) && LEN_OK(w->bgate_up, w->bgate_up_len, 2 * (int64_t)s->inter) &&
           LEN_OK(w->bdown, w->bdown_len, hid) && LEN_OK(w->sh_gate_inp, w->sh_gate_inp_len, hid) &&
           (w->sh_gate_inp != NULL) == (s->shared_gate == 1) && w->cos_len == (int64_t)s->n_pos * (d / 2) &&
           w->sin_len == w->cos_len && LEN_OK(w->sinks, w->sinks_len, s->n_heads) &&
           LEN_OK(w->router_bias, w->router_bias_len, s->n_experts) &&
           LEN_OK(w->exp_gate_bias, w->exp_gate_bias_len, (int64_t)s->n_experts * s->expert_inter) &&
           LEN_OK(w->exp_up_bias, w->exp_up_bias_len, (int64_t)s->n_experts * s->expert_inter) &&
           LEN_OK(w->exp_down_bias, w->exp_down_bias_len, (int64_t)s->n_experts * hid) &&
           (s->n_experts || !(w->router_bias || w->exp_gate_bias || w->exp_up_bias || w->exp_down_bias));
#undef LEN_OK
}

int64_t ringshm_layer_work_floats(const struct ringshm_layer_shape *s, int64_t t) {
    struct layout l;
    return layout_of(s, t, &l) ? l.total : RINGSHM_KERNEL_ERR_SHAPE;
}

/* The shape's gate on gu [m, 2 inter] rows [gate | up] into out [m, inter] (kernels.h); a status. */
int ringshm_layer_act(const struct ringshm_layer_shape *s, float *out, const float *gu, int64_t m, int64_t inter) {
    switch (s->act) {
    case RINGSHM_ACT_GELU_TANH: return ringshm_gelu_tanh_mul(out, gu, m, inter);
    case RINGSHM_ACT_SWIGLU_OAI: return ringshm_swiglu_oai_mul(out, gu, m, inter, s->swiglu_alpha, s->swiglu_limit);
    default: return ringshm_silu_mul(out, gu, m, inter);
    }
}

/* x[i] = a[i] + b[i] over [t, hidden] (one rounded add each: the residual of a post-normed branch). */
static void add_rows(float *x, const float *a, const float *b, int64_t n) {
    for (int64_t i = 0; i < n; i++) x[i] = a[i] + b[i];
}

/* x[i] = a[i] + b[i] * scale over n floats: a branch scaled before its residual add (two roundings). */
void ringshm_add_scaled_rows(float *x, const float *a, const float *b, float scale, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        const float scaled = b[i] * scale;
        x[i] = a[i] + scaled;
    }
}

/* The layer, or (kv_only) its keys and values alone: the steps up to each segment's kv_append. */
static int layer_forward(const struct ringshm_layer_shape *s, const struct ringshm_layer_weights *w, float *x, int64_t t,
                         const int64_t *starts, const int64_t *lens, const int32_t *tables, const int64_t *table_offs,
                         int n_seg, float *work, int64_t work_floats, int n_threads, int isa, int kv_only) {
    struct layout l;
    if (!w || !layout_of(s, t, &l) || work_floats < l.total || n_seg <= 0 || n_seg > RINGSHM_ATTN_MAX_SEGMENTS ||
        w->window < 0 || !w->cos || !w->sin || (!w->q_norm) != (!w->k_norm) ||
        (!w->post_attn_norm) != (!w->post_ffn_norm) || w->kv.n_kv_heads != s->n_kv_heads ||
        w->kv.head_dim != s->head_dim)
        return RINGSHM_KERNEL_ERR_SHAPE;
    if (!lengths_ok(s, w)) return RINGSHM_KERNEL_ERR_LENGTH;
    int64_t sum = 0;
    for (int i = 0; i < n_seg; i++) {
        if (lens[i] <= 0) return RINGSHM_KERNEL_ERR_SHAPE;
        if (starts[i] < 0 || starts[i] + lens[i] > s->n_pos) return RINGSHM_KERNEL_ERR_RANGE;
        sum += lens[i];
    }
    if (sum != t) return RINGSHM_KERNEL_ERR_SHAPE;
    const int hid = s->hidden, hq = s->n_heads, hkv = s->n_kv_heads, d = s->head_dim;
    const int64_t qd = (int64_t)hq * d, kvd = (int64_t)hkv * d;
    const int post = w->post_attn_norm != NULL;
    if (post && s->residual_scale != 1.0f) return RINGSHM_KERNEL_ERR_SHAPE; /* no family scales a post-normed branch */
    float *h = work + l.h, *qkv = work + l.qkv, *q = work + l.q, *k = work + l.k, *v = work + l.v;
    float *attn = work + l.attn, *x2 = work + l.x2, *gu = work + l.gu, *act = work + l.act;
    int st;

    if ((st = ringshm_rms_norm(h, x, w->attn_norm, w->attn_norm_len, t, hid, s->rms_eps))) return st;
    if (!w->qkv_split) {
        if ((st = ringshm_layer_mm(s, &l, work, 0, w->type_qkv, w->qkv, w->qkv_bytes, qd + 2 * kvd, hid, h, t, qkv,
                                   l.qkv_w, w->bqkv, w->bqkv_len, NULL, 0, n_threads, isa)))
            return st;
    } else { /* Q, K, V in order into their columns (q_dim, kv_dim are multiples of 16: no padding overlaps) */
        const int types[3] = {w->type_qkv, w->type_wk, w->type_wv};
        const uint8_t *parts[3] = {w->qkv, w->wk, w->wv};
        const int64_t bytes[3] = {w->qkv_bytes, w->wk_bytes, w->wv_bytes}, rows[3] = {qd, kvd, kvd};
        for (int i = 0, col = 0; i < 3; col += (int)rows[i], i++)
            if ((st = ringshm_layer_mm(s, &l, work, 0, types[i], parts[i], bytes[i], rows[i], hid, h, t, qkv + col,
                                       l.qkv_w, w->bqkv ? w->bqkv + col : NULL, w->bqkv ? rows[i] : 0, NULL, 0,
                                       n_threads, isa)))
                return st;
    }
    for (int64_t i = 0; i < t; i++) { /* split the fused rows: q, k, v contiguous [t, H, D] */
        memcpy(q + i * qd, qkv + i * l.qkv_w, sizeof(float) * (size_t)qd);
        memcpy(k + i * kvd, qkv + i * l.qkv_w + qd, sizeof(float) * (size_t)kvd);
        memcpy(v + i * kvd, qkv + i * l.qkv_w + qd + kvd, sizeof(float) * (size_t)kvd);
    }
    if (w->q_norm && s->qk_norm_full) { /* over each token's whole projection (OLMoE) */
        if (!kv_only && (st = ringshm_rms_norm(q, q, w->q_norm, w->q_norm_len, t, qd, s->rms_eps))) return st;
        if ((st = ringshm_rms_norm(k, k, w->k_norm, w->k_norm_len, t, kvd, s->rms_eps))) return st;
    } else if (w->q_norm) { /* per-head RMSNorm: every head's D values are one row */
        if (!kv_only && (st = ringshm_rms_norm(q, q, w->q_norm, w->q_norm_len, t * hq, d, s->rms_eps))) return st;
        if ((st = ringshm_rms_norm(k, k, w->k_norm, w->k_norm_len, t * hkv, d, s->rms_eps))) return st;
    }
    int64_t off = 0;
    for (int i = 0; i < n_seg; off += lens[i], i++) { /* RoPE and KV-append per segment, into its blocks */
        const int n = (int)lens[i], start = (int)starts[i];
        const int32_t *table = tables + table_offs[i];
        const int n_table = (int)(table_offs[i + 1] - table_offs[i]);
        if ((st = ringshm_kv_append(&w->kv, table, n_table, k + off * kvd, v + off * kvd, w->cos, w->sin, n, start,
                                    s->n_pos)))
            return st;
        if (!kv_only && (st = ringshm_rope_apply(q + off * qd, q + off * qd, w->cos, w->sin, n, hq, d, start,
                                                 s->n_pos)))
            return st;
    }
    if (kv_only) return RINGSHM_KERNEL_OK;
    /* then every segment's attention at once: (segment, kv head) items over the threads */
    if ((st = ringshm_attn_forward_segments(attn, q, &w->kv, tables, table_offs, starts, lens, n_seg, hq, w->window,
                                            s->attn_scale, w->sinks, n_threads)))
        return st;
    if (post) { /* x2 = x + norm(attn . Wo^T + bo) */
        if ((st = ringshm_layer_mm(s, &l, work, 0, w->type_o, w->o, w->o_bytes, hid, qd, attn, t, x2, hid, w->bo,
                                   w->bo_len, NULL, 0, n_threads, isa)) ||
            (st = ringshm_rms_norm(x2, x2, w->post_attn_norm, w->post_attn_norm_len, t, hid, s->rms_eps)))
            return st;
        add_rows(x2, x, x2, t * hid);
    } else if (s->residual_scale != 1.0f) { /* x2 = x + (attn . Wo^T + bo) * residual_scale */
        if ((st = ringshm_layer_mm(s, &l, work, 0, w->type_o, w->o, w->o_bytes, hid, qd, attn, t, x2, hid, w->bo,
                                   w->bo_len, NULL, 0, n_threads, isa)))
            return st;
        ringshm_add_scaled_rows(x2, x, x2, s->residual_scale, t * hid);
    } else if ((st = ringshm_layer_mm(s, &l, work, 0, w->type_o, w->o, w->o_bytes, hid, qd, attn, t, x2, hid, w->bo,
                                      w->bo_len, x, hid, n_threads, isa))) {
        return st;
    }
    if ((st = ringshm_rms_norm(h, x2, w->ffn_norm, w->ffn_norm_len, t, hid, s->rms_eps))) return st;
    if (s->n_experts) {
        if (post) return RINGSHM_KERNEL_ERR_SHAPE; /* no MoE family has post norms */
        return ringshm_moe_ffn(s, w, &l, work, h, x2, x, t, n_threads, isa);
    }
    if ((st = ringshm_layer_mm(s, &l, work, 0, w->type_gate_up, w->gate_up, w->gate_up_bytes, 2 * (int64_t)s->inter,
                               hid, h, t, gu, l.gu_w, w->bgate_up, w->bgate_up_len, NULL, 0, n_threads, isa)))
        return st;
    if ((st = ringshm_layer_act(s, act, gu, t, s->inter))) return st;
    if (post) { /* x = x2 + norm(act . Wdown^T + bdown) */
        if ((st = ringshm_layer_mm(s, &l, work, 0, w->type_down, w->down, w->down_bytes, hid, s->inter, act, t, h, hid,
                                   w->bdown, w->bdown_len, NULL, 0, n_threads, isa)) ||
            (st = ringshm_rms_norm(h, h, w->post_ffn_norm, w->post_ffn_norm_len, t, hid, s->rms_eps)))
            return st;
        add_rows(x, x2, h, t * hid);
        return RINGSHM_KERNEL_OK;
    }
    if (s->residual_scale != 1.0f) { /* x = x2 + (act . Wdown^T + bdown) * residual_scale */
        if ((st = ringshm_layer_mm(s, &l, work, 0, w->type_down, w->down, w->down_bytes, hid, s->inter, act, t, h, hid,
                                   w->bdown, w->bdown_len, NULL, 0, n_threads, isa)))
            return st;
        ringshm_add_scaled_rows(x, x2, h, s->residual_scale, t * hid);
        return RINGSHM_KERNEL_OK;
    }
    return ringshm_layer_mm(s, &l, work, 0, w->type_down, w->down, w->down_bytes, hid, s->inter, act, t, x, hid,
                            w->bdown, w->bdown_len, x2, hid, n_threads, isa);
}

int ringshm_layer_forward(const struct ringshm_layer_shape *s, const struct ringshm_layer_weights *w, float *x,
                          int64_t t, const int64_t *starts, const int64_t *lens, const int32_t *tables,
                          const int64_t *table_offs, int n_seg, float *work, int64_t work_floats, int n_threads,
                          int isa) {
    return layer_forward(s, w, x, t, starts, lens, tables, table_offs, n_seg, work, work_floats, n_threads, isa, 0);
}

int ringshm_layer_kv(const struct ringshm_layer_shape *s, const struct ringshm_layer_weights *w, const float *x,
                     int64_t t, const int64_t *starts, const int64_t *lens, const int32_t *tables,
                     const int64_t *table_offs, int n_seg, float *work, int64_t work_floats, int n_threads, int isa) {
    return layer_forward(s, w, (float *)x, t, starts, lens, tables, table_offs, n_seg, work, work_floats, n_threads,
                         isa, 1);
}
