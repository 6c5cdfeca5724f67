// Prefill attention of the CPU kernel, written once against the lane API, reusing
// phase 1's register-tiled S^T = K Q^T and O^T = V^T P^T steps (chunk_first.h).
//
// Two phases, as in decode (prefill_params.h has the layout):
// - context items, the chunk-first idea applied to prefill: where the new tokens of
//   several sequences all see a run of context segments whole (their common cached
//   prefix), the queries of all of them, one contiguous run of rows, go against those
//   segments at once, and each row's partial (o, m, n) goes to scratch;
// - tiles: at most kRowsPerItem query rows of one sequence (the GQA group's heads of
//   consecutive new tokens) start from their partials and walk the rest of the
//   sequence's segments, up to the one holding the tile's last position.
// Both walk segments in place from the pool, FlashAttention style: per segment and
// block of kRowVecs * kLanes rows, the scores, the causal mask (only where a segment
// reaches past a row's position), the online-softmax update in the log2 domain and
// O += P V. No gather and no mask tensor: memory is an item's Q^T and O^T, a block's
// scores and the context partials.
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

// An item's query rows: Q^T of rows [row0, row0 + num_rows) of one KV head (global rows,
// row = token * group + head of the group), pre-scaled by scale * log2 e, each row's
// position and window start, and the running (O^T, m, n).
struct ItemRows {
  // Row stride of Q^T and O^T: not kRowsPerItem (512 bytes), whose multiples map every
  // dimension's row to one eighth of L1's sets, so that a block's columns evicted each
  // other (D = 128 ran at 48 GFLOP/s against 65 with this stride, 2 threads, 2,048
  // tokens); 9 cache lines apart they use every set.
  static constexpr int kStride = kRowsPerItem + 16;
  int64_t row0;
  int num_rows, padded;
  float *qt, *ot, *m, *n, *st, *k_buf, *v_buf;  // the thread's workspace
  int64_t pos[kRowsPerItem], lo[kRowsPerItem];
};

template <typename T, int D>
void load_rows(const PrefillParams& p, int kv_head, ItemRows& it, float* ws) {
  constexpr int R = kRowsPerItem, S = ItemRows::kStride;
  const int C = p.chunk_size, H = p.num_heads, group = H / p.num_kv_heads;
  it.padded = static_cast<int>(round_up(it.num_rows, kLanes));
  it.qt = ws;                                 // Q^T [D][S]
  it.ot = it.qt + S * D;                      // O^T [D][S]
  it.m = it.ot + S * D;                       // [R]
  it.n = it.m + R;                            // [R]
  it.st = it.n + R;                           // [C][kMaxBlockRows]
  it.k_buf = it.st + C * kMaxBlockRows;       // [C][D] (bf16 storage)
  it.v_buf = it.k_buf + C * D;                // [C][kVStride<D>], fp32 (see v_rows)
  const T* q = static_cast<const T*>(p.q);
  const float qs = p.scale * kLog2e;
  for (int r = 0; r < it.num_rows; ++r) {
    const int64_t row = it.row0 + r, token = row / group;
    it.pos[r] = p.token_pos[token];
    const int64_t src = (token * H + kv_head * group + row % group) * D;
    for (int d = 0; d < D; ++d) it.qt[d * S + r] = load_scalar(q, src + d) * qs;
  }
  // padding rows see every key (their zero queries give finite scores never written out)
  for (int r = it.num_rows; r < it.padded; ++r) {
    it.pos[r] = INT64_MAX / 2;  // past every key, without overflow in causal_mask
    for (int d = 0; d < D; ++d) it.qt[d * S + r] = 0.f;
  }
  for (int r = 0; r < it.padded; ++r) it.lo[r] = window_start(it.pos[r], p.window);
  for (int d = 0; d < D; ++d)
    for (int r = 0; r < it.padded; ++r) it.ot[d * S + r] = 0.f;
  for (int r = 0; r < it.padded; ++r) it.m[r] = kNegInf, it.n[r] = 0.f;
}

