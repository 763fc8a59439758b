/* One decode query over a layer's KV pages, for x86-64 CPUs with AVX2 and FMA (JustFit's default 4-bit
   format: channel keys, affine values).

   MLX's CPU quantized_matmul handles one query row at a time with scalar code (~2 GMAC/s here), so decode
   over 4-bit pages ran no faster than float32 BLAS over 7x the bytes. This loop unpacks each 4-bit code
   once into 8-lane vectors and uses it for every query row of its KV head (grouped-query attention: 3-4
   rows), and does the layer's whole attention (scores, softmax, values) over every page in one call.

   q4_decode_batch(seqs, B, scratch, per_thread, X, R, D, P, threads): for each of B sequences (seq_t: q,
   its pages, np of them, out), out[x, r] = softmax(q[x, r] k^T) v over its pages in token order, for X KV
   heads with R query rows each. q [X, R, D] float32, pre-scaled; out [X, R, D]; scratch holds `threads`
   blocks of per_thread >= 4 x (the longest sequence's tokens) floats. A page (page_t) is
     kind 0: a sealed 4-bit page of P tokens. Keys: each channel quantized along 64-token groups, codes
             [X, P/64, D, 8] uint32 (token 8w + j of a group at bits 4j of word w), scales and biases
             [X, P/64, D, 1] bfloat16. Values: `mx.quantize` along D in 64-element groups, codes
             [X, P, D/8] uint32 (element 8w + j at bits 4j of word w), scales and biases [X, P, D/64]
             bfloat16. x = scale * code + bias.
     kind 1: a bfloat16 page, k and v [X, P, D] with each head's [P, D] contiguous and heads hs elements
             apart (a page sealed from a slice of a longer prefill is a strided view of it), first n tokens
             valid;
     kind 2: the same in float32 (the open page).
   D is a multiple of 64, at most 256; P a multiple of 64. Returns 0, or -1 for what it does not take (the
   caller then runs MLX's path). */
#include <immintrin.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define AI static inline __attribute__((always_inline))

typedef struct {
    int kind, n;
    const void *k, *ks, *kb, *v, *vs, *vb;
    int64_t hs;  /* float pages: elements from one head's keys (and values) to the next */
} page_t;

AI float bf16(const void* a, size_t i) {
    uint32_t x = (uint32_t)((const uint16_t*)a)[i] << 16;
    float f;
    memcpy(&f, &x, 4);
    return f;
}

AI float hsum(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_hadd_ps(x, x);
    return _mm_cvtss_f32(_mm_hadd_ps(x, x));
}

AI __m256 codes(__m256i words, int j) {  /* lane w: code j of word w (bits 4j) */
    return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(words, _mm256_set1_epi32(4 * j)),
                                               _mm256_set1_epi32(15)));
}

