// Phase 1 (chunk-first) of the CPU kernel, written once against the lane API.
//
// A work item (schedule.h) takes a piece of a run of shared segments for one KV head
// and up to kRowsPerItem query rows. Per segment and block of kRowVecs * kLanes rows it
// is a small GEMM S^T = K Q^T over the segment's keys, an online-softmax update and
// O = O * correction + P V, FlashAttention style, so a whole piece leaves one
// partial (o, m, n) per row instead of one per segment. Scores are in the log2 domain
// (Q^T is pre-scaled by scale * log2 e).
#pragma once

namespace chunk_attn_cpu {
namespace CHUNK_ATTN_ISA {

// Q^T of one KV head: qt[d * stride + r] for rows r = seq * group + g, pre-scaled;
// the padding rows are zero, so a block that runs past the last row reads zeros.
template <typename T, int D>
void transpose_q(const Params& p, int kv_head) {
  const int group = p.num_heads / p.num_kv_heads;
  const int64_t stride = q_t_stride(p.num_seqs, p.num_heads, p.num_kv_heads);
  const int rows = p.num_seqs * group;
  const float qs = p.scale * kLog2e;
  const T* q = static_cast<const T*>(p.q);
  float* qt = p.q_t + static_cast<int64_t>(kv_head) * D * stride;
  for (int r = 0; r < rows; ++r) {
    const int64_t row = (static_cast<int64_t>(r / group) * p.num_heads + kv_head * group + r % group) * D;
    for (int d = 0; d < D; ++d) qt[d * stride + r] = load_scalar(q, row + d) * qs;
  }
  for (int d = 0; d < D; ++d)
    for (int64_t r = rows; r < stride; ++r) qt[d * stride + r] = 0.f;
}

// One block of RV * kLanes query rows against one chunk of keys, in three steps that
// prefill (prefill.h) also uses, with its causal mask between the first two. Both
// products broadcast values of the chunk and take vectors of rows, so a block reads
// the chunk's K and V once, each row in order:
//   S^T = K Q^T:        tiles of kKeyTile keys x RV row vectors; st = S^T, then P^T
//   O^T = V^T P^T:      tiles of kPvDims dims x RV row vectors
// qt: Q^T, row b of dim d at qt[d * stride + b]; k, v: [C][D] fp32; st: [C][RV * kLanes];
// ot: O^T, row b of dim d at ot[d * kOtStride + b] (phase 1: kRowsPerItem); m, n: [RV * kLanes] running
// max and sum.

// S^T of keys [0, num_keys) (num_keys a multiple of kKeyTile) into st.
template <int D, int RV>
void block_scores(const float* qt, int64_t stride, const float* k, int num_keys, float* st, const Prefetch& next) {
  constexpr int L = RV * kLanes;
  const int num_tiles = num_keys / kKeyTile;
  for (int j = 0; j < num_keys; j += kKeyTile) {
    next.part(j / kKeyTile, num_tiles);
    Vec acc[kKeyTile][RV];
#pragma GCC unroll 16
    for (int u = 0; u < kKeyTile; ++u)
#pragma GCC unroll 4
      for (int r = 0; r < RV; ++r) acc[u][r] = vzero();
    for (int d = 0; d < D; ++d) {
      Vec q[RV];
#pragma GCC unroll 4
      for (int r = 0; r < RV; ++r) q[r] = vload(qt + d * stride + r * kLanes), vpin(q[r]);
#pragma GCC unroll 16
      for (int u = 0; u < kKeyTile; ++u) {
        const Vec key = vset1(k[(j + u) * D + d]);
#pragma GCC unroll 4
        for (int r = 0; r < RV; ++r) acc[u][r] = vfma(key, q[r], acc[u][r]);
      }
    }
#pragma GCC unroll 16
    for (int u = 0; u < kKeyTile; ++u)
#pragma GCC unroll 4
      for (int r = 0; r < RV; ++r) vstore(st + (j + u) * L + r * kLanes, acc[u][r]);
  }
}

// Online-softmax update over keys [0, num_keys) of st: st becomes P^T = 2^(S^T - m_new),
// m and n advance, corr = 2^(m_old - m_new) per row (what O^T is rescaled by).
template <int RV>
void block_softmax(float* st, int num_keys, float* m, float* n, float* corr) {
  constexpr int L = RV * kLanes;
  for (int r = 0; r < RV; ++r) {
    const Vec m_old = vload(m + r * kLanes);
    Vec m_new = m_old;
    for (int j = 0; j < num_keys; ++j) m_new = vmax(m_new, vload(st + j * L + r * kLanes));
    const Vec correction = vexp2(vsub(m_old, m_new));  // 0 on the first chunk (m_old = -inf)
    Vec sum = vmul(vload(n + r * kLanes), correction);
    for (int j = 0; j < num_keys; ++j) {
      const Vec e = vexp2(vsub(vload(st + j * L + r * kLanes), m_new));
      vstore(st + j * L + r * kLanes, e);
      sum = vadd(sum, e);
    }
    vstore(m + r * kLanes, m_new);
    vstore(n + r * kLanes, sum);
    vstore(corr + r * kLanes, correction);
  }
}

// O^T = O^T * correction + V^T P^T over keys [0, num_keys) in tiles of kPvDims dims x RV
// row vectors: each V value broadcast (the row's values in order), each P^T vector
// loaded once per key. Rows of V past num_keys are never read (they may be NaN).
// kOtStride: O^T's row stride; kVStride: V's (phase 1: kRowsPerItem and D; constants, so
// that phase 1's code is as before prefill shared it).
template <int D, int RV, int kOtStride, int kVStride = D>
void block_pv(const float* v, int num_keys, const float* st, const float* corr, float* ot) {
  constexpr int L = RV * kLanes;
  for (int d0 = 0; d0 < D; d0 += kPvDims) {
    Vec acc[kPvDims][RV];
#pragma GCC unroll 16
    for (int e = 0; e < kPvDims; ++e)
#pragma GCC unroll 4
      for (int r = 0; r < RV; ++r)
        acc[e][r] = vmul(vload(ot + (d0 + e) * kOtStride + r * kLanes), vload(corr + r * kLanes));
    for (int j = 0; j < num_keys; ++j) {
      Vec pt[RV];
#pragma GCC unroll 4
      for (int r = 0; r < RV; ++r) pt[r] = vload(st + j * L + r * kLanes), vpin(pt[r]);
#pragma GCC unroll 16
      for (int e = 0; e < kPvDims; ++e) {
        const Vec x = vset1(v[j * kVStride + d0 + e]);
#pragma GCC unroll 4
        for (int r = 0; r < RV; ++r) acc[e][r] = vfma(x, pt[r], acc[e][r]);
      }
    }
#pragma GCC unroll 16
    for (int e = 0; e < kPvDims; ++e)
#pragma GCC unroll 4
      for (int r = 0; r < RV; ++r) vstore(ot + (d0 + e) * kOtStride + r * kLanes, acc[e][r]);
  }
}

// Sliding-window mask of one block: key j of the chunk (position key0 + j) is hidden
// from row r when it lies before the row's window, which starts at lo[r]. st: [num_keys][L].
template <int L>
inline void window_mask(float* st, int num_keys, int64_t key0, const int64_t* lo) {
  for (int r = 0; r < L; ++r) {
    const int64_t hidden = lo[r] - key0 < num_keys ? lo[r] - key0 : num_keys;
    for (int64_t j = 0; j < hidden; ++j) st[j * L + r] = kMaskedScore;
  }
}

// A segment of num_keys keys at positions key0 .., masked by the rows' window starts lo
// (nullptr: every key visible, decode's shared segments without a window). The scores
// are computed for whole key tiles: K is read up to kKeyTile - 1 rows past the segment
// (inside the pool, see kv/pool.py), and those scores are never used.
template <int D, int RV>
void block_update(const float* qt, int64_t stride, const float* k, const float* v, int num_keys, float* st,
                  float* ot, float* m, float* n, const Prefetch& next, const int64_t* lo, int64_t key0) {
  alignas(64) float corr[RV * kLanes];
  block_scores<D, RV>(qt, stride, k, static_cast<int>(round_up(num_keys, kKeyTile)), st, next);
  if (lo != nullptr) window_mask<RV * kLanes>(st, num_keys, key0, lo);
  block_softmax<RV>(st, num_keys, m, n, corr);
  block_pv<D, RV, kRowsPerItem>(v, num_keys, st, corr, ot);
}

// The last block of an item, narrower than kRowVecs vectors: `vectors` of them.
template <int D, int RV>
void tail_block(int vectors, const float* qt, int64_t stride, const float* k, const float* v, int num_keys,
                float* st, float* ot, float* m, float* n, const Prefetch& next, const int64_t* lo, int64_t key0) {
  if constexpr (RV >= 1) {
    if (vectors == RV)
      block_update<D, RV>(qt, stride, k, v, num_keys, st, ot, m, n, next, lo, key0);
    else
      tail_block<D, RV - 1>(vectors, qt, stride, k, v, num_keys, st, ot, m, n, next, lo, key0);
  }
}

// A chunk's K or V as fp32: in place, or converted from bf16 (in registers, a vector
// at a time) once for all the item's row blocks, since a broadcast cannot convert.
inline const float* as_float(const float* x, int64_t, float*) { return x; }
inline const float* as_float(const uint16_t* x, int64_t count, float* buf) {
  for (int64_t i = 0; i < count; i += kLanes) vstore(buf + i, vload(x + i));
  return buf;
}

template <typename T, int D>
void chunk_first_item(const Params& p, const ChunkItem& item, float* ws) {
  constexpr int L = kRowVecs * kLanes;
  const int C = p.chunk_size, H = p.num_heads, group = H / p.num_kv_heads;
  const int num_rows = item.row_end - item.row_begin;
  const int padded = static_cast<int>(round_up(num_rows, kLanes));
  float* ot = ws;                          // O^T [D][kRowsPerItem]
  float* m = ot + kRowsPerItem * D;        // [kRowsPerItem]
  float* n = m + kRowsPerItem;             // [kRowsPerItem]
  float* st = n + kRowsPerItem;            // [C][kMaxBlockRows]
  float* k_buf = st + C * kMaxBlockRows;   // [C][D] (bf16 storage)
  float* v_buf = k_buf + C * D;            // [C][D] (bf16 storage)
  for (int d = 0; d < D; ++d)
    for (int r = 0; r < padded; ++r) ot[d * kRowsPerItem + r] = 0.f;
  for (int r = 0; r < padded; ++r) m[r] = kNegInf, n[r] = 0.f;
  // Under a sliding window, each row's first visible position (the query is at
  // seq_len - 1); padding rows see everything. Chunks before every row's window are
  // skipped, and only chunks before some row's window are masked.
  int64_t lo[kRowsPerItem];
  int64_t min_lo = INT64_MAX, max_lo = INT64_MIN;
  if (p.window > 0) {
    for (int r = 0; r < padded; ++r) {
      lo[r] = r < num_rows ? window_start(p.seq_lens[(item.row_begin + r) / group] - 1, p.window) : INT64_MIN / 2;
      if (r < num_rows) min_lo = lo[r] < min_lo ? lo[r] : min_lo, max_lo = lo[r] > max_lo ? lo[r] : max_lo;
    }
  }
  const int64_t stride = q_t_stride(p.num_seqs, H, p.num_kv_heads);
  const float* qt = p.q_t + static_cast<int64_t>(item.kv_head) * D * stride + item.row_begin;
  const T* k_cache = static_cast<const T*>(p.k_cache);
  const T* v_cache = static_cast<const T*>(p.v_cache);
  for (int c = 0; c < item.count; ++c) {
    const int s = item.first + c;
    const int64_t key0 = p.shared_pos[s];
    const int num_keys = static_cast<int>(p.shared_len[s]);
    if (p.window > 0 && key0 + num_keys <= min_lo) continue;  // before every row's window
    const int64_t* mask = p.window > 0 && key0 < max_lo ? lo : nullptr;
    const int64_t base = chunk_offset(p, p.shared_chunk_ids[s], item.kv_head) + p.shared_start[s] * D;
    const float* k = as_float(k_cache + base, round_up(num_keys, kKeyTile) * D, k_buf);
    const float* v = as_float(v_cache + base, static_cast<int64_t>(num_keys) * D, v_buf);
    Prefetch next{};  // the next segment's K and V, spread over the first block's key tiles
    if (c + 1 < item.count) {
      const int64_t at = chunk_offset(p, p.shared_chunk_ids[s + 1], item.kv_head) + p.shared_start[s + 1] * D;
      next = Prefetch{reinterpret_cast<const char*>(k_cache + at), reinterpret_cast<const char*>(v_cache + at),
                      p.shared_len[s + 1] * D * static_cast<int64_t>(sizeof(T))};
    }
    int b = 0;
    for (; b + L <= padded; b += L) {
      block_update<D, kRowVecs>(qt + b, stride, k, v, num_keys, st, ot + b, m + b, n + b, next,
                                mask ? mask + b : mask, key0);
      next = Prefetch{};
    }
    if (b < padded)
      tail_block<D, kRowVecs - 1>((padded - b) / kLanes, qt + b, stride, k, v, num_keys, st, ot + b, m + b, n + b,
                                  next, mask ? mask + b : mask, key0);
  }
  for (int r = 0; r < num_rows; ++r) {
    const int row = item.row_begin + r, seq = row / group, head = item.kv_head * group + row % group;
    const int64_t slot = p.seq_pair_ptr[seq] + p.shared_depth[item.first];
    const int64_t at = slot * H + head;
    float* po = p.partial_o + at * D;
    for (int d = 0; d < D; ++d) po[d] = ot[d * kRowsPerItem + r];
    p.partial_m[at] = m[r];
    p.partial_n[at] = n[r];
    for (int c = 1; c < item.count; ++c) p.partial_m[(slot + c) * H + head] = kNegInf;
  }
}

}  // namespace CHUNK_ATTN_ISA
}  // namespace chunk_attn_cpu
