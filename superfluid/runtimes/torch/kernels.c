/* Native CPU kernels for decode-sized steps (built by kernels.py with the system C compiler).
 *
 * - sf_gemv: y[m, n] (+)= sum_k W[n, k] x[m, k] for a few rows m, with W in a GGUF file's
 *   own block types (q8_0, q4_1 (Q4_0 as q4_1 with min -8d), q5_1 (Q5_0: min -16d), q4_k,
 *   q5_k, q6_k), repacked at load for these tiles but never requantized, and x quantized
 *   per block of 32 to int8 on entry (as llama.cpp's q8 activations; finer than its q8_K
 *   for K-quants), so the inner product is integer (AVX2 maddubs or VNNI) and a token
 *   streams ~0.56-1.06 bytes per weight instead of 4 (fp32). Single-row decode is
 *   memory-bound; this is what makes it fast. A fused matrix may stack parts of several
 *   kinds (sf_qcat). Where the CPU has AVX-512 (BW), two groups of weight rows go in one
 *   512-bit vector against up to 8 x rows ("wide tiles"): the many-row steps (prefill, many
 *   lanes) reuse each x broadcast and each unpacked weight more, with the same bits.
 * - sf_attend_decode: one query token per sequence against its keys in the paged KV pool
 *   (cells gathered by index), fp32, softmax with the running maximum subtracted.
 * - sf_rms_norm, sf_rope_kv (RoPE on q and k, k and v stored in their cells), sf_silu_mul.
 * - sf_experts: a mixture-of-experts feed-forward (routing, the step's rows grouped by expert).
 * - sf_decode: every layer of a step with the functions above (decoder.layer in C), one call a step.
 *
 * Without AVX2/FMA (or when built portable) every kernel has a plain C path.
 *
 * Work is split into parts claimed by the caller and a small persistent pthread pool
 * (sf_set_threads; workers spin briefly, then sleep on a condition variable). Tasks are
 * serialised (run_mu), so concurrent callers from several threads wait their turn.
 */
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define SF_AVX2 1
/* u8 x s8 dot products of 4 adjacent bytes into int32 lanes. VNNI does it in one exact
 * instruction; AVX2 needs maddubs (u8 x s8 pairs into int16) then madd (pairs into int32).
 * Both are exact here (every pair sum fits int16: |w|, |x| <= 127, q4 w <= 15), so the two
 * builds give bit-identical products. */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && !defined(SF_NO_VNNI)
#define SF_DPBUSD(acc, u, s) _mm256_dpbusd_epi32((acc), (u), (s))
#elif defined(__AVXVNNI__) && !defined(SF_NO_VNNI)
#define SF_DPBUSD(acc, u, s) _mm256_dpbusd_avx_epi32((acc), (u), (s))
#else
#define SF_DPBUSD(acc, u, s) _mm256_add_epi32((acc), _mm256_madd_epi16(_mm256_maddubs_epi16((u), (s)), _mm256_set1_epi16(1)))
#endif
#else
#define SF_AVX2 0
#endif
/* 512-bit attention (scores 16 keys a vector, values 16 lanes); the SF_NO_AVX512 build keeps
 * the 256-bit path (tests compare the two). */
#if SF_AVX2 && defined(__AVX512F__) && !defined(SF_NO_AVX512)
#define SF_AVX512 1
#else
#define SF_AVX512 0
#endif

#define QK 32
#define MAX_THREADS 64
#define SPIN_ROUNDS 20000

/* ------------------------------------------------------------------ thread pool
 *
 * A task is split into parts that any thread claims from one atomic ticket:
 * gen (32 bits) | parts (16) | next part (16). The caller publishes a task and claims parts
 * like the workers, then waits only for the parts others claimed. So a worker that is asleep
 * or descheduled (a busy machine) delays nothing but the part it holds: the caller takes the
 * rest. A part is claimed by a CAS on a ticket of the current gen, and the caller reuses
 * fn/arg only after every claimed part is done, so a worker always runs the task it claimed.
 */

typedef void (*task_fn)(void *arg, int part, int parts);

static pthread_mutex_t run_mu = PTHREAD_MUTEX_INITIALIZER; /* one task at a time, whoever calls */

static struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    _Atomic uint64_t ticket;
    atomic_int done;
    task_fn fn;
    void *arg;
    int n_workers;      /* started workers */
    atomic_int active;  /* threads that take parts (caller included) */
    pthread_t th[MAX_THREADS];
} pool = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};

static inline void cpu_relax(void) {
#if SF_AVX2
    _mm_pause();
#endif
}

/* Runs parts of the current task until none is left unclaimed. */
static void work(void) {
    uint64_t t = atomic_load_explicit(&pool.ticket, memory_order_acquire);
    for (;;) {
        unsigned next = t & 0xffff, parts = (t >> 16) & 0xffff;
        if (next >= parts) return;
        if (!atomic_compare_exchange_weak_explicit(&pool.ticket, &t, t + 1, memory_order_acq_rel,
                                                   memory_order_acquire))
            continue;
        pool.fn(pool.arg, (int)next, (int)parts);
        atomic_fetch_add_explicit(&pool.done, 1, memory_order_release);
        t = atomic_load_explicit(&pool.ticket, memory_order_acquire);
    }
}

static void *worker_main(void *p) {
    int ith = (int)(intptr_t)p;
    uint32_t seen = 0;
    for (;;) {
        uint64_t t;
        int spins = 0;
        while ((uint32_t)((t = atomic_load_explicit(&pool.ticket, memory_order_acquire)) >> 32) == seen) {
            if (++spins < SPIN_ROUNDS) {
                cpu_relax();
                continue;
            }
            pthread_mutex_lock(&pool.mu);
            while ((uint32_t)((t = atomic_load_explicit(&pool.ticket, memory_order_acquire)) >> 32) == seen)
                pthread_cond_wait(&pool.cv, &pool.mu);
            pthread_mutex_unlock(&pool.mu);
            break;
        }
        seen = (uint32_t)(t >> 32);
        if (ith < atomic_load_explicit(&pool.active, memory_order_relaxed)) work();
    }
    return NULL;
}

/* Threads used by the next tasks (caller included); starts workers as needed. Returns the count. */
int sf_set_threads(int n) {
    if (n < 1) n = 1;
    if (n > MAX_THREADS) n = MAX_THREADS;
    while (pool.n_workers < n - 1) {
        if (pthread_create(&pool.th[pool.n_workers], NULL, worker_main, (void *)(intptr_t)(pool.n_workers + 1)))
            break;
        pthread_detach(pool.th[pool.n_workers]);
        pool.n_workers++;
    }
    int active = n <= pool.n_workers + 1 ? n : pool.n_workers + 1;
    atomic_store(&pool.active, active);
    return active;
}

/* fn(arg, part, parts) for every part in [0, parts), on the caller and the active workers. */
static void run(task_fn fn, void *arg, int parts) {
    if (parts > 0xffff) parts = 0xffff;
    if (parts <= 1 || atomic_load_explicit(&pool.active, memory_order_relaxed) <= 1) {
        for (int i = 0; i < parts; i++) fn(arg, i, parts);
        return;
    }
    pthread_mutex_lock(&run_mu);
    pool.fn = fn;
    pool.arg = arg;
    atomic_store_explicit(&pool.done, 0, memory_order_relaxed);
    uint64_t gen = (atomic_load_explicit(&pool.ticket, memory_order_relaxed) >> 32) + 1;
    pthread_mutex_lock(&pool.mu);
    atomic_store_explicit(&pool.ticket, (gen << 32) | ((uint64_t)parts << 16), memory_order_release);
    pthread_cond_broadcast(&pool.cv);
    pthread_mutex_unlock(&pool.mu);
    work();
    /* every part is claimed; wait for those that workers hold (yield: they may need our core) */
    for (int spins = 0; atomic_load_explicit(&pool.done, memory_order_acquire) < parts; spins++) {
        if (spins < 2000)
            cpu_relax();
        else
            sched_yield();
    }
    pthread_mutex_unlock(&run_mu);
}

/* How many parts to cut n items into: at least `grain` items each, at most 8 per thread. */
static int n_parts(size_t n, size_t grain) {
    int active = atomic_load_explicit(&pool.active, memory_order_relaxed);
    size_t p = n / (grain ? grain : 1);
    size_t cap = (size_t)8 * (active > 0 ? active : 1);
    if (active <= 1) cap = 1;
    return p < 1 ? 1 : (int)(p < cap ? p : cap);
}

static inline void split(int n, int part, int parts, int align, int *lo, int *hi) {
    int per = (n + parts - 1) / parts;
    per = (per + align - 1) / align * align;
    *lo = part * per < n ? part * per : n;
    *hi = *lo + per < n ? *lo + per : n;
}

/* ------------------------------------------------------------ activation quantization */

#if SF_AVX2
static inline int32_t hsum_i32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}
#endif

/* x [K] -> xq [K] int8 (round half to even, |q| <= 127), xd [K/QK] scales, xs [K/QK] the
 * quantized block sums d * sum(q), x16 [K/16] the integer sums of q per 16 (q6_k's offset
 * of 32 is subtracted with them). The offset terms use the quantized sums: with them the
 * product is exactly dequant(x) . w, whose error is that of x against the centred weights;
 * the exact sum would leave it against the uncentred q alone (all >= 0, so far larger). */
static void quantize_row(const float *x, int K, int8_t *xq, float *xd, float *xs, int32_t *x16) {
    for (int b = 0; b < K / QK; b++) {
        const float *v = x + b * QK;
        int8_t *q = xq + b * QK;
        float amax = 0.f;
#if SF_AVX2
        /* the same values as the loop below: max of |v| is exact, v * id the same product,
         * cvtps rounds half to even as nearbyintf does in the default rounding mode */
        const __m256 sign = _mm256_set1_ps(-0.f);
        __m256 m = _mm256_setzero_ps();
        for (int j = 0; j < QK; j += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(v + j)));
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_movehdup_ps(h));
        amax = _mm_cvtss_f32(h);
        float d = amax / 127.f, id = amax > 0.f ? 127.f / amax : 0.f;
        __m256 vid = _mm256_set1_ps(id);
        __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v), vid));
        __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + 8), vid));
        __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + 16), vid));
        __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + 24), vid));
        int32_t lo = hsum_i32(_mm256_add_epi32(i0, i1)), hi = hsum_i32(_mm256_add_epi32(i2, i3));
        /* |values| <= 127: the saturating packs are exact; packs interleave 128-bit lanes, so
         * put the dwords back in order */
        __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
        p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)q, p);
        xd[b] = d;
        xs[b] = d * (float)(lo + hi);
        x16[2 * b] = lo;
        x16[2 * b + 1] = hi;
#else
        for (int j = 0; j < QK; j++) {
            float a = fabsf(v[j]);
            amax = a > amax ? a : amax;
        }
        float d = amax / 127.f, id = amax > 0.f ? 127.f / amax : 0.f;
        int32_t sum[2] = {0, 0};
        for (int j = 0; j < QK; j++) {
            q[j] = (int8_t)nearbyintf(v[j] * id);
            sum[j / 16] += q[j];
        }
        xd[b] = d;
        xs[b] = d * (float)(sum[0] + sum[1]);
        x16[2 * b] = sum[0];
        x16[2 * b + 1] = sum[1];
#endif
    }
}

typedef struct {
    const float *x;
    int8_t *xq;
    float *xd, *xs;
    int32_t *x16;
    int M, K;
} quant_task;

static void quant_part(void *p, int part, int parts) {
    const quant_task *t = p;
    int nb = t->K / QK, lo, hi;
    split(t->M, part, parts, 1, &lo, &hi);
    for (int m = lo; m < hi; m++)
        quantize_row(t->x + (size_t)m * t->K, t->K, t->xq + (size_t)m * t->K, t->xd + (size_t)m * nb,
                     t->xs + (size_t)m * nb, t->x16 + (size_t)m * 2 * nb);
}

