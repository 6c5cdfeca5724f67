// Portable lanes: the fallback for CPUs without a lanes_<isa>.h, written with the
// GCC/Clang vector extensions (the compilers torch builds extensions with here), which
// both lower to whatever the baseline target has: SSE2, Advanced SIMD, or scalar code.
//
// The lane API, the same in every lanes_<isa>.h, all fp32 math:
//   kLanes                   fp32 lanes of a Vec (one register of the target)
//   kRowVecs                 phase-1 row block: kRowVecs vectors of rows
//   kPvDims                  phase-1 O^T tile: kPvDims dims x kRowVecs vectors of rows
//   kSeqHeads, kSeqPvVecs    phase-2 tile: kSeqHeads heads of a GQA group, P V of kSeqPvVecs
//                            dim vectors of each in registers
//   vzero, vset1(x)          all lanes 0 / x
//   vload(p), vstore(p, a)   kLanes consecutive fp32, or bf16 (uint16_t) converted in registers; vload also
//                            fp16 (Half: a float16 pool's K/V, which only the layers' scalar stores write)
//                            (stores round to nearest even)
//   vhalf(p)                     every lane: the fp16 at p (a block's scale)
//   half_to_float(p)             the fp16 at p as a float (a K-quant's scale; hardware where it can)
//   vhalves(p)                   lane i = the fp16 at p + 2i (F16 weights)
//   vbytes16(low, high, out)     out[i] = byte i of low, out[8 + i] = byte i of high (16 floats)
//   vscaled_nibbles(p, bias, scale, &low, &high)  low: ((p[i] & 15) + bias) * scale, high:
//                                ((p[i] >> 4) + bias) * scale (one load; quantized weights)
//   vq6k(low, ls, high, hs)      Q6_K's: lane i = ((low[i] >> ls) & 15) + 16 ((high[i] >> hs) & 3) - 32
//   vnibbles5k(p, shift, bits, bit, scale)  Q5_K's: lane i = (((p[i] >> shift) & 15)
//                                + 16 ((bits[i] >> bit) & 1)) * scale, the product rounded once
//   vnibbles5(p, bits, first, bias, &low, &high)  Q5's: low: (p[i] & 15) + 16 bit first + i of
//                                bits + bias, high: (p[i] >> 4) + 16 bit first + 16 + i + bias
//   vint8(p)                     lane i = p[i], p: kLanes int8
//   vadd, vsub, vmul, vdiv, vmax  lane-wise (correctly rounded); vfma(a, b, c) = a * b + c
//   vreduce_add, vreduce_max one float from all lanes
//   vsum_lanes(x)            x[kLanes] -> lane j = sum of x[j]'s lanes (x may be overwritten)
//   vexp2(x)                 2^x for x <= 0, exp2_scalar's method lane by lane
//   vpin(a)                  keep a in a register (no-op where the compiler needs no hint)
#pragma once

namespace chunk_attn_cpu {
namespace generic {

constexpr int kLanes = 8;
// Tiles for an unknown target, sized so that even sixteen 128-bit registers (SSE2, the
// x86-64 baseline: a Vec is two of them) hold them: phase 1's O^T 2 dims x 2 row vectors
// + 2 + 1 Vecs, phase 2's 2 heads x 2 dim vectors + 2 + 1. Larger tiles spilled there and
// ran 28x slower than the AVX2 variant.
constexpr int kRowVecs = 2;
constexpr int kPvDims = 2;
constexpr int kSeqHeads = 2, kSeqPvVecs = 2;

// Whole-vector arithmetic also compiles in 5 s where plain arrays, which the optimiser
// must first unroll and vectorise, took 17-38 s: this file is on the first-use build path.
typedef float F32s __attribute__((vector_size(4 * kLanes)));
typedef uint32_t U32s __attribute__((vector_size(4 * kLanes)));
typedef uint16_t U16s __attribute__((vector_size(2 * kLanes)));

struct Vec {
  F32s v;
};

inline Vec vzero() { return {F32s{}}; }
static_assert(kLanes == 8, "vset1 lists the lanes");
// An initialiser list, not F32s{} + x, which GCC built through a scalar store and a
// vector load (a store-forwarding stall on every broadcast).
inline Vec vset1(float x) { return {F32s{x, x, x, x, x, x, x, x}}; }
inline Vec vload(const float* p) {
  Vec r;
  std::memcpy(&r.v, p, sizeof(r.v));
  return r;
}
inline Vec vload(const uint16_t* p) {  // bf16: widen to 32 bits, then into the high half
  U16s x;
  std::memcpy(&x, p, sizeof(x));
  return {(F32s)(__builtin_convertvector(x, U32s) << 16)};
}
inline void vstore(float* p, Vec a) { std::memcpy(p, &a.v, sizeof(a.v)); }
inline void vstore(uint16_t* p, Vec a) {  // round to nearest even, keep the high halves
  U32s bits = (U32s)a.v;
  bits = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const U16s narrow = __builtin_convertvector(bits, U16s);
  std::memcpy(p, &narrow, sizeof(narrow));
}
inline Vec vload(const Half* p) {  // fp16: the scalar conversion lane by lane (no portable vector one)
  Vec r;
  for (int i = 0; i < kLanes; ++i) r.v[i] = load_scalar(p, i);
  return r;
}
inline Vec vadd(Vec a, Vec b) { return {a.v + b.v}; }
#include "lanes_quant_scalar.h"
inline Vec vsub(Vec a, Vec b) { return {a.v - b.v}; }
inline Vec vmul(Vec a, Vec b) { return {a.v * b.v}; }
inline Vec vdiv(Vec a, Vec b) { return {a.v / b.v}; }
inline Vec vmax(Vec a, Vec b) {
  for (int i = 0; i < kLanes; ++i) a.v[i] = a.v[i] > b.v[i] ? a.v[i] : b.v[i];
  return a;
}
// not std::fma: a libm call where FMA is not in the baseline ISA
inline Vec vfma(Vec a, Vec b, Vec c) { return {a.v * b.v + c.v}; }
inline float vreduce_add(Vec a) {
  float s = 0.f;
  for (int i = 0; i < kLanes; ++i) s += a.v[i];
  return s;
}
inline float vreduce_max(Vec a) {
  float m = a.v[0];
  for (int i = 1; i < kLanes; ++i) m = a.v[i] > m ? a.v[i] : m;
  return m;
}
inline Vec vsum_lanes(Vec* x) {
  Vec r;
  for (int j = 0; j < kLanes; ++j) r.v[j] = vreduce_add(x[j]);
  return r;
}
inline Vec vexp2(Vec x) {
  for (int i = 0; i < kLanes; ++i) x.v[i] = exp2_scalar(x.v[i]);
  return x;
}
inline void vpin(Vec&) {}

}  // namespace generic
}  // namespace chunk_attn_cpu
