/* The CPU product of turboquant::linear for a few activation rows, decoding the packed weight a few rows at a time.

   Built on first use by turboquant_hf/cpu_kernel.py with the machine's C compiler (-O3 -march=native
   -ffp-contract=off, OpenMP where the compiler has it) and called through ctypes; no Python or torch header.

   tq_linear computes out[m, r] = sum_k w_rot[r, k] * x_rot[m, k] for M activation rows, where
   w_rot[r, g*G + i] = codebook[idx] * norm[r, g] is the weight in the rotated basis (the reference's
   `codec.rotated_weight`: the same float32 products) and x_rot the activations rotated per group
   (D2 . H . D1 . x / sqrt(G), zero-padded to whole groups) or given already rotated. Each thread takes a
   contiguous share of the weight rows. With one activation row, each weight row is multiplied as it is decoded, in
   registers; otherwise TILE_R weight rows are decoded into a buffer of the thread's own (in the
   caches) and multiplied by every activation row there, TILE_M activation rows by TILE_R weight rows at a time.
   Each output is one dot product in a fixed order, whatever the number of rows, threads or the row's place.
   Packed indices are read in the published tq3_native layout: LSB-first bit streams of 2-, 3- or 4-bit indices
   per group, five base-3 digits a byte for ternary. With AVX2 and FMA (x86-64) the codebook is looked up with
   lane permutes (vpermps), eight indices at a time; elsewhere in portable C.

   tq_decode writes the decoded rows themselves (what the product multiplies), for checking them bit for bit. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && defined(__AVX2__) && defined(__FMA__) && !defined(TQ_PORTABLE)
#include <immintrin.h>
#define TQ_AVX2 1
#endif

enum { TQ_F32 = 0, TQ_BF16 = 1, TQ_F16 = 2 };

/* ---- scalar conversions ---------------------------------------------------------------------------------- */

static float f32_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    if (exp == 0) { /* zero or subnormal: man * 2^-24, exact in float32 */
        float f = (float)man * 5.9604644775390625e-08f;
        return sign ? -f : f;
    }
    if (exp == 31) return f32_bits(sign | 0x7f800000u | (man << 13));
    return f32_bits(sign | ((exp + 112u) << 23) | (man << 13));
}

/* round to nearest even; NaN to the quiet NaN 0x7fc0 (as torch converts) */
static uint16_t float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static float load_float(const void *p, int dtype, size_t i) {
    if (dtype == TQ_F32) return ((const float *)p)[i];
    uint16_t v = ((const uint16_t *)p)[i];
    return dtype == TQ_BF16 ? f32_bits((uint32_t)v << 16) : half_to_float(v);
}

/* ---- per-thread buffers ------------------------------------------------------------------------------------ */

static float *thread_buffer(int which, size_t floats) {
    static __thread float *bufs[3];
    static __thread size_t caps[3];
    if (caps[which] < floats) {
        free(bufs[which]);
        bufs[which] = (float *)aligned_alloc(64, ((floats * 4 + 63) / 64) * 64);
        caps[which] = bufs[which] ? floats : 0;
    }
    return bufs[which];
}

/* ---- decoding one group: dst[0..G) = lut[idx], lut = codebook * norm ------------------------------------------ */

/* digits of each byte, least significant first, one byte each (bytes from 243 on as the reference reads them) */
static uint64_t ternary_digits[256];

__attribute__((constructor)) static void init_ternary(void) {
    for (int b = 0; b < 256; b++) {
        uint64_t d = 0;
        for (int i = 0, p = 1; i < 5; i++, p *= 3) d |= (uint64_t)((b / p) % 3) << (8 * i);
        ternary_digits[b] = d;
    }
}

static void decode_group_portable(const uint8_t *p, int n_levels, int G, const float *lut, float *dst) {
    if (n_levels == 3) {
        int bytes = (G + 4) / 5;
        for (int j = 0; j < bytes; j++) {
            uint64_t d = ternary_digits[p[j]];
            for (int i = 0; i < 5 && 5 * j + i < G; i++) dst[5 * j + i] = lut[(d >> (8 * i)) & 0xff];
        }
        return;
    }
    int b = n_levels == 4 ? 2 : n_levels == 8 ? 3 : 4;
    uint32_t mask = (uint32_t)n_levels - 1;
    for (int i = 0; i < G; i++) {
        int bit = i * b, byte = bit >> 3, shift = bit & 7;
        uint32_t w = p[byte] | ((shift + b > 8) ? (uint32_t)p[byte + 1] << 8 : 0);
        dst[i] = lut[(w >> shift) & mask];
    }
}

