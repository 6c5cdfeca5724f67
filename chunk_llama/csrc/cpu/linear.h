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

// Advances the MR x NR tile's accumulators (acc[r * NR + c]) over in_features [i0, i1),
// whole vectors: each output's FMAs in order along in_features, wherever its accumulator
// is kept between calls.
template <int MR, int NR>
__attribute__((nothrow)) inline void linear_fmas(const float* x, const float* w, int64_t in_features, int64_t i0,
                                                 int64_t i1, Vec* acc) {
  for (int64_t i = i0; i + kLanes <= i1; i += kLanes) {
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
}

// The MR x NR tile's dot products over whole vectors of in_features: lane r * NR + c of
// the result (the lanes past MR * NR are 0).
template <int MR, int NR>
__attribute__((nothrow)) inline Vec linear_sums(const float* x, const float* w, int64_t in_features) {
  Vec acc[kLanes];
#pragma GCC unroll 16
  for (int i = 0; i < kLanes; ++i) acc[i] = vzero();
  linear_fmas<MR, NR>(x, w, in_features, 0, in_features, acc);
  return vsum_lanes(acc);  // the unused accumulators of a narrower tile add up to 0
}

// The MR x NR tile's dot products into out[r * NR + c]: linear_sums, then the rest of
// in_features (not a multiple of kLanes) one by one.
template <int MR, int NR>
__attribute__((nothrow)) inline void linear_tile(const float* x, const float* w, int64_t in_features, float* out) {
  alignas(64) float sums[kLanes];
  vstore(sums, linear_sums<MR, NR>(x, w, in_features));
  for (int64_t i = in_features / kLanes * kLanes; i < in_features; ++i)
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

// in_features a work item's kLinCols rows of W take in L1 at once: wider rows are taken a
// part at a time, each tile's accumulators kept in a buffer in between, kSplitRows rows
// of x at a time (1,536 weights a row ran 7% faster so).
constexpr int64_t kSplitK = 768;
constexpr int kSplitRows = 16 * kLinRows;

// A tile of mr <= kLinRows rows of x and nr <= kLinCols rows of w, as a vector (lane r *
// kLinCols + c; the lanes past mr or nr 0): linear_sums for a whole tile, any_tile else
// (the same FMAs and tree for each output).
__attribute__((nothrow)) inline Vec tile_lanes(int mr, int nr, const float* x, const float* w, int64_t in_features) {
  if (mr == kLinRows && nr == kLinCols && in_features % kLanes == 0)
    return linear_sums<kLinRows, kLinCols>(x, w, in_features);
  float sums[kLanes];
  alignas(64) float lanes[kLanes] = {};
  any_tile(mr, nr, x, w, in_features, sums);
  for (int r = 0; r < mr; ++r)
    for (int c = 0; c < nr; ++c) lanes[r * kLinCols + c] = sums[r * nr + c];
  return vload(lanes);
}

// x [rows, in_features] (row stride in_features) against the first nr of kLinCols rows of
// w: emit(row, mr, sums) per tile of mr <= kLinRows rows from `row`, sums' lane r * kLinCols
// + c the dot product of row + r and column c (no bias; lanes past mr or nr: garbage).
// Whole tiles come from linear_sums, the rest through any_tile: each output's FMAs are
// linear_fmas' in either case, so a row's results do not depend on the rows beside it.
template <typename Emit>
__attribute__((nothrow)) inline void tile_sums(const float* x, const float* w, int64_t in_features, int nr,
                                               int64_t rows, Emit&& emit) {
  const int64_t whole = nr == kLinCols && in_features % kLanes == 0 ? rows / kLinRows * kLinRows : 0;
  if (in_features <= kSplitK) {
    for (int64_t row = 0; row < whole; row += kLinRows)
      emit(row, kLinRows, linear_sums<kLinRows, kLinCols>(x + row * in_features, w, in_features));
  } else {
    const int64_t parts = (in_features + kSplitK - 1) / kSplitK, vectors = in_features / kLanes;
    Vec acc[kSplitRows / kLinRows][kLanes];
    for (int64_t row0 = 0; row0 < whole; row0 += kSplitRows) {
      const int tiles = static_cast<int>((whole - row0 < kSplitRows ? whole - row0 : kSplitRows) / kLinRows);
      for (int t = 0; t < tiles; ++t)
        for (int i = 0; i < kLanes; ++i) acc[t][i] = vzero();
      for (int64_t part = 0; part < parts; ++part)
        for (int t = 0; t < tiles; ++t)
          linear_fmas<kLinRows, kLinCols>(x + (row0 + t * kLinRows) * in_features, w, in_features,
                                          vectors * part / parts * kLanes, vectors * (part + 1) / parts * kLanes,
                                          acc[t]);
      for (int t = 0; t < tiles; ++t) emit(row0 + t * kLinRows, kLinRows, vsum_lanes(acc[t]));
    }
  }
  for (int64_t row = whole; row < rows; row += kLinRows) {  // the rest: narrower tiles
    const int mr = static_cast<int>(rows - row < kLinRows ? rows - row : kLinRows);
    emit(row, mr, tile_lanes(mr, nr, x + row * in_features, w, in_features));
  }
}

// Lane r * kLinCols + c: the bias of column col + c (0 without a bias or past nr).
__attribute__((nothrow)) inline Vec bias_lanes(const float* bias, int64_t col, int nr) {
  alignas(64) float lanes[kLanes];
  for (int t = 0; t < kLanes; ++t) lanes[t] = bias && t % kLinCols < nr ? bias[col + t % kLinCols] : 0.f;
  return vload(lanes);
}

// The mr rows of a tile's results (lane r * kLinCols + c) into y's columns [col, col + nr).
__attribute__((nothrow)) inline void store_tile(Vec v, int mr, int nr, float* y, int64_t out_features) {
  alignas(64) float lanes[kLanes];
  vstore(lanes, v);
  if (mr == kLinRows && nr == kLinCols) {  // (sizes the compiler knows: a few vector moves)
    for (int r = 0; r < kLinRows; ++r) std::memcpy(y + r * out_features, lanes + r * kLinCols, sizeof(float) * kLinCols);
    return;
  }
  for (int r = 0; r < mr; ++r)
    for (int c = 0; c < nr; ++c) y[r * out_features + c] = lanes[r * kLinCols + c];
}

// Rows of x one pass over W takes (a multiple of kLinRows): as many as fit kRowBlockBytes,
// so that the block stays in L2 while each work item's W rows, in L1, pass over it.
constexpr int64_t kRowBlockBytes = 256 << 10;
inline int64_t row_block(int64_t in_features) {
  const int64_t fit = kRowBlockBytes / (static_cast<int64_t>(sizeof(float)) * (in_features > 0 ? in_features : 1));
  return fit / kLinRows * kLinRows > kLinRows ? fit / kLinRows * kLinRows : kLinRows;
}

void small_linear(const LinearParams& p) {
  const int64_t num_items = (p.out_features + kLinCols - 1) / kLinCols, block = row_block(p.in_features);
#ifdef _OPENMP
#pragma omp parallel num_threads(p.num_threads)
#endif
  {
#ifdef _OPENMP
    const int64_t thread = omp_get_thread_num(), threads = omp_get_num_threads();
#else
    const int64_t thread = 0, threads = 1;
#endif
    // each thread its share of W's rows (what schedule(static) gives), for every block of x
    const int64_t first = num_items * thread / threads, last = num_items * (thread + 1) / threads;
    for (int64_t row0 = 0; row0 < p.rows; row0 += block) {
      const int64_t rows = p.rows - row0 < block ? p.rows - row0 : block;
      for (int64_t item = first; item < last; ++item) {
        const int64_t col = item * kLinCols;
        const int nr = static_cast<int>(p.out_features - col < kLinCols ? p.out_features - col : kLinCols);
        float* y = p.y + row0 * p.out_features + col;
        if (rows < kLinRows) {  // a decode step's few rows: one narrow tile, stored as it comes
          float out[kLanes] = {};  // (any_tile writes rows * nr of them; GCC -O3 cannot see it)
          any_tile(static_cast<int>(rows), nr, p.x + row0 * p.in_features, p.w + col * p.in_features, p.in_features,
                   out);
          for (int64_t r = 0; r < rows; ++r)  // (the bias as store_tile adds it, lane by lane)
            for (int c = 0; c < nr; ++c) y[r * p.out_features + c] = out[r * nr + c] + (p.bias ? p.bias[col + c] : 0.f);
          continue;
        }
        const Vec bias = bias_lanes(p.bias, col, nr);
        tile_sums(p.x + row0 * p.in_features, p.w + col * p.in_features, p.in_features, nr, rows,
                  [&](int64_t row, int mr, Vec sums) { store_tile(vadd(sums, bias), mr, nr, y + row * p.out_features,
                                                                  p.out_features); });
      }
    }
  }
}

}  // namespace CHUNK_ATTN_ISA
}  // namespace chunk_attn_cpu