// Attends the item's rows to segments [first, end) of a walk: segment(i, key0, count, at)
// gives segment i's first position, its keys (those the rows may see) and where its K/V
// rows begin in the cache (count 0: none). Rows need not be in position order.
template <typename T, int D, typename Segment>
void attend_segments(const PrefillParams& p, ItemRows& it, int first, int end, Segment segment) {
  constexpr int S = ItemRows::kStride, L = kRowVecs * kLanes;
  // per block of rows: the positions and window starts its rows span
  int64_t min_pos[kRowsPerItem / kLanes], max_pos[kRowsPerItem / kLanes];
  int64_t min_lo[kRowsPerItem / kLanes], max_lo[kRowsPerItem / kLanes];
  for (int b = 0, block = 0; b < it.padded; b += L, ++block) {
    const int last = (b + L < it.num_rows ? b + L : it.num_rows);
    min_pos[block] = min_lo[block] = INT64_MAX;
    max_pos[block] = max_lo[block] = INT64_MIN;
    for (int r = b; r < last; ++r) {
      min_pos[block] = std::min(min_pos[block], it.pos[r]), max_pos[block] = std::max(max_pos[block], it.pos[r]);
      min_lo[block] = std::min(min_lo[block], it.lo[r]), max_lo[block] = std::max(max_lo[block], it.lo[r]);
    }
  }
  const T* k_cache = static_cast<const T*>(p.k_cache);
  const T* v_cache = static_cast<const T*>(p.v_cache);
  int64_t key0 = 0, at = 0, next_key0 = 0, next_at = 0;
  int count = 0, next_count = 0;
  if (first < end) segment(first, key0, count, at);
  // Segments outermost: a segment's K and V stay in L2 (or L1) for all the item's blocks.
  // Blocks outermost instead (each block's Q^T and O^T kept in L1, the sequence's K/V
  // streamed once per block) ran about 20% slower: a long prompt's K/V do not fit L2.
  for (int i = first; i < end; ++i, key0 = next_key0, count = next_count, at = next_at) {
    Prefetch next{};  // the next segment's K and V, spread over the first block's key tiles
    next_count = 0;
    if (i + 1 < end) {
      segment(i + 1, next_key0, next_count, next_at);
      next = Prefetch{reinterpret_cast<const char*>(k_cache + next_at),
                      reinterpret_cast<const char*>(v_cache + next_at),
                      static_cast<int64_t>(next_count) * D * static_cast<int64_t>(sizeof(T))};
    }
    if (count == 0) continue;
    // the score tiles' keys: up to kKeyTile - 1 rows past the segment (inside the pool)
    const int64_t elems_read = round_up(count, kKeyTile) * D;
    const float* k = as_float(k_cache + at, elems_read, it.k_buf);
    const float* v = v_rows<D>(v_cache + at, elems_read / D, it.v_buf);
    for (int b = 0, block = 0; b < it.padded; b += L, ++block) {
      const int vectors = (it.padded - b) / kLanes < kRowVecs ? (it.padded - b) / kLanes : kRowVecs;
      const int64_t seen = max_pos[block] - key0 + 1;  // keys of this segment some row sees
      if (seen <= 0) continue;                          // the segment lies after all the block's rows
      if (key0 + count <= min_lo[block]) continue;      // ... or before all their windows
      const int num_keys = static_cast<int>(seen < count ? seen : count);
      const bool diagonal = key0 + num_keys - 1 > min_pos[block];  // some row sees fewer keys
      const bool windowed = key0 < max_lo[block];                  // some row's window starts later
      with_row_vecs<kRowVecs>(vectors, [&](auto rv) {
        constexpr int RV = decltype(rv)::value;
        alignas(64) float corr[RV * kLanes];
        block_scores<D, RV>(it.qt + b, S, k, static_cast<int>(round_up(num_keys, kKeyTile)), it.st, next);
        if (diagonal) causal_mask<RV * kLanes>(it.st, num_keys, key0, it.pos + b);
        if (windowed) window_mask<RV * kLanes>(it.st, num_keys, key0, it.lo + b);
        block_softmax<RV>(it.st, num_keys, it.m + b, it.n + b, corr);
        block_pv<D, RV, S, kVStride<D>>(v, num_keys, it.st, corr, it.ot + b);
      });
      next = Prefetch{};
    }
  }
}

