/* Block-quantized linear layers for x86 CPUs with AVX2 + FMA: y = x @ W^T (engine/quant/kernel.py builds it).
 *
 * W: N rows of K values in blocks of 32 along K, each block with a scale d and, for 4-bit blocks, a
 * minimum m: w = d * q + m, q in 0..15 (GGUF's Q4_1; Q4_0 is m = -8 d), or w = d * q, q int8 (Q8_0).
 * Stored packed (blockq_pack), so GGUF blocks are held exactly and 4-bit weights stream at 0.75 byte each.
 *
 * x is quantized per row, per block of 32, to int8 with scale amax / 127 (GGUF's Q8_0 for activations,
 * as llama.cpp does), then each block's dot product is an exact int32 sum. An output element is
 *     sum over blocks, in order, of (d_w * d_x) * dot(q_w, q_x)   [8 float lanes, then a fixed tree]
 *   + sum over blocks, in order, of m_w * (d_x * sum(q_x))         [one float]
 * The arithmetic of an element does not depend on M, N, the tiling or the thread count: a row's output
 * has the same bits whatever else shares the call.
 *
 * Above one row the kernel is compute-bound, so rows of x are taken in groups of up to 8 and each unpacked
 * weight block serves the whole group (dot_rows_xr); one to three rows take the four-accumulator form
 * (dot_tile_x1). Both run the operations above lane by lane, so they give the same bits.
 */
#include "../cpu_kernels.h"

#define QK 32

/* One row of K values (bf16 if is_bf16, else float) -> int8 blocks, and per block the scale and the scaled
 * sum, written `stride` floats apart (the scratch holds them block-major). Per block: amax = the largest |x|
 * (NaN ignored), d = amax / 127, q = round-to-nearest-even(x * (1 / d)) (0 if d is 0), s = d * sum(q). */
static void quantize_row(const void *x, int is_bf16, int K, int8_t *q, float *d, float *s, long stride) {
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int b = 0; b < K / QK; b++) {
        __m256 v[4];
        __m256 amax = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            if (is_bf16) {
                const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)x + b * QK + 8 * i));
                v[i] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
            } else {
                v[i] = _mm256_loadu_ps((const float *)x + b * QK + 8 * i);
            }
            amax = _mm256_max_ps(_mm256_and_ps(v[i], abs_mask), amax); /* a NaN lane keeps amax */
        }
        __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        m = _mm_max_ss(m, _mm_movehdup_ps(m));
        const float db = _mm_cvtss_f32(m) / 127.0f;
        const __m256 inv = _mm256_set1_ps(db != 0.0f ? 1.0f / db : 0.0f);
        __m256i qi[4];
        for (int i = 0; i < 4; i++)
            qi[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        const __m256i q16 = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
        _mm256_storeu_si256((__m256i *)(q + b * QK), _mm256_permutevar8x32_epi32(q16, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
        const __m256i t = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3]));
        __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
        t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0x4e));
        t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0xb1));
        d[b * stride] = db;
        s[b * stride] = db * (float)_mm_cvtsi128_si32(t4);
    }
}

/* Eight int32 lanes, lane i the exact sum of bytes 4i..4i+3 of u * s (u unsigned, s signed; no sum can
 * overflow an int16 here, so maddubs never saturates): one VNNI instruction where the build has it, else
 * two AVX2 ones. The same integers either way, so the same bits. */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define DOT_I32(u, s) _mm256_dpbusd_epi32(_mm256_setzero_si256(), (u), (s))
#else
#define DOT_I32(u, s) _mm256_madd_epi16(_mm256_maddubs_epi16((u), (s)), _mm256_set1_epi16(1))
#endif

/* int32 lanes of one block's dot product, as floats: q_w unsigned (0..15) when HAS_MIN, else signed. */
#define BLOCK_DOT(w, x, HAS_MIN)                                                                          \
    _mm256_cvtepi32_ps((HAS_MIN) ? DOT_I32((w), (x)) : DOT_I32(_mm256_sign_epi8((w), (w)), _mm256_sign_epi8((x), (w))))

