/* tensordiff._kernels: the diff's per-row sums in one pass over each element.
 *
 * row_sums(a, kind_a, b, kind_b, k, w, aa, bb, dd, maxabs)
 *   a, b     2-D buffers [m, >= k*w] of stored rows: kind 0 float32, kind 1 bfloat16 bits
 *            (uint16); elements contiguous within a row, any row stride
 *   aa, bb, dd  C-contiguous float64 [m, k], written: sum x^2, sum y^2, sum (x - y)^2 per row and slot
 *   maxabs   C-contiguous float32 [m, k], written: max |x - y| (NaN elements ignored)
 *
 * row_dots(x, c, out)
 *   x, c     2-D buffers [n, w] of float32 or float64 rows (each its own), elements contiguous
 *   out      C-contiguous float64 [n], written: sum x * c per row (the identity search's cosines)
 *
 * row_dots_at(x, kind_x, xi, c, kind_c, ci, out)
 *   the same sums over rows picked by index (xi, ci: int64, each entry checked; None: every row)
 *   from rows of any stored kind (0 float32, 1 bf16 bits, 2 float64): the identity search scores
 *   a candidate's rows where they lie (mapped in place), with no gather and no conversion
 *
 * Every element is widened to double (exact for bf16 and float32), so products of bf16 values are
 * exact and sums of float32 inputs cannot overflow. Each row and slot is summed in LANES
 * interleaved partial sums, combined in a fixed tree: the order of every addition is fixed by this
 * code, not by the vector width the compiler picks, and floating-point contraction is off (setup),
 * so the result is the same bits on every x86-64 machine whichever clone runs, and on every code
 * path: portable, AVX2 (lanes 0-3 and 4-7 in two vectors) and AVX-512 (all eight in one), the
 * best the CPU has taken at import (simd() switches, for tests). Non-finite inputs
 * make the sums non-finite; the caller recomputes those rows over their finite elements.
 * The GIL is released while summing: callers run sub-blocks on several threads.
 *
 * topk(x, k, vals, idx): the recorders' top-k predictions of float32 rows (see below).
 * Rows, put_rows, put_tokens: the trace writer's appends of a few rows (see below).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define LANES 8   /* partial sums per row and slot; lane l takes the elements j with j % LANES == l */

static inline double from_bf16(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return (double)f;
}

static inline double from_f32(float v) { return (double)v; }

/* the portable sums of one (row, slot); the AVX2 versions below make the same additions in the
 * same order, lane by lane, so both give the same bits */
#define PORTABLE_SUMS(NAME, TA, LOADA, TB, LOADB)                                                  \
    static void NAME(const TA *x, const TB *y, Py_ssize_t w, double *sa, double *sb, double *sd,   \
                     double *mx)                                                                   \
    {                                                                                              \
        Py_ssize_t j = 0;                                                                          \
        for (; j + LANES <= w; j += LANES) {                                                       \
            for (int l = 0; l < LANES; l++) {                                                      \
                double u = LOADA(x[j + l]), v = LOADB(y[j + l]);                                   \
                double d = u - v;                                                                  \
                double ad = fabs(d);                                                               \
                sa[l] = sa[l] + u * u;                                                             \
                sb[l] = sb[l] + v * v;                                                             \
                sd[l] = sd[l] + d * d;                                                             \
                mx[l] = ad > mx[l] ? ad : mx[l];                                                   \
            }                                                                                      \
        }                                                                                          \
    }

PORTABLE_SUMS(portable_bb, uint16_t, from_bf16, uint16_t, from_bf16)
PORTABLE_SUMS(portable_ff, float, from_f32, float, from_f32)
PORTABLE_SUMS(portable_bf, uint16_t, from_bf16, float, from_f32)
PORTABLE_SUMS(portable_fb, float, from_f32, uint16_t, from_bf16)

typedef void (*sums_fn)(const void *, const void *, Py_ssize_t, double *, double *, double *, double *);

typedef void (*dots_fn)(const void *, const void *, Py_ssize_t, double *);

/* row_dots_at: the same sums over rows of any stored kind (0 float32, 1 bf16 bits, 2 float64),
 * each element widened to double exactly as row_dots and row_sums widen it */
static inline double from_f64(double v) { return v; }

#define PORTABLE_KDOTS(NAME, TX, LX, TC, LC)                                                       \
    static void NAME(const TX *x, const TC *c, Py_ssize_t w, double *acc)                          \
    {                                                                                              \
        for (Py_ssize_t j = 0; j + LANES <= w; j += LANES)                                         \
            for (int l = 0; l < LANES; l++)                                                        \
                acc[l] = acc[l] + LX(x[j + l]) * LC(c[j + l]);                                     \
    }

PORTABLE_KDOTS(pk_ff, float, from_f32, float, from_f32)
PORTABLE_KDOTS(pk_fb, float, from_f32, uint16_t, from_bf16)
PORTABLE_KDOTS(pk_fd, float, from_f32, double, from_f64)
PORTABLE_KDOTS(pk_bf, uint16_t, from_bf16, float, from_f32)
PORTABLE_KDOTS(pk_bb, uint16_t, from_bf16, uint16_t, from_bf16)
PORTABLE_KDOTS(pk_bd, uint16_t, from_bf16, double, from_f64)
PORTABLE_KDOTS(pk_df, double, from_f64, float, from_f32)
PORTABLE_KDOTS(pk_db, double, from_f64, uint16_t, from_bf16)
PORTABLE_KDOTS(pk_dd, double, from_f64, double, from_f64)

/* a row's sum of squares (x = c): each element read and widened once, the same sums */
#define PORTABLE_SQ(NAME, TX, LX)                                                                  \
    static void NAME(const TX *x, const TX *c, Py_ssize_t w, double *acc)                          \
    {                                                                                              \
        (void)c;                                                                                   \
        for (Py_ssize_t j = 0; j + LANES <= w; j += LANES)                                         \
            for (int l = 0; l < LANES; l++) {                                                      \
                double u = LX(x[j + l]);                                                           \
                acc[l] = acc[l] + u * u;                                                           \
            }                                                                                      \
    }

PORTABLE_SQ(psq_f, float, from_f32)
PORTABLE_SQ(psq_b, uint16_t, from_bf16)
PORTABLE_SQ(psq_d, double, from_f64)

#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__)
#include <immintrin.h>
#define TD_AVX2 1

/* 8 stored elements as two vectors of 4 doubles: lanes 0-3 and 4-7 */
__attribute__((target("avx2"))) static inline void load_bf16(const uint16_t *p, __m256d *lo, __m256d *hi)
{
    __m256i u = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
    __m256 f = _mm256_castsi256_ps(u);
    *lo = _mm256_cvtps_pd(_mm256_castps256_ps128(f));
    *hi = _mm256_cvtps_pd(_mm256_extractf128_ps(f, 1));
}

__attribute__((target("avx2"))) static inline void load_f32(const float *p, __m256d *lo, __m256d *hi)
{
    __m256 f = _mm256_loadu_ps(p);
    *lo = _mm256_cvtps_pd(_mm256_castps256_ps128(f));
    *hi = _mm256_cvtps_pd(_mm256_extractf128_ps(f, 1));
}

