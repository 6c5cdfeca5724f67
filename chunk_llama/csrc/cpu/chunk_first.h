// Phase 1 (chunk-first) of the CPU decode kernel, written once against the lane API: the
// blocks of keys several sequences' paths share (params.h SharedBlock), each against the
// query rows of all of them at once, a row block (kRowVecs * kLanes rows) at a time: the
// scores, the block's softmax and its P V, as blocks.h defines them, into the block's
// partials. The K and V of a block are read once for all the rows of an item, and no
// partial depends on the other blocks, so an item may take any piece of a run of blocks
// (the folds take them in order afterwards, seq_first.h).
#pragma once

namespace chunk_attn_cpu {
namespace CHUNK_ATTN_ISA {

// q_rows of one KV head: row r = seq * group + g, its query pre-scaled by scale * log2(e)
// (each value multiplied once, as prefill scales its rows); the padding rows zero.
template <int D>
void scale_q(const Params& p, int kv_head) {
  const int group = p.num_heads / p.num_kv_heads, rows = p.num_seqs * group;
  const int64_t per_head = q_rows_per_head(p.num_seqs, group);
  const float qs = p.scale * kLog2e;
  const bool q_bf16 = p.q_dtype == DType::kBFloat16;
  float* dst = p.q_rows + kv_head * per_head * D;
  for (int r = 0; r < rows; ++r) {
    const int64_t src = (static_cast<int64_t>(r / group) * p.num_heads + kv_head * group + r % group) * D;
    for (int d = 0; d < D; ++d) dst[static_cast<int64_t>(r) * D + d] = load_scalar(p.q, q_bf16, src + d) * qs;
  }
  for (int64_t i = static_cast<int64_t>(rows) * D; i < per_head * D; ++i) dst[i] = 0.f;
}

// Sliding-window mask of one block: key j (position key0 + j) is hidden from row r when it
// lies before the row's window, which starts at lo[r]. st: [num_keys][L].
template <int L>
inline void window_mask(float* st, int num_keys, int64_t key0, const int64_t* lo) {
  for (int r = 0; r < L; ++r) {
    const int64_t hidden = lo[r] - key0 < num_keys ? lo[r] - key0 : num_keys;
    for (int64_t j = 0; j < hidden; ++j) st[j * L + r] = kMaskedScore;
  }
}

// The sequence's whole path (schedule.h), up to its length.
inline Path seq_path(const Params& p, int seq) {
  const int64_t first = p.path_ptr[seq];
  return {p.path_chunk + first, p.path_start + first, p.path_pos + first, p.path_ptr[seq + 1] - first,
          p.seq_lens[seq]};
}

template <typename T, int D>
void shared_item(const Params& p, const ChunkItem& item, float* ws) {
  constexpr int L = kRowVecs * kLanes;
  const int group = p.num_heads / p.num_kv_heads;
  const int num_rows = item.row_end - item.row_begin, padded = static_cast<int>(round_up(num_rows, kLanes));
  float* st = ws;                                // [kBlockKeys][kMaxBlockRows]
  float* k_buf = st + kBlockKeys * kMaxBlockRows;  // [kBlockKeys][D]
  float* v_buf = k_buf + kBlockKeys * D;           // [kBlockKeys][kVStride<D>]
  // Under a sliding window, each row's first visible position (the query is at seq_len - 1);
  // padding rows see everything.
  int64_t lo[kRowsPerItem];
  int64_t min_lo = INT64_MAX, max_lo = INT64_MIN;
  for (int r = 0; r < padded; ++r) {
    lo[r] = r < num_rows ? window_start(p.seq_lens[(item.row_begin + r) / group] - 1, p.window) : INT64_MIN / 2;
    if (r < num_rows) min_lo = std::min(min_lo, lo[r]), max_lo = std::max(max_lo, lo[r]);
  }
  const float* q = p.q_rows + (item.kv_head * q_rows_per_head(p.num_seqs, group) + item.row_begin) * D;
  const T* k_cache = static_cast<const T*>(p.k_cache);
  const T* v_cache = static_cast<const T*>(p.v_cache);
  // The blocks' K/V rows (all on the path of the run's first sequence), the next block's
  // prefetched a key at a time during this one's scores (a block ahead, as phase 2 does):
  // with few rows per KV head this phase reads K/V at the memory's speed.
  const Path path = seq_path(p, static_cast<int>(p.shared_blocks[item.first].seq_begin));
  int64_t rows[2][kBlockKeys], seg = 0;
  const auto locate = [&](int e, int64_t* at) {
    key_rows(path, p.num_kv_heads, p.chunk_size, D, item.kv_head, p.shared_blocks[e].block * kBlockKeys, kBlockKeys,
             seg, at);
  };
  const int end = item.first + item.count;
  locate(item.first, rows[0]);
  for (int e = item.first; e < end; ++e) {
    const SharedBlock& sb = p.shared_blocks[e];
    const int64_t key0 = sb.block * kBlockKeys, stride = sb.stride;
    const int64_t* at = rows[(e - item.first) % 2];
    const int64_t* next = e + 1 < end ? rows[(e + 1 - item.first) % 2] : nullptr;
    if (next) locate(e + 1, rows[(e + 1 - item.first) % 2]);
    float* part = p.shared_partials + sb.offset + item.kv_head * (D + 2) * stride +
                  (item.row_begin - sb.seq_begin * group);
    if (key0 + kBlockKeys <= min_lo) {  // before every row's window: a partial that folds as nothing
      for (int r = 0; r < padded; r += kLanes) {
        for (int d = 0; d < D; ++d) vstore(part + d * stride + r, vzero());
        vstore(part + D * stride + r, vset1(kMaskedScore));
        vstore(part + (D + 1) * stride + r, vzero());
      }
      continue;
    }
    const float* k = block_floats<D>(k_cache, at, kBlockKeys, D, k_buf);
    const float* v = block_floats<D>(v_cache, at, kBlockKeys, kVStride<D>, v_buf);
    for (int b = 0; b < padded; b += L) {
      const int vectors = (padded - b) / kLanes < kRowVecs ? (padded - b) / kLanes : kRowVecs;
      with_count<kRowVecs>(vectors, [&](auto rv) {
        constexpr int RV = decltype(rv)::value;
        row_scores<D, RV>(q + static_cast<int64_t>(b) * D, k, kBlockKeys, st, [&](int j) {
          if (b == 0 && next) prefetch_row<T, D>(k_cache, v_cache, next[j]);
        });
        if (key0 < max_lo) window_mask<RV * kLanes>(st, kBlockKeys, key0, lo + b);
        Vec mb[RV], nb[RV];
        row_softmax<RV>(st, kBlockKeys, mb, nb);
        for (int d0 = 0; d0 < D; d0 += pv_dims<RV>())
          row_pv<RV, kVStride<D>>(v, kBlockKeys, st, d0, [&](int d, int r, Vec o) { vstore(part + d * stride + b + r * kLanes, o); });
        for (int r = 0; r < RV; ++r) {
          vstore(part + D * stride + b + r * kLanes, mb[r]);
          vstore(part + (D + 1) * stride + b + r * kLanes, nb[r]);
        }
      });
    }
  }
}

}  // namespace CHUNK_ATTN_ISA
}  // namespace chunk_attn_cpu
