// The weights' side of the int8-activation layers (quant_act.h): GGML blocks decoded, a
// column vector (kLanes weight rows) at a time, into each group's integer codes laid out for
// the integer tile (codes[s], s < 8: lane c holds column c's codes 4s .. 4s + 3) with its
// scales and offset as float vectors (lane c: column c's), handed to a sink in group order:
//   sink(group, codes, scales, offset)   scales[kSubs<Type>], offset (formats with a minimum)
// Written once for every variant against the lane APIs; included by quant_act.h.
//
// No weight goes through a scalar: the rows' bytes are transposed 32 at a time (itranspose8:
// each lane one row's 8 dwords), or loaded a dword of every lane at a time where the rows are
// tiled (quant_params.h), then the codes taken out of them with byte operations, and
// the scales computed for all lanes at once, with the products k_scales and decode_group make.
#pragma once

namespace chunk_attn_cpu {
namespace CHUNK_ATTN_ISA {

// A format's codes' zero point (its own, or the middle of the codes of one with a minimum,
// which keeps the codes' products with the activations' rounding small), its scales per
// group of 32 (Q6_K: one per 16), and its largest code (Q8_0's biased by 128).
template <int Type>
constexpr int kZero = (Type == kQ4_0 || Type == kQ4_1 || Type == kQ4_K) ? 8
                      : (Type == kQ5_0 || Type == kQ5_1 || Type == kQ5_K) ? 16
                      : Type == kQ6_K ? 32 : 128;
template <int Type>
constexpr int kSubs = Type == kQ6_K ? 2 : 1;
template <int Type>
constexpr int kMaxCode = (Type == kQ4_0 || Type == kQ4_1 || Type == kQ4_K) ? 15
                         : (Type == kQ5_0 || Type == kQ5_1 || Type == kQ5_K) ? 31
                         : Type == kQ6_K ? 63 : 255;
// Groups decoded together: a K-quant's super-block (its scales once), else one block.
template <int Type>
constexpr int kUnitGroups = kIsKQuant<Type> ? 8 : 1;

// A column vector's kLanes weight rows, as the file keeps them (rows: the first, the distance
// between them, and lane c's offset c * stride, for igather) or tiled (quant_params.h: the
// tile that holds them and the lane of the first in it).
template <bool kTiled>
struct Columns;
template <>
struct Columns<false> {
  const uint8_t* first;
  int64_t stride;
  IVec offsets;
};
template <>
struct Columns<true> {
  const uint8_t* tile;
  int lane;
};

// The column vector of weight rows from `row` of the weight at `w` (rows of row_bytes).
template <bool kTiled>
__attribute__((nothrow)) inline Columns<kTiled> columns(const uint8_t* w, int64_t row_bytes, int64_t row) {
  if constexpr (kTiled) {
    return {w + row / kTileRows * kTileRows * row_bytes, static_cast<int>(row % kTileRows)};
  } else {
    alignas(64) int32_t offsets[kLanes];
    for (int c = 0; c < kLanes; ++c) offsets[c] = static_cast<int32_t>(c * row_bytes);
    return {w + row * row_bytes, row_bytes, iload(offsets)};
  }
}

// Tiled (quant_params.h): where the first lane's first dword of block `block` lies, and the dword from
// byte `from` of each lane's block from there.
template <int Type>
__attribute__((nothrow, always_inline)) inline const uint8_t* tile_block(const Columns<true>& cols, int64_t block) {
  return cols.tile + block * kTileRows * quant_format(Type).block_bytes + tile_halves_bytes(Type) + cols.lane * 4;
}
template <int Type>
__attribute__((nothrow, always_inline)) inline IVec tile_dword(const uint8_t* block_at, int from) {
  return iload(block_at + (from - tile_first_dword(Type)) / 4 * kTileRows * 4);
}
// Lane c: the dword from byte `from` of block `block` of column c (tiled).
template <int Type>
__attribute__((nothrow, always_inline)) inline IVec block_dword(const Columns<true>& cols, int64_t block, int from) {
  return tile_dword<Type>(tile_block<Type>(cols, block), from);
}
// Lane c: the lone fp16 of column c's block `block`, as a float (tiled).
template <int Type>
__attribute__((nothrow, always_inline)) inline Vec block_half(const Columns<true>& cols, int64_t block) {
  return ihalves(cols.tile + block * kTileRows * quant_format(Type).block_bytes + 2 * cols.lane);
}
// out[s] (s < 8), lane c: dword s from byte `from` of block `block` of column c.
template <int Type>
__attribute__((nothrow, always_inline)) inline void block_dwords(const Columns<false>& cols, int64_t block, int from,
                                                                 IVec* out) {
  itranspose8(cols.first + block * quant_format(Type).block_bytes + from, cols.stride, out);
}
template <int Type>
__attribute__((nothrow, always_inline)) inline void block_dwords(const Columns<true>& cols, int64_t block, int from,
                                                                 IVec* out) {
  for (int s = 0; s < 8; ++s) out[s] = block_dword<Type>(cols, block, from + 4 * s);
}

// A Q4_K/Q5_K super-block's 8 groups' scales and offsets, from its first 16 bytes (head[0 .. 3], lane c
// column c's: d and dmin, then 12 bytes of 6-bit scales and mins): group j's weight of code z is
// z d sc - dmin m, so its scale is d sc and its offset (the weight of the zero point) kZero d sc - dmin m.
template <int Type>
struct KGroupScales {
  Vec d, dmin;
  // byte i of each lane: the 6-bit scale (min) of group i (first) and of group 4 + i (second): its low
  // 4 bits from w2's nibbles and its top 2 from w0's (w1's) top bits, one shift of the dwords moving
  // them (what it moves into a neighbouring byte lands outside 0x30 there)
  IVec sc_bytes[2], min_bytes[2];
  __attribute__((always_inline)) explicit KGroupScales(const IVec* head)
      : d(ihalf_lo(head[0])), dmin(ihalf_lo(ishr32(head[0], 16))) {
    const IVec w0 = head[1], w1 = head[2], w2 = head[3];
    const IVec low6 = ibytes(63), low4 = ibytes(15), bits45 = ibytes(0x30);
    sc_bytes[0] = iand(w0, low6);
    sc_bytes[1] = ior(iand(w2, low4), iand(ishr32(w0, 2), bits45));
    min_bytes[0] = iand(w1, low6);
    min_bytes[1] = ior(iand(ishr32(w2, 4), low4), iand(ishr32(w1, 2), bits45));
  }
  __attribute__((always_inline)) void make(int j, Vec& scale, Vec& offset) const {
    const IVec sc = byte(sc_bytes[j / 4], j % 4), min = byte(min_bytes[j / 4], j % 4);
    scale = vmul(d, icvt(sc));
    offset = vsub(vmul(vset1(static_cast<float>(kZero<Type>)), scale), vmul(dmin, icvt(min)));
  }
  static IVec byte(IVec bytes, int i) { return i == 3 ? ishr32(bytes, 24) : iand(ishr32(bytes, 8 * i), iset1(255)); }
};

// A Q6_K super-block's 16 scales (of weights 16 i .. 16 i + 15: group i / 2's half i % 2): its int8
// scales (4q .. 4q + 3 at byte 192 + 4q) times its fp16 d (at 208).
template <bool kTiled>
__attribute__((nothrow, always_inline)) inline void q6_scales(const Columns<kTiled>& cols, int64_t block,
                                                              Vec* scale) {
  Vec d;
  IVec four[4];
  if constexpr (kTiled) {
    d = block_half<kQ6_K>(cols, block);
    for (int q = 0; q < 4; ++q) four[q] = block_dword<kQ6_K>(cols, block, 192 + 4 * q);
  } else {
    IVec tail[8];  // bytes 178 .. 209 (192 + 4q = 178 + 14 + 4q)
    block_dwords<kQ6_K>(cols, block, 178, tail);
    d = ihalf_lo(ishr32(tail[7], 16));
    for (int q = 0; q < 4; ++q) four[q] = ior(ishr32(tail[3 + q], 16), ishl32(tail[4 + q], 16));
  }
  for (int q = 0; q < 4; ++q)
    for (int b = 0; b < 4; ++b) scale[4 * q + b] = vmul(d, icvt(isra32(ishl32(four[q], 24 - 8 * b), 24)));
}
// A step's codes of Q6_K group 4h + t from its dword of ql[64h + 32 (t % 2)] (`low`) and of
// qh[32h] (`high`): low 4 bits from low >> 4 (t / 2), top 2 from bits 2t, 2t + 1 of high.
__attribute__((nothrow, always_inline)) inline IVec q6_codes(IVec low, IVec high, int t, IVec nibble, IVec top_two) {
  const IVec bits = t / 2 ? ishr8(low, 4) : iand(low, nibble);
  // bits 2t, 2t + 1 of each byte to bits 4, 5 by one shift of the dwords (the bits it moves into a
  // neighbouring byte land outside 0x30 there)
  const IVec moved = 2 * t <= 4 ? ishl32(high, 4 - 2 * t) : ishr32(high, 2 * t - 4);
  return ior(bits, iand(moved, top_two));
}

// The K-quants' super-block `block` of the column vector: 8 groups to the sink.
template <int Type, bool kTiled, typename Sink>
__attribute__((nothrow, always_inline)) inline void decode_k_block(const Columns<kTiled>& cols, int64_t block,
                                                                   Sink&& sink) {
  IVec raw[8], codes[8];
  if constexpr (Type == kQ4_K || Type == kQ5_K) {
    IVec head[8];
    block_dwords<Type>(cols, block, 0, head);
    const KGroupScales<Type> k_scales(head);
    Vec scale[8], offset[8];
    const auto make_scale = [&](int j) { k_scales.make(j, scale[j], offset[j]); };
    if constexpr (kScalesAhead)  // (else each group's where it is used: the lanes' choice)
      for (int j = 0; j < 8; ++j) make_scale(j);
    IVec fifth[8];  // Q5_K: bit j of byte l is group j's weight l
    if constexpr (Type == kQ5_K) block_dwords<Type>(cols, block, 16, fifth);
    const IVec nibble = ibytes(15), one = ibytes(1);
#pragma GCC unroll 4  // (whole: each load's address a constant offset)
    for (int pair = 0; pair < 4; ++pair) {
      block_dwords<Type>(cols, block, (Type == kQ5_K ? 48 : 16) + 32 * pair, raw);
#pragma GCC unroll 2
      for (int half = 0; half < 2; ++half) {
        const int j = 2 * pair + half;
        for (int s = 0; s < 8; ++s) {
          codes[s] = half ? ishr8(raw[s], 4) : iand(raw[s], nibble);
          if constexpr (Type == kQ5_K) codes[s] = ior(codes[s], ishl8(iand(ishr8(fifth[s], j), one), 4));
        }
        if constexpr (!kScalesAhead) make_scale(j);
        sink(j, codes, &scale[j], offset[j]);
      }
    }
  } else if constexpr (Type == kQ6_K) {
    Vec scale[16];
    q6_scales(cols, block, scale);
    const IVec nibble = ibytes(15), top_two = ibytes(0x30);
    IVec low[2][8], high[8];
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {  // groups 4h + t: low 4 bits from ql[64h + 32 (t % 2)] >> 4 (t / 2)
      block_dwords<Type>(cols, block, 64 * h, low[0]);
      block_dwords<Type>(cols, block, 64 * h + 32, low[1]);
      block_dwords<Type>(cols, block, 128 + 32 * h, high);
#pragma GCC unroll 4
      for (int t = 0; t < 4; ++t) {
        for (int s = 0; s < 8; ++s) codes[s] = q6_codes(low[t % 2][s], high[s], t, nibble, top_two);
        sink(4 * h + t, codes, &scale[2 * (4 * h + t)], vzero());
      }
    }
  }
}

// Block g of the 32-weight formats of the column vector to the sink. In rows, reads the block's
// first 32 bytes whatever its size: the caller makes sure memory follows (quant_int8_of pads
// the last item); tiled, exactly its bytes.
template <int Type, bool kTiled, typename Sink>
__attribute__((nothrow, always_inline)) inline void decode_block32(const Columns<kTiled>& cols, int64_t g,
                                                                   Sink&& sink) {
  constexpr bool kMin = Type == kQ4_1 || Type == kQ5_1, kFifth = Type == kQ5_0 || Type == kQ5_1;
  IVec head[8], codes[8];
  Vec d = vzero(), m = vzero();  // (m: formats with a minimum)
  if constexpr (kTiled) {
    if constexpr (tile_lone_half_at(Type) == 0) {
      d = block_half<Type>(cols, g);
    } else {
      const IVec halves = block_dword<Type>(cols, g, 0);
      d = ihalf_lo(halves);
      m = ihalf_lo(ishr32(halves, 16));
    }
  } else {
    block_dwords<Type>(cols, g, 0, head);
    const IVec halves =
        Type == kQ8_0 ? igather(cols.first + g * quant_format(Type).block_bytes, cols.offsets) : head[0];
    d = ihalf_lo(halves);
    if constexpr (kMin) m = ihalf_lo(ishr32(halves, 16));
  }
  // dword k from byte `from` on (rows: from the head, 2-byte offsets two dwords joined)
  const auto dword = [&](int from, int k) {
    const int b = from + 4 * k;
    if constexpr (kTiled)
      return block_dword<Type>(cols, g, b);
    else
      return b % 4 == 0 ? head[b / 4] : ior(ishr32(head[b / 4], 16), ishl32(head[b / 4 + 1], 16));
  };
  // the weight of code z: m + z d
  const Vec offset = kMin ? vadd(m, vmul(vset1(static_cast<float>(kZero<Type>)), d)) : vzero();
  if constexpr (Type == kQ8_0) {
    if constexpr (kTiled)
      for (int s = 0; s < 8; ++s) codes[s] = dword(2, s);
    else
      block_dwords<Type>(cols, g, 2, codes);
    const IVec top = ibytes(0x80);
    for (int s = 0; s < 8; ++s) codes[s] = ixor(codes[s], top);  // q + 128
  } else {
    // 16 bytes of nibbles: weight i < 16 the low nibble of byte i, weight 16 + i its high one;
    // Q5's fifth bits: bit i of 32, here per lane the 4 bits of a step spread to its 4 bytes
    constexpr int kNibbles = (kMin ? 4 : 2) + (kFifth ? 4 : 0);
    const IVec nibble = ibytes(15);
    for (int s = 0; s < 4; ++s) {
      const IVec raw = dword(kNibbles, s);
      codes[s] = iand(raw, nibble);
      codes[s + 4] = ishr8(raw, 4);
    }
    if constexpr (kFifth) {
      // bits 4s .. 4s + 3 to bytes 0 .. 3 (times 0x00204081: bit k lands at bit 8k + k, the mask keeps it), as 16
      const IVec fifth = dword(kMin ? 4 : 2, 0), spread = iset1(0x00204081), bit = iset1(0x01010101);
      for (int s = 0; s < 8; ++s)
        codes[s] = ior(codes[s], ishl32(iand(imul32(iand(ishr32(fifth, 4 * s), iset1(15)), spread), bit), 4));
    }
  }
  sink(0, codes, &d, offset);
}

// Unit `unit` (kUnitGroups<Type> groups from group unit * kUnitGroups) of the column vector.
template <int Type, bool kTiled, typename Sink>
__attribute__((nothrow, always_inline)) inline void decode_unit(const Columns<kTiled>& cols, int64_t unit,
                                                                Sink&& sink) {
  if constexpr (kIsKQuant<Type>)
    decode_k_block<Type>(cols, unit, sink);
  else
    decode_block32<Type>(cols, unit, sink);
}

// Prefetches share `step` of `bytes` bytes from `next` (the rows that come next, contiguous: a
// decode step's next column vector, a prefill's next item), one of `steps`: a decode reads its
// rows once, from memory, and the hardware's own prefetch left it waiting on them. The same share
// of the rows two such parts later goes to L2 (taken as the same size: only a thread's last parts
// differ, and a prefetch past them reads nothing it needs and never faults), so that their reads
// are under way earlier (docs/BENCHMARKS.md: one row from memory, Q4_K 12% and Q6_K 7% faster).
struct StepPrefetch {
  const uint8_t* next;
  int64_t bytes, share;  // (the share divided once: a call per group)
  StepPrefetch(const uint8_t* next_rows, int64_t next_bytes, int64_t steps)
      : next(next_rows), bytes(next_bytes), share((next_bytes + steps - 1) / steps) {}
  __attribute__((nothrow, always_inline)) void operator()(int64_t step) const {
    for (int64_t at = step * share & ~int64_t{63}; at < (step + 1) * share && at < bytes; at += 64) {
      __builtin_prefetch(next + at);
      __builtin_prefetch(next + 2 * bytes + at, 0, 2);
    }
  }
};

// `bytes` from p to L2 (whole lines; none for bytes <= 0).
__attribute__((nothrow)) inline void prefetch_l2(const uint8_t* p, int64_t bytes) {
  for (int64_t at = 0; at < bytes; at += 64) __builtin_prefetch(p + at, 0, 2);
}

}  // namespace CHUNK_ATTN_ISA
}  // namespace chunk_attn_cpu
