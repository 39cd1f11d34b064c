/* Row-wise decoder operations for x86 CPUs with AVX2, FMA and F16C, in bfloat16 or float16 (engine/models/llama.py):
 * each replaces several torch calls (whose per-call overhead dominates a decode step) with one, and computes a
 * row from that row alone, in a fixed order: a row's bits never depend on how many rows share the call.
 * Rounding to the model's dtype falls where the torch formulation rounds (transformers' Llama modules).
 */
#include <math.h>
#include <omp.h>
#include <stdlib.h>

#include "../cpu_kernels.h"

enum { BF16 = 1, F16 = 2 };

static inline float to_f32(const uint16_t *p, long i, int dt) {
    return dt == F16 ? _cvtsh_ss(p[i]) : bf16_to_f32(p[i]);
}

static inline uint16_t from_f32(float f, int dt) { /* round to nearest even, as torch does */
    return dt == F16 ? _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT) : f32_to_bf16(f);
}

static inline float round_to(float f, int dt) { return to_f32((uint16_t[]){from_f32(f, dt)}, 0, dt); }

/* If delta: h[m] = h[m] + delta[m] (rounded, written back). Then out[m] = weight * round(h * rsqrt(mean(h^2) + eps)),
 * the mean of squares in float32: 8 partial sums (element i in sum i % 8), added in a fixed order. The _omp forms
 * here split rows between the threads of an enclosing parallel region. */
void rms_norm_omp(int M, int N, uint16_t *h, const uint16_t *delta, const uint16_t *weight, float eps, uint16_t *out,
                  int dt) {
#pragma omp for schedule(static)
    for (int m = 0; m < M; m++) {
        uint16_t *x = h + (long)m * N;
        if (delta != NULL)
            for (int i = 0; i < N; i++) x[i] = from_f32(to_f32(x, i, dt) + to_f32(delta, (long)m * N + i, dt), dt);
        float part[8] = {0};
        for (int i = 0; i < N; i++) {
            const float v = to_f32(x, i, dt);
            part[i % 8] += v * v;
        }
        const float ss = ((part[0] + part[4]) + (part[2] + part[6])) + ((part[1] + part[5]) + (part[3] + part[7]));
        const float r = 1.0f / sqrtf(ss / (float)N + eps);
        for (int i = 0; i < N; i++)
            out[(long)m * N + i] = from_f32(to_f32(weight, i, dt) * round_to(to_f32(x, i, dt) * r, dt), dt);
    }
}

void rms_norm(int M, int N, uint16_t *h, const uint16_t *delta, const uint16_t *weight, float eps, uint16_t *out,
              int dt) {
    rms_norm_omp(M, N, h, delta, weight, eps, out, dt); /* outside a parallel region: one thread */
}

/* Rotary embedding in place on x [T, heads, D] (row stride x_stride elements; heads packed): with c, s the
 * token's cos / sin rounded to the dtype, x1 | x2 the halves, x1' = x1 c - x2 s and x2' = x2 c + x1 s, each
 * product and the sum rounded (torch's x * cos + rotate_half(x) * sin). cos, sin: [max_pos, D] in the dtype. */
void rotary_omp(int T, int heads, int D, uint16_t *x, long x_stride, const int64_t *positions, const uint16_t *cos,
                const uint16_t *sin, int dt) {
    const int half = D / 2;
#pragma omp for schedule(static)
    for (int t = 0; t < T; t++) {
        const uint16_t *c = cos + positions[t] * D, *s = sin + positions[t] * D;
        for (int h = 0; h < heads; h++) {
            uint16_t *p = x + t * x_stride + (long)h * D;
            for (int i = 0; i < half; i++) {
                const float x1 = to_f32(p, i, dt), x2 = to_f32(p, i + half, dt);
                const float c1 = to_f32(c, i, dt), s1 = to_f32(s, i, dt);
                const float c2 = to_f32(c, i + half, dt), s2 = to_f32(s, i + half, dt);
                const float a = round_to(x1 * c1, dt) + round_to(round_to(-x2, dt) * s1, dt);
                const float b = round_to(x2 * c2, dt) + round_to(x1 * s2, dt);
                p[i] = from_f32(a, dt);
                p[i + half] = from_f32(b, dt);
            }
        }
    }
}

void rotary(int T, int heads, int D, uint16_t *x, long x_stride, const int64_t *positions, const uint16_t *cos,
            const uint16_t *sin, int dt) {
    rotary_omp(T, heads, D, x, x_stride, positions, cos, sin, dt);
}

/* y[m] = round(y[m] + bias) (torch's y + bias in the dtype). */
static void add_bias_omp(int M, int N, uint16_t *y, const uint16_t *bias, int dt) {
#pragma omp for schedule(static)
    for (int m = 0; m < M; m++)
        for (int i = 0; i < N; i++) y[(long)m * N + i] = from_f32(to_f32(y, (long)m * N + i, dt) + to_f32(bias, i, dt), dt);
}

/* out [M, N] = round(round(silu(gate)) * up) for gu [M, 2N] = gate | up; silu(x) = x / (1 + exp(-x)) in float32. */
static void silu_mul_omp(int M, int N, const uint16_t *gu, uint16_t *out, int dt) {
#pragma omp for schedule(static)
    for (int m = 0; m < M; m++) {
        const uint16_t *g = gu + (long)m * 2 * N, *u = g + N;
        for (int i = 0; i < N; i++) {
            const float x = to_f32(g, i, dt);
            out[(long)m * N + i] = from_f32(round_to(x / (1.0f + expf(-x)), dt) * to_f32(u, i, dt), dt);
        }
    }
}

