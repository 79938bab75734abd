/* int8 weights (one scale per output channel) x int8 activations (one scale per row), int32 sums,
 * for x86-64 with AVX2: the native backend of specdec/kernels.py's Int8RowLinear.
 *
 * y[m, n] = ((float) sum_k q[m, k] * w[n, k]) * ws[n] * s[m] + bias[n]
 *
 * where row m of x is quantized here, on its own: s[m] = max|x[m]| / 127,
 * q[m, k] = round_half_even(x[m, k] * (127 / max|x[m]|)), exactly as quantize_rows in kernels.py.
 * The sums are integer sums (exact in any order), and each output's epilogue reads only its own
 * row and channel: a row's result is the same bits whatever other rows the call holds, so a
 * verify pass of k positions computes exactly what k one-row steps compute.
 *
 * Products: _mm256_maddubs_epi16(|x|, w * sign(x)) sums two u8 x s8 products into int16; with
 * |x| <= 127 and |w| <= 127 a pair is at most 32258 < 32767, so nothing saturates (fbgemm's
 * AVX2 path has no such bound on its u8 activations and must drop them to 7 bits).
 *
 * Weights are stored in tiles of TILE output channels, interleaved by 32 columns: for each 32 of
 * the Kp columns (K rounded up to 32), channel 0's 32 bytes, channel 1's, ... so that one tile is
 * one sequential stream; N is padded to a multiple of TILE, the padding zero (kernels.py's
 * native_tiles writes this layout).
 *
 * AVX-512 VNNI (where the CPU has it: Zen 4, Ice Lake and later; chosen at run time, AVX2 else):
 * vpdpbusd sums four u8 x s8 products into int32 in one instruction, with no int16 step to
 * saturate. Activations go in as u = q + 128 (q XOR 0x80: 0..254), so each sum is
 * sum (q + 128) w = sum q w + 128 sum w, and 128 * wsum[n] (sum of channel n's weights, computed
 * once at packing) is taken off: the same integers as the AVX2 path, so the same output bits.
 * One zmm holds two channels' 32 bytes; up to four rows share each weight load.
 *
 * Threads: OpenMP over tiles. Built with -fopenmp against the libgomp.so.1 that torch has already
 * loaded, so these regions run on torch's own thread team.
 * Build: cc -O3 -mavx2 -mfma -ffp-contract=off -fopenmp -fPIC -shared (kernels.py does it once per
 * source and caches the library).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "specdec_kernels.h"

#define TILE 4           /* output channels per tile: one accumulator each, per row */
#define PREFETCH 1024    /* bytes ahead in the tile's stream */

static inline int32_t hsum_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(s);
}

/* One row: q (Kp bytes, zero padded) and the returned scale s = amax / 127. Each byte is stored
 * XOR flip: 0 gives q itself, 0x80 gives u = q + 128 as unsigned (the VNNI path's operand). */
static float quantize_row(const float *x, int64_t K, int64_t Kp, int8_t *q, uint8_t flip) {
    float amax = 0.0f;
    for (int64_t k = 0; k < K; k++) {
        float a = fabsf(x[k]);
        amax = a > amax ? a : amax;
    }
    if (!(amax >= 1e-30f)) amax = 1e-30f;
    const float inv = 127.0f / amax;
    int64_t k = 0;
    const __m256 vinv = _mm256_set1_ps(inv);
    for (; k + 8 <= K; k += 8) {
        __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + k), vinv);
        v = _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); /* half to even */
        int32_t tmp[8];
        _mm256_storeu_si256((__m256i *)tmp, _mm256_cvtps_epi32(v));
        for (int j = 0; j < 8; j++) q[k + j] = (int8_t)((uint8_t)tmp[j] ^ flip);
    }
    for (; k < K; k++) q[k] = (int8_t)((uint8_t)(int8_t)nearbyintf(x[k] * inv) ^ flip);
    memset(q + K, flip, (size_t)(Kp - K));
    return amax / 127.0f;
}

#define MAC(acc, ax, xv, wv) \
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(wv, xv)), ones))

