// headstart's native forward: a Llama-style decoder stack in one call, its products at the memory wall, every row
// computed in the same order whatever the number of rows (row-count invariance). Built at first use by
// runtime/native.py (g++ -O3 -march=native -fopenmp; cached per machine), called through ctypes.
//
// Two element types: float32 (dtype 0) and bfloat16 (dtype 1, stored as uint16). Every reduction runs in float32
// over fixed lanes in a fixed order; a value is rounded to the element type where transformers' Llama rounds it
// (after each product, norm, residual add, activation), so the results stay close to transformers' (not bitwise:
// the summation orders differ) and equal to themselves at any row count.
//
// Weights are repacked once (hs_pack) into strips of 16 outputs whose inputs run front to back (see "products"), so a
// product streams each strip in order and every output's sum is one vector lane's chain in input order.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <omp.h>
#include <vector>
#if defined(__AVX512F__) || defined(__AVX512BF16__)
#include <immintrin.h>
#endif

typedef uint16_t bf16;

namespace {

inline float to_f(float v) { return v; }
inline float to_f(bf16 v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
template <typename T> inline T from_f(float f);
template <> inline float from_f<float>(float f) { return f; }
template <> inline bf16 from_f<bf16>(float f) {  // round to nearest even, as torch
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)((u >> 16) | 64);  // NaN stays NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16)(u >> 16);
}
#if defined(__AVX512F__)
// The sums of 16 vectors' lanes at once, out[i][j] = the sum of acc[i][j]'s lanes, each in the order
// _mm512_reduce_add_ps adds one vector's (lane l with l + 8, then p with p + 4, p + 2, p + 1): the attention's 16
// keys' scores at once, each what `dot` gives it, for a quarter of the shuffles.
inline void reduce16(const __m512 acc[4][4], float out[4][4]) {
    const __m512* v = &acc[0][0];
    __m512 r[8], s[4], t[2];
    for (int i = 0; i < 8; i++)  // each lane l of v with lane l + 8: v[2i] in lanes 0-7, v[2i+1] in 8-15
        r[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++)  // p with p + 4: quarter q holds v[4i + q]'s four
        s[i] = _mm512_add_ps(_mm512_shuffle_f32x4(r[2 * i], r[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(r[2 * i], r[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++)  // p with p + 2
        t[i] = _mm512_add_ps(_mm512_shuffle_ps(s[2 * i], s[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(s[2 * i], s[2 * i + 1], 0xEE));
    // p with p + 1: element 4k + c holds v[4c + k]
    const __m512 u = _mm512_add_ps(_mm512_shuffle_ps(t[0], t[1], 0x88), _mm512_shuffle_ps(t[0], t[1], 0xDD));
    float sums[16];
    _mm512_storeu_ps(sums, u);
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 4; j++) out[i][j] = sums[4 * j + i];
}

#endif

// ---- the layers' pointwise steps ------------------------------------------------------------------------------
template <typename T>
inline float mean_square(const T* x, int n) {
    float lane[16] = {};
    int k = 0;
    for (; k + 16 <= n; k += 16)
        for (int l = 0; l < 16; l++) lane[l] += to_f(x[k + l]) * to_f(x[k + l]);
    for (; k < n; k++) lane[k % 16] += to_f(x[k]) * to_f(x[k]);
    float s = 0;
    for (int l = 0; l < 16; l++) s += lane[l];
    return s / n;
}

// e^x for softmax and SiLU, in plain arithmetic the compiler vectorises (libm's expf stays scalar): 2^n e^r with
// |r| <= ln2 / 2 and a degree-6 polynomial (relative error ~2e-7); exactly 0 below -87 (a masked key: no weight).
inline float exp_f(float x) {
    const float t = (x < 88.0f ? x : 88.0f) * 1.44269504f;
    const float n = std::floor(t + 0.5f);
    const float r = (x - n * 0.693145752f) - n * 1.42860677e-06f;
    float p = 1.0f + r * (1.0f + r * (0.5f + r * (0.166666672f + r * (0.0416666679f + r * (0.00833333377f + r * 0.00138888892f)))));
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, 4);
    return x < -87.0f ? 0.0f : p * scale;
}

inline float silu(float v) { return v / (1.0f + exp_f(-v)); }

// q . k over D (a multiple of 16) in float32: 16 lanes, then halves added pairwise (a fixed order)
#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const bf16* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
template <typename T>
inline float dot(const float* q, const T* k, int D) {
    __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(q), load16(k));
    for (int d = 16; d < D; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), load16(k + d), acc);
    return _mm512_reduce_add_ps(acc);
}
// acc[0..D) += p v[0..D)
template <typename T>
inline void axpy(float* acc, float p, const T* v, int D) {
    const __m512 pv = _mm512_set1_ps(p);
    for (int d = 0; d < D; d += 16) _mm512_storeu_ps(acc + d, _mm512_fmadd_ps(pv, load16(v + d), _mm512_loadu_ps(acc + d)));
}
#else
template <typename T>
inline void axpy(float* acc, float p, const T* v, int D) {
    for (int d = 0; d < D; d++) acc[d] += p * to_f(v[d]);
}
template <typename T>
inline float dot(const float* q, const T* k, int D) {
    float lane[16] = {};
    for (int d = 0; d < D; d += 16)
        for (int l = 0; l < 16; l++) lane[l] += q[d + l] * to_f(k[d + l]);
    for (int w = 8; w > 0; w /= 2)
        for (int l = 0; l < w; l++) lane[l] += lane[l + w];
    return lane[0];
}
#endif

// ---- rows of pointwise steps: 16 elements at a time where AVX-512 runs, each exactly as the scalar tail computes it
// (the same operations in the same order: -ffp-contract=off keeps the scalar ones unfused), so an element's value
// does not depend on which of the two computed it
#if defined(__AVX512F__)
inline __m512 exp16(__m512 x) {  // exp_f, 16 at a time
    const __m512 t = _mm512_mul_ps(_mm512_min_ps(x, _mm512_set1_ps(88.0f)), _mm512_set1_ps(1.44269504f));
    const __m512 n = _mm512_roundscale_ps(_mm512_add_ps(t, _mm512_set1_ps(0.5f)), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_sub_ps(_mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(0.693145752f))),
                                   _mm512_mul_ps(n, _mm512_set1_ps(1.42860677e-06f)));
    __m512 p = _mm512_set1_ps(0.00138888892f);
    const float c[] = {0.00833333377f, 0.0416666679f, 0.166666672f, 0.5f, 1.0f, 1.0f};
    for (float k : c) p = _mm512_add_ps(_mm512_set1_ps(k), _mm512_mul_ps(r, p));
    const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
    const __m512 e = _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
    return _mm512_mask_mov_ps(e, _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ), _mm512_setzero_ps());
}
inline __m512 round16(float*, __m512 v) { return v; }
inline __m512 round16(bf16*, __m512 v) {  // to bfloat16 and back (from_f's rounding, NaN kept)
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_and_si512(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb),
                                 _mm512_set1_epi32((int)0xffff0000u));
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_and_si512(_mm512_or_si512(u, _mm512_set1_epi32(64 << 16)),
                                                       _mm512_set1_epi32((int)0xffff0000u)));
    return _mm512_castsi512_ps(r);
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(bf16* p, __m512 v) {  // v already rounded (round16)
    _mm256_storeu_si256((__m256i*)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16)));
}
#endif

