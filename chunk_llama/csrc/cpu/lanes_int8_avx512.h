// Integer lanes for the int8-activation linear layers (quant_act.h) on AVX-512 with VNNI:
// sixteen int32 lanes of a ZMM register, each the dot product of four unsigned weight
// codes and four signed activations (vpdpbusd: exact, no 16-bit intermediate). Included by
// kernel_avx512.cpp inside a target region that adds avx512bw, avx512vl and avx512vnni,
// after lanes_avx512.h; the variant runs it only where the CPU has them (variants.h).
//
// The integer lane API (the same in every lanes_int8_<isa>.h):
//   IVec                         kLanes int32 lanes (4 * kLanes bytes)
//   iset1(v), iload(p), istore(p, a)
//   idot<kMaxCode, kSteps>(acc, u, s)  lane i: acc + sum over steps t < kSteps and j < 4 of
//                                u[t][4i + j] * s[4t + j]: u unsigned codes up to kMaxCode (at
//                                most 255), s int8 in [-127, 127] (each step's 4 to every lane);
//                                exact
//   idot16<kMaxCode, kSteps>(acc, u, lo, hi)  idot against lo plus 255 times idot against hi (int16
//                                activations' halves, one row's: the lanes may run the two side by side)
//   keep_in_register(v)          a Vec (the lane API's float vector) held in a register here, where the
//                                lanes need it (AVX2), else nothing
//   iwdot(acc, w, s)             lane i: acc + w[2i] * s[0] + w[2i + 1] * s[1], w's 16-bit codes
//                                (below 256) and s int16 (the int16 tile's word products); exact
//   kWordTiles                   whether int16 tiles take every format's codes as words (iwdot), or
//                                only those with two scales a group (quant_act.h's kInt16Words)
//   kIdotSteps                   steps per idot call in the prefill tile: 1 where a step is one
//                                instruction (the tile interleaves its sums step by step), else 8
//   kFewRowsMax                  rows up to which a step runs in registers (int8_few_rows), not tiles
//   IRun, kRunSteps<kMaxCode>    a run of one row's int16 steps (quant_act_row.h): irun_first(u, lo, hi)
//                                starts it with a step (u: a step's codes, lo and hi: its 4 activations'
//                                halves), irun_next(run, u, lo, hi) adds one, irun_end(acc, run) is acc plus
//                                its exact sum against lo + 255 hi; at most kRunSteps steps a run
//   kStreamedRow                 whether one int16 row on tiled K-quants is streamed (quant_act_row.h)
//   vround_even(a)               each float rounded to the nearest integer, ties to even (as the quantize_ ones)
//   kScalesAhead                 whether a Q4_K/Q5_K super-block's 8 scales and offsets are made before its
//                                groups' products, or each group's where it is used (quant_act_decode.h)
//   icvt(a)                      int32 -> float, exactly (|a| < 2^24)
//   quantize_store(p, a)         kLanes floats rounded to nearest even, stored as int8
//   quantize_words(p, a)         kLanes floats (|a| <= 32385.5) rounded to nearest even, as int16
//   quantize_split(hi, lo, a)    kLanes floats (|a| <= 32385.5) rounded to nearest even, q, stored
//                                as two int8 halves: hi = q / 255 rounded to nearest, lo = q - 255 hi
//   iadd(a, b), imul255(a)       int32 lane sum, a * 255
//   itranspose8(rows, stride, out)  8 dwords at rows + c * stride for each of kLanes rows ->
//                                out[s] (s < 8): dword s of row c in lane c
//   igather(base, offsets)       lane c: the dword at base + offsets[c] (any alignment)
//   iand, ior, ixor, ibytes(v)   bitwise; every byte v
//   ishr8(a, n), ishl8(a, n)     each byte shifted (logical; the bits leaving the byte dropped)
//   ishr32, ishl32, isra32, imul32  int32 lane shifts (logical, arithmetic), low product
//   ihalf_lo(a)                  the fp16 in each lane's low 16 bits, as a float
//   ihalves(p)                   kLanes fp16 at p, as floats
#pragma once