/* One quantized row against one tile. */
static inline void tile_1(const int8_t *q, int64_t Kp, const int8_t *w, int32_t out[TILE]) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t k = 0; k < Kp; k += 32, w += 32 * TILE) {
        _mm_prefetch((const char *)(w + PREFETCH), _MM_HINT_T0);
        _mm_prefetch((const char *)(w + PREFETCH + 64), _MM_HINT_T0);
        const __m256i x = _mm256_load_si256((const __m256i *)(q + k));
        const __m256i ax = _mm256_sign_epi8(x, x);
        MAC(a0, ax, x, _mm256_load_si256((const __m256i *)w));
        MAC(a1, ax, x, _mm256_load_si256((const __m256i *)(w + 32)));
        MAC(a2, ax, x, _mm256_load_si256((const __m256i *)(w + 64)));
        MAC(a3, ax, x, _mm256_load_si256((const __m256i *)(w + 96)));
    }
    out[0] = hsum_epi32(a0);
    out[1] = hsum_epi32(a1);
    out[2] = hsum_epi32(a2);
    out[3] = hsum_epi32(a3);
}

/* Two quantized rows against one tile: each weight vector loaded once for both. The sums are the
 * same integers tile_1 gives for each row alone. */
static inline void tile_2(const int8_t *q, const int8_t *r, int64_t Kp, const int8_t *w, int32_t out[2 * TILE]) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
    for (int64_t k = 0; k < Kp; k += 32, w += 32 * TILE) {
        _mm_prefetch((const char *)(w + PREFETCH), _MM_HINT_T0);
        _mm_prefetch((const char *)(w + PREFETCH + 64), _MM_HINT_T0);
        const __m256i x = _mm256_load_si256((const __m256i *)(q + k));
        const __m256i ax = _mm256_sign_epi8(x, x);
        const __m256i z = _mm256_load_si256((const __m256i *)(r + k));
        const __m256i az = _mm256_sign_epi8(z, z);
        __m256i v;
        v = _mm256_load_si256((const __m256i *)w);
        MAC(a0, ax, x, v);
        MAC(b0, az, z, v);
        v = _mm256_load_si256((const __m256i *)(w + 32));
        MAC(a1, ax, x, v);
        MAC(b1, az, z, v);
        v = _mm256_load_si256((const __m256i *)(w + 64));
        MAC(a2, ax, x, v);
        MAC(b2, az, z, v);
        v = _mm256_load_si256((const __m256i *)(w + 96));
        MAC(a3, ax, x, v);
        MAC(b3, az, z, v);
    }
    out[0] = hsum_epi32(a0);
    out[1] = hsum_epi32(a1);
    out[2] = hsum_epi32(a2);
    out[3] = hsum_epi32(a3);
    out[4] = hsum_epi32(b0);
    out[5] = hsum_epi32(b1);
    out[6] = hsum_epi32(b2);
    out[7] = hsum_epi32(b3);
}

static inline void store(float *y, int64_t N, int64_t n0, int64_t nc, const int32_t *sums, const float *ws,
                         float s, const float *bias) {
    for (int64_t c = 0; c < nc; c++) {
        float v = (float)sums[c] * ws[n0 + c];
        v = v * s;
        if (bias != NULL) v = v + bias[n0 + c];
        y[n0 + c] = v;
    }
    (void)N;
}

#define VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))

/* Four lanes' sums of a [ch | ch'] accumulator: the low 256 bits are one channel, the high the next. */
VNNI static inline void hsum2_vnni(__m512i v, int32_t *lo, int32_t *hi) {
    *lo = hsum_epi32(_mm512_castsi512_si256(v));
    *hi = hsum_epi32(_mm512_extracti64x4_epi64(v, 1));
}

/* R (1..4) rows of u = q + 128 against one tile: out[r * TILE + c] = sum_k u[r, k] w[c, k]. */
VNNI static inline void tile_vnni(const uint8_t *u, int64_t R, int64_t Kp, const int8_t *w, int32_t *out) {
    __m512i a[4][2];
    for (int r = 0; r < 4; r++) a[r][0] = a[r][1] = _mm512_setzero_si512();
    for (int64_t k = 0; k < Kp; k += 32, w += 32 * TILE) {
        _mm_prefetch((const char *)(w + PREFETCH), _MM_HINT_T0);
        _mm_prefetch((const char *)(w + PREFETCH + 64), _MM_HINT_T0);
        const __m512i w01 = _mm512_loadu_si512((const void *)w);
        const __m512i w23 = _mm512_loadu_si512((const void *)(w + 64));
#define ROW(r)                                                                                          \
    if ((r) < R) {                                                                                      \
        const __m512i x = _mm512_broadcast_i64x4(_mm256_load_si256((const __m256i *)(u + (r) * Kp + k))); \
        a[r][0] = _mm512_dpbusd_epi32(a[r][0], x, w01);                                                 \
        a[r][1] = _mm512_dpbusd_epi32(a[r][1], x, w23);                                                 \
    }
        ROW(0) ROW(1) ROW(2) ROW(3)
#undef ROW
    }
    for (int64_t r = 0; r < R; r++) {
        hsum2_vnni(a[r][0], out + r * TILE, out + r * TILE + 1);
        hsum2_vnni(a[r][1], out + r * TILE + 2, out + r * TILE + 3);
    }
}