/* ------------------------------------------------------------- interleaved tiles
 *
 * Weights are stored interleaved (QMat packs them, from a GGUF file's own blocks or from
 * floats): rows in groups of R = 8 (N padded with zero rows to a multiple of 8); per group g
 * and block b (32 values along k), for row i of the group and t < 4:
 *   q8_0: q 256 bytes, 8 chunks of 32: byte 4i + t of chunk j = q[8g + i][32b + 4j + t] (int8)
 *   4-bit planes (q4_1, q5_1, q4_k, q5_k, q6_k): q 128 bytes, 4 chunks of 32: byte 4i + t of
 *         chunk j = q[..][32b + 4j + t] & 15 | (q[..][32b + 16 + 4j + t] & 15) << 4
 *   5-bit (q5_1, q5_k): qh 32 bytes: byte 4i + t, bit j = bit 4 of q[..][32b + 4j + t], bit
 *         4 + j = bit 4 of q[..][32b + 16 + 4j + t]
 *   q6_k: qh 64 bytes, two halves of 32: byte 4i + t of half h, bits 4c..4c+1 = bits 4-5 of
 *         q[..][32b + 4j + t] and bits 4c+2..4c+3 those of q[..][32b + 16 + 4j + t], j = 2h + c
 * Scales, lane i for row 8g + i:
 *   q8_0, q4_1, q5_1: d (and mn) fp16 [G][nb][8], as GGUF stores them: w = d q (+ mn)
 *   q4_k, q5_k: d, dmin fp16 [G][nb/8][8] per 256, sc, mn uint8 [G][nb][8] per 32:
 *         w = (d sc) q - (dmin mn), both products exact in fp32 (11 x 6 bits)
 *   q6_k: d fp16 [G][nb/8][8], sc int8 [G][nb][2][8] per 16: w = (d sc) (q - 32)
 * A 256-bit chunk holds 4 consecutive k of each of 8 rows, so one 4-way u8 x s8 dot against
 * those 4 x values broadcast gives 8 rows' partial sums at once; a block's integer sum per
 * row is exact, and a block costs one int->float conversion and one FMA per 8 rows (the
 * row-major layout paid them per row). Accumulators hold output rows, not k lanes: no
 * horizontal sums, and a tile of up to MT x rows reuses every loaded (unpacked) weight.
 *
 * Arithmetic per output (row n, x row m), whatever the tile or the thread split: for each
 * block in order, with s the block's integer sum of q x:
 *   q8_0:        acc = fma((float)s, d * xd, acc)
 *   q4_1, q5_1:  acc = fma((float)s, d * xd, acc); macc = fma(mn, xs, macc)
 *   q4_k, q5_k:  acc = fma((float)s, (d * sc) * xd, acc); macc = fma(-(dmin * mn), xs, macc)
 *   q6_k:        t = sc0 (s0 - 32 x16_0) + sc1 (s1 - 32 x16_1) over the two 16-halves (exact
 *                int32); acc = fma((float)t, d * xd, acc)
 * and y = acc (+ macc). The plain C path does exactly that, so every build and every batch
 * gives bit-identical rows. */

#define R 8
#define MT 4 /* x rows per tile */

enum { SF_Q8_0, SF_Q4_1, SF_Q5_1, SF_Q4_K, SF_Q5_K, SF_Q6_K, SF_KINDS };

/* One matrix in one kind (the layouts above). */
typedef struct {
    int kind;
    const uint8_t *q, *qh;   /* qh: 5- and 6-bit kinds only */
    const uint16_t *d, *m;   /* m: q4_1, q5_1 (min), q4_k, q5_k (dmin) */
    const uint8_t *sc, *mn;  /* K-quants: sub-block scales (q6_k: int8) and mins */
    int N, K;
} sf_qmat;

/* Up to four matrices over the same x stacked along N (a fused qkv whose v is stored in
 * another type than q and k, as Q4_K_M files do): one activation quantization, one output. */
#define MAX_PARTS 4
typedef struct {
    sf_qmat p[MAX_PARTS];
    int n;
} sf_qcat;

static inline int kind_bytes(int kind) { return kind == SF_Q8_0 ? 256 : 128; }
static inline int kind_high(int kind) { return kind == SF_Q6_K ? 64 : (kind == SF_Q5_1 || kind == SF_Q5_K) ? 32 : 0; }
static inline int kind_k(int kind) { return kind >= SF_Q4_K; } /* scales per 256 */

/* fp16 -> fp32, exact (the plain path; F16C's vcvtph2ps gives the same values). */
static inline float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff, bits;
    if (e == 0x1f)
        bits = sign | 0x7f800000 | (m << 13); /* inf, nan */
    else if (e)
        bits = sign | ((e + 112) << 23) | (m << 13);
    else if (m) { /* subnormal: normalise */
        e = 113;
        while (!(m & 0x400)) {
            m <<= 1;
            e--;
        }
        bits = sign | (e << 23) | ((m & 0x3ff) << 13);
    } else
        bits = sign;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* One group's pointers into a matrix (g: the group within it). */
typedef struct {
    const uint8_t *q, *qh, *sc, *mn;
    const uint16_t *d, *m;
} group_ptrs;

static inline group_ptrs group_of(const sf_qmat *w, size_t g) {
    size_t nb = (size_t)w->K / QK, ds = kind_k(w->kind) ? nb / 8 : nb;
    group_ptrs p = {w->q + g * nb * kind_bytes(w->kind), NULL, NULL, NULL, w->d + g * ds * R,
                    w->m ? w->m + g * ds * R : NULL};
    if (kind_high(w->kind)) p.qh = w->qh + g * nb * kind_high(w->kind);
    if (kind_k(w->kind)) {
        p.sc = w->sc + g * nb * R * (w->kind == SF_Q6_K ? 2 : 1);
        p.mn = w->mn ? w->mn + g * nb * R : NULL;
    }
    return p;
}

#if SF_AVX2
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline __m256 half8(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }

static inline __m256 u8x8(const uint8_t *p) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p))); }

static inline __m256i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

static inline __attribute__((always_inline)) void tile_q8_0(const group_ptrs *w, int nb, const int8_t *xq,
                                                             const float *xd, size_t K, int mt, float *out) {
    __m256 acc[MT];
    for (int m = 0; m < mt; m++) acc[m] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        __m256i s[MT];
        for (int m = 0; m < mt; m++) s[m] = _mm256_setzero_si256();
        for (int j = 0; j < 8; j++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(w->q + (size_t)b * 256 + 32 * j));
            __m256i aw = _mm256_sign_epi8(v, v); /* |w| as u8; x carries w's sign (exact) */
            for (int m = 0; m < mt; m++)
                s[m] = SF_DPBUSD(s[m], aw, _mm256_sign_epi8(bcast4(xq + m * K + (size_t)b * QK + 4 * j), v));
        }
        __m256 d = half8(w->d + (size_t)b * R);
        for (int m = 0; m < mt; m++)
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[m]), _mm256_mul_ps(d, _mm256_set1_ps(xd[m * nb + b])), acc[m]);
    }
    for (int m = 0; m < mt; m++) _mm256_storeu_ps(out + m * R, acc[m]);
}

/* The 4- and 5-bit kinds with a min: q4_1, q5_1, q4_k, q5_k (kind a constant per call). */
static inline __attribute__((always_inline)) void tile_qmin(int kind, const group_ptrs *w, int nb, const int8_t *xq,
                                                             const float *xd, const float *xs, size_t K, int mt,
                                                             float *out) {
    const __m256i low = _mm256_set1_epi8(0x0f), sixteen = _mm256_set1_epi8(16);
    const int high = kind == SF_Q5_1 || kind == SF_Q5_K, ks = kind_k(kind);
    __m256 acc[MT], macc[MT];
    for (int m = 0; m < mt; m++) acc[m] = macc[m] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        __m256i s[MT], hb = _mm256_setzero_si256();
        for (int m = 0; m < mt; m++) s[m] = _mm256_setzero_si256();
        if (high) hb = _mm256_loadu_si256((const __m256i *)(w->qh + (size_t)b * 32));
        for (int j = 0; j < 4; j++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(w->q + (size_t)b * 128 + 32 * j));
            __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            if (high) {
                __m256i bl = _mm256_set1_epi8((char)(1 << j)), bh = _mm256_set1_epi8((char)(16 << j));
                lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(hb, bl), bl), sixteen));
                hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(hb, bh), bh), sixteen));
            }
            for (int m = 0; m < mt; m++) {
                const int8_t *x = xq + m * K + (size_t)b * QK + 4 * j;
                s[m] = SF_DPBUSD(s[m], lo, bcast4(x));
                s[m] = SF_DPBUSD(s[m], hi, bcast4(x + 16));
            }
        }
        __m256 d, mn;
        if (ks) {
            d = _mm256_mul_ps(half8(w->d + (size_t)(b / 8) * R), u8x8(w->sc + (size_t)b * R));
            mn = _mm256_mul_ps(half8(w->m + (size_t)(b / 8) * R), u8x8(w->mn + (size_t)b * R));
        } else {
            d = half8(w->d + (size_t)b * R);
            mn = half8(w->m + (size_t)b * R);
        }
        for (int m = 0; m < mt; m++) {
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[m]), _mm256_mul_ps(d, _mm256_set1_ps(xd[m * nb + b])), acc[m]);
            macc[m] = ks ? _mm256_fnmadd_ps(mn, _mm256_set1_ps(xs[m * nb + b]), macc[m])
                         : _mm256_fmadd_ps(mn, _mm256_set1_ps(xs[m * nb + b]), macc[m]);
        }
    }
    for (int m = 0; m < mt; m++) _mm256_storeu_ps(out + m * R, _mm256_add_ps(acc[m], macc[m]));
}

static inline __attribute__((always_inline)) void tile_q6_k(const group_ptrs *w, int nb, const int8_t *xq,
                                                             const float *xd, const int32_t *x16, size_t K, int mt,
                                                             float *out) {
    const __m256i low = _mm256_set1_epi8(0x0f), three = _mm256_set1_epi8(3);
    __m256 acc[MT];
    for (int m = 0; m < mt; m++) acc[m] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        __m256i s0[MT], s1[MT];
        for (int m = 0; m < mt; m++) s0[m] = s1[m] = _mm256_setzero_si256();
        for (int j = 0; j < 4; j++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(w->q + (size_t)b * 128 + 32 * j));
            __m256i h = _mm256_loadu_si256((const __m256i *)(w->qh + (size_t)b * 64 + 32 * (j >> 1)));
            int sh = 4 * (j & 1);
            /* epi16 shifts then byte masks: the bits taken never cross a byte (sh + 3 <= 7) */
            __m256i lo = _mm256_or_si256(_mm256_and_si256(v, low),
                                         _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, sh), three), 4));
            __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low),
                                         _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, sh + 2), three), 4));
            for (int m = 0; m < mt; m++) {
                const int8_t *x = xq + m * K + (size_t)b * QK + 4 * j;
                s0[m] = SF_DPBUSD(s0[m], lo, bcast4(x));
                s1[m] = SF_DPBUSD(s1[m], hi, bcast4(x + 16));
            }
        }
        __m256i c0 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(w->sc + (size_t)b * 2 * R)));
        __m256i c1 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(w->sc + (size_t)b * 2 * R + R)));
        __m256 d = half8(w->d + (size_t)(b / 8) * R);
        for (int m = 0; m < mt; m++) {
            const int32_t *o = x16 + (size_t)m * 2 * nb + 2 * b;
            __m256i t = _mm256_add_epi32(_mm256_mullo_epi32(c0, _mm256_sub_epi32(s0[m], _mm256_set1_epi32(32 * o[0]))),
                                         _mm256_mullo_epi32(c1, _mm256_sub_epi32(s1[m], _mm256_set1_epi32(32 * o[1]))));
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_mul_ps(d, _mm256_set1_ps(xd[m * nb + b])), acc[m]);
        }
    }
    for (int m = 0; m < mt; m++) _mm256_storeu_ps(out + m * R, acc[m]);
}
#endif

#if SF_AVX512 && defined(__AVX512BW__)
#define SF_WIDE 1
/* ------------------------------------------------------------------ wide tiles
 *
 * Many-row steps (prefill, many lanes, draft verification): two groups side by side in one
 * 512-bit vector (16 weight rows: group g in lanes 0-7, g + 1 in 8-15) against up to MW x
 * rows, so each x broadcast feeds 16 rows and each unpacked weight MW rows. Every lane does
 * exactly the operations its row does in the 256-bit tiles above (the same integer sums,
 * then the same cvt, mul and fma per block in block order), so a row's bits do not depend
 * on which tile computed it: batch invariance holds across both. */
#define MW 8 /* x rows per wide tile */
/* Steps of fewer x rows take the 256-bit tiles: streaming from memory (a decode step), two
 * groups a vector read two streams a group apart and ran slower. Measured on an AMD EPYC Zen 4,
 * 2 threads, a 1B-shape file's matrices (GB/s streamed, 256-bit vs wide): Q4_K 16384x2048 at
 * 1 row 36.4 vs 23.1, 4 rows 22.4 vs 18.6, 5 rows 13.5 vs 17.7, 8 rows 10.9 vs 14.3; the
 * Q6_K head likewise. The bits are the same either way. */