/* no FMA: a product is rounded, then added, as in the portable code */
#define AVX2_SUMS(NAME, TA, LOADA, TB, LOADB)                                                      \
    __attribute__((target("avx2"))) static void NAME(const TA *x, const TB *y, Py_ssize_t w,      \
                                                     double *sa, double *sb, double *sd,           \
                                                     double *mx)                                   \
    {                                                                                              \
        const __m256d sign = _mm256_set1_pd(-0.0);                                                 \
        __m256d a0 = _mm256_loadu_pd(sa), a1 = _mm256_loadu_pd(sa + 4);                            \
        __m256d b0 = _mm256_loadu_pd(sb), b1 = _mm256_loadu_pd(sb + 4);                            \
        __m256d d0 = _mm256_loadu_pd(sd), d1 = _mm256_loadu_pd(sd + 4);                            \
        __m256d m0 = _mm256_loadu_pd(mx), m1 = _mm256_loadu_pd(mx + 4);                            \
        for (Py_ssize_t j = 0; j + LANES <= w; j += LANES) {                                       \
            __m256d u0, u1, v0, v1;                                                                \
            LOADA(x + j, &u0, &u1);                                                                \
            LOADB(y + j, &v0, &v1);                                                                \
            __m256d e0 = _mm256_sub_pd(u0, v0), e1 = _mm256_sub_pd(u1, v1);                        \
            a0 = _mm256_add_pd(a0, _mm256_mul_pd(u0, u0));                                         \
            a1 = _mm256_add_pd(a1, _mm256_mul_pd(u1, u1));                                         \
            b0 = _mm256_add_pd(b0, _mm256_mul_pd(v0, v0));                                         \
            b1 = _mm256_add_pd(b1, _mm256_mul_pd(v1, v1));                                         \
            d0 = _mm256_add_pd(d0, _mm256_mul_pd(e0, e0));                                         \
            d1 = _mm256_add_pd(d1, _mm256_mul_pd(e1, e1));                                         \
            m0 = _mm256_max_pd(_mm256_andnot_pd(sign, e0), m0); /* ad > m ? ad : m */              \
            m1 = _mm256_max_pd(_mm256_andnot_pd(sign, e1), m1);                                    \
        }                                                                                          \
        _mm256_storeu_pd(sa, a0);                                                                  \
        _mm256_storeu_pd(sa + 4, a1);                                                              \
        _mm256_storeu_pd(sb, b0);                                                                  \
        _mm256_storeu_pd(sb + 4, b1);                                                              \
        _mm256_storeu_pd(sd, d0);                                                                  \
        _mm256_storeu_pd(sd + 4, d1);                                                              \
        _mm256_storeu_pd(mx, m0);                                                                  \
        _mm256_storeu_pd(mx + 4, m1);                                                              \
    }

AVX2_SUMS(avx2_bb, uint16_t, load_bf16, uint16_t, load_bf16)
AVX2_SUMS(avx2_ff, float, load_f32, float, load_f32)
AVX2_SUMS(avx2_bf, uint16_t, load_bf16, float, load_f32)
AVX2_SUMS(avx2_fb, float, load_f32, uint16_t, load_bf16)

__attribute__((target("avx2"))) static inline void load_f64(const double *p, __m256d *lo, __m256d *hi)
{
    *lo = _mm256_loadu_pd(p);
    *hi = _mm256_loadu_pd(p + 4);
}

#define AVX2_DOTS(NAME, TX, LOADX, TC, LOADC)                                                      \
    __attribute__((target("avx2"))) static void NAME(const TX *x, const TC *c, Py_ssize_t w,      \
                                                     double *acc)                                  \
    {                                                                                              \
        __m256d s0 = _mm256_loadu_pd(acc), s1 = _mm256_loadu_pd(acc + 4);                          \
        for (Py_ssize_t j = 0; j + LANES <= w; j += LANES) {                                       \
            __m256d u0, u1, v0, v1;                                                                \
            LOADX(x + j, &u0, &u1);                                                                \
            LOADC(c + j, &v0, &v1);                                                                \
            s0 = _mm256_add_pd(s0, _mm256_mul_pd(u0, v0));                                         \
            s1 = _mm256_add_pd(s1, _mm256_mul_pd(u1, v1));                                         \
        }                                                                                          \
        _mm256_storeu_pd(acc, s0);                                                                 \
        _mm256_storeu_pd(acc + 4, s1);                                                             \
    }

AVX2_DOTS(adot_ff, float, load_f32, float, load_f32)
AVX2_DOTS(adot_fd, float, load_f32, double, load_f64)
AVX2_DOTS(adot_df, double, load_f64, float, load_f32)
AVX2_DOTS(adot_dd, double, load_f64, double, load_f64)
AVX2_DOTS(ak_fb, float, load_f32, uint16_t, load_bf16)
AVX2_DOTS(ak_bf, uint16_t, load_bf16, float, load_f32)
AVX2_DOTS(ak_bb, uint16_t, load_bf16, uint16_t, load_bf16)
AVX2_DOTS(ak_bd, uint16_t, load_bf16, double, load_f64)
AVX2_DOTS(ak_db, double, load_f64, uint16_t, load_bf16)

#define AVX2_SQ(NAME, TX, LOADX)                                                                   \
    __attribute__((target("avx2"))) static void NAME(const TX *x, const TX *c, Py_ssize_t w,      \
                                                     double *acc)                                  \
    {                                                                                              \
        (void)c;                                                                                   \
        __m256d s0 = _mm256_loadu_pd(acc), s1 = _mm256_loadu_pd(acc + 4);                          \
        for (Py_ssize_t j = 0; j + LANES <= w; j += LANES) {                                       \
            __m256d u0, u1;                                                                        \
            LOADX(x + j, &u0, &u1);                                                                \
            s0 = _mm256_add_pd(s0, _mm256_mul_pd(u0, u0));                                         \
            s1 = _mm256_add_pd(s1, _mm256_mul_pd(u1, u1));                                         \
        }                                                                                          \
        _mm256_storeu_pd(acc, s0);                                                                 \
        _mm256_storeu_pd(acc + 4, s1);                                                             \
    }

AVX2_SQ(asq_f, float, load_f32)
AVX2_SQ(asq_b, uint16_t, load_bf16)
AVX2_SQ(asq_d, double, load_f64)

/* AVX-512: one vector of 8 doubles holds the 8 lanes; the same additions in the same order as
 * the AVX2 and portable code, lane by lane, so all three give the same bits */
#define TD_AVX512 1
__attribute__((target("avx512f,avx2"))) static inline __m512d load8_bf16(const uint16_t *p)
{
    __m256i u = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
    return _mm512_cvtps_pd(_mm256_castsi256_ps(u));
}

__attribute__((target("avx512f,avx2"))) static inline __m512d load8_f32(const float *p)
{
    return _mm512_cvtps_pd(_mm256_loadu_ps(p));
}

__attribute__((target("avx512f,avx2"))) static inline __m512d load8_f64(const double *p)
{
    return _mm512_loadu_pd(p);
}

#define AVX512_SUMS(NAME, TA, LOADA, TB, LOADB)                                                    \
    __attribute__((target("avx512f,avx2"))) static void NAME(const TA *x, const TB *y, Py_ssize_t w, \
                                                             double *sa, double *sb, double *sd,   \
                                                             double *mx)                           \
    {                                                                                              \
        __m512d a = _mm512_loadu_pd(sa), b = _mm512_loadu_pd(sb), d = _mm512_loadu_pd(sd),         \
                m = _mm512_loadu_pd(mx);                                                           \
        for (Py_ssize_t j = 0; j + LANES <= w; j += LANES) {                                       \
            __m512d u = LOADA(x + j), v = LOADB(y + j);                                            \
            __m512d e = _mm512_sub_pd(u, v);                                                       \
            a = _mm512_add_pd(a, _mm512_mul_pd(u, u));                                             \
            b = _mm512_add_pd(b, _mm512_mul_pd(v, v));                                             \
            d = _mm512_add_pd(d, _mm512_mul_pd(e, e));                                             \
            m = _mm512_max_pd(_mm512_abs_pd(e), m); /* ad > m ? ad : m */                          \
        }                                                                                          \
        _mm512_storeu_pd(sa, a);                                                                   \
        _mm512_storeu_pd(sb, b);                                                                   \
        _mm512_storeu_pd(sd, d);                                                                   \
        _mm512_storeu_pd(mx, m);                                                                   \
    }