/* The codebook as the decoders read it, TABLES floats: 16 entries, the codebook repeated (ternary: its 3 entries,
   then zeros); for ternary then, for every byte, the codebook entries of its five digits and three zeros. */
#define TABLES (16 + 256 * 8)
static void build_tables(const float *codebook, int n_levels, float *t) {
    for (int i = 0; i < 16; i++) t[i] = n_levels == 3 ? (i < 3 ? codebook[i] : 0.0f) : codebook[i % n_levels];
    if (n_levels == 3)
        for (int b = 0; b < 256; b++)
            for (int i = 0; i < 8; i++) t[16 + 8 * b + i] = i < 5 ? t[(ternary_digits[b] >> (8 * i)) & 0xff] : 0.0f;
}

/* one row of the weight in the rotated basis into dst, n_groups groups of G floats (codebook[idx] * norm), reading
   no byte past the row's own (the form for the last row of a call) */
static void decode_row_portable(const uint8_t *prow, const void *norms, int norms_dtype, size_t first_norm,
                                const float *t16, int n_levels, int G, int n_groups, int bpg, float *dst) {
    float lut[16];
    for (int g = 0; g < n_groups; g++) {
        float n = load_float(norms, norms_dtype, first_norm + g);
        for (int i = 0; i < 16; i++) lut[i] = t16[i] * n;
        decode_group_portable(prow + (size_t)g * bpg, n_levels, G, lut, dst + (size_t)g * G);
    }
}

#ifdef TQ_AVX2
/* the 32-bit word at p (any alignment) in every lane: a load, no shuffle */
static inline __m256i bcast32(const uint8_t *p) {
    return _mm256_castps_si256(_mm256_broadcast_ss((const float *)(const void *)p));
}

/* Indices 8c..8c+7 of a group (p: its bytes) as values of the tables t0 (and t1): codebook * norm, 8 entries a
   register, the codebook repeated where it has fewer, so that the bits above an index that permutevar reads
   select the same entry. Reading a whole word reads past a row's last bytes: the last row of a call is decoded
   apart. 3 bits: 8 indices in 3 bytes, read as a 32-bit word (one byte past them). */
static inline __m256 chunk8(const uint8_t *p, int c, __m256 t0, __m256 t1) {
    return _mm256_permutevar8x32_ps(t0, _mm256_srlv_epi32(bcast32(p + 3 * c), _mm256_setr_epi32(0, 3, 6, 9, 12, 15, 18, 21)));
    (void)t1;
}
/* 2 bits: 8 indices in 2 bytes, read as a 32-bit word (two bytes past them) */
static inline __m256 chunk4(const uint8_t *p, int c, __m256 t0, __m256 t1) {
    return _mm256_permutevar8x32_ps(t0, _mm256_srlv_epi32(bcast32(p + 2 * c), _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14)));
    (void)t1;
}
/* 4 bits: 8 indices a word; the fourth bit chooses between t0 (entries 0-7) and t1 (8-15): one two-table permute
   with AVX-512VL, else two permutes and a blend */
static inline __m256 chunk16(const uint8_t *p, int c, __m256 t0, __m256 t1) {
    __m256i idx = _mm256_srlv_epi32(bcast32(p + 4 * c), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28));
#if defined(__AVX512VL__) && defined(__AVX512F__) && !defined(TQ_NO_AVX512)
    return _mm256_permutex2var_ps(t0, idx, t1);