#ifndef SF_WIDE_ROWS
#define SF_WIDE_ROWS 5
#endif
#if defined(__AVX512VNNI__) && !defined(SF_NO_VNNI)
#define SF_DPBUSD512(acc, u, s) _mm512_dpbusd_epi32((acc), (u), (s))
#else /* exact as above: |u x s| pair sums stay within int16 for every kind's operands */
#define SF_DPBUSD512(acc, u, s) _mm512_add_epi32((acc), _mm512_madd_epi16(_mm512_maddubs_epi16((u), (s)), _mm512_set1_epi16(1)))
#endif

static inline __m512i pair256(const uint8_t *a, const uint8_t *b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)a)),
                              _mm256_loadu_si256((const __m256i *)b), 1);
}

static inline __m512 pair_half8(const uint16_t *a, const uint16_t *b) {
    return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)a)),
                                                   _mm_loadu_si128((const __m128i *)b), 1));
}

static inline __m128i pair64(const void *a, const void *b) {
    return _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)a), _mm_loadl_epi64((const __m128i *)b));
}

static inline __m512 pair_u8x8(const uint8_t *a, const uint8_t *b) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(pair64(a, b)));
}

static inline __m512i bcast4w(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

static inline __attribute__((always_inline)) void wide_q8_0(const group_ptrs *w0, const group_ptrs *w1, int nb,
                                                             const int8_t *xq, const float *xd, size_t K, int mt,
                                                             float *out) {
    __m512 acc[MW];
    for (int m = 0; m < mt; m++) acc[m] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        __m512i s[MW];
        for (int m = 0; m < mt; m++) s[m] = _mm512_setzero_si512();
        for (int j = 0; j < 8; j++) {
            __m512i v = pair256(w0->q + (size_t)b * 256 + 32 * j, w1->q + (size_t)b * 256 + 32 * j);
            __m512i aw = _mm512_abs_epi8(v); /* |w| as u8 (-128 -> 128); x takes w's sign below */
            __mmask64 neg = _mm512_movepi8_mask(v);
            for (int m = 0; m < mt; m++) {
                __m512i x = bcast4w(xq + m * K + (size_t)b * QK + 4 * j);
                /* sign_epi8(x, v) where w != 0; where w = 0 the product is 0 either way */
                s[m] = SF_DPBUSD512(s[m], aw, _mm512_mask_sub_epi8(x, neg, _mm512_setzero_si512(), x));
            }
        }
        __m512 d = pair_half8(w0->d + (size_t)b * R, w1->d + (size_t)b * R);
        for (int m = 0; m < mt; m++)
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[m]), _mm512_mul_ps(d, _mm512_set1_ps(xd[m * nb + b])), acc[m]);
    }
    for (int m = 0; m < mt; m++) _mm512_storeu_ps(out + m * 2 * R, acc[m]);
}

static inline __attribute__((always_inline)) void wide_qmin(int kind, const group_ptrs *w0, const group_ptrs *w1,
                                                             int nb, const int8_t *xq, const float *xd,
                                                             const float *xs, size_t K, int mt, float *out) {
    const __m512i low = _mm512_set1_epi8(0x0f), sixteen = _mm512_set1_epi8(16);
    const int high = kind == SF_Q5_1 || kind == SF_Q5_K, ks = kind_k(kind);
    __m512 acc[MW], macc[MW];
    for (int m = 0; m < mt; m++) acc[m] = macc[m] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        __m512i s[MW], hb = _mm512_setzero_si512();
        for (int m = 0; m < mt; m++) s[m] = _mm512_setzero_si512();
        if (high) hb = pair256(w0->qh + (size_t)b * 32, w1->qh + (size_t)b * 32);
        for (int j = 0; j < 4; j++) {
            __m512i v = pair256(w0->q + (size_t)b * 128 + 32 * j, w1->q + (size_t)b * 128 + 32 * j);
            __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            if (high) { /* bit 4 is clear in lo and hi: adding 16 sets it */
                lo = _mm512_mask_add_epi8(lo, _mm512_test_epi8_mask(hb, _mm512_set1_epi8((char)(1 << j))), lo, sixteen);
                hi = _mm512_mask_add_epi8(hi, _mm512_test_epi8_mask(hb, _mm512_set1_epi8((char)(16 << j))), hi, sixteen);
            }
            for (int m = 0; m < mt; m++) {
                const int8_t *x = xq + m * K + (size_t)b * QK + 4 * j;
                s[m] = SF_DPBUSD512(s[m], lo, bcast4w(x));
                s[m] = SF_DPBUSD512(s[m], hi, bcast4w(x + 16));
            }
        }
        __m512 d, mn;
        if (ks) {
            d = _mm512_mul_ps(pair_half8(w0->d + (size_t)(b / 8) * R, w1->d + (size_t)(b / 8) * R),
                              pair_u8x8(w0->sc + (size_t)b * R, w1->sc + (size_t)b * R));
            mn = _mm512_mul_ps(pair_half8(w0->m + (size_t)(b / 8) * R, w1->m + (size_t)(b / 8) * R),
                               pair_u8x8(w0->mn + (size_t)b * R, w1->mn + (size_t)b * R));
        } else {
            d = pair_half8(w0->d + (size_t)b * R, w1->d + (size_t)b * R);
            mn = pair_half8(w0->m + (size_t)b * R, w1->m + (size_t)b * R);
        }
        for (int m = 0; m < mt; m++) {
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[m]), _mm512_mul_ps(d, _mm512_set1_ps(xd[m * nb + b])), acc[m]);
            macc[m] = ks ? _mm512_fnmadd_ps(mn, _mm512_set1_ps(xs[m * nb + b]), macc[m])
                         : _mm512_fmadd_ps(mn, _mm512_set1_ps(xs[m * nb + b]), macc[m]);
        }
    }
    for (int m = 0; m < mt; m++) _mm512_storeu_ps(out + m * 2 * R, _mm512_add_ps(acc[m], macc[m]));
}

static inline __attribute__((always_inline)) void wide_q6_k(const group_ptrs *w0, const group_ptrs *w1, int nb,
                                                             const int8_t *xq, const float *xd, const int32_t *x16,
                                                             size_t K, int mt, float *out) {
    const __m512i low = _mm512_set1_epi8(0x0f), three = _mm512_set1_epi8(3);
    __m512 acc[MW];
    for (int m = 0; m < mt; m++) acc[m] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        __m512i s0[MW], s1[MW];
        for (int m = 0; m < mt; m++) s0[m] = s1[m] = _mm512_setzero_si512();
        for (int j = 0; j < 4; j++) {
            __m512i v = pair256(w0->q + (size_t)b * 128 + 32 * j, w1->q + (size_t)b * 128 + 32 * j);
            __m512i h = pair256(w0->qh + (size_t)b * 64 + 32 * (j >> 1), w1->qh + (size_t)b * 64 + 32 * (j >> 1));
            int sh = 4 * (j & 1);
            __m512i lo = _mm512_or_si512(_mm512_and_si512(v, low),
                                         _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(h, sh), three), 4));
            __m512i hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v, 4), low),
                                         _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(h, sh + 2), three), 4));
            for (int m = 0; m < mt; m++) {
                const int8_t *x = xq + m * K + (size_t)b * QK + 4 * j;
                s0[m] = SF_DPBUSD512(s0[m], lo, bcast4w(x));
                s1[m] = SF_DPBUSD512(s1[m], hi, bcast4w(x + 16));
            }
        }
        __m512i c0 = _mm512_cvtepi8_epi32(pair64(w0->sc + (size_t)b * 2 * R, w1->sc + (size_t)b * 2 * R));
        __m512i c1 = _mm512_cvtepi8_epi32(pair64(w0->sc + (size_t)b * 2 * R + R, w1->sc + (size_t)b * 2 * R + R));
        __m512 d = pair_half8(w0->d + (size_t)(b / 8) * R, w1->d + (size_t)(b / 8) * R);
        for (int m = 0; m < mt; m++) {
            const int32_t *o = x16 + (size_t)m * 2 * nb + 2 * b;
            __m512i t = _mm512_add_epi32(_mm512_mullo_epi32(c0, _mm512_sub_epi32(s0[m], _mm512_set1_epi32(32 * o[0]))),
                                         _mm512_mullo_epi32(c1, _mm512_sub_epi32(s1[m], _mm512_set1_epi32(32 * o[1]))));
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), _mm512_mul_ps(d, _mm512_set1_ps(xd[m * nb + b])), acc[m]);
        }
    }
    for (int m = 0; m < mt; m++) _mm512_storeu_ps(out + m * 2 * R, acc[m]);
}
#else
#define SF_WIDE 0
#endif

/* Row i's value k (0..31) of block b in a 4-bit plane (plus its high bits), as unsigned. */
static inline int plane_value(int kind, const group_ptrs *w, int b, int i, int k) {
    int j = (k % 16) / 4, t = k % 4, up = k >= 16;
    uint8_t byte = w->q[(size_t)b * 128 + 32 * j + 4 * i + t];
    int v = up ? byte >> 4 : byte & 15;
    if (kind == SF_Q5_1 || kind == SF_Q5_K)
        v |= ((w->qh[(size_t)b * 32 + 4 * i + t] >> (j + 4 * up)) & 1) << 4;
    else if (kind == SF_Q6_K)
        v |= ((w->qh[(size_t)b * 64 + 32 * (j >> 1) + 4 * i + t] >> (4 * (j & 1) + 2 * up)) & 3) << 4;
    return v;
}

/* The plain C tile: the same arithmetic, lane by lane (see above). */
static void tile_plain(int kind, const group_ptrs *w, int nb, const int8_t *xq, const float *xd, const float *xs,
                       const int32_t *x16, size_t K, int mt, float *out) {
    for (int m = 0; m < mt; m++)
        for (int i = 0; i < R; i++) {
            float acc = 0.f, macc = 0.f;
            for (int b = 0; b < nb; b++) {
                const int8_t *x = xq + m * K + (size_t)b * QK;
                int32_t s[2] = {0, 0};
                if (kind == SF_Q8_0) {
                    const int8_t *q = (const int8_t *)w->q + (size_t)b * 256 + 4 * i;
                    for (int k = 0; k < QK; k++) s[0] += (int32_t)q[32 * (k / 4) + k % 4] * x[k];
                } else
                    for (int k = 0; k < QK; k++) s[k / 16] += plane_value(kind, w, b, i, k) * x[k];
                float xdb = xd[m * nb + b];
                if (kind == SF_Q8_0)
                    acc = fmaf((float)s[0], half_to_float(w->d[(size_t)b * R + i]) * xdb, acc);
                else if (kind == SF_Q4_1 || kind == SF_Q5_1) {
                    acc = fmaf((float)(s[0] + s[1]), half_to_float(w->d[(size_t)b * R + i]) * xdb, acc);
                    macc = fmaf(half_to_float(w->m[(size_t)b * R + i]), xs[m * nb + b], macc);
                } else if (kind == SF_Q6_K) {
                    const int32_t *o = x16 + (size_t)m * 2 * nb + 2 * b;
                    int32_t t = (int32_t)(int8_t)w->sc[(size_t)b * 2 * R + i] * (s[0] - 32 * o[0]) +
                                (int32_t)(int8_t)w->sc[(size_t)b * 2 * R + R + i] * (s[1] - 32 * o[1]);
                    acc = fmaf((float)t, half_to_float(w->d[(size_t)(b / 8) * R + i]) * xdb, acc);
                } else {
                    float D = half_to_float(w->d[(size_t)(b / 8) * R + i]) * (float)w->sc[(size_t)b * R + i];
                    float Mn = half_to_float(w->m[(size_t)(b / 8) * R + i]) * (float)w->mn[(size_t)b * R + i];
                    acc = fmaf((float)(s[0] + s[1]), D * xdb, acc);
                    macc = fmaf(-Mn, xs[m * nb + b], macc);
                }
            }
            out[m * R + i] = acc + macc;
        }
}

/* ------------------------------------------------------------------------ GEMV */

typedef struct {
    const sf_qcat *w;
    const int8_t *xq;
    const float *xd, *xs;
    const int32_t *x16;
    float *y;
    int M, N, K, G, accumulate; /* N: every part's rows (y's row length); G: every part's groups */
} gemv_task;