/* Packed weights: tiles of TILE rows; per tile and block of 32 along K one record, so a tile streams
 * from memory in one sequential run:
 *   Q4 (has min): TILE x 16 bytes of nibbles (element i low, element i + 16 high), TILE scales, TILE minima
 *   Q8 (no min):  TILE x 32 int8, TILE scales                                                        */
#define TILE 4
#define Q4_RECORD (TILE * 16 + TILE * 8)
#define Q8_RECORD (TILE * 32 + TILE * 4)

static inline __m256i unpack_nibbles(const uint8_t *p) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)p);
    const __m256i both = _mm256_set_m128i(_mm_srli_epi16(raw, 4), raw);
    return _mm256_and_si256(both, _mm256_set1_epi8(0x0f));
}

/* Rows of x are taken up to XR at a time. Their scales at one block are adjacent in the scratch (block-major,
 * rows padded to a multiple of XR with zeros), so one load gives them all. */
#define XR 8
#define CHUNK_BYTES (96 * 1024) /* quantized rows of x per pass over the weights: within a 512 KB L2 */
#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* One row of x against a tile's TILE weight rows (the memory-bound case: four independent accumulators). */
ALWAYS_INLINE void dot_tile_x1(const int q4, int nb, long mp, const int8_t *xq, const float *xd, const float *xs,
                               const uint8_t *rec, float out[TILE]) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    float s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    const long record = q4 ? Q4_RECORD : Q8_RECORD;
    for (int b = 0; b < nb; b++, rec += record) {
        const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + b * QK));
        const float *d = (const float *)(rec + TILE * (q4 ? 16 : 32));
        const float dx = xd[b * mp];
        const int wb = q4 ? 16 : 32;
#define W(j) (q4 ? unpack_nibbles(rec + (j) * 16) : _mm256_loadu_si256((const __m256i *)(rec + (j) * wb)))
        a0 = _mm256_fmadd_ps(_mm256_set1_ps(d[0] * dx), BLOCK_DOT(W(0), x, q4), a0);
        a1 = _mm256_fmadd_ps(_mm256_set1_ps(d[1] * dx), BLOCK_DOT(W(1), x, q4), a1);
        a2 = _mm256_fmadd_ps(_mm256_set1_ps(d[2] * dx), BLOCK_DOT(W(2), x, q4), a2);
        a3 = _mm256_fmadd_ps(_mm256_set1_ps(d[3] * dx), BLOCK_DOT(W(3), x, q4), a3);
#undef W
        if (q4) {
            const float *m = d + TILE, sx = xs[b * mp];
            s0 += m[0] * sx; s1 += m[1] * sx; s2 += m[2] * sx; s3 += m[3] * sx;
        }
    }
    out[0] = hsum8(a0); out[1] = hsum8(a1); out[2] = hsum8(a2); out[3] = hsum8(a3);
    if (q4) { out[0] += s0; out[1] += s1; out[2] += s2; out[3] += s3; }
}

/* Weight rows j..j+JW-1 of a tile against R (4..XR) rows of x: the compute-bound case, where one unpacked
 * weight block serves R rows and each block's scales for all R rows are one multiply. Output (r, j + i) is
 * the same sequence of IEEE operations as in dot_tile_x1 (each lane independent), so its bits depend neither
 * on R nor on JW. */