// Context item: a run of shared context segments against the rows of the sequences
// under it; each row's unnormalised (o, m, n) to the partials.
template <typename T, int D>
void context_item(const PrefillParams& p, int index, int kv_head, float* ws) {
  constexpr int S = ItemRows::kStride;
  const int64_t* item = p.ctx_items + 5 * index;  // first segment, count, row_begin, row_end, partial offset
  ItemRows it;
  it.row0 = item[2];
  it.num_rows = static_cast<int>(item[3] - item[2]);
  load_rows<T, D>(p, kv_head, it, ws);
  const int64_t lowest = *std::min_element(it.lo, it.lo + it.num_rows);
  int first = static_cast<int>(item[0]);
  const int end = first + static_cast<int>(item[1]);
  while (first + 1 < end && p.ctx_pos[first] + p.ctx_len[first] <= lowest) ++first;  // before every window
  attend_segments<T, D>(p, it, first, end, [&](int i, int64_t& key0, int& count, int64_t& at) {
    key0 = p.ctx_pos[i];
    count = static_cast<int>(p.ctx_len[i]);
    at = chunk_offset(p.num_kv_heads, p.chunk_size, D, p.ctx_chunk[i], kv_head) + p.ctx_start[i] * D;
  });
  // the partials of one KV head are [D][rows] like O^T: rows contiguous, copied a dim at a time
  const int64_t partial_rows = p.num_partial_rows * (p.num_heads / p.num_kv_heads);
  const int64_t prow0 = item[4] * (p.num_heads / p.num_kv_heads) + it.row0;
  float* po = p.partial_o + kv_head * D * partial_rows + prow0;
  for (int d = 0; d < D; ++d) std::memcpy(po + d * partial_rows, it.ot + d * S, it.num_rows * sizeof(float));
  std::memcpy(p.partial_m + kv_head * partial_rows + prow0, it.m, it.num_rows * sizeof(float));
  std::memcpy(p.partial_n + kv_head * partial_rows + prow0, it.n, it.num_rows * sizeof(float));
}