static void tile(const gemv_task *t, const sf_qmat *w, int g, int m0, int mt, float *out) {
    int nb = t->K / QK;
    const int8_t *xq = t->xq + (size_t)m0 * t->K;
    const float *xd = t->xd + (size_t)m0 * nb, *xs = t->xs + (size_t)m0 * nb;
    const int32_t *x16 = t->x16 + (size_t)m0 * 2 * nb;
    group_ptrs p = group_of(w, (size_t)g);
#if SF_AVX2
    /* constant kind and mt per call: the compiler keeps the accumulators in registers */
#define SF_TILE(n)                                                                       \
    case n:                                                                              \
        switch (w->kind) {                                                               \
        case SF_Q8_0: tile_q8_0(&p, nb, xq, xd, (size_t)t->K, n, out); return;           \
        case SF_Q4_1: tile_qmin(SF_Q4_1, &p, nb, xq, xd, xs, (size_t)t->K, n, out); return; \
        case SF_Q5_1: tile_qmin(SF_Q5_1, &p, nb, xq, xd, xs, (size_t)t->K, n, out); return; \
        case SF_Q4_K: tile_qmin(SF_Q4_K, &p, nb, xq, xd, xs, (size_t)t->K, n, out); return; \
        case SF_Q5_K: tile_qmin(SF_Q5_K, &p, nb, xq, xd, xs, (size_t)t->K, n, out); return; \
        case SF_Q6_K: tile_q6_k(&p, nb, xq, xd, x16, (size_t)t->K, n, out); return;       \
        }                                                                                \
        break;
    switch (mt) {
        SF_TILE(1)
        SF_TILE(2)
        SF_TILE(3)
        SF_TILE(4)
    }
#undef SF_TILE
#endif
    tile_plain(w->kind, &p, nb, xq, xd, xs, x16, (size_t)t->K, mt, out);
}

#if SF_WIDE
/* Groups g and g + 1 of w (both within it) against x rows [m0, m0 + mt), mt <= MW: out [mt][16]. */
static void wide(const gemv_task *t, const sf_qmat *w, int g, int m0, int mt, float *out) {
    int nb = t->K / QK;
    const int8_t *xq = t->xq + (size_t)m0 * t->K;
    const float *xd = t->xd + (size_t)m0 * nb, *xs = t->xs + (size_t)m0 * nb;
    const int32_t *x16 = t->x16 + (size_t)m0 * 2 * nb;
    group_ptrs p0 = group_of(w, (size_t)g), p1 = group_of(w, (size_t)g + 1);
#define SF_WIDE_TILE(n)                                                                                \
    case n:                                                                                            \
        switch (w->kind) {                                                                             \
        case SF_Q8_0: wide_q8_0(&p0, &p1, nb, xq, xd, (size_t)t->K, n, out); return;                   \
        case SF_Q4_1: wide_qmin(SF_Q4_1, &p0, &p1, nb, xq, xd, xs, (size_t)t->K, n, out); return;      \
        case SF_Q5_1: wide_qmin(SF_Q5_1, &p0, &p1, nb, xq, xd, xs, (size_t)t->K, n, out); return;      \
        case SF_Q4_K: wide_qmin(SF_Q4_K, &p0, &p1, nb, xq, xd, xs, (size_t)t->K, n, out); return;      \
        case SF_Q5_K: wide_qmin(SF_Q5_K, &p0, &p1, nb, xq, xd, xs, (size_t)t->K, n, out); return;      \
        case SF_Q6_K: wide_q6_k(&p0, &p1, nb, xq, xd, x16, (size_t)t->K, n, out); return;               \
        }                                                                                              \
        break;
    switch (mt) {
        SF_WIDE_TILE(1)
        SF_WIDE_TILE(2)
        SF_WIDE_TILE(3)
        SF_WIDE_TILE(4)
        SF_WIDE_TILE(5)
        SF_WIDE_TILE(6)
        SF_WIDE_TILE(7)
        SF_WIDE_TILE(8)
    }
#undef SF_WIDE_TILE
}
#endif

/* ------------------------------------------------------------------- AMX tiles
 *
 * Where the CPU has AMX-INT8 and the kernel grants the tile state (Linux asks a process to
 * request it: arch_prctl(ARCH_REQ_XCOMP_PERM); a refusal, or SF_NO_AMX, keeps the wide tiles),
 * steps of >= 16 x rows run the integer part of each block on the tile unit: one TDPBSUD
 * (q8_0: TDPBSSD) gives a block's exact int32 sum for 16 x rows (A, read in place from xq)
 * by 16 weight rows (B: a pair of groups, the lanes of a wide tile, unpacked to bytes).
 * A 4-byte column of B is 4 consecutive k of one row, which is how the interleaved layout
 * already stores them, so B's rows are the wide tiles' unpacked vectors as they are. The
 * epilogue is the wide tiles' own (the same cvt, mul and fma per block, in block order), so
 * an x row's bits do not depend on which tiles computed it (tests/test_native_kernels.py).
 * The last M % 16 rows take the wide tiles. */
#if SF_WIDE && defined(__AMX_TILE__) && defined(__AMX_INT8__) && !defined(SF_NO_AMX)
#define SF_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#define MA 64 /* x rows per pass over the blocks: 4 tiles of 16, one C register each */
/* The kinds that take the tiles. Each block's sums leave the tile unit through memory and
 * its epilogue stays the wide tiles' (the price of bit-identical rows), so the tiles pay only
 * where the wide tiles' integer part is dearest: q8_0 (a sign trick per x row). Measured in
 * one process, builds alternating (benchmarks/gemm_ab.py, Intel Xeon with AMX, 2 cores): q8_0
 * 0.93-1.69x at 16-512 rows by shape (results/gemm_ab_no_amx.json); q4_1, q4_k, q5_k 0.7-1.2x
 * (no gain through the noise); q6_k 0.4-0.8x. SF_AMX_ALL_KINDS (SUPERFLUID_KERNELS_AMX_ALL=1: tests, benchmarks) sends every kind. */
#ifdef SF_AMX_ALL_KINDS
#define AMX_KINDS ((1 << SF_KINDS) - 1)
#else
#define AMX_KINDS (1 << SF_Q8_0)
#endif

static atomic_int amx_state; /* 0: not asked yet, 1: granted, -1: refused */

static int amx_granted(void) {
    int s = atomic_load_explicit(&amx_state, memory_order_acquire);
    if (!s) { /* process-wide: one grant covers every thread */
        s = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0 ? 1 : -1;
        atomic_store_explicit(&amx_state, s, memory_order_release);
    }
    return s > 0;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((aligned(64))) amx_config;

/* tmm0-3: C, 16 x 16 int32 (q6_k: lo and hi sums of two x tiles). Otherwise tmm4, tmm6, tmm7:
 * A, 16 x rows by one block's 32 bytes; tmm5: B, 8 rows of 64 bytes. q6_k: tmm4/tmm6 the halves of A (16
 * bytes), tmm5/tmm7 those of B (4 rows). Loaded on every call: a thread's configuration is
 * its own, and torch's oneDNN may have set another on the calling thread. */
static void amx_configure(int q6) {
    amx_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < 4; i++) c.rows[i] = 16, c.colsb[i] = 64;
    if (q6) {
        c.rows[4] = c.rows[6] = 16, c.colsb[4] = c.colsb[6] = 16;
        c.rows[5] = c.rows[7] = 4, c.colsb[5] = c.colsb[7] = 64;
    } else {
        c.rows[4] = c.rows[6] = c.rows[7] = 16, c.colsb[4] = c.colsb[6] = c.colsb[7] = 32;
        c.rows[5] = 8, c.colsb[5] = 64;
    }
    _tile_loadconfig(&c);
}

/* Block b of groups w0, w1 as B's bytes (q6_k: 256 of the low half's k, then 256 of the high). */
static inline void amx_unpack(int kind, const group_ptrs *w0, const group_ptrs *w1, int b, uint8_t *B) {
    if (kind == SF_Q8_0) {
        for (int j = 0; j < 8; j++)
            _mm512_store_si512((void *)(B + 64 * j), pair256(w0->q + (size_t)b * 256 + 32 * j, w1->q + (size_t)b * 256 + 32 * j));
        return;
    }
    const __m512i low = _mm512_set1_epi8(0x0f), sixteen = _mm512_set1_epi8(16), three = _mm512_set1_epi8(3);
    __m512i hb = _mm512_setzero_si512();
    if (kind == SF_Q5_1 || kind == SF_Q5_K) hb = pair256(w0->qh + (size_t)b * 32, w1->qh + (size_t)b * 32);
    for (int j = 0; j < 4; j++) {
        __m512i v = pair256(w0->q + (size_t)b * 128 + 32 * j, w1->q + (size_t)b * 128 + 32 * j);
        __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        if (kind == SF_Q5_1 || kind == SF_Q5_K) {
            lo = _mm512_mask_add_epi8(lo, _mm512_test_epi8_mask(hb, _mm512_set1_epi8((char)(1 << j))), lo, sixteen);
            hi = _mm512_mask_add_epi8(hi, _mm512_test_epi8_mask(hb, _mm512_set1_epi8((char)(16 << j))), hi, sixteen);
        } else if (kind == SF_Q6_K) {
            __m512i h = pair256(w0->qh + (size_t)b * 64 + 32 * (j >> 1), w1->qh + (size_t)b * 64 + 32 * (j >> 1));
            int sh = 4 * (j & 1);
            lo = _mm512_or_si512(lo, _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(h, sh), three), 4));
            hi = _mm512_or_si512(hi, _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(h, sh + 2), three), 4));
        }
        _mm512_store_si512((void *)(B + 64 * j), lo);
        _mm512_store_si512((void *)(B + 64 * (4 + j)), hi);
    }
}

/* Block b's scales for groups p0, p1, as the wide tiles form them: d (q6_k: and the
 * sub-block scales c0, c1), and the min's factor mn where the kind has one. */
typedef struct {
    __m512 d, mn;
    __m512i c0, c1;
} amx_scales;

static inline amx_scales amx_scales_of(int kind, const group_ptrs *p0, const group_ptrs *p1, int b) {
    amx_scales a = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_si512(), _mm512_setzero_si512()};
    if (kind == SF_Q6_K) {
        a.c0 = _mm512_cvtepi8_epi32(pair64(p0->sc + (size_t)b * 2 * R, p1->sc + (size_t)b * 2 * R));
        a.c1 = _mm512_cvtepi8_epi32(pair64(p0->sc + (size_t)b * 2 * R + R, p1->sc + (size_t)b * 2 * R + R));
        a.d = pair_half8(p0->d + (size_t)(b / 8) * R, p1->d + (size_t)(b / 8) * R);
    } else if (kind_k(kind)) {
        a.d = _mm512_mul_ps(pair_half8(p0->d + (size_t)(b / 8) * R, p1->d + (size_t)(b / 8) * R),
                            pair_u8x8(p0->sc + (size_t)b * R, p1->sc + (size_t)b * R));
        a.mn = _mm512_mul_ps(pair_half8(p0->m + (size_t)(b / 8) * R, p1->m + (size_t)(b / 8) * R),
                             pair_u8x8(p0->mn + (size_t)b * R, p1->mn + (size_t)b * R));
    } else {
        a.d = pair_half8(p0->d + (size_t)b * R, p1->d + (size_t)b * R);
        if (kind != SF_Q8_0) a.mn = pair_half8(p0->m + (size_t)b * R, p1->m + (size_t)b * R);
    }
    return a;
}

/* Scratch for one pair of groups: every block's B bytes, its scales as vectors, and one x
 * tile's block sums (q6_k: the two halves' each). */
typedef struct {
    uint8_t *B;    /* [nb][512] */
    int32_t *C;    /* [nb][2][256] */
    float *dv, *mv; /* [nb][16] */
    int32_t *cv;   /* q6_k: [nb][2][16] */
} amx_scratch;

static size_t amx_scratch_bytes(int nb) { return (size_t)nb * (512 + 2048 + 64 + 64 + 128); }

static amx_scratch amx_scratch_at(void *p, int nb) {
    uint8_t *b = p;
    amx_scratch s = {b, (int32_t *)(b + (size_t)nb * 512), (float *)(b + (size_t)nb * 2560), (float *)(b + (size_t)nb * 2624),
                     (int32_t *)(b + (size_t)nb * 2688)};
    return s;
}

/* One block's products into C register c (an immediate) and on to memory. */
#define SF_AMX_BLOCK(c, a, sud, B, x, K, out) \
    do {                                      \
        _tile_loadd(5, (B), 64);              \
        _tile_loadd(a, (x), (K));             \
        _tile_zero(c);                        \
        if (sud)                              \
            _tile_dpbsud(c, a, 5);            \
        else                                  \
            _tile_dpbssd(c, a, 5);            \
        _tile_stored(c, (out), 64);           \
    } while (0)
