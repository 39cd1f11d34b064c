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
 */
#include <math.h>

#include "../cpu_kernels.h"

#define QK 32

/* One row of K values (bf16 if is_bf16, else float) -> int8 blocks, their scales and scaled sums. */
static void quantize_row(const void *x, int is_bf16, int K, int8_t *q, float *d, float *s) {
    float buf[QK];
    for (int b = 0; b < K / QK; b++) {
        float amax = 0.0f;
        for (int i = 0; i < QK; i++) {
            float v = is_bf16 ? bf16_to_f32(((const uint16_t *)x)[b * QK + i]) : ((const float *)x)[b * QK + i];
            buf[i] = v;
            float a = fabsf(v);
            amax = a > amax ? a : amax;
        }
        float db = amax / 127.0f;
        float inv = db != 0.0f ? 1.0f / db : 0.0f;
        int sum = 0;
        for (int i = 0; i < QK; i++) {
            int v = (int)nearbyintf(buf[i] * inv);
            q[b * QK + i] = (int8_t)v;
            sum += v;
        }
        d[b] = db;
        s[b] = db * (float)sum;
    }
}

/* int32 lanes of one block's dot product, as floats: q_w unsigned (0..15) when HAS_MIN, else signed. */
#define BLOCK_DOT(w, x, HAS_MIN)                                                                          \
    _mm256_cvtepi32_ps(_mm256_madd_epi16(                                                                 \
        (HAS_MIN) ? _mm256_maddubs_epi16((w), (x))                                                        \
                  : _mm256_maddubs_epi16(_mm256_sign_epi8((w), (w)), _mm256_sign_epi8((x), (w))),          \
        _mm256_set1_epi16(1)))

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

/* TILE outputs of one row; each element runs exactly the same arithmetic whatever its tile position. */
static void dot_tile_q4(int nb, const int8_t *xq, const float *xd, const float *xs, const uint8_t *rec,
                        float out[TILE]) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    float s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    for (int b = 0; b < nb; b++, rec += Q4_RECORD) {
        const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + b * QK));
        const float *d = (const float *)(rec + TILE * 16), *m = d + TILE;
        const float dx = xd[b], sx = xs[b];
        a0 = _mm256_fmadd_ps(_mm256_set1_ps(d[0] * dx), BLOCK_DOT(unpack_nibbles(rec), x, 1), a0);
        a1 = _mm256_fmadd_ps(_mm256_set1_ps(d[1] * dx), BLOCK_DOT(unpack_nibbles(rec + 16), x, 1), a1);
        a2 = _mm256_fmadd_ps(_mm256_set1_ps(d[2] * dx), BLOCK_DOT(unpack_nibbles(rec + 32), x, 1), a2);
        a3 = _mm256_fmadd_ps(_mm256_set1_ps(d[3] * dx), BLOCK_DOT(unpack_nibbles(rec + 48), x, 1), a3);
        s0 += m[0] * sx; s1 += m[1] * sx; s2 += m[2] * sx; s3 += m[3] * sx;
    }
    out[0] = hsum8(a0) + s0; out[1] = hsum8(a1) + s1; out[2] = hsum8(a2) + s2; out[3] = hsum8(a3) + s3;
}

static void dot_tile_q8(int nb, const int8_t *xq, const float *xd, const uint8_t *rec, float out[TILE]) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int b = 0; b < nb; b++, rec += Q8_RECORD) {
        const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + b * QK));
        const float *d = (const float *)(rec + TILE * 32);
        const float dx = xd[b];
        a0 = _mm256_fmadd_ps(_mm256_set1_ps(d[0] * dx), BLOCK_DOT(_mm256_loadu_si256((const __m256i *)rec), x, 0), a0);
        a1 = _mm256_fmadd_ps(_mm256_set1_ps(d[1] * dx), BLOCK_DOT(_mm256_loadu_si256((const __m256i *)(rec + 32)), x, 0), a1);
        a2 = _mm256_fmadd_ps(_mm256_set1_ps(d[2] * dx), BLOCK_DOT(_mm256_loadu_si256((const __m256i *)(rec + 64)), x, 0), a2);
        a3 = _mm256_fmadd_ps(_mm256_set1_ps(d[3] * dx), BLOCK_DOT(_mm256_loadu_si256((const __m256i *)(rec + 96)), x, 0), a3);
    }
    out[0] = hsum8(a0); out[1] = hsum8(a1); out[2] = hsum8(a2); out[3] = hsum8(a3);
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

/* y [M, N] = x [M, K] @ W^T, x and y bf16 or float; scratch: M * (K + 8 * K / 32) bytes. Rows are
 * quantized, then tiles of columns are split across threads: columns share no arithmetic, so the split
 * changes no bits. The _omp form runs inside an enclosing parallel region (ops_cpu.c's decoder step). */
void blockq_linear_omp(int M, int N, int K, const void *x, int x_bf16, const uint8_t *w, int q4, void *y, int y_bf16,
                       void *scratch) {
    const int nb = K / QK;
    int8_t *xq = (int8_t *)scratch;
    float *xd = (float *)(xq + (long)M * K);
    float *xs = xd + (long)M * nb;
    const int esize = x_bf16 ? 2 : 4;
    const long record = q4 ? Q4_RECORD : Q8_RECORD;
#pragma omp for schedule(static)
    for (int m = 0; m < M; m++)
        quantize_row((const char *)x + (long)m * K * esize, x_bf16, K, xq + (long)m * K, xd + (long)m * nb,
                     xs + (long)m * nb);
#pragma omp for schedule(static)
    for (int t = 0; t < N / TILE; t++) {
        const uint8_t *rec = w + (long)t * nb * record;
        for (int m = 0; m < M; m++) {
            float out[TILE];
            if (q4) dot_tile_q4(nb, xq + (long)m * K, xd + (long)m * nb, xs + (long)m * nb, rec, out);
            else dot_tile_q8(nb, xq + (long)m * K, xd + (long)m * nb, rec, out);
            for (int j = 0; j < TILE; j++) store(y, y_bf16, (long)m * N + (long)t * TILE + j, out[j]);
        }
    }
}

void blockq_linear(int M, int N, int K, const void *x, int x_bf16, const uint8_t *w, int q4, void *y, int y_bf16,
                   void *scratch, int num_threads) {
#pragma omp parallel num_threads(num_threads)
    blockq_linear_omp(M, N, K, x, x_bf16, w, q4, y, y_bf16, scratch);
}
