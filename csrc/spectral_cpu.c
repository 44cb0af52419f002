/* flashrt CPU kernel: the small batched GEMM of the block-spectral convs' DFTs.
 *
 *   out_r = A_r @ B_r,  r < R      A_r (M, K), B_r (K, N), out_r (M, N), each strided (batch, row)
 *
 * The DFTs: one A (a_batch 0), B_r the overlapping windows of a sequence read in place (b_batch =
 * hop C, b_row = C) or a block's product points; out (R, M, N) contiguous. (The strides also fit the
 * per-frequency products, r a group; measured 1.3-2x oneDNN's grouped conv at <= 40 rows, level to
 * 9 % slower from 146 rows, and no gain inside HiFi-GAN V1 at 32 channels: not used for them.)
 *
 * `flashrt.nn.spectral_conv.SpectralPlan`: the forward DFT (A the (P, N) DFT points, B_r a block of N
 * steps of C channels) and the inverse (A the (H, P) inverse, B_r a block's P product points of O
 * channels). K is small (12-64), M 10-64, N 64-256: torch's batched matmul (MKL) runs these at ~55
 * GFLOP/s on the dev CPU; a register tile of MR rows of A by NV vectors of N, accumulated over k in
 * order, runs them 1.5-2.3x faster. Each output is sum_k A[m, k] B_r[k, n], added in k order with
 * fused multiply-adds, whatever its row, batch or position.
 *
 * Built with csrc/anti_alias_cpu.c into one library by `flashrt.runtime.csrc_cpu` (its header comment
 * has the build and the vector conventions). N % VW == 0.
 */
#include <stdint.h>

#ifdef __AVX512F__
#define VW 16
#else
#define VW 8
#endif
#define MR 6                        /* rows of A per register tile */
#define NV 4                        /* vectors of N per register tile */

typedef float vf __attribute__((vector_size(4 * VW)));
typedef float vfu __attribute__((vector_size(4 * VW), aligned(4)));

static inline vf ld(const float *p) { return *(const vfu *)p; }
static inline void st(float *p, vf v) { *(vfu *)p = v; }

static inline __attribute__((always_inline)) void tile(const float *restrict a, int64_t a_row, int64_t K,
        const float *restrict b, int64_t b_row, float *restrict c, int64_t c_row, const int mr, const int nv) {
    vf acc[MR][NV];
    for (int i = 0; i < mr; i++)
        for (int n = 0; n < nv; n++) acc[i][n] = (vf){0};
    for (int64_t k = 0; k < K; k++) {
        vf w[NV];
        for (int n = 0; n < nv; n++) w[n] = ld(b + k * b_row + VW * n);
        for (int i = 0; i < mr; i++) {
            const vf x = (vf){0} + a[i * a_row + k];
            for (int n = 0; n < nv; n++) acc[i][n] += x * w[n];
        }
    }
    for (int i = 0; i < mr; i++)
        for (int n = 0; n < nv; n++) st(c + i * c_row + VW * n, acc[i][n]);
}

/* One (mr, nv) tile with both as compile-time constants (mr <= MR, nv in 1, 2, 4). */
static void tile_any(const float *a, int64_t a_row, int64_t K, const float *b, int64_t b_row, float *c,
                     int64_t c_row, int mr, int nv) {
#define TILES(NVC) switch (mr) { \
        case 6: tile(a, a_row, K, b, b_row, c, c_row, 6, NVC); break; \
        case 5: tile(a, a_row, K, b, b_row, c, c_row, 5, NVC); break; \
        case 4: tile(a, a_row, K, b, b_row, c, c_row, 4, NVC); break; \
        case 3: tile(a, a_row, K, b, b_row, c, c_row, 3, NVC); break; \
        case 2: tile(a, a_row, K, b, b_row, c, c_row, 2, NVC); break; \
        default: tile(a, a_row, K, b, b_row, c, c_row, 1, NVC); }
    if (nv == 4) { TILES(4) }
    else if (nv == 2) { TILES(2) }
    else { TILES(1) }
#undef TILES
}

/* out_r = A_r @ B_r for r < R: A_r (M, K) at a + r a_batch, rows a_row apart (a_batch 0: one A for all);
   B_r (K, N) at b + r b_batch, rows b_row apart; out_r (M, N) at out + r c_batch, rows c_row apart. */
int flashrt_bgemm(const float *a, int64_t a_batch, int64_t a_row, int64_t M, int64_t K, const float *b,
                  int64_t b_batch, int64_t b_row, int64_t R, int64_t N, float *out, int64_t c_batch,
                  int64_t c_row, int threads) {
    if (N % VW || M < 1 || K < 1) return 1;
    (void)threads;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < R; r++) {
        const float *ar = a + r * a_batch, *br = b + r * b_batch;
        float *cr = out + r * c_batch;
        for (int64_t n0 = 0; n0 < N; ) {
            const int64_t left = (N - n0) / VW;
            const int nv = left >= 4 ? 4 : (left >= 2 ? 2 : 1);
            for (int64_t m0 = 0; m0 < M; m0 += MR) {
                const int mr = M - m0 < MR ? (int)(M - m0) : MR;
                tile_any(ar + m0 * a_row, a_row, K, br + n0, b_row, cr + m0 * c_row + n0, c_row, mr, nv);
            }
            n0 += (int64_t)nv * VW;
        }
    }
    return 0;
}
