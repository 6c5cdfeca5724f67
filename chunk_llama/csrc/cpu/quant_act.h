// Linear layers on GGML blocks with int8 or int16 activations (quant_act_params.h has the arithmetic),
// written once for every variant against the float lane API and the integer one
// (lanes_int8_<isa>.h): included by kernel_<isa>.cpp after kernel.h.
//
// A work item is kI8Cols weight rows ("columns" of y). Its groups are decoded once into a
// per-thread buffer laid out for the integer tile: per group, 8 steps of 4 weights, each
// step one vector per kLanes columns (lane c: column c's 4 codes), then the columns' scales
// and offsets. The tile takes kI8Rows rows of x and kI8ColVecs vectors of columns: per step,
// each row's 4 activation codes broadcast to every lane and multiplied into each column
// vector (idot: 4 products a step summed per lane), so a group's sums come out one column per
// lane, ready for its scales: per group one conversion, a multiply and an FMA per row and
// column vector (the scale factored out of the group's sum), and an FMA for the offset.
// int16 (kInt16) runs each step's products twice, on the high and the low halves of the codes,
// against the same decoded weights; or, in tiles (kInt16Words), the item's codes decoded as 16-bit
// words against whole q (int16_tile). A decode step's few rows run the same exact sums and float
// steps on each group decoded in registers, a column vector at a time (int8_few_rows; one int16 row
// on tiled K-quants streamed a step at a time where the lanes say so, quant_act_row.h), and a last
// tile of fewer rows the same tile, so every output's operations do not depend on the rows beside it.
// The decoded items and the many-row tiles are in quant_act_tile.h; this file has the rows'
// quantization, the float steps, a decode step's few rows and the entry point.
#pragma once

namespace chunk_attn_cpu {
namespace CHUNK_ATTN_ISA {

constexpr int kI8ColVecs = kLanes >= 16 ? 2 : 1;  // column vectors per item
constexpr int kI8Cols = kI8ColVecs * kLanes;       // weight rows per item
constexpr int kI8Rows = 4;                         // rows of x per tile
static_assert(kI8Cols <= kInt8MaxCols, "an item must fit the caller's scratch");
static_assert(kFewRowsMax >= kI8Rows, "a tile's rows run in registers");

}  // namespace CHUNK_ATTN_ISA
}  // namespace chunk_attn_cpu

#include "quant_act_decode.h"
#include "item_ranges.h"