VNNI static void linear_vnni(const uint8_t *u, const float *s, int64_t M, int64_t Kp, const int8_t *w,
                             const int32_t *wsum, int64_t N, const float *ws, const float *bias, float *y,
                             int32_t threads) {
    const int64_t tiles = (N + TILE - 1) / TILE;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && N >= 64)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t n0 = t * TILE;
        const int64_t nc = N - n0 < TILE ? N - n0 : TILE;
        for (int64_t m = 0; m < M; m += 4) {
            const int64_t R = M - m < 4 ? M - m : 4;
            int32_t sums[4 * TILE];
            tile_vnni(u + m * Kp, R, Kp, w + n0 * Kp, sums);
            for (int64_t r = 0; r < R; r++) {
                for (int c = 0; c < TILE; c++) sums[r * TILE + c] -= 128 * wsum[n0 + c];
                store(y + (m + r) * N, N, n0, nc, sums + r * TILE, ws, s[m + r], bias);
            }
        }
    }
}

static int use_vnni = -1; /* -1: not decided yet; specdec_native_isa sets it */

/* 0: the best this CPU has, 1: AVX2 only (tests and ablations). Returns the ISA now in use:
 * 1 AVX2, 2 AVX-512 VNNI. */
int specdec_native_isa(int32_t want) {
    __builtin_cpu_init();
    use_vnni = want == 0 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
    return use_vnni ? 2 : 1;
}

/* x: float32 [M, K] (rows contiguous); w: tiles as above, 32-byte aligned; wsum: int32 [Np], each
 * channel's sum of weights (the VNNI path's offset); ws: float32 [N]; bias: float32 [N] or NULL;
 * y: float32 [M, N]. Returns 0, or -1 if scratch memory could not be had. */
int specdec_int8_rows_linear(const float *x, int64_t M, int64_t K, const int8_t *w, int64_t Kp, int64_t N,
                             const int32_t *wsum, const float *ws, const float *bias, float *y, int32_t threads) {
    if (use_vnni < 0) specdec_native_isa(0);
    int8_t *q = (int8_t *)aligned_alloc(64, (size_t)((M * Kp + 63) / 64 * 64));
    float *s = (float *)malloc(sizeof(float) * (size_t)M);
    if (q == NULL || s == NULL) {
        free(q);
        free(s);
        return -1;
    }
    for (int64_t m = 0; m < M; m++) s[m] = quantize_row(x + m * K, K, Kp, q + m * Kp, use_vnni ? 0x80 : 0);
    if (use_vnni) { /* q holds u = q + 128 */
        linear_vnni((const uint8_t *)q, s, M, Kp, w, wsum, N, ws, bias, y, threads);
        free(q);
        free(s);
        return 0;
    }
    const int64_t tiles = (N + TILE - 1) / TILE;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && N >= 64)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t n0 = t * TILE;
        const int64_t nc = N - n0 < TILE ? N - n0 : TILE;
        const int8_t *wt = w + n0 * Kp;
        int64_t m = 0;
        for (; m + 2 <= M; m += 2) {
            int32_t sums[2 * TILE];
            tile_2(q + m * Kp, q + (m + 1) * Kp, Kp, wt, sums);
            store(y + m * N, N, n0, nc, sums, ws, s[m], bias);
            store(y + (m + 1) * N, N, n0, nc, sums + TILE, ws, s[m + 1], bias);
        }
        if (m < M) {
            int32_t sums[TILE];
            tile_1(q + m * Kp, Kp, wt, sums);
            store(y + m * N, N, n0, nc, sums, ws, s[m], bias);
        }
    }
    free(q);
    free(s);
    return 0;
}

