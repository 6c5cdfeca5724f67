// Lanes for AVX-512 (F): sixteen fp32 lanes in a ZMM register, thirty-two registers.
// The lane API (the same in every lanes_<isa>.h) is described in lanes_generic.h.
// Included by kernel_avx512.cpp after its target pragma; <immintrin.h> comes before it.
#pragma once

namespace chunk_attn_cpu {
namespace avx512 {

constexpr int kLanes = 16;
// Register tiles for 32 ZMM registers.
//   phase 1, S^T = K Q^T: a tile of 16 rows against one key: 16 accumulators + a K vector.
//   phase 1, O^T = V^T P^T: 8 dims x 2 row vectors: 16 + 2 P^T vectors + 1 broadcast.
//   phase 2, O += p V: 4 heads x 4 dim vectors, plus 4 broadcasts and a V vector: 16 + 4 + 1.
constexpr int kRowVecs = 2;
constexpr int kPvDims = 8;
constexpr int kSeqHeads = 4, kSeqPvVecs = 4;

struct Vec {
  __m512 v;
};

inline Vec vzero() { return {_mm512_setzero_ps()}; }
inline Vec vset1(float x) { return {_mm512_set1_ps(x)}; }
inline Vec vload(const float* p) { return {_mm512_loadu_ps(p)}; }
inline Vec vload(const uint16_t* p) {  // bf16: widen to 32 bits, then into the high half
  const __m512i x = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(x, 16))};
}
inline void vstore(float* p, Vec a) { _mm512_storeu_ps(p, a.v); }
inline void vstore(uint16_t* p, Vec a) {  // round to nearest even, keep the high halves
  __m512i bits = _mm512_castps_si512(a.v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  bits = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bits));  // truncation is exact
}
inline Vec vload(const Half* p) { return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))}; }
inline Vec vadd(Vec a, Vec b) { return {_mm512_add_ps(a.v, b.v)}; }
inline float half_to_float(const uint8_t* p) {  // the fp16 at p (F16C: a subnormal half costs no assist)
  uint16_t h;
  std::memcpy(&h, p, sizeof h);
  return _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h)));
}
inline Vec vhalf(const uint8_t* p) {  // every lane: the fp16 at p (converted once, then broadcast)
  return {_mm512_set1_ps(half_to_float(p))};
}
inline Vec vhalves(const uint8_t* p) {  // lane i: the fp16 at p + 2i
  return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
}
// The nibbles' entries of a 16-entry table (one load for both halves): vpermps reads each
// index's low 4 bits, so the low nibble needs no mask and neither half a conversion.
inline void nibble_lookup(const uint8_t* p, __m512 table, __m512* low, __m512* high) {
  const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  *low = _mm512_permutexvar_ps(bytes, table);
  *high = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
}
inline __m512 nibble_values(float bias) {  // lane n: n + bias
  const __m512 values = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  return bias == 0.f ? values : _mm512_add_ps(values, _mm512_set1_ps(bias));
}
inline void vbytes16(uint64_t low, uint64_t high, float* out) {  // (in registers: no store to reload)
  _mm512_storeu_ps(out, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                            _mm_set_epi64x(static_cast<long long>(high), static_cast<long long>(low)))));
}
inline void vscaled_nibbles(const uint8_t* p, float bias, Vec scale, Vec* low, Vec* high) {
  // the table scaled once (16 products, each the one a lane would compute), not each vector
  nibble_lookup(p, _mm512_mul_ps(nibble_values(bias), scale.v), &low->v, &high->v);
}
inline Vec vq6k(const uint8_t* low, int low_shift, const uint8_t* high, int high_shift) {
  // both fields from tables (vpermps reads the low 4 bits of an index: no masks, no
  // conversions), -32 folded into the first: the sum of two small integers, exact
  const __m512 lows = _mm512_set_ps(-17, -18, -19, -20, -21, -22, -23, -24, -25, -26, -27, -28, -29, -30, -31, -32);
  const __m512 highs = _mm512_set_ps(48, 32, 16, 0, 48, 32, 16, 0, 48, 32, 16, 0, 48, 32, 16, 0);  // 16 (k & 3)
  const __m512i l = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(low)));
  const __m512i h = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(high)));
  return {_mm512_add_ps(_mm512_permutexvar_ps(_mm512_srl_epi32(l, _mm_cvtsi32_si128(low_shift)), lows),
                        _mm512_permutexvar_ps(_mm512_srl_epi32(h, _mm_cvtsi32_si128(high_shift)), highs))};
}
inline Vec vnibbles5k(const uint8_t* p, int shift, const uint8_t* bits, int bit, Vec scale) {
  // two 16-entry tables scaled once ((0..15) * scale and (16..31) * scale, each entry the
  // product a lane would compute); the fifth bit picks the second under a mask made with a
  // byte shift and movemask: two lookups, against a field's shift, mask and conversion, a
  // multiply and two adds per vector (one lookup in a 32-entry table, vpermt2ps, was slower:
  // its index needs the nibble masked and the bit or'd in)
  const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m128i fifth = _mm_sll_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bits)),
                                      _mm_cvtsi32_si128(7 - bit));  // bit `bit` of byte i to its bit 7
  const uint16_t high = static_cast<uint16_t>(_mm_movemask_epi8(fifth));  // (a __mmask16)
  const __m512i index = _mm512_srl_epi32(bytes, _mm_cvtsi32_si128(shift));  // (vpermps reads its low 4 bits)
  const __m512 values = nibble_values(0.f);
  const __m512 low = _mm512_permutexvar_ps(index, _mm512_mul_ps(values, scale.v));
  return {_mm512_mask_permutexvar_ps(low, high, index, _mm512_mul_ps(_mm512_add_ps(values, _mm512_set1_ps(16.f)),
                                                                      scale.v))};
}
inline void vnibbles5(const uint8_t* p, uint32_t bits, int first, float bias, Vec* low, Vec* high) {
  // the nibbles from a table (biased, not scaled); each lane's fifth bit is a mask bit
  // already: adding 16 under it is one operation (against a shift, mask, conversion,
  // multiply and add per vector)
  const __m512 sixteen = _mm512_set1_ps(16.f);
  __m512 l, h;
  nibble_lookup(p, nibble_values(bias), &l, &h);
  low->v = _mm512_mask_add_ps(l, static_cast<uint16_t>(bits >> first), l, sixteen);
  high->v = _mm512_mask_add_ps(h, static_cast<uint16_t>(bits >> (first + 16)), h, sixteen);
}
inline Vec vint8(const int8_t* p) {
  return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
}
inline Vec vsub(Vec a, Vec b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline Vec vmul(Vec a, Vec b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline Vec vdiv(Vec a, Vec b) { return {_mm512_div_ps(a.v, b.v)}; }
inline Vec vmax(Vec a, Vec b) { return {_mm512_max_ps(a.v, b.v)}; }
inline Vec vfma(Vec a, Vec b, Vec c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline float vreduce_add(Vec a) { return _mm512_reduce_add_ps(a.v); }
inline float vreduce_max(Vec a) { return _mm512_reduce_max_ps(a.v); }

// Permutation indices for vsum_lanes: at level l (item width 16 >> l) output lane t
// takes lanes lo and hi (the two halves of one item's segment) of the pair (x, y),
// where index 16 + i means lane i of y.
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
alignas(64) static constexpr SumIndex kSumIndex = make_sum_index();

// x[16] -> lane j holds the sum of x[j]'s lanes (x is overwritten): four levels that
// each add the two halves of every item's segment, pairing neighbours to keep order.
inline Vec vsum_lanes(Vec* x) {
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

inline Vec vexp2(Vec x) {  // see exp2_scalar: the same steps, lane by lane
  const __m512 xc = _mm512_max_ps(x.v, _mm512_set1_ps(kExp2Min));
  const __m512 n = _mm512_roundscale_ps(xc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(xc, n);
  __m512 poly = _mm512_set1_ps(kExp2Coef[6]);
  for (int i = 5; i >= 0; --i) poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(kExp2Coef[i]));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return {_mm512_mul_ps(poly, _mm512_castsi512_ps(bits))};
}

// Keeps a loaded vector in a register: without it GCC folds the load into every FMA
// that uses it, and the loads, not the FMAs, bound the loop. (SIMDe's emulated
// registers, see kernel_avx512.cpp, are no register operand: a no-op there.)
#ifdef CHUNK_ATTN_EMULATE_AVX512
inline void vpin(Vec&) {}
#else
inline void vpin(Vec& a) { asm("" : "+v"(a.v)); }
#endif

}  // namespace avx512
}  // namespace chunk_attn_cpu