// out = silu(gate) rounded, times up, rounded (transformers' act_fn(gate) * up in the model's dtype)
template <typename T>
inline void silu_mul(const T* gate, const T* up, T* out, int n) {
    int k = 0;
#if defined(__AVX512F__)
    for (; k + 16 <= n; k += 16) {
        const __m512 g = load16(gate + k);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
        const __m512 s = round16(out, _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
        store16(out + k, round16(out, _mm512_mul_ps(s, load16(up + k))));
    }
#endif
    for (; k < n; k++) out[k] = from_f<T>(to_f(from_f<T>(silu(to_f(gate[k])))) * to_f(up[k]));
}

// h = h + d, rounded (a residual add)
template <typename T>
inline void add_into(T* h, const T* d, int n) {
    int k = 0;
#if defined(__AVX512F__)
    for (; k + 16 <= n; k += 16) store16(h + k, round16(h, _mm512_add_ps(load16(h + k), load16(d + k))));
#endif
    for (; k < n; k++) h[k] = from_f<T>(to_f(h[k]) + to_f(d[k]));
}

// transformers' RMSNorm: normalised in float32, rounded, then scaled by the weight (and rounded)
template <typename T>
inline void rms_norm(const T* x, const T* weight, float eps, int n, T* out) {
    const float inv = 1.0f / std::sqrt(mean_square(x, n) + eps);
    int k = 0;
#if defined(__AVX512F__)
    const __m512 iv = _mm512_set1_ps(inv);
    for (; k + 16 <= n; k += 16) {
        const __m512 normed = round16(out, _mm512_mul_ps(load16(x + k), iv));
        store16(out + k, round16(out, _mm512_mul_ps(load16(weight + k), normed)));
    }
#endif
    for (; k < n; k++) out[k] = from_f<T>(to_f(weight[k]) * to_f(from_f<T>(to_f(x[k]) * inv)));
}

// out[j] = q . K[j] for the n keys of K (n x D): 16 keys at a time summed by reduce16, which adds each key's lanes
// in the order `dot` adds them, so a score does not depend on how many keys a row reads
template <typename T>
inline void dots(const float* q, const T* K, int n, int D, float* out) {
    int j = 0;
#if defined(__AVX512F__)
    for (; j + 16 <= n; j += 16) {
        __m512 acc[4][4];
        for (int k = 0; k < 16; k++) {
            const T* key = K + (size_t)(j + k) * D;
            __m512 a = _mm512_mul_ps(_mm512_loadu_ps(q), load16(key));
            for (int d = 16; d < D; d += 16) a = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), load16(key + d), a);
            acc[k / 4][k % 4] = a;
        }
        float sums[4][4];
        reduce16(acc, sums);
        for (int k = 0; k < 16; k++) out[j + k] = sums[k / 4][k % 4];
    }
