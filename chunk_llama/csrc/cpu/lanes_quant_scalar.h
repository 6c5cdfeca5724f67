// The quantized-weight lane functions (see lanes_generic.h), one lane at a time, for
// the lanes without integer-to-float vector code here (generic, neon): included by their
// lanes_<isa>.h, in its namespace, after its vload, vstore and vset1.
#pragma once

inline float half_to_float(const uint8_t* p) { return fp16_to_float(p); }
inline Vec vhalf(const uint8_t* p) { return vset1(fp16_to_float(p)); }
inline Vec vhalves(const uint8_t* p) {
  alignas(64) float lanes[kLanes];
  for (int i = 0; i < kLanes; ++i) lanes[i] = fp16_to_float(p + 2 * i);
  return vload(lanes);
}
inline void vbytes16(uint64_t low, uint64_t high, float* out) {
  for (int i = 0; i < 8; ++i) {
    out[i] = static_cast<float>((low >> (8 * i)) & 0xFF);
    out[8 + i] = static_cast<float>((high >> (8 * i)) & 0xFF);
  }
}
inline void vscaled_nibbles(const uint8_t* p, float bias, Vec scale, Vec* low, Vec* high) {
  alignas(64) float scales[kLanes], lows[kLanes], highs[kLanes];
  vstore(scales, scale);
  for (int i = 0; i < kLanes; ++i) {
    lows[i] = (static_cast<float>(p[i] & 15) + bias) * scales[i];
    highs[i] = (static_cast<float>(p[i] >> 4) + bias) * scales[i];
  }
  *low = vload(lows);
  *high = vload(highs);
}
inline Vec vq6k(const uint8_t* low, int low_shift, const uint8_t* high, int high_shift) {
  alignas(64) float lanes[kLanes];
  for (int i = 0; i < kLanes; ++i)
    lanes[i] = static_cast<float>((((low[i] >> low_shift) & 15) | ((high[i] >> high_shift) & 3) << 4) - 32);
  return vload(lanes);
}
inline Vec vnibbles5k(const uint8_t* p, int shift, const uint8_t* bits, int bit, Vec scale) {
  alignas(64) float scales[kLanes], lanes[kLanes];
  vstore(scales, scale);
  for (int i = 0; i < kLanes; ++i)
    lanes[i] = static_cast<float>(((p[i] >> shift) & 15) | ((bits[i] >> bit) & 1) << 4) * scales[i];
  return vload(lanes);
}
inline void vnibbles5(const uint8_t* p, uint32_t bits, int first, float bias, Vec* low, Vec* high) {
  alignas(64) float lows[kLanes], highs[kLanes];
  for (int i = 0; i < kLanes; ++i) {
    lows[i] = static_cast<float>((p[i] & 15) | ((bits >> (first + i)) & 1u) << 4) + bias;
    highs[i] = static_cast<float>((p[i] >> 4) | ((bits >> (first + 16 + i)) & 1u) << 4) + bias;
  }
  *low = vload(lows);
  *high = vload(highs);
}
inline Vec vint8(const int8_t* p) {
  alignas(64) float lanes[kLanes];
  for (int i = 0; i < kLanes; ++i) lanes[i] = static_cast<float>(p[i]);
  return vload(lanes);
}
