/* Decode-sized quantized linear layers on the CPU: y = x @ dequant(W)^T for 1-64 rows of x, reading W in
   mlx-lm's packed affine format where it lies (no float copy of the weights).

   W [N, K] is stored as uint32 words, K * bits / 32 per row (element e*w + j at bits `bits * j` of word w,
   e = 32 / bits), with float32 scales s and biases b [N, K / gs]: W[n, k] = s[n, g] * code + b[n, g] for
   k in group g. So y[m, n] = sum_g s[n, g] (sum_{k in g} x[m, k] code[n, k]) + sum_g b[n, g] xsum[m, g],
   with xsum the per-group sums of x.

   Why a kernel: MLX's CPU quantized_matmul runs scalar code (far below memory bandwidth), so JustFit used
   to dequantize every weight to float32 and read 8x the bytes per token. Here x is permuted once per call
   so that lane w of a vector of words meets x[e * w + j] when code j of every word is unpacked (shift,
   mask, convert: no shuffles in the inner loop), the unpacked codes of a row serve up to 4 rows of x, and
   the per-group scale multiplies a vector partial sum once per group (a permute spreads a block's scales
   over its lanes when a vector spans several groups).

   qmm(x, M, K, jobs, njobs, bits, gs, variant, threads): every job (job_t) is one weight with its own N
   and output, all sharing x [M, K] (q/k/v or gate/up projections read the same input: one call, one host
   synchronization). variant: 1 AVX2+FMA, 2 AVX-512 (x86-64, chosen at run time from the CPU's flags and
   a timing), 3 NEON (compiled only on arm64; not run on the x86-64 machine this was written on). Output
   rows are dealt to `threads` threads of a persistent pool. Returns 0, or -1 for what it does not take. */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#if defined(__aarch64__)
#include <arm_neon.h>
#endif

#define MAX_ROWS 64
#define MAX_THREADS 16
#define AI static inline __attribute__((always_inline))

typedef struct {
    const uint32_t* w;
    const float *s, *b;
    float* y;
    int64_t n, ldy; /* output rows (features) of this weight; y's row stride (elements) */
} job_t;

typedef struct {
    const float *xp, *xsum; /* x permuted per vector block [M, Kp]; per-group sums [M, G] */
    const job_t* jobs;
    int M, K, Kp, G, bits, gs, variant, njobs, threads;
    int64_t total;
} task_t;

/* ---- the row loop, one copy per vector width; R rows of x (a constant after inlining) ---- */

#if defined(__x86_64__)
#define T512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,fma,avx2")))
#define T256 __attribute__((target("avx2,fma")))

T512 AI void row512(const task_t* t, const job_t* jb, int64_t n, int m0, const int R, const int bits) {
    const int E = 32 / bits, L = 16, B = L * E, W = t->K * bits / 32, nv = (W + L - 1) / L;
    const int wpg = t->gs * bits / 32, G = t->G;
    const uint32_t* wr = jb->w + n * W;
    const float *sr = jb->s + n * G, *br = jb->b + n * G;
    const __mmask16 tail = (W % L) ? (__mmask16)((1u << (W % L)) - 1) : (__mmask16)0xFFFF;
    const __m512i idx = _mm512_srlv_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                          _mm512_set1_epi32(wpg == 4 ? 2 : wpg == 8 ? 3 : 4));
    const __m512i mask = _mm512_set1_epi32((1 << bits) - 1);
    __m512 acc[4];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int v = 0; v < nv; v++) {
        __m512i wv = v == nv - 1 ? _mm512_maskz_loadu_epi32(tail, wr + (size_t)v * L)
                                 : _mm512_loadu_si512((const void*)(wr + (size_t)v * L));
        __m512 part[4];
        for (int r = 0; r < R; r++) part[r] = _mm512_setzero_ps();
        for (int j = 0; j < E; j++) {
            __m512 c = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srlv_epi32(wv, _mm512_set1_epi32(bits * j)), mask));
            for (int r = 0; r < R; r++)
                part[r] = _mm512_fmadd_ps(c, _mm512_loadu_ps(t->xp + (size_t)(m0 + r) * t->Kp + (size_t)v * B + j * L), part[r]);
        }
        __m512 sc;
        if (wpg >= L) {
            sc = _mm512_set1_ps(sr[v * L / wpg]);
        } else {
            int g0 = v * L / wpg, ng = G - g0 < L / wpg ? G - g0 : L / wpg;
            sc = _mm512_permutexvar_ps(idx, _mm512_maskz_loadu_ps((__mmask16)((1u << ng) - 1), sr + g0));
        }
        for (int r = 0; r < R; r++) acc[r] = _mm512_fmadd_ps(sc, part[r], acc[r]);
    }
    for (int r = 0; r < R; r++) {
        float y = _mm512_reduce_add_ps(acc[r]);
        const float* xs = t->xsum + (size_t)(m0 + r) * G;
        for (int g = 0; g < G; g++) y += br[g] * xs[g];
        jb->y[(size_t)(m0 + r) * jb->ldy + n] = y;
    }
}

