// Sixteen fp32 lanes: AVX-512 registers where the compiler targets them, plain arrays
// otherwise, so the kernel in tpp_cpu.h is written once. Storage is fp32 or bf16 (raw
// uint16); all math is fp32.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace chunk_attn_cpu {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kLog2e = 1.44269504088896341f;

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const uint16_t* p, int64_t i) {
  uint32_t bits = static_cast<uint32_t>(p[i]) << 16;
  float x;
  std::memcpy(&x, &bits, sizeof(x));
  return x;
}
inline void store(float* p, int64_t i, float x) { p[i] = x; }
inline void store(uint16_t* p, int64_t i, float x) {  // round to nearest even
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  bits += 0x7fffu + ((bits >> 16) & 1u);
  p[i] = static_cast<uint16_t>(bits >> 16);
}

// 2^x for x <= 0 (softmax weights in the log2 domain): x = n + f with n = round(x),
// |f| <= 1/2, 2^f by a degree-6 Taylor polynomial in f ln 2 (relative error ~1e-7).
// Below -150 the result is exactly 0, which is also what 2^-inf must give.
constexpr float kExp2Coef[7] = {1.0f, 0.693147181f, 0.240226507f, 0.0555041087f, 0.00961812911f,
                                0.00133335581f, 0.000154035304f};

inline float exp2_scalar(float x) {
  x = std::max(x, -150.0f);
  const float n = std::nearbyint(x), f = x - n;
  float poly = kExp2Coef[6];
  for (int i = 5; i >= 0; --i) poly = poly * f + kExp2Coef[i];
  return std::ldexp(poly, static_cast<int>(n));
}

#ifdef __AVX512F__
struct V16 {
  __m512 v;
};
inline V16 vload(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void vstore(float* p, V16 a) { _mm512_storeu_ps(p, a.v); }
inline V16 vset1(float x) { return {_mm512_set1_ps(x)}; }
inline V16 vfma(V16 a, V16 b, V16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline V16 vmul(V16 a, V16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline V16 vadd(V16 a, V16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline V16 vsub(V16 a, V16 b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline V16 vmax(V16 a, V16 b) { return {_mm512_max_ps(a.v, b.v)}; }
inline float vsum(V16 a) { return _mm512_reduce_add_ps(a.v); }
inline float vmax_lane(V16 a) { return _mm512_reduce_max_ps(a.v); }
// Keeps a loaded vector in a register: without it GCC folds the load into every FMA
// that uses it, and the loads, not the FMAs, bound the loop.
inline void vpin(V16& a) { asm("" : "+v"(a.v)); }
// Permutation indices for vsum16: at level l (item width 16 >> l) output lane t takes
// lanes lo and hi (the two halves of one item's segment) of the pair (x, y), where
// index 16 + i means lane i of y.
struct SumIndex {
  int32_t lo[4][16], hi[4][16];
};
constexpr SumIndex make_sum_index() {
  SumIndex r{};
  for (int level = 0, width = 16; level < 4; ++level, width /= 2)
    for (int lane = 0; lane < 16; ++lane) {
      const int half = width / 2, item = lane / half, per_vector = 16 / width;
      r.lo[level][lane] = (item >= per_vector ? 16 : 0) + (item % per_vector) * width + lane % half;
      r.hi[level][lane] = r.lo[level][lane] + half;
    }
  return r;
}
inline constexpr SumIndex kSumIndex = make_sum_index();

// x[16] -> lane j holds the sum of x[j]'s lanes (x is overwritten): four levels that
// each add the two halves of every item's segment, pairing neighbours to keep order.
inline V16 vsum16(V16* x) {
#pragma GCC unroll 4
  for (int level = 0, num = 16; level < 4; ++level, num /= 2) {
    const __m512i lo = _mm512_loadu_si512(kSumIndex.lo[level]), hi = _mm512_loadu_si512(kSumIndex.hi[level]);
#pragma GCC unroll 8
    for (int i = 0; i < num / 2; ++i)
      x[i].v = _mm512_add_ps(_mm512_permutex2var_ps(x[2 * i].v, lo, x[2 * i + 1].v),
                             _mm512_permutex2var_ps(x[2 * i].v, hi, x[2 * i + 1].v));
  }
  return x[0];
}
inline V16 vexp2(V16 x) {
  const __m512 xc = _mm512_max_ps(x.v, _mm512_set1_ps(-150.0f));
  const __m512 n = _mm512_roundscale_ps(xc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(xc, n);
  __m512 poly = _mm512_set1_ps(kExp2Coef[6]);
  for (int i = 5; i >= 0; --i) poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(kExp2Coef[i]));
  return {_mm512_scalef_ps(poly, n)};
}
#else
struct V16 {
  float v[16];
};
inline V16 vload(const float* p) {
  V16 r;
  std::memcpy(r.v, p, sizeof(r.v));
  return r;
}
inline void vstore(float* p, V16 a) { std::memcpy(p, a.v, sizeof(a.v)); }
inline V16 vset1(float x) {
  V16 r;
  for (float& lane : r.v) lane = x;
  return r;
}
#define CHUNK_ATTN_LANEWISE(name, expr)          \
  inline V16 name(V16 a, V16 b) {                \
    V16 r;                                       \
    for (int i = 0; i < 16; ++i) r.v[i] = expr;  \
    return r;                                    \
  }
CHUNK_ATTN_LANEWISE(vmul, a.v[i] * b.v[i])
CHUNK_ATTN_LANEWISE(vadd, a.v[i] + b.v[i])
CHUNK_ATTN_LANEWISE(vsub, a.v[i] - b.v[i])
CHUNK_ATTN_LANEWISE(vmax, std::max(a.v[i], b.v[i]))
#undef CHUNK_ATTN_LANEWISE
inline V16 vfma(V16 a, V16 b, V16 c) {
  for (int i = 0; i < 16; ++i) c.v[i] += a.v[i] * b.v[i];
  return c;
}
inline float vsum(V16 a) {
  float s = 0.f;
  for (float lane : a.v) s += lane;
  return s;
}
inline float vmax_lane(V16 a) { return *std::max_element(a.v, a.v + 16); }
inline void vpin(V16&) {}
inline V16 vsum16(V16* x) {
  V16 r;
  for (int j = 0; j < 16; ++j) r.v[j] = vsum(x[j]);
  return r;
}
inline V16 vexp2(V16 x) {
  for (float& lane : x.v) lane = exp2_scalar(lane);
  return x;
}
#endif

}  // namespace chunk_attn_cpu