namespace chunk_attn_cpu {
namespace CHUNK_ATTN_ISA {

// The rows' quantized form (quant_act_params.h's scratch, row strides in_features, groups and
// in_features / 16).
struct Int8Rows {
  const int8_t* codes;    // int8: the codes; int16: their low halves
  const int8_t* high;     // int16: the high halves (q = 255 high + codes)
  const int16_t* words;   // int16 in tiles (instead of the halves): q
  const float* scales;    // dx per group
  const float* sums;      // sums of x per group (the offsets' factor: formats with a minimum only)
  const int32_t* zero_sums;  // per group, per sub-group (kSubs<Type> == 2: each 16; else [2g] the 32's):
                             // minus the format's zero point times the codes' sum (a sum's starting value)
};

// Groups [g0, g1) of one row of x (x, codes, high, words: the row's; scales and sums: per group,
// zero_sums: per 16) into its codes (int16: as halves, or as words where `words` is given), scales
// and sums for a weight of format Type (the same operations on every instruction set: a maximum, a
// division, a reciprocal, products rounded to nearest even, and a group's sum of x in four
// interleaved chains, added in pairs: the formats with a minimum only, which multiply it).
template <int Type, bool kInt16>
__attribute__((nothrow)) inline void quantize_groups(const float* x, int64_t g0, int64_t g1, int8_t* codes,
                                                     int8_t* high, int16_t* words, float* scales, float* sums,
                                                     int32_t* zero_sums) {
  for (int64_t g = g0; g < g1; ++g) {
    const float* xg = x + g * kGroup;
    Vec top = vzero();
    for (int v = 0; v < kGroupVecs; ++v) {
      const Vec a = vload(xg + v * kLanes);
      top = vmax(top, vmax(a, vsub(vzero(), a)));
    }
    const float d = vreduce_max(top) / (kInt16 ? 127.f * 255.f : 127.f), inverse = d != 0.f ? 1.f / d : 0.f;
    static_assert(16 % kLanes == 0, "a vector of x lies in one half of its group");
    Vec half_q[2] = {vzero(), vzero()};  // each 16's sum of the codes q, in floats (integers below 2^24: exact)
    for (int v = 0; v < kGroupVecs; ++v) {
      const int64_t at = g * kGroup + v * kLanes;
      const Vec scaled = vmul(vload(xg + v * kLanes), vset1(inverse));
      half_q[v * kLanes / 16] = vadd(half_q[v * kLanes / 16], vround_even(scaled));
      if (kInt16 && words)
        quantize_words(words + at, scaled);
      else if (kInt16)
        quantize_split(high + at, codes + at, scaled);
      else
        quantize_store(codes + at, scaled);
    }
    scales[g] = d;
    if constexpr (kHasOffset<Type>) {
      float chains[4] = {0.f, 0.f, 0.f, 0.f};
      for (int i = 0; i < kGroup; i += 4)
        for (int c = 0; c < 4; ++c) chains[c] += xg[i + c];
      sums[g] = (chains[0] + chains[1]) + (chains[2] + chains[3]);
    }
    const int32_t half_sums[2] = {static_cast<int32_t>(vreduce_add(half_q[0])),
                                  static_cast<int32_t>(vreduce_add(half_q[1]))};
    for (int sub = 0; sub < 2; ++sub)  // (precomputed here so that a group's sums start from a broadcast load)
      zero_sums[2 * g + sub] = -kZero<Type> * (kSubs<Type> == 2 ? half_sums[sub] : half_sums[0] + half_sums[1]);
  }
}

// The float steps on a group's exact integer sums, for row `row` (int8_few_rows through
// group_fmas and int8_tile alike, so both give the same bits). The sum's starting value: minus the
// zero point times the codes' sum over sub-group `sub` (kSubs<Type> == 2: its 16; else all 32), as
// quantize_groups stored it.
__attribute__((nothrow, always_inline)) inline IVec zero_point_sum(const Int8Rows& x, int64_t row, int64_t g, int sub,
                                                                   int64_t in_features) {
  return iset1(x.zero_sums[row * (in_features / 16) + 2 * g + sub]);
}
// acc + the sub-group's sum (int16: low + 255 high) converted once, times scale * dx (the row's
// group's scale, x.scales[row * groups + g]).
template <bool kInt16>
__attribute__((nothrow, always_inline)) inline Vec add_scaled_sum(Vec acc, IVec low, IVec high, Vec scale, float dx) {
  const IVec sum = kInt16 ? iadd(low, imul255(high)) : low;
  return vfma(icvt(sum), vmul(scale, vset1(dx)), acc);
}
// acc + the group's offset times its exact sum of x (x.sums[row * groups + g]; formats with a minimum).
__attribute__((nothrow, always_inline)) inline Vec add_offset(Vec acc, Vec offset, float sum_x) {
  return vfma(offset, vset1(sum_x), acc);
}

// Group g's share of MR rows (from row0) against one column vector: its codes[8] (lane c:
// column c's), scales and offset (lane c: column c's), into acc[MR]. Per sub-group the exact
// integer dot product (int16: 255 times the high halves' plus the low halves'), less the zero
// point times the codes' sum, converted once and scaled by scale * dx; then the offset times
// the group's exact sum of x. A decode step's rows run this for each group in order, and the
// prefill tile (int8_tile) the same float steps on the same exact sums: a row's outputs do not
// depend on the rows beside it.
template <int Type, bool kInt16, int MR>
__attribute__((nothrow, always_inline)) inline void group_fmas(const IVec* codes, const Vec* scales, Vec offset,
                                                              const Int8Rows& x, int64_t row0, int64_t g,
                                                              int64_t in_features, Vec* acc) {
  constexpr int kSub = kSubs<Type>, kStepsPerSub = 8 / kSub;
  const int64_t groups = in_features / kGroup;
#pragma GCC unroll 2
  for (int sub = 0; sub < kSub; ++sub) {
    IVec dot[MR], high[MR];
    if constexpr (kInt16 && MR == 1) {  // (a decode step's one row: its halves side by side, the same integer)
      const int64_t at = row0 * in_features + g * kGroup + 4 * sub * kStepsPerSub;
      dot[0] = idot16<kMaxCode<Type>, kStepsPerSub>(zero_point_sum(x, row0, g, sub, in_features),
                                                    codes + sub * kStepsPerSub, x.codes + at, x.high + at);
      acc[0] = add_scaled_sum<false>(acc[0], dot[0], dot[0], scales[sub], x.scales[row0 * groups + g]);
      continue;
    }
    for (int r = 0; r < MR; ++r) {
      const int64_t at = (row0 + r) * in_features + g * kGroup + 4 * sub * kStepsPerSub;
      dot[r] = idot<kMaxCode<Type>, kStepsPerSub>(zero_point_sum(x, row0 + r, g, sub, in_features),
                                                  codes + sub * kStepsPerSub, x.codes + at);
      high[r] = iset1(0);  // (int8: unused)
      if constexpr (kInt16) high[r] = idot<kMaxCode<Type>, kStepsPerSub>(high[r], codes + sub * kStepsPerSub, x.high + at);
    }
    for (int r = 0; r < MR; ++r)
      acc[r] = add_scaled_sum<kInt16>(acc[r], dot[r], high[r], scales[sub], x.scales[(row0 + r) * groups + g]);
  }
  if constexpr (kHasOffset<Type>)
    for (int r = 0; r < MR; ++r) acc[r] = add_offset(acc[r], offset, x.sums[(row0 + r) * groups + g]);
  if constexpr (MR == 1) keep_in_register(acc[0]);
}

}  // namespace CHUNK_ATTN_ISA
}  // namespace chunk_attn_cpu