void silu_mul(int M, int N, const uint16_t *gu, uint16_t *out, int dt) { silu_mul_omp(M, N, gu, out, dt); }

/* -- one whole decoder step (Llama-family layers with block-quantized linears), in one parallel region -------- */

void blockq_linear_omp(int M, int N, int K, const void *x, int x_bf16, const uint8_t *w, int q4, void *y, int y_bf16,
                       void *scratch);
void paged_attention_omp(int T, int H, int KVH, int D, int dt, const void *q, long q_stride, const void *k,
                         long k_stride, const void *v, long v_stride, void *k_cache, void *v_cache,
                         const int64_t *slot_mapping, const int64_t *block_table, int max_blocks, int block_size,
                         const int32_t *tok_seg, const int32_t *num_cached, const int32_t *chain_ptr,
                         const int32_t *chain_idx, float scale, void *out, float *s);
int paged_attention_max_len(int T, const int32_t *num_cached, const int32_t *chain_ptr);

typedef struct { /* one decoder layer; biases may be NULL */
    const uint8_t *qkv, *o, *gate_up, *down; /* packed block weights (blockq.c) */
    int qkv_q4, o_q4, gate_up_q4, down_q4;
    const uint16_t *qkv_bias, *o_bias, *gate_up_bias, *down_bias;
    const uint16_t *norm1, *norm2;
    void *k_cache, *v_cache;
} Layer;

typedef struct {
    int num_layers, hidden, heads, kv_heads, head_dim, intermediate, dt;
    float eps, scale;
    const Layer *layers;
    const uint16_t *final_norm, *cos, *sin; /* rotary tables [max_pos, head_dim] in the dtype */
} Decoder;

typedef struct { /* the step, and its buffers (all in the dtype but the linear scratch) */
    int T;
    const int64_t *positions, *slot_mapping, *block_table;
    int max_blocks, block_size;
    const int32_t *tok_seg, *num_cached, *chain_ptr, *chain_idx;
    uint16_t *h;             /* [T, hidden]: the embeddings in; the residual stream after */
    uint16_t *qkv;           /* [T, q + 2 kv] per layer, qkv_layer_stride elements apart (0: one buffer) */
    long qkv_layer_stride;
    uint16_t *x, *delta, *attn; /* [T, hidden] each; x ends as the final norm's output */
    uint16_t *gate_up, *act;    /* [T, 2 I], [T, I] */
    void *linear_scratch;       /* blockq_scratch_bytes(T, max K) bytes */
} Step;

/* Exactly the module path's operations (llama.py with C operations and block weights), in order; rows are
 * split between threads, never the arithmetic of one output. Returns 0, or -1 if scratch could not be had. */
int decoder_step(const Decoder *m, const Step *st, int num_threads) {
    const int T = st->T, dt = m->dt, H = m->heads, KVH = m->kv_heads, D = m->head_dim, I = m->intermediate;
    const int E = m->hidden, QKV = (H + 2 * KVH) * D, bf16 = dt == BF16;
    if (dt != BF16) return -2; /* the block kernel takes bfloat16 or float32 activations */
    const long per_thread = paged_attention_max_len(T, st->num_cached, st->chain_ptr) + 8;
    float *scratch = (float *)malloc(sizeof(float) * per_thread * num_threads);
    if (scratch == NULL) return -1;
#pragma omp parallel num_threads(num_threads)
    {
        float *s = scratch + per_thread * omp_get_thread_num();
        for (int l = 0; l < m->num_layers; l++) {
            const Layer *L = &m->layers[l];
            uint16_t *qkv = st->qkv + l * st->qkv_layer_stride;
            rms_norm_omp(T, E, st->h, l ? st->delta : NULL, L->norm1, m->eps, st->x, dt);
            blockq_linear_omp(T, QKV, E, st->x, bf16, L->qkv, L->qkv_q4, qkv, bf16, st->linear_scratch);
            if (L->qkv_bias) add_bias_omp(T, QKV, qkv, L->qkv_bias, dt);
            rotary_omp(T, H + KVH, D, qkv, QKV, st->positions, m->cos, m->sin, dt); /* q and k are adjacent */
            paged_attention_omp(T, H, KVH, D, dt, qkv, QKV, qkv + H * D, QKV, qkv + (H + KVH) * D, QKV, L->k_cache,
                                L->v_cache, st->slot_mapping, st->block_table, st->max_blocks, st->block_size,
                                st->tok_seg, st->num_cached, st->chain_ptr, st->chain_idx, m->scale, st->attn, s);
            blockq_linear_omp(T, E, H * D, st->attn, bf16, L->o, L->o_q4, st->delta, bf16, st->linear_scratch);
            if (L->o_bias) add_bias_omp(T, E, st->delta, L->o_bias, dt);
            rms_norm_omp(T, E, st->h, st->delta, L->norm2, m->eps, st->x, dt);
            blockq_linear_omp(T, 2 * I, E, st->x, bf16, L->gate_up, L->gate_up_q4, st->gate_up, bf16,
                              st->linear_scratch);
            if (L->gate_up_bias) add_bias_omp(T, 2 * I, st->gate_up, L->gate_up_bias, dt);
            silu_mul_omp(T, I, st->gate_up, st->act, dt);
            blockq_linear_omp(T, E, I, st->act, bf16, L->down, L->down_q4, st->delta, bf16, st->linear_scratch);
            if (L->down_bias) add_bias_omp(T, E, st->delta, L->down_bias, dt);
        }
        rms_norm_omp(T, E, st->h, m->num_layers ? st->delta : NULL, m->final_norm, m->eps, st->x, dt);
    }
    free(scratch);
    return 0;
}
