// Prefill attention of the CPU kernel, written once against the lane API, reusing
// phase 1's register-tiled S^T = K Q^T and O^T = V^T P^T steps (chunk_first.h).
//
// Work item = (tile of at most kRowsPerItem query rows of one sequence, KV head);
// rows are the GQA group's heads of consecutive new tokens (prefill_params.h). The
// item walks the sequence's segments in place from the pool, from the first to the one
// holding its last query's position, FlashAttention style: per segment and block of
// kRowVecs * kLanes rows, the scores, the causal mask (only in chunks that reach past
// a row's position), the online-softmax update in the log2 domain and O += P V. No
// gather and no mask tensor: memory is the item's Q^T and O^T and a block's scores.
#pragma once

namespace chunk_attn_cpu {
namespace CHUNK_ATTN_ISA {

// Calls f(RowVecs<vectors>{}) for a run-time vectors in [1, RV]: each block width is
// its own instantiation of the register tiles.
template <int N>
struct RowVecs {
  static constexpr int value = N;
};
template <int RV, typename F>
inline void with_row_vecs(int vectors, F&& f) {
  if constexpr (RV >= 1) {
    if (vectors == RV)
      f(RowVecs<RV>{});
    else
      with_row_vecs<RV - 1>(vectors, f);
  }
}

inline void store_scalar(float* p, int64_t i, float x) { p[i] = x; }
inline void store_scalar(uint16_t* p, int64_t i, float x) { p[i] = float_to_bf16(x); }

// Causal mask of one block: key j of the chunk (position key0 + j) is hidden from row
// r when it lies after the row's position pos[r]. st: [num_keys][L].
template <int L>
inline void causal_mask(float* st, int num_keys, int64_t key0, const int64_t* pos) {
  for (int r = 0; r < L; ++r) {
    const int64_t visible = pos[r] - key0 + 1;
    for (int64_t j = visible > 0 ? visible : 0; j < num_keys; ++j) st[j * L + r] = kNegInf;
  }
}

// V's row stride for O^T = V^T P^T, which walks V a column of kPvDims values at a time
// down all the chunk's rows: at D >= 128 (512 bytes or more) those rows fall into one
// eighth of L1's sets or fewer and evict each other, so V is copied to rows 16 floats
// (a cache line) longer: D = 128 ran 4% faster (one thread, 1,024 tokens). At D = 64
// the rows spread over enough sets and the copy only cost time (about 5%).
template <int D>
constexpr int kVStride = D >= 128 ? D + 16 : D;

// A chunk's V as fp32 rows of kVStride<D>: in place where that is its own layout.
template <int D, typename T>
inline const float* v_rows(const T* src, int64_t rows, float* buf) {
  if constexpr (kVStride<D> == D) return as_float(src, rows * D, buf);
  for (int64_t j = 0; j < rows; ++j)
    for (int i = 0; i < D; i += kLanes) vstore(buf + j * kVStride<D> + i, vload(src + j * D + i));
  return buf;
}

template <typename T, int D>
void prefill_item(const PrefillParams& p, int tile, int kv_head, float* ws) {
  constexpr int R = kRowsPerItem;
  // Row stride of Q^T and O^T: not R (512 bytes), whose multiples map every dimension's
  // row to one eighth of L1's sets, so that a block's columns evicted each other (D = 128
  // ran at 48 GFLOP/s against 65 with this stride, 2 threads, 2,048 tokens); 9 cache
  // lines apart they use every set.
  constexpr int kStride = R + 16;
  const int C = p.chunk_size, H = p.num_heads, group = H / p.num_kv_heads;
  const int64_t seq = p.tiles[3 * tile], row_begin = p.tiles[3 * tile + 1];
  const int num_rows = static_cast<int>(p.tiles[3 * tile + 2] - row_begin);
  const int padded = static_cast<int>(round_up(num_rows, kLanes));
  float* qt = ws;                         // Q^T [D][kStride], pre-scaled by scale * log2 e
  float* ot = qt + kStride * D;           // O^T [D][kStride]
  float* m = ot + kStride * D;            // [R]
  float* n = m + R;                       // [R]
  float* st = n + R;                      // [C][kMaxBlockRows]
  float* k_buf = st + C * kMaxBlockRows;  // [C][D] (bf16 storage)
  float* v_buf = k_buf + C * D;           // [C][kVStride<D>], fp32 (see v_rows)
  // Each row's position in its sequence; padding rows see every key (their zero
  // queries give finite scores that are never written out).
  int64_t pos[R];
  const int64_t q_start = p.q_start[seq], token_start = p.token_start[seq];
  const T* q = static_cast<const T*>(p.q);
  const float qs = p.scale * kLog2e;
  for (int r = 0; r < num_rows; ++r) {
    const int64_t row = row_begin + r, token = row / group;
    pos[r] = q_start + token;
    const int64_t src = ((token_start + token) * H + kv_head * group + row % group) * D;
    for (int d = 0; d < D; ++d) qt[d * kStride + r] = load_scalar(q, src + d) * qs;
  }
  for (int r = num_rows; r < padded; ++r) {
    pos[r] = INT64_MAX / 2;  // past every key, without overflow in causal_mask
    for (int d = 0; d < D; ++d) qt[d * kStride + r] = 0.f;
  }
  for (int d = 0; d < D; ++d)
    for (int r = 0; r < padded; ++r) ot[d * kStride + r] = 0.f;
  for (int r = 0; r < padded; ++r) m[r] = kNegInf, n[r] = 0.f;

  // Under a sliding window, each row's first visible position (rows are in position
  // order, so lo rises with them); the walk starts at the segment of the first row's.
  int64_t lo[R];
  for (int r = 0; r < padded; ++r) lo[r] = window_start(pos[r], p.window);
  const int64_t last_pos = pos[num_rows - 1];
  const int64_t* chunk_ids = p.seg_chunk + seq * p.max_segments;
  const int64_t* starts = p.seg_start + seq * p.max_segments;
  const int64_t* positions = p.seg_pos + seq * p.max_segments;
  const T* k_cache = static_cast<const T*>(p.k_cache);
  const T* v_cache = static_cast<const T*>(p.v_cache);
  // Segment i holds positions [positions[i], the next one's); keys past the item's last
  // position are hidden from every row and not read at all.
  const auto segment_end = [&](int i) {
    const int64_t next = i + 1 < p.max_segments ? positions[i + 1] : kNoPosition;
    return next < last_pos + 1 ? next : last_pos + 1;
  };
  int first = 0;
  while (first + 1 < p.max_segments && segment_end(first) <= lo[0]) ++first;
  // Segments outermost: a segment's K and V stay in L2 (or L1) for all the item's blocks.
  // Blocks outermost instead (each block's Q^T and O^T kept in L1, the sequence's K/V
  // streamed once per block) ran about 20% slower: a long prompt's K/V do not fit L2.
  for (int i = first; i < p.max_segments && positions[i] <= last_pos; ++i) {
    const int64_t key0 = positions[i];
    const int count = static_cast<int>(segment_end(i) - key0);
    const int64_t base = chunk_offset(p.num_kv_heads, C, D, chunk_ids[i], kv_head) + starts[i] * D;
    // the score tiles' keys: up to kKeyTile - 1 rows past the segment (inside the pool)
    const int64_t elems_read = round_up(count, kKeyTile) * D;
    const float* k = as_float(k_cache + base, elems_read, k_buf);
    const float* v = v_rows<D>(v_cache + base, elems_read / D, v_buf);
    Prefetch next{};  // the next segment's K and V, spread over the first block's key tiles
    if (i + 1 < p.max_segments && positions[i + 1] <= last_pos) {
      const int64_t at = chunk_offset(p.num_kv_heads, C, D, chunk_ids[i + 1], kv_head) + starts[i + 1] * D;
      next = Prefetch{reinterpret_cast<const char*>(k_cache + at), reinterpret_cast<const char*>(v_cache + at),
                      static_cast<int64_t>(C) * D * static_cast<int64_t>(sizeof(T))};
    }
    for (int b = 0; b < padded; b += kRowVecs * kLanes) {
      const int vectors = (padded - b) / kLanes < kRowVecs ? (padded - b) / kLanes : kRowVecs;
      const int last_row = (b + vectors * kLanes < num_rows ? b + vectors * kLanes : num_rows) - 1;
      // keys of this segment the block's last row sees (rows are in position order)
      const int64_t seen = pos[last_row] - key0 + 1;
      if (seen <= 0) continue;  // the segment lies after all the block's rows
      if (key0 + count <= lo[b]) continue;  // ... or before all their windows
      const int num_keys = static_cast<int>(seen < count ? seen : count);
      const bool diagonal = key0 + num_keys - 1 > pos[b];  // some row sees fewer keys
      const bool windowed = key0 < lo[last_row];            // some row's window starts later
      with_row_vecs<kRowVecs>(vectors, [&](auto rv) {
        constexpr int RV = decltype(rv)::value;
        alignas(64) float corr[RV * kLanes];
        block_scores<D, RV>(qt + b, kStride, k, static_cast<int>(round_up(num_keys, kKeyTile)), st, next);
        if (diagonal) causal_mask<RV * kLanes>(st, num_keys, key0, pos + b);
        if (windowed) window_mask<RV * kLanes>(st, num_keys, key0, lo + b);
        block_softmax<RV>(st, num_keys, m + b, n + b, corr);
        block_pv<D, RV, kStride, kVStride<D>>(v, num_keys, st, corr, ot + b);
      });
      next = Prefetch{};
    }
  }
  T* out = static_cast<T*>(p.out);
  for (int r = 0; r < num_rows; ++r) {
    const int64_t row = row_begin + r;
    const int64_t dst = ((token_start + row / group) * H + kv_head * group + row % group) * D;
    const float inv = 1.f / n[r];
    for (int d = 0; d < D; ++d) store_scalar(out, dst + d, ot[d * kStride + r] * inv);
  }
}

template <typename T, int D>
void prefill(const PrefillParams& p) {
  // Tiles come most work first: dynamic scheduling then balances the threads (LPT).
  const int num_items = p.num_tiles * p.num_kv_heads;
#ifdef _OPENMP
#pragma omp parallel for num_threads(p.num_threads) schedule(dynamic, 1)
#endif
  for (int i = 0; i < num_items; ++i) {
#ifdef _OPENMP
    float* ws = p.workspace + omp_get_thread_num() * p.workspace_stride;
#else
    float* ws = p.workspace;
#endif
    prefill_item<T, D>(p, i / p.num_kv_heads, i % p.num_kv_heads, ws);
  }
}

// The caller checked supports(chunk_size, head_dim), the tiles and sized the workspace.
void tpp_prefill(const PrefillParams& p) {
  const bool bf16 = p.dtype == DType::kBFloat16;
  switch (p.head_dim) {
    case 64: return bf16 ? prefill<uint16_t, 64>(p) : prefill<float, 64>(p);
    case 128: return bf16 ? prefill<uint16_t, 128>(p) : prefill<float, 128>(p);
    default: return bf16 ? prefill<uint16_t, 256>(p) : prefill<float, 256>(p);
  }
}

}  // namespace CHUNK_ATTN_ISA
}  // namespace chunk_attn_cpu
