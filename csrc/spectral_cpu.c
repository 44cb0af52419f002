/* flashrt CPU kernel: the small batched GEMM of the block-spectral convs' DFTs.
 *
 *   out[r] = A @ B_r,   r < R      A (M, K) row-major; B_r (K, N) at b + r * b_batch, rows b_row apart
 *                                   (the overlapping windows of a sequence, read in place: b_batch = hop C,
 *                                   b_row = C; or the products' spectra, contiguous); out (R, M, N)
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

static inline __attribute__((always_inline)) void tile(const float *restrict a, int64_t K,
        const float *restrict b, int64_t b_row, float *restrict c, int64_t c_row, const int mr, const int nv) {
    vf acc[MR][NV];
    for (int i = 0; i < mr; i++)
        for (int n = 0; n < nv; n++) acc[i][n] = (vf){0};
    for (int64_t k = 0; k < K; k++) {
        vf w[NV];
        for (int n = 0; n < nv; n++) w[n] = ld(b + k * b_row + VW * n);
        for (int i = 0; i < mr; i++) {
            const vf x = (vf){0} + a[i * K + k];
            for (int n = 0; n < nv; n++) acc[i][n] += x * w[n];
        }
    }
    for (int i = 0; i < mr; i++)
        for (int n = 0; n < nv; n++) st(c + i * c_row + VW * n, acc[i][n]);
}

/* One (mr, nv) tile with both as compile-time constants (mr <= MR, nv in 1, 2, 4). */
static void tile_any(const float *a, int64_t K, const float *b, int64_t b_row, float *c, int64_t c_row,
                     int mr, int nv) {
#define TILES(NVC) switch (mr) { \
        case 6: tile(a, K, b, b_row, c, c_row, 6, NVC); break; \
        case 5: tile(a, K, b, b_row, c, c_row, 5, NVC); break; \
        case 4: tile(a, K, b, b_row, c, c_row, 4, NVC); break; \
        case 3: tile(a, K, b, b_row, c, c_row, 3, NVC); break; \
        case 2: tile(a, K, b, b_row, c, c_row, 2, NVC); break; \
        default: tile(a, K, b, b_row, c, c_row, 1, NVC); }
    if (nv == 4) { TILES(4) }
    else if (nv == 2) { TILES(2) }
    else { TILES(1) }
#undef TILES
}

int flashrt_bgemm(const float *a, int64_t M, int64_t K, const float *b, int64_t b_batch, int64_t b_row,
                  int64_t R, int64_t N, float *out, int threads) {
    if (N % VW || M < 1 || K < 1) return 1;
    (void)threads;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < R; r++) {
        const float *br = b + r * b_batch;
        float *cr = out + r * M * N;
        for (int64_t n0 = 0; n0 < N; ) {
            const int64_t left = (N - n0) / VW;
            const int nv = left >= 4 ? 4 : (left >= 2 ? 2 : 1);
            for (int64_t m0 = 0; m0 < M; m0 += MR) {
                const int mr = M - m0 < MR ? (int)(M - m0) : MR;
                tile_any(a + m0 * K, K, br + n0, b_row, cr + m0 * N + n0, N, mr, nv);
            }
            n0 += (int64_t)nv * VW;
        }
    }
    return 0;
}