#define SF_AMX_BLOCK6(c, c1, B, x, K, out) \
    do {                                   \
        _tile_loadd(5, (B), 64);           \
        _tile_loadd(7, (B) + 256, 64);     \
        _tile_loadd(4, (x), (K));          \
        _tile_loadd(6, (x) + 16, (K));     \
        _tile_zero(c);                     \
        _tile_zero(c1);                    \
        _tile_dpbsud(c, 4, 5);             \
        _tile_dpbsud(c1, 6, 7);            \
        _tile_stored(c, (out), 64);        \
        _tile_stored(c1, (out) + 256, 64); \
    } while (0)

/* Groups g and g + 1 of w against x rows [m0, m0 + mt), mt a multiple of 16 up to MA:
 * out [mt][16], as wide() gives them. Every block is unpacked and its scales formed once;
 * then per x tile the tile unit computes every block's sums (C registers in turn, so one
 * block's product overlaps the last one's store), and each x row runs its FMA chain over
 * the blocks in order with the accumulators in registers. */
static inline __attribute__((always_inline)) void amx_pair_kind(int kind, const gemv_task *t, const sf_qmat *w, int g,
                                                                int m0, int mt, float *out, amx_scratch sc) {
    const int nb = t->K / QK, q6 = kind == SF_Q6_K, ks = kind_k(kind), qmin = kind != SF_Q8_0 && !q6;
    const size_t K = (size_t)t->K;
    group_ptrs p0 = group_of(w, (size_t)g), p1 = group_of(w, (size_t)g + 1);
    for (int b = 0; b < nb; b++) {
        amx_unpack(kind, &p0, &p1, b, sc.B + (size_t)b * 512);
        amx_scales a = amx_scales_of(kind, &p0, &p1, b);
        _mm512_store_ps(sc.dv + 16 * b, a.d);
        _mm512_store_ps(sc.mv + 16 * b, a.mn);
        if (q6) {
            _mm512_store_si512((void *)(sc.cv + 32 * b), a.c0);
            _mm512_store_si512((void *)(sc.cv + 32 * b + 16), a.c1);
        }
    }
    for (int r = 0; r < mt; r += 16) {
        const int8_t *xq = t->xq + (size_t)(m0 + r) * K;
        if (q6) {
            for (int b = 0; b < nb; b++) {
                const uint8_t *B = sc.B + (size_t)b * 512;
                if (b & 1)
                    SF_AMX_BLOCK6(2, 3, B, xq + (size_t)b * QK, K, sc.C + (size_t)b * 512);
                else
                    SF_AMX_BLOCK6(0, 1, B, xq + (size_t)b * QK, K, sc.C + (size_t)b * 512);
            }
        } else {
            const int sud = kind != SF_Q8_0;
            for (int b = 0; b < nb; b++) {
                const uint8_t *B = sc.B + (size_t)b * 512;
                const int8_t *x = xq + (size_t)b * QK;
                int32_t *o = sc.C + (size_t)b * 256;
                switch (b & 3) {
                case 0: SF_AMX_BLOCK(0, 4, sud, B, x, K, o); break;
                case 1: SF_AMX_BLOCK(1, 6, sud, B, x, K, o); break;
                case 2: SF_AMX_BLOCK(2, 7, sud, B, x, K, o); break;
                default: SF_AMX_BLOCK(3, 4, sud, B, x, K, o); break;
                }
            }
        }
        for (int m = r; m < r + 16; m++) {
            const float *xd = t->xd + (size_t)(m0 + m) * nb, *xs = t->xs + (size_t)(m0 + m) * nb;
            const int32_t *x16 = t->x16 + (size_t)(m0 + m) * 2 * nb;
            __m512 acc = _mm512_setzero_ps(), macc = _mm512_setzero_ps();
            for (int b = 0; b < nb; b++) {
                __m512 f;
                if (q6) {
                    const int32_t *s0 = sc.C + (size_t)b * 512 + 16 * (m - r);
                    f = _mm512_cvtepi32_ps(_mm512_add_epi32(
                        _mm512_mullo_epi32(_mm512_load_si512((const void *)(sc.cv + 32 * b)),
                                           _mm512_sub_epi32(_mm512_load_si512((const void *)s0), _mm512_set1_epi32(32 * x16[2 * b]))),
                        _mm512_mullo_epi32(_mm512_load_si512((const void *)(sc.cv + 32 * b + 16)),
                                           _mm512_sub_epi32(_mm512_load_si512((const void *)(s0 + 256)), _mm512_set1_epi32(32 * x16[2 * b + 1])))));
                } else
                    f = _mm512_cvtepi32_ps(_mm512_load_si512((const void *)(sc.C + (size_t)b * 256 + 16 * (m - r))));
                acc = _mm512_fmadd_ps(f, _mm512_mul_ps(_mm512_load_ps(sc.dv + 16 * b), _mm512_set1_ps(xd[b])), acc);
                if (qmin)
                    macc = ks ? _mm512_fnmadd_ps(_mm512_load_ps(sc.mv + 16 * b), _mm512_set1_ps(xs[b]), macc)
                              : _mm512_fmadd_ps(_mm512_load_ps(sc.mv + 16 * b), _mm512_set1_ps(xs[b]), macc);
            }
            _mm512_storeu_ps(out + 16 * m, qmin ? _mm512_add_ps(acc, macc) : acc);
        }
    }
}
#undef SF_AMX_BLOCK
#undef SF_AMX_BLOCK6

static void amx_pair(const gemv_task *t, const sf_qmat *w, int g, int m0, int mt, float *out, amx_scratch sc) {
    switch (w->kind) { /* a constant kind per copy: no branches in the block loops */
    case SF_Q8_0: amx_pair_kind(SF_Q8_0, t, w, g, m0, mt, out, sc); return;
    case SF_Q4_1: amx_pair_kind(SF_Q4_1, t, w, g, m0, mt, out, sc); return;
    case SF_Q5_1: amx_pair_kind(SF_Q5_1, t, w, g, m0, mt, out, sc); return;
    case SF_Q4_K: amx_pair_kind(SF_Q4_K, t, w, g, m0, mt, out, sc); return;
    case SF_Q5_K: amx_pair_kind(SF_Q5_K, t, w, g, m0, mt, out, sc); return;
    case SF_Q6_K: amx_pair_kind(SF_Q6_K, t, w, g, m0, mt, out, sc); return;
    }
}
#else
#define SF_AMX 0
#define MA MW
#endif

/* y rows [m0, m0 + mt) at column col += or = out [mt][stride] (its first `rows` lanes). */
static inline void put_rows(const gemv_task *t, int m0, int mt, size_t col, int rows, const float *out, int stride) {
#if SF_AVX2
    if (rows == R) { /* a whole group: one vector a row (the same additions) */
        for (int m = 0; m < mt; m++) {
            float *y = t->y + (size_t)(m0 + m) * t->N + col;
            __m256 o = _mm256_loadu_ps(out + m * stride);
            _mm256_storeu_ps(y, t->accumulate ? _mm256_add_ps(_mm256_loadu_ps(y), o) : o);
        }
        return;
    }
#endif
    for (int m = 0; m < mt; m++) {
        float *y = t->y + (size_t)(m0 + m) * t->N + col;
        for (int i = 0; i < rows; i++) y[i] = t->accumulate ? y[i] + out[m * stride + i] : out[m * stride + i];
    }
}

static void gemv_part(void *p, int part, int parts) {
    const gemv_task *t = p;
    int lo, hi;
    split(t->G, part, parts, SF_WIDE ? 2 : 1, &lo, &hi);
    float out[MT * R];
    int k = 0, g0 = 0, col = 0; /* the part holding group lo: its first group and column */
#if SF_AMX
    int amx_parts = 0; /* parts of a kind that takes the tiles */
    for (int i = 0; i < t->w->n; i++) amx_parts += AMX_KINDS >> t->w->p[i].kind & 1;
    void *scratch = t->M >= 16 && amx_parts && amx_granted() ? aligned_alloc(64, amx_scratch_bytes(t->K / QK)) : NULL;
    int amx = scratch != NULL, amx_q6 = 0; /* amx_q6: the configuration loaded, q6_k's or the others' */
    amx_scratch sc = {0};
    if (amx) sc = amx_scratch_at(scratch, t->K / QK);
    if (amx) amx_configure(0);
#endif
    while (k < t->w->n - 1 && lo >= g0 + (t->w->p[k].N + R - 1) / R) {
        g0 += (t->w->p[k].N + R - 1) / R;
        col += t->w->p[k].N;
        k++;
    }
    for (int gg = lo; gg < hi; gg++) { /* a group's weights stay in L1 across every x row */
        const sf_qmat *w = &t->w->p[k];
        int g = gg - g0;
        if (g * R >= w->N) { /* the next part */
            g0 += (w->N + R - 1) / R;
            col += w->N;
            w = &t->w->p[++k];
            g = gg - g0;
        }
        int rows = w->N - g * R < R ? w->N - g * R : R;
#if SF_WIDE
        if (t->M >= SF_WIDE_ROWS && gg + 1 < hi && (g + 1) * R < w->N) { /* g and g + 1 together */
            float wout[(SF_AMX ? MA : MW) * 2 * R];
            int rows1 = w->N - (g + 1) * R < R ? w->N - (g + 1) * R : R, m0 = 0;
#if SF_AMX
            if (amx && (AMX_KINDS >> w->kind & 1)) { /* whole x tiles on the tile unit, the rest in the wide tiles below */
                if ((w->kind == SF_Q6_K) != amx_q6) amx_configure(amx_q6 = w->kind == SF_Q6_K);
                for (int whole = t->M / 16 * 16; m0 < whole;) {
                    int mt = whole - m0 < MA ? whole - m0 : MA;
                    amx_pair(t, w, g, m0, mt, wout, sc);
                    put_rows(t, m0, mt, col + (size_t)g * R, R, wout, 2 * R);
                    put_rows(t, m0, mt, col + (size_t)(g + 1) * R, rows1, wout + R, 2 * R);
                    m0 += mt;
                }
            }
#endif
            for (; m0 < t->M; m0 += MW) {
                int mt = t->M - m0 < MW ? t->M - m0 : MW;
                wide(t, w, g, m0, mt, wout);
                put_rows(t, m0, mt, col + (size_t)g * R, R, wout, 2 * R);
                put_rows(t, m0, mt, col + (size_t)(g + 1) * R, rows1, wout + R, 2 * R);
            }
            gg++;
            continue;
        }
#endif
        for (int m0 = 0; m0 < t->M; m0 += MT) {
            int mt = t->M - m0 < MT ? t->M - m0 : MT;
            tile(t, w, g, m0, mt, out);
            put_rows(t, m0, mt, col + (size_t)g * R, rows, out, R);
        }
    }
#if SF_AMX
    if (amx) _tile_release(); /* the tile state back to its initial state: context switches skip its 8 KiB */
    free(scratch);
#endif
}

/* Arguments a caller could get wrong, checked before anything is read: 0 or -1. */
static int check_qcat(const sf_qcat *w) {
    if (w->n < 1 || w->n > MAX_PARTS) return -1;
    for (int k = 0; k < w->n; k++) {
        const sf_qmat *p = &w->p[k];
        if (p->K != w->p[0].K || p->K % QK || p->N < 1 || p->kind < 0 || p->kind >= SF_KINDS) return -1;
        if (kind_k(p->kind) && p->K % (8 * QK)) return -1;
        if (!p->q || !p->d || (kind_high(p->kind) && !p->qh) || (kind_k(p->kind) && !p->sc)) return -1;
        if ((p->kind == SF_Q4_1 || p->kind == SF_Q5_1 || p->kind == SF_Q4_K || p->kind == SF_Q5_K) && !p->m) return -1;
        if ((p->kind == SF_Q4_K || p->kind == SF_Q5_K) && !p->mn) return -1;
    }
    return 0;
}

/* x [M, K] fp32 -> y [M, N] fp32 (N: the parts' rows together); y += when accumulate.
 * Returns 0, -1 on bad arguments, -2 when scratch memory could not be had. */
static int gemv(const sf_qcat *w, const float *x, float *y, int M, int accumulate) {
    if (check_qcat(w)) return -1;
    int K = w->p[0].K, nb = K / QK, N = 0, G = 0;
    for (int k = 0; k < w->n; k++) {
        N += w->p[k].N;
        G += (w->p[k].N + R - 1) / R;
    }
    int8_t *xq = malloc((size_t)M * K + 4 * sizeof(float) * (size_t)M * nb + 64);
    if (!xq) return -2;
    float *xd = (float *)(((uintptr_t)(xq + (size_t)M * K) + 15) & ~(uintptr_t)15);
    float *xs = xd + (size_t)M * nb;
    int32_t *x16 = (int32_t *)(xs + (size_t)M * nb);
    quant_task qt = {x, xq, xd, xs, x16, M, K};
    run(quant_part, &qt, (size_t)M * K < 65536 ? 1 : n_parts((size_t)M, 8));
    gemv_task t = {w, xq, xd, xs, x16, y, M, N, K, G, accumulate};
    /* parts of >= 4 groups (32 rows) and >= ~16k multiply-adds: less is not worth a hand-off */
    size_t grain = 2048 / ((size_t)K * M) > 4 ? 2048 / ((size_t)K * M) : 4;
    run(gemv_part, &t, n_parts((size_t)G, grain));
    free(xq);
    return 0;
}