namespace chunk_attn_cpu {
namespace avx512 {

struct IVec {
  __m512i v;
};

constexpr int kIdotSteps = 1;  // (a step is one vpdpbusd)
// int16 tiles multiply 16-bit codes (vpdpwssd) only for formats with two scales a group (Q6_K: 13%
// faster); with one, the halves' two fused vpdpbusd on bytes ran 5% faster (docs/BENCHMARKS.md)
constexpr bool kWordTiles = false;
// A step's rows up to this many run in registers (quant_act.h's int8_few_rows), kI8Rows at a time on
// each column vector while it is in L1/L2, each group decoded again for each kI8Rows rows; beyond, an
// item is decoded once into a buffer for its tiles. In registers 1.65x faster at 5 rows, 1.1-1.2x at 16,
// 1.1x slower at 24 (docs/BENCHMARKS.md).
constexpr int kFewRowsMax = 16;
// Q4_K/Q5_K super-blocks' scales made where each group uses them, not all 8 first: the 16 vectors
// left free for the products ran one row 0.5-8% faster from memory, where AVX2 (16 registers) ran
// 0.3-6% slower (docs/BENCHMARKS.md)
constexpr bool kScalesAhead = false;
inline IVec iset1(int32_t v) { return {_mm512_set1_epi32(v)}; }
inline IVec iload(const void* p) { return {_mm512_loadu_si512(p)}; }
inline void istore(void* p, IVec a) { _mm512_storeu_si512(p, a.v); }
template <int kMaxCode, int kSteps>
inline IVec idot(IVec acc, const IVec* u, const int8_t* s) {
  for (int t = 0; t < kSteps; ++t) {
    int32_t four;
    std::memcpy(&four, s + 4 * t, sizeof four);
    acc.v = _mm512_dpbusd_epi32(acc.v, u[t].v, _mm512_set1_epi32(four));
  }
  return acc;
}
inline IVec iwdot(IVec acc, IVec w, const int16_t* s) {
  int32_t two;
  std::memcpy(&two, s, sizeof two);
  return {_mm512_dpwssd_epi32(acc.v, w.v, _mm512_set1_epi32(two))};
}
inline Vec icvt(IVec a) { return {_mm512_cvtepi32_ps(a.v)}; }
inline void quantize_store(int8_t* p, Vec a) {  // (vcvtps2dq rounds to nearest even; the values fit int8)
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(a.v)));
}
inline Vec vround_even(Vec a) { return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
inline void quantize_words(int16_t* p, Vec a) {  // (the values fit int16)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(a.v)));
}

inline IVec iadd(IVec a, IVec b) { return {_mm512_add_epi32(a.v, b.v)}; }
inline IVec imul255(IVec a) { return {_mm512_sub_epi32(_mm512_slli_epi32(a.v, 8), a.v)}; }
template <int kMaxCode, int kSteps>
inline IVec idot16(IVec acc, const IVec* u, const int8_t* lo, const int8_t* hi) {
  return iadd(idot<kMaxCode, kSteps>(acc, u, lo), imul255(idot<kMaxCode, kSteps>(iset1(0), u, hi)));
}
constexpr bool kStreamedRow = true;  // (quant_act_row.h: two groups side by side, 2% faster from memory, 6-12% slower in cache)
#include "lanes_int8_runs.h"
inline void keep_in_register(Vec&) {}
// (q / 255 is never within 1 / 510 of a tie, so q * (1 / 255), off by less than 2^-16, rounds as it)
inline void quantize_split(int8_t* hi, int8_t* lo, Vec a) {
  const __m512i q = _mm512_cvtps_epi32(a.v);
  const __m512i high = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_cvtepi32_ps(q), _mm512_set1_ps(1.f / 255.f)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(hi), _mm512_cvtepi32_epi8(high));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(lo),
                   _mm512_cvtepi32_epi8(_mm512_sub_epi32(q, imul255({high}).v)));
}