#endif
    for (; j < n; j++) out[j] = dot(q, K + (size_t)j * D, D);
}

// scores[j] = e^(s_j - max s) for s_j = scores[j] * scale + mask[j] (unnormalised softmax weights; a masked key's
// is exactly 0), 16 keys at a time where AVX-512 runs, each exactly as the scalar tail computes it
template <typename T>
inline void softmax_weights(float* scores, int n, float scale, const T* mask) {
    float top = -INFINITY;
    int j = 0;
#if defined(__AVX512F__)
    const __m512 sv = _mm512_set1_ps(scale);
    __m512 tv = _mm512_set1_ps(-INFINITY);
    for (; j + 16 <= n; j += 16) {
        __m512 sc = _mm512_mul_ps(_mm512_loadu_ps(scores + j), sv);
        if (mask) sc = _mm512_add_ps(sc, load16(mask + j));
        _mm512_storeu_ps(scores + j, sc);
        tv = _mm512_max_ps(tv, sc);
    }
    top = _mm512_reduce_max_ps(tv);
#endif
    for (; j < n; j++) {
        const float sc = scores[j] * scale + (mask ? to_f(mask[j]) : 0.f);
        scores[j] = sc;
        top = sc > top ? sc : top;
    }
    j = 0;
#if defined(__AVX512F__)
    const __m512 topv = _mm512_set1_ps(top);
    for (; j + 16 <= n; j += 16) _mm512_storeu_ps(scores + j, exp16(_mm512_sub_ps(_mm512_loadu_ps(scores + j), topv)));
#endif
    for (; j < n; j++) scores[j] = exp_f(scores[j] - top);
}

