/* Shape-invariant paged attention for x86 CPUs with AVX2, FMA and F16C (engine/attention/invariant.py).
 *
 * Every query token t sees its keys in increasing absolute position, one per position: the first
 * num_cached[t] from the paged cache (positions 0.., through its block-table row), then the in-step tokens
 * chain_idx[chain_ptr[t] .. chain_ptr[t + 1]) (a lookahead token's ancestors and itself). For each
 * (token, head) the arithmetic is fixed by the keys alone:
 *   score j  = (8-lane FMA over head_dim in order, then a fixed tree) * scale
 *   e_j      = exp(score j - max), one vector formula per element
 *   denom    = key j in lane j % 8 of a running vector sum, then a fixed tree
 *   out      = (sum over j in order of e_j * v_j, per element) * (1 / denom)
 * so a query's output has the same bits whatever kind of segment carries it (plain decode, prefill chunk,
 * lookahead window or candidate), whatever else shares the step, and however the work is split between
 * threads. Inputs and outputs: float32, bfloat16 or float16; arithmetic in float32.
 */
#include <math.h>
#include <omp.h>
#include <stdlib.h>

#include "../cpu_kernels.h"

enum { F32 = 0, BF16 = 1, F16 = 2 };

static inline __m256 load8(const void *p, const int dt) {
    if (dt == F32) return _mm256_loadu_ps((const float *)p);
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
    if (dt == F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static inline void store8(void *p, __m256 v, const int dt) {
    if (dt == F32) {
        _mm256_storeu_ps((float *)p, v);
    } else if (dt == F16) {
        _mm_storeu_si128((__m128i *)p, _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    } else { /* bfloat16, round to nearest even (NaN kept quiet), as torch does */
        __m256i u = _mm256_castps_si256(v);
        const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
        __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
        const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                               _mm256_set1_epi32(0x7f800000));
        r = _mm256_blendv_epi8(r, _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40)), nan);
        const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
        _mm_storeu_si128((__m128i *)p, packed);
    }
}

/* exp for x <= 0 (Cephes' single-precision polynomial): the same instructions for every lane. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
    __m256 n = _mm256_floor_ps(_mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                             _mm256_set1_ps(0.5f)));
    x = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f)));
    x = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(-2.12194440e-4f)));
    const __m256 z = _mm256_mul_ps(x, x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(y, z), x), _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

typedef struct {
    int H, KVH, D, dt, block_size, max_blocks;
    const char *q, *k, *v, *k_cache, *v_cache;
    long q_stride, k_stride, v_stride; /* elements between tokens */
    const int64_t *block_table;
    const int32_t *tok_seg, *num_cached, *chain_ptr, *chain_idx;
    float scale;
    char *out;
} Args;

/* Key (or value) j of token t, kv head h. */
static inline const char *key_at(const Args *a, const char *cache, const char *step, long step_stride, int t,
                                 int h, int j, int es) {
    const int nc = a->num_cached[t];
    if (j < nc) {
        const int64_t *row = a->block_table + (long)a->tok_seg[t] * a->max_blocks;
        const long slot = row[j / a->block_size] * a->block_size + j % a->block_size;
        return cache + ((slot * a->KVH + h) * a->D) * es;
    }
    return step + ((long)a->chain_idx[a->chain_ptr[t] + j - nc] * step_stride + (long)h * a->D) * es;
}

/* One (token, head). D and dt are constants where it is inlined, so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void attend(const Args *a, int t, int h, float *s, const int D,
                                                         const int dt) {
    const int es = dt == F32 ? 4 : 2, kvh = h / (a->H / a->KVH);
    const int L = a->num_cached[t] + a->chain_ptr[t + 1] - a->chain_ptr[t];
    __m256 q[32]; /* D <= 256 */
    const char *qp = a->q + ((long)t * a->q_stride + (long)h * D) * es;
    for (int c = 0; c < D / 8; c++) q[c] = load8(qp + c * 8 * es, dt);
    float m = -INFINITY;
    for (int j = 0; j < L; j++) {
        const char *kp = key_at(a, a->k_cache, a->k, a->k_stride, t, kvh, j, es);
        __m256 acc = _mm256_mul_ps(q[0], load8(kp, dt));
        for (int c = 1; c < D / 8; c++) acc = _mm256_fmadd_ps(q[c], load8(kp + c * 8 * es, dt), acc);
        s[j] = hsum8(acc) * a->scale;
        m = s[j] > m ? s[j] : m;
    }
    const __m256 mv = _mm256_set1_ps(m);
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256 sum = _mm256_setzero_ps();
    for (int j = 0; j < L; j += 8) { /* s has room for the last vector; lanes past L count as 0 */
        const __m256 live = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(L - j), lane));
        const __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv)), live);
        _mm256_storeu_ps(s + j, e);
        sum = _mm256_add_ps(sum, e);
    }
    __m256 o[32];
    for (int c = 0; c < D / 8; c++) o[c] = _mm256_setzero_ps();
    for (int j = 0; j < L; j++) {
        const char *vp = key_at(a, a->v_cache, a->v, a->v_stride, t, kvh, j, es);
        const __m256 w = _mm256_set1_ps(s[j]);
        for (int c = 0; c < D / 8; c++) o[c] = _mm256_fmadd_ps(w, load8(vp + c * 8 * es, dt), o[c]);
    }
    const __m256 inv = _mm256_set1_ps(1.0f / hsum8(sum));
    char *op = a->out + (((long)t * a->H + h) * D) * es;
    for (int c = 0; c < D / 8; c++) store8(op + c * 8 * es, _mm256_mul_ps(o[c], inv), dt);
}

