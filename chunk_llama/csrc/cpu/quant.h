// GGML's block formats (quant_params.h) decoded, written once for every variant against
// the lane API: included by kernel.h in namespace chunk_attn_cpu::CHUNK_ATTN_ISA, after
// linear.h; quant_linear.h multiplies by them.
//
// Every format decodes in groups of 32 weights (a block of the 32-weight formats, a
// sub-block of the K-quants, 32 float16 or bfloat16), kLanes at a time in registers
// (vscaled_nibbles and friends). decode_group does it with the operations, in the order, of
// gguf-py's numpy dequantizers (what transformers loads a GGUF file with): the weights are
// the float32-dequantized model's, bit for bit where vpin keeps the compiler from fusing a
// multiply and an add (not the generic lanes, whose baseline x86 target has no FMA to fuse
// into; aarch64's may, by 1 ulp). dequantize: whole rows to float32 that way (the
// embedding's lookups; layers of many rows, which then run oneDNN's GEMM).
//
// With an offset pointer, the formats with a minimum give the group without it (the
// scaled integers, and the offset apart): quant_linear.h multiplies x by those and adds the
// offset times the group's sum of x once.
#pragma once

namespace chunk_attn_cpu {
namespace CHUNK_ATTN_ISA {

constexpr int kGroup = 32;
constexpr int kGroupVecs = kGroup / kLanes;
static_assert(kLanes <= 16 && 16 % kLanes == 0, "a vector of a 32-weight group must not straddle its halves");

// A product rounded to float before the add that follows, as gguf-py rounds it: the
// compiler may not fuse the two into an FMA across vpin (so the weights are bitwise
// transformers').
inline Vec rounded(Vec a) {
  vpin(a);
  return a;
}

inline uint32_t load_u32(const uint8_t* p) { return p[0] | (p[1] << 8) | (p[2] << 16) | (uint32_t(p[3]) << 24); }

// Whether a format's weights are a scaled integer plus a group's offset (a minimum).
template <int Type>
constexpr bool kHasOffset = Type == kQ4_1 || Type == kQ5_1 || Type == kQ4_K || Type == kQ5_K;
template <int Type>
constexpr bool kIsKQuant = Type == kQ4_K || Type == kQ5_K || Type == kQ6_K;

// A K-quant super-block's scales, the floats its 8 groups multiply by, unpacked and
// converted once for them (not again for each group): Q4_K, Q5_K: group j's d * scale in
// d[j] and dmin * min in m[j]; Q6_K: d times each of its 16 int8 scales (one per 16
// weights) in d[0..15].
struct KScales {
  float d[16], m[8];
};

// The integers converted a vector at a time (vbytes16, vint8), not one by one: unpacked and
// converted a value at a time, a Q4_K super-block's 16 scales took more instructions than
// its 256 weights' decode and FMAs (quant_tile is compute-bound at one row); assembled
// byte by byte in memory for a vector load, still half as many.
template <int Type>
__attribute__((nothrow)) inline void k_scales(const uint8_t* block, KScales* s) {
  if constexpr (Type == kQ4_K || Type == kQ5_K) {
    // 12 bytes at block + 4 hold 8 scales and 8 mins of 6 bits: bytes 0-3 scales 0-3 and
    // bytes 4-7 mins 0-3 in their low 6 bits, whose top 2 bits are the high bits of scales
    // 4-7 and mins 4-7; bytes 8-11 the low 4 bits of scales 4-7 (low nibbles) and of mins
    // 4-7 (high nibbles). As 32-bit words, the values' bytes are:
    const uint8_t* p = block + 4;
    const uint32_t w0 = load_u32(p), w1 = load_u32(p + 4), w2 = load_u32(p + 8);
    constexpr uint32_t kLow6 = 0x3F3F3F3F, kLow4 = 0x0F0F0F0F, kLow2 = 0x03030303;
    const uint64_t scales = (w0 & kLow6) | uint64_t{(w2 & kLow4) | (((w0 >> 6) & kLow2) << 4)} << 32;
    const uint64_t mins = (w1 & kLow6) | uint64_t{((w2 >> 4) & kLow4) | (((w1 >> 6) & kLow2) << 4)} << 32;
    alignas(64) float values[16];  // scales 0-7, mins 0-7
    vbytes16(scales, mins, values);
    const float d = half_to_float(block), dmin = half_to_float(block + 2);
    for (int j = 0; j < 8; ++j) {
      s->d[j] = d * values[j];
      s->m[j] = dmin * values[8 + j];
    }
  } else if constexpr (Type == kQ6_K) {
    const int8_t* scales = reinterpret_cast<const int8_t*>(block + 192);
    const Vec d = vhalf(block + 208);
    for (int i = 0; i < 16; i += kLanes) vstore(s->d + i, vmul(d, vint8(scales + i)));
  }
}

// Group j (0..7) of a K-quant super-block (`b`) into g, as decode_group (ks: its
// k_scales); `factored`: without the offset (-ks.m[j], the caller's to store). Loops that
// unroll j (quant_tile) make every choice below a constant.
template <int Type>
__attribute__((nothrow)) inline void decode_k_group(const uint8_t* b, int j, const KScales& ks, Vec* g,
                                                    bool factored) {
  if constexpr (Type == kQ4_K || Type == kQ5_K) {
    // 8 sub-blocks of 32; sub-blocks 2k and 2k+1 share 32 bytes of nibbles (low, high);
    // Q5_K's fifth bits: bit j of byte l is sub-block j's weight l.
    constexpr bool kFifth = Type == kQ5_K;
    const float dj = ks.d[j], mj = ks.m[j];
    const uint8_t* qs = b + (kFifth ? 48 : 16) + 32 * (j / 2);
#pragma GCC unroll 8
    for (int v = 0; v < kGroupVecs; ++v) {
      Vec q, high;  // dj times the integers (tables: fewer operations than a field's shift, mask and conversion)
      if constexpr (kFifth) {
        q = vnibbles5k(qs + v * kLanes, 4 * (j % 2), b + 16 + v * kLanes, j, vset1(dj));
      } else {
        vscaled_nibbles(qs + v * kLanes, 0.f, vset1(dj), &q, &high);
        if (j % 2) q = high;
      }
      g[v] = factored ? q : vsub(rounded(q), vset1(mj));
    }
  } else if constexpr (Type == kQ6_K) {
    // Group t of half h (j = 4h + t): low 4 bits from ql[64h + 32(t%2) + l] >> 4(t/2), high
    // 2 bits from qh[32h + l] >> 2t; weights l < 16 scale by scales[2j], the rest by the next.
    const int h = j / 4, t = j % 4;
    const uint8_t* low = b + 64 * h + 32 * (t % 2);
    const uint8_t* high = b + 128 + 32 * h;
#pragma GCC unroll 8
    for (int v = 0; v < kGroupVecs; ++v) {
      const int i = v * kLanes;
      g[v] = vmul(vset1(ks.d[2 * j + i / 16]), vq6k(low + i, 4 * (t / 2), high + i, 2 * t));
    }
  }
}

// Weights [32 * group, 32 * group + 32) of one row (`row`: its first block) into g. With
// `offset` (formats with kHasOffset), g gets the scaled integers before the group's offset
// is added, rounded as gguf-py rounds them, and *offset the offset: weight = g + *offset.
// The K-quants take their super-block's scales (k_scales) in `ks`.
template <int Type>
__attribute__((nothrow)) inline void decode_group(const uint8_t* row, int64_t group, Vec* g, float* offset = nullptr,
                                                  const KScales* ks = nullptr) {
  if constexpr (Type == kQ4_0 || Type == kQ4_1 || Type == kQ5_0 || Type == kQ5_1) {
    // 16 bytes of nibbles: weight i < 16 is byte i's low nibble, weight i + 16 its high one;
    // Q5's fifth bits: bit i of 32.
    constexpr bool kMin = Type == kQ4_1 || Type == kQ5_1, kFifth = Type == kQ5_0 || Type == kQ5_1;
    const uint8_t* b = row + group * quant_format(Type).block_bytes;
    const Vec d = vhalf(b), m = kMin ? vhalf(b + 2) : vzero();
    if (kMin && offset != nullptr) *offset = half_to_float(b + 2);
    const uint32_t qh = kFifth ? load_u32(b + (kMin ? 4 : 2)) : 0;
    const uint8_t* qs = b + (kMin ? 4 : 2) + (kFifth ? 4 : 0);
    // weights v * kLanes + lane: the low nibbles of 16 bytes, then the high; the formats
    // without a minimum subtract their bias from the integers (exact); Q4's products with
    // d come scaled from the lanes (one product per value, as a multiply per lane gives)
    constexpr float kBias = kMin ? 0.f : kFifth ? -16.f : -8.f;
    Vec q[kGroupVecs];  // the integers (Q5), or d times them (Q4)
#pragma GCC unroll 4
    for (int v = 0; v < kGroupVecs / 2; ++v) {
      if constexpr (kFifth)
        vnibbles5(qs + v * kLanes, qh, v * kLanes, kBias, &q[v], &q[v + kGroupVecs / 2]);
      else
        vscaled_nibbles(qs + v * kLanes, kBias, d, &q[v], &q[v + kGroupVecs / 2]);
    }
#pragma GCC unroll 8
    for (int v = 0; v < kGroupVecs; ++v) {
      const Vec dq = kFifth ? vmul(d, q[v]) : q[v];
      g[v] = kMin && offset == nullptr ? vadd(rounded(dq), m) : dq;
    }
  } else if constexpr (Type == kQ8_0) {
    const uint8_t* b = row + group * quant_format(Type).block_bytes;
    const Vec d = vhalf(b);
#pragma GCC unroll 8
    for (int v = 0; v < kGroupVecs; ++v) g[v] = vmul(vint8(reinterpret_cast<const int8_t*>(b + 2) + v * kLanes), d);
  } else if constexpr (kIsKQuant<Type>) {
    const int j = static_cast<int>(group % 8);
    if (kHasOffset<Type> && offset != nullptr) *offset = -ks->m[j];
    decode_k_group<Type>(row + (group / 8) * quant_format(Type).block_bytes, j, *ks, g, offset != nullptr);
  } else if constexpr (Type == kF16) {
    // 32 float16: exact in float32
    const uint8_t* b = row + group * quant_format(Type).block_bytes;
#pragma GCC unroll 8
    for (int v = 0; v < kGroupVecs; ++v) g[v] = vhalves(b + 2 * v * kLanes);
  } else if constexpr (Type == kBF16) {
    // 32 bfloat16: exact in float32 (the 16 bits in a float's high half, as the bf16 KV pool loads)
    const uint8_t* b = row + group * quant_format(Type).block_bytes;
#pragma GCC unroll 8
    for (int v = 0; v < kGroupVecs; ++v) {
      uint16_t halves[kLanes];  // (a copy: the blocks are bytes, at any alignment)
      __builtin_memcpy(halves, b + 2 * v * kLanes, sizeof halves);
      g[v] = vload(halves);
    }
  }
}

// One row of in_features weights (whole groups) to float32; with `offsets` (formats with
// kHasOffset), without the groups' offsets, which go to offsets[group] (decode_group's).
template <int Type>
__attribute__((nothrow)) inline void decode_row(const uint8_t* row, int64_t in_features, float* y,
                                                float* offsets = nullptr) {
  KScales ks{};  // (K-quants only)
  for (int64_t group = 0; group < in_features / kGroup; ++group) {
    if (kIsKQuant<Type> && group % 8 == 0) k_scales<Type>(row + group / 8 * quant_format(Type).block_bytes, &ks);
    Vec g[kGroupVecs];
    decode_group<Type>(row, group, g, offsets != nullptr ? offsets + group : nullptr, &ks);
    for (int v = 0; v < kGroupVecs; ++v) vstore(y + group * kGroup + v * kLanes, g[v]);
  }
}

template <int Type>
void dequantize_of(const DequantizeParams& p) {
  const QuantFormat f = quant_format(Type);
  const int64_t row_bytes = p.in_features / f.block_elems * f.block_bytes;
#ifdef _OPENMP
#pragma omp parallel for num_threads(p.num_threads) schedule(static)
#endif
  for (int64_t row = 0; row < p.num_rows; ++row)
    decode_row<Type>(p.w + row * row_bytes, p.in_features, p.out + row * p.in_features);
}

// The C interface admits only the types below (quant_format's): call<Type>(params).
#define CHUNK_ATTN_FOR_QUANT_TYPE(call, params)                  \
  switch (params.type) {                                         \
    case kQ4_0: return call<kQ4_0>(params);                      \
    case kQ4_1: return call<kQ4_1>(params);                      \
    case kQ5_0: return call<kQ5_0>(params);                      \
    case kQ5_1: return call<kQ5_1>(params);                      \
    case kQ8_0: return call<kQ8_0>(params);                      \
    case kQ4_K: return call<kQ4_K>(params);                      \
    case kQ5_K: return call<kQ5_K>(params);                      \
    case kQ6_K: return call<kQ6_K>(params);                      \
    case kF16: return call<kF16>(params);                        \
    case kBF16: return call<kBF16>(params);                      \
    default: return;                                             \
  }

void dequantize(const DequantizeParams& p) { CHUNK_ATTN_FOR_QUANT_TYPE(dequantize_of, p) }
// (CHUNK_ATTN_FOR_QUANT_TYPE is undefined at the end of quant_linear.h, its other user.)

}  // namespace CHUNK_ATTN_ISA
}  // namespace chunk_attn_cpu
