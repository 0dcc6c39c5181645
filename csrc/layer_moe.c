/* A routed mixture of experts' FFN for ringshm_layer_forward (layer.h draws it): routing, the experts on their
 * rows, the shared expert, and each token's sum in fixed order. */
#include <math.h>
#include <string.h>

#include "kernels.h"
#include "layer_internal.h"
#include "matmul.h"

/* One token's routing (layer.h): softmax over the n logits (RINGSHM_GATE_TOPK_SOFTMAX: the logits themselves), the
 * k largest picked by ascending scans (the first of equal values wins), their weights (renormalised for
 * RINGSHM_GATE_SOFTMAX_NORM; the softmax over the k picked for RINGSHM_GATE_TOPK_SOFTMAX). p: n floats of
 * scratch; isel / wsel: k each. */
static void route_token(const float *logits, int n, int k, int gating, float *p, float *wsel, int32_t *isel) {
    if (gating == RINGSHM_GATE_TOPK_SOFTMAX) { /* pick on the logits; the softmax over the k picked */
        memcpy(p, logits, sizeof(float) * (size_t)n);
    } else {
        float mx = logits[0];
        for (int e = 1; e < n; e++) mx = logits[e] > mx ? logits[e] : mx;
        float sum = 0.0f;
        for (int e = 0; e < n; e++) p[e] = expf(logits[e] - mx), sum += p[e];
        for (int e = 0; e < n; e++) p[e] = p[e] / sum;
    }
    for (int r = 0; r < k; r++) {
        int best = -1;
        for (int e = 0; e < n; e++) {
            int taken = 0;
            for (int q = 0; q < r; q++) taken |= isel[q] == e;
            if (!taken && (best < 0 || p[e] > p[best])) best = e;
        }
        isel[r] = best, wsel[r] = p[best];
    }
    if (gating == RINGSHM_GATE_SOFTMAX_NORM) {
        float s = 0.0f;
        for (int r = 0; r < k; r++) s += wsel[r];
        for (int r = 0; r < k; r++) wsel[r] = wsel[r] / s;
    } else if (gating == RINGSHM_GATE_TOPK_SOFTMAX) { /* rank 0 holds the largest logit */
        const float mx = wsel[0];
        float s = 0.0f;
        for (int r = 0; r < k; r++) wsel[r] = expf(wsel[r] - mx), s += wsel[r];
        for (int r = 0; r < k; r++) wsel[r] = wsel[r] / s;
    }
}

/* One expert's FFN on its n rows (pairs [lo, lo + n) of the grouped order): gather h, gate and up, act, down into
 * ys. n_threads split its panels (1: the calling thread). */
static int run_expert(const struct ringshm_layer_shape *s, const struct ringshm_layer_weights *w,
                      const struct layout *l, float *work, const float *h, int e, int64_t lo, int64_t n,
                      int n_threads, int isa) {
    const int hid = s->hidden, k = s->n_experts_used, ie = s->expert_inter;
    const int32_t *pairs = (const int32_t *)(work + l->order) + lo;
    float *xs = work + l->xs + lo * hid, *gu = work + l->gu + lo * 2 * ie, *act = work + l->act + lo * ie;
    float *ys = work + l->ys + lo * hid;
    int st;
    for (int64_t r = 0; r < n; r++) memcpy(xs + r * hid, h + (pairs[r] / k) * hid, sizeof(float) * (size_t)hid);
    const float *bg = w->exp_gate_bias ? w->exp_gate_bias + (int64_t)e * ie : NULL;
    const float *bu = w->exp_up_bias ? w->exp_up_bias + (int64_t)e * ie : NULL;
    const float *bd = w->exp_down_bias ? w->exp_down_bias + (int64_t)e * hid : NULL;
    if ((st = ringshm_layer_mm(s, l, work, lo, w->type_exp_gate, w->exp_gate + e * w->exp_gate_bytes,
                               w->exp_gate_bytes, ie, hid, xs, n, gu, 2 * ie, bg, bg ? ie : 0, NULL, 0, n_threads,
                               isa)) ||
        (st = ringshm_layer_mm(s, l, work, lo, w->type_exp_up, w->exp_up + e * w->exp_up_bytes, w->exp_up_bytes, ie,
                               hid, xs, n, gu + ie, 2 * ie, bu, bu ? ie : 0, NULL, 0, n_threads, isa)) ||
        (st = ringshm_layer_act(s, act, gu, n, ie)))
        return st;
    return ringshm_layer_mm(s, l, work, lo, w->type_exp_down, w->exp_down + e * w->exp_down_bytes, w->exp_down_bytes,
                            hid, ie, act, n, ys, hid, bd, bd ? hid : 0, NULL, 0, n_threads, isa);
}