#else
    return _mm256_blendv_ps(_mm256_permutevar8x32_ps(t0, idx), _mm256_permutevar8x32_ps(t1, idx),
                            _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
#endif
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* One weight row (prow: its bytes) decoded: into dst when dst is given, else multiplied by the rotated activation row
   x as it is decoded, the dot product returned. */
#define ROW_FUNCTION(NAME, CHUNK)                                                                                 \
    static float NAME(const uint8_t *prow, const void *norms, int norms_dtype, size_t first_norm, __m256 T0,      \
                      __m256 T1, int G, int n_groups, int bpg, const float *x, float *dst) {                      \
        const int chunks = G / 8;                                                                                 \
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;                                               \
        for (int g = 0; g < n_groups; g++) {                                                                      \
            __m256 n = _mm256_set1_ps(load_float(norms, norms_dtype, first_norm + g));                            \
            __m256 t0 = _mm256_mul_ps(T0, n), t1 = _mm256_mul_ps(T1, n);                                          \
            const uint8_t *p = prow + (size_t)g * bpg;                                                            \
            if (dst) {                                                                                            \
                float *d = dst + (size_t)g * G;                                                                   \
                for (int c = 0; c < chunks; c++) _mm256_storeu_ps(d + 8 * c, CHUNK(p, c, t0, t1));                \
                continue;                                                                                         \
            }                                                                                                     \
            const float *xg = x + (size_t)g * G;                                                                  \
            int c = 0;                                                                                            \
            for (; c + 4 <= chunks; c += 4) {                                                                     \
                a0 = _mm256_fmadd_ps(CHUNK(p, c, t0, t1), _mm256_loadu_ps(xg + 8 * c), a0);                      \
                a1 = _mm256_fmadd_ps(CHUNK(p, c + 1, t0, t1), _mm256_loadu_ps(xg + 8 * c + 8), a1);               \
                a2 = _mm256_fmadd_ps(CHUNK(p, c + 2, t0, t1), _mm256_loadu_ps(xg + 8 * c + 16), a2);              \
                a3 = _mm256_fmadd_ps(CHUNK(p, c + 3, t0, t1), _mm256_loadu_ps(xg + 8 * c + 24), a3);              \
            }                                                                                                     \
            for (; c < chunks; c++) a0 = _mm256_fmadd_ps(CHUNK(p, c, t0, t1), _mm256_loadu_ps(xg + 8 * c), a0);   \
        }                                                                                                         \
        return hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));                                 \
    }

ROW_FUNCTION(row3, chunk8)
ROW_FUNCTION(row2, chunk4)
ROW_FUNCTION(row4, chunk16)

/* ternary: a byte's five values (and three zeros) from its row of the table, scaled, stored eight lanes wide (the
   three past them are overwritten next) into dst */
static void decode_row_ternary(const uint8_t *prow, const void *norms, int norms_dtype, size_t first_norm,
                               const float *bytes, int G, int n_groups, int bpg, float *dst) {
    for (int g = 0; g < n_groups; g++) {
        __m256 n = _mm256_set1_ps(load_float(norms, norms_dtype, first_norm + g));
        const uint8_t *p = prow + (size_t)g * bpg;
        float *d = dst + (size_t)g * G;
        for (int j = 0; j < bpg; j++) _mm256_storeu_ps(d + 5 * j, _mm256_mul_ps(_mm256_loadu_ps(bytes + 8 * p[j]), n));
    }
}

/* ternary, one activation row: each byte's five values times five activations (a masked load: no lane past them),
   the group's last byte only its digits within the group; reads no byte past the row */
static float row_ternary(const uint8_t *prow, const void *norms, int norms_dtype, size_t first_norm,
                         const float *bytes, int G, int n_groups, int bpg, const float *x) {
    const int full = G / 5, rest = G - 5 * full;
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i m5 = _mm256_cmpgt_epi32(_mm256_set1_epi32(5), lane);
    const __m256i mr = _mm256_cmpgt_epi32(_mm256_set1_epi32(rest), lane);
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int g = 0; g < n_groups; g++) {
        __m256 n = _mm256_set1_ps(load_float(norms, norms_dtype, first_norm + g));
        const uint8_t *p = prow + (size_t)g * bpg;
        const float *xg = x + (size_t)g * G;
        int j = 0;
        for (; j + 4 <= full; j += 4) {
            a0 = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_loadu_ps(bytes + 8 * p[j]), n), _mm256_maskload_ps(xg + 5 * j, m5), a0);
            a1 = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_loadu_ps(bytes + 8 * p[j + 1]), n), _mm256_maskload_ps(xg + 5 * j + 5, m5), a1);
            a2 = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_loadu_ps(bytes + 8 * p[j + 2]), n), _mm256_maskload_ps(xg + 5 * j + 10, m5), a2);
            a3 = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_loadu_ps(bytes + 8 * p[j + 3]), n), _mm256_maskload_ps(xg + 5 * j + 15, m5), a3);
        }
        for (; j < full; j++)
            a0 = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_loadu_ps(bytes + 8 * p[j]), n), _mm256_maskload_ps(xg + 5 * j, m5), a0);
        if (rest)
            a1 = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_loadu_ps(bytes + 8 * p[full]), n), _mm256_maskload_ps(xg + 5 * full, mr), a1);
    }
    (void)bpg;
    return hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
}

