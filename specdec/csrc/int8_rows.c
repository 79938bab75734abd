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

/* ---- int4-rows: 4-bit weights, affine per group of 32 columns, int8 activations per row ------
 *
 * w[n, k] ~ d[n, g] * u[n, k] + m[n, g] with u in 0..15 and g = k / 32, so
 *
 * y[m, n] = s[m] * sum_g (d[n, g] * (float) sum_{k in g} q[m, k] u[n, k] + m[n, g] * (float) qs[m, g]) + bias[n]
 *
 * with qs[m, g] the integer sum of row m's quantized activations over group g. Each integer sum
 * is exact (|q| <= 127, u <= 15: a vpmaddubsw pair is at most 3810), the float sums run in one
 * fixed order per row and channel whatever else the call holds: rows are bitwise independent.
 * Layout: tiles of TILE channels, for each group the TILE channels' 16 bytes (byte j: element j
 * in the low nibble, element j + 16 in the high one); d as floats [Np / TILE][G][TILE], m as
 * floats [Np / TILE][TILE][G].
 */

static inline __m256i unpack_nibbles(const int8_t *p) {
    const __m128i v = _mm_loadu_si128((const __m128i *)p);
    const __m128i lo = _mm_and_si128(v, _mm_set1_epi8(0x0F));
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(0x0F));
    return _mm256_set_m128i(hi, lo);
}

static inline float hsum_ps(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* One quantized row (q: Kp bytes, qs: G floats) against one tile; out: TILE unscaled sums. */
static inline void tile4_1(const int8_t *q, const float *qs, int64_t G, const int8_t *w, const float *d,
                           const float *mn, float out[TILE]) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t g = 0; g < G; g++, w += 16 * TILE, d += TILE) {
        _mm_prefetch((const char *)(w + 512), _MM_HINT_T0);
        const __m256i x = _mm256_load_si256((const __m256i *)(q + 32 * g));
#define G4(acc, c)                                                                                    \
    acc = _mm256_fmadd_ps(                                                                            \
        _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(unpack_nibbles(w + 16 * (c)), x), ones)), \
        _mm256_broadcast_ss(d + (c)), acc)
        G4(a0, 0);
        G4(a1, 1);
        G4(a2, 2);
        G4(a3, 3);
    }
    /* the groups' offsets: sum_g m[n, g] * qs[g], eight groups at a time, then the rest (mn is
     * [TILE][G]: each channel's offsets contiguous) */
    __m256 b0 = _mm256_setzero_ps(), b1 = b0, b2 = b0, b3 = b0;
    int64_t g = 0;
    for (; g + 8 <= G; g += 8) {
        const __m256 s = _mm256_loadu_ps(qs + g);
        b0 = _mm256_fmadd_ps(_mm256_loadu_ps(mn + g), s, b0);
        b1 = _mm256_fmadd_ps(_mm256_loadu_ps(mn + G + g), s, b1);
        b2 = _mm256_fmadd_ps(_mm256_loadu_ps(mn + 2 * G + g), s, b2);
        b3 = _mm256_fmadd_ps(_mm256_loadu_ps(mn + 3 * G + g), s, b3);
    }
    float r0 = hsum_ps(b0), r1 = hsum_ps(b1), r2 = hsum_ps(b2), r3 = hsum_ps(b3);
    for (; g < G; g++) {
        r0 = fmaf(mn[g], qs[g], r0);
        r1 = fmaf(mn[G + g], qs[g], r1);
        r2 = fmaf(mn[2 * G + g], qs[g], r2);
        r3 = fmaf(mn[3 * G + g], qs[g], r3);
    }
    out[0] = hsum_ps(a0) + r0;
    out[1] = hsum_ps(a1) + r1;
    out[2] = hsum_ps(a2) + r2;
    out[3] = hsum_ps(a3) + r3;
}

/* x: float32 [M, K]; w: tiles as above (32-byte aligned); d, mn: float32 as above;
 * bias: float32 [N] or NULL; y: float32 [M, N]. Returns 0, or -1 without scratch memory. */
int specdec_int4_rows_linear(const float *x, int64_t M, int64_t K, const int8_t *w, int64_t Kp, int64_t N,
                             const float *d, const float *mn, const float *bias, float *y, int32_t threads) {
    const int64_t G = Kp / 32;
    int8_t *q = (int8_t *)aligned_alloc(32, (size_t)(M * Kp));
    float *s = (float *)malloc(sizeof(float) * (size_t)M);
    float *qs = (float *)malloc(sizeof(float) * (size_t)(M * G));
    if (q == NULL || s == NULL || qs == NULL) {
        free(q);
        free(s);
        free(qs);
        return -1;
    }
    for (int64_t m = 0; m < M; m++) {
        s[m] = quantize_row(x + m * K, K, Kp, q + m * Kp, 0);
        for (int64_t g = 0; g < G; g++) {
            int32_t t = 0;
            for (int j = 0; j < 32; j++) t += q[m * Kp + 32 * g + j];
            qs[m * G + g] = (float)t;
        }
    }
    const int64_t tiles = (N + TILE - 1) / TILE;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && N >= 64)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t n0 = t * TILE;
        const int64_t nc = N - n0 < TILE ? N - n0 : TILE;
        for (int64_t m = 0; m < M; m++) {
            float sums[TILE];
            tile4_1(q + m * Kp, qs + m * G, G, w + t * G * 16 * TILE, d + t * G * TILE, mn + t * G * TILE, sums);
            for (int64_t c = 0; c < nc; c++) {
                float v = sums[c] * s[m];
                if (bias != NULL) v = v + bias[n0 + c];
                y[m * N + n0 + c] = v;
            }
        }
    }
    free(q);
    free(s);
    free(qs);
    return 0;
}