AVX512_SUMS(z_bb, uint16_t, load8_bf16, uint16_t, load8_bf16)
AVX512_SUMS(z_ff, float, load8_f32, float, load8_f32)
AVX512_SUMS(z_bf, uint16_t, load8_bf16, float, load8_f32)
AVX512_SUMS(z_fb, float, load8_f32, uint16_t, load8_bf16)

#define AVX512_DOTS(NAME, TX, LOADX, TC, LOADC)                                                    \
    __attribute__((target("avx512f,avx2"))) static void NAME(const TX *x, const TC *c, Py_ssize_t w, \
                                                             double *acc)                          \
    {                                                                                              \
        __m512d s = _mm512_loadu_pd(acc);                                                          \
        for (Py_ssize_t j = 0; j + LANES <= w; j += LANES)                                         \
            s = _mm512_add_pd(s, _mm512_mul_pd(LOADX(x + j), LOADC(c + j)));                       \
        _mm512_storeu_pd(acc, s);                                                                  \
    }

AVX512_DOTS(zd_ff, float, load8_f32, float, load8_f32)
AVX512_DOTS(zd_fb, float, load8_f32, uint16_t, load8_bf16)
AVX512_DOTS(zd_fd, float, load8_f32, double, load8_f64)
AVX512_DOTS(zd_bf, uint16_t, load8_bf16, float, load8_f32)
AVX512_DOTS(zd_bb, uint16_t, load8_bf16, uint16_t, load8_bf16)
AVX512_DOTS(zd_bd, uint16_t, load8_bf16, double, load8_f64)
AVX512_DOTS(zd_df, double, load8_f64, float, load8_f32)
AVX512_DOTS(zd_db, double, load8_f64, uint16_t, load8_bf16)
AVX512_DOTS(zd_dd, double, load8_f64, double, load8_f64)

#define AVX512_SQ(NAME, TX, LOADX)                                                                 \
    __attribute__((target("avx512f,avx2"))) static void NAME(const TX *x, const TX *c, Py_ssize_t w, \
                                                             double *acc)                          \
    {                                                                                              \
        (void)c;                                                                                   \
        __m512d s = _mm512_loadu_pd(acc);                                                          \
        for (Py_ssize_t j = 0; j + LANES <= w; j += LANES) {                                       \
            __m512d u = LOADX(x + j);                                                              \
            s = _mm512_add_pd(s, _mm512_mul_pd(u, u));                                             \
        }                                                                                          \
        _mm512_storeu_pd(acc, s);                                                                  \
    }

AVX512_SQ(zsq_f, float, load8_f32)
AVX512_SQ(zsq_b, uint16_t, load8_bf16)
AVX512_SQ(zsq_d, double, load8_f64)
#endif

/* [kind_a * 2 + kind_b] */
static sums_fn portable[4] = {(sums_fn)portable_ff, (sums_fn)portable_fb, (sums_fn)portable_bf,
                              (sums_fn)portable_bb};
#ifdef TD_AVX2
static sums_fn avx2[4] = {(sums_fn)avx2_ff, (sums_fn)avx2_fb, (sums_fn)avx2_bf, (sums_fn)avx2_bb};
#endif
#ifdef TD_AVX512
static sums_fn avx512[4] = {(sums_fn)z_ff, (sums_fn)z_fb, (sums_fn)z_bf, (sums_fn)z_bb};
static dots_fn avx512_sq[3] = {(dots_fn)zsq_f, (dots_fn)zsq_b, (dots_fn)zsq_d};
static dots_fn avx512_kdots[9] = {(dots_fn)zd_ff, (dots_fn)zd_fb, (dots_fn)zd_fd, (dots_fn)zd_bf, (dots_fn)zd_bb,
                                  (dots_fn)zd_bd, (dots_fn)zd_df, (dots_fn)zd_db, (dots_fn)zd_dd};
#endif
/* the code path: 0 portable, 1 AVX2, 2 AVX-512 (the best the CPU has, unless simd() says otherwise) */
static int use_avx2 = 0;
/* [kind_x * 3 + kind_c], kinds 0 float32, 1 bf16 bits, 2 float64 */
static dots_fn portable_sq[3] = {(dots_fn)psq_f, (dots_fn)psq_b, (dots_fn)psq_d};
static dots_fn portable_kdots[9] = {(dots_fn)pk_ff, (dots_fn)pk_fb, (dots_fn)pk_fd, (dots_fn)pk_bf, (dots_fn)pk_bb,
                                    (dots_fn)pk_bd, (dots_fn)pk_df, (dots_fn)pk_db, (dots_fn)pk_dd};
#ifdef TD_AVX2
static dots_fn avx2_sq[3] = {(dots_fn)asq_f, (dots_fn)asq_b, (dots_fn)asq_d};
static dots_fn avx2_kdots[9] = {(dots_fn)adot_ff, (dots_fn)ak_fb, (dots_fn)adot_fd, (dots_fn)ak_bf, (dots_fn)ak_bb,
                                (dots_fn)ak_bd, (dots_fn)adot_df, (dots_fn)ak_db, (dots_fn)adot_dd};
#endif

/* one (row, slot): the whole-lane part by `fn`, the tail and the fixed combining tree here */
static void slot_sums(sums_fn fn, const char *x, int ka, const char *y, int kb, Py_ssize_t w, double *out_aa,
                      double *out_bb, double *out_dd, float *out_max)
{
    double sa[LANES] = {0}, sb[LANES] = {0}, sd[LANES] = {0}, mx[LANES] = {0};
    fn(x, y, w, sa, sb, sd, mx);
    for (Py_ssize_t j = w - w % LANES, l = 0; j < w; j++, l++) {
        double u = ka ? from_bf16(((const uint16_t *)x)[j]) : from_f32(((const float *)x)[j]);
        double v = kb ? from_bf16(((const uint16_t *)y)[j]) : from_f32(((const float *)y)[j]);
        double d = u - v;
        double ad = fabs(d);
        sa[l] = sa[l] + u * u;
        sb[l] = sb[l] + v * v;
        sd[l] = sd[l] + d * d;
        mx[l] = ad > mx[l] ? ad : mx[l];
    }
    *out_aa = ((sa[0] + sa[1]) + (sa[2] + sa[3])) + ((sa[4] + sa[5]) + (sa[6] + sa[7]));
    *out_bb = ((sb[0] + sb[1]) + (sb[2] + sb[3])) + ((sb[4] + sb[5]) + (sb[6] + sb[7]));
    *out_dd = ((sd[0] + sd[1]) + (sd[2] + sd[3])) + ((sd[4] + sd[5]) + (sd[6] + sd[7]));
    double m = mx[0];
    for (int l = 1; l < LANES; l++)
        m = mx[l] > m ? mx[l] : m;
    *out_max = (float)m;
}