/* <w, x> over n_groups groups of G in the order of the row functions' products (the same sums, bit for bit) */
static float dot_grouped(const float *w, const float *x, int G, int n_groups) {
    const int chunks = G / 8;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int g = 0; g < n_groups; g++) {
        const float *wg = w + (size_t)g * G, *xg = x + (size_t)g * G;
        int c = 0;
        for (; c + 4 <= chunks; c += 4) {
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(wg + 8 * c), _mm256_loadu_ps(xg + 8 * c), a0);
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(wg + 8 * c + 8), _mm256_loadu_ps(xg + 8 * c + 8), a1);
            a2 = _mm256_fmadd_ps(_mm256_loadu_ps(wg + 8 * c + 16), _mm256_loadu_ps(xg + 8 * c + 16), a2);
            a3 = _mm256_fmadd_ps(_mm256_loadu_ps(wg + 8 * c + 24), _mm256_loadu_ps(xg + 8 * c + 24), a3);
        }
        for (; c < chunks; c++) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(wg + 8 * c), _mm256_loadu_ps(xg + 8 * c), a0);
    }
    return hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
}

/* Whether one activation row's products take a weight row at a time (`row` with x). */
static int fuses(int n_levels) { (void)n_levels; return 1; }

/* One row of the weight (t: the tables of `build_tables`): with x (one activation row) its dot product with x into
   *out, multiplied as it is decoded; else decoded into w. The last row of a call (`last`) is decoded without
   reading past its bytes, and its product summed in the same order (`dot_grouped`); ternary rows read only their
   own bytes. */
static void row(const uint8_t *prow, const void *norms, int norms_dtype, size_t first_norm, const float *t,
                int n_levels, int G, int n_groups, int bpg, const float *x, float *w, float *out, int last) {
    if (n_levels == 3 && x) {
        *out = row_ternary(prow, norms, norms_dtype, first_norm, t + 16, G, n_groups, bpg, x);
        return;
    }
    if (n_levels == 3) {
        decode_row_ternary(prow, norms, norms_dtype, first_norm, t + 16, G, n_groups, bpg, w);
        return;
    }
    if (last) {
        decode_row_portable(prow, norms, norms_dtype, first_norm, t, n_levels, G, n_groups, bpg, w);
        if (x) *out = dot_grouped(w, x, G, n_groups);
        return;
    }
    __m256 T0 = _mm256_loadu_ps(t), T1 = _mm256_loadu_ps(t + 8);
    float *dst = x ? NULL : w;
    float y;
    switch (n_levels) {
    case 8: y = row3(prow, norms, norms_dtype, first_norm, T0, T1, G, n_groups, bpg, x, dst); break;
    case 4: y = row2(prow, norms, norms_dtype, first_norm, T0, T1, G, n_groups, bpg, x, dst); break;
    default: y = row4(prow, norms, norms_dtype, first_norm, T0, T1, G, n_groups, bpg, x, dst); break;
    }
    if (!dst) *out = y;
}
#else
static int fuses(int n_levels) { (void)n_levels; return 0; }

static void row(const uint8_t *prow, const void *norms, int norms_dtype, size_t first_norm, const float *t16,
                int n_levels, int G, int n_groups, int bpg, const float *x, float *w, float *out, int last) {
    decode_row_portable(prow, norms, norms_dtype, first_norm, t16, n_levels, G, n_groups, bpg, w);
    (void)x, (void)out, (void)last;
}
#endif

/* ---- several activation rows: tiles of TILE_M activation rows by TILE_R decoded weight rows -------------------- */

