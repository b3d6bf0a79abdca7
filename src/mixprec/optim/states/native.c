/* The low-bit Adam/AdamW update of mixprec.optim.states.kernels.adam_update, for float32
 * parameters and gradients with int8, int4 or float8 moments and no compensation, written
 * out per block: decode both moments, update them, find each block's new scales, encode,
 * update the parameter, in one pass a block while the block sits in L1. The same arithmetic
 * as the eager update, in the same order (built with -ffp-contract=off, so that no multiply
 * and add is fused where the eager update rounds twice; the moment's lerp is one fused
 * multiply-add where torch's vectorized CPU lerp computes it so: MIXPREC_FUSED_LERP).
 * native.py builds and calls it. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define SMALLEST_V 1.17549435e-38f /* float32's smallest normal number */

/* A dynamic map's decades as codecs._Decades holds them, in float32 (the layout native.py
 * writes); copied into locals before a loop, so that the compiler keeps them in registers */
typedef struct {
    float slopes[8], offsets[8], uppers[8];
    float end_slope, end_offset, zero, zero_positive, one, last;
} decades_t;

/* A map's decades in locals (small arrays the compiler keeps in registers once the loops
 * over them are unrolled; the whole struct in the vectorized loop is not) */
#define DECADE_LOCALS(P, D)                                                                  \
    float P##sl[8], P##of[8], P##up[8];                                                     \
    for (int k = 0; k < 8; k++) {                                                           \
        P##sl[k] = (D)->slopes[k];                                                          \
        P##of[k] = (D)->offsets[k];                                                         \
        P##up[k] = (D)->uppers[k];                                                          \
    }                                                                                       \
    const float P##es = (D)->end_slope, P##eo = (D)->end_offset, P##z = (D)->zero;          \
    const float P##zp = (D)->zero_positive, P##one = (D)->one, P##last = (D)->last;

/* codecs.dynamic_nearest for a map of `nd` decades: the code as a float32 whole number */
static inline __attribute__((always_inline)) float dynamic_nearest(
    float y, const float *sl, const float *of, const float *up, const float es, const float eo,
    const float zero, const float zero_positive, const float one, const float last,
    const int nd, const int sign) {
    float a = fabsf(y);
    a = (a <= 1.0f) ? a : 1.0f; /* a NaN: the code of +-1 */
    float slope = sl[0], offset = of[0];
    for (int i = 1; i < nd; i++) {
        const int above = a > up[i - 1];
        slope = above ? sl[i] : slope;
        offset = above ? of[i] : offset;
    }
    const float end = floorf(offset * es + eo);
    float t = floorf(a * slope + offset);
    t = (t < end) ? t : end;
    t = (a > one) ? last : t;
    if (!sign) return (a < zero) ? 0.0f : t + 1.0f;
    const int negative = y < 0.0f;
    float k = negative ? t + 1.0f : ((t < 1.0f) ? 1.0f : t);
    k = (a < (negative ? zero : zero_positive)) ? 0.0f : k;
    const float half = last + 1.0f;
    return negative ? half - k : half + k;
}