ALWAYS_INLINE void dot_rows_xr(const int JW, const int R, const int q4, int nb, long K, long mp, const int8_t *xq,
                               const float *xd, const float *xs, const uint8_t *rec, int j, float out[XR][TILE]) {
    __m256 acc[2][XR];
    __m256 s[2]; /* lane r: the minimum's term of row r */
    for (int i = 0; i < JW; i++) {
        for (int r = 0; r < R; r++) acc[i][r] = _mm256_setzero_ps();
        s[i] = _mm256_setzero_ps();
    }
    const long record = q4 ? Q4_RECORD : Q8_RECORD;
    for (int b = 0; b < nb; b++, rec += record) {
        const float *d = (const float *)(rec + TILE * (q4 ? 16 : 32)) + j;
        float scale[2][XR] __attribute__((aligned(32)));
        __m256i w[2];
        for (int i = 0; i < JW; i++) {
            _mm256_store_ps(scale[i], _mm256_mul_ps(_mm256_broadcast_ss(d + i), _mm256_loadu_ps(xd + b * mp)));
            if (q4) {
                s[i] = _mm256_add_ps(s[i], _mm256_mul_ps(_mm256_broadcast_ss(d + TILE + i), _mm256_loadu_ps(xs + b * mp)));
                w[i] = unpack_nibbles(rec + (j + i) * 16);
            } else {
                w[i] = _mm256_loadu_si256((const __m256i *)(rec + (j + i) * 32));
            }
        }
        for (int r = 0; r < R; r++) {
            const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + r * K + b * QK));
            for (int i = 0; i < JW; i++)
                acc[i][r] = _mm256_fmadd_ps(_mm256_broadcast_ss(scale[i] + r), BLOCK_DOT(w[i], x, q4), acc[i][r]);
        }
    }
    for (int i = 0; i < JW; i++) {
        float sm[XR] __attribute__((aligned(32)));
        _mm256_store_ps(sm, s[i]);
        for (int r = 0; r < R; r++) out[r][j + i] = q4 ? hsum8(acc[i][r]) + sm[r] : hsum8(acc[i][r]);
    }
}

/* Weight rows per pass of dot_rows_xr: 2 where AVX-512 gives 32 vector registers (its 16 accumulators fit;
 * benchmarks/results/2026-12-08-kernels-vnni.md), else 1. */
#ifdef __AVX512VL__
#define JW 2
#else
#define JW 1
#endif

/* One tile's outputs out[r][j] for R (1..XR) rows of x; R is a constant in each inlined call. */
static void dot_tile(int R, int q4, int nb, long K, long mp, const int8_t *xq, const float *xd, const float *xs,
                     const uint8_t *rec, float out[XR][TILE]) {
    if (R < 4) { /* too few rows to pay for the per-block set-up below (measured: benchmarks/kernels.py) */
        for (int r = 0; r < R; r++) {
            if (q4) dot_tile_x1(1, nb, mp, xq + r * K, xd + r, xs + r, rec, out[r]);
            else dot_tile_x1(0, nb, mp, xq + r * K, xd + r, xs + r, rec, out[r]);
        }
        return;
    }
    for (int j = 0; j < TILE; j += JW) {
#define CASE(n)                                                                                 \
    case n:                                                                                     \
        if (q4) dot_rows_xr(JW, n, 1, nb, K, mp, xq, xd, xs, rec, j, out);                      \
        else dot_rows_xr(JW, n, 0, nb, K, mp, xq, xd, xs, rec, j, out);                         \
        break;
        switch (R) { CASE(4) CASE(5) CASE(6) CASE(7) CASE(8) }
#undef CASE
    }
}

static inline void store(void *y, int out_bf16, long idx, float v) {
    if (out_bf16) ((uint16_t *)y)[idx] = f32_to_bf16(v);
    else ((float *)y)[idx] = v;
}

/* Bytes of the packed weights of an [N, K] matrix (N a multiple of TILE, K of 32). */
long blockq_packed_bytes(int N, int K, int q4) { return (long)(N / TILE) * (K / QK) * (q4 ? Q4_RECORD : Q8_RECORD); }

