// A decode step's one row of int16 activations against a tiled K-quant column vector, streamed a step
// at a time (where the lanes' kStreamedRow says so; else int8_few_rows' decode_unit and group_fmas): each
// step's codes made from its dword just before its products, each group's runs of products (the lanes'
// IRun) ended where the group ends and its float steps taken then. So only a group's codes, runs and
// sums live at once, which AVX2's 16 registers hold: decode_unit makes a super-block's scales and a pair
// of groups' codes first, which spilled about 30 values a group there (1B file, one row: AVX2's C stack
// 11-13% faster, AVX-512's 1.6%; two groups side by side spilled again on AVX2 and ran 6-12% slower in
// cache on AVX-512, docs/BENCHMARKS.md). The exact integer sums and the float steps, in group_fmas'
// order, are group_fmas' own: the outputs are the same bit for bit. Included by quant_act.h after
// group_fmas.
#pragma once

namespace chunk_attn_cpu {
namespace CHUNK_ATTN_ISA {

// Row r of Int8Rows: its int16 halves [in_features], and per group its dx, its sum of x and (per 16)
// its zero-point starting values (quant_act.h's quantize_groups).
struct Int16Row {
  const int8_t* lo;
  const int8_t* hi;
  const float* dx;
  const float* sums;
  const int32_t* zero_sums;
};

// Sub-group `sub` of group g's exact sum (kSteps steps: kSubs 2, 4), step s's codes from code(s): zero
// point + sum over steps of codes . (lo + 255 hi), in runs of kRunSteps.
template <int Type, int kSteps, typename Code>
__attribute__((nothrow, always_inline)) inline IVec row_sum(const Int16Row& x, int64_t g, int sub, Code&& code) {
  constexpr int kRun = kRunSteps<kMaxCode<Type>> < kSteps ? kRunSteps<kMaxCode<Type>> : kSteps;
  IVec sum = iset1(x.zero_sums[2 * g + sub]);
  IRun run;
#pragma GCC unroll 8
  for (int s = 0; s < kSteps; ++s) {
    const int64_t at = g * kGroup + 4 * (kSteps * sub + s);
    const IVec u = code(kSteps * sub + s);
    run = s % kRun ? irun_next<kMaxCode<Type>>(run, u, x.lo + at, x.hi + at)
                   : irun_first<kMaxCode<Type>>(u, x.lo + at, x.hi + at);
    if (s % kRun == kRun - 1 || s == kSteps - 1) sum = irun_end(sum, run);
  }
  return sum;
}

// Super-block `block` of the column vector times the row into acc, the next rows' share of each group
// prefetched (int8_few_rows' order): group j's sum, then its float steps, in turn.
template <int Type>
__attribute__((nothrow, always_inline)) inline void row_k_block(const Columns<true>& cols, int64_t block,
                                                                const Int16Row& x, const StepPrefetch& prefetch,
                                                                Vec& acc) {
  const int64_t g0 = block * 8;
  const uint8_t* block_at = tile_block<Type>(cols, block);
  // each group's loads from `at`, which an empty asm "changes" at the group's start: GCC otherwise hoisted the
  // next groups' loads and codes over the products and spilled them
  const auto group_at = [block_at] {
    const uint8_t* at = block_at;
    __asm__("" : "+r"(at));
    return at;
  };
  if constexpr (Type == kQ4_K || Type == kQ5_K) {
    IVec head[4];
    for (int k = 0; k < 4; ++k) head[k] = tile_dword<Type>(block_at, 4 * k);
    const KGroupScales<Type> k_scales(head);
    Vec scale[8], offset[8];
    if constexpr (kScalesAhead)  // (else each group's where it is used: the lanes' choice)
      for (int j = 0; j < 8; ++j) k_scales.make(j, scale[j], offset[j]);
    const IVec nibble = ibytes(15), one = ibytes(1);
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {  // group j: the low (even j) or high nibbles of 32 bytes (Q5_K: bit j of 32 more)
      const uint8_t* at = group_at();
      const IVec sum = row_sum<Type, 8>(x, g0 + j, 0, [&](int s) {
        const IVec raw = tile_dword<Type>(at, (Type == kQ5_K ? 48 : 16) + 32 * (j / 2) + 4 * s);
        IVec u = j % 2 ? ishr8(raw, 4) : iand(raw, nibble);
        if constexpr (Type == kQ5_K) u = ior(u, ishl8(iand(ishr8(tile_dword<Type>(at, 16 + 4 * s), j), one), 4));
        return u;
      });
      prefetch(g0 + j);
      if constexpr (!kScalesAhead) k_scales.make(j, scale[j], offset[j]);
      acc = add_scaled_sum<false>(acc, sum, sum, scale[j], x.dx[g0 + j]);
      acc = add_offset(acc, offset[j], x.sums[g0 + j]);
      keep_in_register(acc);
    }
  } else if constexpr (Type == kQ6_K) {
    Vec scale[16];
    q6_scales(cols, block, scale);
    const IVec nibble = ibytes(15), top_two = ibytes(0x30);
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {  // group 4h + t (quant_act_decode.h's q6_codes)
      const uint8_t* at = group_at();
      const int h = j / 4, t = j % 4;
      const auto code = [&](int s) {
        return q6_codes(tile_dword<Type>(at, 64 * h + 32 * (t % 2) + 4 * s), tile_dword<Type>(at, 128 + 32 * h + 4 * s),
                        t, nibble, top_two);
      };
      const IVec first = row_sum<Type, 4>(x, g0 + j, 0, code), second = row_sum<Type, 4>(x, g0 + j, 1, code);
      prefetch(g0 + j);
      acc = add_scaled_sum<false>(acc, first, first, scale[2 * j], x.dx[g0 + j]);
      acc = add_scaled_sum<false>(acc, second, second, scale[2 * j + 1], x.dx[g0 + j]);
      keep_in_register(acc);
    }
  }
}

}  // namespace CHUNK_ATTN_ISA
}  // namespace chunk_attn_cpu