#define DISPATCH(D)                                              \
    if (a->dt == BF16) attend(a, t, h, s, D, BF16);              \
    else if (a->dt == F16) attend(a, t, h, s, D, F16);           \
    else attend(a, t, h, s, D, F32)

static void attend_any(const Args *a, int t, int h, float *s) {
    if (a->D == 64) { DISPATCH(64); }
    else if (a->D == 128) { DISPATCH(128); }
    else { DISPATCH(a->D); } /* any multiple of 8 up to 256 (checked by the caller) */
}

/* The longest key list of the step: the scratch each thread needs is that many floats plus 8. */
int paged_attention_max_len(int T, const int32_t *num_cached, const int32_t *chain_ptr) {
    int max_len = 0;
    for (int t = 0; t < T; t++) {
        const int L = num_cached[t] + chain_ptr[t + 1] - chain_ptr[t];
        max_len = L > max_len ? L : max_len;
    }
    return max_len;
}

/* Inside a parallel region: first writes the keys and values of the tokens with slot_mapping[t] >= 0
 * (committed tokens) to the cache, then attends; s is this thread's scratch (paged_attention_max_len + 8
 * floats). out [T, H, D] contiguous. */
void paged_attention_omp(int T, int H, int KVH, int D, int dt, const void *q, long q_stride, const void *k,
                         long k_stride, const void *v, long v_stride, void *k_cache, void *v_cache,
                         const int64_t *slot_mapping, const int64_t *block_table, int max_blocks, int block_size,
                         const int32_t *tok_seg, const int32_t *num_cached, const int32_t *chain_ptr,
                         const int32_t *chain_idx, float scale, void *out, float *s) {
    const int es = dt == F32 ? 4 : 2;
    const long row = (long)KVH * D * es;
#pragma omp for schedule(static)
    for (int t = 0; t < T; t++)
        if (slot_mapping[t] >= 0) {
            memcpy((char *)k_cache + slot_mapping[t] * row, (const char *)k + (long)t * k_stride * es, row);
            memcpy((char *)v_cache + slot_mapping[t] * row, (const char *)v + (long)t * v_stride * es, row);
        }
    const Args a = {H, KVH, D, dt, block_size, max_blocks, q, k, v, k_cache, v_cache, q_stride, k_stride, v_stride,
                    block_table, tok_seg, num_cached, chain_ptr, chain_idx, scale, out};
#pragma omp for schedule(dynamic, 1)
    for (long i = 0; i < (long)T * H; i++) attend_any(&a, (int)(i / H), (int)(i % H), s);
}

/* paged_attention_omp in its own parallel region. Returns 0, or -1 if scratch memory could not be had. */
int paged_attention(int T, int H, int KVH, int D, int dt, const void *q, long q_stride, const void *k, long k_stride,
                    const void *v, long v_stride, void *k_cache, void *v_cache, const int64_t *slot_mapping,
                    const int64_t *block_table, int max_blocks, int block_size, const int32_t *tok_seg,
                    const int32_t *num_cached, const int32_t *chain_ptr, const int32_t *chain_idx, float scale,
                    void *out, int num_threads) {
    const long per_thread = paged_attention_max_len(T, num_cached, chain_ptr) + 8;
    float *scratch = (float *)malloc(sizeof(float) * per_thread * num_threads);
    if (scratch == NULL) return -1;
#pragma omp parallel num_threads(num_threads)
    paged_attention_omp(T, H, KVH, D, dt, q, q_stride, k, k_stride, v, v_stride, k_cache, v_cache, slot_mapping,
                        block_table, max_blocks, block_size, tok_seg, num_cached, chain_ptr, chain_idx, scale, out,
                        scratch + per_thread * omp_get_thread_num());
    free(scratch);
    return 0;
}