int sf_gemv(const sf_qcat *w, const float *x, float *y, int M, int accumulate) { return gemv(w, x, y, M, accumulate); }

/* 1 when steps of >= 16 x rows run on the AMX tiles (AMX_KINDS: q8_0 unless built with
 * SF_AMX_ALL_KINDS), the build having them and the kernel having granted the tile state; else 0. */
int sf_amx(void) {
#if SF_AMX
    return amx_granted();
#else
    return 0;
#endif
}

/* ------------------------------------------------------------------- attention
 *
 * Each query vector attends over its own span of keys in two passes, in a fixed order that
 * depends on its span length alone: scores in groups of eight keys counted from the span's
 * start (a transposed sum), the tail one key at a time; the softmax (exp_shifted); then the
 * values summed in key order into one FMA chain per output lane. So a query's output cannot
 * depend on what shares its step.
 *
 * Tiles (why the order is written out per query). A prefill chunk or a draft verification
 * has many rows over one sequence's keys; attending row by row re-read every key once per
 * query (at 4,096 tokens, ~9 GB of key and value reads per layer for a 512-row chunk: the
 * superlinear prefill cost). Consecutive rows whose gathered cells agree over their spans
 * form a tile, and a tile's queries (its rows x the heads sharing one kv head) walk the keys
 * together: each group of eight keys, each block of values, is loaded once for all of them.
 * Every query still runs exactly its own sequence of operations (the value accumulators are
 * kept in the output between blocks, which does not change a float), so a tile's rows are
 * bit-identical to the same rows attended one at a time (tests/test_native_kernels.py).
 *
 * Where the CPU has AVX-512 (SF_AVX512) the scores go 16 keys a vector instead: a block of keys
 * is transposed once per tile, and each score is the FMA chain over the head dimension from
 * zero, whoever shares the block; values go four queries a load where d is a multiple of 64. The largest score and
 * the normalisation are vector loops (exact in any order). A block of keys is transposed in
 * registers (transpose16). benchmarks/long_prompt.py, default model's head shape, against the
 * 256-bit build: the last 512-row chunk of a 4,096-token prompt 33.3 vs 55.2 ms per layer, but
 * 32 decode lanes of 400 keys 0.81 vs 0.73 ms (a tile of three queries pays for the transpose). */

#define MAXQ 64   /* query vectors walking the keys together: their scores fit a part's scratch */
#define VBLOCK 64 /* values per block: 16 KiB at d = 64, in L1 while every query of the tile adds them */

typedef struct {
    const float *q;
    float *s, *o; /* s: scores then weights [L]; o: output [d] */
    int L;        /* the span's length */
} attn_query;

static inline float dotf(const float *a, const float *b, int d) {
#if SF_AVX2
    if ((d & 7) == 0) {
        __m256 acc = _mm256_setzero_ps();
        for (int j = 0; j < d; j += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + j), _mm256_loadu_ps(b + j), acc);
        return hsum8(acc);
    }
#endif
    float s = 0.f;
    for (int j = 0; j < d; j++) s += a[j] * b[j];
    return s;
}

#if SF_AVX2
/* Eight sums of eight lanes each, as one vector [sum a0, ..., sum a7]. */
static inline __m256 hsum8x8(const __m256 *a) {
    __m256 h01 = _mm256_hadd_ps(a[0], a[1]), h23 = _mm256_hadd_ps(a[2], a[3]);
    __m256 h45 = _mm256_hadd_ps(a[4], a[5]), h67 = _mm256_hadd_ps(a[6], a[7]);
    __m256 h0 = _mm256_hadd_ps(h01, h23), h1 = _mm256_hadd_ps(h45, h67);
    return _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20), _mm256_permute2f128_ps(h0, h1, 0x31));
}
#endif

#if SF_AVX512
/* r[i][j] -> r[j][i]: a 16 x 16 block of floats transposed in registers (unpacks, then 128-bit
 * lane shuffles); exact, it only moves values. */
static inline void transpose16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
        __m512d c = _mm512_castps_pd(t[4 * i + 2]), e = _mm512_castps_pd(t[4 * i + 3]);
        r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
        r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
        r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, e));
        r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, e));
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
        r[i + 4] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0x88);
        r[i + 12] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0xdd);
    }
}

/* NR queries against the 16 keys of kt [d][16] (a key a lane): each score is the FMA
 * chain over c = 0 .. d - 1 from zero, so it is the same whatever else shares the call;
 * q[r] == NULL pads (its lanes are computed from a zero query and not stored); NR <= 8. */
static inline __attribute__((always_inline)) void scores16(attn_query *const *q, int NR, const float *kt, int d,
                                                           int l0, __m512 scale, const float *zero) {
    const float *qv[8];
    __m512 acc[8];
    for (int r = 0; r < NR; r++) {
        qv[r] = q[r] ? q[r]->q : zero;
        acc[r] = _mm512_setzero_ps();
    }
    for (int c = 0; c < d; c++) {
        __m512 kv = _mm512_loadu_ps(kt + (size_t)c * 16);
        for (int r = 0; r < NR; r++) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(qv[r][c]), kv, acc[r]);
    }
    for (int r = 0; r < NR; r++)
        if (q[r] && q[r]->L > l0) _mm512_storeu_ps(q[r]->s + l0, _mm512_mul_ps(acc[r], scale));
}

/* Scores of queries qs[0, n) over the keys g[0, L) they share, 16 keys at a time: the block is
 * transposed once into kt [d][16] (zeros past the longest span), then each row of kt is loaded
 * once for eight (or, for the last few, four) queries. Scores are written in whole blocks of 16:
 * a query's scratch holds its span rounded up to 16. */
static void tile_scores16(attn_query *qs, int n, const float *kc, const int64_t *g, int Hkv, int kh, int d,
                          float scale, float *kt, const float *zero) {
    int Lmax = 0;
    for (int r = 0; r < n; r++) Lmax = qs[r].L > Lmax ? qs[r].L : Lmax;
    __m512 vs = _mm512_set1_ps(scale);
    for (int l0 = 0; l0 < Lmax; l0 += 16) {
        int nk = Lmax - l0 < 16 ? Lmax - l0 : 16;
        const float *k[16];
        for (int i = 0; i < 16; i++) k[i] = i < nk ? kc + ((size_t)g[l0 + i] * Hkv + kh) * d : NULL;
        for (int c0 = 0; c0 < d; c0 += 16) {
            int w = d - c0 < 16 ? d - c0 : 16;
            __mmask16 m = (__mmask16)((1u << w) - 1);
            __m512 r[16];
            for (int i = 0; i < 16; i++) r[i] = k[i] ? _mm512_maskz_loadu_ps(m, k[i] + c0) : _mm512_setzero_ps();
            transpose16(r);
            for (int j = 0; j < w; j++) _mm512_storeu_ps(kt + (size_t)(c0 + j) * 16, r[j]);
        }
        for (int r0 = 0; r0 < n; r0 += 8) {
            attn_query *q[8];
            int left = n - r0;
            for (int r = 0; r < 8; r++) q[r] = r < left ? &qs[r0 + r] : NULL;
            if (left > 4) scores16(q, 8, kt, d, l0, vs, zero);
            else scores16(q, 4, kt, d, l0, vs, zero);
        }
    }
}
#endif

#if !SF_AVX512
/* Scores of queries qs[0, n) over the keys g[0, L) they share (each its own L): a group of
 * eight keys is loaded once for every query whose span holds all eight. */
static void tile_scores(attn_query *qs, int n, const float *kc, const int64_t *g, int Hkv, int kh, int d,
                        float scale) {
    int Lmax = 0, grouped = 0;
    for (int r = 0; r < n; r++) Lmax = qs[r].L > Lmax ? qs[r].L : Lmax;
#if SF_AVX2
    if ((d & 7) == 0) {
        grouped = 1;
        for (int l = 0; l + 8 <= Lmax; l += 8) {
            const float *k[8];
            for (int i = 0; i < 8; i++) k[i] = kc + ((size_t)g[l + i] * Hkv + kh) * d;
            for (int r = 0; r < n; r++) {
                if (qs[r].L < l + 8) continue;
                __m256 acc[8];
                for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
                for (int c = 0; c < d; c += 8) {
                    __m256 qv = _mm256_loadu_ps(qs[r].q + c);
                    for (int i = 0; i < 8; i++) acc[i] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[i] + c), acc[i]);
                }
                _mm256_storeu_ps(qs[r].s + l, _mm256_mul_ps(hsum8x8(acc), _mm256_set1_ps(scale)));
            }
        }
    }
#endif
    for (int r = 0; r < n; r++)
        for (int l = grouped ? qs[r].L / 8 * 8 : 0; l < qs[r].L; l++)
            qs[r].s[l] = dotf(qs[r].q, kc + ((size_t)g[l] * Hkv + kh) * d, d) * scale;
}
#endif

/* o = sum_l w[l] v(g[l]) for every query, keys in order: a block of values is loaded once
 * for every query whose span reaches it; each query's accumulators live in its output between
 * blocks (64 lanes in registers within one). */
#if SF_AVX512
/* Four queries' output lanes [c0, c0 + 64) (d a multiple of 64) over keys [l0, l1) (within
 * every one's span), each value row loaded once for all four: o += w[l] v(g[l]) in key order,
 * as one query alone would add them (each lane its own chain: the lanes may go in any grouping). */
static void values4_d64(attn_query *qs, int l0, int l1, const float *vc, const int64_t *g, int Hkv, int kh, int d,
                        int c0) {
    __m512 acc[4][4];
    for (int r = 0; r < 4; r++)
        for (int i = 0; i < 4; i++) acc[r][i] = _mm512_loadu_ps(qs[r].o + c0 + 16 * i);
    for (int l = l0; l < l1; l++) {
        const float *v = vc + ((size_t)g[l] * Hkv + kh) * d + c0;
        __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16), v2 = _mm512_loadu_ps(v + 32),
               v3 = _mm512_loadu_ps(v + 48);
        for (int r = 0; r < 4; r++) {
            __m512 w = _mm512_set1_ps(qs[r].s[l]);
            acc[r][0] = _mm512_fmadd_ps(w, v0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(w, v1, acc[r][1]);
            acc[r][2] = _mm512_fmadd_ps(w, v2, acc[r][2]);
            acc[r][3] = _mm512_fmadd_ps(w, v3, acc[r][3]);
        }
    }
    for (int r = 0; r < 4; r++)
        for (int i = 0; i < 4; i++) _mm512_storeu_ps(qs[r].o + c0 + 16 * i, acc[r][i]);
}
#endif

static void values_one(attn_query *qr, int l0, int l1, const float *vc, const int64_t *g, int Hkv, int kh, int d);

static void tile_values(attn_query *qs, int n, const float *vc, const int64_t *g, int Hkv, int kh, int d) {
    int Lmax = 0;
    for (int r = 0; r < n; r++) {
        Lmax = qs[r].L > Lmax ? qs[r].L : Lmax;
        memset(qs[r].o, 0, sizeof(float) * (size_t)d);
    }
#if SF_AVX512
    if (d % 64 == 0) { /* d = 64, 128, 256: each 64-lane slice on its own */
        /* Groups of four walk a block of keys together as far as all four spans reach, then each
         * finishes the block alone: every output lane still adds its keys in order. */
        for (int l0 = 0; l0 < Lmax; l0 += VBLOCK) {
            int r = 0;
            for (; r + 4 <= n; r += 4) {
                int l1 = l0 + VBLOCK;
                for (int i = 0; i < 4; i++) l1 = qs[r + i].L < l1 ? qs[r + i].L : l1;
                if (l1 > l0)
                    for (int c0 = 0; c0 < d; c0 += 64) values4_d64(qs + r, l0, l1, vc, g, Hkv, kh, d, c0);
                for (int i = 0; i < 4; i++) {
                    int e = l0 + VBLOCK < qs[r + i].L ? l0 + VBLOCK : qs[r + i].L;
                    values_one(&qs[r + i], l1 > l0 ? l1 : l0, e, vc, g, Hkv, kh, d);
                }
            }
            for (; r < n; r++) {
                int e = l0 + VBLOCK < qs[r].L ? l0 + VBLOCK : qs[r].L;
                values_one(&qs[r], l0, e, vc, g, Hkv, kh, d);
            }
        }
        return;
    }
#endif
    for (int l0 = 0; l0 < Lmax; l0 += VBLOCK)
        for (int r = 0; r < n; r++)
            values_one(&qs[r], l0, l0 + VBLOCK < qs[r].L ? l0 + VBLOCK : qs[r].L, vc, g, Hkv, kh, d);
}

