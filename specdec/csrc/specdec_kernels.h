/* The native library's entry points (int8_rows.c, decoder.c; built as one library by
 * specdec/native_build.py) and the structs its callers lay out: the one declaration of each. The
 * Python side's ctypes signatures (specdec/kernels.py, native_library) and struct layouts
 * (specdec/worker/forward.py) follow it; tests/specdec/test_native_build.py checks the signatures
 * against this file. Every function returns 0, or -1 where scratch memory could not be had. */
#ifndef SPECDEC_KERNELS_H
#define SPECDEC_KERNELS_H

#include <stdint.h>

/* 0: the best ISA this CPU has, 1: AVX2 only (tests and ablations). Returns the ISA now in use:
 * 1 AVX2, 2 AVX-512 VNNI. */
int specdec_native_isa(int32_t want);

/* y[M, N] = x[M, K] W^T + bias, int8 weights per channel (tiles of 4 x 32, K padded to Kp), int8
 * activations per row; wsum: each channel's sum of weights; ws: the channels' scales. */
int specdec_int8_rows_linear(const float *x, int64_t M, int64_t K, const int8_t *w, int64_t Kp, int64_t N,
                             const int32_t *wsum, const float *ws, const float *bias, float *y, int32_t threads);

/* The same on the GGUF's own Q4_K / Q6_K blocks (qs: the quants, meta: the scales and mins). */
int specdec_q4k_rows_linear(const float *x, int64_t M, int64_t K, int64_t Kp, const uint8_t *qs, const uint8_t *meta,
                            int64_t N, const float *bias, float *y, int32_t threads);
int specdec_q6k_rows_linear(const float *x, int64_t M, int64_t K, int64_t Kp, const uint8_t *qs, const uint8_t *meta,
                            int64_t N, const float *bias, float *y, int32_t threads);

/* One projection: the fields of kernels.py's Int8RowLinear (kind 1), Q4KRowLinear (2) or Q6KRowLinear (3), all
 * eight bytes wide (forward.py writes them as an int64 tensor). */
typedef struct {
    int64_t kind, K, N, Kp;
    const void *w;      /* int8 tiles | Q4_K or Q6_K qs */
    const void *aux;    /* int32 channel sums | Q4_K or Q6_K meta */
    const float *scale; /* int8: one per channel | unused */
    const float *bias;  /* or NULL */
} sd_linear;

typedef struct {
    const float *in_norm, *post_norm;
    sd_linear q, k, v, o, gate, up, down;
} sd_layer;

typedef struct {
    int64_t layers, hidden, heads, kv_heads, head_dim, inter;
    const float *final_norm;
    const sd_layer *layer;
} sd_model;

/* one session's buffers in one layer: [kv_heads][capacity][head_dim] keys and values */
typedef struct {
    float *keys, *values;
    int64_t capacity;
} sd_kv;

/* The decoder layers of one ragged pass (decoder.c): h [n, hidden] the embeddings in, the
 * final-normed hidden states out; sessions in order, new_rows[s] rows each after past[s] cached
 * ones; kv: [layers][sessions]. */
int specdec_decoder_pass(const sd_model *model, float *h, int64_t n, const float *cos, const float *sin,
                         int64_t sessions, const int64_t *new_rows, const int64_t *past, const sd_kv *kv, float eps,
                         float scaling, int32_t threads, int64_t n_aux, const int64_t *aux_layers, float *aux);

#endif
