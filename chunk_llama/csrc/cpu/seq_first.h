// Phase 2 (sequence-first) of the CPU decode kernel and the folds, written once against the
// lane API.
//
// Phase 2: one work item per (sequence, KV head, part of its private blocks: params.h
// num_parts) computes each block's partial for every head of the GQA group (keys in lanes,
// blocks.h) into the block's slot. This phase reads each private K/V byte once and does
// little math per byte, so its loop order is chosen for the memory reads and the FMA
// chains: each K and V row read whole and in address order (reading eight rows side by
// side, a vector of each at a time, ran at 60% of the speed), each vector of it loaded once
// for kSeqHeads heads of the group (independent FMA chains; one head at a time waited on
// each score's chain and reloaded every row per head), and the next block's rows prefetched
// in software, which also covers the jumps between segments that the hardware prefetchers
// do not follow.
//
// Folds: one work item per (rows of sequences with the same shared blocks, KV head) folds
// those blocks' partials in order (rows in lanes), then each row's private partials, and
// writes the normalised output.
#pragma once

namespace chunk_attn_cpu {
namespace CHUNK_ATTN_ISA {

// The first block a query at pos sees (its window's), and its first visible position.
inline int64_t window_first(int64_t pos, int window) {
  const int64_t lo = window_start(pos, window);
  return lo > 0 ? lo : 0;
}

// A sequence's private blocks: from `first` (its fully shared blocks' end: its slots are
// numbered from there) to `last` (the one holding its query); `from`, at or after first, is
// the first its window reaches (the earlier ones are neither computed nor folded).
struct PrivateBlocks {
  int64_t first, from, last;
};
inline PrivateBlocks private_blocks(const Params& p, int seq) {
  const int64_t length = p.seq_lens[seq], first = p.num_shared_tokens[seq] / kBlockKeys;
  return {first, std::max(first, window_first(length - 1, p.window) / kBlockKeys), (length - 1) / kBlockKeys};
}

// One block's partials for HT heads of a GQA group (keys in lanes, blocks.h), each K and V
// row loaded once for all of them: q [HT][D] (pre-scaled), the block's count keys at rows
// (the first `skip` before the window), s: [HT][kBlockKeys] scratch, dst: [HT][D + 2]
// (o_b, m_b, n_b per head). A head's scores are row_scores' numbers and its P V row_pv's,
// chain by chain, in the keys-in-lanes layout (the next block's rows, next_count of them,
// prefetched meanwhile).
template <int HT, int D, typename T>
inline void private_heads(const T* k_cache, const T* v_cache, const int64_t* rows, int count, int skip,
                          const float* q, float* s, float* dst, const int64_t* next, int next_count) {
  constexpr int kVecs = D / kLanes, B = kBlockKeys;
  const int padded = static_cast<int>(round_up(count, kLanes));
  for (int u0 = 0; u0 < count; u0 += kLanes) {  // the scores: each K row read once, in order
    Vec acc[HT][kLanes];
#pragma GCC unroll 4
    for (int g = 0; g < HT; ++g)
#pragma GCC unroll 16
      for (int u = 0; u < kLanes; ++u) acc[g][u] = vzero();
    const int keys = count - u0 < kLanes ? count - u0 : kLanes;
    for (int u = 0; u < keys; ++u) {
      if (u0 + u < next_count) prefetch_row<T, D>(k_cache, v_cache, next[u0 + u]);
      const T* k = k_cache + rows[u0 + u];
      Vec a[HT];
#pragma GCC unroll 4
      for (int g = 0; g < HT; ++g) a[g] = vzero();
#pragma GCC unroll 16
      for (int i = 0; i < kVecs; ++i) {
        const Vec kv = vload(k + i * kLanes);
#pragma GCC unroll 4
        for (int g = 0; g < HT; ++g) a[g] = score_chain(kv, vload(q + g * D + i * kLanes), a[g]);
      }
#pragma GCC unroll 4
      for (int g = 0; g < HT; ++g) acc[g][u] = a[g];
    }
#pragma GCC unroll 4
    for (int g = 0; g < HT; ++g) vstore(s + g * B + u0, vsum_lanes(acc[g]));
  }
  for (int g = 0; g < HT; ++g) {  // the block's softmax per head
    float* sg = s + g * B;
    for (int u = count; u < padded; ++u) sg[u] = kMaskedScore;
    for (int u = 0; u < skip; ++u) sg[u] = kMaskedScore;
    Vec mv = vload(sg);
    for (int u = kLanes; u < padded; u += kLanes) mv = vmax(mv, vload(sg + u));
    const float mb = vreduce_max(mv);
    for (int u = 0; u < padded; u += kLanes) vstore(sg + u, vexp2(vsub(vload(sg + u), vset1(mb))));
    float nb = 0.f;
    for (int u = 0; u < count; ++u) nb += sg[u];  // in key order, as the rows-in-lanes sum
    dst[g * (D + 2) + D] = mb;
    dst[g * (D + 2) + D + 1] = nb;
  }
  // P V: a slice of NV dim vectors for the HT heads in registers, each V row read in order
  constexpr int NV = kVecs < kSeqPvVecs ? kVecs : kSeqPvVecs;
  for (int d0 = 0; d0 < D; d0 += NV * kLanes) {
    const int nv = (D - d0) / kLanes < NV ? (D - d0) / kLanes : NV;  // (the last slice may be narrower)
    with_count<NV>(nv, [&](auto n) {
      constexpr int W = decltype(n)::value;
      Vec o[HT][W];
#pragma GCC unroll 4
      for (int g = 0; g < HT; ++g)
#pragma GCC unroll 16
        for (int i = 0; i < W; ++i) o[g][i] = vzero();
      for (int u = 0; u < count; ++u) {
        Vec pu[HT];
#pragma GCC unroll 4
        for (int g = 0; g < HT; ++g) pu[g] = vset1(s[g * B + u]);
        const T* v = v_cache + rows[u] + d0;
#pragma GCC unroll 16
        for (int i = 0; i < W; ++i) {
          const Vec vv = vload(v + i * kLanes);
#pragma GCC unroll 4
          for (int g = 0; g < HT; ++g) o[g][i] = vfma(pu[g], vv, o[g][i]);
        }
      }
#pragma GCC unroll 4
      for (int g = 0; g < HT; ++g)
#pragma GCC unroll 16
        for (int i = 0; i < W; ++i) vstore(dst + g * (D + 2) + d0 + i * kLanes, o[g][i]);
    });
  }
}

// Work item (sequence, KV head, part of part_len blocks) of phase 2: the part's blocks, for each head of the
// group (kSeqHeads at a time), into their slots ([num_heads][D + 2]: o_b, m_b, n_b). Blocks
// before the window are neither computed nor folded. A part past the sequence's last: nothing.
template <typename T, int D>
void private_item(const Params& p, int seq, int kv_head, int part, int64_t part_len, float* ws) {
  const int H = p.num_heads, group = H / p.num_kv_heads;
  const int64_t length = p.seq_lens[seq], lo = window_first(length - 1, p.window);
  const int64_t slot0 = p.private_slot[seq];
  const auto [first, from, last] = private_blocks(p, seq);
  const int64_t blocks = last - from + 1;
  if (part >= num_parts(blocks, part_len)) return;
  const int64_t b0 = from + part * part_len, b1 = std::min(last + 1, b0 + part_len);
  float* s = ws;  // [kSeqHeads][kBlockKeys] the scores, then the weights
  const T* k_cache = static_cast<const T*>(p.k_cache);
  const T* v_cache = static_cast<const T*>(p.v_cache);
  const float* q = p.q_rows + (kv_head * q_rows_per_head(p.num_seqs, group) + static_cast<int64_t>(seq) * group) * D;
  const Path path = seq_path(p, seq);
  int64_t rows[2][kBlockKeys], seg = 0;
  const auto locate = [&](int64_t b, int64_t* at) {
    const int64_t key0 = b * kBlockKeys;
    const int count = static_cast<int>(std::min<int64_t>(kBlockKeys, length - key0));
    key_rows(path, p.num_kv_heads, p.chunk_size, D, kv_head, key0, count, seg, at);
    return count;
  };
  int count = locate(b0, rows[0]);
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t* at = rows[(b - b0) % 2];
    int next_count = 0;
    if (b + 1 < b1) next_count = locate(b + 1, rows[(b + 1 - b0) % 2]);  // prefetched while this one is computed
    const int skip = static_cast<int>(std::max<int64_t>(0, lo - b * kBlockKeys));  // keys before the window
    float* dst = p.private_partials + ((slot0 + b - first) * H + kv_head * group) * (D + 2);
    for (int g0 = 0; g0 < group; g0 += kSeqHeads)
      with_count<kSeqHeads>(std::min(kSeqHeads, group - g0), [&](auto heads) {
        private_heads<decltype(heads)::value, D>(k_cache, v_cache, at, count, skip, q + g0 * D, s, dst + g0 * (D + 2),
                                                 rows[(b + 1 - b0) % 2], g0 == 0 ? next_count : 0);
      });
    count = next_count;
  }
}

// Final work item: the rows' shared blocks folded (rows in lanes), then each row's private
// blocks, normalised into out.
template <int D>
void fold_item(const Params& p, const FoldItem& f, float* ws) {
  constexpr int R = kRowsPerItem;
  const int H = p.num_heads, group = H / p.num_kv_heads;
  const int num_rows = f.row_end - f.row_begin, padded = static_cast<int>(round_up(num_rows, kLanes));
  float* ot = ws;         // O^T [D][R]
  float* m = ot + D * R;  // [R]
  float* n = m + R;       // [R]
  float* o = n + R;       // [D] one row's o
  for (int r = 0; r < padded; r += kLanes) {
    for (int d = 0; d < D; ++d) vstore(ot + d * R + r, vzero());
    vstore(m + r, vset1(kMaskedScore));
    vstore(n + r, vzero());
  }
  int64_t min_lo = INT64_MAX;  // blocks before every row's window are skipped (they fold as nothing)
  for (int r = 0; r < num_rows; ++r)
    min_lo = std::min(min_lo, window_first(p.seq_lens[(f.row_begin + r) / group] - 1, p.window));
  for (int i = 0; i < f.count; ++i) {
    const SharedBlock& sb = p.shared_blocks[p.fold_blocks[f.first + i]];
    if ((sb.block + 1) * kBlockKeys <= min_lo) continue;
    const int64_t stride = sb.stride;
    const float* part = p.shared_partials + sb.offset + f.kv_head * (D + 2) * stride + (f.row_begin - sb.seq_begin * group);
    for (int r = 0; r < padded; r += kLanes) {
      const FoldWeights w = fold_weights(vload(m + r), vload(part + D * stride + r));
      vstore(n + r, fold(vload(n + r), vload(part + (D + 1) * stride + r), w));
      for (int d = 0; d < D; ++d) vstore(ot + d * R + r, fold(vload(ot + d * R + r), vload(part + d * stride + r), w));
      vstore(m + r, w.m);
    }
  }
  for (int r = 0; r < num_rows; ++r) {
    const int row = f.row_begin + r, seq = row / group, head = f.kv_head * group + row % group;
    float mr = m[r], nr = n[r];
    for (int d = 0; d < D; ++d) o[d] = ot[d * R + r];
    const auto [first, from, last] = private_blocks(p, seq);
    for (int64_t b = from; b <= last; ++b) {
      const float* src = p.private_partials + ((p.private_slot[seq] + b - first) * H + head) * (D + 2);
      fold_one<D>(mr, nr, o, src[D], src[D + 1], src);
    }
    const Vec inv = vset1(1.f / nr);
    const int64_t dst = (static_cast<int64_t>(seq) * H + head) * D;
    if (p.q_dtype == DType::kBFloat16)
      for (int d = 0; d < D; d += kLanes) vstore(static_cast<uint16_t*>(p.out) + dst + d, vmul(vload(o + d), inv));
    else
      for (int d = 0; d < D; d += kLanes) vstore(static_cast<float*>(p.out) + dst + d, vmul(vload(o + d), inv));
  }
}

}  // namespace CHUNK_ATTN_ISA
}  // namespace chunk_attn_cpu