/* ---- int4-rows: the GGUF's own Q4_K blocks x int8 activations per row ------------------------
 *
 * A Q4_K super-block covers 256 columns of one output channel, in 8 sub-blocks i of 32:
 * w[k] = d * sc[i] * u[k] - dmin * mn[i], with u in 0..15, sc and mn 6-bit integers, d and dmin
 * float16 (ggml's block_q4_K; the numbers llama.cpp computes with). With row m quantized as above
 * (q, s[m]) and qsum[m, i] the integer sum of its q over sub-block i:
 *
 * y[m, n] = s[m] * (sum_b d_b * sum_i sc_i P_bi - sum_b dmin_b * J_b) + bias[n]
 * P_bi = sum_{k in sub-block i} q[m, k] u[n, k],   J_b = sum_i mn_i * qsum[m, i]
 *
 * Weights are repacked so that lane i of a 256-bit vector holds 4 columns of sub-block i: step t
 * (0..7) holds columns 32i + 4t .. 32i + 4t + 3 of every sub-block, and the row's activations are
 * laid out the same way (q4k_steps). Eight steps of 4-byte dot products (vpdpbusd, or vpmaddubsw +
 * vpmaddwd on AVX2: the same integers, |q u| <= 1905) leave P_bi whole in lane i, one vpmulld by
 * the 8 scales makes it sc_i P_bi (|.| <= 3.9e6: exact in float), and one float step a super-block
 * adds d_b times it: two multiplies a 32-byte step and row where a scale per 32 columns would
 * take three. The float steps run in one fixed order per row and channel (eight lanes in
 * super-block order, four of dmin_b * J_b, then fixed trees), whatever else the call holds: rows
 * bitwise independent, as int8-rows, and the AVX2 and VNNI paths give the same bits.
 *
 * Layout (kernels.py's Q4KRowLinear writes it): tiles of QTILE channels (N padded), each one
 * sequential stream, super-block by super-block: qs [N/8][K/256][8][4][32] bytes, byte 4i + j of
 * vector v holding step 2v's column in its low nibble and step 2v+1's in its high one; meta
 * [N/8][K/256][8][20]: sc[8], mn[8] as bytes, then d and dmin as float16 bits.
 */

#define QK 256
#define QMETA 20

