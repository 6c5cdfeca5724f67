// Linear layers on GGML blocks with integer activations (`--gguf-activations int8|int16`),
// free of torch and of any instruction set: what quant_act.h computes, its scratch, and the
// variants' entry points. Included like quant_params.h (after it).
//
// int8: x is quantized as llama.cpp quantizes it for its integer dot products (Q8_0): each
// row's groups of 32 values to int8 with one scale, amax / 127, rounded to nearest even.
// int16: the same with amax / (127 * 255), so q = round(x / d) in [-32385, 32385], split
// exactly into two int8 halves q = 255 hi + lo (hi = round(q / 255), so both in [-127, 127]:
// the range every variant's int8 dot product takes), and a group's integer dot product is
// 255 dot(c, hi) + dot(c, lo): the same instructions on the same decoded codes, twice (or, in the
// tiles where quant_act.h's kInt16Words says so, dot(c, q) on the codes as 16-bit words: the same
// integer), for 255 times finer steps (every partial sum below 2^29 in int32 for every format; at
// most, Q8_0's codes up to 255: 255 * 32 * 255 * 127 + 32 * 255 * 127 + 128 * 32 * 32385). Each
// weight group is its format's unsigned integer codes c, a zero point z (the format's own,
// or the middle of the codes' range for the formats with a minimum) and scales: weight =
// scale * (c - z) + offset. A group's integer dot product is exact (int32), so each output
// is, in float32, sum over groups of (scale * dx) * (sum c q - z sum q) + offset * sum x, in
// group order: the same operations in the same order whatever rows come with it (batch
// invariance within the mode), and on every instruction set.
#pragma once

#include <cstdint>

namespace chunk_attn_cpu {

struct QuantInt8Params {
  const float* x;     // [rows, in_features]
  const uint8_t* w;   // [out_features, in_features / block_elems * block_bytes]
  int type;           // QuantType, quant_int8_supports
  const float* bias;  // [out_features] or nullptr
  float* y;           // [rows, out_features]
  int64_t rows, out_features, in_features;
  int num_threads;
  uint8_t* scratch;   // quant_int8_scratch_bytes(rows, in_features, num_threads, int16), 64-byte aligned
  bool int16 = false; // int16 activations (two int8 halves) instead of int8
};

// The formats with integer codes (all but F16 and BF16, which keep float32 activations), in
// rows or tiled (quant_params.h).
constexpr bool quant_int8_supports(int type) {
  const int t = untiled(type);
  return t == kQ4_0 || t == kQ4_1 || t == kQ5_0 || t == kQ5_1 || t == kQ8_0 || t == kQ4_K || t == kQ5_K || t == kQ6_K;
}

// The widest item (weight rows decoded at once) of any variant, and the bytes of one group
// of 32 weights of each of its rows once decoded (codes, as 16-bit words for int16, up to two
// scales and an offset).
constexpr int kInt8MaxCols = 32;
constexpr int64_t kInt8GroupBytes = kInt8MaxCols * (64 + 4 * 3);

inline int64_t round64(int64_t bytes) { return (bytes + 63) / 64 * 64; }

// The scratch's parts, in bytes from its start: the rows' codes [rows, in_features] int8 (int16:
// the low halves, then the high halves [rows, in_features] int8 at `high`; or, more rows than a
// decode step's, q [rows, in_features] int16 in the same bytes from the start), their
// scales and exact sums [rows, in_features / 32] float each, minus the weight format's zero
// point times their codes' sums per 16 (or 32: quant_act.h's Int8Rows) [rows, in_features / 16]
// int32, then per thread a decoded item [in_features / 32, kInt8GroupBytes] and the last item's
// rows padded to a whole item [kInt8MaxCols, row bytes (at most in_features * 34 / 32, Q8_0's)]
// and 64 bytes.
struct Int8Scratch {
  int64_t codes, high, scales, sums, zero_sums, threads, item_bytes, per_thread, bytes;
};
inline Int8Scratch int8_scratch(int64_t rows, int64_t in_features, int num_threads, bool int16) {
  Int8Scratch s{};
  const int64_t groups = in_features / 32;
  s.codes = 0;
  s.high = round64(rows * in_features);
  s.scales = s.high + (int16 ? round64(rows * in_features) : 0);
  s.sums = s.scales + round64(rows * groups * 4);
  s.zero_sums = s.sums + round64(rows * groups * 4);
  s.threads = s.zero_sums + round64(rows * (in_features / 16) * 4);
  s.item_bytes = round64(groups * kInt8GroupBytes);
  s.per_thread = s.item_bytes + round64(kInt8MaxCols * groups * 34 + 64);
  s.bytes = s.threads + s.per_thread * num_threads;
  return s;
}
inline int64_t quant_int8_scratch_bytes(int64_t rows, int64_t in_features, int num_threads, bool int16) {
  return int8_scratch(rows, in_features, num_threads, int16).bytes;
}

// Entry points of the variants (kernel_<isa>.cpp): the layer, and whether this CPU runs the
// variant's integer kernel (AVX-512's needs VNNI and BW beyond the variant's AVX-512F).
#define CHUNK_ATTN_DECLARE_INT8(isa)                   \
  namespace isa {                                      \
  void quant_linear_int8(const QuantInt8Params& p);    \
  }
CHUNK_ATTN_DECLARE_INT8(avx512)
CHUNK_ATTN_DECLARE_INT8(avx2)
CHUNK_ATTN_DECLARE_INT8(neon)
CHUNK_ATTN_DECLARE_INT8(generic)
#undef CHUNK_ATTN_DECLARE_INT8

}  // namespace chunk_attn_cpu