// Tile: one sequence's rows, from the partials of the context items over its rows, then
// its own segments from ctx_end on, normalised into the output.
template <typename T, int D>
void prefill_item(const PrefillParams& p, int tile, int kv_head, float* ws) {
  constexpr int S = ItemRows::kStride;
  const int H = p.num_heads, group = H / p.num_kv_heads;
  const int64_t seq = p.tiles[3 * tile];
  ItemRows it;
  it.row0 = p.token_start[seq] * group + p.tiles[3 * tile + 1];
  it.num_rows = static_cast<int>(p.tiles[3 * tile + 2] - p.tiles[3 * tile + 1]);
  load_rows<T, D>(p, kv_head, it, ws);
  // Start from the context partials: the running (O^T, m, n) is an online-softmax state,
  // so each piece's partial merges in as one more block of keys.
  const int64_t partial_rows = p.num_partial_rows * group;
  for (int64_t c = p.seq_ctx_ptr[seq]; c < p.seq_ctx_ptr[seq + 1]; ++c) {
    const int64_t prow0 = p.seq_ctx_offset[c] * group + it.row0;
    const float* m_c = p.partial_m + kv_head * partial_rows + prow0;
    const float* n_c = p.partial_n + kv_head * partial_rows + prow0;
    alignas(64) float own[kRowsPerItem], theirs[kRowsPerItem];
    for (int r = 0; r < it.num_rows; ++r) {
      // m = -inf on both sides (no key seen yet, or every key of that piece before the
      // row's window): nothing to add, and no 2^(-inf + inf)
      const float m_new = std::max(it.m[r], m_c[r]);
      own[r] = m_new == kNegInf ? 1.f : exp2_scalar(it.m[r] - m_new);
      theirs[r] = m_new == kNegInf ? 0.f : exp2_scalar(m_c[r] - m_new);
      it.n[r] = it.n[r] * own[r] + n_c[r] * theirs[r];
      it.m[r] = m_new;
    }
    const float* po = p.partial_o + kv_head * D * partial_rows + prow0;
    for (int d = 0; d < D; ++d) {
      float* ot = it.ot + d * S;
      const float* o_c = po + d * partial_rows;
      for (int r = 0; r < it.num_rows; ++r) ot[r] = ot[r] * own[r] + o_c[r] * theirs[r];
    }
  }
  // Segment i holds positions [positions[i], the next one's); keys past the tile's last
  // position are hidden from every row and not read at all.
  const int64_t last_pos = it.pos[it.num_rows - 1];
  const int64_t* chunk_ids = p.seg_chunk + seq * p.max_segments;
  const int64_t* starts = p.seg_start + seq * p.max_segments;
  const int64_t* positions = p.seg_pos + seq * p.max_segments;
  const auto segment_end = [&](int i) {
    const int64_t next = i + 1 < p.max_segments ? positions[i + 1] : kNoPosition;
    return next < last_pos + 1 ? next : last_pos + 1;
  };
  // from the sequence's first key the context items did not cover, or the first row's window
  const int64_t from = std::max(p.ctx_end[seq], it.lo[0]);
  int first = 0, end = 0;
  while (first + 1 < p.max_segments && segment_end(first) <= from) ++first;
  for (end = first; end < p.max_segments && positions[end] <= last_pos;) ++end;
  attend_segments<T, D>(p, it, first, end, [&](int i, int64_t& key0, int& count, int64_t& at) {
    // a segment the context items covered in part starts at ctx_end
    const int64_t skip = std::max<int64_t>(0, p.ctx_end[seq] - positions[i]);
    key0 = positions[i] + skip;
    count = static_cast<int>(std::max<int64_t>(0, segment_end(i) - key0));
    at = chunk_offset(p.num_kv_heads, p.chunk_size, D, chunk_ids[i], kv_head) + (starts[i] + skip) * D;
  });
  T* out = static_cast<T*>(p.out);
  for (int r = 0; r < it.num_rows; ++r) {
    const int64_t row = it.row0 + r;
    const int64_t dst = ((row / group) * H + kv_head * group + row % group) * D;
    const float inv = 1.f / it.n[r];
    for (int d = 0; d < D; ++d) store_scalar(out, dst + d, it.ot[d * S + r] * inv);
  }
}

template <typename T, int D>
void prefill(const PrefillParams& p) {
  const int num_context = p.num_ctx_items * p.num_kv_heads, num_tiles = p.num_tiles * p.num_kv_heads;
#ifdef _OPENMP
#pragma omp parallel num_threads(p.num_threads)
#endif
  {
#ifdef _OPENMP
    float* ws = p.workspace + omp_get_thread_num() * p.workspace_stride;
#pragma omp for schedule(dynamic, 1)
#else
    float* ws = p.workspace;
#endif
    for (int i = 0; i < num_context; ++i) context_item<T, D>(p, i / p.num_kv_heads, i % p.num_kv_heads, ws);
    // (implicit barrier) every partial is written before a tile reads it. Tiles come most
    // work first: dynamic scheduling then balances the threads (LPT).
#ifdef _OPENMP
#pragma omp for schedule(dynamic, 1)
#endif
    for (int i = 0; i < num_tiles; ++i) prefill_item<T, D>(p, i / p.num_kv_heads, i % p.num_kv_heads, ws);
  }
}

// The caller checked supports(chunk_size, head_dim), the plan and sized the scratch.
void tpp_prefill(const PrefillParams& p) {
  const bool bf16 = p.dtype == DType::kBFloat16;
  switch (p.head_dim) {
#define CHUNK_ATTN_PREFILL_CASE(D) \
  case D: return bf16 ? prefill<uint16_t, D>(p) : prefill<float, D>(p);
    CHUNK_ATTN_CPU_HEAD_DIMS(CHUNK_ATTN_PREFILL_CASE)
#undef CHUNK_ATTN_PREFILL_CASE
  }
}

}  // namespace CHUNK_ATTN_ISA
}  // namespace chunk_attn_cpu
