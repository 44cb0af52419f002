/* flashrt CPU kernel: BigVGAN's anti-aliased snake activation in one pass over channels-last rows.
 *
 *   out = down2(snake(up2(x)))      x, out: (B, T, C) float32 (rows stored channels-last), C % 16 == 0
 *
 * up2:   the 2x band-limited upsampler with replicate padding (`flashrt.nn.alias_free.UpSample1d`, 12
 *        taps, its filter pre-scaled by 2): y[j] = sum_k up[k] x[clamp((j + 15 - k) / 2 - 5)] over the
 *        k with j + 15 - k even (six per output: its polyphase form).
 * snake: z = y + inv[c] sin^2(freq[c] y) (Snake and SnakeBeta, their derived per-channel buffers).
 * down2: the 12-tap low-pass, stride 2, replicate padding (`DownSample1d`):
 *        out[t] = sum_k down[k] z[clamp(2 t + k - 5)].
 * clamp(i) = min(max(i, 0), n - 1) on that sequence: replicate padding is the clamp of an index.
 *
 * The upsampled signal never leaves the cache: per tile of TILE output steps and block of up to 64
 * channels, its 2 TILE + 11 steps are made in a small buffer, activated, and filtered down. Every value
 * is computed by the same lane-wise vector code whatever its position, tile or channel block, so a
 * window of a stream computes each sample away from its ends exactly as the whole sequence does.
 *
 * sin^2: t = q pi/2 + r (q the nearest integer, three-part pi/2), |r| <= pi/4; sin^2 t = sin^2 r for
 * even q, cos^2 r for odd q (no sign to track). The minimax polynomials for sin and cos on [-pi/4, pi/4]
 * are the classic single-precision ones (about 1 ulp); q is rounded with the 1.5 * 2^23 shift, valid
 * for |t| < 2^22 (snake arguments are freq * y, a few hundred at most).
 *
 * Built by `flashrt.runtime.csrc_cpu` with the machine's C compiler (-O3 -march=native; OpenMP where
 * the compiler has it). GCC/Clang vector extensions: a vector is one register of the target (16 floats
 * with AVX-512, else 8: AVX2 or two SSE/NEON registers), a channel block up to MAXV of them. No torch
 * header: a C ABI of raw pointers.
 */
#include <stdint.h>

#define FLASHRT_CPU_ABI 1
#define TILE 64                     /* output steps per tile */
#define ZROWS (2 * TILE + 12)       /* upsampled steps a tile reads */
#define MAXV 4                      /* vectors per channel block */
#ifdef __AVX512F__
#define VW 16                       /* floats per vector */
#else
#define VW 8
#endif
#define BLOCK (MAXV * VW)           /* channels per block */

typedef float vf __attribute__((vector_size(4 * VW)));
typedef int32_t vi __attribute__((vector_size(4 * VW)));
typedef float vfu __attribute__((vector_size(4 * VW), aligned(4)));

int flashrt_cpu_abi(void) { return FLASHRT_CPU_ABI; }

static inline vf ld(const float *p) { return *(const vfu *)p; }
static inline void st(float *p, vf v) { *(vfu *)p = v; }
static inline vf splat(float a) { return (vf){0} + a; }
static inline int64_t clampi(int64_t i, int64_t n) { return i < 0 ? 0 : (i >= n ? n - 1 : i); }

static inline vf sin2(vf t) {
    const vf shift = splat(12582912.0f);                         /* 1.5 * 2^23 */
    vf y = t * splat(0.63661977236758134f) + shift;
    vf q = y - shift;
    vi odd = -(((vi)y) & 1);                                    /* all ones where q is odd */
    vf r = t - q * splat(1.5703125f);
    r = r - q * splat(4.8375129699707031e-4f);
    r = r - q * splat(7.5497899548918821e-8f);
    vf z = r * r;
    vf s = r + r * z * (splat(-1.6666654611e-1f) + z * (splat(8.3321608736e-3f) + z * splat(-1.9515295891e-4f)));
    vf c = splat(1.0f) - splat(0.5f) * z
         + z * z * (splat(4.166664568298827e-2f) + z * (splat(-1.388731625493765e-3f) + z * splat(2.443315711809948e-5f)));
    vf v = (vf)(((vi)c & odd) | ((vi)s & ~odd));
    return v * v;
}