// acc[0..D) = sum_j p[j] V[j] over the keys of nonzero weight (in key order), and the sum of the weights
template <typename T>
inline float weighted_sum(const float* p, const T* V, int n, int D, float* acc) {
    float total = 0;
    for (int d = 0; d < D; d++) acc[d] = 0.f;
#if defined(__AVX512F__)
    if (D == 64) {  // the common head size: the sums kept in registers
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int j = 0; j < n; j++) {
            if (p[j] == 0.f) continue;  // a masked key (exactly zero weight): skipping it changes no sum
            total += p[j];
            const __m512 pv = _mm512_set1_ps(p[j]);
            const T* v = V + (size_t)j * D;
            a0 = _mm512_fmadd_ps(pv, load16(v), a0);
            a1 = _mm512_fmadd_ps(pv, load16(v + 16), a1);
            a2 = _mm512_fmadd_ps(pv, load16(v + 32), a2);
            a3 = _mm512_fmadd_ps(pv, load16(v + 48), a3);
        }
        _mm512_storeu_ps(acc, a0);
        _mm512_storeu_ps(acc + 16, a1);
        _mm512_storeu_ps(acc + 32, a2);
        _mm512_storeu_ps(acc + 48, a3);
        return total;
    }
#endif
    for (int j = 0; j < n; j++) {
        if (p[j] == 0.f) continue;
        total += p[j];
        axpy(acc, p[j], V + (size_t)j * D, D);
    }
    return total;
}

// ---- products: y[m, n] = sum_k x[m, k] w[n, k] (+ bias[n]), rounded to T ---------------------------------------
// The packed weight (hs_pack): strips of LANES outputs, each strip's inputs front to back in steps of KS (bf16: a pair,
// what one vdpbf16ps lane adds; float32: one), a step holding the strip's outputs side by side:
// P[s][k / KS][l][k % KS] = W[LANES s + l][k]. An output's sum is one accumulator lane adding step after step in k
// order: no reduction across lanes, and the same operations whatever the rows or strips computed beside it. A tile
// is R rows x S strips, at most 24 accumulators in registers (6 x 4, 8 x 3, 12 x 2); the threads split the strips.
const int LANES = 16;
const int MR = 6;  // rows of a tile of NR strips (MR x NR accumulators and NR weights: 28 of the 32 vector registers)
const int NR = 4;  // strips a tile, at most
const int WIDE = 12;  // up to this many rows one tile holds them all (7-8 rows x 3 strips, 9-12 x 2)
const int TALL = 8;  // beyond WIDE, rows of a tile of 3 strips
template <typename T> constexpr int ks() { return sizeof(T) == 2 ? 2 : 1; }
#define TILE_ARGS x, ldx, P, strip, k0, k1, part, bias, y, ldy, last, pf  // a tile's arguments, passed on

// One tile, R rows x S strips, over inputs [k0, k1): each output's float32 FMA chain in k order, carried between
// blocks of k in `part` (row i, output LANES j + l at (i S + j) LANES + l) and, after the last block, rounded into y
// with its bias. `pf`: where nonzero, each weight step also prefetches the one pf elements on (the next block). The
// portable way here; the AVX-512 one below computes the very same chains.
template <typename T>
void tile_any(int R, int S, const T* x, int ldx, const T* P, size_t strip, int k0, int k1, float* part, const T* bias,
              T* y, int ldy, bool last, long) {
    for (int i = 0; i < R; i++)
        for (int j = 0; j < S; j++)
            for (int l = 0; l < LANES; l++) {
                const T* w = P + j * strip + (size_t)l * ks<T>();
                float a = k0 ? part[(i * S + j) * LANES + l] : 0.f;
                for (int k = k0; k < k1; k += ks<T>())
                    for (int e = 0; e < ks<T>(); e++)
                        a = std::fma(to_f(x[(size_t)i * ldx + k + e]), to_f(w[(size_t)k * LANES + e]), a);
                part[(i * S + j) * LANES + l] = a;
                if (last) y[(size_t)i * ldy + j * LANES + l] = from_f<T>(a + (bias ? to_f(bias[j * LANES + l]) : 0.f));
            }
}

