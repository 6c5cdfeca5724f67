// Linear layers whose weights stay in GGML's quantized block formats (GGUF files), on the
// CPU, free of torch and of any instruction set. Included like linear_params.h.
//
// A weight [out_features, in_features] is kept as the file stores it: each row is
// in_features / block_elems blocks of block_bytes, rows back to back. A decode step then
// reads the blocks (4.5 bits a weight for Q4_0, 8.5 for Q8_0) instead of fp32 (32 bits):
// the step is bound by the weights' bytes, so that is its speed.
#pragma once

#include <cstdint>

namespace chunk_attn_cpu {

// GGML's type ids (ggml.h `enum ggml_type`, gguf-py GGMLQuantizationType): the formats
// the kernels decode.
enum QuantType : int {
  kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14,
};

struct QuantFormat {
  int block_elems;  // weights per block (32, or 256 for the K-quants' super-blocks)
  int block_bytes;
};

// The format of a type id; {0, 0} for one the kernels do not decode.
inline QuantFormat quant_format(int type) {
  switch (type) {
    case kQ4_0: return {32, 18};   // fp16 d, 16 bytes of nibbles
    case kQ4_1: return {32, 20};   // fp16 d, fp16 m, 16 bytes of nibbles
    case kQ5_0: return {32, 22};   // fp16 d, 32 high bits, 16 bytes of nibbles
    case kQ5_1: return {32, 24};   // fp16 d, fp16 m, 32 high bits, 16 bytes of nibbles
    case kQ8_0: return {32, 34};   // fp16 d, 32 int8
    case kQ4_K: return {256, 144}; // fp16 d, fp16 dmin, 12 bytes of 6-bit scales/mins, 128 bytes of nibbles
    case kQ5_K: return {256, 176}; // as Q4_K, then 32 bytes of high bits before the nibbles
    case kQ6_K: return {256, 210}; // 128 bytes low 4 bits, 64 bytes high 2 bits, 16 int8 scales, fp16 d
    default: return {0, 0};
  }
}

struct QuantLinearParams {
  const float* x;     // [rows, in_features]
  const uint8_t* w;   // [out_features, in_features / block_elems * block_bytes]
  int type;           // QuantType
  const float* bias;  // [out_features] or nullptr
  float* y;           // [rows, out_features]
  int64_t rows, out_features, in_features;
  int num_threads;
};

struct DequantizeParams {
  const uint8_t* w;  // [num_rows, in_features / block_elems * block_bytes]
  int type;
  float* out;        // [num_rows, in_features]
  int64_t num_rows, in_features;
  int num_threads;
};

// Entry points of the variants (kernel_<isa>.cpp), beside small_linear.
#define CHUNK_ATTN_DECLARE_QUANT(isa)                \
  namespace isa {                                    \
  void quant_linear(const QuantLinearParams& p);     \
  void dequantize(const DequantizeParams& p);        \
  }
CHUNK_ATTN_DECLARE_QUANT(avx512)
CHUNK_ATTN_DECLARE_QUANT(avx2)
CHUNK_ATTN_DECLARE_QUANT(neon)
CHUNK_ATTN_DECLARE_QUANT(generic)
#undef CHUNK_ATTN_DECLARE_QUANT

}  // namespace chunk_attn_cpu

namespace chunk_attn_cpu {

// An IEEE half's bits as a float (the blocks' scales; once a block, so scalar).
inline float fp16_to_float(const uint8_t* bytes) {
  const uint16_t h = static_cast<uint16_t>(bytes[0] | (bytes[1] << 8));  // little-endian, any alignment
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact in a float
    const float magnitude = static_cast<float>(mantissa) * (1.0f / 16777216.0f);
    return sign ? -magnitude : magnitude;
  }
  const uint32_t bits = sign | (exponent == 31 ? 0x7f800000u | (mantissa << 13) : ((exponent + 112) << 23) | (mantissa << 13));
  float value;
  __builtin_memcpy(&value, &bits, sizeof value);
  return value;
}

}  // namespace chunk_attn_cpu