#define TILE_R 4
#define TILE_M 2
#if defined(TQ_AVX2)
typedef __m256 vec;
#define VW 8
#define vzero _mm256_setzero_ps
#define vload _mm256_loadu_ps
#define vfma _mm256_fmadd_ps
#define vsum hsum
#else
typedef struct { float v[8]; } vec;
#define VW 8
static vec vzero(void) { vec z = {{0}}; return z; }
static vec vload(const float *p) { vec r; memcpy(r.v, p, sizeof r.v); return r; }
static vec vfma(vec a, vec b, vec c) { for (int l = 0; l < 8; l++) c.v[l] += a.v[l] * b.v[l]; return c; }
static float vsum(vec a) { return ((a.v[0] + a.v[4]) + (a.v[1] + a.v[5])) + ((a.v[2] + a.v[6]) + (a.v[3] + a.v[7])); }
#endif

/* acc[j][i] += <w + i * P, x + j * P> over k in [0, kn), in steps of VW lanes (i < nr, j < mb) */
static inline __attribute__((always_inline)) void tile_body(const float *w, int nr, const float *x, int mb, int kn,
                                                            int P, vec (*acc)[TILE_R]) {
    vec a[TILE_M][TILE_R];
    for (int j = 0; j < mb; j++)
        for (int i = 0; i < nr; i++) a[j][i] = acc[j][i];
    for (int k = 0; k < kn; k += VW) {
        vec wk[TILE_R];
        for (int i = 0; i < nr; i++) wk[i] = vload(w + (size_t)i * P + k);
        for (int j = 0; j < mb; j++) {
            vec xk = vload(x + (size_t)j * P + k);
            for (int i = 0; i < nr; i++) a[j][i] = vfma(wk[i], xk, a[j][i]);
        }
    }
    for (int j = 0; j < mb; j++)
        for (int i = 0; i < nr; i++) acc[j][i] = a[j][i];
}

/* full tiles with the tile's sizes as constants (unrolled, accumulators in registers), and partial ones */
static __attribute__((noinline)) void tile_full(const float *w, const float *x, int kn, int P, vec (*acc)[TILE_R]) {
    tile_body(w, TILE_R, x, TILE_M, kn, P, acc);
}

static __attribute__((noinline)) void tile_part(const float *w, int nr, const float *x, int mb, int kn, int P,
                                                vec (*acc)[TILE_R]) {
    tile_body(w, nr, x, mb, kn, P, acc);
}

/* Columns of the weight and the activations taken at a time: TILE_M activation rows' share stays in the L1 cache. */
#define TILE_K 512
#define TILES_M 16

/* out[j * stride + i] = <w + i * P, x + j * P> for i < nr decoded weight rows, j < M activation rows: each pair
   one accumulator over k in order (the same sums whatever nr, M and the blocking), P a multiple of 16 */
static void tiles(const float *w, int nr, const float *x, int M, int P, float *out, size_t stride) {
    vec acc[TILES_M][TILE_R];
    for (int m0 = 0; m0 < M; m0 += TILES_M) {
        int ms = M - m0 < TILES_M ? M - m0 : TILES_M;
        for (int j = 0; j < ms; j++)
            for (int i = 0; i < nr; i++) acc[j][i] = vzero();
        for (int k0 = 0; k0 < P; k0 += TILE_K) {
            int kn = P - k0 < TILE_K ? P - k0 : TILE_K;
            for (int j = 0; j < ms; j += TILE_M) {
                const float *xj = x + (size_t)(m0 + j) * P + k0;
                int mb = ms - j < TILE_M ? ms - j : TILE_M;
                if (nr == TILE_R && mb == TILE_M)
                    tile_full(w + k0, xj, kn, P, acc + j);
                else
                    tile_part(w + k0, nr, xj, mb, kn, P, acc + j);
            }
        }
        for (int j = 0; j < ms; j++)
            for (int i = 0; i < nr; i++) out[(size_t)(m0 + j) * stride + i] = vsum(acc[j][i]);
    }
}