#if defined(__AVX512F__)
// A step's input broadcast to every lane, and acc + x . w over the step for each lane's output
inline __m512 bcast(const float* x) { return _mm512_set1_ps(*x); }
inline __m512 madd(__m512 acc, __m512 x, __m512i w) { return _mm512_fmadd_ps(x, _mm512_castsi512_ps(w), acc); }
#if defined(__AVX512BF16__)
inline __m512i bcast(const bf16* x) {
    int32_t pair;
    std::memcpy(&pair, x, 4);
    return _mm512_set1_epi32(pair);
}
inline __m512 madd(__m512 acc, __m512i x, __m512i w) { return _mm512_dpbf16_ps(acc, (__m512bh)x, (__m512bh)w); }
#else
struct Pair {
    __m512 lo, hi;
};
inline Pair bcast(const bf16* x) { return {_mm512_set1_ps(to_f(x[0])), _mm512_set1_ps(to_f(x[1]))}; }
inline __m512 madd(__m512 acc, Pair x, __m512i w) {  // tile_any's two FMAs
    acc = _mm512_fmadd_ps(x.lo, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)), acc);
    return _mm512_fmadd_ps(x.hi, _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32((int)0xffff0000u))), acc);
}
#endif

template <typename T, int R, int S>
inline void tile(const T* x, int ldx, const T* P, size_t strip, int k0, int k1, float* part, const T* bias, T* y,
                 int ldy, bool last, long pf) {
    __m512 acc[R][S];
    for (int i = 0; i < R; i++)
        for (int j = 0; j < S; j++) acc[i][j] = k0 ? _mm512_loadu_ps(part + (i * S + j) * LANES) : _mm512_setzero_ps();
    for (int k = k0; k < k1; k += ks<T>()) {
        __m512i w[S];
        for (int j = 0; j < S; j++) w[j] = _mm512_loadu_si512(P + j * strip + (size_t)k * LANES);
        if (pf)
            for (int j = 0; j < S; j++) _mm_prefetch((const char*)(P + j * strip + (size_t)k * LANES + pf), _MM_HINT_T0);
        for (int i = 0; i < R; i++) {
            const auto xb = bcast(x + (size_t)i * ldx + k);
            for (int j = 0; j < S; j++) acc[i][j] = madd(acc[i][j], xb, w[j]);
        }
    }
    for (int i = 0; i < R; i++)
        for (int j = 0; j < S; j++) {
            if (!last) {
                _mm512_storeu_ps(part + (i * S + j) * LANES, acc[i][j]);
                continue;
            }
            const __m512 v = bias ? _mm512_add_ps(acc[i][j], load16(bias + j * LANES)) : acc[i][j];
            store16(y + (size_t)i * ldy + j * LANES, round16(y, v));
        }
}
template <typename T, int R>
inline void tile_r(int S, const T* x, int ldx, const T* P, size_t strip, int k0, int k1, float* part, const T* bias,
                   T* y, int ldy, bool last, long pf) {
    constexpr int most = R <= MR ? NR : R <= TALL ? 3 : 2;  // strips, at most 24 accumulators
    if (S == 1) return tile<T, R, 1>(TILE_ARGS);
    if (S == 2 || most == 2) return tile<T, R, 2>(TILE_ARGS);
    if (S == 3 || most == 3) return tile<T, R, most < 3 ? 2 : 3>(TILE_ARGS);
    return tile<T, R, most < NR ? most : NR>(TILE_ARGS);
}
#endif

template <typename T>
inline void tiles(int R, int S, const T* x, int ldx, const T* P, size_t strip, int k0, int k1, float* part,
                  const T* bias, T* y, int ldy, bool last, long pf) {
#if defined(__AVX512F__)
    static_assert(WIDE == 12, "the dispatch below covers 1-12 rows");
    switch (R) {
        case 1: return tile_r<T, 1>(S, TILE_ARGS);
        case 2: return tile_r<T, 2>(S, TILE_ARGS);
        case 3: return tile_r<T, 3>(S, TILE_ARGS);
        case 4: return tile_r<T, 4>(S, TILE_ARGS);
        case 5: return tile_r<T, 5>(S, TILE_ARGS);
        case 6: return tile_r<T, 6>(S, TILE_ARGS);
        case 7: return tile_r<T, 7>(S, TILE_ARGS);
        case 8: return tile_r<T, 8>(S, TILE_ARGS);
        case 9: return tile_r<T, 9>(S, TILE_ARGS);
        case 10: return tile_r<T, 10>(S, TILE_ARGS);
        case 11: return tile_r<T, 11>(S, TILE_ARGS);
        default: return tile_r<T, WIDE>(S, TILE_ARGS);
    }
#else
    tile_any<T>(R, S, TILE_ARGS);
#endif
}