/* One query's o += w[l] v(g[l]) over keys [l0, l1), in key order (the lanes of a 64-wide group
 * in registers; the rest one at a time): the same chain for every output lane as tile_values. */
static void values_one(attn_query *qr, int l0, int l1, const float *vc, const int64_t *g, int Hkv, int kh, int d) {
    const float *w = qr->s;
    float *o = qr->o;
    int c0 = 0;
#if SF_AVX2
    for (; c0 + 64 <= d; c0 += 64) {
        __m256 acc[8];
        for (int i = 0; i < 8; i++) acc[i] = _mm256_loadu_ps(o + c0 + 8 * i);
        for (int l = l0; l < l1; l++) {
            const float *v = vc + ((size_t)g[l] * Hkv + kh) * d + c0;
            __m256 wl = _mm256_set1_ps(w[l]);
            for (int i = 0; i < 8; i++) acc[i] = _mm256_fmadd_ps(wl, _mm256_loadu_ps(v + 8 * i), acc[i]);
        }
        for (int i = 0; i < 8; i++) _mm256_storeu_ps(o + c0 + 8 * i, acc[i]);
    }
#endif
    for (int l = l0; l < l1 && c0 < d; l++) {
        const float *v = vc + ((size_t)g[l] * Hkv + kh) * d;
        for (int c = c0; c < d; c++) o[c] += w[l] * v[c];
    }
}

/* s[l] = exp(s[l] - mx) for l < n; returns their sum. Eight at a time on AVX2 (Cephes' expf:
 * x = k ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial in r, relative error ~2e-7), the tail
 * with expf; which values go together and the order of the sum depend on n alone. */
static float exp_shifted(float *s, int n, float mx) {
    int l = 0;
    float sum = 0.f;
#if SF_AVX2
    __m256 vs = _mm256_setzero_ps(), vm = _mm256_set1_ps(mx);
    const __m256 log2e = _mm256_set1_ps(1.44269504088896341f), c1 = _mm256_set1_ps(0.693359375f),
                 c2 = _mm256_set1_ps(-2.12194440e-4f), floor_ = _mm256_set1_ps(-87.3f), one = _mm256_set1_ps(1.f);
    for (; l + 8 <= n; l += 8) {
        /* x <= 0 (mx is the maximum); below -87.3, e^x is 0 to float precision anyway */
        __m256 x = _mm256_max_ps(_mm256_sub_ps(_mm256_loadu_ps(s + l), vm), floor_);
        __m256 k = _mm256_round_ps(_mm256_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        __m256 r = _mm256_fnmadd_ps(k, c2, _mm256_fnmadd_ps(k, c1, x)); /* x - k ln2 in two parts */
        __m256 p = _mm256_set1_ps(1.9875691500e-4f);
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
        p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, one));
        __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
        __m256 v = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
        _mm256_storeu_ps(s + l, v);
        vs = _mm256_add_ps(vs, v);
    }
    sum = hsum8(vs);
#endif
    for (; l < n; l++) {
        s[l] = expf(s[l] - mx);
        sum += s[l];
    }
    return sum;
}

/* The largest of s[0, n) (exact in any order: the lanes may be reduced in any grouping). */
static float max_of(const float *s, int n) {
    int l = 0;
    float mx = -INFINITY;
#if SF_AVX2
    __m256 vm = _mm256_set1_ps(-INFINITY);
    for (; l + 8 <= n; l += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(s + l));
    float lanes[8];
    _mm256_storeu_ps(lanes, vm);
    for (int i = 0; i < 8; i++) mx = lanes[i] > mx ? lanes[i] : mx;
#endif
    for (; l < n; l++) mx = s[l] > mx ? s[l] : mx;
    return mx;
}

/* s[l] *= k for l < n (each element on its own: the same in any vector width). */
static void scale_by(float *s, int n, float k) {
    int l = 0;
#if SF_AVX2
    __m256 vk = _mm256_set1_ps(k);
    for (; l + 8 <= n; l += 8) _mm256_storeu_ps(s + l, _mm256_mul_ps(_mm256_loadu_ps(s + l), vk));
#endif
    for (; l < n; l++) s[l] *= k;
}

/* Rows [start[i], start[i + 1]) form tile i: at most `rows` consecutive rows with the same
 * first and, over each row's span, the cells of the tile's longest row (every span is then a
 * prefix of the longest's: a prefill chunk's or a draft's rows). Returns the tile count. */
static int plan_tiles(const int64_t *gather, const int64_t *first, const int64_t *lens, int B, int L, int rows,
                      int *start) {
    int n = 0;
    for (int b = 0; b < B;) {
        int longest = b, e = b + 1;
        for (; e < B && e - b < rows && first[e] == first[b]; e++) {
            int64_t f = first[b], m = lens[e] < lens[longest] ? lens[e] : lens[longest];
            if (memcmp(gather + (size_t)e * L + f, gather + (size_t)longest * L + f, sizeof(int64_t) * (size_t)(m - f)))
                break;
            if (lens[e] > lens[longest]) longest = e;
        }
        start[n] = b;
        start[B + 1 + n++] = longest; /* the tile's longest row, after the starts */
        b = e;
    }
    start[n] = B;
    return n;
}

typedef struct {
    const float *q, *kc, *vc;
    const int64_t *gather, *first, *lens;
    float *out, scale;
    int B, H, Hkv, d, L;
    const int *tiles; /* plan_tiles' starts [n_tiles + 1], then each tile's longest row at B + 1 */
    int n_tiles, Lmax, maxq; /* Lmax: the longest span rounded up to 16 (a score row's stride) */
    size_t per_part;         /* scratch floats a part owns: maxq score rows, kt [d][16], a zero query [d] */
    float *scratch;          /* [parts, per_part] */
} attn_task;

/* One tile's queries against one kv head, MAXQ query vectors at a time. */
static void attend_tile(const attn_task *t, int tile, int kh, float *scratch) {
    int group = t->H / t->Hkv, b0 = t->tiles[tile], b1 = t->tiles[tile + 1], longest = t->tiles[t->B + 1 + tile];
    int f = (int)t->first[b0], nq = (b1 - b0) * group;
    const int64_t *g = t->gather + (size_t)longest * t->L + f;
    attn_query qs[MAXQ];
    for (int q0 = 0; q0 < nq; q0 += t->maxq) {
        int n = nq - q0 < t->maxq ? nq - q0 : t->maxq;
        for (int r = 0; r < n; r++) {
            int b = b0 + (q0 + r) / group, h = kh * group + (q0 + r) % group;
            size_t at = ((size_t)b * t->H + h) * t->d;
            qs[r] = (attn_query){t->q + at, scratch + (size_t)r * t->Lmax, t->out + at, (int)t->lens[b] - f};
        }
#if SF_AVX512
        float *kt = scratch + (size_t)t->maxq * t->Lmax;
        tile_scores16(qs, n, t->kc, g, t->Hkv, kh, t->d, t->scale, kt, kt + 16 * (size_t)t->d);
#else
        tile_scores(qs, n, t->kc, g, t->Hkv, kh, t->d, t->scale);
#endif
        for (int r = 0; r < n; r++) {
            float *s = qs[r].s;
            float inv = 1.f / exp_shifted(s, qs[r].L, max_of(s, qs[r].L));
            scale_by(s, qs[r].L, inv);
        }
        tile_values(qs, n, t->vc, g, t->Hkv, kh, t->d);
    }
}

static void attn_part(void *p, int part, int parts) {
    const attn_task *t = p;
    int lo, hi;
    split(t->n_tiles * t->Hkv, part, parts, 1, &lo, &hi);
    for (int it = lo; it < hi; it++)
        attend_tile(t, it / t->Hkv, it % t->Hkv, t->scratch + (size_t)part * t->per_part);
}

/* Attention over a tile plan (see plan_tiles); 0, or -2 when the scratch cannot be had
 * (taken before any part runs: nothing is written then). */
static int attend_planned(const float *q, const float *kc, const float *vc, const int64_t *gather,
                          const int64_t *first, const int64_t *lens, int B, int H, int Hkv, int d, int L, float scale,
                          float *out, const int *tiles, int n_tiles) {
    int Lmax = 1, rows = 1, group = H / Hkv;
    for (int b = 0; b < B; b++) Lmax = lens[b] - first[b] > Lmax ? (int)(lens[b] - first[b]) : Lmax;
    for (int i = 0; i < n_tiles; i++) rows = tiles[i + 1] - tiles[i] > rows ? tiles[i + 1] - tiles[i] : rows;
    int maxq = rows * group < MAXQ ? rows * group : MAXQ; /* query vectors an item holds at once */
    int parts = (size_t)B * Lmax * H * d < 32768 ? 1 : n_parts((size_t)n_tiles * Hkv, 1);
    if (parts > 0xffff) parts = 0xffff; /* run's own cap */
    Lmax = (Lmax + 15) / 16 * 16;
    size_t per_part = (size_t)maxq * Lmax + 17 * (size_t)d;
    float *scratch = calloc((size_t)parts * per_part, sizeof(float)); /* zeroed: each part's zero query */
    if (!scratch) return -2;
    attn_task t = {q, kc, vc, gather, first, lens, out, scale, B, H, Hkv, d, L, tiles, n_tiles, Lmax, maxq, per_part,
                   scratch};
    run(attn_part, &t, parts);
    free(scratch);
    return 0;
}

static int check_spans(const int64_t *first, const int64_t *lens, int B, int L) {
    for (int b = 0; b < B; b++)
        if (first[b] < 0 || lens[b] <= first[b] || lens[b] > L) return -1;
    return 0;
}

/* Rows per tile: enough that a tile's queries fill MAXQ (one row when a kv head serves MAXQ
 * or more query heads). */
static int tile_rows(int H, int Hkv) { return H / Hkv >= MAXQ ? 1 : MAXQ / (H / Hkv); }

/* q [B, H, d]; kc, vc [S, Hkv, d]; gather [B, L] cells: row b attends to its entries
 * first[b] .. lens[b] - 1 (a sliding window starts past 0); out [B, H, d]. Query head h reads
 * kv head h / (H / Hkv). Returns 0; -1 on bad arguments, -2 when scratch memory cannot be
 * allocated (nothing is written then, never a row of uninitialised output). */
int sf_attend_decode(const float *q, const float *kc, const float *vc, const int64_t *gather, const int64_t *first,
                     const int64_t *lens, int B, int H, int Hkv, int d, int L, float scale, float *out) {
    if (H % Hkv || check_spans(first, lens, B, L)) return -1;
    int *tiles = malloc(sizeof(int) * (2 * (size_t)B + 2));
    if (!tiles) return -2;
    int n = plan_tiles(gather, first, lens, B, L, tile_rows(H, Hkv), tiles);
    int rc = attend_planned(q, kc, vc, gather, first, lens, B, H, Hkv, d, L, scale, out, tiles, n);
    free(tiles);
    return rc;
}

/* ------------------------------------------------------------------- RMS norm */

/* x, y [M, D]; w [D]. Statistics in fp32 (as transformers for fp32 models). y may alias x. */
void sf_rms_norm(const float *x, const float *w, float *y, int M, int D, float eps) {
    for (int m = 0; m < M; m++) {
        const float *r = x + (size_t)m * D;
        float ss = 0.f;
        for (int j = 0; j < D; j++) ss += r[j] * r[j];
        float inv = 1.f / sqrtf(ss / D + eps);
        for (int j = 0; j < D; j++) y[(size_t)m * D + j] = w[j] * (r[j] * inv);
    }
}

/* ------------------------------------------------------------ RoPE + KV store */

/* qkv [T, (H + 2 Hkv) d] (q heads, k heads, v heads); cos, sin [P, d] tables; pos [T];
 * slots [T]. Rotates q and k (rotate-half: out_j = x_j cos_j - x_{j+d/2} sin_j,
 * out_{j+d/2} = x_{j+d/2} cos_{j+d/2} + x_j sin_{j+d/2}), writes q to q_out [T, H, d] and
 * k, v to kc, vc [S, Hkv, d] at cell slots[t]. */
