// Scalar helpers shared by every variant: bf16 and fp16 <-> fp32 and 2^x. Included before a
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

// An IEEE half's bits (little-endian, any alignment) as a float, exactly, either sign,
// infinities included (NaNs stay NaNs): the blocks' scales where the lanes have no
// hardware conversion (half_to_float), F16 weights and a float16 pool's K/V on the generic
// lanes, and the tests' reference; branch-free.
// No subnormal float arises on the way: an arithmetic operation on one costs a microcode
// assist (about a hundred cycles), and real files hold many subnormal scales (Gemma 3
// 270M's Q6_K ffn_down ran at a third of its speed when a subnormal half was scaled up
// from a subnormal float). The exponent is rebased by an integer add; a
// subnormal half, m * 2^-24, is the normal float 2^-14 (1 + m / 1024) minus 2^-14, which
// is exact (zero too: 2^-14 - 2^-14).
static inline float fp16_to_float(const uint8_t* bytes) {
  uint16_t h;
  __builtin_memcpy(&h, bytes, sizeof h);
  const uint32_t magnitude = static_cast<uint32_t>(h & 0x7fffu) << 13;  // exponent and mantissa in place
  const uint32_t exponent = magnitude & 0x0f800000u;
  const bool subnormal = exponent == 0, special = exponent == 0x0f800000u;
  const uint32_t bits = magnitude + ((127u - 15u) << 23) + (subnormal ? 1u << 23 : 0u) +
                        (special ? (128u - 16u) << 23 : 0u);  // infinities and NaNs: all ones
  float value;
  __builtin_memcpy(&value, &bits, sizeof value);
  value -= subnormal ? 0x1p-14f : 0.f;
  uint32_t signed_bits;
  __builtin_memcpy(&signed_bits, &value, sizeof signed_bits);
  signed_bits |= static_cast<uint32_t>(h & 0x8000u) << 16;
  __builtin_memcpy(&value, &signed_bits, sizeof value);
  return value;
}
// A float rounded to the nearest IEEE half (ties to even, as torch's conversion and F16C's
// vcvtps2ph round), as its bits: past the largest half (65504) an infinity, below 2^-14 a
// subnormal half (the add of 0.5 rounds |f| to a multiple of 2^-24, 0.5's unit in the last
// place), NaNs quiet NaNs.
static inline uint16_t float_to_fp16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  const uint32_t sign = (bits >> 16) & 0x8000u, magnitude = bits & 0x7fffffffu;
  if (magnitude >= 0x7f800000u)  // infinity, NaN
    return static_cast<uint16_t>(sign | 0x7c00u | (magnitude > 0x7f800000u ? 0x200u | ((magnitude >> 13) & 0x3ffu) : 0u));
  if (magnitude >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to 2^16 or more
  if (magnitude < 0x38800000u) {  // below 2^-14
    float absolute;
    std::memcpy(&absolute, &magnitude, sizeof absolute);
    const float sum = absolute + 0.5f;
    uint32_t sum_bits;
    std::memcpy(&sum_bits, &sum, sizeof sum_bits);
    return static_cast<uint16_t>(sign | (sum_bits - 0x3f000000u));
  }
  const uint32_t rebased = magnitude - ((127u - 15u) << 23);  // the half's exponent in place
  return static_cast<uint16_t>(sign | ((rebased + 0xfffu + ((magnitude >> 13) & 1u)) >> 13));
}

// A float16 K/V pool's element: a distinct type, so that the kernels' templates on the
// pool's element (float, bf16 as raw uint16_t, Half) pick each one's vload.
struct Half {
  uint16_t bits;
};

static inline float load_scalar(const float* p, int64_t i) { return p[i]; }
static inline float load_scalar(const uint16_t* p, int64_t i) { return bf16_to_float(p[i]); }
static inline void store_scalar(float* p, int64_t i, float x) { p[i] = x; }
static inline void store_scalar(uint16_t* p, int64_t i, float x) { p[i] = float_to_bf16(x); }
static inline float load_scalar(const Half* p, int64_t i) { return fp16_to_float(reinterpret_cast<const uint8_t*>(p + i)); }
static inline void store_scalar(Half* p, int64_t i, float x) { p[i].bits = float_to_fp16(x); }
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
