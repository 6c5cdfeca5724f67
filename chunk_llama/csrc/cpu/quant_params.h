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
  kF16 = 1, kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14,
  kBF16 = 30,
};

struct QuantFormat {
  int block_elems;  // weights per block (32, or 256 for the K-quants' super-blocks)
  int block_bytes;
};

// The format of a type id; {0, 0} for one the kernels do not decode.
constexpr QuantFormat quant_format(int type) {
  switch (type) {
    case kQ4_0: return {32, 18};   // fp16 d, 16 bytes of nibbles
    case kQ4_1: return {32, 20};   // fp16 d, fp16 m, 16 bytes of nibbles
    case kQ5_0: return {32, 22};   // fp16 d, 32 high bits, 16 bytes of nibbles
    case kQ5_1: return {32, 24};   // fp16 d, fp16 m, 32 high bits, 16 bytes of nibbles
    case kQ8_0: return {32, 34};   // fp16 d, 32 int8
    case kQ4_K: return {256, 144}; // fp16 d, fp16 dmin, 12 bytes of 6-bit scales/mins, 128 bytes of nibbles
    case kQ5_K: return {256, 176}; // as Q4_K, then 32 bytes of high bits before the nibbles
    case kQ6_K: return {256, 210}; // 128 bytes low 4 bits, 64 bytes high 2 bits, 16 int8 scales, fp16 d
    case kF16: return {32, 64};    // 32 float16 (GGML's own blocks are of 1; rows here are whole 32s)
    case kBF16: return {32, 64};   // 32 bfloat16 (likewise)
    default: return {0, 0};
  }
}

// A type id plus kTiled: the same blocks with each kTileRows rows tiled for the integer kernel
// (quant_act.h; ops/cpu/tiles.py writes them). A tile holds its rows' bytes, block by block:
// per block, the rows' lone fp16 if the format has one (Q4_0, Q5_0, Q8_0's d first in the
// block, Q6_K's last), then each of the block's other dwords as the tile's rows' in turn
// (kTileRows dwords). A column vector's read of a dword of kLanes rows is then one load
// instead of a transposition. Only integer activations read tiles; a tile takes the bytes its
// rows take, so row r's tile starts at (r / kTileRows) * kTileRows rows' bytes.
constexpr int kTiled = 256;
constexpr int kTileRows = 16;
constexpr int untiled(int type) { return type & ~kTiled; }
constexpr bool is_tiled(int type) { return (type & kTiled) != 0; }
// Where a format's lone fp16 lies in its block (Q4_0, Q5_0 and Q8_0's d at byte 0, Q6_K's at
// 208), or -1 (the block is whole dwords); a tiled block holds the rows' lone fp16s first
// (tile_halves_bytes), then its dwords from tile_first_dword on in the block.
constexpr int tile_lone_half_at(int type) {
  return (type == kQ4_0 || type == kQ5_0 || type == kQ8_0) ? 0 : type == kQ6_K ? 208 : -1;
}
constexpr int tile_halves_bytes(int type) { return tile_lone_half_at(type) >= 0 ? 2 * kTileRows : 0; }
constexpr int tile_first_dword(int type) { return tile_lone_half_at(type) == 0 ? 2 : 0; }

struct QuantLinearParams {
  const float* x;     // [rows, in_features]
  const uint8_t* w;   // [out_features, in_features / block_elems * block_bytes]
  int type;           // QuantType
  const float* bias;  // [out_features] or nullptr
  float* y;           // [rows, out_features]
  int64_t rows, out_features, in_features;
  int num_threads;
  // quant_scratch_floats(rows, in_features) floats per thread, from the caller (a variant
  // may not allocate: an allocation can throw, and unwinding data would name a symbol
  // outside its namespace).
  float* scratch;
};
constexpr int kQuantScratchRows = 4;  // >= every variant's kLinCols

// A row's groups of 32 (in_features / 32) rounded up to a multiple of 16 (of every
// variant's kLanes): the stride of quant_linear's per-group scratch, zero-padded so that
// its sums over groups run whole vectors.
inline int64_t padded_groups(int64_t in_features) { return (in_features / 32 + 15) / 16 * 16; }

// Floats of scratch quant_linear needs per thread: kQuantScratchRows weight rows decoded
// (the weights [in_features] and the groups' offsets [padded_groups] each) and the rows'
// group sums of x [rows, padded_groups] (quant_linear.h).
inline int64_t quant_scratch_floats(int64_t rows, int64_t in_features) {
  return kQuantScratchRows * (in_features + padded_groups(in_features)) + rows * padded_groups(in_features);
}

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