static int get_rows(PyObject *obj, Py_buffer *view, int kind, const char *what, Py_ssize_t *m,
                    Py_ssize_t need)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_STRIDES | PyBUF_FORMAT) < 0)
        return -1;
    Py_ssize_t size = kind == 1 ? 2 : 4;
    if (view->ndim != 2 || view->itemsize != size || view->strides[1] != size || view->strides[0] < 0 ||
        view->strides[0] % size != 0 || view->shape[1] < need) {
        PyErr_Format(PyExc_ValueError, "%s: expected 2-D rows of %zd-byte elements, contiguous within a row, "
                     "at least %zd wide", what, size, need);
        PyBuffer_Release(view);
        return -1;
    }
    *m = view->shape[0];
    return 0;
}

static int get_out(PyObject *obj, Py_buffer *view, Py_ssize_t itemsize, const char *what, Py_ssize_t m,
                   Py_ssize_t k)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE | PyBUF_FORMAT) < 0)
        return -1;
    if (view->itemsize != itemsize || view->len != m * k * itemsize) {
        PyErr_Format(PyExc_ValueError, "%s: expected a C-contiguous [%zd, %zd] array of %zd-byte elements", what,
                     m, k, itemsize);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static PyObject *row_sums(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *oa, *ob, *oaa, *obb, *odd, *omax;
    int ka, kb;
    Py_ssize_t k, w;
    if (!PyArg_ParseTuple(args, "OiOinnOOOO:row_sums", &oa, &ka, &ob, &kb, &k, &w, &oaa, &obb, &odd, &omax))
        return NULL;
    if ((ka != 0 && ka != 1) || (kb != 0 && kb != 1) || k < 0 || w < 0) {
        PyErr_SetString(PyExc_ValueError, "row_sums: kinds are 0 (float32) or 1 (bfloat16); k and w >= 0");
        return NULL;
    }
    Py_buffer va, vb, vaa, vbb, vdd, vmax;
    Py_ssize_t ma, mb;
    if (get_rows(oa, &va, ka, "a", &ma, k * w) < 0)
        return NULL;
    if (get_rows(ob, &vb, kb, "b", &mb, k * w) < 0) {
        PyBuffer_Release(&va);
        return NULL;
    }
    int held = 2;
    if (ma != mb) {
        PyErr_SetString(PyExc_ValueError, "row_sums: a and b have different row counts");
        goto fail;
    }
    if (get_out(oaa, &vaa, 8, "aa", ma, k) < 0)
        goto fail;
    held++;
    if (get_out(obb, &vbb, 8, "bb", ma, k) < 0)
        goto fail;
    held++;
    if (get_out(odd, &vdd, 8, "dd", ma, k) < 0)
        goto fail;
    held++;
    if (get_out(omax, &vmax, 4, "maxabs", ma, k) < 0)
        goto fail;
    held++;

    sums_fn fn = portable[ka * 2 + kb];
#ifdef TD_AVX2
    if (use_avx2)
        fn = avx2[ka * 2 + kb];
#ifdef TD_AVX512
    if (use_avx2 == 2)
        fn = avx512[ka * 2 + kb];
#endif
#endif
    Py_ssize_t sa_ = ka ? 2 : 4, sb_ = kb ? 2 : 4;
    Py_BEGIN_ALLOW_THREADS
    const char *pa = (const char *)va.buf, *pb = (const char *)vb.buf;
    double *aa = (double *)vaa.buf, *bb = (double *)vbb.buf, *dd = (double *)vdd.buf;
    float *mx = (float *)vmax.buf;
    for (Py_ssize_t i = 0; i < ma; i++) {
        const char *ra = pa + i * va.strides[0], *rb = pb + i * vb.strides[0];
        for (Py_ssize_t s = 0; s < k; s++) {
            Py_ssize_t o = i * k + s;
            slot_sums(fn, ra + s * w * sa_, ka, rb + s * w * sb_, kb, w, aa + o, bb + o, dd + o, mx + o);
        }
    }
    Py_END_ALLOW_THREADS

    PyBuffer_Release(&va);
    PyBuffer_Release(&vb);
    PyBuffer_Release(&vaa);
    PyBuffer_Release(&vbb);
    PyBuffer_Release(&vdd);
    PyBuffer_Release(&vmax);
    Py_RETURN_NONE;

fail:
    PyBuffer_Release(&va);
    PyBuffer_Release(&vb);
    if (held > 2)
        PyBuffer_Release(&vaa);
    if (held > 3)
        PyBuffer_Release(&vbb);
    if (held > 4)
        PyBuffer_Release(&vdd);
    return NULL;
}


/* a buffer's struct format without its native / little-endian prefix ("B" when it has none) */
static const char *plain_format(const char *f)
{
    if (f == NULL)
        return "B";
    if (*f == '@' || *f == '=' || *f == '<')
        f++;
    return f;
}

/* a 2-D buffer of float32 or float64 rows, elements contiguous within a row; *wide: float64 */
static int get_float_rows(PyObject *obj, Py_buffer *view, const char *what, int *wide)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_STRIDES | PyBUF_FORMAT) < 0)
        return -1;
    const char *f = plain_format(view->format);
    int ok = view->ndim == 2 && ((strcmp(f, "f") == 0 && view->itemsize == 4) ||
                                 (strcmp(f, "d") == 0 && view->itemsize == 8));
    if (!ok || view->strides[1] != view->itemsize || view->strides[0] < 0 || view->strides[0] % view->itemsize) {
        PyErr_Format(PyExc_ValueError, "%s: expected 2-D float32 or float64 rows, contiguous within a row", what);
        PyBuffer_Release(view);
        return -1;
    }
    *wide = view->itemsize == 8;
    return 0;
}

static double kind_elem(const char *row, int kind, Py_ssize_t j)
{
    if (kind == 1)
        return from_bf16(((const uint16_t *)row)[j]);
    if (kind == 2)
        return ((const double *)row)[j];
    return (double)((const float *)row)[j];
}

/* out[t] = sum_j x[xi[t], j] * c[ci[t], j] (an index NULL: row t) of rows of kinds kx, kc: the
 * whole lanes by the code path's function, the tail and the fixed combining tree here; a row
 * against itself (a norm) by its squares, each element widened once. Called without the GIL. */
static void dot_rows(const char *bx, Py_ssize_t sx, const int64_t *xi, int kx, const char *bc, Py_ssize_t sc,
                     const int64_t *ci, int kc, Py_ssize_t n, Py_ssize_t w, double *out)
{
    dots_fn fn = portable_kdots[kx * 3 + kc], sq = portable_sq[kx];
#ifdef TD_AVX2
    if (use_avx2) {
        fn = avx2_kdots[kx * 3 + kc];
        sq = avx2_sq[kx];
    }
#ifdef TD_AVX512
    if (use_avx2 == 2) {
        fn = avx512_kdots[kx * 3 + kc];
        sq = avx512_sq[kx];
    }
#endif
#endif
    for (Py_ssize_t t = 0; t < n; t++) {
        const char *rx = bx + (xi ? (Py_ssize_t)xi[t] : t) * sx;
        const char *rc = bc + (ci ? (Py_ssize_t)ci[t] : t) * sc;
        double acc[LANES] = {0};
        (rx == rc && kx == kc ? sq : fn)(rx, rc, w, acc);
        for (Py_ssize_t j = w - w % LANES, l = 0; j < w; j++, l++)
            acc[l] = acc[l] + kind_elem(rx, kx, j) * kind_elem(rc, kc, j);
        out[t] = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    }
}