/* x (M, in_features) of dtype x_dtype -> xr (M, n_groups*G) float32, zero-padded, D2 . H . D1 . x / sqrt(G) */
static void rotate(const void *x, int x_dtype, int M, int in_features, const float *s1, const float *s2, int G,
                   int n_groups, float *xr) {
    const float scale = sqrtf((float)G);
    const int P = n_groups * G;
    for (int m = 0; m < M; m++)
        for (int g = 0; g < n_groups; g++) {
            float *t = xr + (size_t)m * P + (size_t)g * G;
            for (int i = 0; i < G; i++) {
                int k = g * G + i;
                t[i] = k < in_features ? load_float(x, x_dtype, (size_t)m * in_features + k) * s1[i] : 0.0f;
            }
            for (int h = 1; h < G; h <<= 1)
                for (int i = 0; i < G; i += 2 * h)
                    for (int j = i; j < i + h; j++) {
                        float a = t[j], b = t[j + h];
                        t[j] = a + b;
                        t[j + h] = a - b;
                    }
            for (int i = 0; i < G; i++) t[i] = t[i] / scale * s2[i];
        }
}

int tq_has_avx2(void) {
#ifdef TQ_AVX2
    return 1;
#else
    return 0;
#endif
}

/* out: (M, rows) float32, or bfloat16 with out_dtype TQ_BF16 (rounded from the float32 result, as torch rounds).
   Returns 0, or -1 when a buffer could not be allocated (nothing written). */
int tq_linear(const void *x, int x_dtype, int M, int in_features, int rotated, const float *s1, const float *s2,
              const uint8_t *packed, const void *norms, int norms_dtype, const float *codebook, int n_levels,
              long long rows, int n_groups, int G, int bpg, void *out_, int out_dtype, int threads) {
    const int P = n_groups * G;
    float tables[TABLES];
    build_tables(codebook, n_levels, tables);
    const float *xr;
    if (rotated) {
        xr = (const float *)x;
    } else {
        float *buf = thread_buffer(0, (size_t)M * P);
        if (!buf) return -1;
        rotate(x, x_dtype, M, in_features, s1, s2, G, n_groups, buf);
        xr = buf;
    }
    float *out = out_dtype == TQ_F32 ? (float *)out_ : thread_buffer(2, (size_t)M * rows);
    if (!out) return -1;
    const int fused = M == 1 && fuses(n_levels);
    const long long blocks = fused ? rows : (rows + TILE_R - 1) / TILE_R;
    int failed = 0;
#ifdef _OPENMP
#pragma omp parallel num_threads(threads) reduction(| : failed)
#endif
    {
        float *w = thread_buffer(1, (size_t)TILE_R * P + 16);
        if (!w) {
            failed = 1;
        } else {
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
            for (long long b = 0; b < blocks; b++) {
                if (fused) { /* one weight row, multiplied as it is decoded */
                    row(packed + (size_t)b * n_groups * bpg, norms, norms_dtype, (size_t)b * n_groups, tables, n_levels,
                        G, n_groups, bpg, xr, w, out + b, b == rows - 1);
                    continue;
                }
                long long r0 = b * TILE_R;
                int nr = rows - r0 < TILE_R ? (int)(rows - r0) : TILE_R;
                for (int i = 0; i < nr; i++) {
                    long long r = r0 + i;
                    row(packed + (size_t)r * n_groups * bpg, norms, norms_dtype, (size_t)r * n_groups, tables, n_levels,
                        G, n_groups, bpg, NULL, w + (size_t)i * P, NULL, r == rows - 1);
                }
                tiles(w, nr, xr, M, P, out + r0, (size_t)rows);
            }
        }
    }
    (void)threads;
    if (failed) return -1;
    if (out_dtype == TQ_BF16)
        for (size_t i = 0; i < (size_t)M * rows; i++) ((uint16_t *)out_)[i] = float_to_bf16(out[i]);
    return 0;
}

/* rows [first, first + count) of the weight in the rotated basis into out (count, n_groups*G) */
int tq_decode(const uint8_t *packed, const void *norms, int norms_dtype, const float *codebook, int n_levels,
              long long first, long long count, int n_groups, int G, int bpg, float *out) {
    const size_t P = (size_t)n_groups * G;
    float tables[TABLES];
    build_tables(codebook, n_levels, tables);
    float *w = thread_buffer(1, P + 16);
    if (!w) return -1;
    for (long long r = first; r < first + count; r++) {
        const uint8_t *prow = packed + (size_t)r * n_groups * bpg;
        row(prow, norms, norms_dtype, (size_t)r * n_groups, tables, n_levels, G, n_groups, bpg, NULL, w, NULL,
            r == first + count - 1);
        memcpy(out + (size_t)(r - first) * P, w, P * 4);
    }
    return 0;
}