/* The shared expert on h [t, hidden] (layer.h): sy [t, hidden] and, with its gate, sg [t] = sigmoid(h . w) with
 * the dot product one fmaf per element in ascending order (each token alone). The matmuls split panels over the
 * threads, every row the matmul's row-invariant result. */
static int shared_expert(const struct ringshm_layer_shape *s, const struct ringshm_layer_weights *w,
                         const struct layout *l, float *work, const float *h, int64_t t, int n_threads, int isa) {
    const int hid = s->hidden;
    const int64_t si = s->shared_inter;
    float *sgu = work + l->sgu, *sact = work + l->sact, *sg = work + l->sg;
    int st;
    if (!w->sh_gate_up || !w->sh_down) return RINGSHM_KERNEL_ERR_SHAPE;
    if ((st = ringshm_layer_mm(s, l, work, 0, w->type_sh_gate_up, w->sh_gate_up, w->sh_gate_up_bytes, 2 * si, hid, h,
                               t, sgu, 2 * si, NULL, 0, NULL, 0, n_threads, isa)) ||
        (st = ringshm_layer_act(s, sact, sgu, t, si)) ||
        (st = ringshm_layer_mm(s, l, work, 0, w->type_sh_down, w->sh_down, w->sh_down_bytes, hid, si, sact, t,
                               work + l->sy, hid, NULL, 0, NULL, 0, n_threads, isa)))
        return st;
    if (s->shared_gate)
        for (int64_t i = 0; i < t; i++) {
            float z = 0.0f;
            for (int j = 0; j < hid; j++) z = fmaf(h[i * hid + j], w->sh_gate_inp[j], z);
            sg[i] = 1.0f / (1.0f + expf(-z));
        }
    return RINGSHM_KERNEL_OK;
}

/* The routed experts' FFN on h [t, hidden] (layer.h), the result added to x2 into x. The (token, rank) pairs are
 * grouped by expert (a counting sort, tokens ascending within each); every pair has its own rows of xs / gu / act
 * / ys, so experts never share scratch. With at least as many active experts as threads, each thread runs whole
 * experts (dynamic schedule, most rows first) on one thread each; with fewer, the experts run one after another,
 * their panels split over the threads. Either way every expert row is the matmul's row-invariant result. Then
 * each token sums its k terms in ascending expert id, and adds the shared expert's (gated) output last. */