static PyObject *row_dots(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *ox, *oc, *oout;
    if (!PyArg_ParseTuple(args, "OOO:row_dots", &ox, &oc, &oout))
        return NULL;
    Py_buffer vx, vc, vo;
    int wx, wc;
    if (get_float_rows(ox, &vx, "x", &wx) < 0)
        return NULL;
    if (get_float_rows(oc, &vc, "c", &wc) < 0) {
        PyBuffer_Release(&vx);
        return NULL;
    }
    if (vx.shape[0] != vc.shape[0] || vx.shape[1] != vc.shape[1]) {
        PyErr_SetString(PyExc_ValueError, "row_dots: x and c have different shapes");
        PyBuffer_Release(&vx);
        PyBuffer_Release(&vc);
        return NULL;
    }
    Py_ssize_t n = vx.shape[0], w = vx.shape[1];
    if (get_out(oout, &vo, 8, "out", n, 1) < 0) {
        PyBuffer_Release(&vx);
        PyBuffer_Release(&vc);
        return NULL;
    }
    /* float32 is kind 0, float64 kind 2: the same sums as row_dots_at's */
    int kx = wx ? 2 : 0, kc = wc ? 2 : 0;
    const char *bx = (const char *)vx.buf, *bc = (const char *)vc.buf;
    Py_ssize_t sx = vx.strides[0], sc = vc.strides[0];
    double *out = (double *)vo.buf;
    Py_BEGIN_ALLOW_THREADS
    dot_rows(bx, sx, NULL, kx, bc, sc, NULL, kc, n, w, out);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&vx);
    PyBuffer_Release(&vc);
    PyBuffer_Release(&vo);
    Py_RETURN_NONE;
}


/* a 2-D buffer of rows of one kind (0 float32 'f', 1 bf16 bits 'H', 2 float64 'd'), elements
 * contiguous within a row, any non-negative whole-element row stride */