static inline float hsum8_ps(__m256 v) { /* ((0+4)+(2+6))+((1+5)+(3+7)) */
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float hsum4_ps(__m128 s) {
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float half_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* ROWn(r, body): body n times, with r = 0 .. n - 1 as a constant */
#define ROW1(r, body) { enum { r = 0 }; body }
#define ROW2(r, body) ROW1(r, body) { enum { r = 1 }; body }
#define ROW3(r, body) ROW2(r, body) { enum { r = 2 }; body }
#define ROW4(r, body) ROW3(r, body) { enum { r = 3 }; body }
#define ROW5(r, body) ROW4(r, body) { enum { r = 4 }; body }
#define ROW6(r, body) ROW5(r, body) { enum { r = 5 }; body }
#define ROW7(r, body) ROW6(r, body) { enum { r = 6 }; body }
#define ROW8(r, body) ROW7(r, body) { enum { r = 7 }; body }

/* RMAX rows (q: int8 [RMAX][K] in step order at stride K; qsum: int16 [RMAX][K/32]) against the
 * first nc (<= QTILE) channels of one tile (qs, meta: the tile's), super-block by super-block, so
 * that a super-block's activations (RMAX x 256 bytes) serve every channel of the tile from L1:
 * out[c * RMAX + r] = sum_b d_b sum_i sc_i P_bi - sum_b dmin_b J_b for channel c and row r, each
 * channel's floats in super-block order whatever the tile. DOT4(acc, u, x): acc + the 4-byte dot
 * products of u (unsigned) and x (signed) in each lane. One function per row count (Q4K_KERNELS):
 * with the count a constant every row's sums stay in registers (10-15% faster at 1-6 rows than
 * one function for up to 8 rows), and the low and high nibbles' products go to two chains (a, e:
 * their sum is the same integer P_bi) so that a row's dot products do not wait on each other. */
#define QTILE 8
#define Q4K_TILE(NAME, ATTR, RMAX, ROWS, DOT4)                                                             \
    ATTR static void NAME(const int8_t *q, const void *sums, int64_t K, const uint8_t *qs,                  \
                          const uint8_t *meta, int64_t nb, int64_t nc, float *out) {                       \
        const int16_t *qsum = (const int16_t *)sums;                                                       \
        const __m256i low = _mm256_set1_epi8(0x0F);                                                        \
        __m256 f[QTILE][RMAX];                                                                             \
        for (int c = 0; c < QTILE; c++)                                                                    \
            for (int r = 0; r < RMAX; r++) f[c][r] = _mm256_setzero_ps();                                  \
        for (int64_t b = 0; b < nb; b++) {                                                                 \
            const int8_t *xq = q + b * QK;                                                                 \
            for (int64_t c = 0; c < nc; c++) {                                                             \
                const uint8_t *w = qs + (b * QTILE + c) * 128, *mt = meta + (b * QTILE + c) * QMETA;       \
                _mm_prefetch((const char *)(w + PREFETCH), _MM_HINT_T0);                                   \
                _mm_prefetch((const char *)(w + PREFETCH + 64), _MM_HINT_T0);                              \
                __m256i a[RMAX], e[RMAX];                                                                  \
                for (int r = 0; r < RMAX; r++) a[r] = e[r] = _mm256_setzero_si256();                       \
                for (int v = 0; v < 4; v++) {                                                              \
                    const __m256i wv = _mm256_loadu_si256((const __m256i *)(w + 32 * v));                  \
                    const __m256i lo = _mm256_and_si256(wv, low);                                          \
                    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(wv, 4), low);                    \
                    ROWS(r, {                                                                              \
                        a[r] = DOT4(a[r], lo, _mm256_loadu_si256((const __m256i *)(xq + (r) * K + 64 * v))); \
                        e[r] = DOT4(e[r], hi, _mm256_loadu_si256((const __m256i *)(xq + (r) * K + 64 * v + 32))); \
                    })                                                                                     \
                }                                                                                          \
                const __m256i sc = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)mt));             \
                const __m256 d = _mm256_set1_ps(half_at(mt + 16));                                         \
                ROWS(r, f[c][r] = _mm256_fmadd_ps(                                                         \
                    _mm256_cvtepi32_ps(_mm256_mullo_epi32(_mm256_add_epi32(a[r], e[r]), sc)), d, f[c][r]);) \
            }                                                                                              \
        }                                                                                                  \
        const int64_t G = K / 32;                                                                          \
        for (int64_t c = 0; c < nc; c++) { /* the offsets: J_b from the channel's meta */                  \
            __m128 g[RMAX];                                                                                \
            for (int r = 0; r < RMAX; r++) g[r] = _mm_setzero_ps();                                        \
            const uint8_t *mt = meta + c * QMETA;                                                          \
            for (int64_t b = 0; b < nb; b++, mt += QTILE * QMETA) {                                        \
                const __m128i mn = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(mt + 8)));          \
                const __m128 dmin = _mm_set1_ps(half_at(mt + 18));                                         \
                ROWS(r, g[r] = _mm_fmadd_ps(                                                               \
                    _mm_cvtepi32_ps(_mm_madd_epi16(mn, _mm_loadu_si128((const __m128i *)(qsum + (r) * G + 8 * b)))), dmin, g[r]);) \
            }                                                                                              \
            for (int r = 0; r < RMAX; r++) out[c * RMAX + r] = hsum8_ps(f[c][r]) - hsum4_ps(g[r]);         \
        }                                                                                                  \
    }

#define DOT4_AVX2(acc, u, x) _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1)))
#define DOT4_VNNI(acc, u, x) _mm256_dpbusd_epi32(acc, u, x)
/* one function per row count: NAME_1 .. NAME_4 (and NAME_5 .. NAME_8 for the VNNI path), and a
 * table of them by row count */
typedef void (*blocks_tile_fn)(const int8_t *, const void *, int64_t, const uint8_t *, const uint8_t *, int64_t,
                               int64_t, float *);