// Indices of the three levels of itranspose8 (16 rows x 8 dwords; see there).
struct TransposeIndex {
  int32_t level[3][2][16];
};
constexpr TransposeIndex make_transpose_index() {
  TransposeIndex t{};
  for (int half = 0; half < 2; ++half)
    for (int k = 0; k < 16; ++k) {
      // level 1: 4 rows (2 from each input) x 4 steps (half: steps 0-3 or 4-7)
      const int row1 = k / 4;
      t.level[0][half][k] = (row1 < 2 ? 0 : 16) + (row1 % 2) * 8 + 4 * half + k % 4;
      // level 2: 8 rows (4 from each) x 2 steps (half: the first or second pair of 4)
      const int row2 = k / 2;
      t.level[1][half][k] = (row2 < 4 ? 0 : 16) + (row2 % 4) * 4 + 2 * half + k % 2;
      // level 3: 16 rows (8 from each) x 1 step (half: the first or second of 2)
      t.level[2][half][k] = (k < 8 ? 0 : 16) + (k % 8) * 2 + half;
    }
  return t;
}
alignas(64) static constexpr TransposeIndex kTransposeIndex = make_transpose_index();

inline void itranspose8(const uint8_t* rows, int64_t stride, IVec* out) {
  __m512i a[8], b[8], c[8];
  for (int p = 0; p < 8; ++p)  // rows 2p, 2p + 1
    a[p] = _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows + 2 * p * stride))),
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows + (2 * p + 1) * stride)), 1);
  const auto pair = [](__m512i x, __m512i y, const int32_t* lo, const int32_t* hi, __m512i* to_lo, __m512i* to_hi) {
    *to_lo = _mm512_permutex2var_epi32(x, _mm512_load_si512(lo), y);
    *to_hi = _mm512_permutex2var_epi32(x, _mm512_load_si512(hi), y);
  };
  const auto& t = kTransposeIndex.level;
  for (int i = 0; i < 4; ++i)  // b[4 h + i]: rows 4i .. 4i + 3, steps 4h .. 4h + 3
    pair(a[2 * i], a[2 * i + 1], t[0][0], t[0][1], &b[i], &b[4 + i]);
  for (int h = 0; h < 2; ++h)  // c[2 sp + q]: rows 8q .. 8q + 7, steps 2sp, 2sp + 1
    for (int q = 0; q < 2; ++q)
      pair(b[4 * h + 2 * q], b[4 * h + 2 * q + 1], t[1][0], t[1][1], &c[(2 * h) * 2 + q], &c[(2 * h + 1) * 2 + q]);
  for (int sp = 0; sp < 4; ++sp)  // all 16 rows, steps 2sp and 2sp + 1
    pair(c[2 * sp], c[2 * sp + 1], t[2][0], t[2][1], &out[2 * sp].v, &out[2 * sp + 1].v);
}
inline IVec igather(const uint8_t* base, IVec offsets) { return {_mm512_i32gather_epi32(offsets.v, base, 1)}; }
inline IVec iand(IVec a, IVec b) { return {_mm512_and_si512(a.v, b.v)}; }
inline IVec ior(IVec a, IVec b) { return {_mm512_or_si512(a.v, b.v)}; }
inline IVec ixor(IVec a, IVec b) { return {_mm512_xor_si512(a.v, b.v)}; }
inline IVec ibytes(uint8_t v) { return {_mm512_set1_epi8(static_cast<char>(v))}; }
inline IVec ishr8(IVec a, int n) {
  return {_mm512_and_si512(_mm512_srli_epi16(a.v, n), _mm512_set1_epi8(static_cast<char>(0xFF >> n)))};
}
inline IVec ishl8(IVec a, int n) {
  return {_mm512_and_si512(_mm512_slli_epi16(a.v, n), _mm512_set1_epi8(static_cast<char>((0xFF << n) & 0xFF)))};
}
inline IVec ishr32(IVec a, int n) { return {_mm512_srli_epi32(a.v, n)}; }
inline IVec ishl32(IVec a, int n) { return {_mm512_slli_epi32(a.v, n)}; }
inline IVec isra32(IVec a, int n) { return {_mm512_srai_epi32(a.v, n)}; }
inline IVec imul32(IVec a, IVec b) { return {_mm512_mullo_epi32(a.v, b.v)}; }
inline Vec ihalf_lo(IVec a) { return {_mm512_cvtph_ps(_mm512_cvtepi32_epi16(a.v))}; }
inline Vec ihalves(const uint8_t* p) { return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))}; }

}  // namespace avx512
}  // namespace chunk_attn_cpu