static int get_kind_rows(PyObject *obj, Py_buffer *view, int kind, const char *what)
{
    static const char *formats[3] = {"f", "H", "d"};
    static const Py_ssize_t sizes[3] = {4, 2, 8};
    if (kind < 0 || kind > 2) {
        PyErr_Format(PyExc_ValueError, "%s: kinds are 0 (float32), 1 (bfloat16 bits) or 2 (float64)", what);
        return -1;
    }
    if (PyObject_GetBuffer(obj, view, PyBUF_STRIDES | PyBUF_FORMAT) < 0)
        return -1;
    const char *f = plain_format(view->format);
    if (view->ndim != 2 || strcmp(f, formats[kind]) != 0 || view->itemsize != sizes[kind] ||
        view->strides[1] != view->itemsize || view->strides[0] < 0 || view->strides[0] % view->itemsize) {
        PyErr_Format(PyExc_ValueError, "%s: expected 2-D rows of kind %d, contiguous within a row", what, kind);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* an optional index into `m` rows: None (every row in order) or a 1-D contiguous int64 array,
 * every entry checked to lie in [0, m) */
static int get_index(PyObject *obj, Py_buffer *view, const char *what, Py_ssize_t m, Py_ssize_t *n,
                     const int64_t **idx)
{
    if (obj == Py_None) {
        *idx = NULL;
        *n = m;
        view->obj = NULL;
        return 0;
    }
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return -1;
    const char *f = plain_format(view->format);
    if (view->ndim != 1 || view->itemsize != 8 || (strcmp(f, "l") != 0 && strcmp(f, "q") != 0)) {
        PyErr_Format(PyExc_ValueError, "%s: expected a 1-D contiguous int64 index", what);
        PyBuffer_Release(view);
        return -1;
    }
    const int64_t *p = (const int64_t *)view->buf;
    *n = view->shape[0];
    for (Py_ssize_t t = 0; t < *n; t++) {
        if (p[t] < 0 || p[t] >= m) {
            PyErr_Format(PyExc_IndexError, "%s: row %lld outside [0, %zd)", what, (long long)p[t], m);
            PyBuffer_Release(view);
            return -1;
        }
    }
    *idx = p;
    return 0;
}

static void release_all(Py_buffer *views, int count)
{
    for (int i = 0; i < count; i++)
        if (views[i].obj != NULL)
            PyBuffer_Release(&views[i]);
}

static PyObject *row_dots_at(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *ox, *oxi, *oc, *oci, *oout;
    int kx, kc;
    if (!PyArg_ParseTuple(args, "OiOOiOO:row_dots_at", &ox, &kx, &oxi, &oc, &kc, &oci, &oout))
        return NULL;
    Py_buffer v[5];
    memset(v, 0, sizeof v);
    const int64_t *xi, *ci;
    Py_ssize_t nx, nc;
    if (get_kind_rows(ox, &v[0], kx, "x") < 0)
        return NULL;
    if (get_kind_rows(oc, &v[1], kc, "c") < 0) {
        release_all(v, 1);
        return NULL;
    }
    if (v[0].shape[1] != v[1].shape[1]) {
        PyErr_SetString(PyExc_ValueError, "row_dots_at: x and c rows have different widths");
        release_all(v, 2);
        return NULL;
    }
    if (get_index(oxi, &v[2], "xi", v[0].shape[0], &nx, &xi) < 0) {
        release_all(v, 2);
        return NULL;
    }
    if (get_index(oci, &v[3], "ci", v[1].shape[0], &nc, &ci) < 0) {
        release_all(v, 3);
        return NULL;
    }
    if (nx != nc) {
        PyErr_SetString(PyExc_ValueError, "row_dots_at: x and c index different numbers of rows");
        release_all(v, 4);
        return NULL;
    }
    if (get_out(oout, &v[4], 8, "out", nx, 1) < 0) {
        release_all(v, 4);
        return NULL;
    }
    Py_ssize_t n = nx, w = v[0].shape[1];
    const char *bx = (const char *)v[0].buf, *bc = (const char *)v[1].buf;
    Py_ssize_t sx = v[0].strides[0], sc = v[1].strides[0];
    double *out = (double *)v[4].buf;
    Py_BEGIN_ALLOW_THREADS
    dot_rows(bx, sx, xi, kx, bc, sc, ci, kc, n, w, out);
    Py_END_ALLOW_THREADS
    release_all(v, 5);
    Py_RETURN_NONE;
}

static int best_level(void)
{
#ifdef TD_AVX512
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx2"))
        return 2;
#endif
#ifdef TD_AVX2
    if (__builtin_cpu_supports("avx2"))
        return 1;
#endif
    return 0;
}

static PyObject *simd(PyObject *self, PyObject *args)
{
    (void)self;
    static const char *names[3] = {"portable", "avx2", "avx512"};
    PyObject *want = NULL;
    if (!PyArg_ParseTuple(args, "|O:simd", &want))
        return NULL;
    int was = use_avx2;
    if (want != NULL && PyUnicode_Check(want)) {
        int level = -1;
        for (int i = 0; i < 3; i++)
            if (PyUnicode_CompareWithASCIIString(want, names[i]) == 0)
                level = i;
        if (level < 0 || level > best_level()) {
            PyErr_Format(PyExc_ValueError, "simd: %R is not a code path this CPU runs (it runs up to %s)", want,
                         names[best_level()]);
            return NULL;
        }
        use_avx2 = level;
    } else if (want != NULL) {
        int on = PyObject_IsTrue(want);
        if (on < 0)
            return NULL;
        use_avx2 = on ? best_level() : 0;
    }
    return PyUnicode_FromString(names[was]);
}


/* ---- top-k of float32 rows ----------------------------------------------------------------------
 *
 * topk(x, k, vals, idx): per row of x (2-D float32 [n, V], elements contiguous within a row, any
 * row stride) its k largest values, best first, into vals (float32 [n, k]) and their column
 * indices into idx (int64 [n, k]). The order is total: NaN above every number, then by value,
 * and among equal values (0.0 and -0.0 are equal) the lower index first, so the first entry is
 * what an argmax picks. The values are copied, never computed: they are the bits of x.
 *
 * A row without NaN and with at least k blocks of TOPK_BLOCK elements takes two passes: the
 * maximum of each block, then a bound t that at least k elements reach (the blocks dealt into k
 * disjoint groups: the least of the groups' maxima). So the k-th best value is >= t and every
 * element below t is outside the top k; only the blocks whose maximum reaches t are scanned,
 * their elements >= t in index order, the order the single scan below sees them in: the same
 * ranks and ties. Other rows
 * take the single scan: a block of 16 elements none of which beats the k-th best so far is skipped
 * whole.
 */
#define TOPK_BLOCK 16

/* a ranks above b (a at a lower index than b when they tie) */
static inline int td_above(float a, float b) { return a > b || (a != a && b == b); }

static void topk_row(const float *x, Py_ssize_t V, Py_ssize_t k, float *bv, int64_t *bi)
{
    Py_ssize_t have = 0;
    for (Py_ssize_t j = 0; j < V; j++) {
        float v = x[j];
        if (have == k) {
            if (!td_above(v, bv[k - 1]))
                continue;
        } else {
            have++;
        }
        Py_ssize_t p = have - 1;  /* the slot v takes: shift the worse entries down by one */
        while (p > 0 && td_above(v, bv[p - 1])) {
            bv[p] = bv[p - 1];
            bi[p] = bi[p - 1];
            p--;
        }
        bv[p] = v;
        bi[p] = (int64_t)j;
        if (have == k && j + 1 < V) {
            /* skip blocks of 16 that hold nothing above the k-th best (the common case) */
            float thr = bv[k - 1];
            Py_ssize_t q = j + 1;
            while (q + 16 <= V && thr == thr) {
                int any = 0;
                for (int l = 0; l < 16; l++)
                    any |= !(x[q + l] <= thr);  /* above, or NaN */
                if (any)
                    break;
                q += 16;
            }
            j = q - 1;
        }
    }
}

/* insert v (column j) into the sorted best list bv/bi holding *have of k entries; v is no NaN */
static inline void topk_insert(float v, Py_ssize_t j, Py_ssize_t k, float *bv, int64_t *bi, Py_ssize_t *have)
{
    if (*have == k) {
        if (!(v > bv[k - 1]))
            return;
    } else {
        (*have)++;
    }
    Py_ssize_t p = *have - 1;
    while (p > 0 && v > bv[p - 1]) {
        bv[p] = bv[p - 1];
        bi[p] = bi[p - 1];
        p--;
    }
    bv[p] = v;
    bi[p] = (int64_t)j;
}

/* the maximum of each whole block of TOPK_BLOCK elements of x[0:V] into bmax; nonzero when one of
 * them is NaN (then the maxima are meaningless) */
#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__)
static int block_maxima(const float *x, Py_ssize_t full, float *bmax)
{
    __m128 bad = _mm_setzero_ps();
    for (Py_ssize_t b = 0; b < full; b++) {
        const float *p = x + b * TOPK_BLOCK;
        __m128 a0 = _mm_loadu_ps(p), a1 = _mm_loadu_ps(p + 4), a2 = _mm_loadu_ps(p + 8), a3 = _mm_loadu_ps(p + 12);
        bad = _mm_or_ps(bad, _mm_or_ps(_mm_or_ps(_mm_cmpunord_ps(a0, a0), _mm_cmpunord_ps(a1, a1)),
                                       _mm_or_ps(_mm_cmpunord_ps(a2, a2), _mm_cmpunord_ps(a3, a3))));
        __m128 m = _mm_max_ps(_mm_max_ps(a0, a1), _mm_max_ps(a2, a3));
        m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
        bmax[b] = _mm_cvtss_f32(m);
    }
    return _mm_movemask_ps(bad);
}

/* the columns of block p[0:TOPK_BLOCK] whose value is >= t, as bits */
static inline unsigned block_at_least(const float *p, float t)
{
    __m128 tv = _mm_set1_ps(t);
    return (unsigned)_mm_movemask_ps(_mm_cmpge_ps(_mm_loadu_ps(p), tv))
           | (unsigned)_mm_movemask_ps(_mm_cmpge_ps(_mm_loadu_ps(p + 4), tv)) << 4
           | (unsigned)_mm_movemask_ps(_mm_cmpge_ps(_mm_loadu_ps(p + 8), tv)) << 8
           | (unsigned)_mm_movemask_ps(_mm_cmpge_ps(_mm_loadu_ps(p + 12), tv)) << 12;
}
#else
static int block_maxima(const float *x, Py_ssize_t full, float *bmax)
{
    int nan = 0;
    for (Py_ssize_t b = 0; b < full; b++) {
        const float *p = x + b * TOPK_BLOCK;
        float m = p[0];
        for (int l = 0; l < TOPK_BLOCK; l++) {
            m = p[l] > m ? p[l] : m;
            nan |= p[l] != p[l];
        }
        bmax[b] = m;
    }
    return nan;
}

static inline unsigned block_at_least(const float *p, float t)
{
    unsigned bits = 0;
    for (int l = 0; l < TOPK_BLOCK; l++)
        bits |= (unsigned)(p[l] >= t) << l;
    return bits;
}
#endif

/* the least of v[0:n] (no NaN) */
static inline float least(const float *v, Py_ssize_t n)
{
    float m = v[0];
    for (Py_ssize_t l = 1; l < n; l++)
        m = v[l] < m ? v[l] : m;
    return m;
}

/* the two-pass top k of one row (see above); 0 when the row holds NaN (then nothing is written
 * that the single scan does not overwrite) */
static int topk_row_blocks(const float *x, Py_ssize_t V, Py_ssize_t k, float *bv, int64_t *bi, void *scratch)
{
    Py_ssize_t nb = (V + TOPK_BLOCK - 1) / TOPK_BLOCK;
    float *bmax = (float *)scratch;
    float *tv = bmax + nb;
    Py_ssize_t full = V / TOPK_BLOCK;
    int nan = block_maxima(x, full, bmax);
    if (full < nb) {  /* the last, partial block */
        const float *p = x + full * TOPK_BLOCK;
        float m = p[0];
        for (Py_ssize_t l = 0; l < V - full * TOPK_BLOCK; l++) {
            m = p[l] > m ? p[l] : m;
            nan |= p[l] != p[l];
        }
        bmax[full] = m;
    }
    if (nan)
        return 0;
    /* t: slot l holds the largest maximum of the blocks l, l + k, l + 2k, ...: k disjoint groups,
     * each with an element >= its slot, so at least k elements are >= the least slot */
    memcpy(tv, bmax, (size_t)k * sizeof(float));
    for (Py_ssize_t b = k; b < nb; b += k) {
        Py_ssize_t w = nb - b < k ? nb - b : k;
        for (Py_ssize_t l = 0; l < w; l++)
            tv[l] = bmax[b + l] > tv[l] ? bmax[b + l] : tv[l];
    }
    float t = least(tv, k);
    Py_ssize_t have = 0;
    for (Py_ssize_t b = 0; b < full; b++) {
        if (bmax[b] < t)
            continue;
        unsigned bits = block_at_least(x + b * TOPK_BLOCK, t);
        while (bits) {
            int l = __builtin_ctz(bits);
            bits &= bits - 1;
            Py_ssize_t j = b * TOPK_BLOCK + l;
            topk_insert(x[j], j, k, bv, bi, &have);
        }
    }
    if (full < nb && !(bmax[full] < t))
        for (Py_ssize_t j = full * TOPK_BLOCK; j < V; j++)
            if (x[j] >= t)
                topk_insert(x[j], j, k, bv, bi, &have);
    return 1;
}

static PyObject *topk(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *ox, *ov, *oi;
    Py_ssize_t k;
    if (!PyArg_ParseTuple(args, "OnOO:topk", &ox, &k, &ov, &oi))
        return NULL;
    Py_buffer vx, vv, vi;
    int wide;
    if (get_float_rows(ox, &vx, "x", &wide) < 0)
        return NULL;
    Py_ssize_t n = vx.shape[0], V = vx.shape[1];
    if (wide || k < 1 || k > V) {
        PyErr_SetString(PyExc_ValueError, "topk: x must be float32 rows and 1 <= k <= their width");
        PyBuffer_Release(&vx);
        return NULL;
    }
    if (get_out(ov, &vv, 4, "vals", n, k) < 0) {
        PyBuffer_Release(&vx);
        return NULL;
    }
    if (get_out(oi, &vi, 8, "idx", n, k) < 0) {
        PyBuffer_Release(&vx);
        PyBuffer_Release(&vv);
        return NULL;
    }
    Py_ssize_t nb = (V + TOPK_BLOCK - 1) / TOPK_BLOCK;
    /* scratch of the two-pass rows: the block maxima and their own top k */
    void *scratch = nb >= k ? PyMem_RawMalloc((size_t)(nb + k) * sizeof(float))
                            : NULL;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t r = 0; r < n; r++) {
        const float *row = (const float *)((const char *)vx.buf + r * vx.strides[0]);
        float *bv = (float *)vv.buf + r * k;
        int64_t *bi = (int64_t *)vi.buf + r * k;
        if (scratch == NULL || !topk_row_blocks(row, V, k, bv, bi, scratch))
            topk_row(row, V, k, bv, bi);
    }
    Py_END_ALLOW_THREADS
    PyMem_RawFree(scratch);
    PyBuffer_Release(&vx);
    PyBuffer_Release(&vv);
    PyBuffer_Release(&vi);
    Py_RETURN_NONE;
}


/* ---- the trace writer's row buffers -------------------------------------------------------------
 *
 * Rows(buf): the chunk buffer of one of TraceWriter's appenders (a writable C-contiguous array,
 * rows along axis 0), with its fill (rows held) and dirty flag. The writer's common appends run
 * here, one call each, instead of a dozen Python-level checks and numpy slice assignments:
 *
 * put_rows(limit, index_rows, index, rows1, src1, ...) -> bool
 *   Copies each src into its Rows at its fill, all of them or none: every src must be a
 *   C-contiguous buffer with the rows' element format and row shape, all the same row count n >= 1,
 *   each Rows must keep room after it (fill + n < capacity: a call that would fill a chunk is the
 *   writer's to write), and ``index`` must be int64 row indices, each in [0, limit). Otherwise
 *   nothing changes and it returns False: the writer's Python path then checks, raises its errors
 *   or writes full chunks.
 *
 * put_tokens(pairs, runs, positions, tokens, seq, regime, step) -> the fill before, or -1
 *   The token table's rows: positions and tokens (int64, 1-D, contiguous, the same length n >= 1)
 *   interleaved into ``pairs`` (int64 [chunk, 2]) and one run (n, seq, regime, step) into ``runs``
 *   (int64 [chunk, 4]), under the same all-or-nothing rule; -1 leaves both unchanged.
 */

typedef struct {
    PyObject_HEAD
    Py_buffer view;      /* the chunk buffer, held for the object's lifetime */
    int held;
    Py_ssize_t cap;      /* rows the buffer holds */
    Py_ssize_t row_bytes;
    Py_ssize_t fill;
    int dirty;
} RowsObject;

static void Rows_dealloc(RowsObject *self)
{
    if (self->held)
        PyBuffer_Release(&self->view);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int Rows_init(RowsObject *self, PyObject *args, PyObject *kw)
{
    PyObject *arr;
    static char *names[] = {"buf", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O:Rows", names, &arr))
        return -1;
    if (self->held) {
        PyBuffer_Release(&self->view);
        self->held = 0;
    }
    self->cap = self->row_bytes = self->fill = 0;  /* no rows until a buffer is held */
    self->dirty = 0;
    if (PyObject_GetBuffer(arr, &self->view, PyBUF_RECORDS) < 0)
        return -1;
    if (self->view.ndim < 1 || self->view.shape[0] < 1 || !PyBuffer_IsContiguous(&self->view, 'C')) {
        PyBuffer_Release(&self->view);
        PyErr_SetString(PyExc_ValueError, "Rows: expected a C-contiguous buffer of at least one row");
        return -1;
    }
    self->held = 1;
    self->cap = self->view.shape[0];
    self->row_bytes = self->view.len / self->cap;
    self->fill = 0;
    self->dirty = 0;
    return 0;
}

static PyObject *Rows_get_fill(RowsObject *self, void *c) { (void)c; return PyLong_FromSsize_t(self->fill); }

static int Rows_set_fill(RowsObject *self, PyObject *v, void *c)
{
    (void)c;
    Py_ssize_t f = v ? PyLong_AsSsize_t(v) : -1;
    if (f == -1 && PyErr_Occurred())
        return -1;
    if (f < 0 || f > self->cap) {
        PyErr_SetString(PyExc_ValueError, "Rows.fill: out of range");
        return -1;
    }
    self->fill = f;
    return 0;
}

static PyObject *Rows_get_dirty(RowsObject *self, void *c) { (void)c; return PyBool_FromLong(self->dirty); }

static int Rows_set_dirty(RowsObject *self, PyObject *v, void *c)
{
    (void)c;
    int d = v ? PyObject_IsTrue(v) : -1;
    if (d < 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "Rows.dirty cannot be deleted");
        return -1;
    }
    self->dirty = d;
    return 0;
}

static PyGetSetDef Rows_getset[] = {
    {"fill", (getter)Rows_get_fill, (setter)Rows_set_fill, "rows held in the buffer", NULL},
    {"dirty", (getter)Rows_get_dirty, (setter)Rows_set_dirty, "rows held that are not on disk yet", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject RowsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "tensordiff._kernels.Rows",
    .tp_basicsize = sizeof(RowsObject),
    .tp_dealloc = (destructor)Rows_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Rows(buf): a chunk buffer's fill and dirty flag, for put_rows and put_tokens",
    .tp_getset = Rows_getset,
    .tp_init = (initproc)Rows_init,
    .tp_new = PyType_GenericNew,
};

/* whether src (a held buffer) can go into r as n rows */
static int fits(const RowsObject *r, const Py_buffer *src, Py_ssize_t n)
{
    const Py_buffer *d = &r->view;
    if (!r->held || src->ndim != d->ndim || src->itemsize != d->itemsize || src->shape[0] != n || n < 1 ||
        r->fill + n >= r->cap)
        return 0;
    for (int i = 1; i < d->ndim; i++)
        if (src->shape[i] != d->shape[i])
            return 0;
    if (strcmp(plain_format(src->format), plain_format(d->format)) != 0)
        return 0;
    return PyBuffer_IsContiguous(src, 'C');
}

static int is_int64(const Py_buffer *v)
{
    const char *f = plain_format(v->format);
    return v->itemsize == 8 && (strcmp(f, "q") == 0 || strcmp(f, "l") == 0);
}

#define MAX_PUT 4

static PyObject *put_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs < 3 || nargs % 2 == 0 || (nargs - 1) / 2 > MAX_PUT) {
        PyErr_SetString(PyExc_TypeError, "put_rows(limit, rows, src, ...): 1 to 4 (Rows, src) pairs");
        return NULL;
    }
    Py_ssize_t limit = PyLong_AsSsize_t(args[0]);
    if (limit == -1 && PyErr_Occurred())
        return NULL;
    Py_ssize_t m = (nargs - 1) / 2, held = 0, n = -1;
    Py_buffer src[MAX_PUT];
    RowsObject *dst[MAX_PUT];
    int ok = 1;
    for (Py_ssize_t i = 0; i < m; i++) {
        PyObject *r = args[1 + 2 * i];
        if (!PyObject_TypeCheck(r, &RowsType)) {
            PyErr_SetString(PyExc_TypeError, "put_rows: expected Rows");
            return NULL;
        }
        dst[i] = (RowsObject *)r;
        for (Py_ssize_t j = 0; j < i; j++)
            if (dst[j] == dst[i]) {
                PyErr_SetString(PyExc_ValueError, "put_rows: each Rows at most once");
                return NULL;
            }
    }
    for (Py_ssize_t i = 0; i < m && ok; i++) {
        if (PyObject_GetBuffer(args[2 + 2 * i], &src[i], PyBUF_RECORDS_RO) < 0) {
            PyErr_Clear();  /* not a buffer: the Python path converts or raises */
            ok = 0;
            break;
        }
        held++;
        if (i == 0)
            n = src[0].ndim >= 1 ? src[0].shape[0] : -1;
        ok = fits(dst[i], &src[i], n);
    }
    if (ok && !is_int64(&src[0]))
        ok = 0;
    if (ok) {
        const int64_t *ix = (const int64_t *)src[0].buf;
        for (Py_ssize_t j = 0; j < n; j++)
            if (ix[j] < 0 || ix[j] >= limit) {
                ok = 0;
                break;
            }
    }
    if (ok)
        for (Py_ssize_t i = 0; i < m; i++) {
            RowsObject *r = dst[i];
            memcpy((char *)r->view.buf + r->fill * r->row_bytes, src[i].buf, (size_t)(n * r->row_bytes));
            r->fill += n;
            r->dirty = 1;
        }
    for (Py_ssize_t i = 0; i < held; i++)
        PyBuffer_Release(&src[i]);
    return PyBool_FromLong(ok);
}

static PyObject *put_tokens(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 7 || !PyObject_TypeCheck(args[0], &RowsType) || !PyObject_TypeCheck(args[1], &RowsType)) {
        PyErr_SetString(PyExc_TypeError, "put_tokens(pairs, runs, positions, tokens, seq, regime, step)");
        return NULL;
    }
    RowsObject *pairs = (RowsObject *)args[0], *runs = (RowsObject *)args[1];
    int64_t meta[3];
    for (int i = 0; i < 3; i++) {
        meta[i] = PyLong_AsLongLong(args[4 + i]);
        if (meta[i] == -1 && PyErr_Occurred())
            return NULL;
    }
    if (!pairs->held || !runs->held || pairs == runs) {
        PyErr_SetString(PyExc_ValueError, "put_tokens: pairs and runs must be two Rows holding buffers");
        return NULL;
    }
    if (pairs->view.ndim != 2 || pairs->view.shape[1] != 2 || !is_int64(&pairs->view) ||
        runs->view.ndim != 2 || runs->view.shape[1] != 4 || !is_int64(&runs->view)) {
        PyErr_SetString(PyExc_ValueError, "put_tokens: pairs must be int64 [chunk, 2] and runs int64 [chunk, 4]");
        return NULL;
    }
    Py_buffer p, t;
    if (PyObject_GetBuffer(args[2], &p, PyBUF_RECORDS_RO) < 0) {
        PyErr_Clear();
        return PyLong_FromLong(-1);
    }
    if (PyObject_GetBuffer(args[3], &t, PyBUF_RECORDS_RO) < 0) {
        PyErr_Clear();
        PyBuffer_Release(&p);
        return PyLong_FromLong(-1);
    }
    Py_ssize_t n = p.ndim == 1 ? p.shape[0] : -1;
    long before = -1;
    if (n >= 1 && t.ndim == 1 && t.shape[0] == n && is_int64(&p) && is_int64(&t) &&
        PyBuffer_IsContiguous(&p, 'C') && PyBuffer_IsContiguous(&t, 'C') && pairs->fill + n < pairs->cap &&
        runs->fill < runs->cap) {
        const int64_t *pp = (const int64_t *)p.buf, *tt = (const int64_t *)t.buf;
        int64_t *out = (int64_t *)pairs->view.buf + 2 * pairs->fill;
        for (Py_ssize_t j = 0; j < n; j++) {
            out[2 * j] = pp[j];
            out[2 * j + 1] = tt[j];
        }
        int64_t *run = (int64_t *)runs->view.buf + 4 * runs->fill;
        run[0] = n;
        run[1] = meta[0];
        run[2] = meta[1];
        run[3] = meta[2];
        before = (long)pairs->fill;
        pairs->fill += n;
        pairs->dirty = 1;
        runs->fill += 1;
        runs->dirty = 1;
    }
    PyBuffer_Release(&p);
    PyBuffer_Release(&t);
    return PyLong_FromLong(before);
}

