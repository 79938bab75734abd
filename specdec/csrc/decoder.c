/* The decoder layers of a Llama/Qwen2-family model, one ragged pass, in C: the native forward of
 * specdec/worker/forward.py (native_forward) for models whose every projection runs on this
 * library's row kernels (int8_rows.c: int8-rows and the GGUF's Q4_K blocks).
 *
 * Per layer, for the n rows of the pass (sessions laid end to end, as batching.py's RaggedCache):
 *   x = rms_norm(h) * w_in;  q, k, v = x Wq, x Wk, x Wv (+ biases);  rotary positions on q and k;
 *   k and v written into each session's cache buffers after its past rows;
 *   each row's attention over its session's keys up to its own position (softmax(q k / sqrt(d)) v,
 *   query head j reading kv head j / (heads / kv_heads));
 *   h += o Wo;  x = rms_norm(h) * w_post;  h += (silu(x Wg) * x Wu) Wd;
 * then h = rms_norm(h) * w_final (the head stays in Python: a Linear like any other).
 *
 * Why: the same computation in torch ops costs ~35 dispatches a layer on 1536-wide vectors; on a
 * 2-core CPU that was ~8 ms of a 40 ms one-row target pass and ~6 of a 20 ms draft step.
 *
 * Exactness: every row is computed by the same sequence of operations whatever else the pass holds.
 * The projections are row-independent (int8_rows.c), and norms, rotary, softmax and the attention
 * sums here run per row (and per head) in one fixed order, in whichever thread: a k-row verify
 * computes bitwise what k one-row steps compute. The results are close to, not bitwise equal to,
 * transformers' float32 ops (other summation orders; exp by the polynomial of ggml's
 * ggml_v_expf, ~1.5 ulp, MIT licence, as llama.cpp computes it).
 *
 * Built with int8_rows.c into one library (kernels.py), with -ffp-contract=off: every multiply-add
 * below that fuses is written as one.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "specdec_kernels.h"

static int linear(const sd_linear *l, const float *x, int64_t M, float *y, int32_t threads) {
    if (l->kind == 1)
        return specdec_int8_rows_linear(x, M, l->K, (const int8_t *)l->w, l->Kp, l->N, (const int32_t *)l->aux,
                                        l->scale, l->bias, y, threads);
    if (l->kind == 2)
        return specdec_q4k_rows_linear(x, M, l->K, l->Kp, (const uint8_t *)l->w, (const uint8_t *)l->aux, l->N,
                                       l->bias, y, threads);
    return specdec_q6k_rows_linear(x, M, l->K, l->Kp, (const uint8_t *)l->w, (const uint8_t *)l->aux, l->N, l->bias,
                                   y, threads);
}

/* ggml's ggml_v_expf (llama.cpp, ggml/src/ggml-cpu/vec.h, MIT): exp of 8 floats, ~1.5 ulp. */
static inline __m256 v_expf(__m256 x) {
    const __m256 r = _mm256_set1_ps(0x1.8p23f);
    const __m256 z = _mm256_fmadd_ps(x, _mm256_set1_ps(0x1.715476p+0f), r);
    const __m256 n = _mm256_sub_ps(z, r);
    const __m256 b =
        _mm256_fnmadd_ps(n, _mm256_set1_ps(0x1.7f7d1cp-20f), _mm256_fnmadd_ps(n, _mm256_set1_ps(0x1.62e4p-1f), x));
    const __m256i e = _mm256_slli_epi32(_mm256_castps_si256(z), 23);
    const __m256 k = _mm256_castsi256_ps(_mm256_add_epi32(e, _mm256_castps_si256(_mm256_set1_ps(1))));
    const __m256i c =
        _mm256_castps_si256(_mm256_cmp_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.f), n), _mm256_set1_ps(126), _CMP_GT_OQ));
    const __m256 u = _mm256_mul_ps(b, b);
    const __m256 j = _mm256_fmadd_ps(
        _mm256_fmadd_ps(_mm256_fmadd_ps(_mm256_set1_ps(0x1.0e4020p-7f), b, _mm256_set1_ps(0x1.573e2ep-5f)), u,
                        _mm256_fmadd_ps(_mm256_set1_ps(0x1.555e66p-3f), b, _mm256_set1_ps(0x1.fffdb6p-2f))),
        u, _mm256_mul_ps(_mm256_set1_ps(0x1.ffffecp-1f), b));
    if (!_mm256_movemask_ps(_mm256_castsi256_ps(c))) return _mm256_fmadd_ps(j, k, k);
    const __m256i g = _mm256_and_si256(_mm256_castps_si256(_mm256_cmp_ps(n, _mm256_setzero_ps(), _CMP_LE_OQ)),
                                       _mm256_set1_epi32((int)0x82000000u));
    const __m256 s1 = _mm256_castsi256_ps(_mm256_add_epi32(g, _mm256_set1_epi32(0x7f000000)));
    const __m256 s2 = _mm256_castsi256_ps(_mm256_sub_epi32(e, g));
    const __m256i d =
        _mm256_castps_si256(_mm256_cmp_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.f), n), _mm256_set1_ps(192), _CMP_GT_OQ));
    return _mm256_or_ps(
        _mm256_and_ps(_mm256_castsi256_ps(d), _mm256_mul_ps(s1, s1)),
        _mm256_andnot_ps(_mm256_castsi256_ps(d),
                         _mm256_or_ps(_mm256_and_ps(_mm256_castsi256_ps(c), _mm256_mul_ps(_mm256_fmadd_ps(s2, j, s2), s1)),
                                      _mm256_andnot_ps(_mm256_castsi256_ps(c), _mm256_fmadd_ps(k, j, k)))));
}

