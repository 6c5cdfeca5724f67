// Integer lanes for the int8-activation linear layers (quant_act.h) in plain C++, for the
// variants without their own (generic, neon): kLanes int32 lanes as an array, each the
// exact dot product of four codes and four activations. The lane API is listed in
// lanes_int8_avx512.h. Included by kernel_<isa>.cpp inside its namespace, after its
// lanes_<isa>.h (whose kLanes, Vec, vload and vstore it uses).
#pragma once

struct IVec {
  int32_t v[kLanes];
};

constexpr int kIdotSteps = 8;
constexpr bool kWordTiles = true;  // (int16 tiles: two products per two codes, where the halves take four)
constexpr int kFewRowsMax = 4;     // (lanes_int8_avx512.h; not measured here: a tile's rows, as before)
constexpr bool kScalesAhead = true;  // (as AVX2)
inline IVec iset1(int32_t v) {
  IVec r;
  for (int i = 0; i < kLanes; ++i) r.v[i] = v;
  return r;
}
inline IVec iload(const void* p) {
  IVec r;
  std::memcpy(r.v, p, sizeof r.v);
  return r;
}
inline void istore(void* p, IVec a) { std::memcpy(p, a.v, sizeof a.v); }
template <int kMaxCode, int kSteps>
inline IVec idot(IVec acc, const IVec* u, const int8_t* s) {
  for (int t = 0; t < kSteps; ++t) {
    uint8_t codes[4 * kLanes];
    std::memcpy(codes, u[t].v, sizeof codes);
    for (int i = 0; i < kLanes; ++i)
      for (int j = 0; j < 4; ++j) acc.v[i] += int32_t{codes[4 * i + j]} * int32_t{s[4 * t + j]};
  }
  return acc;
}
inline IVec iwdot(IVec acc, IVec w, const int16_t* s) {
  uint16_t words[2 * kLanes];
  std::memcpy(words, w.v, sizeof words);
  for (int i = 0; i < kLanes; ++i) acc.v[i] += int32_t{words[2 * i]} * s[0] + int32_t{words[2 * i + 1]} * s[1];
  return acc;
}
inline Vec icvt(IVec a) {
  alignas(64) float lanes[kLanes];
  for (int i = 0; i < kLanes; ++i) lanes[i] = static_cast<float>(a.v[i]);
  return vload(lanes);
}
inline void quantize_store(int8_t* p, Vec a) {  // nearest, ties to even (the default rounding mode)
  alignas(64) float lanes[kLanes];
  vstore(lanes, a);
  for (int i = 0; i < kLanes; ++i) p[i] = static_cast<int8_t>(__builtin_nearbyintf(lanes[i]));
}
inline Vec vround_even(Vec a) {
  alignas(64) float lanes[kLanes];
  vstore(lanes, a);
  for (int i = 0; i < kLanes; ++i) lanes[i] = __builtin_nearbyintf(lanes[i]);
  return vload(lanes);
}
inline void quantize_words(int16_t* p, Vec a) {
  alignas(64) float lanes[kLanes];
  vstore(lanes, a);
  for (int i = 0; i < kLanes; ++i) p[i] = static_cast<int16_t>(__builtin_nearbyintf(lanes[i]));
}
inline void quantize_split(int8_t* hi, int8_t* lo, Vec a) {  // (never a tie: see avx512's)
  alignas(64) float lanes[kLanes];
  vstore(lanes, a);
  for (int i = 0; i < kLanes; ++i) {
    const int32_t q = static_cast<int32_t>(__builtin_nearbyintf(lanes[i]));
    const int32_t high = static_cast<int32_t>(__builtin_nearbyintf(static_cast<float>(q) * (1.f / 255.f)));
    hi[i] = static_cast<int8_t>(high);
    lo[i] = static_cast<int8_t>(q - 255 * high);  // (|lo| <= 127)
  }
}
inline IVec iadd(IVec a, IVec b) {
  for (int i = 0; i < kLanes; ++i) a.v[i] += b.v[i];
  return a;
}
inline IVec imul255(IVec a) {
  for (int i = 0; i < kLanes; ++i) a.v[i] *= 255;
  return a;
}
template <int kMaxCode, int kSteps>
inline IVec idot16(IVec acc, const IVec* u, const int8_t* lo, const int8_t* hi) {
  return iadd(idot<kMaxCode, kSteps>(acc, u, lo), imul255(idot<kMaxCode, kSteps>(iset1(0), u, hi)));
}
constexpr bool kStreamedRow = false;  // (the generic variant streamed ran Q4_K/Q5_K at 0.5-0.6x, Q6_K 1.2x)
#include "lanes_int8_runs.h"
inline void keep_in_register(Vec&) {}
inline void itranspose8(const uint8_t* rows, int64_t stride, IVec* out) {
  for (int c = 0; c < kLanes; ++c)
    for (int s = 0; s < 8; ++s) std::memcpy(&out[s].v[c], rows + c * stride + 4 * s, 4);
}
inline IVec igather(const uint8_t* base, IVec offsets) {
  IVec r;
  for (int c = 0; c < kLanes; ++c) std::memcpy(&r.v[c], base + offsets.v[c], 4);
  return r;
}
inline IVec iand(IVec a, IVec b) {
  for (int i = 0; i < kLanes; ++i) a.v[i] &= b.v[i];
  return a;
}
inline IVec ior(IVec a, IVec b) {
  for (int i = 0; i < kLanes; ++i) a.v[i] |= b.v[i];
  return a;
}
inline IVec ixor(IVec a, IVec b) {
  for (int i = 0; i < kLanes; ++i) a.v[i] ^= b.v[i];
  return a;
}
inline IVec ibytes(uint8_t v) { return iset1(static_cast<int32_t>(v * 0x01010101u)); }
inline IVec ishr8(IVec a, int n) {
  for (int i = 0; i < kLanes; ++i) a.v[i] = static_cast<int32_t>((static_cast<uint32_t>(a.v[i]) >> n) & ((0xFFu >> n) * 0x01010101u));
  return a;
}
inline IVec ishl8(IVec a, int n) {
  for (int i = 0; i < kLanes; ++i)
    a.v[i] = static_cast<int32_t>((static_cast<uint32_t>(a.v[i]) << n) & (((0xFFu << n) & 0xFFu) * 0x01010101u));
  return a;
}
inline IVec ishr32(IVec a, int n) {
  for (int i = 0; i < kLanes; ++i) a.v[i] = static_cast<int32_t>(static_cast<uint32_t>(a.v[i]) >> n);
  return a;
}
inline IVec ishl32(IVec a, int n) {
  for (int i = 0; i < kLanes; ++i) a.v[i] = static_cast<int32_t>(static_cast<uint32_t>(a.v[i]) << n);
  return a;
}
inline IVec isra32(IVec a, int n) {
  for (int i = 0; i < kLanes; ++i) a.v[i] >>= n;  // (arithmetic for negative values: C++20, and GCC/Clang before)
  return a;
}
inline IVec imul32(IVec a, IVec b) {
  for (int i = 0; i < kLanes; ++i) a.v[i] = static_cast<int32_t>(static_cast<uint32_t>(a.v[i]) * static_cast<uint32_t>(b.v[i]));
  return a;
}
inline Vec ihalf_lo(IVec a) {
  alignas(64) float lanes[kLanes];
  for (int i = 0; i < kLanes; ++i) {
    const uint16_t h = static_cast<uint16_t>(a.v[i]);
    lanes[i] = fp16_to_float(reinterpret_cast<const uint8_t*>(&h));
  }
  return vload(lanes);
}
inline Vec ihalves(const uint8_t* p) {
  alignas(64) float lanes[kLanes];
  for (int i = 0; i < kLanes; ++i) lanes[i] = fp16_to_float(p + 2 * i);
  return vload(lanes);
}