// Inside a parallel region: each thread its run of strips, S at a time; returns once every thread has written. Up to
// WIDE rows one tile holds every row and streams each weight once, its inputs front to back. More rows run as tiles of
// up to TALL rows (as even as can be) over blocks of 4 KB of each strip: the first tile reads a block from memory, the
// others from L1 (a block's 12 KB), the last one prefetching the next block, which the memory would otherwise
// only start on when the next first tile asks (products_ab: 1.1-1.3x from 7 rows against tiles of 6 x 4 each block).
template <typename T>
void gemm(const T* x, int M, int K, const T* P, const T* bias, T* y, int N) {
    const int ns = M <= MR ? NR : M <= TALL ? 3 : M <= WIDE ? 2 : 3;  // strips a tile
    const int tiles_n = M <= WIDE ? 1 : (M + TALL - 1) / TALL;
    const int strips = N / LANES, t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int first = (int)((long)strips * t / nt), end = (int)((long)strips * (t + 1) / nt);
    const size_t strip = (size_t)K * LANES;
    const int KB = tiles_n == 1 ? K : 4096 / (LANES * (int)sizeof(T));
    const int per_tile = 24 * LANES;
    thread_local std::vector<float> parts;  // each row tile's partial sums between blocks of k
    const size_t need = (size_t)tiles_n * per_tile;
    if (parts.size() < need) parts.resize(need);
    for (int s = first; s < end; s += ns) {
        const int S = end - s < ns ? end - s : ns;
        for (int k0 = 0; k0 < K; k0 += KB) {
            const int k1 = K - k0 < KB ? K : k0 + KB;
            // the next block, in elements from this one: this strips' next inputs, or the next strips' first
            const long next = k1 < K ? (long)(k1 - k0) * LANES : (long)(ns * strip) - (long)k0 * LANES;
            const bool ahead = tiles_n > 1 && (k1 < K || s + ns < end);
            for (int m = 0, i = 0; i < tiles_n; i++) {
                const int R = M / tiles_n + (i < M % tiles_n);  // rows of this tile
                tiles<T>(R, S, x + (size_t)m * K, K, P + s * strip, strip, k0, k1, parts.data() + (size_t)i * per_tile,
                         bias ? bias + s * LANES : nullptr, y + (size_t)m * N + s * LANES, N, k1 == K,
                         ahead && i == tiles_n - 1 ? next : 0);
                m += R;
            }
        }
    }
#pragma omp barrier
}

struct Layer {
    const void *in_norm, *post_norm, *q_norm, *k_norm;  // (hidden,) or null (none), (hidden,), (D,) or null, (D,) or null
    const void *qkv, *qkv_bias, *o, *o_bias, *gate_up, *down;  // packed products, biases or null
    void *k_cache, *v_cache;  // (slots, G, capacity, D)
    void* hidden_out;  // (N, hidden): this layer's output, or null
};

struct Forward {
    int32_t dtype, N, hidden, heads, kv_heads, head_dim, intermediate, layers, capacity, threads;
    float eps, scale;
    void* h;  // (N, hidden): the embeddings in, the last layer's output out
    const void *cos, *sin;  // (N, D): each row's rotary, sin's first half negated
    const int64_t *slot, *row, *keys, *mask;  // (N,): the cache slot, the row it writes, keys it reads, mask row address
    const void* final_norm;  // or null: out is the last layer's output
    void* out;  // (N, hidden): the final norm's output
    const Layer* layer;
    void* work;  // workspace: hs_workspace_bytes
    const void* x_in;  // (N, x_width) or null: what the first layer's q/k/v product reads instead of its input norm of
    int32_t x_width;   // h (an EAGLE-3 draft layer's [norm(embedding); norm(fused state)], 2 hidden wide)
};