#define KERNELS4(TILE, NAME, ATTR, DOT4) TILE(NAME##_1, ATTR, 1, ROW1, DOT4) TILE(NAME##_2, ATTR, 2, ROW2, DOT4) \
    TILE(NAME##_3, ATTR, 3, ROW3, DOT4) TILE(NAME##_4, ATTR, 4, ROW4, DOT4)
#define KERNELS8(TILE, NAME, ATTR, DOT4) KERNELS4(TILE, NAME, ATTR, DOT4) TILE(NAME##_5, ATTR, 5, ROW5, DOT4) \
    TILE(NAME##_6, ATTR, 6, ROW6, DOT4) TILE(NAME##_7, ATTR, 7, ROW7, DOT4) TILE(NAME##_8, ATTR, 8, ROW8, DOT4)
#define TABLE4(NAME) {NULL, NAME##_1, NAME##_2, NAME##_3, NAME##_4}
#define TABLE8(NAME) {NULL, NAME##_1, NAME##_2, NAME##_3, NAME##_4, NAME##_5, NAME##_6, NAME##_7, NAME##_8}
KERNELS4(Q4K_TILE, q4k_tile_avx2, , DOT4_AVX2)
KERNELS8(Q4K_TILE, q4k_tile_vnni, VNNI, DOT4_VNNI)
static const blocks_tile_fn q4k_avx2[5] = TABLE4(q4k_tile_avx2), q4k_vnni[9] = TABLE8(q4k_tile_vnni);

/* A row's super-blocks in step order: [256] as [8 sub-blocks][8 steps][4] -> [8 steps][8 sub-blocks][4]. */
static void q4k_steps(const int8_t *q, int64_t K, int8_t *out) {
    for (int64_t b = 0; b < K; b += QK)
        for (int t = 0; t < 8; t++)
            for (int i = 0; i < 8; i++) memcpy(out + b + 32 * t + 4 * i, q + b + 32 * i + 4 * t, 4);
}


/* ---- int4-rows' other half: the GGUF's own Q6_K blocks x int8 activations per row ------------
 *
 * A Q6_K super-block covers 256 columns of one channel in 16 sub-blocks j of 16:
 * w[k] = d * sc[j] * (u[k] - 32), u in 0..63, sc a signed byte, d float16 (ggml's block_q6_K). With
 * row m quantized as above (q, s[m]) and X[m, j] the integer sum of its q over sub-block j:
 *
 * y[m, n] = s[m] * sum_b d_b * T_b + bias[n],   T_b = sum_j sc_j (P_bj - 32 X_bj),
 * P_bj = sum_{k in sub-block j} q[m, k] u[n, k]
 *
 * all integer up to d_b (|P - 32 X| <= 193040, |T_b| < 4e8: exact in int32). Each half of a
 * super-block (8 sub-blocks, 128 columns) is four steps of 4 columns of each sub-block (lane i of
 * a vector: sub-block i of the half), as Q4_K's; the row's activations are laid out the same way
 * (q6k_steps). One float step a super-block per row and channel (d_b times T_b's eight lanes), in
 * super-block order, then a fixed tree: rows bitwise independent, the AVX2 and VNNI paths the same
 * bits.
 *
 * Layout (kernels.py's Q6KRowLinear writes it): tiles of QTILE channels, super-block by
 * super-block: qs [N/8][K/256][8][192]: four vectors of 32 bytes, vector t holding step t of the
 * first half in its low nibbles and step t of the second half in its high ones, then two vectors
 * of the values' top two bits (vector h for half h, step t in bits 2t, 2t + 1); meta
 * [N/8][K/256][8][20]: sc[16] as bytes, d as float16 bits, two bytes unused.
 */

#define Q6META 20
#define Q6K_TILE(NAME, ATTR, RMAX, ROWS, DOT4)                                                             \
    ATTR static void NAME(const int8_t *q, const void *sums, int64_t K, const uint8_t *qs,                  \
                          const uint8_t *meta, int64_t nb, int64_t nc, float *out) {                       \
        const int32_t *xsum = (const int32_t *)sums;                                                       \
        const __m256i low = _mm256_set1_epi8(0x0F), three = _mm256_set1_epi8(3);                           \
        const int64_t G = K / 16;                                                                          \
        __m256 f[QTILE][RMAX];                                                                             \
        for (int c = 0; c < QTILE; c++)                                                                    \
            for (int r = 0; r < RMAX; r++) f[c][r] = _mm256_setzero_ps();                                  \
        for (int64_t b = 0; b < nb; b++) {                                                                 \
            const int8_t *xq = q + b * QK;                                                                 \
            for (int64_t c = 0; c < nc; c++) {                                                             \
                const uint8_t *w = qs + (b * QTILE + c) * 192, *mt = meta + (b * QTILE + c) * Q6META;      \
                _mm_prefetch((const char *)(w + PREFETCH), _MM_HINT_T0);                                   \
                _mm_prefetch((const char *)(w + PREFETCH + 64), _MM_HINT_T0);                              \
                _mm_prefetch((const char *)(w + PREFETCH + 128), _MM_HINT_T0);                             \
                __m256i a[RMAX], e[RMAX];                                                                  \
                for (int r = 0; r < RMAX; r++) a[r] = e[r] = _mm256_setzero_si256();                       \
                const __m256i h0 = _mm256_loadu_si256((const __m256i *)(w + 128));                         \
                const __m256i h1 = _mm256_loadu_si256((const __m256i *)(w + 160));                         \
                Q6K_STEP(0, ROWS, DOT4) Q6K_STEP(1, ROWS, DOT4)                                            \
                Q6K_STEP(2, ROWS, DOT4) Q6K_STEP(3, ROWS, DOT4)                                            \
                const __m128i s16 = _mm_loadu_si128((const __m128i *)mt);                                  \
                const __m256i sa = _mm256_cvtepi8_epi32(s16), sb = _mm256_cvtepi8_epi32(_mm_srli_si128(s16, 8)); \
                const __m256 d = _mm256_set1_ps(half_at(mt + 16));                                         \
                ROWS(r, {                                                                                  \
                    const int32_t *xs = xsum + (r) * G + 16 * b;                                           \
                    const __m256i ta = _mm256_mullo_epi32(_mm256_sub_epi32(a[r], _mm256_slli_epi32(        \
                        _mm256_loadu_si256((const __m256i *)xs), 5)), sa);                                 \
                    const __m256i tb = _mm256_mullo_epi32(_mm256_sub_epi32(e[r], _mm256_slli_epi32(        \
                        _mm256_loadu_si256((const __m256i *)(xs + 8)), 5)), sb);                           \
                    f[c][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(ta, tb)), d, f[c][r]);   \
                })                                                                                         \
            }                                                                                              \
        }                                                                                                  \
        for (int64_t c = 0; c < nc; c++)                                                                   \
            for (int r = 0; r < RMAX; r++) out[c * RMAX + r] = hsum8_ps(f[c][r]);                          \
    }
/* step t of both halves: the 6-bit values (low nibbles | top bits << 4), times the row's activations */
#define Q6K_STEP(t, ROWS, DOT4)                                                                                      \
    {                                                                                                      \
        const __m256i wv = _mm256_loadu_si256((const __m256i *)(w + 32 * (t)));                            \
        const __m256i ua = _mm256_or_si256(_mm256_and_si256(wv, low),                                      \
                                           _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h0, 2 * (t)), three), 4)); \
        const __m256i ub = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(wv, 4), low),                \
                                           _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h1, 2 * (t)), three), 4)); \
        ROWS(r, {                                                                                          \
            a[r] = DOT4(a[r], ua, _mm256_loadu_si256((const __m256i *)(xq + (r) * K + 32 * (t))));         \
            e[r] = DOT4(e[r], ub, _mm256_loadu_si256((const __m256i *)(xq + (r) * K + 128 + 32 * (t))));   \
        })                                                                                                 \
    }
