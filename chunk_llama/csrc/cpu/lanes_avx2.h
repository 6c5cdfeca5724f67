// Lanes for AVX2 + FMA: eight fp32 lanes in a YMM register, sixteen registers.
// The lane API (the same in every lanes_<isa>.h) is described in lanes_generic.h.
// Included by kernel_avx2.cpp after its target pragma; <immintrin.h> comes before it.
#pragma once

namespace chunk_attn_cpu {
namespace avx2 {

constexpr int kLanes = 8;
// Register tiles for 16 YMM registers.
//   phase 1, S^T = K Q^T: a tile of 8 rows against one key: 8 accumulators + a K vector.
//   phase 1, O^T = V^T P^T: 4 dims x 3 row vectors: 12 + 3 P^T vectors + 1 broadcast (2 row
//     vectors, 8 accumulators, ran the decode's shared blocks and the prefill 7-11% slower).
//   phase 2, O += p V: 3 heads x 4 dim vectors, plus 3 broadcasts and a V vector: 12 + 3 + 1.
constexpr int kRowVecs = 3;
constexpr int kPvDims = 4;
constexpr int kSeqHeads = 3, kSeqPvVecs = 4;

struct Vec {
  __m256 v;
};

inline Vec vzero() { return {_mm256_setzero_ps()}; }
inline Vec vset1(float x) { return {_mm256_set1_ps(x)}; }
inline Vec vload(const float* p) { return {_mm256_loadu_ps(p)}; }
inline Vec vload(const uint16_t* p) {  // bf16: widen to 32 bits, then into the high half
  const __m256i x = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(x, 16))};
}
inline void vstore(float* p, Vec a) { _mm256_storeu_ps(p, a.v); }
inline void vstore(uint16_t* p, Vec a) {  // round to nearest even, keep the high halves
  __m256i bits = _mm256_castps_si256(a.v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  bits = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
  // each 32-bit lane now holds a value below 2^16: packing with unsigned saturation is exact
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}
inline Vec vload(const Half* p) {  // (F16C)
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))};
}
inline Vec vadd(Vec a, Vec b) { return {_mm256_add_ps(a.v, b.v)}; }
inline Vec vhalf(const uint8_t* p) {  // every lane: the fp16 at p (F16C)
  uint16_t h;
  std::memcpy(&h, p, sizeof h);
  return {_mm256_cvtph_ps(_mm_set1_epi16(static_cast<short>(h)))};
}
inline float half_to_float(const uint8_t* p) {  // the fp16 at p (F16C: a subnormal half costs no assist)
  uint16_t h;
  std::memcpy(&h, p, sizeof h);
  return _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h)));
}
inline Vec vhalves(const uint8_t* p) {  // lane i: the fp16 at p + 2i (F16C)
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))};
}
inline void vbytes16(uint64_t low, uint64_t high, float* out) {  // (in registers: no store to reload)
  _mm256_storeu_ps(out, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<long long>(low)))));
  _mm256_storeu_ps(out + 8, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<long long>(high)))));
}
inline void vscaled_nibbles(const uint8_t* p, float bias, Vec scale, Vec* low, Vec* high) {
  const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));  // both halves
  low->v = _mm256_cvtepi32_ps(_mm256_and_si256(bytes, _mm256_set1_epi32(0xF)));
  high->v = _mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4));
  if (bias != 0.f) {
    low->v = _mm256_add_ps(low->v, _mm256_set1_ps(bias));
    high->v = _mm256_add_ps(high->v, _mm256_set1_ps(bias));
  }
  low->v = _mm256_mul_ps(low->v, scale.v);
  high->v = _mm256_mul_ps(high->v, scale.v);
}
inline Vec vq6k(const uint8_t* low, int low_shift, const uint8_t* high, int high_shift) {
  // the two fields joined as integers: one conversion
  const __m256i l = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(low)));
  const __m256i h = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(high)));
  const __m256i q = _mm256_or_si256(
      _mm256_and_si256(_mm256_srl_epi32(l, _mm_cvtsi32_si128(low_shift)), _mm256_set1_epi32(15)),
      _mm256_slli_epi32(_mm256_and_si256(_mm256_srl_epi32(h, _mm_cvtsi32_si128(high_shift)), _mm256_set1_epi32(3)),
                        4));
  return {_mm256_cvtepi32_ps(_mm256_sub_epi32(q, _mm256_set1_epi32(32)))};
}
inline Vec vnibbles5k(const uint8_t* p, int shift, const uint8_t* bits, int bit, Vec scale) {
  // the fifth bit joins the nibble as integers: one conversion, one product
  const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i fifth = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bits)));
  const __m256i q = _mm256_or_si256(
      _mm256_and_si256(_mm256_srl_epi32(bytes, _mm_cvtsi32_si128(shift)), _mm256_set1_epi32(15)),
      _mm256_slli_epi32(_mm256_and_si256(_mm256_srl_epi32(fifth, _mm_cvtsi32_si128(bit)), _mm256_set1_epi32(1)), 4));
  return {_mm256_mul_ps(_mm256_cvtepi32_ps(q), scale.v)};
}
inline void vnibbles5(const uint8_t* p, uint32_t bits, int first, float bias, Vec* low, Vec* high) {
  // each lane's fifth bit joins its nibble as integers: one conversion per vector
  const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i all = _mm256_set1_epi32(static_cast<int>(bits)), lanes = _mm256_set_epi32(7, 6, 5, 4, 3, 2, 1, 0);
  const auto fifth = [&](int from) {  // lane i: bit from + i, as 16
    return _mm256_slli_epi32(
        _mm256_and_si256(_mm256_srlv_epi32(all, _mm256_add_epi32(lanes, _mm256_set1_epi32(from))),
                         _mm256_set1_epi32(1)),
        4);
  };
  const __m256 b = _mm256_set1_ps(bias);
  low->v = _mm256_add_ps(
      _mm256_cvtepi32_ps(_mm256_or_si256(_mm256_and_si256(bytes, _mm256_set1_epi32(0xF)), fifth(first))), b);
  high->v = _mm256_add_ps(_mm256_cvtepi32_ps(_mm256_or_si256(_mm256_srli_epi32(bytes, 4), fifth(first + 16))), b);
}
inline Vec vint8(const int8_t* p) {
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))))};
}
inline Vec vsub(Vec a, Vec b) { return {_mm256_sub_ps(a.v, b.v)}; }
inline Vec vmul(Vec a, Vec b) { return {_mm256_mul_ps(a.v, b.v)}; }
inline Vec vdiv(Vec a, Vec b) { return {_mm256_div_ps(a.v, b.v)}; }
inline Vec vmax(Vec a, Vec b) { return {_mm256_max_ps(a.v, b.v)}; }
inline Vec vfma(Vec a, Vec b, Vec c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }

inline float vreduce_add(Vec a) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}
inline float vreduce_max(Vec a) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  x = _mm_max_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

// x[8] -> lane j holds the sum of x[j]'s lanes: two levels of pairwise horizontal
// adds within 128-bit halves, then the halves added across.
inline Vec vsum_lanes(Vec* x) {
  const __m256 h01 = _mm256_hadd_ps(x[0].v, x[1].v), h23 = _mm256_hadd_ps(x[2].v, x[3].v);
  const __m256 h45 = _mm256_hadd_ps(x[4].v, x[5].v), h67 = _mm256_hadd_ps(x[6].v, x[7].v);
  const __m256 lo4 = _mm256_hadd_ps(h01, h23);  // [x0..x3 of the low half | x0..x3 of the high half]
  const __m256 hi4 = _mm256_hadd_ps(h45, h67);
  return {_mm256_add_ps(_mm256_permute2f128_ps(lo4, hi4, 0x20), _mm256_permute2f128_ps(lo4, hi4, 0x31))};
}

inline Vec vexp2(Vec x) {  // see exp2_scalar: the same steps, lane by lane
  const __m256 xc = _mm256_max_ps(x.v, _mm256_set1_ps(kExp2Min));
  const __m256 n = _mm256_round_ps(xc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(xc, n);
  __m256 poly = _mm256_set1_ps(kExp2Coef[6]);
  for (int i = 5; i >= 0; --i) poly = _mm256_fmadd_ps(poly, f, _mm256_set1_ps(kExp2Coef[i]));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return {_mm256_mul_ps(poly, _mm256_castsi256_ps(bits))};
}

// Keeps a loaded vector in a register: without it GCC folds the load into every FMA
// that uses it, and the loads, not the FMAs, bound the loop.
inline void vpin(Vec& a) { asm("" : "+x"(a.v)); }

}  // namespace avx2
}  // namespace chunk_attn_cpu