template <typename T>
void run(const Forward& f) {
    const int N = f.N, E = f.hidden, H = f.heads, G = f.kv_heads, D = f.head_dim, I = f.intermediate;
    const int QKV = (H + 2 * G) * D;
    T* h = (T*)f.h;
    T* xn = (T*)f.work;  // (N, E)
    T* qkv = xn + (size_t)N * E;  // (N, QKV)
    T* q = qkv + (size_t)N * QKV;  // (N, H, D)
    T* att = q + (size_t)N * H * D;  // (N, H * D)
    T* tmp = att + (size_t)N * H * D;  // (N, E)
    T* gu = tmp + (size_t)N * E;  // (N, 2I)
    T* act = gu + (size_t)N * 2 * I;  // (N, I)
    const T* cos = (const T*)f.cos;
    const T* sin = (const T*)f.sin;
#pragma omp parallel num_threads(f.threads)
    {
        float* scores = nullptr;
        int scores_n = 0;
        for (int li = 0; li < f.layers; li++) {
            const Layer& L = f.layer[li];
            T* kc = (T*)L.k_cache;
            T* vc = (T*)L.v_cache;
            const T* x = xn;  // what q/k/v read: the input norm of h, h itself (no norm), or the caller's rows
            int K = E;
            if (li == 0 && f.x_in) {
                x = (const T*)f.x_in;
                K = f.x_width;
            } else if (!L.in_norm) {
                x = h;
            } else {
#pragma omp for schedule(static)
                for (int r = 0; r < N; r++)
                    rms_norm(h + (size_t)r * E, (const T*)L.in_norm, f.eps, E, xn + (size_t)r * E);
            }
            gemm<T>(x, N, K, (const T*)L.qkv, (const T*)L.qkv_bias, qkv, QKV);
            // q/k norms (Qwen3), rotary on q and k, q to its buffer, k and v into the cache at the row's slot and row
#pragma omp for schedule(static)
            for (int t = 0; t < N * (H + G); t++) {
                const int r = t / (H + G), hd = t % (H + G);
                const T* src = qkv + (size_t)r * QKV + (size_t)hd * D;
                const T* norm = hd < H ? (const T*)L.q_norm : (const T*)L.k_norm;
                T normed[512];
                if (norm) {
                    rms_norm(src, norm, f.eps, D, normed);
                    src = normed;
                }
                T* dst = hd < H ? q + ((size_t)r * H + hd) * D
                                : kc + (((size_t)f.slot[r] * G + (hd - H)) * f.capacity + f.row[r]) * D;
                const T* c = cos + (size_t)r * D;
                const T* s = sin + (size_t)r * D;
                for (int d = 0; d < D; d++) {  // x cos + rotate_half(x) sin, each product and the sum rounded
                    const float a = to_f(from_f<T>(to_f(src[d]) * to_f(c[d])));
                    const float b = to_f(from_f<T>(to_f(src[(d + D / 2) % D]) * to_f(s[d])));
                    dst[d] = from_f<T>(a + b);
                }
                if (hd >= H) {
                    const T* v = qkv + (size_t)r * QKV + (size_t)(H + G + hd - H) * D;
                    std::memcpy(vc + (((size_t)f.slot[r] * G + (hd - H)) * f.capacity + f.row[r]) * D, v, D * sizeof(T));
                }
            }
            // attention: each (row, head) over its slot's first keys[r] rows, plus its mask row where it has one
#pragma omp for schedule(static)
            for (int t = 0; t < N * H; t++) {
                const int r = t / H, hh = t % H, g = hh / (H / G);
                const int n = (int)f.keys[r];
                if (n > scores_n) {
                    delete[] scores;
                    scores_n = n + 256;
                    scores = new float[scores_n];
                }
                const T* qv = q + ((size_t)r * H + hh) * D;
                const T* K = kc + ((size_t)f.slot[r] * G + g) * f.capacity * D;
                const T* V = vc + ((size_t)f.slot[r] * G + g) * f.capacity * D;
                const T* mask = (const T*)(intptr_t)f.mask[r];
                float qf[512];
                for (int d = 0; d < D; d++) qf[d] = to_f(qv[d]);
                dots(qf, K, n, D, scores);
                softmax_weights(scores, n, f.scale, mask);
                float acc[512];
                const float total = weighted_sum(scores, V, n, D, acc);
                T* o = att + (size_t)r * H * D + (size_t)hh * D;
                for (int d = 0; d < D; d++) o[d] = from_f<T>(acc[d] / total);
            }
            gemm<T>(att, N, H * D, (const T*)L.o, (const T*)L.o_bias, tmp, E);
#pragma omp for schedule(static)
            for (int r = 0; r < N; r++) {
                T* hr = h + (size_t)r * E;
                add_into(hr, tmp + (size_t)r * E, E);
                rms_norm(hr, (const T*)L.post_norm, f.eps, E, xn + (size_t)r * E);
            }
            gemm<T>(xn, N, E, (const T*)L.gate_up, nullptr, gu, 2 * I);
#pragma omp for schedule(static)
            for (int r = 0; r < N; r++)
                silu_mul(gu + (size_t)r * 2 * I, gu + (size_t)r * 2 * I + I, act + (size_t)r * I, I);
            gemm<T>(act, N, I, (const T*)L.down, nullptr, tmp, E);
#pragma omp for schedule(static)
            for (int r = 0; r < N; r++) {
                T* hr = h + (size_t)r * E;
                add_into(hr, tmp + (size_t)r * E, E);
                if (L.hidden_out) std::memcpy((T*)L.hidden_out + (size_t)r * E, hr, E * sizeof(T));
            }
        }
#pragma omp for schedule(static)
        for (int r = 0; r < N; r++) {
            if (f.final_norm) rms_norm(h + (size_t)r * E, (const T*)f.final_norm, f.eps, E, (T*)f.out + (size_t)r * E);
            else std::memcpy((T*)f.out + (size_t)r * E, h + (size_t)r * E, E * sizeof(T));
        }
        delete[] scores;
    }
}

