// Scalar helpers shared by every variant: bf16 <-> fp32 and 2^x. Included before a
// variant's target pragma, so they are baseline code (see params.h on linkage).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace chunk_attn_cpu {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kLog2e = 1.44269504088896341f;
// Score of a key outside a query's sliding window. Finite, unlike a causal mask's -inf:
// a block can hide every key of a row (its window starts in a later chunk), and
// 2^(-inf - -inf) would be NaN where 2^(kMaskedScore - kMaskedScore) = 1 is harmless,
// since the row's first visible key then rescales that sum by 2^(kMaskedScore - m) = 0.
constexpr float kMaskedScore = -1e30f;

// bf16 is the top half of an fp32: widening is a shift, narrowing rounds to nearest even.
static inline float bf16_to_float(uint16_t x) {
  const uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
static inline uint16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

static inline float load_scalar(const float* p, int64_t i) { return p[i]; }
static inline float load_scalar(const uint16_t* p, int64_t i) { return bf16_to_float(p[i]); }
static inline void store_scalar(float* p, int64_t i, float x) { p[i] = x; }
static inline void store_scalar(uint16_t* p, int64_t i, float x) { p[i] = float_to_bf16(x); }
// The attention ops' q and out, whose dtype (bf16: raw uint16) is the activations', not
// always the pool's: a branch per element, on the few q and out values of a call.
static inline float load_scalar(const void* p, bool bf16, int64_t i) {
  return bf16 ? load_scalar(static_cast<const uint16_t*>(p), i) : load_scalar(static_cast<const float*>(p), i);
}
static inline void store_scalar(void* p, bool bf16, int64_t i, float x) {
  if (bf16)
    store_scalar(static_cast<uint16_t*>(p), i, x);
  else
    store_scalar(static_cast<float*>(p), i, x);
}

// 2^x for x <= 0 (softmax weights in the log2 domain), the same method in every
// variant: x = n + f with n = round(x), |f| <= 1/2, 2^f by a degree-6 Taylor
// polynomial in f ln 2 (relative error ~1e-7), 2^n put into the exponent bits. At and
// below -127 the result is exactly 0, which is also what 2^-inf must give.
constexpr float kExp2Min = -127.0f;
constexpr float kExp2Coef[7] = {1.0f, 0.693147181f, 0.240226507f, 0.0555041087f, 0.00961812911f,
                                0.00133335581f, 0.000154035304f};

static inline float exp2_scalar(float x) {
  x = x > kExp2Min ? x : kExp2Min;  // -inf too
  // round to nearest even by adding and subtracting 1.5 * 2^23 (exact for |x| < 2^22):
  // std::nearbyint is a libm call where the baseline ISA has no rounding instruction
  const float n = (x + 12582912.f) - 12582912.f, f = x - n;
  float poly = kExp2Coef[6];
  for (int i = 5; i >= 0; --i) poly = poly * f + kExp2Coef[i];
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;  // 0 at n = -127
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return poly * scale;
}

}  // namespace chunk_attn_cpu