void sf_rope_kv(const float *qkv, int T, int H, int Hkv, int d, const float *cos, const float *sin,
                const int64_t *pos, const int64_t *slots, float *kc, float *vc, float *q_out) {
    int half = d / 2, width = (H + 2 * Hkv) * d;
    for (int t = 0; t < T; t++) {
        const float *row = qkv + (size_t)t * width, *c = cos + (size_t)pos[t] * d, *s = sin + (size_t)pos[t] * d;
        for (int h = 0; h < H + Hkv; h++) {
            const float *x = row + (size_t)h * d;
            float *o = h < H ? q_out + ((size_t)t * H + h) * d : kc + ((size_t)slots[t] * Hkv + (h - H)) * d;
            for (int j = 0; j < half; j++) {
                float a = x[j], b = x[j + half];
                o[j] = a * c[j] - b * s[j];
                o[j + half] = b * c[j + half] + a * s[j + half];
            }
        }
        memcpy(vc + (size_t)slots[t] * Hkv * d, row + (size_t)(H + Hkv) * d, sizeof(float) * (size_t)Hkv * d);
    }
}

/* gu [T, 2F] (gate then up) -> out [T, F] = silu(gate) * up. */
void sf_silu_mul(const float *gu, int T, int F, float *out) {
    for (int t = 0; t < T; t++) {
        const float *g = gu + (size_t)t * 2 * F, *u = g + F;
        float *o = out + (size_t)t * F;
        for (int j = 0; j < F; j++) o[j] = g[j] / (1.f + expf(-g[j])) * u[j];
    }
}

/* ------------------------------------------------------- mixture of experts */

typedef struct {
    int E, used, renorm, F; /* experts, experts per token, top weights renormalised, an expert's ffn width */
    sf_qcat router;         /* [E, D] */
    const sf_qcat *gu, *down; /* per expert: [2F, D] gate rows then up rows; [D, F] */
} sf_moe;

static int qcat_rows(const sf_qcat *w) {
    int N = 0;
    for (int k = 0; k < w->n; k++) N += w->p[k].N;
    return N;
}

/* The routing of one row, as transformers: softmax over the router's logits in fp32, the
 * `used` largest (ties to the lower expert), optionally divided by their sum. idx, wt [used]. */
static void route_row(const float *l, int E, int used, int renorm, int *idx, float *wt) {
    float mx = l[0], s = 0.f;
    for (int e = 1; e < E; e++) mx = l[e] > mx ? l[e] : mx;
    for (int e = 0; e < E; e++) s += expf(l[e] - mx);
    unsigned char taken[1024] = {0}; /* E <= 1024 (checked) */
    float sum = 0.f;
    for (int k = 0; k < used; k++) {
        int best = -1;
        for (int e = 0; e < E; e++)
            if (!taken[e] && (best < 0 || l[e] > l[best])) best = e;
        taken[best] = 1;
        idx[k] = best;
        wt[k] = expf(l[best] - mx) / s;
        sum += wt[k];
    }
    if (renorm)
        for (int k = 0; k < used; k++) wt[k] /= sum;
}

/* The mixture-of-experts feed-forward of h [T, D] into out [T, D] (before the residual add):
 * decoder._experts in C. The step's rows are grouped by expert (counting sort, each group in
 * row order); each expert in ascending order runs once over its rows (gather, gate/up,
 * SiLU-gating, down) and adds each row's product, times its weight, into that row's output.
 * A row's result depends on that row alone: its routing, then the same per-row GEMV and the
 * same order of adds, whatever else is in the step. Returns 0, -1 on bad arguments, -2 on no memory. */
int sf_experts(const sf_moe *m, const float *h, int T, int D, float *out) {
    int E = m->E, U = m->used, F = m->F;
    if (E < 1 || E > 1024 || U < 1 || U > E || F < 1 || check_qcat(&m->router) || m->router.p[0].K != D ||
        qcat_rows(&m->router) != E)
        return -1;
    for (int e = 0; e < E; e++)
        if (check_qcat(&m->gu[e]) || check_qcat(&m->down[e]) || m->gu[e].p[0].K != D || qcat_rows(&m->gu[e]) != 2 * F ||
            m->down[e].p[0].K != F || qcat_rows(&m->down[e]) != D)
            return -1;
    if (T < 1) return T < 0 ? -1 : 0;
    size_t TU = (size_t)T * U;
    /* an expert sees a row at most once, so its group has at most T rows */
    float *logits = malloc(sizeof(float) * ((size_t)T * E + 2 * TU + (size_t)T * (2 * (size_t)D + 3 * (size_t)F)));
    int *idx = malloc(sizeof(int) * (2 * TU + 2 * (size_t)E + 1));
    if (!logits || !idx) {
        free(logits);
        free(idx);
        return -2;
    }
    float *wt = logits + (size_t)T * E, *rw = wt + TU, *hg = rw + TU, *gu = hg + (size_t)T * D, *act = gu + (size_t)T * 2 * F,
          *y = act + (size_t)T * F;
    int *rows = idx + TU, *start = rows + TU, *fill = start + E + 1;
    int rc = gemv(&m->router, h, logits, T, 0);
    if (!rc) {
        for (int t = 0; t < T; t++) route_row(logits + (size_t)t * E, E, U, m->renorm, idx + (size_t)t * U, wt + (size_t)t * U);
        memset(start, 0, sizeof(int) * ((size_t)E + 1));
        for (size_t i = 0; i < TU; i++) start[idx[i] + 1]++;
        for (int e = 0; e < E; e++) start[e + 1] += start[e];
        memcpy(fill, start, sizeof(int) * (size_t)E);
        for (size_t i = 0; i < TU; i++) { /* row order within each expert */
            int slot = fill[idx[i]]++;
            rows[slot] = (int)(i / U);
            rw[slot] = wt[i];
        }
    }
    memset(out, 0, sizeof(float) * (size_t)T * D);
    for (int e = 0; e < E && !rc; e++) {
        int n = start[e + 1] - start[e];
        if (!n) continue;
        const int *r = rows + start[e];
        for (int i = 0; i < n; i++) memcpy(hg + (size_t)i * D, h + (size_t)r[i] * D, sizeof(float) * D);
        if ((rc = gemv(&m->gu[e], hg, gu, n, 0))) break;
        sf_silu_mul(gu, n, F, act);
        if ((rc = gemv(&m->down[e], act, y, n, 0))) break;
        for (int i = 0; i < n; i++) {
            float *o = out + (size_t)r[i] * D, w = rw[start[e] + i];
            const float *yi = y + (size_t)i * D;
            for (int j = 0; j < D; j++) o[j] += yi[j] * w;
        }
    }
    free(idx);
    free(logits);
    return rc;
}

/* ------------------------------------------------------- whole decode forward */

typedef struct {
    const float *attn_norm, *ffn_norm, *bqkv; /* bqkv may be NULL */
    const float *q_norm, *k_norm; /* [d] per head or [H d] / [Hkv d] over all heads (sf_model.qk_norm); NULL: none */
    sf_qcat wqkv, wo, wgu, wdown; /* each matrix in its own kind (a Q4_K_M file mixes them); wgu, wdown unused with moe */
    const sf_moe *moe;            /* NULL: the dense feed-forward */
    float *kc, *vc;               /* this layer's cache [S, Hkv, d] */
} sf_layer;

typedef struct {
    int n_layers, D, F, H, Hkv, d;
    int qk_norm;      /* 1: per head, 2: over all heads (the layers' q_norm / k_norm) */
    float eps, scale; /* scale: attention's 1 / sqrt(d) */
    const float *cos, *sin, *norm; /* cos, sin [P, d]; norm [D] */
    const sf_layer *layers;
} sf_model;

/* qkv [T, W] += b [W] per row (the bias NativeKernels.linear adds: the same float sums). */
static void add_bias(float *qkv, const float *b, int T, int W) {
    for (int t = 0; t < T; t++)
        for (int j = 0; j < W; j++) qkv[(size_t)t * W + j] += b[j];
}

/* q and k of each row of qkv [T, W] RMS-normed in place, per head of d or over all heads:
 * the rows NativeKernels.norm normalises (the same sf_rms_norm per row), v left as is. */
static void qk_norm(float *qkv, int T, int H, int Hkv, int d, int per_head, const float *qn, const float *kn,
                    float eps) {
    int W = (H + 2 * Hkv) * d;
    for (int t = 0; t < T; t++) {
        float *q = qkv + (size_t)t * W, *k = q + (size_t)H * d;
        if (per_head) {
            sf_rms_norm(q, qn, q, H, d, eps);
            sf_rms_norm(k, kn, k, Hkv, d, eps);
        } else {
            sf_rms_norm(q, qn, q, 1, H * d, eps);
            sf_rms_norm(k, kn, k, 1, Hkv * d, eps);
        }
    }
}

/* decoder.layer (decoder.py) over every layer, then the final norm: the kernels that
 * native.NativeKernels calls one by one from Python, called here in the same order with the
 * same arguments, so the rows are bit-identical (tests/test_whole_step.py, on every
 * architecture feature) and a step costs one call instead of ~9 per layer (the Python round
 * trips are what this saves: measured in native.py's module doc). Change the two together.
 * x [T, D] embeddings in (used as the residual stream), out [T, D] the normed hidden states.
 * pos/slots [T]; gather [T, L] key cells with spans first/lens as in sf_attend_decode: any
 * step whose rows each see their keys up to their own position (decodes, prefill chunks,
 * draft verification: every row's k/v is stored before any row attends). Returns 0, or < 0
 * on bad arguments (checked before anything is written) / no memory. */
int sf_decode(const sf_model *m, float *x, int T, const int64_t *pos, const int64_t *slots, const int64_t *gather,
              int L, const int64_t *first, const int64_t *lens, float *out) {
    int D = m->D, H = m->H, Hkv = m->Hkv, d = m->d, F = m->F, W = (H + 2 * Hkv) * d;
    if (check_spans(first, lens, T, L)) return -1;
    size_t n = (size_t)T * (2 * (size_t)D + W + 2 * (size_t)H * d + 3 * (size_t)F);
    float *buf = malloc(sizeof(float) * n);
    int *tiles = malloc(sizeof(int) * (2 * (size_t)T + 2));
    if (!buf || !tiles) {
        free(buf);
        free(tiles);
        return -2;
    }
    int n_tiles = plan_tiles(gather, first, lens, T, L, tile_rows(H, Hkv), tiles); /* every layer's, once */
    float *h = buf, *qkv = h + (size_t)T * D, *q = qkv + (size_t)T * W, *a = q + (size_t)T * H * d,
          *gu = a + (size_t)T * H * d, *act = gu + (size_t)T * 2 * F, *ffn = act + (size_t)T * F;
    int rc = 0;
#define STEP(call) if ((rc = (call))) break /* the first failure ends the step with its code */
    for (int li = 0; li < m->n_layers; li++) {
        const sf_layer *ly = &m->layers[li];
        sf_rms_norm(x, ly->attn_norm, h, T, D, m->eps);                                    /* norm */
        STEP(gemv(&ly->wqkv, h, qkv, T, 0));                                                  /* qkv */
        if (ly->bqkv) add_bias(qkv, ly->bqkv, T, W);                                        /* + bias */
        if (ly->q_norm) qk_norm(qkv, T, H, Hkv, d, m->qk_norm == 1, ly->q_norm, ly->k_norm, m->eps); /* q/k norm */
        sf_rope_kv(qkv, T, H, Hkv, d, m->cos, m->sin, pos, slots, ly->kc, ly->vc, q);       /* rope, kv store */
        STEP(attend_planned(q, ly->kc, ly->vc, gather, first, lens, T, H, Hkv, d, L, m->scale, a, tiles, n_tiles));
        STEP(gemv(&ly->wo, a, x, T, 1));                                                      /* o + residual */
        sf_rms_norm(x, ly->ffn_norm, h, T, D, m->eps);                                      /* norm */
        if (ly->moe) {                                                                      /* experts */
            STEP(sf_experts(ly->moe, h, T, D, ffn));
            for (size_t i = 0; i < (size_t)T * D; i++) x[i] += ffn[i];                     /* + residual */
            continue;
        }
        STEP(gemv(&ly->wgu, h, gu, T, 0));                                                    /* gate/up */
        sf_silu_mul(gu, T, F, act);                                                         /* gating */
        STEP(gemv(&ly->wdown, act, x, T, 1));                                                 /* down + residual */
    }
#undef STEP
    if (!rc) sf_rms_norm(x, m->norm, out, T, D, m->eps);
    free(tiles);
    free(buf);
    return rc;
}
