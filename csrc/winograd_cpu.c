/* flashrt CPU kernels: the transforms of a 3-tap conv as Winograd F(4, 3) (Lavin & Gray 2016).
 *
 * `flashrt.nn.winograd_conv.WinogradPlan`: a stride-1 conv of 3 taps (dilation d, 'same' padding) on
 * rows is, per dilation phase, an undilated 3-tap conv of the phase's S = T / d steps. Per tile of 4
 * outputs y[4 i .. 4 i + 3] it takes the 6 inputs d_k = x[4 i - 1 + k] (zero outside the sequence):
 *     V_j = sum_k B[j][k] d_k       (6 transformed inputs: `flashrt_wino43_in`)
 *     M_j = U_j V_j                 (6 products, U_j = sum_k G[j][k] W_k: one grouped GEMM, oneDNN)
 *     y_t = sum_j A[t][j] M_j + b   (4 outputs: `flashrt_wino43_out`)
 * with the interpolation points 0, 1, -1, 2, -2 and infinity:
 *     B = [4 0 -5 0 1 0; 0 -4 -4 1 1 0; 0 4 -4 -1 1 0; 0 -2 -1 2 1 0; 0 2 -1 -2 1 0; 0 4 0 -5 0 1]
 *     A = [1 1 1 1 1 0; 0 1 -1 2 -2 0; 0 1 1 4 4 0; 0 1 -1 8 -8 1]
 * 6 products per 4 outputs instead of 12: half the direct conv's FLOPs, for the two light passes here.
 * Layouts (channels-last): x (S, D, C), the D phases side by side (the (T/d, d) view of a (T, C)
 * sequence); v (tiles, D, 6, C), a pixel per (tile, phase) with the 6 groups' channels together, as
 * the grouped GEMM reads them; products m (tiles, D, 6, O); y (S, D, O). C, O % VW == 0.
 *
 * Built with the other *_cpu.c into one library by `flashrt.runtime.csrc_cpu`.
 */
#include <stdint.h>
#ifdef __AVX512F__
#define VW 16
#else
#define VW 8
#endif
typedef float vf __attribute__((vector_size(4 * VW)));
typedef float vfu __attribute__((vector_size(4 * VW), aligned(4)));
static inline vf ld(const float *p) { return *(const vfu *)p; }
static inline void st(float *p, vf v) { *(vfu *)p = v; }

/* x: the first T (<= S D) rows of (S, D, C) (D dilation phases of S steps each, side by side; the
   sequence (T, C) read as its (T / d, d) view); v: (tiles, D, 6, C), tiles = ceil(S / 4):
   v[i, p, j] = sum_k B[j][k] x[4 i - 1 + k, p] (zero outside the T rows). C % VW == 0. */
int flashrt_wino43_in(const float *x, float *v, int64_t T, int64_t S, int64_t D, int64_t C) {
    if (C % VW || T > S * D) return 1;
    const int64_t tiles = (S + 3) / 4, W = D * C;
    for (int64_t i = 0; i < tiles; i++) {
        const float *rows[6];
        for (int k = 0; k < 6; k++) { int64_t s = 4 * i - 1 + k; rows[k] = (s >= 0 && s < S) ? x + s * W : 0; }
        for (int64_t p = 0; p < D; p++) {
            float *vi = v + (i * D + p) * 6 * C;
            for (int64_t c = 0; c < C; c += VW) {
                vf d[6];
                for (int k = 0; k < 6; k++)
                    d[k] = rows[k] && (rows[k] - x) / C + p < T ? ld(rows[k] + p * C + c) : (vf){0};
                st(vi + 0 * C + c, 4.0f * d[0] - 5.0f * d[2] + d[4]);
                st(vi + 1 * C + c, -4.0f * d[1] - 4.0f * d[2] + d[3] + d[4]);
                st(vi + 2 * C + c, 4.0f * d[1] - 4.0f * d[2] - d[3] + d[4]);
                st(vi + 3 * C + c, -2.0f * d[1] - d[2] + 2.0f * d[3] + d[4]);
                st(vi + 4 * C + c, 2.0f * d[1] - d[2] - 2.0f * d[3] + d[4]);
                st(vi + 5 * C + c, 4.0f * d[1] - 5.0f * d[3] + d[5]);
            }
        }
    }
    return 0;
}

/* m: (tiles, D, 6, O) products -> y: (S, D, O): y[4 i + t, p] = sum_j A[t][j] m[i, p, j] + bias. */
int flashrt_wino43_out(const float *m, float *y, int64_t S, int64_t D, int64_t O, const float *bias) {
    if (O % VW) return 1;
    const int64_t tiles = (S + 3) / 4, W = D * O;
    for (int64_t i = 0; i < tiles; i++)
        for (int64_t p = 0; p < D; p++) {
            const float *mi = m + (i * D + p) * 6 * O;
            for (int64_t c = 0; c < O; c += VW) {
                vf a[6];
                for (int j = 0; j < 6; j++) a[j] = ld(mi + j * O + c);
                const vf b = bias ? ld(bias + c) : (vf){0};
                const vf s12 = a[1] + a[2], d12 = a[1] - a[2], s34 = a[3] + a[4], d34 = a[3] - a[4];
                const vf out[4] = {a[0] + s12 + s34 + b, d12 + 2.0f * d34 + b, s12 + 4.0f * s34 + b,
                                   d12 + 8.0f * d34 + a[5] + b};
                for (int t = 0; t < 4; t++)
                    if (4 * i + t < S) st(y + (4 * i + t) * W + p * O + c, out[t]);
            }
        }
    return 0;
}