T256 AI float hsum256(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(x, _mm_shuffle_ps(x, x, 1)));
}

T256 AI void row256(const task_t* t, const job_t* jb, int64_t n, int m0, const int R, const int bits) {
    const int E = 32 / bits, L = 8, B = L * E, W = t->K * bits / 32, nv = (W + L - 1) / L;
    const int wpg = t->gs * bits / 32, G = t->G;
    const uint32_t* wr = jb->w + n * W;
    const float *sr = jb->s + n * G, *br = jb->b + n * G;
    const int rem = W % L ? W % L : L;
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i tail = _mm256_cmpgt_epi32(_mm256_set1_epi32(rem), lanes);
    const __m256i idx = _mm256_srlv_epi32(lanes, _mm256_set1_epi32(wpg == 4 ? 2 : 3));
    const __m256i mask = _mm256_set1_epi32((1 << bits) - 1);
    __m256 acc[4];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int v = 0; v < nv; v++) {
        __m256i wv = v == nv - 1 ? _mm256_maskload_epi32((const int*)(wr + (size_t)v * L), tail)
                                 : _mm256_loadu_si256((const __m256i*)(wr + (size_t)v * L));
        __m256 part[4];
        for (int r = 0; r < R; r++) part[r] = _mm256_setzero_ps();
        for (int j = 0; j < E; j++) {
            __m256 c = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(wv, _mm256_set1_epi32(bits * j)), mask));
            for (int r = 0; r < R; r++)
                part[r] = _mm256_fmadd_ps(c, _mm256_loadu_ps(t->xp + (size_t)(m0 + r) * t->Kp + (size_t)v * B + j * L), part[r]);
        }
        __m256 sc;
        if (wpg >= L) {
            sc = _mm256_set1_ps(sr[v * L / wpg]);
        } else { /* wpg == 4: two groups per vector */
            int g0 = v * L / wpg, ng = G - g0 < 2 ? G - g0 : 2;
            __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32(ng), lanes);
            sc = _mm256_permutevar8x32_ps(_mm256_maskload_ps(sr + g0, m), idx);
        }
        for (int r = 0; r < R; r++) acc[r] = _mm256_fmadd_ps(sc, part[r], acc[r]);
    }
    for (int r = 0; r < R; r++) {
        float y = hsum256(acc[r]);
        const float* xs = t->xsum + (size_t)(m0 + r) * G;
        for (int g = 0; g < G; g++) y += br[g] * xs[g];
        jb->y[(size_t)(m0 + r) * jb->ldy + n] = y;
    }
}