/* One channel block of nv vectors (VW nv channels) of one sequence. */
static inline __attribute__((always_inline)) void block(
        const float *restrict x, float *restrict out, int64_t T, int64_t C, const int nv,
        const int *restrict up_at, const float *restrict up_w, const float *restrict down,
        const float *restrict freq, const float *restrict inv, float *restrict zbuf) {
    vf fq[MAXV], iv[MAXV];
    for (int n = 0; n < nv; n++) { fq[n] = ld(freq + VW * n); iv[n] = ld(inv + VW * n); }
    for (int64_t t0 = 0; t0 < T; t0 += TILE) {
        const int64_t t1 = t0 + TILE < T ? t0 + TILE : T, zs = 2 * t0 - 5, ze = 2 * t1 + 6;
        for (int64_t j = zs; j < ze; j++) {                     /* upsampled step j = 2 m + p */
            const int64_t jc = clampi(j, 2 * T), m = jc >> 1, p = jc & 1;
            vf acc[MAXV];
            for (int n = 0; n < nv; n++) acc[n] = splat(0.0f);
            for (int a = 0; a < 6; a++) {
                const float *row = x + clampi(m + up_at[6 * p + a], T) * C;
                const vf w = splat(up_w[6 * p + a]);
                for (int n = 0; n < nv; n++) acc[n] += w * ld(row + VW * n);
            }
            float *zr = zbuf + (j - zs) * VW * nv;
            for (int n = 0; n < nv; n++) st(zr + VW * n, acc[n] + iv[n] * sin2(fq[n] * acc[n]));
        }
        for (int64_t t = t0; t < t1; t++) {
            vf acc[MAXV];
            for (int n = 0; n < nv; n++) acc[n] = splat(0.0f);
            for (int k = 0; k < 12; k++) {
                const float *zr = zbuf + (2 * t + k - 5 - zs) * VW * nv;
                const vf w = splat(down[k]);
                for (int n = 0; n < nv; n++) acc[n] += w * ld(zr + VW * n);
            }
            for (int n = 0; n < nv; n++) st(out + t * C + VW * n, acc[n]);
        }
    }
}

/* x, out (B, T, C) contiguous; up, down (12,); freq, inv (C,). Returns 0, or 1 when C % 16 != 0. */
int flashrt_aa_snake(const float *x, float *out, int64_t B, int64_t T, int64_t C, const float *up,
                     const float *down, const float *freq, const float *inv, int threads) {
    if (C % 16 || T < 1) return 1;
    int up_at[12];
    float up_w[12];
    for (int p = 0; p < 2; p++) {                               /* polyphase taps, input order */
        int n = 0;
        for (int k = 11; k >= 0; k--) {
            if ((p + 15 - k) & 1) continue;
            up_at[6 * p + n] = (p + 15 - k) / 2 - 5;
            up_w[6 * p + n] = up[k];
            n++;
        }
    }
    const int64_t blocks = (C + BLOCK - 1) / BLOCK;
    (void)threads;
    #pragma omp parallel for collapse(2) num_threads(threads) schedule(static)
    for (int64_t b = 0; b < B; b++) {
        for (int64_t cb = 0; cb < blocks; cb++) {
            float zbuf[ZROWS * BLOCK];
            const int64_t c0 = BLOCK * cb, nv = (C - c0 < BLOCK ? C - c0 : BLOCK) / VW;
            const float *xb = x + b * T * C + c0;
            float *ob = out + b * T * C + c0;
            if (nv == 4) block(xb, ob, T, C, 4, up_at, up_w, down, freq + c0, inv + c0, zbuf);
            else if (nv == 3) block(xb, ob, T, C, 3, up_at, up_w, down, freq + c0, inv + c0, zbuf);
            else if (nv == 2) block(xb, ob, T, C, 2, up_at, up_w, down, freq + c0, inv + c0, zbuf);
            else block(xb, ob, T, C, 1, up_at, up_w, down, freq + c0, inv + c0, zbuf);
        }
    }
    return 0;
}