#include "quant_act_row.h"
#include "quant_act_tile.h"

namespace chunk_attn_cpu {
namespace CHUNK_ATTN_ISA {

// The same tile for MR <= kI8Rows of a decode step's few rows (row0 on) against one column
// vector, each group decoded from the blocks in registers just before its products (no buffer),
// the next column vector's rows prefetched a share with each group (a K-quant super-block's 8
// shares at once ran 6-10% slower from memory, docs/BENCHMARKS.md): out[r][kLanes] at row stride
// kI8Cols (no bias).
template <int Type, bool kInt16, bool kTiled, int MR>
__attribute__((nothrow, noinline)) void int8_few_rows(const Columns<kTiled>& cols, const Int8Rows& x, int64_t row0,
                                                      int64_t in_features, const uint8_t* next, int64_t next_bytes,
                                                      float* __restrict__ out) {
  Vec acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = vzero();
  const int64_t units = in_features / kGroup / kUnitGroups<Type>;
  const StepPrefetch prefetch(next, next_bytes, units * kUnitGroups<Type>);
  if constexpr (kStreamedRow && kTiled && kInt16 && MR == 1 && kIsKQuant<Type>) {  // (quant_act_row.h)
    const int64_t groups = in_features / kGroup;
    const Int16Row row{x.codes + row0 * in_features, x.high + row0 * in_features, x.scales + row0 * groups,
                       x.sums + row0 * groups, x.zero_sums + row0 * (in_features / 16)};
    for (int64_t unit = 0; unit < units; ++unit) row_k_block<Type>(cols, unit, row, prefetch, acc[0]);
    vstore(out, acc[0]);
    return;
  }
  for (int64_t unit = 0; unit < units; ++unit) {
    decode_unit<Type>(cols, unit, [&](int j, const IVec* codes, const Vec* scales, Vec offset) {
      prefetch(unit * kUnitGroups<Type> + j);
      group_fmas<Type, kInt16, MR>(codes, scales, offset, x, row0, unit * kUnitGroups<Type> + j, in_features, acc);
    });
  }
  for (int r = 0; r < MR; ++r) vstore(out + r * kI8Cols, acc[r]);
}

template <int Type, bool kInt16, bool kTiled, int MR = kI8Rows>
__attribute__((nothrow)) inline void any_int8_few_rows(int mr, const Columns<kTiled>& cols, const Int8Rows& x,
                                                       int64_t row0, int64_t in_features, const uint8_t* next,
                                                       int64_t next_bytes, float* out) {
  if constexpr (MR >= 1) {
    if (mr < MR)
      return any_int8_few_rows<Type, kInt16, kTiled, MR - 1>(mr, cols, x, row0, in_features, next, next_bytes, out);
    int8_few_rows<Type, kInt16, kTiled, MR>(cols, x, row0, in_features, next, next_bytes, out);
  }
}

template <int Type, bool kInt16, bool kTiled>
void quant_int8_of(const QuantInt8Params& p) {
  const QuantFormat f = quant_format(Type);  // (tiles take the rows' bytes)
  const int64_t row_bytes = p.in_features / f.block_elems * f.block_bytes, groups = p.in_features / kGroup;
  const Int8Scratch layout = int8_scratch(p.rows, p.in_features, p.num_threads, kInt16);
  int8_t* codes = reinterpret_cast<int8_t*>(p.scratch + layout.codes);
  int8_t* high = kInt16 ? reinterpret_cast<int8_t*>(p.scratch + layout.high) : nullptr;
  float* scales = reinterpret_cast<float*>(p.scratch + layout.scales);
  float* sums = reinterpret_cast<float*>(p.scratch + layout.sums);
  int32_t* zero_sums = reinterpret_cast<int32_t*>(p.scratch + layout.zero_sums);
  const bool in_registers = p.rows <= kFewRowsMax;  // (a decode step's rows: int8_few_rows, else tiles)
  // int16 rows in tiles as words (q), in place of the halves (the same bytes); a decode step's as halves
  int16_t* words =
      kInt16 && kInt16Words<Type> && !in_registers ? reinterpret_cast<int16_t*>(p.scratch + layout.codes) : nullptr;
  const Int8Rows x{codes, high, words, scales, sums, zero_sums};
  const int64_t num_items = (p.out_features + kI8Cols - 1) / kI8Cols;
  // the rows quantized by every thread: fewer rows than threads (a decode step) in parts of their groups
  const int64_t parts = std::max<int64_t>(1, p.num_threads / std::max<int64_t>(1, p.rows));
  ItemRanges items(num_items, p.num_threads);  // (a thread the region does not get: its range is taken)
#ifdef _OPENMP
#pragma omp parallel num_threads(p.num_threads)
#endif
  {
#ifdef _OPENMP
    const int64_t thread = omp_get_thread_num();
#else
    const int64_t thread = 0;
#endif
    if (in_registers) {  // this thread's first column vector (tiled: its whole tile) on its way to L2 while x is
                         // quantized: a call's own prefetches run a column vector ahead of its reads, so without
                         // this each call's first reads waited on memory (1B decode: C stack 0.4% faster)
      const int64_t first = num_items * thread / p.num_threads * kI8Cols;
      const int64_t rows = std::min<int64_t>(kTiled ? kTileRows : kLanes, p.out_features - first);
      if (rows > 0) prefetch_l2(p.w + first * row_bytes, rows * row_bytes);  // (no pointer past the weight)
    }
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
    for (int64_t i = 0; i < p.rows * parts; ++i) {
      const int64_t r = i / parts, part = i % parts;
      quantize_groups<Type, kInt16>(p.x + r * p.in_features, groups * part / parts, groups * (part + 1) / parts,
                                    codes + r * p.in_features, kInt16 ? high + r * p.in_features : nullptr,
                                    words ? words + r * p.in_features : nullptr, scales + r * groups,
                                    sums + r * groups, zero_sums + r * (p.in_features / 16));
    }
    // (implicit barrier) each thread its share of the items (item_ranges.h), every row against each
    uint8_t* buf = p.scratch + layout.threads + thread * layout.per_thread;
    uint8_t* pad = buf + layout.item_bytes;  // [kI8Cols, row_bytes]
    int64_t last = 0;                         // the end of this thread's range as it took the item
    for (int64_t item; (item = items.take(static_cast<int>(thread), last)) >= 0;) {
      const int64_t col = item * kI8Cols;
      const int nc = static_cast<int>(p.out_features - col < kI8Cols ? p.out_features - col : kI8Cols);
      Columns<kTiled> cols[kI8ColVecs];
      if constexpr (kTiled) {  // (whole tiles: a column vector past the last reads the first again)
        for (int cv = 0; cv < kI8ColVecs; ++cv)
          cols[cv] = columns<true>(p.w, row_bytes, col + (cv * kLanes < nc ? cv * kLanes : 0));
      } else {
        const uint8_t* rows = p.w + col * row_bytes;
        if (item == num_items - 1) {  // the last item: padded with copies of its last row, and 64 bytes more (the
                                      // 32-weight formats' decode reads 32 bytes from each block's first)
          for (int c = 0; c < kI8Cols; ++c)
            std::memcpy(pad + c * row_bytes, rows + (c < nc ? c : nc - 1) * row_bytes, row_bytes);
          rows = pad;
        }
        for (int cv = 0; cv < kI8ColVecs; ++cv) cols[cv] = columns<false>(rows, row_bytes, cv * kLanes);
      }
      alignas(64) float out[kFewRowsMax * kI8Cols];
      const auto store = [&](int64_t row, int mr) {
        for (int r = 0; r < mr; ++r)  // (the bias as the float32 kernel adds it)
          for (int c = 0; c < nc; ++c)
            p.y[(row + r) * p.out_features + col + c] = out[r * kI8Cols + c] + (p.bias ? p.bias[col + c] : 0.f);
      };
      if (in_registers) {  // a column vector at a time (each one's rows read as one stream, the next one's
                           // prefetched: from memory, 12-17% faster than an item's column vectors together on
                           // AVX-512, docs/BENCHMARKS.md)
        for (int cv = 0; cv < kI8ColVecs; ++cv) {
          // prefetched meanwhile: the next column vector's rows; tiled, where a tile holds several column
          // vectors (AVX2's 8 lanes, NEON's 4, each reading a part of every line of the tile), this one's
          // share of the next tile, so that each tile is fetched whole, a tile ahead
          constexpr int64_t kParts = kTiled && kTileRows > kLanes ? kTileRows / kLanes : 1;
          const int64_t vec = col / kLanes + cv, end = std::min(p.out_features, last * kI8Cols);
          const int64_t following = kParts > 1 ? (vec / kParts + 1) * kTileRows : col + (cv + 1) * kLanes;
          const uint8_t* next = p.w + following * row_bytes + (kParts > 1 ? vec % kParts * kLanes * row_bytes : 0);
          const int64_t ahead = std::max<int64_t>(0, std::min<int64_t>(kLanes, end - following));
          for (int64_t row = 0; row < p.rows; row += kI8Rows)  // (the next rows prefetched by the first pass)
            any_int8_few_rows<Type, kInt16>(static_cast<int>(std::min<int64_t>(kI8Rows, p.rows - row)), cols[cv], x,
                                            row, p.in_features, next, row == 0 ? ahead * row_bytes : 0,
                                            out + row * kI8Cols + cv * kLanes);
        }
        store(0, static_cast<int>(p.rows));
        continue;
      }
      const int64_t next_rows = item + 1 < last ? std::min<int64_t>(kI8Cols, p.out_features - col - kI8Cols) : 0;
      decode_item<Type, kInt16 && kInt16Words<Type>>(cols, groups, buf, p.w + (col + kI8Cols) * row_bytes,
                                                     next_rows * row_bytes);
      for (int64_t row = 0; row < p.rows; row += kI8Rows) {
        const int mr = static_cast<int>(p.rows - row < kI8Rows ? p.rows - row : kI8Rows);
        any_int8_tile<Type, kInt16>(mr, buf, x, row, p.in_features, out);
        store(row, mr);
      }
    }
  }
}

template <bool kInt16, bool kTiled>
void quant_act_of(const QuantInt8Params& p) {
  switch (untiled(p.type)) {
    case kQ4_0: return quant_int8_of<kQ4_0, kInt16, kTiled>(p);
    case kQ4_1: return quant_int8_of<kQ4_1, kInt16, kTiled>(p);
    case kQ5_0: return quant_int8_of<kQ5_0, kInt16, kTiled>(p);
    case kQ5_1: return quant_int8_of<kQ5_1, kInt16, kTiled>(p);
    case kQ8_0: return quant_int8_of<kQ8_0, kInt16, kTiled>(p);
    case kQ4_K: return quant_int8_of<kQ4_K, kInt16, kTiled>(p);
    case kQ5_K: return quant_int8_of<kQ5_K, kInt16, kTiled>(p);
    case kQ6_K: return quant_int8_of<kQ6_K, kInt16, kTiled>(p);
    default: return;
  }
}

void quant_linear_int8(const QuantInt8Params& p) {
  if (is_tiled(p.type))
    p.int16 ? quant_act_of<true, true>(p) : quant_act_of<false, true>(p);
  else
    p.int16 ? quant_act_of<true, false>(p) : quant_act_of<false, false>(p);
}

}  // namespace CHUNK_ATTN_ISA
}  // namespace chunk_attn_cpu