#define NEAREST(Y, P, ND, SIGN) \
    dynamic_nearest(Y, P##sl, P##of, P##up, P##es, P##eo, P##z, P##zp, P##one, P##last, ND, SIGN)

/* The largest magnitude of n values, NaN if any is NaN (torch's abs().amax()): as the bits
 * of a magnitude order as the magnitudes do, with a NaN's past infinity's, the largest of
 * them as integers (a float max with NaN propagation does not vectorize; an integer one does) */
static inline float abs_max(const float *restrict x, int n) {
    int32_t m = 0;
    for (int i = 0; i < n; i++) {
        int32_t bits;
        memcpy(&bits, x + i, sizeof bits);
        bits &= 0x7fffffff;
        m = (bits > m) ? bits : m;
    }
    float r;
    memcpy(&r, &m, sizeof r);
    return r;
}

/* codecs._over's factors for a block of largest magnitude `scale`: x * up * inverse */
static inline void over(float scale, float *up, float *inverse) {
    *up = (scale < SMALLEST_V) ? 18446744073709551616.0f : 1.0f;
    const float safe = (scale > 0.0f) ? scale * *up : 1.0f;
    *inverse = 1.0f / safe;
}

static inline uint8_t to_code(float c) { return (uint8_t)(int32_t)c; }

/* codecs._e4m3: the float8 e4m3 byte of y from y's bits as torch converts (round to nearest
 * even, subnormals, past 448 saturated to 448, NaN to NaN); with `infinities`, an infinity to
 * the NaN code of its sign instead of 448 (the codec of a tensor stored once) */
static inline __attribute__((always_inline)) int32_t e4m3_bits(float y, const int infinities) {
    uint32_t bits;
    memcpy(&bits, &y, sizeof bits);
    const uint32_t magnitude = bits & 0x7fffffffu;
    /* a normal e4m3: exponent rebiased, three mantissa bits kept, rounded to nearest even */
    const uint32_t rounded = (magnitude + 0x7ffffu + ((magnitude >> 20) & 1u)) >> 20;
    const int32_t normal = (int32_t)rounded - (120 << 3);
    const int32_t subnormal = (int32_t)rintf(fabsf(y) * 512.0f); /* multiples of 2^-9 */
    int32_t code = (magnitude < 0x3c800000u) ? subnormal : normal;
    code = (magnitude > 0x43e00000u) ? 0x7e : code;
    code = (magnitude >= (infinities ? 0x7f800000u : 0x7f800001u)) ? 0x7f : code;
    code |= (int32_t)((bits >> 24) & 0x80u);
    return code;
}

/* e4m3_bits as a float32 whole number (for a select chain over floats) */
static inline float e4m3_code(float y) { return (float)e4m3_bits(y, 0); }

/* hp: lr, beta1, beta2, eps, weight_decay, step_size, inv_sqrt_bc2, gain1, gain2.
 * bits: 8 (int8: one code a byte), 4 (int4: two a byte, the first in the low half; the
 * second moment on the linear map k/16, k = 1..16) or 0 (float8: e4m3 bytes of the moment
 * over its scale, the block's largest magnitude over 448; mt and vt then e4m3's values).
 * dm, dv: the decades of the first and second moment's maps (read for int8 and int4's first
 * moment). ms, vs: the block's float32 scales. m1, m2, codes, index: scratch of the block. */
static inline __attribute__((always_inline)) void adam_block(
                       float *restrict p, const float *restrict g, uint8_t *restrict mc,
                       float *restrict ms, uint8_t *restrict vc, float *restrict vs,
                       const float *restrict mt, const float *restrict vt,
                       const float *restrict hp, const decades_t *restrict dm_,
                       const decades_t *restrict dv_, const int block, const int bits,
                       const int decoupled, float *restrict m1, float *restrict m2,
                       float *restrict codes, int32_t *restrict index) {
    const float lr = hp[0], beta2 = hp[2], eps = hp[3], wd = hp[4];
    const float step_size = hp[5], inv_sqrt_bc2 = hp[6], gain1 = hp[7], gain2 = hp[8];
    DECADE_LOCALS(m_, dm_)
    DECADE_LOCALS(v_, dv_)
    const float ms_old = *ms, vs_old = *vs;
    float vmag = fabsf(vs_old);
    if (bits == 4 && vmag == INFINITY) vmag = NAN; /* int4: past float32's range decodes NaN */
    const int roots = (bits == 0) || vs_old < 0.0f; /* (float8 always stores roots) */
    /* lerp's coefficient and base choice, as torch's vectorized CPU lerp */
    const int small = fabsf(gain1) < 0.5f;
    const float coeff = small ? gain1 : gain1 - 1.0f;
    if (bits == 4) { /* unpacked first: a nibble's shift by position does not vectorize */
        for (int j = 0; j < block / 2; j++) {
            index[2 * j] = mc[j] & 15;
            index[2 * j + 1] = mc[j] >> 4;
            index[block + 2 * j] = vc[j] & 15;
            index[block + 2 * j + 1] = vc[j] >> 4;
        }
    }
    for (int i = 0; i < block; i++) {
        const int mcode = (bits == 4) ? index[i] : mc[i];
        const int vcode = (bits == 4) ? index[block + i] : vc[i];
        const float p32 = p[i];
        float g32 = g[i];
        if (!decoupled) g32 = g32 + wd * p32;
        const float m = mt[mcode] * ms_old;
        const float values = vt[vcode];
        const float stored = values * vmag;
        float v = roots ? stored * stored : stored;
        v = (values > 0.0f && vmag > 0.0f) ? ((v < SMALLEST_V) ? SMALLEST_V : v) : v;
#if MIXPREC_FUSED_LERP
        m1[i] = fmaf(coeff, g32 - m, small ? m : g32);
#else
        m1[i] = coeff * (g32 - m) + (small ? m : g32);
#endif
        m2[i] = v * beta2 + gain2 * g32 * g32;
    }
    /* the new scales: the largest magnitude of m1, the largest root of m2 */
    float mabs = abs_max(m1, block);
    /* (m2 >= 0 or NaN: its largest is its largest magnitude) */
    float vroot = fabsf(sqrtf(abs_max(m2, block)));
    if (bits == 0) { /* float8's scales: over e4m3's largest finite value */
        mabs = mabs / 448.0f;
        vroot = vroot / 448.0f;
    }
    float mup, minv, vup, vinv;
    over(mabs, &mup, &minv);
    over(vroot, &vup, &vinv);
    for (int i = 0; i < block; i++) {
        const float root = sqrtf(m2[i]);
        const float ym = (m1[i] * mup) * minv;
        const float yv = (root * vup) * vinv;
        float cm, cv;
        if (bits == 8) {
            cm = NEAREST(ym, m_, 7, 1);
            cv = NEAREST(yv, v_, 7, 0);
            const float lowest = (yv > 0.0f) ? 1.0f : 0.0f; /* a positive root: not 0's code */
            cv = (cv < lowest) ? lowest : cv;
        } else if (bits == 0) { /* (the e4m3 bytes in a loop of their own, below) */
            cm = ym;
            /* a positive root below e4m3's smallest subnormal stored as it (two selects: the
             * nested one is not if-converted) */
            const float lifted = (yv < 0x1p-9f) ? 0x1p-9f : yv;
            cv = (yv > 0.0f) ? lifted : yv;
        } else {
            cm = NEAREST(ym, m_, 3, 1);
            cv = ceilf(yv * 16.0f - 0.5f) - 1.0f;
            cv = (cv < 0.0f) ? 0.0f : ((cv > 15.0f) ? 15.0f : cv);
        }
        codes[i] = cm; /* (floats: a select chain ending in a byte store does not vectorize) */
        codes[block + i] = cv;
        float u = -((step_size * m1[i]) / (root * inv_sqrt_bc2 + eps));
        if (decoupled) u = u - (lr * wd) * p[i];
        p[i] = p[i] + u;
    }
    if (bits == 0) { /* (within the loop above, the byte's integer selects are not if-converted) */
        for (int i = 0; i < 2 * block; i++) codes[i] = e4m3_code(codes[i]);
    }
    if (bits != 4) {
        for (int i = 0; i < block; i++) {
            mc[i] = to_code(codes[i]);
            vc[i] = to_code(codes[block + i]);
        }
    } else {
        for (int i = 0; i < block / 2; i++) {
            const float *v = codes + block;
            mc[i] = (uint8_t)(to_code(codes[2 * i]) | (to_code(codes[2 * i + 1]) << 4));
            vc[i] = (uint8_t)(to_code(v[2 * i]) | (to_code(v[2 * i + 1]) << 4));
        }
    }
    *ms = mabs;
    *vs = (bits == 0) ? vroot : -vroot; /* (int8, int4: negated, to mark roots) */
}

/* One update of `blocks` blocks (adam_block each; block <= MAX_BLOCK, whose scratch stays
 * on the stack), split over `threads` OpenMP threads. */
#define MAX_BLOCK 4096

int mixprec_max_block(void) { return MAX_BLOCK; }

void mixprec_adam(float *p, const float *g, uint8_t *mc, float *ms, uint8_t *vc, float *vs,
                  const float *mt, const float *vt, const float *hp, const decades_t *dm,
                  const decades_t *dv, int64_t blocks, int block, int bits, int decoupled,
                  int threads) {
    const int64_t per = bits == 4 ? block / 2 : block;
#define ADAM_LOOP(BITS, DECOUPLED)                                                         \
    _Pragma("omp parallel for num_threads(threads) schedule(static) if (threads > 1)")     \
    for (int64_t b = 0; b < blocks; b++) {                                                 \
        float m1[MAX_BLOCK], m2[MAX_BLOCK], codes[2 * MAX_BLOCK];                          \
        int32_t index[2 * MAX_BLOCK];                                                      \
        adam_block(p + b * block, g + b * block, mc + b * per, ms + b, vc + b * per, vs + b, \
                   mt, vt, hp, dm, dv, block, BITS, DECOUPLED, m1, m2, codes, index);       \
    }
    if (bits == 8 && decoupled) {
        ADAM_LOOP(8, 1)
    } else if (bits == 8) {
        ADAM_LOOP(8, 0)
    } else if (bits == 0 && decoupled) {
        ADAM_LOOP(0, 1)
    } else if (bits == 0) {
        ADAM_LOOP(0, 0)
    } else if (decoupled) {
        ADAM_LOOP(4, 1)
    } else {
        ADAM_LOOP(4, 0)
    }
}

/* The float8 codec of a tensor stored once (codecs.Float8Codec.encode_tensor and
 * decode_tensor, signed: a saved activation), a block at a time: the block's scale is its
 * largest finite magnitude over 448 (NaN where it holds a NaN), each element's code the e4m3
 * byte of it over that scale, an infinity the NaN code of its sign, which decodes back to
 * the infinity. `dtype`: 0 float32, 1 bfloat16 (read and written as their top 16 bits). A
 * last partial block is coded as if padded with zeros (codes and scales as formats.quantize's,
 * whose codes hold whole blocks). With `means` (one float32 a row of `row` elements, a
 * multiple of the block), what is coded is each element less its row's mean, in float32,
 * a row whose mean is not finite as zeros, and decoding adds the mean back before the cast
 * (activations.codecs.Centered: a layer norm's input). */
enum { F32 = 0, BF16 = 1 };

static inline float from_bf16(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* float32 to bfloat16, rounded to nearest even, a NaN to the quiet NaN (as torch converts) */
static inline uint16_t to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    return (uint16_t)(((bits & 0x7fffffffu) > 0x7f800000u) ? 0x7fc0u : rounded);
}

/* e4m3's magnitude of the byte c, its sign and NaN codes aside (0x7f: read as 480) */
static inline float e4m3_magnitude(uint32_t c) {
    const uint32_t bits = ((c & 0x7fu) << 20) + (120u << 23); /* exponent rebiased from 7 */
    float v;
    memcpy(&v, &bits, sizeof v);
    return ((c & 0x78u) == 0u) ? (float)(c & 7u) * 0x1p-9f : v; /* (subnormal: m 2^-9) */
}

static inline __attribute__((always_inline)) void fp8_encode_block(
    const float *restrict x, int n, uint8_t *restrict codes, float *restrict scale,
    int32_t *restrict scratch) {
    /* the largest finite magnitude, NaN over all (as integers: an infinity's bits as 0) */
    int32_t m = 0;
    for (int i = 0; i < n; i++) {
        int32_t bits;
        memcpy(&bits, x + i, sizeof bits);
        bits &= 0x7fffffff;
        bits = (bits == 0x7f800000) ? 0 : bits;
        m = (bits > m) ? bits : m;
    }
    float largest;
    memcpy(&largest, &m, sizeof largest);
    const float s = largest / 448.0f;
    float up, inverse;
    over(s, &up, &inverse);
    /* x over the scale is infinite exactly where x is, NaN where x is, of x's sign everywhere:
     * e4m3_bits with infinities gives the eager codec's select and copysign their codes */
    if (up == 1.0f) { /* (x * 1 is x: one product an element) */
        for (int i = 0; i < n; i++) scratch[i] = e4m3_bits(x[i] * inverse, 1);
    } else {
        for (int i = 0; i < n; i++) scratch[i] = e4m3_bits((x[i] * up) * inverse, 1);
    }
    for (int i = 0; i < n; i++) codes[i] = (uint8_t)scratch[i];
    *scale = s;
}

static inline __attribute__((always_inline)) void fp8_decode_block(
    const uint8_t *restrict codes, float scale, int n, float *restrict out) {
    /* a NaN code under a finite scale is an infinity of its sign; under a NaN one, NaN (a
     * NaN scale makes every value of the block NaN: the scale's, unsigned, as a product
     * with it is) */
    const int finite = scale == scale;
    const float special = finite ? INFINITY : scale;
    const uint32_t sign = finite ? 0x80u : 0u;
    for (int i = 0; i < n; i++) {
        const uint32_t c = codes[i];
        float v = ((c & 0x7fu) == 0x7fu) ? special : e4m3_magnitude(c) * scale;
        uint32_t bits;
        memcpy(&bits, &v, sizeof bits);
        bits |= (c & sign) << 24;
        memcpy(out + i, &bits, sizeof bits);
    }
}

void mixprec_fp8_encode(const void *x, int dtype, int64_t n, const float *means, int64_t row,
                        uint8_t *codes, float *scales, int block, int threads) {
    const int64_t blocks = (n + block - 1) / block;
    _Pragma("omp parallel for num_threads(threads) schedule(static) if (threads > 1)")
    for (int64_t b = 0; b < blocks; b++) {
        float xb[MAX_BLOCK];
        int32_t scratch[MAX_BLOCK];
        const int64_t start = b * block;
        const int len = (int)((n - start < block) ? n - start : block);
        if (dtype == BF16) {
            const uint16_t *h = (const uint16_t *)x + start;
            for (int i = 0; i < len; i++) xb[i] = from_bf16(h[i]);
        } else {
            memcpy(xb, (const float *)x + start, (size_t)len * sizeof(float));
        }
        if (means) {
            const float mean = means[start / row];
            const int finite = fabsf(mean) <= 3.40282347e38f;
            for (int i = 0; i < len; i++) xb[i] = finite ? xb[i] - mean : 0.0f;
        }
        for (int i = len; i < block; i++) xb[i] = 0.0f; /* (a partial block: zeros, as padded) */
        fp8_encode_block(xb, block, codes + start, scales + b, scratch);
    }
}

void mixprec_fp8_decode(const uint8_t *codes, const float *scales, int64_t n, int block,
                        const float *means, int64_t row, void *out, int dtype, int threads) {
    const int64_t blocks = (n + block - 1) / block;
    _Pragma("omp parallel for num_threads(threads) schedule(static) if (threads > 1)")
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t start = b * block;
        const int len = (int)((n - start < block) ? n - start : block);
        float ob[MAX_BLOCK];
        float *o = (dtype == BF16 || means) ? ob : (float *)out + start;
        fp8_decode_block(codes + start, scales[b], len, o);
        if (means) {
            const float mean = means[start / row];
            for (int i = 0; i < len; i++) o[i] = o[i] + mean;
        }
        if (dtype == BF16) {
            uint16_t *h = (uint16_t *)out + start;
            for (int i = 0; i < len; i++) h[i] = to_bf16(o[i]);
        } else if (means) {
            memcpy((float *)out + start, o, (size_t)len * sizeof(float));
        }
    }
}
