/* Tree attention for the tree rows of one step, read straight from vLLM's packed CPU KV cache.
 *
 * One call per attention layer replaces the torch path of tree_attention.py (gather, two GEMMs,
 * softmax: ~20 small ops per layer). Same math as vLLM's vec kernel: fp32 scores of the pre-scaled
 * query, online softmax over key blocks, fp32 accumulation, one rounding at the end.
 *
 * Request r has q_len[r] = T query rows (root + nodes) and seq_len[r] = L keys; its first
 * P = L - T keys are the cached prefix (always visible), key P + j is visible to row t iff
 * mask[t * T + j]. Query head h reads kv head h / (H / Hkv). Only rows t >= row0[r] are computed
 * and written: rows before it see exactly the causal mask (the tree's first path, laid out first),
 * so vLLM's causal kernel already wrote them.
 *
 * Cache: key_cache / value_cache point at element (block 0, kv head 0, slot 0, dim 0) of the two
 * halves of vLLM's [num_blocks, Hkv, 2 * block_size, D] layer cache; each (block, kv head) region
 * is block_size * D contiguous elements, packed per ISA:
 *   layout 0 ("vec", "vec16"): K as [D][block_size], V as [block_size][D];
 *   layout 1 (any other): element (slot, d) at k_off[slot * D + d] / v_off[slot * D + d].
 * dtype 0: float32, 1: bfloat16 (query, cache and output alike).
 *
 * Built once per machine by vllm_spec_plugins/native.py (cc -O3 -march=native), called with ctypes.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define RB 8    /* query rows per register block */
#define CB 16   /* keys / dims per vector */

/* 16 floats: one AVX-512 register, two AVX2 or four SSE registers (GCC/Clang vector extension). */
typedef float vf __attribute__((vector_size(CB * sizeof(float))));

