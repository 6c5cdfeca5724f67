// Linear layers on weights in GGML's block formats, y = x W^T (+ bias), written once for
// every variant against the lane API: included by kernel.h after quant.h.
//
// A tile is small_linear's (kLinRows rows of x against kLinCols weight rows, kLanes
// accumulators, one vsum_lanes at the end), on each group of 32 weights as decode_group
// gives it: the formats with a minimum (Q4_1, Q5_1, Q4_K, Q5_K) without it, their offset
// times the group's sum of x (sx, once per call) going into one float per output instead
// (llama.cpp's factoring, in float32). Per weight that is a conversion, a multiply and an
// FMA, where decoding the weight exactly first added the offset to every weight (an add
// kept apart from its multiply for gguf-py's rounding); that arithmetic, not the memory,
// bounded a decode step. The other formats' weights are gguf-py's exactly, so there the
// result is small_linear's on the dequantized weight, bit for bit.
//
// A decode step (up to kLinRows rows) decodes each group from the blocks in registers
// just before its FMAs, so the weights are read once, in their compact form, and the next
// work item's blocks are prefetched meanwhile. More rows, and a last item of fewer than
// kLinCols weight rows: each item's weight rows are decoded once into a per-thread buffer
// that stays in L1 while small_linear's tile passes every tile of x over it, and the
// offsets are added after. Each output's FMAs and offset products are the same, in the
// same order, on both paths, so a row's result does not depend on how many rows came
// with it.
#pragma once

namespace chunk_attn_cpu {
namespace CHUNK_ATTN_ISA {

static_assert(kLinCols <= kQuantScratchRows, "an item's weight rows must fit the caller's scratch");

// The next item's blocks (the kLinCols rows after `w`'s, contiguous), a group's share
// (`share` bytes) per group: the hardware's stride prefetch alone left a decode step
// waiting on memory (the blocks are read once, from DRAM, and a few hundred bytes per row
// are too short a stream to train it). Past the last item it names bytes after the
// weight: a prefetch never faults.
inline void prefetch_share(const uint8_t* next, int64_t group, int64_t share) {
  for (int64_t at = group * share & ~int64_t{63}; at < (group + 1) * share; at += 64) __builtin_prefetch(next + at);
}

// sx [rows, stride]: each group's sum of x [rows, in_features], in one fixed order, then
// zeros up to the stride (padded_groups).
__attribute__((nothrow)) inline void group_sums(const float* x, int64_t rows, int64_t in_features, float* sx,
                                                int64_t stride) {
  const int64_t groups = in_features / kGroup;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t group = 0; group < groups; ++group) {
      const float* xg = x + r * in_features + group * kGroup;
      Vec s = vload(xg);
      for (int v = 1; v < kGroupVecs; ++v) s = vadd(s, vload(xg + v * kLanes));
      sx[r * stride + group] = vreduce_add(s);
    }
    for (int64_t group = groups; group < stride; ++group) sx[r * stride + group] = 0.f;
  }
}

// out[r * nr + c] += the offsets' share: sum over groups of offsets[c, g] * sx[r, g], for
// an mr x nr tile, as small_linear's tile computes it on whole vectors (stride: a multiple
// of kLanes, zero-padded), which is the same for each output whatever the tile's size, so
// the two paths below agree.
__attribute__((nothrow)) inline void add_offsets(int mr, int nr, const float* sx, const float* offsets, int64_t stride,
                                                 float* out) {
  float shares[kLanes];
  any_tile(mr, nr, sx, offsets, stride, shares);
  for (int t = 0; t < mr * nr; ++t) out[t] += shares[t];
}

