// The many-row path of the int8/int16-activation linear layers (quant_act.h): a work item's
// kI8Cols weight rows decoded once into a per-thread buffer (decode_item), then MR x kI8Cols
// tiles of x's rows against it (int8_tile on bytes, int16_tile on 16-bit words), with the same
// exact integer sums and the same float steps in the same order as a decode step's few rows
// (quant_act.h's group_fmas), so a row's outputs do not depend on the rows beside it. Included
// by quant_act.h after its Int8Rows and float steps.
#pragma once

namespace chunk_attn_cpu {
namespace CHUNK_ATTN_ISA {

// A decoded group in the item's buffer: its codes, then its scales [kSubs][kI8Cols] and offsets
// [kI8Cols] (formats with a minimum). The codes: int8's 8 steps of kI8Cols columns' 4 bytes, or
// (kWords, the int16 tile's) 16 steps of kI8Cols columns' 2 codes as 16-bit words.
template <bool kWords>
constexpr int64_t kI8CodeBytes = kI8Cols * (kWords ? 64 : 32);
template <int Type, bool kWords>
constexpr int64_t kI8GroupBytes = kI8CodeBytes<kWords> + kI8Cols * 4 * (kSubs<Type> + (kHasOffset<Type> ? 1 : 0));
static_assert(kI8Cols * (64 + 4 * 3) <= kInt8GroupBytes, "a decoded group must fit the caller's scratch");

// Whether int16 tiles take the codes as 16-bit words against q (int16_tile) rather than as bytes
// against the halves (int8_tile): where the lanes say so (kWordTiles), and everywhere for formats
// with two scales a group (Q6_K: the halves are combined twice a group).
template <int Type>
constexpr bool kInt16Words = kWordTiles || kSubs<Type> == 2;

// Codes 4s .. 4s + 3 of each lane (a step, bytes) as two steps of 16-bit words: words[0] lane c
// codes 4s and 4s + 1 (the low word the first), words[1] codes 4s + 2 and 4s + 3.
__attribute__((nothrow, always_inline)) inline void code_words(IVec step, IVec* words) {
  const IVec low_byte = iset1(0xFF), third_byte = iset1(0xFF0000);
  words[0] = ior(iand(step, low_byte), iand(ishl32(step, 8), third_byte));
  words[1] = ior(iand(ishr32(step, 16), low_byte), iand(ishr32(step, 8), third_byte));
}

// The item of kI8Cols weight rows (its column vectors `cols`) into buf [groups,
// kI8GroupBytes<Type, kWords>], the next item's rows (`next_bytes` from `next`) prefetched meanwhile.
template <int Type, bool kWords, bool kTiled>
__attribute__((nothrow)) inline void decode_item(const Columns<kTiled>* cols, int64_t groups, uint8_t* buf,
                                                 const uint8_t* next, int64_t next_bytes) {
  const int64_t units = groups / kUnitGroups<Type>;
  const StepPrefetch prefetch(next, next_bytes, units);
  for (int64_t unit = 0; unit < units; ++unit) {
    prefetch(unit);
    for (int cv = 0; cv < kI8ColVecs; ++cv)
      decode_unit<Type>(cols[cv], unit,
                        [&](int j, const IVec* codes, const Vec* scales, Vec offset) {
                          uint8_t* group = buf + (unit * kUnitGroups<Type> + j) * kI8GroupBytes<Type, kWords>;
                          float* tail = reinterpret_cast<float*>(group + kI8CodeBytes<kWords>) + cv * kLanes;
                          const auto store = [&](int step, IVec v) {
                            istore(group + (step * kI8Cols + cv * kLanes) * 4, v);
                          };
                          for (int s = 0; s < 8; ++s) {
                            if constexpr (kWords) {
                              IVec words[2];
                              code_words(codes[s], words);
                              store(2 * s, words[0]);
                              store(2 * s + 1, words[1]);
                            } else {
                              store(s, codes[s]);
                            }
                          }
                          for (int sub = 0; sub < kSubs<Type>; ++sub) vstore(tail + sub * kI8Cols, scales[sub]);
                          if constexpr (kHasOffset<Type>) vstore(tail + kSubs<Type> * kI8Cols, offset);
                        });
  }
}

// The tiles' last float step of a group (group_fmas' in its order): the column vectors' offsets
// (lane c: column c's, from `offsets`) times each row's exact sum of x (formats with a minimum).
template <int Type, int MR>
__attribute__((nothrow, always_inline)) inline void add_tile_offsets(Vec (&acc)[kI8ColVecs][MR], const float* offsets,
                                                                    const Int8Rows& x, int64_t row0, int64_t g,
                                                                    int64_t groups) {
  if constexpr (kHasOffset<Type>)
    for (int cv = 0; cv < kI8ColVecs; ++cv) {
      const Vec offset = vload(offsets + cv * kLanes);
      for (int r = 0; r < MR; ++r) acc[cv][r] = add_offset(acc[cv][r], offset, x.sums[(row0 + r) * groups + g]);
    }
}

// An MR x kI8Cols tile on a decoded item (buf, codes as bytes) into out[r][kI8Cols] (no bias).
// Every column vector and row of a group at once, kIdotSteps steps at a time: each step's codes
// loaded once per column vector and each row's activations broadcast once for all of them, so
// the MR x kI8ColVecs (int16: twice as many) integer sums are independent chains the core
// interleaves. The integer sums are exact and the float steps are group_fmas' own helpers in the
// same order, so a tile's outputs equal a decode step's (int8_few_rows) bit for bit.
template <int Type, bool kInt16, int MR>
__attribute__((nothrow, noinline)) void int8_tile(const uint8_t* __restrict__ buf, const Int8Rows& x,
                                                  int64_t row0, int64_t in_features, float* __restrict__ out) {
  constexpr int kSub = kSubs<Type>, kStepsPerSub = 8 / kSub;
  constexpr int kRun = kIdotSteps < kStepsPerSub ? kIdotSteps : kStepsPerSub;  // steps per idot
  const int64_t groups = in_features / kGroup;
  Vec acc[kI8ColVecs][MR];
  for (int cv = 0; cv < kI8ColVecs; ++cv)
    for (int r = 0; r < MR; ++r) acc[cv][r] = vzero();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* group = buf + g * kI8GroupBytes<Type, false>;
    const float* tail = reinterpret_cast<const float*>(group + kI8CodeBytes<false>);
    for (int sub = 0; sub < kSub; ++sub) {
      IVec dot[kI8ColVecs][MR], high[kI8ColVecs][MR];
      for (int r = 0; r < MR; ++r) {
        const IVec zero = zero_point_sum(x, row0 + r, g, sub, in_features);
        for (int cv = 0; cv < kI8ColVecs; ++cv) {
          dot[cv][r] = zero;
          high[cv][r] = iset1(0);  // (int8: unused)
        }
      }
#pragma GCC unroll 8
      for (int k0 = 0; k0 < kStepsPerSub; k0 += kRun) {  // (a constant count: unrolled whole)
        const int s = sub * kStepsPerSub + k0;
        IVec codes[kI8ColVecs][kRun];
        for (int cv = 0; cv < kI8ColVecs; ++cv)
          for (int k = 0; k < kRun; ++k) codes[cv][k] = iload(group + ((s + k) * kI8Cols + cv * kLanes) * 4);
        for (int r = 0; r < MR; ++r) {
          const int64_t at = (row0 + r) * in_features + g * kGroup + 4 * s;
          for (int cv = 0; cv < kI8ColVecs; ++cv) {
            dot[cv][r] = idot<kMaxCode<Type>, kRun>(dot[cv][r], codes[cv], x.codes + at);
            if constexpr (kInt16) high[cv][r] = idot<kMaxCode<Type>, kRun>(high[cv][r], codes[cv], x.high + at);
          }
        }
      }
      for (int cv = 0; cv < kI8ColVecs; ++cv) {
        const Vec scale = vload(tail + sub * kI8Cols + cv * kLanes);
        for (int r = 0; r < MR; ++r)
          acc[cv][r] = add_scaled_sum<kInt16>(acc[cv][r], dot[cv][r], high[cv][r], scale,
                                                  x.scales[(row0 + r) * groups + g]);
      }
    }
    add_tile_offsets<Type, MR>(acc, tail + kSub * kI8Cols, x, row0, g, groups);
  }
  for (int r = 0; r < MR; ++r)
    for (int cv = 0; cv < kI8ColVecs; ++cv) vstore(out + r * kI8Cols + cv * kLanes, acc[cv][r]);
}

// The int16 tile: the same on a decoded item of 16-bit codes (buf, decode_item<Type, true>)
// against the rows' q as int16 (x.words), two products a lane a step (iwdot: one instruction,
// the codes and q each once, where the halves take two products each and a combining step). Its
// sums are the same exact integers as a decode step's 255 dot(c, hi) + dot(c, lo), so its outputs
// equal that step's bit for bit.
template <int Type, int MR>
__attribute__((nothrow, noinline)) void int16_tile(const uint8_t* __restrict__ buf, const Int8Rows& x,
                                                   int64_t row0, int64_t in_features, float* __restrict__ out) {
  constexpr int kSub = kSubs<Type>, kStepsPerSub = 16 / kSub;  // (steps of 2 codes)
  const int64_t groups = in_features / kGroup;
  Vec acc[kI8ColVecs][MR];
  for (int cv = 0; cv < kI8ColVecs; ++cv)
    for (int r = 0; r < MR; ++r) acc[cv][r] = vzero();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* group = buf + g * kI8GroupBytes<Type, true>;
    const float* tail = reinterpret_cast<const float*>(group + kI8CodeBytes<true>);
    for (int sub = 0; sub < kSub; ++sub) {
      IVec dot[kI8ColVecs][MR];
      for (int r = 0; r < MR; ++r)
        for (int cv = 0; cv < kI8ColVecs; ++cv) dot[cv][r] = zero_point_sum(x, row0 + r, g, sub, in_features);
#pragma GCC unroll 16
      for (int k = 0; k < kStepsPerSub; ++k) {  // (a constant count: unrolled whole)
        const int s = sub * kStepsPerSub + k;
        IVec codes[kI8ColVecs];
        for (int cv = 0; cv < kI8ColVecs; ++cv) codes[cv] = iload(group + (s * kI8Cols + cv * kLanes) * 4);
        for (int r = 0; r < MR; ++r) {
          const int16_t* q = x.words + (row0 + r) * in_features + g * kGroup + 2 * s;
          for (int cv = 0; cv < kI8ColVecs; ++cv) dot[cv][r] = iwdot(dot[cv][r], codes[cv], q);
        }
      }
      for (int cv = 0; cv < kI8ColVecs; ++cv) {
        const Vec scale = vload(tail + sub * kI8Cols + cv * kLanes);
        for (int r = 0; r < MR; ++r)
          acc[cv][r] = add_scaled_sum<false>(acc[cv][r], dot[cv][r], dot[cv][r], scale,
                                                 x.scales[(row0 + r) * groups + g]);
      }
    }
    add_tile_offsets<Type, MR>(acc, tail + kSub * kI8Cols, x, row0, g, groups);
  }
  for (int r = 0; r < MR; ++r)
    for (int cv = 0; cv < kI8ColVecs; ++cv) vstore(out + r * kI8Cols + cv * kLanes, acc[cv][r]);
}

template <int Type, bool kInt16, int MR = kI8Rows>
__attribute__((nothrow)) inline void any_int8_tile(int mr, const uint8_t* buf, const Int8Rows& x, int64_t row0,
                                                   int64_t in_features, float* out) {
  if constexpr (MR >= 1) {
    if (mr < MR) return any_int8_tile<Type, kInt16, MR - 1>(mr, buf, x, row0, in_features, out);
    if constexpr (kInt16 && kInt16Words<Type>)
      int16_tile<Type, MR>(buf, x, row0, in_features, out);
    else
      int8_tile<Type, kInt16, MR>(buf, x, row0, in_features, out);
  }
}

}  // namespace CHUNK_ATTN_ISA
}  // namespace chunk_attn_cpu
