// Linear layers on weights in GGML's block formats, y = x W^T (+ bias), written once for
// every variant against the lane API: included by kernel.h after quant.h.
//
// A tile is small_linear's (kLinRows rows of x against kLinCols weight rows, kLanes
// accumulators, one vsum_lanes at the end), on each group's affine form (decode_affine):
// the lane-wise products of x with the integers q, summed over the group (or each half of
// it, for Q6_K), times the group's scale a into the accumulator; each group's offset b
// times the group's sum of x (sx, once per call) into one float per output. That is the
// dequantized weight's dot product in real numbers, rounded in another order; it costs one
// conversion and about one FMA per weight, where decoding each weight exactly first (a
// multiply and an add, kept apart for gguf-py's rounding) doubled the arithmetic, and
// that arithmetic, not the memory, bounded a decode step.
//
// Where the groups come from: a decode step (up to kLinRows rows) decodes each from the
// blocks in registers just before its FMAs (FromBlocks), so the weights are read once, in
// their compact form. More rows, and a last item of fewer than kLinCols weight rows:
// each item's weight rows are decoded once into a per-thread buffer of q, a and b that
// stays in L1 while every tile of x passes it (FromBuffer). Both run the same arithmetic
// in the same order, so a row's result does not depend on how many rows came with it.
#pragma once

namespace chunk_attn_cpu {
namespace CHUNK_ATTN_ISA {

static_assert(kLinCols <= kQuantScratchRows, "an item's weight rows must fit the caller's scratch");

// Groups decoded from the blocks of kLinCols consecutive weight rows (w: the first).
template <int Type>
struct FromBlocks {
  const uint8_t* w;
  int64_t row_bytes;
  inline void operator()(int c, int64_t group, Vec* q, Vec* a, float* b) const {
    decode_affine<Type>(w + c * row_bytes, group, q, a, b);
  }
  // The next item's blocks (the kLinCols rows after these, contiguous), a group's share
  // per group: the hardware's stride prefetch alone left a decode step waiting on memory
  // (the blocks are read once, from DRAM, and a few hundred bytes per row are too short a
  // stream to train it).
  inline void prefetch(int64_t group, int64_t groups) const {
    const int64_t item_bytes = kLinCols * row_bytes;
    const uint8_t* next = w + item_bytes;
    for (int64_t at = group * item_bytes / groups & ~int64_t{63}; at < (group + 1) * item_bytes / groups; at += 64)
      __builtin_prefetch(next + at);
  }
};

// Groups decoded into buffers: q [kLinCols, in_features], a [kLinCols, groups, 2],
// b [kLinCols, groups].
struct FromBuffer {
  const float *q, *a, *b;
  int64_t in_features, groups;
  inline void prefetch(int64_t, int64_t) const {}  // (in L1)
  inline void operator()(int c, int64_t group, Vec* qv, Vec* av, float* bv) const {
#pragma GCC unroll 8
    for (int v = 0; v < kGroupVecs; ++v) qv[v] = vload(q + c * in_features + group * kGroup + v * kLanes);
    av[0] = vset1(a[(c * groups + group) * 2]);
    av[1] = vset1(a[(c * groups + group) * 2 + 1]);
    *bv = b[c * groups + group];
  }
};

template <int Type>
__attribute__((nothrow)) inline void buffer_row(const uint8_t* row, int64_t in_features, float* q, float* a,
                                                float* b) {
  for (int64_t group = 0; group < in_features / kGroup; ++group) {
    Vec qv[kGroupVecs], av[2];
    decode_affine<Type>(row, group, qv, av, b + group);
    for (int v = 0; v < kGroupVecs; ++v) vstore(q + group * kGroup + v * kLanes, qv[v]);
    a[2 * group] = vreduce_max(av[0]);  // (every lane holds it)
    a[2 * group + 1] = vreduce_max(av[1]);
  }
}

// a * b rounded to float before whatever add follows: every instantiation of a tile then
// rounds its offsets alike (the compiler may contract a product and an add into an FMA in
// one and not in another, which made a row's result depend on the path by an ulp).
inline float product(float a, float b) {
  float p = a * b;
#if defined(__x86_64__) || defined(_M_X64)
  asm("" : "+x"(p));
#elif defined(__aarch64__)
  asm("" : "+w"(p));
#endif
  return p;
}

// sx [rows, groups]: each group's sum of x [rows, in_features], in one fixed order.
__attribute__((nothrow)) inline void group_sums(const float* x, int64_t rows, int64_t in_features, float* sx) {
  const int64_t groups = in_features / kGroup;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t group = 0; group < groups; ++group) {
      const float* xg = x + r * in_features + group * kGroup;
      Vec s = vload(xg);
      for (int v = 1; v < kGroupVecs; ++v) s = vadd(s, vload(xg + v * kLanes));
      sx[r * groups + group] = vreduce_add(s);
    }
}

// The MR x kLinCols tile's dot products into out[r * kLinCols + c] (x: MR rows; sx: their
// group sums, read for formats with an offset). (Templates called in a parallel loop are
// marked nothrow, as in linear.h.)
template <int Type, int MR, class Source>
__attribute__((nothrow)) inline void affine_tile(const float* x, const float* sx, int64_t in_features,
                                                 const Source& source, float* out) {
  using T = Affine<Type>;
  constexpr int kPart = T::kHalves ? kGroupVecs / 2 : kGroupVecs;  // vectors under one scale
  const int64_t groups = in_features / kGroup;
  Vec acc[kLanes];
#pragma GCC unroll 16
  for (int i = 0; i < kLanes; ++i) acc[i] = vzero();
  float offset[MR * kLinCols] = {};
  for (int64_t group = 0; group < groups; ++group) {
    source.prefetch(group, groups);
#pragma GCC unroll 4
    for (int c = 0; c < kLinCols; ++c) {
      Vec q[kGroupVecs], a[2];
      float b;
      source(c, group, q, a, &b);
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r) {
        const float* xg = x + r * in_features + group * kGroup;
        Vec& sum = acc[r * kLinCols + c];
        if constexpr (!T::kScaled) {
#pragma GCC unroll 8
          for (int v = 0; v < kGroupVecs; ++v) sum = vfma(vload(xg + v * kLanes), q[v], sum);
        } else {
#pragma GCC unroll 2
          for (int first = 0; first < kGroupVecs; first += kPart) {
            Vec part = vmul(vload(xg + first * kLanes), q[first]);
#pragma GCC unroll 8
            for (int v = first + 1; v < first + kPart; ++v) part = vfma(vload(xg + v * kLanes), q[v], part);
            sum = vfma(part, a[first / kPart], sum);
          }
        }
        if constexpr (T::kOffset) offset[r * kLinCols + c] += product(b, sx[r * groups + group]);
      }
    }
  }
  alignas(64) float sums[kLanes];
  vstore(sums, vsum_lanes(acc));  // the unused accumulators of a shorter tile add up to 0
  for (int t = 0; t < MR * kLinCols; ++t) out[t] = sums[t] + offset[t];
}