// The MR x kLinCols tile's dot products into out[r * kLinCols + c], each weight group
// decoded from the blocks (w: the tile's first weight row) just before its FMAs (x: MR
// rows; for formats with an offset, sx: their group sums [MR, stride], and offsets
// [kLinCols, stride], zero-padded, for the groups' offsets). (Templates called in a
// parallel loop are marked nothrow, as in linear.h; noinline: inlined into its caller's loop,
// GCC allocated its registers worse and a decode step's layers ran 15-20% slower.)
template <int Type, int MR>
__attribute__((nothrow, noinline)) void quant_tile(const float* __restrict__ x, const float* __restrict__ sx,
                                                const uint8_t* __restrict__ w, int64_t row_bytes, int64_t in_features,
                                                float* __restrict__ offsets, int64_t stride,
                                                float* __restrict__ out) {
  const int64_t groups = in_features / kGroup;
  const int64_t share = (kLinCols * row_bytes + groups - 1) / groups;
  Vec acc[kLanes];
#pragma GCC unroll 16
  for (int i = 0; i < kLanes; ++i) acc[i] = vzero();
  // one group's FMAs for a column, on its weights g
  const auto column_fmas = [&](int64_t group, int c, const Vec* g) __attribute__((always_inline)) {
#pragma GCC unroll 8
    for (int v = 0; v < kGroupVecs; ++v)
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r)
        acc[r * kLinCols + c] = vfma(vload(x + r * in_features + group * kGroup + v * kLanes), g[v],
                                     acc[r * kLinCols + c]);
  };
  if constexpr (kIsKQuant<Type>) {
    // a super-block's scales once for its 8 groups, and the groups unrolled, so that each
    // group's choices of bytes, shifts and scales are constants
    constexpr int64_t kBlockBytes = quant_format(Type).block_bytes;
    for (int64_t block = 0; block < groups / 8; ++block) {
      KScales ks[kLinCols];
      for (int c = 0; c < kLinCols; ++c) {
        k_scales<Type>(w + c * row_bytes + block * kBlockBytes, &ks[c]);
        if constexpr (kHasOffset<Type>)  // (stored here: a store inside the FMAs' loop may alias the blocks)
          for (int j = 0; j < 8; ++j) offsets[c * stride + block * 8 + j] = -ks[c].m[j];
      }
      // The scales are read back from memory by each use (a load, or AVX-512's embedded
      // broadcast), not kept in registers and broadcast to a vector by permutes: those take
      // the port the table lookups need (Q6_K at one row 20 -> 23-24 Gweights/s, AVX-512).
      asm volatile("" ::: "memory");
      // (a plain loop: with each group in a lambda GCC ran a Q4_K tile in L2 faster, 50
      // against 68 us, but DRAM-bound Q6_K, Q8_0 and Q4_1 at half the speed)
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        prefetch_share(w + kLinCols * row_bytes, block * 8 + j, share);
#pragma GCC unroll 4
        for (int c = 0; c < kLinCols; ++c) {
          Vec g[kGroupVecs];
          decode_k_group<Type>(w + c * row_bytes + block * kBlockBytes, j, ks[c], g, kHasOffset<Type>);
          column_fmas(block * 8 + j, c, g);
        }
      }
    }
  } else {
    for (int64_t group = 0; group < groups; ++group) {
      prefetch_share(w + kLinCols * row_bytes, group, share);
#pragma GCC unroll 4
      for (int c = 0; c < kLinCols; ++c) {
        Vec g[kGroupVecs];
        decode_group<Type>(w + c * row_bytes, group, g, kHasOffset<Type> ? offsets + c * stride + group : nullptr);
        column_fmas(group, c, g);
      }
    }
  }
  alignas(64) float sums[kLanes];
  vstore(sums, vsum_lanes(acc));  // the unused accumulators of a shorter tile add up to 0
  for (int t = 0; t < MR * kLinCols; ++t) out[t] = sums[t];
  if constexpr (kHasOffset<Type>) add_offsets(MR, kLinCols, sx, offsets, stride, out);
}

template <int Type, int MR = kLinRows>
__attribute__((nothrow)) inline void any_quant_tile(int mr, const float* x, const float* sx, const uint8_t* w,
                                                    int64_t row_bytes, int64_t in_features, float* offsets,
                                                    int64_t stride, float* out) {
  if constexpr (MR >= 1) {
    if (mr < MR) return any_quant_tile<Type, MR - 1>(mr, x, sx, w, row_bytes, in_features, offsets, stride, out);
    quant_tile<Type, MR>(x, sx, w, row_bytes, in_features, offsets, stride, out);
  }
}

// A decode step's few rows (up to kLinRows): each item's groups decoded in registers just
// before their FMAs (a last item of fewer than kLinCols weight rows through the buffer).
template <int Type>
void quant_few_rows(const QuantLinearParams& p, float* g, float* offsets, const float* sx) {
  const QuantFormat f = quant_format(Type);
  const int64_t row_bytes = p.in_features / f.block_elems * f.block_bytes, stride = padded_groups(p.in_features);
  const int64_t num_items = (p.out_features + kLinCols - 1) / kLinCols;
  const int mr = static_cast<int>(p.rows);
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
  for (int64_t item = 0; item < num_items; ++item) {
    const int64_t col = item * kLinCols;
    const int nr = static_cast<int>(p.out_features - col < kLinCols ? p.out_features - col : kLinCols);
    float out[kLanes];
    if (nr == kLinCols) {
      any_quant_tile<Type>(mr, p.x, sx, p.w + col * row_bytes, row_bytes, p.in_features, offsets, stride, out);
    } else {  // small_linear's tile on the buffer, then the offsets, as the many-row path below
      for (int c = 0; c < nr; ++c)
        decode_row<Type>(p.w + (col + c) * row_bytes, p.in_features, g + c * p.in_features,
                         kHasOffset<Type> ? offsets + c * stride : nullptr);
      alignas(64) float lanes[kLanes];
      vstore(lanes, tile_lanes(mr, nr, p.x, g, p.in_features));
      if constexpr (kHasOffset<Type>) vstore(lanes, vadd(vload(lanes), tile_lanes(mr, nr, sx, offsets, stride)));
      for (int t = 0; t < kLanes; ++t) out[t] = lanes[t];
    }
    for (int r = 0; r < mr; ++r)  // (the bias as the many-row path adds it, lane by lane)
      for (int c = 0; c < nr; ++c)
        p.y[r * p.out_features + col + c] = out[r * kLinCols + c] + (p.bias ? p.bias[col + c] : 0.f);
  }
}