template <typename T>
void pack(const T* W, T* P, int N, int K) {
    for (int s = 0; s < N / LANES; s++)
        for (int k = 0; k < K; k += ks<T>())
            for (int l = 0; l < LANES; l++)
                for (int e = 0; e < ks<T>(); e++)
                    P[((size_t)s * K + k) * LANES + l * ks<T>() + e] = W[((size_t)s * LANES + l) * K + k + e];
}

}  // namespace

extern "C" {

// What a weight must be to pack: rows a multiple of this, columns a multiple of hs_chunk(dtype).
int hs_rows_multiple() { return LANES; }
int hs_chunk(int dtype) { return dtype == 1 ? ks<bf16>() : ks<float>(); }
size_t hs_sizeof_forward() { return sizeof(Forward); }
size_t hs_sizeof_layer() { return sizeof(Layer); }

void hs_pack(int dtype, const void* W, void* P, int N, int K) {
    if (dtype == 1) pack<bf16>((const bf16*)W, (bf16*)P, N, K);
    else pack<float>((const float*)W, (float*)P, N, K);
}

// y (M, N) = x (M, K) . W^T + bias, W packed by hs_pack.
void hs_linear(int dtype, const void* x, int M, int K, const void* P, const void* bias, void* y, int N, int threads) {
#pragma omp parallel num_threads(threads)
    {
        if (dtype == 1) gemm<bf16>((const bf16*)x, M, K, (const bf16*)P, (const bf16*)bias, (bf16*)y, N);
        else gemm<float>((const float*)x, M, K, (const float*)P, (const float*)bias, (float*)y, N);
    }
}

size_t hs_workspace_bytes(int dtype, int N, int hidden, int heads, int kv_heads, int head_dim, int intermediate) {
    const size_t elems = (size_t)N * (2 * hidden + (heads + 2 * kv_heads) * head_dim + 2 * heads * head_dim +
                                      3 * intermediate);
    return elems * (dtype == 1 ? 2 : 4);
}

void hs_forward(const Forward* f) {
    if (f->dtype == 1) run<bf16>(*f);
    else run<float>(*f);
}

}  // extern "C"