template <int Type, class Source, int MR = kLinRows>
__attribute__((nothrow)) inline void any_affine_tile(int mr, const float* x, const float* sx, int64_t in_features,
                                                     const Source& source, float* out) {
  if constexpr (MR >= 1) {
    if (mr < MR) return any_affine_tile<Type, Source, MR - 1>(mr, x, sx, in_features, source, out);
    affine_tile<Type, MR>(x, sx, in_features, source, out);
  }
}

template <int Type>
void quant_linear_of(const QuantLinearParams& p) {
  const QuantFormat f = quant_format(Type);
  const int64_t row_bytes = p.in_features / f.block_elems * f.block_bytes, groups = p.in_features / kGroup;
  const int64_t num_items = (p.out_features + kLinCols - 1) / kLinCols;
  const bool few_rows = p.rows <= kLinRows;
#ifdef _OPENMP
#pragma omp parallel num_threads(p.num_threads)
#endif
  {
#ifdef _OPENMP
    float* scratch = p.scratch + omp_get_thread_num() * quant_scratch_floats(p.rows, p.in_features);
#else
    float* scratch = p.scratch;
#endif
    // (layout: quant_params.h's quant_scratch_floats)
    float* q = scratch;
    float* a = q + kQuantScratchRows * p.in_features;
    float* b = a + kQuantScratchRows * groups * 2;
    float* sx = b + kQuantScratchRows * groups;
    if constexpr (Affine<Type>::kOffset) group_sums(p.x, p.rows, p.in_features, sx);  // (each thread its own)
    const FromBuffer buffered{q, a, b, p.in_features, groups};
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
    for (int64_t item = 0; item < num_items; ++item) {
      const int64_t col = item * kLinCols;
      const int nr = static_cast<int>(p.out_features - col < kLinCols ? p.out_features - col : kLinCols);
      const bool in_registers = few_rows && nr == kLinCols;
      if (!in_registers)
        for (int c = 0; c < kLinCols; ++c) {
          if (c < nr) {
            buffer_row<Type>(p.w + (col + c) * row_bytes, p.in_features, q + c * p.in_features, a + c * groups * 2,
                             b + c * groups);
          } else {  // a missing weight row: zeros, its outputs unused
            for (int64_t i = 0; i < p.in_features; ++i) q[c * p.in_features + i] = 0.f;
            for (int64_t i = 0; i < groups; ++i) a[(c * groups + i) * 2] = a[(c * groups + i) * 2 + 1] = b[c * groups + i] = 0.f;
          }
        }
      const FromBlocks<Type> blocks{p.w + col * row_bytes, row_bytes};
      for (int64_t row = 0; row < p.rows; row += kLinRows) {
        const int mr = static_cast<int>(p.rows - row < kLinRows ? p.rows - row : kLinRows);
        const float* x = p.x + row * p.in_features;
        const float* row_sx = sx + row * groups;
        float out[kLanes];
        if (in_registers)
          any_affine_tile<Type>(mr, x, row_sx, p.in_features, blocks, out);
        else
          any_affine_tile<Type>(mr, x, row_sx, p.in_features, buffered, out);
        for (int r = 0; r < mr; ++r)
          for (int c = 0; c < nr; ++c)
            p.y[(row + r) * p.out_features + col + c] = out[r * kLinCols + c] + (p.bias ? p.bias[col + c] : 0.f);
      }
    }
  }
}

void quant_linear(const QuantLinearParams& p) { CHUNK_ATTN_FOR_QUANT_TYPE(quant_linear_of, p) }
#undef CHUNK_ATTN_FOR_QUANT_TYPE

}  // namespace CHUNK_ATTN_ISA
}  // namespace chunk_attn_cpu