AI __m256 load8(const void* base, size_t i, int is_bf16) {  /* 8 floats from float32 or bfloat16 storage */
    if (!is_bf16) return _mm256_loadu_ps((const float*)base + i);
    __m128i h = _mm_loadu_si128((const __m128i*)((const uint16_t*)base + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

AI __m256 exp_neg(__m256 x) {  /* e^x for x <= 0 (Cephes expf: range reduction and a degree-6 polynomial) */
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 f = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    f = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), f);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(f, f), _mm256_add_ps(f, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

/* Scores of rows 0..R-1 (R <= 4, a constant after inlining) of head x against a sealed 4-bit page's channel
   keys, into s (row stride S): per 64-token group, sum_d (q_d scale_d) codes[d, :] + sum_d q_d bias_d, in
   two passes (tokens 8w + 0-3, then 8w + 4-7) so the R x 4 running sums stay in registers. */
AI void key_scores(const float* q, const page_t* pg, int x, int D, int P, float* s, size_t S, const int R) {
    const int NG = P / 64;
    for (int g = 0; g < NG; g++) {
        const size_t base = ((size_t)x * NG + g) * D;
        float beta[4] = {0, 0, 0, 0};
        for (int d = 0; d < D; d++) {
            float b = bf16(pg->kb, base + d);
            for (int r = 0; r < R; r++) beta[r] += q[(size_t)r * D + d] * b;
        }
        for (int half = 0; half < 2; half++) {
            __m256 acc[4][4];
            for (int r = 0; r < R; r++)
                for (int u = 0; u < 4; u++) acc[r][u] = _mm256_setzero_ps();
            for (int d = 0; d < D; d++) {
                float sc = bf16(pg->ks, base + d);
                __m256i w = _mm256_loadu_si256((const __m256i*)((const uint32_t*)pg->k + (base + d) * 8));
                __m256 qs[4];
                for (int r = 0; r < R; r++) qs[r] = _mm256_set1_ps(q[(size_t)r * D + d] * sc);
                for (int u = 0; u < 4; u++) {
                    __m256 c = codes(w, 4 * half + u);
                    for (int r = 0; r < R; r++) acc[r][u] = _mm256_fmadd_ps(qs[r], c, acc[r][u]);
                }
            }
            for (int r = 0; r < R; r++)
                for (int u = 0; u < 4; u++) {
                    float tmp[8];
                    _mm256_storeu_ps(tmp, acc[r][u]);
                    for (int k = 0; k < 8; k++) s[r * S + 64 * g + 8 * k + 4 * half + u] = tmp[k] + beta[r];
                }
        }
    }
}

/* o[r, :] += sum_t p[r, t] v[t, :] over a sealed 4-bit page's affine values: per 64-element chunk, two
   passes (elements 8w + 0-3, then 8w + 4-7), so the R x 4 running sums stay in registers. */
AI void value_mix(const float* p, size_t S, const page_t* pg, int x, int D, int P, float* o, const int R) {
    const int W = D / 8, C = D / 64;
    for (int c = 0; c < C; c++) {
        float pb[4] = {0, 0, 0, 0};
        for (int t = 0; t < P; t++) {
            float b = bf16(pg->vb, ((size_t)x * P + t) * C + c);
            for (int r = 0; r < R; r++) pb[r] += p[r * S + t] * b;
        }
        for (int half = 0; half < 2; half++) {
            __m256 acc[4][4];
            for (int r = 0; r < R; r++)
                for (int u = 0; u < 4; u++) acc[r][u] = _mm256_setzero_ps();
            for (int t = 0; t < P; t++) {
                size_t row = (size_t)x * P + t;
                float sc = bf16(pg->vs, row * C + c);
                __m256i w = _mm256_loadu_si256((const __m256i*)((const uint32_t*)pg->v + row * W + 8 * c));
                __m256 ps[4];
                for (int r = 0; r < R; r++) ps[r] = _mm256_set1_ps(p[r * S + t] * sc);
                for (int u = 0; u < 4; u++) {
                    __m256 cf = codes(w, 4 * half + u);
                    for (int r = 0; r < R; r++) acc[r][u] = _mm256_fmadd_ps(ps[r], cf, acc[r][u]);
                }
            }
            for (int r = 0; r < R; r++)
                for (int u = 0; u < 4; u++) {
                    float tmp[8];
                    _mm256_storeu_ps(tmp, acc[r][u]);
                    for (int k = 0; k < 8; k++) o[(size_t)r * D + 64 * c + 8 * k + 4 * half + u] += tmp[k];
                }
        }
        for (int r = 0; r < R; r++)
            for (int d = 0; d < 64; d++) o[(size_t)r * D + 64 * c + d] += pb[r];
    }
}

/* Scores of rows 0..R-1 against a float page's first n tokens, into s (row stride S). */
AI void float_scores(const float* q, const page_t* pg, int x, int D, int P, float* s, size_t S, const int R) {
    const int is_bf16 = pg->kind == 1;
    for (int t = 0; t < pg->n; t++) {
        size_t row = (size_t)x * pg->hs + (size_t)t * D;
        __m256 acc[4];
        for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
        for (int d = 0; d < D; d += 8) {
            __m256 k = load8(pg->k, row + d, is_bf16);
            for (int r = 0; r < R; r++) acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(q + (size_t)r * D + d), k, acc[r]);
        }
        for (int r = 0; r < R; r++) s[r * S + t] = hsum(acc[r]);
    }
}

/* o[r, :] += sum_t p[r, t] v[t, :] over a float page's first n tokens. */
AI void float_mix(const float* p, size_t S, const page_t* pg, int x, int D, int P, float* o, const int R) {
    const int is_bf16 = pg->kind == 1;
    for (int d = 0; d < D; d += 8) {
        __m256 acc[4];
        for (int r = 0; r < R; r++) acc[r] = _mm256_loadu_ps(o + (size_t)r * D + d);
        for (int t = 0; t < pg->n; t++) {
            __m256 v = load8(pg->v, (size_t)x * pg->hs + (size_t)t * D + d, is_bf16);
            for (int r = 0; r < R; r++) acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(p[r * S + t]), v, acc[r]);
        }
        for (int r = 0; r < R; r++) _mm256_storeu_ps(o + (size_t)r * D + d, acc[r]);
    }
}

/* Rows 0..R-1 (R <= 4) of head x: scores over every page, softmax in place, values. */
AI void decode_rows(const float* q, const page_t* pages, int np, float* o, float* s, size_t S, int x, int D,
                    int P, const int R) {
    size_t t0 = 0;
    for (int i = 0; i < np; i++) {
        if (pages[i].kind == 0) key_scores(q, &pages[i], x, D, P, s + t0, S, R);
        else float_scores(q, &pages[i], x, D, P, s + t0, S, R);
        t0 += pages[i].n;
    }
    float l[4];
    for (int r = 0; r < R; r++) {
        float* sr = s + r * S;
        float m = -INFINITY, tail = 0;
        for (size_t t = 0; t < S; t++) m = sr[t] > m ? sr[t] : m;
        __m256 vm = _mm256_set1_ps(m), sum = _mm256_setzero_ps();
        size_t t = 0;
        for (; t + 8 <= S; t += 8) {
            __m256 e = exp_neg(_mm256_sub_ps(_mm256_loadu_ps(sr + t), vm));
            _mm256_storeu_ps(sr + t, e);
            sum = _mm256_add_ps(sum, e);
        }
        for (; t < S; t++) {
            sr[t] = expf(sr[t] - m);
            tail += sr[t];
        }
        l[r] = hsum(sum) + tail;
    }
    memset(o, 0, sizeof(float) * (size_t)R * D);
    t0 = 0;
    for (int i = 0; i < np; i++) {
        if (pages[i].kind == 0) value_mix(s + t0, S, &pages[i], x, D, P, o, R);
        else float_mix(s + t0, S, &pages[i], x, D, P, o, R);
        t0 += pages[i].n;
    }
    for (int r = 0; r < R; r++)
        for (int d = 0; d < D; d++) o[(size_t)r * D + d] /= l[r];
}

/* The tokens of a valid page list (what scores hold per row), or 0 for one the kernel does not take. */
static size_t checked_tokens(const page_t* pages, int np, int P) {
    size_t S = 0;
    if (np <= 0) return 0;
    for (int i = 0; i < np; i++) {
        const page_t* pg = &pages[i];
        if (pg->kind < 0 || pg->kind > 2 || pg->n <= 0 || pg->n > P || (pg->kind == 0 && pg->n != P)) return 0;
        S += pg->n;
    }
    return S;
}

/* Rows r0.. (up to 4) of head x of one sequence. */
static void decode_item(const float* q, const page_t* pages, int np, float* out, float* scratch, size_t S, int x,
                        int r0, int R, int D, int P) {
    const float* qx = q + ((size_t)x * R + r0) * D;
    float* ox = out + ((size_t)x * R + r0) * D;
    switch (R - r0 < 4 ? R - r0 : 4) {
        case 1: decode_rows(qx, pages, np, ox, scratch, S, x, D, P, 1); break;
        case 2: decode_rows(qx, pages, np, ox, scratch, S, x, D, P, 2); break;
        case 3: decode_rows(qx, pages, np, ox, scratch, S, x, D, P, 3); break;
        default: decode_rows(qx, pages, np, ox, scratch, S, x, D, P, 4); break;
    }
}

/* B sequences in one call: seq_t b is q [X, R, D] -> out [X, R, D] over its own pages. The work items (a
   sequence's head and up to 4 of its rows) are dealt round-robin to `threads` threads (this one included),
   each with its own scratch of `per_thread` floats (4 x the longest sequence's tokens): decode synchronizes
   MLX first, so its CPU threads are idle while this runs. */
typedef struct {
    const float* q;
    const page_t* pages;
    int np;
    float* out;
} seq_t;

typedef struct {
    const seq_t* seqs;
    const size_t* S;
    int B, X, R, D, P, t, threads;
    float* scratch;
} job_t;

static void* run_job(void* arg) {
    const job_t* j = (const job_t*)arg;
    const int per_head = (j->R + 3) / 4, items = j->B * j->X * per_head;
    for (int i = j->t; i < items; i += j->threads) {
        const int b = i / (j->X * per_head), x = (i / per_head) % j->X, r0 = 4 * (i % per_head);
        const seq_t* s = &j->seqs[b];
        decode_item(s->q, s->pages, s->np, s->out, j->scratch, j->S[b], x, r0, j->R, j->D, j->P);
    }
    return NULL;
}

#define MAX_THREADS 16

int q4_decode_batch(const seq_t* seqs, int B, float* scratch, size_t per_thread, int X, int R, int D, int P,
                    int threads) {
    if (B <= 0 || X <= 0 || R <= 0 || D <= 0 || D % 64 || D > 256 || P <= 0 || P % 64) return -1;
    size_t* S = malloc(sizeof(size_t) * (size_t)B);
    if (S == NULL) return -1;
    for (int b = 0; b < B; b++) {
        S[b] = checked_tokens(seqs[b].pages, seqs[b].np, P);
        if (S[b] == 0 || 4 * S[b] > per_thread) {
            free(S);
            return -1;
        }
    }
    threads = threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads;
    job_t jobs[MAX_THREADS];
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int t = 0; t < threads; t++)
        jobs[t] = (job_t){seqs, S, B, X, R, D, P, t, threads, scratch + (size_t)t * per_thread};
    for (int t = 1; t < threads; t++) started[t] = pthread_create(&ids[t], NULL, run_job, &jobs[t]) == 0;
    run_job(&jobs[0]);
    for (int t = 1; t < threads; t++) {
        if (started[t]) pthread_join(ids[t], NULL);
        else run_job(&jobs[t]);  /* a thread that could not start: its items run here */
    }
    free(S);
    return 0;
}
