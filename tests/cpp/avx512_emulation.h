// Test-only: the AVX-512 intrinsics kernel_avx512.cpp uses, on any CPU, from SIMDe
// (Debian's libsimde-dev), so that the AVX-512 variant's code is tested on machines
// without AVX-512 (the kernel_avx512.cpp built with CHUNK_ATTN_EMULATE_AVX512).
// SIMDe 0.7.4 lacks a few of them; they are defined here lane by lane from Intel's
// definitions of each instruction.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "quant_params.h"
#include "scalar.h"

#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#include <simde/x86/f16c.h>  // (_mm_cvtph_ps: the variant's target includes F16C)

#ifndef _MM_FROUND_NO_EXC
#define _MM_FROUND_NO_EXC 0x08
#endif

static inline float _mm512_reduce_add_ps(__m512 a) {
  float x[16], s = 0.f;
  _mm512_storeu_ps(x, a);
  for (float lane : x) s += lane;
  return s;
}
static inline float _mm512_reduce_max_ps(__m512 a) {
  float x[16];
  _mm512_storeu_ps(x, a);
  float m = x[0];
  for (float lane : x) m = lane > m ? lane : m;
  return m;
}
// 16 lanes of `Lane` (the whole of `a`) zero- or sign-extended to 32 bits, as Lane's type says
template <typename Lane, typename Narrow>
static inline __m512i widen_to_epi32(Narrow a) {
  static_assert(sizeof(Narrow) == 16 * sizeof(Lane), "16 lanes fill the narrow vector");
  Lane x[16];
  int32_t r[16];
  std::memcpy(x, &a, sizeof x);
  for (int i = 0; i < 16; ++i) r[i] = x[i];
  return _mm512_loadu_si512(r);
}
// vpmovzxwd, vpmovzxbd, vpmovsxbd
static inline __m512i _mm512_cvtepu16_epi32(__m256i a) { return widen_to_epi32<uint16_t>(a); }
static inline __m512i _mm512_cvtepu8_epi32(__m128i a) { return widen_to_epi32<uint8_t>(a); }
static inline __m512i _mm512_cvtepi8_epi32(__m128i a) { return widen_to_epi32<int8_t>(a); }
// vcvtdq2ps: 16 int32 lanes to float (exact for the small integers the kernels convert)
static inline __m512 _mm512_cvtepi32_ps(__m512i a) {
  int32_t x[16];
  float r[16];
  _mm512_storeu_si512(x, a);
  for (int i = 0; i < 16; ++i) r[i] = static_cast<float>(x[i]);
  return _mm512_loadu_ps(r);
}
// vcvtph2ps: 16 halves to floats (the kernels' own scalar conversion, exact for finite halves)
static inline __m512 _mm512_cvtph_ps(__m256i a) {
  uint8_t x[32];
  float r[16];
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(x), a);
  for (int i = 0; i < 16; ++i) r[i] = chunk_attn_cpu::fp16_to_float(x + 2 * i);
  return _mm512_loadu_ps(r);
}
// 16 32-bit lanes truncated to Lane (their low bits), packed into the narrow vector type Narrow
template <typename Lane, typename Narrow>
static inline Narrow narrow_from_epi32(__m512i a) {
  static_assert(sizeof(Narrow) == 16 * sizeof(Lane), "16 lanes fill the narrow vector");
  uint32_t x[16];
  Lane r[16];
  _mm512_storeu_si512(x, a);
  for (int i = 0; i < 16; ++i) r[i] = static_cast<Lane>(x[i]);
  Narrow out;
  std::memcpy(&out, r, sizeof out);
  return out;
}
// vpmovdw, vpmovdb
static inline __m256i _mm512_cvtepi32_epi16(__m512i a) { return narrow_from_epi32<uint16_t, __m256i>(a); }
static inline __m128i _mm512_cvtepi32_epi8(__m512i a) { return narrow_from_epi32<uint8_t, __m128i>(a); }
// vcvtps2dq with the default rounding (to nearest even)
static inline __m512i _mm512_cvtps_epi32(__m512 a) {
  float x[16];
  int32_t r[16];
  _mm512_storeu_ps(x, a);
  for (int i = 0; i < 16; ++i) r[i] = static_cast<int32_t>(std::nearbyint(x[i]));
  return _mm512_loadu_si512(r);
}
// vpsrad by an immediate: each 32-bit lane shifted right arithmetically (a count above 31 fills the sign)
static inline __m512i _mm512_srai_epi32(__m512i a, unsigned int count) {
  int32_t x[16];
  _mm512_storeu_si512(x, a);
  for (int32_t& lane : x) lane = count > 31 ? (lane < 0 ? -1 : 0) : lane >> count;
  return _mm512_loadu_si512(x);
}
// vpgatherdd: 16 dwords, lane i from base + index_i * scale
static inline __m512i _mm512_i32gather_epi32(__m512i index, const void* base, int scale) {
  int32_t at[16], r[16];
  _mm512_storeu_si512(at, index);
  for (int i = 0; i < 16; ++i)
    std::memcpy(&r[i], static_cast<const char*>(base) + static_cast<int64_t>(at[i]) * scale, sizeof r[i]);
  return _mm512_loadu_si512(r);
}