KERNELS4(Q6K_TILE, q6k_tile_avx2, , DOT4_AVX2)
KERNELS8(Q6K_TILE, q6k_tile_vnni, VNNI, DOT4_VNNI)
static const blocks_tile_fn q6k_avx2[5] = TABLE4(q6k_tile_avx2), q6k_vnni[9] = TABLE8(q6k_tile_vnni);

/* A row's super-blocks in step order: each half [8 sub-blocks][4 steps][4] -> [4 steps][8 sub-blocks][4]. */
static void q6k_steps(const int8_t *q, int64_t K, int8_t *out) {
    for (int64_t b = 0; b < K; b += 128)
        for (int t = 0; t < 4; t++)
            for (int i = 0; i < 8; i++) memcpy(out + b + 32 * t + 4 * i, q + b + 16 * i + 4 * t, 4);
}

/* ---- the two block formats' entry points -------------------------------------------------------
 *
 * x: float32 [M, Kx]; qs, meta: Q4_K's or Q6_K's layout above for K = Kp columns, a multiple of 256
 * (Kx <= K: a width that is no multiple of 256 has blocks for its padding, whose activations are
 * zero here); bias: float32 [N] or NULL; y: float32 [M, N]. Each row is quantized here
 * (quantize_row), its integer sums per sub-block taken (32 columns for Q4_K, as int16; 16 for
 * Q6_K, as int32) and laid out in step order; then OpenMP over tiles, up to 4 rows (8 on the VNNI
 * path) a pass over a tile's weights, by the kernel for that many rows.
 * Returns 0, or -1 without scratch memory. */
