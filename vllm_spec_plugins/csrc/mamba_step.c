/* One recurrent Mamba-2 mixer step for a batch of rows, states read from and written to the
 * proposer's snapshot buffers in place (proposers/mamba.py: Mamba2Mixer.step is the same math).
 *
 * One call per layer replaces ~30 small torch ops (split, softplus, convolution window, decay,
 * state update, readout, skip, gate, RMS norm) and the gather / scatter of the states: the SSM
 * state (H * P * N floats, ~300 KB) is read once and written once per row.
 *
 * u [b, di + conv_dim + H] (row stride u_stride): the in-projection's output, z | xBC | dt.
 * conv [slots, snaps, conv_dim, K-1] and ssm [slots, snaps, H, P, N]: row r reads snapshot
 * src[r] and writes snapshot dst[r] of slot slot[r] (src == dst: in place).
 * y [b, di]: rms_norm((y_ssm + D * x) * silu(z)) * norm_w, the out-projection's input.
 * float32 throughout. Built once per machine by vllm_spec_plugins/native.py, called with ctypes.
 */
#include <math.h>
#include <stdint.h>

static inline float silu(float x) { return x / (1.0f + expf(-x)); }
static inline float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

int mamba_step(const float *u, int64_t u_stride,
               float *conv, int64_t conv_slot, int64_t conv_snap,
               float *ssm, int64_t ssm_slot, int64_t ssm_snap,
               const int64_t *slot, const int64_t *src, const int64_t *dst, int b,
               const float *conv_w, const float *conv_b, const float *dt_bias, const float *A,
               const float *D, const float *norm_w, float eps,
               int di, int conv_dim, int H, int P, int N, int K,
               float *y, float *scratch /* conv_dim floats */)
{
    if (K < 2 || K > 16 || di != H * P || conv_dim != di + 2 * N)
        return 1;
    for (int r = 0; r < b; r++) {
        const float *ur = u + r * u_stride, *z = ur, *xbc = ur + di, *dtr = ur + di + conv_dim;
        const float *cin = conv + slot[r] * conv_slot + src[r] * conv_snap;
        float *cout = conv + slot[r] * conv_slot + dst[r] * conv_snap;
        float *xo = scratch;                      /* silu(conv) of x | B | C */
        for (int c = 0; c < conv_dim; c++) {
            const float *w = conv_w + c * K, *win = cin + c * (K - 1);
            float *wout = cout + c * (K - 1), acc = conv_b[c] + xbc[c] * w[K - 1];
            for (int i = 0; i < K - 1; i++)
                acc += win[i] * w[i];
            for (int i = 0; i < K - 2; i++)     /* shift left (in place is safe: reads lead) */
                wout[i] = win[i + 1];
            wout[K - 2] = xbc[c];
            xo[c] = silu(acc);
        }
        const float *Bv = xo + di, *Cv = xo + di + N;
        const float *hin = ssm + slot[r] * ssm_slot + src[r] * ssm_snap;
        float *hout = ssm + slot[r] * ssm_slot + dst[r] * ssm_snap, *yr = y + (int64_t)r * di;
        double ss = 0.0;
        for (int h = 0; h < H; h++) {
            float dt = softplus(dtr[h] + dt_bias[h]), dA = expf(dt * A[h]);
            for (int p = 0; p < P; p++) {
                int ch = h * P + p;
                float dx = dt * xo[ch], acc = 0.0f;
                const float *hi = hin + (int64_t)ch * N;
                float *ho = hout + (int64_t)ch * N;
                for (int n = 0; n < N; n++) {
                    float v = dA * hi[n] + dx * Bv[n];
                    ho[n] = v;
                    acc += v * Cv[n];
                }
                float v = (acc + xo[ch] * D[h]) * silu(z[ch]);
                yr[ch] = v;
                ss += (double)v * v;
            }
        }
        float scale = 1.0f / sqrtf((float)(ss / di) + eps);
        for (int c = 0; c < di; c++)
            yr[c] = yr[c] * scale * norm_w[c];
    }
    return 0;
}