static PyMethodDef methods[] = {
    {"row_dots", row_dots, METH_VARARGS,
     "row_dots(x, c, out): out[i] = sum_j x[i, j] * c[i, j] in float64, x and c float32 or float64 [n, w], "
     "out float64 [n]; the order of the additions fixed, as in row_sums"},
    {"row_dots_at", row_dots_at, METH_VARARGS,
     "row_dots_at(x, kind_x, xi, c, kind_c, ci, out): out[t] = sum_j x[xi[t], j] * c[ci[t], j] in float64 (kinds "
     "0 float32, 1 bf16 bits, 2 float64; an index None takes every row in order; every index checked), the "
     "additions in row_dots' order"},
    {"simd", simd, METH_VARARGS,
     "simd([level]) -> the code path in use before the call, 'avx512', 'avx2' or 'portable'; simd(False) forces "
     "the portable path, simd(True) the best this CPU runs, simd('avx2') a named one (ValueError where the CPU "
     "lacks it); all give the same bits: for tests"},
    {"row_sums", row_sums, METH_VARARGS,
     "row_sums(a, kind_a, b, kind_b, k, w, aa, bb, dd, maxabs): per row and slot, sum x^2, sum y^2, "
     "sum (x-y)^2 (float64) and max |x-y| (float32) of two blocks of stored rows (kind 0 float32, 1 bf16 bits)"},
    {"topk", topk, METH_VARARGS,
     "topk(x, k, vals, idx): the k largest of each float32 row of x, best first (NaN first, ties by the lower "
     "index), into vals float32 [n, k] and idx int64 [n, k]"},
    {"put_rows", (PyCFunction)(void (*)(void))put_rows, METH_FASTCALL,
     "put_rows(limit, rows, index, rows1, src1, ...) -> bool: the writer's append of n rows to each Rows, all "
     "or none (see _kernels.c)"},
    {"put_tokens", (PyCFunction)(void (*)(void))put_tokens, METH_FASTCALL,
     "put_tokens(pairs, runs, positions, tokens, seq, regime, step) -> the fill before, or -1 (see _kernels.c)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "tensordiff._kernels",
                                    "The diff's per-row sums, one pass over each element (see _kernels.c).", -1,
                                    methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__kernels(void)
{
#ifdef TD_AVX2
    __builtin_cpu_init();
#endif
    use_avx2 = best_level();
    if (PyType_Ready(&RowsType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&RowsType);
    if (PyModule_AddObject(m, "Rows", (PyObject *)&RowsType) < 0) {
        Py_DECREF(&RowsType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