#define ROWS(NAME, ATTR, FN)                                                                      \
    ATTR static void NAME(const task_t* t, const job_t* jb, int64_t n0, int64_t n1) {             \
        for (int64_t n = n0; n < n1; n++)                                                         \
            for (int m0 = 0; m0 < t->M; m0 += 4) {                                                \
                int R = t->M - m0 < 4 ? t->M - m0 : 4;                                            \
                if (t->bits == 4) {                                                               \
                    if (R == 4) FN(t, jb, n, m0, 4, 4); else if (R == 3) FN(t, jb, n, m0, 3, 4);  \
                    else if (R == 2) FN(t, jb, n, m0, 2, 4); else FN(t, jb, n, m0, 1, 4);         \
                } else {                                                                          \
                    if (R == 4) FN(t, jb, n, m0, 4, 8); else if (R == 3) FN(t, jb, n, m0, 3, 8);  \
                    else if (R == 2) FN(t, jb, n, m0, 2, 8); else FN(t, jb, n, m0, 1, 8);         \
                }                                                                                 \
            }                                                                                     \
    }
ROWS(rows512, T512, row512)
ROWS(rows256, T256, row256)
#endif

#if defined(__aarch64__)
/* NEON: 4 words a vector; a group spans at least 4 words (gs >= 32), so one scale per vector. */
AI void row_neon(const task_t* t, const job_t* jb, int64_t n, int m0, const int R, const int bits) {
    const int E = 32 / bits, L = 4, B = L * E, W = t->K * bits / 32, nv = W / L;
    const int wpg = t->gs * bits / 32, G = t->G;
    const uint32_t* wr = jb->w + n * W;
    const float *sr = jb->s + n * G, *br = jb->b + n * G;
    const uint32x4_t mask = vdupq_n_u32((1u << bits) - 1);
    float32x4_t acc[4];
    for (int r = 0; r < R; r++) acc[r] = vdupq_n_f32(0);
    for (int v = 0; v < nv; v++) {
        uint32x4_t wv = vld1q_u32(wr + (size_t)v * L);
        float32x4_t part[4];
        for (int r = 0; r < R; r++) part[r] = vdupq_n_f32(0);
        for (int j = 0; j < E; j++) {
            float32x4_t c = vcvtq_f32_u32(vandq_u32(vshlq_u32(wv, vdupq_n_s32(-bits * j)), mask));
            for (int r = 0; r < R; r++)
                part[r] = vfmaq_f32(part[r], c, vld1q_f32(t->xp + (size_t)(m0 + r) * t->Kp + (size_t)v * B + j * L));
        }
        float32x4_t sc = vdupq_n_f32(sr[v * L / wpg]);
        for (int r = 0; r < R; r++) acc[r] = vfmaq_f32(acc[r], sc, part[r]);
    }
    for (int r = 0; r < R; r++) {
        float y = vaddvq_f32(acc[r]);
        const float* xs = t->xsum + (size_t)(m0 + r) * G;
        for (int g = 0; g < G; g++) y += br[g] * xs[g];
        jb->y[(size_t)(m0 + r) * jb->ldy + n] = y;
    }
}

static void rows_neon(const task_t* t, const job_t* jb, int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++)
        for (int m0 = 0; m0 < t->M; m0 += 4) {
            int R = t->M - m0 < 4 ? t->M - m0 : 4;
            if (t->bits == 4) {
                if (R == 4) row_neon(t, jb, n, m0, 4, 4); else if (R == 3) row_neon(t, jb, n, m0, 3, 4);
                else if (R == 2) row_neon(t, jb, n, m0, 2, 4); else row_neon(t, jb, n, m0, 1, 4);
            } else {
                if (R == 4) row_neon(t, jb, n, m0, 4, 8); else if (R == 3) row_neon(t, jb, n, m0, 3, 8);
                else if (R == 2) row_neon(t, jb, n, m0, 2, 8); else row_neon(t, jb, n, m0, 1, 8);
            }
        }
}
#endif

/* Rows [part * total / threads, (part + 1) * total / threads) of the jobs' outputs laid end to end. */
static void run_part(const task_t* t, int part) {
    int64_t lo = t->total * part / t->threads, hi = t->total * (part + 1) / t->threads, base = 0;
    for (int i = 0; i < t->njobs && base < hi; i++) {
        const job_t* jb = &t->jobs[i];
        int64_t a = lo > base ? lo - base : 0, b = hi - base < jb->n ? hi - base : jb->n;
        if (a < b) {
#if defined(__x86_64__)
            if (t->variant == 2) rows512(t, jb, a, b); else rows256(t, jb, a, b);
#elif defined(__aarch64__)
            rows_neon(t, jb, a, b);
#endif
        }
        base += jb->n;
    }
}

