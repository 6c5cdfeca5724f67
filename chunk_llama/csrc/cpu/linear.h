// A linear layer of few rows, written once against the lane API: y = x W^T (+ bias).
//
// A decode step multiplies a few rows (one per sequence) by every weight matrix of the
// model, so it reads the weights once and does few FLOPs per byte: BLAS's blocked GEMM,
// built for many rows, reaches a third of the FMA rate there. Here a tile is kLinRows
// rows of x against kLinCols rows of W (kLinRows * kLinCols = kLanes accumulators),
// dot products along in_features a vector at a time from both row-major operands (W
// read in place, no packing), then one vsum_lanes turns the tile's accumulators into
// its kLanes results. Work item = kLinCols rows of W against all rows of x: those W
// rows stay in L1 while every x tile (in L2) passes them.
#pragma once

namespace chunk_attn_cpu {
namespace CHUNK_ATTN_ISA {

constexpr int kLinCols = kLanes >= 8 ? 4 : 2;  // rows of W per tile
constexpr int kLinRows = kLanes / kLinCols;    // rows of x per tile
static_assert(kLinRows * kLinCols == kLanes, "a tile's accumulators reduce with one vsum_lanes");

// The MR x NR tile's dot products into out[r * NR + c] (MR <= kLinRows, NR <= kLinCols).
template <int MR, int NR>
__attribute__((nothrow)) inline void linear_tile(const float* x, const float* w, int64_t in_features, float* out) {
  Vec acc[kLanes];
#pragma GCC unroll 16
  for (int i = 0; i < kLanes; ++i) acc[i] = vzero();
  int64_t i = 0;
  for (; i + kLanes <= in_features; i += kLanes) {
    Vec wv[NR];
#pragma GCC unroll 4
    for (int c = 0; c < NR; ++c) wv[c] = vload(w + c * in_features + i), vpin(wv[c]);
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) {
      const Vec xv = vload(x + r * in_features + i);
#pragma GCC unroll 4
      for (int c = 0; c < NR; ++c) acc[r * NR + c] = vfma(xv, wv[c], acc[r * NR + c]);
    }
  }
  alignas(64) float sums[kLanes];
  vstore(sums, vsum_lanes(acc));  // the unused accumulators of a narrower tile add up to 0
  for (; i < in_features; ++i)    // in_features not a multiple of kLanes: the rest one by one
    for (int r = 0; r < MR; ++r)
      for (int c = 0; c < NR; ++c) sums[r * NR + c] += x[r * in_features + i] * w[c * in_features + i];
  for (int t = 0; t < MR * NR; ++t) out[t] = sums[t];
}

// Calls linear_tile<mr, nr> for run-time mr <= kLinRows, nr <= kLinCols. (nothrow, which
// GCC cannot infer for these interposable templates: otherwise the parallel loop that
// calls them gets unwinding data naming a symbol outside the variant's namespace.)
template <int MR = kLinRows, int NR = kLinCols>
__attribute__((nothrow)) inline void any_tile(int mr, int nr, const float* x, const float* w, int64_t in_features, float* out) {
  if constexpr (MR >= 1 && NR >= 1) {
    if (mr < MR) return any_tile<MR - 1, NR>(mr, nr, x, w, in_features, out);
    if (nr < NR) return any_tile<MR, NR - 1>(mr, nr, x, w, in_features, out);
    linear_tile<MR, NR>(x, w, in_features, out);
  }
}

void small_linear(const LinearParams& p) {
  const int64_t num_items = (p.out_features + kLinCols - 1) / kLinCols;
#ifdef _OPENMP
#pragma omp parallel for num_threads(p.num_threads) schedule(static)
#endif
  for (int64_t item = 0; item < num_items; ++item) {
    const int64_t col = item * kLinCols;
    const int nr = static_cast<int>(p.out_features - col < kLinCols ? p.out_features - col : kLinCols);
    for (int64_t row = 0; row < p.rows; row += kLinRows) {
      const int mr = static_cast<int>(p.rows - row < kLinRows ? p.rows - row : kLinRows);
      float out[kLanes];
      any_tile(mr, nr, p.x + row * p.in_features, p.w + col * p.in_features, p.in_features, out);
      for (int r = 0; r < mr; ++r)
        for (int c = 0; c < nr; ++c)
          p.y[(row + r) * p.out_features + col + c] = out[r * nr + c] + (p.bias ? p.bias[col + c] : 0.f);
    }
  }
}

}  // namespace CHUNK_ATTN_ISA
}  // namespace chunk_attn_cpu