// More rows: each item's weight rows decoded into the per-thread buffer (in L1) per block of
// rows of x (in L2), small_linear's tiles on it, then the offsets as quant_tile adds them.
// The decode is repeated per block: its arithmetic is a few operations a weight against a
// block's rows of FMAs.
template <int Type>
void quant_many_rows(const QuantLinearParams& p, float* g, float* offsets, const float* sx, int64_t thread,
                     int64_t threads) {
  const QuantFormat f = quant_format(Type);
  const int64_t row_bytes = p.in_features / f.block_elems * f.block_bytes, stride = padded_groups(p.in_features);
  const int64_t num_items = (p.out_features + kLinCols - 1) / kLinCols, block = row_block(p.in_features);
  // each thread its share of the weight rows (what schedule(static) gives), for every block
  const int64_t first = num_items * thread / threads, last = num_items * (thread + 1) / threads;
  for (int64_t row0 = 0; row0 < p.rows; row0 += block) {
    const int64_t rows = p.rows - row0 < block ? p.rows - row0 : block;
    const float* x = p.x + row0 * p.in_features;
    const float* block_sx = sx + row0 * stride;
    for (int64_t item = first; item < last; ++item) {
      const int64_t col = item * kLinCols;
      const int nr = static_cast<int>(p.out_features - col < kLinCols ? p.out_features - col : kLinCols);
      for (int c = 0; c < nr; ++c)
        decode_row<Type>(p.w + (col + c) * row_bytes, p.in_features, g + c * p.in_features,
                         kHasOffset<Type> ? offsets + c * stride : nullptr);
      const Vec bias = bias_lanes(p.bias, col, nr);
      float* y = p.y + row0 * p.out_features + col;
      tile_sums(x, g, p.in_features, nr, rows, [&](int64_t row, int mr, Vec sums) {
        // the offsets' share, as add_offsets computes it (stride: whole vectors)
        if constexpr (kHasOffset<Type>) sums = vadd(sums, tile_lanes(mr, nr, block_sx + row * stride, offsets, stride));
        store_tile(vadd(sums, bias), mr, nr, y + row * p.out_features, p.out_features);
      });
    }
  }
}

template <int Type>
void quant_linear_of(const QuantLinearParams& p) {
  const int64_t stride = padded_groups(p.in_features);
#ifdef _OPENMP
#pragma omp parallel num_threads(p.num_threads)
#endif
  {
#ifdef _OPENMP
    const int64_t thread = omp_get_thread_num(), threads = omp_get_num_threads();
#else
    const int64_t thread = 0, threads = 1;
#endif
    float* scratch = p.scratch + thread * quant_scratch_floats(p.rows, p.in_features);
    // (layout: quant_params.h's quant_scratch_floats)
    float* g = scratch;
    float* offsets = g + kQuantScratchRows * p.in_features;  // [kQuantScratchRows, stride], zero-padded
    float* sx = offsets + kQuantScratchRows * stride;         // [rows, stride]
    if constexpr (kHasOffset<Type>) {  // (each thread its own)
      for (int64_t i = 0; i < kQuantScratchRows * stride; ++i) offsets[i] = 0.f;
      group_sums(p.x, p.rows, p.in_features, sx, stride);
    }
    if (p.rows <= kLinRows)
      quant_few_rows<Type>(p, g, offsets, sx);
    else
      quant_many_rows<Type>(p, g, offsets, sx, thread, threads);
  }
}

void quant_linear(const QuantLinearParams& p) { CHUNK_ATTN_FOR_QUANT_TYPE(quant_linear_of, p) }
#undef CHUNK_ATTN_FOR_QUANT_TYPE

}  // namespace CHUNK_ATTN_ISA
}  // namespace chunk_attn_cpu