int ringshm_moe_ffn(const struct ringshm_layer_shape *s, const struct ringshm_layer_weights *w,
                   const struct layout *l, float *work, const float *h, const float *x2, float *x, int64_t t,
                   int n_threads, int isa) {
    const int hid = s->hidden, n_e = s->n_experts, k = s->n_experts_used;
    float *logits = work + l->logits, *wsel = work + l->wsel, *ys = work + l->ys, *m = work + l->m;
    int32_t *isel = (int32_t *)(work + l->isel), *order = (int32_t *)(work + l->order);
    int32_t *offs = (int32_t *)(work + l->offs), *active = (int32_t *)(work + l->active);
    int32_t *where = (int32_t *)(work + l->where);
    int st;
    if (!w->router || !w->exp_gate || !w->exp_up || !w->exp_down) return RINGSHM_KERNEL_ERR_SHAPE;
    if (s->shared_inter && (st = shared_expert(s, w, l, work, h, t, n_threads, isa))) return st;
    if ((st = ringshm_layer_mm(s, l, work, 0, w->type_router, w->router, w->router_bytes, n_e, hid, h, t, logits,
                               l->logits_w, w->router_bias, w->router_bias_len, NULL, 0, n_threads, isa)))
        return st;
    for (int64_t i = 0; i < t; i++)
        route_token(logits + i * l->logits_w, n_e, k, s->gating, work + l->p, wsel + i * k, isel + i * k);
    memset(offs, 0, sizeof(int32_t) * (size_t)(n_e + 1));
    for (int64_t i = 0; i < t * k; i++) offs[isel[i] + 1]++;
    for (int e = 0; e < n_e; e++) offs[e + 1] += offs[e];
    for (int64_t i = 0; i < t * k; i++) where[i] = offs[isel[i]]++, order[where[i]] = (int32_t)i;
    for (int e = n_e; e > 0; e--) offs[e] = offs[e - 1]; /* the fill moved every start one group on */
    offs[0] = 0;
    int n_active = 0;
    for (int e = 0; e < n_e; e++)
        if (offs[e + 1] > offs[e]) active[n_active++] = e;
    for (int a = 1; a < n_active; a++) { /* most rows first (ties: lower id), for the dynamic schedule */
        const int e = active[a];
        int b = a;
        for (; b > 0 && offs[active[b - 1] + 1] - offs[active[b - 1]] < offs[e + 1] - offs[e]; b--)
            active[b] = active[b - 1];
        active[b] = e;
    }
    if (n_threads > 1 && n_active >= n_threads) {
        int first = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(n_threads)
        for (int a = 0; a < n_active; a++) {
            const int e = active[a];
            const int rc = run_expert(s, w, l, work, h, e, offs[e], offs[e + 1] - offs[e], 1, isa);
            if (rc) {
#pragma omp critical(ringshm_moe_status)
                if (!first) first = rc;
            }
        }
        if (first) return first;
    } else {
        for (int a = 0; a < n_active; a++) {
            const int e = active[a];
            if ((st = run_expert(s, w, l, work, h, e, offs[e], offs[e + 1] - offs[e], n_threads, isa))) return st;
        }
    }
#pragma omp parallel for schedule(static) num_threads(n_threads > 1 ? n_threads : 1)
    for (int64_t i = 0; i < t; i++) { /* m = 0 + w y over the token's experts in ascending id, then x = x2 + m */
        int rank[RINGSHM_MAX_EXPERTS_USED];
        for (int r = 0; r < k; r++) { /* its ranks sorted by expert id (k is small: an insertion sort) */
            int b = r;
            for (; b > 0 && isel[i * k + rank[b - 1]] > isel[i * k + r]; b--) rank[b] = rank[b - 1];
            rank[b] = r;
        }
        float *row = m + i * hid;
        memset(row, 0, sizeof(float) * (size_t)hid);
        for (int q = 0; q < k; q++) {
            const int64_t pair = i * k + rank[q];
            const float wt = wsel[pair];
            const float *y = ys + (int64_t)where[pair] * hid;
            for (int j = 0; j < hid; j++) {
                const float term = wt * y[j];
                row[j] = row[j] + term;
            }
        }
        if (s->shared_inter) { /* the shared expert's term last, as transformers adds it after the routed sum */
            const float *y = work + l->sy + i * hid;
            if (s->shared_gate) {
                const float g = work[l->sg + i];
                for (int j = 0; j < hid; j++) {
                    const float term = g * y[j];
                    row[j] = row[j] + term;
                }
            } else {
                for (int j = 0; j < hid; j++) row[j] = row[j] + y[j];
            }
        }
        if (s->residual_scale != 1.0f)
            ringshm_add_scaled_rows(x + i * hid, x2 + i * hid, row, s->residual_scale, hid);
        else
            for (int j = 0; j < hid; j++) x[i * hid + j] = x2[i * hid + j] + row[j];
    }
    return RINGSHM_KERNEL_OK;
}