static inline float expf_1(float x) { /* the same polynomial for one value (tails) */
    float in[8] = {x}, out[8];
    _mm256_storeu_ps(out, v_expf(_mm256_loadu_ps(in)));
    return out[0];
}

static inline float hsum8(__m256 v) { /* ((0+4)+(2+6))+((1+5)+(3+7)) */
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* y = x / sqrt(mean(x^2) + eps) * w, one row (y may be x) */
static void rms_norm(const float *x, const float *w, int64_t H, float eps, float *y) {
    __m256 acc = _mm256_setzero_ps();
    int64_t d = 0;
    for (; d + 8 <= H; d += 8) {
        __m256 v = _mm256_loadu_ps(x + d);
        acc = _mm256_fmadd_ps(v, v, acc);
    }
    float ss = hsum8(acc);
    for (; d < H; d++) ss += x[d] * x[d];
    const float r = 1.0f / sqrtf(ss / (float)H + eps);
    for (d = 0; d < H; d++) y[d] = w[d] * (x[d] * r);
}

/* rotate_half positions, as transformers' apply_rotary_pos_emb: (x * cos) + (rotate_half(x) * sin) */
static void rotary(float *x, const float *cos, const float *sin, int64_t hd) {
    const int64_t half = hd / 2;
    float t[512];
    for (int64_t d = 0; d < half; d++) t[d] = (x[d] * cos[d]) + (-x[d + half] * sin[d]);
    for (int64_t d = half; d < hd; d++) t[d] = (x[d] * cos[d]) + (x[d - half] * sin[d]);
    memcpy(x, t, sizeof(float) * (size_t)hd);
}

/* One query row of one head against L keys: out = softmax(q k * scaling) v. scores: L floats. */
static void attend(const float *q, const float *keys, const float *values, int64_t L, int64_t hd, float scaling,
                   float *scores, float *out) {
    float m = -INFINITY;
    for (int64_t j = 0; j < L; j++) {
        const float *k = keys + j * hd;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0;
        int64_t d = 0;
        for (; d + 16 <= hd; d += 16) {
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k + d), a0);
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d + 8), _mm256_loadu_ps(k + d + 8), a1);
        }
        for (; d + 8 <= hd; d += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k + d), a0);
        float s = hsum8(_mm256_add_ps(a0, a1));
        for (; d < hd; d++) s += q[d] * k[d];
        s *= scaling;
        scores[j] = s;
        m = s > m ? s : m;
    }
    __m256 vs = _mm256_setzero_ps();
    const __m256 vm = _mm256_set1_ps(m);
    int64_t j = 0;
    for (; j + 8 <= L; j += 8) {
        __m256 e = v_expf(_mm256_sub_ps(_mm256_loadu_ps(scores + j), vm));
        _mm256_storeu_ps(scores + j, e);
        vs = _mm256_add_ps(vs, e);
    }
    float sum = hsum8(vs);
    for (; j < L; j++) {
        scores[j] = expf_1(scores[j] - m);
        sum += scores[j];
    }
    const float inv = 1.0f / sum;
    float acc[512];
    memset(acc, 0, sizeof(float) * (size_t)hd);
    for (j = 0; j < L; j++) {
        const float *v = values + j * hd;
        const __m256 p = _mm256_set1_ps(scores[j] * inv);
        int64_t d = 0;
        for (; d + 8 <= hd; d += 8)
            _mm256_storeu_ps(acc + d, _mm256_fmadd_ps(p, _mm256_loadu_ps(v + d), _mm256_loadu_ps(acc + d)));
        for (; d < hd; d++) acc[d] += scores[j] * inv * v[d];
    }
    memcpy(out, acc, sizeof(float) * (size_t)hd);
}

