/* Row-wise decoder operations for x86 CPUs with AVX2, FMA and F16C, in bfloat16 or float16 (engine/models/llama.py):
 * each replaces several torch calls (whose per-call overhead dominates a decode step) with one, and computes a
 * row from that row alone, in a fixed order: a row's bits never depend on how many rows share the call.
 * Rounding to the model's dtype falls where the torch formulation rounds (transformers' Llama modules).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

enum { BF16 = 1, F16 = 2 };

static inline float to_f32(const uint16_t *p, long i, int dt) {
    if (dt == F16) return _cvtsh_ss(p[i]);
    uint32_t u = (uint32_t)p[i] << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t from_f32(float f, int dt) { /* round to nearest even, as torch does */
    if (dt == F16) return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float round_to(float f, int dt) { return to_f32((uint16_t[]){from_f32(f, dt)}, 0, dt); }

/* If delta: h[m] = h[m] + delta[m] (rounded, written back). Then out[m] = weight * round(h * rsqrt(mean(h^2) + eps)),
 * the mean of squares in float32: 8 partial sums (element i in sum i % 8), added in a fixed order. */
void rms_norm(int M, int N, uint16_t *h, const uint16_t *delta, const uint16_t *weight, float eps, uint16_t *out,
              int dt) {
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

/* Rotary embedding in place on x [T, heads, D] (row stride x_stride elements; heads packed): with c, s the
 * token's cos / sin rounded to the dtype, x1 | x2 the halves, x1' = x1 c - x2 s and x2' = x2 c + x1 s, each
 * product and the sum rounded (torch's x * cos + rotate_half(x) * sin). cos, sin: [max_pos, D] in the dtype. */
void rotary(int T, int heads, int D, uint16_t *x, long x_stride, const int64_t *positions, const uint16_t *cos,
            const uint16_t *sin, int dt) {
    const int half = D / 2;
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