static int blocks_rows_linear(int q6, const float *x, int64_t M, int64_t Kx, int64_t K, const uint8_t *qs,
                              const uint8_t *meta, int64_t N, const float *bias, float *y, int32_t threads) {
    if (use_vnni < 0) specdec_native_isa(0);
    const int64_t width = q6 ? 16 : 32, G = K / width, nb = K / QK;
    const int64_t tile_qs = nb * QTILE * (q6 ? 192 : 128), tile_meta = nb * QTILE * (q6 ? Q6META : QMETA);
    int8_t *q = (int8_t *)aligned_alloc(64, (size_t)((M * K + 63) / 64 * 64));
    int8_t *xq = (int8_t *)aligned_alloc(64, (size_t)((M * K + 63) / 64 * 64));
    void *sums = malloc((q6 ? sizeof(int32_t) : sizeof(int16_t)) * (size_t)(M * G));
    float *s = (float *)malloc(sizeof(float) * (size_t)M);
    if (q == NULL || xq == NULL || sums == NULL || s == NULL) {
        free(q);
        free(xq);
        free(sums);
        free(s);
        return -1;
    }
    for (int64_t m = 0; m < M; m++) {
        s[m] = quantize_row(x + m * Kx, Kx, K, q + m * K, 0);
        for (int64_t j = 0; j < G; j++) {
            int32_t t = 0;
            for (int64_t i = 0; i < width; i++) t += q[m * K + width * j + i];
            if (q6)
                ((int32_t *)sums)[m * G + j] = t;
            else
                ((int16_t *)sums)[m * G + j] = (int16_t)t;
        }
        (q6 ? q6k_steps : q4k_steps)(q + m * K, K, xq + m * K);
    }
    const int vnni = use_vnni;
    const int64_t block = vnni ? 8 : 4; /* rows a pass over a tile's weights */
    const int64_t tiles = (N + QTILE - 1) / QTILE;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && N >= 64)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t n0 = t * QTILE, nc = N - n0 < QTILE ? N - n0 : QTILE;
        const uint8_t *wq = qs + t * tile_qs, *wm = meta + t * tile_meta;
        for (int64_t m = 0; m < M; m += block) {
            const int64_t R = M - m < block ? M - m : block;
            float out[QTILE * 8];
            const blocks_tile_fn tile = (q6 ? (vnni ? q6k_vnni : q6k_avx2) : (vnni ? q4k_vnni : q4k_avx2))[R];
            tile(xq + m * K, q6 ? (const void *)((const int32_t *)sums + m * G) : (const void *)((const int16_t *)sums + m * G),
                 K, wq, wm, nb, nc, out); /* each row's sums per sub-block: Q6_K's int32, Q4_K's int16 */
            for (int64_t c = 0; c < nc; c++)
                for (int64_t r = 0; r < R; r++) {
                    float v = out[c * R + r] * s[m + r];
                    if (bias != NULL) v = v + bias[n0 + c];
                    y[(m + r) * N + n0 + c] = v;
                }
        }
    }
    free(q);
    free(xq);
    free(sums);
    free(s);
    return 0;
}

int specdec_q4k_rows_linear(const float *x, int64_t M, int64_t K, int64_t Kp, const uint8_t *qs, const uint8_t *meta,
                            int64_t N, const float *bias, float *y, int32_t threads) {
    return blocks_rows_linear(0, x, M, K, Kp, qs, meta, N, bias, y, threads);
}

int specdec_q6k_rows_linear(const float *x, int64_t M, int64_t K, int64_t Kp, const uint8_t *qs, const uint8_t *meta,
                            int64_t N, const float *bias, float *y, int32_t threads) {
    return blocks_rows_linear(1, x, M, K, Kp, qs, meta, N, bias, y, threads);
}
