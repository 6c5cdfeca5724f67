// Prefill attention of the CPU kernel, written once against the lane API, in the blocks of
// keys of blocks.h: each query row folds the blocks of its keys (those up to its position,
// inside its window) in order, rows in lanes, so a row's output is what decode computes for
// the same query, however the step's rows are grouped.
//
// Two kinds of work items (prefill_params.h has the layout):
// - context items, the chunk-first idea applied to prefill: where the new tokens of several
//   sequences all see the same leading blocks whole (their common prefix, positions [0,
//   ctx_end), ctx_end a multiple of kBlockKeys), the queries of all of them, one contiguous
//   run of rows, fold those blocks at once, and each row's state (o, m, n) goes to scratch;
// - tiles: at most kRowsPerItem query rows of one sequence start from that state (or from
//   nothing) and fold the sequence's blocks from ctx_end on, up to the one holding the
//   tile's last position, then normalise.
// Both read K/V in place from the pool where a block is one run of float32 rows, FlashAttention
// style: per block of keys and block of kRowVecs * kLanes rows, the scores, the masks (only
// where a block reaches past a row's position or before its window), the block's softmax and
// P V folded into the rows' state. No gather of a sequence and no mask tensor: memory is an
// item's Q and O^T, a block's scores and K/V, and the context states.
#pragma once