static inline vf loadu(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline void storeu(float *p, vf v) { memcpy(p, &v, sizeof v); }
typedef int32_t vi __attribute__((vector_size(CB * sizeof(int32_t))));
static inline vf splat(float a) { return (vf){0} + a; }
static inline vf vmax(vf a, vf b) {
    vi gt = a > b, ai, bi;
    memcpy(&ai, &a, sizeof ai);
    memcpy(&bi, &b, sizeof bi);
    ai = (ai & gt) | (bi & ~gt);
    memcpy(&a, &ai, sizeof a);
    return a;
}
static inline float hmax(vf v) { float m = v[0]; for (int i = 1; i < CB; i++) m = v[i] > m ? v[i] : m; return m; }
static inline float hsum(vf v) { float s = 0.0f; for (int i = 0; i < CB; i++) s += v[i]; return s; }

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {   /* round to nearest even, as torch does */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);   /* NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* exp(x) for x <= 0 (Cephes expf polynomial, ~1 ulp); written so the compiler vectorizes it. */
static inline float exp_nonpos(float x) {
    x = x < -87.0f ? -87.0f : x;
    float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    float y = p * r * r + r + 1.0f;
    int32_t e = ((int32_t)n + 127) << 23;
    float s;
    memcpy(&s, &e, 4);
    return y * s;
}

/* exp_nonpos on 16 lanes; lanes below -87 (masked keys are -inf) give exactly 0. */
static inline vf vexp_nonpos(vf x) {
    vi keep = x >= splat(-87.0f), e, yi;
    x = vmax(x, splat(-87.0f));
    vf n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;     /* round to nearest */
    vf r = x - n * 0.693359375f + n * 2.12194440e-4f;
    vf p = splat(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    vf y = p * r * r + r + 1.0f, sc;
    e = (__builtin_convertvector(n, vi) + 127) << 23;
    memcpy(&sc, &e, sizeof sc);
    y *= sc;
    memcpy(&yi, &y, sizeof yi);
    yi &= keep;
    memcpy(&y, &yi, sizeof y);
    return y;
}

/* S[rows][ldS] = Q[rows][D] . Kt[D][ldk] for the first ceil(n / CB) * CB keys; rows % RB == 0. */
static void scores(const float *Q, int rows, int D, const float *Kt, int ldk, int n, float *S, int ldS) {
    int nc = (n + CB - 1) / CB * CB;
    for (int r0 = 0; r0 < rows; r0 += RB) {
        const float *q = Q + (size_t)r0 * D;
        for (int j0 = 0; j0 < nc; j0 += CB) {
            vf acc[RB] = {0};
            for (int d = 0; d < D; d++) {
                vf k = loadu(Kt + (size_t)d * ldk + j0);
                for (int i = 0; i < RB; i++) acc[i] += q[(size_t)i * D + d] * k;
            }
            for (int i = 0; i < RB; i++) storeu(S + (size_t)(r0 + i) * ldS + j0, acc[i]);
        }
    }
}

/* O[rows][D] += P[rows][n] . V[n][D] (V rows ldv apart); rows % RB == 0, D % CB == 0. */
static void weighted_sum(const float *P, int ldP, int rows, int n, const float *V, int ldv, int D, float *O) {
    for (int r0 = 0; r0 < rows; r0 += RB) {
        const float *p = P + (size_t)r0 * ldP;
        for (int d0 = 0; d0 < D; d0 += CB) {
            vf acc[RB];
            for (int i = 0; i < RB; i++) acc[i] = loadu(O + (size_t)(r0 + i) * D + d0);
            for (int j = 0; j < n; j++) {
                vf v = loadu(V + (size_t)j * ldv + d0);
                for (int i = 0; i < RB; i++) acc[i] += p[(size_t)i * ldP + j] * v;
            }
            for (int i = 0; i < RB; i++) storeu(O + (size_t)(r0 + i) * D + d0, acc[i]);
        }
    }
}

static inline float load(const void *base, size_t i, int dtype) {
    return dtype ? bf16_to_f32(((const uint16_t *)base)[i]) : ((const float *)base)[i];
}

/* Returns 0, or -1 (bad sizes / out of memory: nothing written). */
int tree_attention(const void *query, int64_t q_tok, int64_t q_head,
                   const void *key_cache, const void *value_cache, int64_t c_blk, int64_t c_head,
                   void *out, int64_t o_tok, int64_t o_head,
                   const int32_t *block_table, int64_t bt_stride,
                   int nreq, const int32_t *req, const int32_t *q_start, const int32_t *q_len,
                   const int32_t *seq_len, const uint8_t *mask, const int64_t *mask_off,
                   const int32_t *row0, int H, int Hkv, int D, int bs, float scale, int dtype, int layout,
                   const int32_t *k_off, const int32_t *v_off) {
    if (H <= 0 || Hkv <= 0 || H % Hkv || D <= 0 || D % CB || bs <= 0 || (dtype != 0 && dtype != 1)) return -1;
    int g = H / Hkv, tmax = 0;
    for (int r = 0; r < nreq; r++) {
        if (q_len[r] <= 0 || seq_len[r] < q_len[r] || row0[r] < 0 || row0[r] > q_len[r]) return -1;
        if (q_len[r] - row0[r] > tmax) tmax = q_len[r] - row0[r];
    }
    int rows_max = (g * tmax + RB - 1) / RB * RB;
    int ldS = (bs + CB - 1) / CB * CB;
    size_t nfloat = (size_t)rows_max * D * 2 + (size_t)rows_max * ldS + (size_t)D * ldS + (size_t)bs * D
                    + 2 * (size_t)rows_max;
    float *buf = (float *)malloc(nfloat * sizeof(float));
    if (!buf) return -1;
    float *Q = buf, *O = Q + (size_t)rows_max * D, *S = O + (size_t)rows_max * D;
    float *Kb = S + (size_t)rows_max * ldS, *Vb = Kb + (size_t)D * ldS, *m = Vb + (size_t)bs * D, *l = m + rows_max;

    for (int r = 0; r < nreq; r++) {
        int T = q_len[r], L = seq_len[r], P = L - T, t0 = row0[r], Tn = T - t0, rows = g * Tn;
        if (Tn == 0) continue;
        int rows_p = (rows + RB - 1) / RB * RB;
        const uint8_t *mk = mask + mask_off[r];
        const int32_t *bt = block_table + (int64_t)req[r] * bt_stride;
        for (int kh = 0; kh < Hkv; kh++) {
            /* rows (gi, t): query head kh * g + gi, token q_start + t0 + t; pre-scaled as vLLM does */
            memset(Q, 0, (size_t)rows_p * D * sizeof(float));
            for (int gi = 0; gi < g; gi++)
                for (int t = 0; t < Tn; t++) {
                    size_t base = (size_t)(q_start[r] + t0 + t) * q_tok + (size_t)(kh * g + gi) * q_head;
                    float *q = Q + (size_t)(gi * Tn + t) * D;
                    for (int d = 0; d < D; d++) q[d] = load(query, base + d, dtype) * scale;
                }
            memset(O, 0, (size_t)rows_p * D * sizeof(float));
            for (int i = 0; i < rows_p; i++) { m[i] = -INFINITY; l[i] = 0.0f; }

            for (int b0 = 0; b0 < L; b0 += bs) {
                int n = L - b0 < bs ? L - b0 : bs;
                size_t off = (size_t)bt[b0 / bs] * c_blk + (size_t)kh * c_head;
                const float *Kt, *V;
                int ldk;
                if (layout == 0 && dtype == 0 && bs % CB == 0) {
                    /* fp32 vec: compute on the cache itself (chunk columns past n stay inside the
                     * region; their scores are never read) */
                    Kt = (const float *)key_cache + off;
                    V = (const float *)value_cache + off;
                    ldk = bs;
                } else if (layout == 0) {                 /* vec: widen the n keys (bf16), pad to chunks */
                    const char *kc = (const char *)key_cache + off * (dtype ? 2 : 4);
                    const char *vc = (const char *)value_cache + off * (dtype ? 2 : 4);
                    for (int d = 0; d < D; d++) {
                        float *dst = Kb + (size_t)d * ldS;
                        int j = 0;
                        for (; j < n; j++) dst[j] = load(kc, (size_t)d * bs + j, dtype);
                        for (; j < ldS; j++) dst[j] = 0.0f;
                    }
                    for (size_t i = 0; i < (size_t)n * D; i++) Vb[i] = load(vc, i, dtype);
                    Kt = Kb; V = Vb; ldk = ldS;
                } else {                                  /* any packing: offset tables */
                    for (int d = 0; d < D; d++) {
                        float *dst = Kb + (size_t)d * ldS;
                        int j = 0;
                        for (; j < n; j++) dst[j] = load(key_cache, off + k_off[j * D + d], dtype);
                        for (; j < ldS; j++) dst[j] = 0.0f;
                    }
                    for (int j = 0; j < n; j++)
                        for (int d = 0; d < D; d++) Vb[(size_t)j * D + d] = load(value_cache, off + v_off[j * D + d], dtype);
                    Kt = Kb; V = Vb; ldk = ldS;
                }
                scores(Q, rows_p, D, Kt, ldk, n, S, ldS);

                /* online softmax: S becomes the block's weights, O and l are rescaled */
                int tree0 = P - b0, nc = (n + CB - 1) / CB * CB;   /* first tree key here (may be <0) */
                for (int i = 0; i < rows; i++) {
                    float *s = S + (size_t)i * ldS;
                    const uint8_t *mrow = mk + (size_t)(t0 + i % Tn) * T;
                    for (int j = tree0 > 0 ? tree0 : 0; j < n; j++)
                        if (!mrow[b0 + j - P]) s[j] = -INFINITY;
                    for (int j = n; j < nc; j++) s[j] = -INFINITY;
                    vf vm = splat(-INFINITY);
                    for (int j = 0; j < nc; j += CB) vm = vmax(vm, loadu(s + j));
                    float mb = hmax(vm);
                    if (mb == -INFINITY) {                 /* nothing visible here */
                        memset(s, 0, nc * sizeof(float));
                        continue;
                    }
                    float mn = m[i] > mb ? m[i] : mb;
                    float alpha = m[i] == -INFINITY ? 0.0f : exp_nonpos(m[i] - mn);
                    vf vs = splat(0.0f), vmn = splat(mn);
                    for (int j = 0; j < nc; j += CB) {
                        vf p = vexp_nonpos(loadu(s + j) - vmn);
                        storeu(s + j, p);
                        vs += p;
                    }
                    l[i] = l[i] * alpha + hsum(vs);
                    m[i] = mn;
                    if (alpha != 1.0f) {
                        float *o = O + (size_t)i * D;
                        for (int d = 0; d < D; d++) o[d] *= alpha;
                    }
                }
                for (int i = rows; i < rows_p; i++) memset(S + (size_t)i * ldS, 0, n * sizeof(float));
                weighted_sum(S, ldS, rows_p, n, V, D, D, O);
            }

            for (int gi = 0; gi < g; gi++)
                for (int t = 0; t < Tn; t++) {
                    int i = gi * Tn + t;
                    float inv = 1.0f / l[i];
                    const float *o = O + (size_t)i * D;
                    size_t base = (size_t)(q_start[r] + t0 + t) * o_tok + (size_t)(kh * g + gi) * o_head;
                    if (dtype) {
                        uint16_t *dst = (uint16_t *)out + base;
                        for (int d = 0; d < D; d++) dst[d] = f32_to_bf16(o[d] * inv);
                    } else {
                        float *dst = (float *)out + base;
                        for (int d = 0; d < D; d++) dst[d] = o[d] * inv;
                    }
                }
        }
    }
    free(buf);
    return 0;
}