/* ---- a persistent pool: workers sleep on a condition variable between calls ---- */

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake = PTHREAD_COND_INITIALIZER, done = PTHREAD_COND_INITIALIZER;
static pthread_mutex_t call_mu = PTHREAD_MUTEX_INITIALIZER; /* one call at a time owns the pool */
static const task_t* current;
static int64_t generation;
static int started, pending;

static void* worker(void* arg) {
    int part = (int)(intptr_t)arg;
    int64_t seen = 0;
    pthread_mutex_lock(&mu);
    for (;;) {
        while (generation == seen) pthread_cond_wait(&wake, &mu);
        seen = generation;
        const task_t* t = current;
        pthread_mutex_unlock(&mu);
        if (part < t->threads) run_part(t, part);
        pthread_mutex_lock(&mu);
        if (--pending == 0) pthread_cond_signal(&done);
    }
    return NULL;
}

static void run_all(const task_t* t) {
    pthread_mutex_lock(&mu);
    while (started < t->threads - 1) {
        pthread_t id;
        if (pthread_create(&id, NULL, worker, (void*)(intptr_t)(started + 1)) != 0) break;
        pthread_detach(id);
        started++;
    }
    task_t local = *t;
    if (local.threads > started + 1) local.threads = started + 1;
    if (local.threads > 1) {
        current = &local;
        pending = started;
        generation++;
        pthread_cond_broadcast(&wake);
    }
    pthread_mutex_unlock(&mu);
    run_part(&local, 0);
    if (local.threads > 1) {
        pthread_mutex_lock(&mu);
        while (pending > 0) pthread_cond_wait(&done, &mu);
        pthread_mutex_unlock(&mu);
    }
}

static int lanes(int variant) { return variant == 2 ? 16 : variant == 1 ? 8 : 4; }

int qmm_variants(void) { /* bit v set: variant v compiled in (the caller checks the CPU's flags) */
#if defined(__x86_64__)
    return (1 << 1) | (1 << 2);
#elif defined(__aarch64__)
    return 1 << 3;
#else
    return 0;
#endif
}

int qmm(const float* x, int M, int K, const job_t* jobs, int njobs, int bits, int gs, int variant, int threads) {
    if (M < 1 || M > MAX_ROWS || (bits != 4 && bits != 8) || (gs != 32 && gs != 64 && gs != 128) || K % gs)
        return -1;
    if (!(qmm_variants() & (1 << variant))) return -1;
    const int L = lanes(variant), E = 32 / bits, B = L * E, G = K / gs;
    const int Kp = (K + B - 1) / B * B;
    float* xp = calloc((size_t)M * Kp + (size_t)M * G, sizeof(float));
    if (!xp) return -1;
    float* xsum = xp + (size_t)M * Kp;
    for (int m = 0; m < M; m++) { /* block b, word w, code j: x[b B + w E + j] goes to xp[b B + j L + w] */
        const float* xr = x + (size_t)m * K;
        float* xo = xp + (size_t)m * Kp;
        for (int b = 0, k = 0; b < Kp; b += B)
            for (int w = 0; w < L; w++)
                for (int j = 0; j < E; j++, k++)
                    if (k < K) xo[b + j * L + w] = xr[k];
        for (int g = 0; g < G; g++) {
            float sum = 0;
            for (int k = g * gs; k < (g + 1) * gs; k++) sum += xr[k];
            xsum[(size_t)m * G + g] = sum;
        }
    }
    task_t t = {xp, xsum, jobs, M, K, Kp, G, bits, gs, variant, njobs, threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads, 0};
    for (int i = 0; i < njobs; i++) t.total += jobs[i].n;
    pthread_mutex_lock(&call_mu);
    run_all(&t);
    pthread_mutex_unlock(&call_mu);
    free(xp);
    return 0;
}