namespace chunk_attn_cpu {
namespace CHUNK_ATTN_ISA {

// Causal mask of one block: key j (position key0 + j) is hidden from row r when it lies
// after the row's position pos[r]. st: [num_keys][L].
template <int L>
inline void causal_mask(float* st, int num_keys, int64_t key0, const int64_t* pos) {
  for (int r = 0; r < L; ++r) {
    const int64_t visible = pos[r] - key0 + 1;
    for (int64_t j = visible > 0 ? visible : 0; j < num_keys; ++j) st[j * L + r] = kMaskedScore;
  }
}

// An item's query rows: Q of rows [row0, row0 + num_rows) of one KV head (global rows, row =
// token * group + head of the group), pre-scaled by scale * log2 e, each row's position and
// window start, and the running (O^T, m, n).
struct ItemRows {
  // Row stride of O^T: not kRowsPerItem (512 bytes), whose multiples map every dimension's
  // row to one eighth of L1's sets, so that a block's columns evicted each other (D = 128
  // ran at 48 GFLOP/s against 65 with this stride, 2 threads, 2,048 tokens); 9 cache lines
  // apart they use every set.
  static constexpr int kStride = kRowsPerItem + 16;
  int64_t row0;
  int num_rows, padded;
  float *q, *ot, *m, *n, *st, *k_buf, *v_buf;  // the thread's workspace
  int64_t pos[kRowsPerItem], lo[kRowsPerItem];
};

template <int D>
void load_rows(const PrefillParams& p, int kv_head, ItemRows& it, float* ws) {
  constexpr int R = kRowsPerItem, S = ItemRows::kStride;
  const int H = p.num_heads, group = H / p.num_kv_heads;
  it.padded = static_cast<int>(round_up(it.num_rows, kLanes));
  it.q = ws;                                   // Q [R][D]
  it.ot = it.q + R * D;                        // O^T [D][S]
  it.m = it.ot + S * D;                        // [R]
  it.n = it.m + R;                             // [R]
  it.st = it.n + R;                            // [kBlockKeys][kMaxBlockRows]
  it.k_buf = it.st + kBlockKeys * kMaxBlockRows;  // [kBlockKeys][D]
  it.v_buf = it.k_buf + kBlockKeys * D;           // [kBlockKeys][kVStride<D>]
  const bool q_bf16 = p.q_dtype == DType::kBFloat16;
  const float qs = p.scale * kLog2e;
  for (int r = 0; r < it.num_rows; ++r) {
    const int64_t row = it.row0 + r, token = row / group;
    it.pos[r] = p.token_pos[token];
    const int64_t src = (token * H + kv_head * group + row % group) * D;
    for (int d = 0; d < D; ++d) it.q[r * D + d] = load_scalar(p.q, q_bf16, src + d) * qs;
  }
  // padding rows see every key: their zero queries give finite scores never written out
  for (int r = it.num_rows; r < it.padded; ++r) {
    it.pos[r] = INT64_MAX / 2;  // past every key, without overflow in causal_mask
    for (int d = 0; d < D; ++d) it.q[r * D + d] = 0.f;
  }
  for (int r = 0; r < it.padded; ++r) it.lo[r] = window_start(it.pos[r], p.window);
  for (int d = 0; d < D; ++d)
    for (int r = 0; r < it.padded; ++r) it.ot[d * S + r] = 0.f;
  for (int r = 0; r < it.padded; ++r) it.m[r] = kMaskedScore, it.n[r] = 0.f;
}

// Folds blocks [first, last] of the sequence whose path is `path` into the item's rows
// (rows need not be in position order; a block no row sees is skipped).
template <typename T, int D>
void attend_blocks(const PrefillParams& p, int kv_head, ItemRows& it, const Path& path, int64_t first, int64_t last) {
  constexpr int S = ItemRows::kStride, L = kRowVecs * kLanes;
  // per block of rows: the positions and window starts its rows span
  int64_t min_pos[kRowsPerItem / kLanes], max_pos[kRowsPerItem / kLanes];
  int64_t min_lo[kRowsPerItem / kLanes], max_lo[kRowsPerItem / kLanes];
  int64_t top = INT64_MIN, lowest = INT64_MAX;
  for (int b = 0, block = 0; b < it.padded; b += L, ++block) {
    const int end = (b + L < it.num_rows ? b + L : it.num_rows);
    min_pos[block] = min_lo[block] = INT64_MAX;
    max_pos[block] = max_lo[block] = INT64_MIN;
    for (int r = b; r < end; ++r) {
      min_pos[block] = std::min(min_pos[block], it.pos[r]), max_pos[block] = std::max(max_pos[block], it.pos[r]);
      min_lo[block] = std::min(min_lo[block], it.lo[r]), max_lo[block] = std::max(max_lo[block], it.lo[r]);
    }
    top = std::max(top, max_pos[block]), lowest = std::min(lowest, min_lo[block]);
  }
  const T* k_cache = static_cast<const T*>(p.k_cache);
  const T* v_cache = static_cast<const T*>(p.v_cache);
  int64_t rows[kBlockKeys], seg = 0;
  for (int64_t blk = first; blk <= last; ++blk) {
    const int64_t key0 = blk * kBlockKeys;
    const int count = static_cast<int>(std::min<int64_t>(kBlockKeys, top - key0 + 1));  // keys some row sees
    if (count <= 0) break;
    if (key0 + count <= lowest) continue;  // before every row's window
    key_rows(path, p.num_kv_heads, p.chunk_size, D, kv_head, key0, count, seg, rows);
    const float* k = block_floats<D>(k_cache, rows, count, D, it.k_buf);
    const float* v = block_floats<D>(v_cache, rows, count, kVStride<D>, it.v_buf);
    for (int b = 0, block = 0; b < it.padded; b += L, ++block) {
      const int vectors = (it.padded - b) / kLanes < kRowVecs ? (it.padded - b) / kLanes : kRowVecs;
      const int64_t seen = max_pos[block] - key0 + 1;  // keys of this block some row sees
      if (seen <= 0) continue;                          // the block lies after all the rows
      if (key0 + count <= min_lo[block]) continue;      // ... or before all their windows
      const int num_keys = static_cast<int>(seen < count ? seen : count);
      const bool diagonal = key0 + num_keys - 1 > min_pos[block];  // some row sees fewer keys
      const bool windowed = key0 < max_lo[block];                  // some row's window starts later
      with_count<kRowVecs>(vectors, [&](auto rv) {
        constexpr int RV = decltype(rv)::value;
        row_scores<D, RV>(it.q + static_cast<int64_t>(b) * D, k, num_keys, it.st, [](int) {});
        if (diagonal) causal_mask<RV * kLanes>(it.st, num_keys, key0, it.pos + b);
        if (windowed) window_mask<RV * kLanes>(it.st, num_keys, key0, it.lo + b);
        Vec mb[RV], nb[RV];
        row_softmax<RV>(it.st, num_keys, mb, nb);
        FoldWeights w[RV];
        for (int r = 0; r < RV; ++r) {
          w[r] = fold_weights(vload(it.m + b + r * kLanes), mb[r]);
          vstore(it.n + b + r * kLanes, fold(vload(it.n + b + r * kLanes), nb[r], w[r]));
          vstore(it.m + b + r * kLanes, w[r].m);
        }
        for (int d0 = 0; d0 < D; d0 += pv_dims<RV>())
          row_pv<RV, kVStride<D>>(v, num_keys, it.st, d0, [&](int d, int r, Vec o) {
            float* at = it.ot + d * S + b + r * kLanes;
            vstore(at, fold(vload(at), o, w[r]));
          });
      });
    }
  }
}

// The path of sequence seq (its segment table), up to position end.
inline Path prefill_path(const PrefillParams& p, int64_t seq, int64_t end) {
  const int64_t at = seq * p.max_segments;
  int64_t count = 0;
  while (count < p.max_segments && p.seg_pos[at + count] < end) ++count;
  return {p.seg_chunk + at, p.seg_start + at, p.seg_pos + at, count, end};
}

// The rows' states (O^T, m, n) from or to the partials at `offset` (partial rows are token-
// indexed: row r of token t at (offset + t) * group + r % group; [D][rows] like O^T, a
// dim at a time).
template <int D>
void copy_states(const PrefillParams& p, int kv_head, ItemRows& it, int64_t offset, bool to_partials) {
  constexpr int S = ItemRows::kStride;
  const int group = p.num_heads / p.num_kv_heads;
  const int64_t partial_rows = p.num_partial_rows * group, prow0 = offset * group + it.row0;
  float* po = p.partial_o + kv_head * D * partial_rows + prow0;
  float* pm = p.partial_m + kv_head * partial_rows + prow0;
  float* pn = p.partial_n + kv_head * partial_rows + prow0;
  const size_t bytes = it.num_rows * sizeof(float);
  for (int d = 0; d < D; ++d)
    to_partials ? std::memcpy(po + d * partial_rows, it.ot + d * S, bytes) : std::memcpy(it.ot + d * S, po + d * partial_rows, bytes);
  to_partials ? std::memcpy(pm, it.m, bytes) : std::memcpy(it.m, pm, bytes);
  to_partials ? std::memcpy(pn, it.n, bytes) : std::memcpy(it.n, pn, bytes);
}

// Context item: blocks [first, end) of one sequence's path against the rows of the sequences
// that share them, from the states of the level before (or nothing); each row's state to
// the partials.
template <typename T, int D>
void context_item(const PrefillParams& p, int index, int kv_head, float* ws) {
  // sequence, first block, end block, row_begin, row_end, partial offset, offset started from
  const int64_t* item = p.ctx_items + 7 * index;
  ItemRows it;
  it.row0 = item[3];
  it.num_rows = static_cast<int>(item[4] - item[3]);
  load_rows<D>(p, kv_head, it, ws);
  if (item[6] != kNoState) copy_states<D>(p, kv_head, it, item[6], false);
  attend_blocks<T, D>(p, kv_head, it, prefill_path(p, item[0], item[2] * kBlockKeys), item[1], item[2] - 1);
  copy_states<D>(p, kv_head, it, item[5], true);
}

// Tile: one sequence's rows, from the state its last context item left (if any), then its
// blocks from ctx_end on, normalised into the output.
template <typename T, int D>
void prefill_item(const PrefillParams& p, int tile, int kv_head, float* ws) {
  constexpr int S = ItemRows::kStride;
  const int H = p.num_heads, group = H / p.num_kv_heads;
  const int64_t seq = p.tiles[3 * tile];
  ItemRows it;
  it.row0 = p.token_start[seq] * group + p.tiles[3 * tile + 1];
  it.num_rows = static_cast<int>(p.tiles[3 * tile + 2] - p.tiles[3 * tile + 1]);
  load_rows<D>(p, kv_head, it, ws);
  if (p.seq_ctx_ptr[seq] < p.seq_ctx_ptr[seq + 1]) copy_states<D>(p, kv_head, it, p.seq_ctx_offset[p.seq_ctx_ptr[seq]], false);
  const int64_t last_pos = *std::max_element(it.pos, it.pos + it.num_rows);
  attend_blocks<T, D>(p, kv_head, it, prefill_path(p, seq, last_pos + 1), p.ctx_end[seq] / kBlockKeys,
                      last_pos / kBlockKeys);
  const bool out_bf16 = p.q_dtype == DType::kBFloat16;
  for (int r = 0; r < it.num_rows; ++r) {
    const int64_t row = it.row0 + r;
    const int64_t dst = ((row / group) * H + kv_head * group + row % group) * D;
    const float inv = 1.f / it.n[r];
    for (int d = 0; d < D; ++d) store_scalar(p.out, out_bf16, dst + d, it.ot[d * S + r] * inv);
  }
}

template <typename T, int D>
void prefill(const PrefillParams& p) {
  const int KV = p.num_kv_heads, num_tiles = p.num_tiles * KV;
#ifdef _OPENMP
#pragma omp parallel num_threads(p.num_threads)
#endif
  {
#ifdef _OPENMP
    float* ws = p.workspace + omp_get_thread_num() * p.workspace_stride;
#else
    float* ws = p.workspace;
#endif
    // the context levels in order (each barrier: a level's states are written before the
    // next level's items start from them), then the tiles, most work first: dynamic
    // scheduling then balances the threads (LPT)
    for (int level = 0; level < p.num_ctx_levels; ++level) {
      const int first = static_cast<int>(p.ctx_levels[level]) * KV, end = static_cast<int>(p.ctx_levels[level + 1]) * KV;
#ifdef _OPENMP
#pragma omp for schedule(dynamic, 1)
#endif
      for (int i = first; i < end; ++i) context_item<T, D>(p, i / KV, i % KV, ws);
    }
#ifdef _OPENMP
#pragma omp for schedule(dynamic, 1)
#endif
    for (int i = 0; i < num_tiles; ++i) prefill_item<T, D>(p, i / KV, i % KV, ws);
  }
}

// The caller checked supports(chunk_size, head_dim), the plan and sized the scratch.
void tpp_prefill(const PrefillParams& p) {
  switch (p.head_dim) {
#define CHUNK_ATTN_PREFILL_CASE(D)                                             \
  case D:                                                                      \
    return p.dtype == DType::kBFloat16  ? prefill<uint16_t, D>(p)             \
           : p.dtype == DType::kFloat16 ? prefill<Half, D>(p)                 \
                                        : prefill<float, D>(p);
    CHUNK_ATTN_CPU_HEAD_DIMS(CHUNK_ATTN_PREFILL_CASE)
#undef CHUNK_ATTN_PREFILL_CASE
  }
}

}  // namespace CHUNK_ATTN_ISA
}  // namespace chunk_attn_cpu