/* q [N, K] int8 (0..15 for q4), d and m [N, K / 32] float (m unused unless q4) -> packed. */
void blockq_pack(int N, int K, int q4, const int8_t *q, const float *d, const float *m, uint8_t *out) {
    const int nb = K / QK;
    for (int t = 0; t < N / TILE; t++)
        for (int b = 0; b < nb; b++) {
            uint8_t *rec = out + ((long)t * nb + b) * (q4 ? Q4_RECORD : Q8_RECORD);
            for (int j = 0; j < TILE; j++) {
                const long n = (long)t * TILE + j;
                const int8_t *src = q + n * K + b * QK;
                if (q4) {
                    for (int i = 0; i < 16; i++) rec[j * 16 + i] = (uint8_t)((src[i] & 15) | ((src[i + 16] & 15) << 4));
                    ((float *)(rec + TILE * 16))[j] = d[n * nb + b];
                    ((float *)(rec + TILE * 16))[TILE + j] = m[n * nb + b];
                } else {
                    memcpy(rec + j * 32, src, 32);
                    ((float *)(rec + TILE * 32))[j] = d[n * nb + b];
                }
            }
        }
}

/* Bytes of scratch blockq_linear needs: x quantized (M * K int8), and two floats per row and block. */
long blockq_scratch_bytes(int M, int K) { return (long)M * K + 2L * sizeof(float) * (K / QK) * ((M + XR - 1) / XR * XR); }

/* y [M, N] = x [M, K] @ W^T, x and y bf16 or float; scratch: blockq_scratch_bytes(M, K). Rows are quantized,
 * then tiles of columns are split across threads: columns share no arithmetic, so the split changes no
 * bits. The _omp form runs inside an enclosing parallel region (ops_cpu.c's decoder step). */
void blockq_linear_omp(int M, int N, int K, const void *x, int x_bf16, const uint8_t *w, int q4, void *y, int y_bf16,
                       void *scratch) {
    const int nb = K / QK;
    const long mp = (M + XR - 1) / XR * XR;
    int8_t *xq = (int8_t *)scratch;
    float *xd = (float *)(xq + (long)M * K), *xs = xd + nb * mp;
    const int esize = x_bf16 ? 2 : 4;
    const long record = q4 ? Q4_RECORD : Q8_RECORD;
#pragma omp for schedule(static)
    for (long m = 0; m < mp; m++) {
        if (m < M) quantize_row((const char *)x + m * K * esize, x_bf16, K, xq + m * K, xd + m, xs + m, mp);
        else
            for (int b = 0; b < nb; b++) xd[b * mp + m] = xs[b * mp + m] = 0.0f;
    }
    /* Rows in chunks whose quantized x stays in the L2 cache while every tile passes over it (a prefill's
     * whole x, re-read from L3 once per tile, cost more than its arithmetic). */
    const int chunk = K * XR > CHUNK_BYTES ? XR : CHUNK_BYTES / K / XR * XR;
    for (int m0 = 0; m0 < M; m0 += chunk) {
        const int m1 = M - m0 < chunk ? M : m0 + chunk;
#pragma omp for schedule(static)
        for (int t = 0; t < N / TILE; t++) {
            const uint8_t *rec = w + (long)t * nb * record;
            for (int m = m0; m < m1; m += XR) {
                const int R = m1 - m < XR ? m1 - m : XR;
                float out[XR][TILE];
                dot_tile(R, q4, nb, K, mp, xq + (long)m * K, xd + m, xs + m, rec, out);
                for (int r = 0; r < R; r++)
                    for (int j = 0; j < TILE; j++) store(y, y_bf16, (long)(m + r) * N + (long)t * TILE + j, out[r][j]);
            }
        }
    }
}

void blockq_linear(int M, int N, int K, const void *x, int x_bf16, const uint8_t *w, int q4, void *y, int y_bf16,
                   void *scratch, int num_threads) {
#pragma omp parallel num_threads(num_threads)
    blockq_linear_omp(M, N, K, x, x_bf16, w, q4, y, y_bf16, scratch);
}
