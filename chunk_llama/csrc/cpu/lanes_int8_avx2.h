// Integer lanes for the int8-activation linear layers (quant_act.h) on AVX2: eight int32
// lanes of a YMM register. No VNNI here: vpmaddubsw multiplies the unsigned codes by the
// signed activations into pairs of 16 bits (which saturate beyond 32,767: exact for codes
// up to 127 against |s| <= 127), vpmaddwd with ones widens the pairs to 32 bits. Small codes
// add several steps' pairs in 16 bits before one widening (as many as cannot reach 32,767:
// codes up to 15, 8 steps; 31, 4; 63, 2), which saves most of the widenings and adds, the
// port-bound part of a step (int16 activations' halves run two steps' worth per step; int16 tiles
// multiply words instead, iwdot). The lane API
// is listed in lanes_int8_avx512.h. Included by kernel_avx2.cpp after lanes_avx2.h.
#pragma once

namespace chunk_attn_cpu {
namespace avx2 {

struct IVec {
  __m256i v;
};

constexpr int kIdotSteps = 8;  // (small codes add several steps in 16 bits before one widening)
// int16 tiles multiply 16-bit codes by q (iwdot) for every format: one vpmaddwd and one add per two
// products, where the halves take two vpmaddubsw, their 16-bit adds and a combining step
constexpr bool kWordTiles = true;
// (lanes_int8_avx512.h) a tile's rows: in registers, equal at 5-6 rows, mixed at 8, 1.15-1.25x slower at 12-16
// than the word tiles
constexpr int kFewRowsMax = 4;
// Q4_K/Q5_K super-blocks' scales all made first (lanes_int8_avx512.h: made where used, 0.3-6% slower here)
constexpr bool kScalesAhead = true;
inline IVec iset1(int32_t v) { return {_mm256_set1_epi32(v)}; }
inline IVec iload(const void* p) { return {_mm256_loadu_si256(static_cast<const __m256i*>(p))}; }
inline void istore(void* p, IVec a) { _mm256_storeu_si256(static_cast<__m256i*>(p), a.v); }
inline __m256i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return _mm256_set1_epi32(v);
}
inline __m256i pairs_to_lanes(__m256i pairs) { return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)); }
template <int kMaxCode, int kSteps>
inline IVec idot(IVec acc, const IVec* u, const int8_t* s) {
  if constexpr (kMaxCode > 127) {  // codes up to 255: their low 7 bits and their top bit apart (each pair fits 16 bits)
    for (int t = 0; t < kSteps; ++t) {
      const __m256i low = _mm256_and_si256(u[t].v, _mm256_set1_epi8(0x7F));
      const __m256i top = _mm256_and_si256(u[t].v, _mm256_set1_epi8(static_cast<char>(0x80)));
      const __m256i x = broadcast4(s + 4 * t);
      acc.v = _mm256_add_epi32(acc.v, _mm256_add_epi32(pairs_to_lanes(_mm256_maddubs_epi16(low, x)),
                                                       pairs_to_lanes(_mm256_maddubs_epi16(top, x))));
    }
  } else {
    constexpr int kRun = 32767 / (2 * kMaxCode * 127);  // steps whose pairs' sum fits 16 bits
    static_assert(kRun >= 1, "a step's pairs must fit 16 bits");
    for (int t = 0; t < kSteps; t += kRun) {
      __m256i pairs = _mm256_maddubs_epi16(u[t].v, broadcast4(s + 4 * t));
      for (int k = 1; k < kRun && t + k < kSteps; ++k)
        pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(u[t + k].v, broadcast4(s + 4 * (t + k))));
      acc.v = _mm256_add_epi32(acc.v, pairs_to_lanes(pairs));
    }
  }
  return acc;
}
// One row's int16 sums (quant_act.h's group_fmas): both halves' steps side by side, each step's codes used
// by both at once, the high run widened by vpmaddwd with 255s (255 * high in the widening); held in L2,
// 10% more blocks a second than idot twice (docs/BENCHMARKS.md). Several rows' side by side spill.
template <int kMaxCode, int kSteps>
inline IVec idot16(IVec acc, const IVec* u, const int8_t* lo, const int8_t* hi) {
  if constexpr (kMaxCode > 127) {
    return iadd(idot<kMaxCode, kSteps>(acc, u, lo), imul255(idot<kMaxCode, kSteps>(iset1(0), u, hi)));
  } else {
    constexpr int kRun = 32767 / (2 * kMaxCode * 127);
    for (int t = 0; t < kSteps; t += kRun) {
      __m256i low = _mm256_maddubs_epi16(u[t].v, broadcast4(lo + 4 * t));
      __m256i high = _mm256_maddubs_epi16(u[t].v, broadcast4(hi + 4 * t));
      for (int k = 1; k < kRun && t + k < kSteps; ++k) {
        low = _mm256_add_epi16(low, _mm256_maddubs_epi16(u[t + k].v, broadcast4(lo + 4 * (t + k))));
        high = _mm256_add_epi16(high, _mm256_maddubs_epi16(u[t + k].v, broadcast4(hi + 4 * (t + k))));
      }
      acc.v = _mm256_add_epi32(acc.v, _mm256_add_epi32(pairs_to_lanes(low),
                                                       _mm256_madd_epi16(high, _mm256_set1_epi16(255))));
    }
  }
  return acc;
}
// A run of one row's int16 steps (quant_act_row.h): each half's pairs added in 16 bits, as idot16's runs
// (kRunSteps: as many steps as cannot reach 32,767), widened once at the run's end.
template <int kMaxCode>
constexpr int kRunSteps = 32767 / (2 * kMaxCode * 127);
constexpr bool kStreamedRow = true;  // (quant_act_row.h: two groups side by side spilled again, Q4_K 9% slower)
struct IRun {
  __m256i low, high;
};
template <int kMaxCode>
inline IRun irun_first(IVec u, const int8_t* lo, const int8_t* hi) {
  static_assert(kMaxCode <= 127, "a run's pairs must fit 16 bits");
  return {_mm256_maddubs_epi16(u.v, broadcast4(lo)), _mm256_maddubs_epi16(u.v, broadcast4(hi))};
}
template <int kMaxCode>
inline IRun irun_next(IRun run, IVec u, const int8_t* lo, const int8_t* hi) {
  IRun next{_mm256_add_epi16(run.low, _mm256_maddubs_epi16(u.v, broadcast4(lo))),
            _mm256_add_epi16(run.high, _mm256_maddubs_epi16(u.v, broadcast4(hi)))};
  __asm__("" : "+x"(next.low), "+x"(next.high));  // (each add in its chain, as iwdot's)
  return next;
}
inline IVec irun_end(IVec acc, IRun run) {
  return {_mm256_add_epi32(acc.v, _mm256_add_epi32(pairs_to_lanes(run.low),
                                                   _mm256_madd_epi16(run.high, _mm256_set1_epi16(255))))};
}
// (the row's float sum, which GCC otherwise kept on the stack: its chain a store and a load each group)
inline void keep_in_register(Vec& a) { __asm__("" : "+x"(a.v)); }
inline IVec iwdot(IVec acc, IVec w, const int16_t* s) {  // (vpmaddwd: exact, the codes below 256)
  int32_t two;
  std::memcpy(&two, s, sizeof two);
  __m256i sum = _mm256_add_epi32(acc.v, _mm256_madd_epi16(w.v, _mm256_set1_epi32(two)));
  // (an empty asm keeps each add in its chain: GCC otherwise reassociates a tile's unrolled exact
  // adds into a tree whose products it spills, 39% slower: docs/BENCHMARKS.md)
  __asm__("" : "+x"(sum));
  return {sum};
}
inline Vec icvt(IVec a) { return {_mm256_cvtepi32_ps(a.v)}; }
inline void quantize_store(int8_t* p, Vec a) {  // (vcvtps2dq rounds to nearest even; the values fit int8)
  const __m256i q = _mm256_cvtps_epi32(a.v);
  const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packs_epi16(words, words));
}
inline Vec vround_even(Vec a) { return {_mm256_round_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
inline void quantize_words(int16_t* p, Vec a) {  // (the values fit int16)
  const __m256i q = _mm256_cvtps_epi32(a.v);
  const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), words);
}
inline IVec iadd(IVec a, IVec b) { return {_mm256_add_epi32(a.v, b.v)}; }
inline IVec imul255(IVec a) { return {_mm256_sub_epi32(_mm256_slli_epi32(a.v, 8), a.v)}; }
inline void quantize_split(int8_t* hi, int8_t* lo, Vec a) {  // (never a tie: see avx512's)
  const __m256i q = _mm256_cvtps_epi32(a.v);
  const __m256i high = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_cvtepi32_ps(q), _mm256_set1_ps(1.f / 255.f)));
  const __m256i low = _mm256_sub_epi32(q, imul255({high}).v);
  const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(high), _mm256_extracti128_si256(high, 1));
  const __m128i low_words = _mm_packs_epi32(_mm256_castsi256_si128(low), _mm256_extracti128_si256(low, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(hi), _mm_packs_epi16(words, words));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(lo), _mm_packs_epi16(low_words, low_words));
}
inline void itranspose8(const uint8_t* rows, int64_t stride, IVec* out) {
  __m256i r[8], t[8], u[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows + i * stride));
  for (int i = 0; i < 8; i += 2) {  // within each 128-bit half: pairs of rows by dword
    t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {  // four rows by dword: u[i + k] holds steps k (low half), k + 4 (high)
    u[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int k = 0; k < 4; ++k) {  // rows 0-3 and 4-7 of step k, then of step k + 4
    out[k].v = _mm256_permute2x128_si256(u[k], u[4 + k], 0x20);
    out[k + 4].v = _mm256_permute2x128_si256(u[k], u[4 + k], 0x31);
  }
}
inline IVec igather(const uint8_t* base, IVec offsets) {
  return {_mm256_i32gather_epi32(reinterpret_cast<const int*>(base), offsets.v, 1)};
}
inline IVec iand(IVec a, IVec b) { return {_mm256_and_si256(a.v, b.v)}; }
inline IVec ior(IVec a, IVec b) { return {_mm256_or_si256(a.v, b.v)}; }
inline IVec ixor(IVec a, IVec b) { return {_mm256_xor_si256(a.v, b.v)}; }
inline IVec ibytes(uint8_t v) { return {_mm256_set1_epi8(static_cast<char>(v))}; }
inline IVec ishr8(IVec a, int n) {
  return {_mm256_and_si256(_mm256_srli_epi16(a.v, n), _mm256_set1_epi8(static_cast<char>(0xFF >> n)))};
}
inline IVec ishl8(IVec a, int n) {
  return {_mm256_and_si256(_mm256_slli_epi16(a.v, n), _mm256_set1_epi8(static_cast<char>((0xFF << n) & 0xFF)))};
}
inline IVec ishr32(IVec a, int n) { return {_mm256_srli_epi32(a.v, n)}; }
inline IVec ishl32(IVec a, int n) { return {_mm256_slli_epi32(a.v, n)}; }
inline IVec isra32(IVec a, int n) { return {_mm256_srai_epi32(a.v, n)}; }
inline IVec imul32(IVec a, IVec b) { return {_mm256_mullo_epi32(a.v, b.v)}; }
inline Vec ihalf_lo(IVec a) {  // (the low halves packed: 16-bit lanes 0, 2, 4, 6 of each 128-bit half)
  const __m256i low = _mm256_shuffle_epi8(a.v, _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1,
                                                                0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1));
  return {_mm256_cvtph_ps(_mm256_castsi256_si128(_mm256_permute4x64_epi64(low, 0x08)))};
}

inline Vec ihalves(const uint8_t* p) { return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))}; }

}  // namespace avx2
}  // namespace chunk_attn_cpu