/* y = silu(g) * u, in place into g */
static void silu_mul(float *g, const float *u, int64_t n) {
    const __m256 one = _mm256_set1_ps(1.0f), neg = _mm256_set1_ps(-0.0f);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 x = _mm256_loadu_ps(g + i);
        const __m256 s = _mm256_div_ps(x, _mm256_add_ps(one, v_expf(_mm256_xor_ps(x, neg))));
        _mm256_storeu_ps(g + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
    }
    for (; i < n; i++) g[i] = g[i] / (1.0f + expf_1(-g[i])) * u[i];
}

/* h: float32 [n, hidden], the embeddings in, the final-normed hidden states out; cos, sin: float32
 * [n, head_dim]; sessions: the pass's sessions in order, new[s] rows each after past[s] cached
 * ones; kv: [layers][sessions], each buffer with room for past + new rows. Returns 0, or -1
 * without scratch memory (nothing of the caches' past rows is touched either way; the rows after
 * them may hold part of this pass's keys, which the caller's views do not reach). aux: NULL, or
 * [n][n_aux][hidden], filled with the residual stream entering each layer of aux_layers (the
 * features an EAGLE-3 head reads). */
int specdec_decoder_pass(const sd_model *model, float *h, int64_t n, const float *cos, const float *sin,
                         int64_t sessions, const int64_t *new_rows, const int64_t *past, const sd_kv *kv, float eps,
                         float scaling, int32_t threads, int64_t n_aux, const int64_t *aux_layers, float *aux) {
    const int64_t H = model->hidden, hd = model->head_dim, heads = model->heads, kvh = model->kv_heads;
    const int64_t I = model->inter, qd = heads * hd, kd = kvh * hd, group = heads / kvh;
    if (hd > 512 || hd % 2) return -1; /* native_forward_fits never passes such a model */
    int64_t most = 0; /* the longest attention: keys of one row */
    for (int64_t s = 0; s < sessions; s++) most = past[s] + new_rows[s] > most ? past[s] + new_rows[s] : most;
    float *x = malloc(sizeof(float) * (size_t)(n * H)), *q = malloc(sizeof(float) * (size_t)(n * qd));
    float *k = malloc(sizeof(float) * (size_t)(n * kd)), *v = malloc(sizeof(float) * (size_t)(n * kd));
    float *att = malloc(sizeof(float) * (size_t)(n * qd)), *y = malloc(sizeof(float) * (size_t)(n * H));
    float *g = malloc(sizeof(float) * (size_t)(n * I)), *u = malloc(sizeof(float) * (size_t)(n * I));
    float *scores = malloc(sizeof(float) * (size_t)(most * (threads > 0 ? threads : 1)));
    int64_t *row_session = malloc(sizeof(int64_t) * (size_t)n), *row_index = malloc(sizeof(int64_t) * (size_t)n);
    int rc = -1;
    if (!x || !q || !k || !v || !att || !y || !g || !u || !scores || !row_session || !row_index) goto done;
    for (int64_t s = 0, r = 0; s < sessions; s++)
        for (int64_t i = 0; i < new_rows[s]; i++, r++) row_session[r] = s, row_index[r] = i;
    int64_t keys_total = 0; /* the attention's size, for the threading decision */
    for (int64_t r = 0; r < n; r++) keys_total += past[row_session[r]] + row_index[r] + 1;
    const int parallel = threads > 1 && keys_total * heads * hd >= 65536;

    for (int64_t l = 0; l < model->layers; l++) {
        const sd_layer *L = model->layer + l;
        const sd_kv *cache = kv + l * sessions;
        for (int64_t a = 0; a < n_aux; a++) /* the residual stream entering layer l: a feature head's input */
            if (aux_layers[a] == l)
                for (int64_t r = 0; r < n; r++) memcpy(aux + (r * n_aux + a) * H, h + r * H, sizeof(float) * H);
        for (int64_t r = 0; r < n; r++) rms_norm(h + r * H, L->in_norm, H, eps, x + r * H);
        if (linear(&L->q, x, n, q, threads) || linear(&L->k, x, n, k, threads) || linear(&L->v, x, n, v, threads))
            goto done;
        for (int64_t r = 0; r < n; r++) {
            const int64_t s = row_session[r], pos = past[s] + row_index[r];
            for (int64_t j = 0; j < heads; j++) rotary(q + r * qd + j * hd, cos + r * hd, sin + r * hd, hd);
            for (int64_t j = 0; j < kvh; j++) {
                rotary(k + r * kd + j * hd, cos + r * hd, sin + r * hd, hd);
                memcpy(cache[s].keys + (j * cache[s].capacity + pos) * hd, k + r * kd + j * hd, sizeof(float) * hd);
                memcpy(cache[s].values + (j * cache[s].capacity + pos) * hd, v + r * kd + j * hd, sizeof(float) * hd);
            }
        }
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (parallel)
        for (int64_t t = 0; t < n * heads; t++) {
            const int64_t r = t / heads, j = t % heads, s = row_session[r];
            const int64_t base = (j / group) * cache[s].capacity * hd;
            float *sc = scores + (parallel ? omp_get_thread_num() : 0) * most;
            attend(q + r * qd + j * hd, cache[s].keys + base, cache[s].values + base, past[s] + row_index[r] + 1, hd,
                   scaling, sc, att + r * qd + j * hd);
        }
        if (linear(&L->o, att, n, y, threads)) goto done;
        for (int64_t i = 0; i < n * H; i++) h[i] = h[i] + y[i];
        for (int64_t r = 0; r < n; r++) rms_norm(h + r * H, L->post_norm, H, eps, x + r * H);
        if (linear(&L->gate, x, n, g, threads) || linear(&L->up, x, n, u, threads)) goto done;
        silu_mul(g, u, n * I);
        if (linear(&L->down, g, n, y, threads)) goto done;
        for (int64_t i = 0; i < n * H; i++) h[i] = h[i] + y[i];
    }
    for (int64_t r = 0; r < n; r++) rms_norm(h + r * H, model->final_norm, H, eps, h + r * H);
    rc = 0;
done:
    free(x), free(q), free(k), free(v), free(att), free(y), free(g), free(u), free(scores);
    free(row_session), free(row_index);
    return rc;
}
