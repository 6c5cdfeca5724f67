// Lanes for aarch64 Advanced SIMD (NEON): four fp32 lanes in a Q register, thirty-two
// registers. The lane API (the same in every lanes_<isa>.h) is described in
// lanes_generic.h. Included by kernel_neon.cpp; <arm_neon.h> comes before it.
#pragma once

namespace chunk_attn_cpu {
namespace neon {

constexpr int kLanes = 4;
// Register tiles for 32 Q registers.
//   phase 1, S^T = K Q^T: a tile of 4 rows against one key: 4 accumulators + a K vector.
//   phase 1, O^T = V^T P^T: 4 dims x 4 row vectors: 16 + 4 P^T vectors + 1 broadcast.
//   phase 2, O += p V: 4 heads x 4 dim vectors, plus 4 broadcasts and a V vector: 16 + 4 + 1.
constexpr int kRowVecs = 4;
constexpr int kPvDims = 4;
constexpr int kSeqHeads = 4, kSeqPvVecs = 4;

struct Vec {
  float32x4_t v;
};

inline Vec vzero() { return {vdupq_n_f32(0.f)}; }
inline Vec vset1(float x) { return {vdupq_n_f32(x)}; }
inline Vec vload(const float* p) { return {vld1q_f32(p)}; }
inline Vec vload(const uint16_t* p) {  // bf16: widen each 16 bits into the high half of 32
  return {vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16))};
}
inline void vstore(float* p, Vec a) { vst1q_f32(p, a.v); }
inline void vstore(uint16_t* p, Vec a) {  // round to nearest even, keep the high halves
  const uint32x4_t bits = vreinterpretq_u32_f32(a.v);
  const uint32x4_t odd = vandq_u32(vshrq_n_u32(bits, 16), vdupq_n_u32(1));
  vst1_u16(p, vshrn_n_u32(vaddq_u32(bits, vaddq_u32(odd, vdupq_n_u32(0x7fff))), 16));
}
inline Vec vload(const Half* p) { return {vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(&p->bits)))}; }
inline Vec vadd(Vec a, Vec b) { return {vaddq_f32(a.v, b.v)}; }
#include "lanes_quant_scalar.h"
inline Vec vsub(Vec a, Vec b) { return {vsubq_f32(a.v, b.v)}; }
inline Vec vmul(Vec a, Vec b) { return {vmulq_f32(a.v, b.v)}; }
inline Vec vdiv(Vec a, Vec b) { return {vdivq_f32(a.v, b.v)}; }
inline Vec vmax(Vec a, Vec b) { return {vmaxq_f32(a.v, b.v)}; }
inline Vec vfma(Vec a, Vec b, Vec c) { return {vfmaq_f32(c.v, a.v, b.v)}; }
inline float vreduce_add(Vec a) { return vaddvq_f32(a.v); }
inline float vreduce_max(Vec a) { return vmaxvq_f32(a.v); }

// x[4] -> lane j holds the sum of x[j]'s lanes: two levels of pairwise adds.
inline Vec vsum_lanes(Vec* x) {
  return {vpaddq_f32(vpaddq_f32(x[0].v, x[1].v), vpaddq_f32(x[2].v, x[3].v))};
}

inline Vec vexp2(Vec x) {  // see exp2_scalar: the same steps, lane by lane
  // vmaxnm returns the number when one operand is NaN, as the x86 variants' max does
  const float32x4_t xc = vmaxnmq_f32(x.v, vdupq_n_f32(kExp2Min));
  const float32x4_t n = vrndnq_f32(xc);
  const float32x4_t f = vsubq_f32(xc, n);
  float32x4_t poly = vdupq_n_f32(kExp2Coef[6]);
  for (int i = 5; i >= 0; --i) poly = vfmaq_f32(vdupq_n_f32(kExp2Coef[i]), poly, f);
  const int32x4_t bits = vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127)), 23);
  return {vmulq_f32(poly, vreinterpretq_f32_s32(bits))};
}

// Keeps a loaded vector in a register (see lanes_avx2.h).
inline void vpin(Vec& a) { asm("" : "+w"(a.v)); }

}  // namespace neon
}  // namespace chunk_attn_cpu
