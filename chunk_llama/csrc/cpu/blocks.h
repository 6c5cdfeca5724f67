// Attention in blocks of keys at fixed positions: the arithmetic every CPU attention path
// shares (decode's two phases, prefill's context items and tiles), written once against the
// lane API, so that a query's output is bit for bit the same whichever path computes it:
// alone or in a batch, its prefix shared with other sequences or not, cached or not, its
// prompt prefilled whole or in pieces, a key's K/V written by a decode step or a prefill.
//
// A query's keys are cut into blocks of kBlockKeys (params.h) at positions [b * kBlockKeys,
// (b + 1) * kBlockKeys), whatever chunks and segments hold them. Per block, from nothing:
//   s_j = q . k_j   q pre-scaled by scale * log2(e); one FMA chain along the dims a vector at a
//                   time (score_chain), its lanes then added by vsum_lanes' tree
//   m_b = the largest s_j (a key the query does not see scores kMaskedScore)
//   e_j = 2^(s_j - m_b), n_b = e_0 + e_1 + ... and o_b = e_0 v_0 + e_1 v_1 + ... (one FMA
//         chain), both in key order from 0
// and the blocks are folded in position order into the query's (m, n, o), which starts at
// (kMaskedScore, 0, 0):
//   m' = max(m, m_b), a = 2^(m - m'), c = 2^(m_b - m'), n' = fma(n_b, c, n * a),
//   o' = fma(o_b, c, o * a); out = o * (1 / n).
// A block whose keys the query sees none of changes nothing once a visible block was folded
// (c = 0, a = 1) and before that leaves finite values that the first visible block multiplies
// by a = 2^(kMaskedScore - m_b) = 0: a path may fold such a block or skip it. Two layouts
// compute the same numbers: keys in lanes (a few queries against a block, each key's row
// loaded once for them: decode's phase 2, seq_first.h private_heads) and
// rows in lanes (a block of queries against a block: decode's phase 1, prefill), whose scores
// come from tiles of kLanes rows against one key, each row's chain in its own accumulator.
#pragma once

namespace chunk_attn_cpu {
namespace CHUNK_ATTN_ISA {

// A sequence's segments in position order: segment i holds positions [pos[i], pos[i + 1])
// (the last up to `end`), at slots start[i] .. of chunk chunk[i].
struct Path {
  const int64_t* chunk;
  const int64_t* start;
  const int64_t* pos;
  int64_t count, end;
};

// rows[u]: where the K/V row of position first + u (u < count) of `kv_head` starts in the
// cache (elements). seg: a segment at or before `first` (0 at the start of a walk), advanced.
inline void key_rows(const Path& path, int num_kv_heads, int chunk_size, int head_dim, int kv_head, int64_t first,
                     int count, int64_t& seg, int64_t* rows) {
  for (int u = 0; u < count;) {
    const int64_t x = first + u;
    while (seg + 1 < path.count && path.pos[seg + 1] <= x) ++seg;
    const int64_t seg_end = seg + 1 < path.count ? path.pos[seg + 1] : path.end;
    const int64_t base = chunk_offset(num_kv_heads, chunk_size, head_dim, path.chunk[seg], kv_head) +
                         (path.start[seg] + x - path.pos[seg]) * head_dim;
    const int run = static_cast<int>(count - u < seg_end - x ? count - u : seg_end - x);
    for (int j = 0; j < run; ++j) rows[u + j] = base + static_cast<int64_t>(j) * head_dim;
    u += run;
  }
}

// The block's K or V rows [count][stride] as fp32: in place where they are one run of fp32
// rows of stride D, else copied (bf16 or fp16 widened) into buf.
template <int D, typename T>
inline const float* block_floats(const T* cache, const int64_t* rows, int count, int stride, float* buf) {
  if constexpr (std::is_same_v<T, float>)
    if (stride == D && rows[count - 1] == rows[0] + static_cast<int64_t>(count - 1) * D) return cache + rows[0];
  for (int j = 0; j < count; ++j)
    for (int i = 0; i < D; i += kLanes) vstore(buf + static_cast<int64_t>(j) * stride + i, vload(cache + rows[j] + i));
  return buf;
}

// Prefetches one K and one V row (hint 2: the outer caches). Decode asks for the next
// block's row j while it scores key j: a block ahead, spread over the block. With the next
// few keys only, the step's K/V (evicted from every cache by the weights' stream) arrived at
// 12-15 GB/s; a whole block ahead at once, 15-18 (Zen 4, 2026-11-25), 31 (Zen 5, AVX2,
// 32 x 1,024 keys, 2026-11-27); spread, 45 (the DRAM's read bandwidth on 2 cores there).
template <typename T, int D>
inline void prefetch_row(const T* k_cache, const T* v_cache, int64_t row) {
  constexpr int kBytes = D * sizeof(T);
  const char* k = reinterpret_cast<const char*>(k_cache + row);
  const char* v = reinterpret_cast<const char*>(v_cache + row);
  for (int off = 0; off < kBytes; off += 64) {
    __builtin_prefetch(k + off, 0, 2);
    __builtin_prefetch(v + off, 0, 2);
  }
}

// One step of a score's chain: the products of a vector of dims of k and q, added lane by lane.
inline Vec score_chain(Vec k, Vec q, Vec acc) { return vfma(k, q, acc); }

// Rows in lanes: st[j * RV * kLanes + r] for keys j < num_keys (k: [num_keys][D]) and rows
// r < RV * kLanes (q: their rows [RV * kLanes][D], pre-scaled), each score as keys in lanes
// compute it (seq_first.h private_heads): a tile is kLanes rows against one key, a row's chain in each accumulator, so
// a key's scores for a vector of rows leave as one vector (a 4 x 4 tile of rows and keys
// needs a quarter of the loads but four partial stores per key: it ran 2x slower).
// before_key(j) runs before key j's scores (a prefetch).
template <int D, int RV, typename BeforeKey>
inline void row_scores(const float* q, const float* k, int num_keys, float* st, BeforeKey&& before_key) {
  constexpr int L = RV * kLanes, kVecs = D / kLanes;
  for (int j = 0; j < num_keys; ++j) {
    before_key(j);
    for (int rv = 0; rv < RV; ++rv) {
      Vec acc[kLanes];
#pragma GCC unroll 16
      for (int t = 0; t < kLanes; ++t) acc[t] = vzero();
#pragma GCC unroll 16
      for (int i = 0; i < kVecs; ++i) {
        const Vec kv = vload(k + j * D + i * kLanes);
#pragma GCC unroll 16
        for (int t = 0; t < kLanes; ++t)
          acc[t] = score_chain(kv, vload(q + (rv * kLanes + t) * D + i * kLanes), acc[t]);
      }
      vstore(st + j * L + rv * kLanes, vsum_lanes(acc));
    }
  }
}

// Rows in lanes: st's scores [num_keys][RV * kLanes] become e = 2^(s - m_b); mb and nb get
// each row vector's m_b and n_b.
template <int RV>
inline void row_softmax(float* st, int num_keys, Vec* mb, Vec* nb) {
  constexpr int L = RV * kLanes;
  for (int r = 0; r < RV; ++r) {
    Vec m = vload(st + r * kLanes);
    for (int j = 1; j < num_keys; ++j) m = vmax(m, vload(st + j * L + r * kLanes));
    Vec n = vzero();
    for (int j = 0; j < num_keys; ++j) {
      const Vec e = vexp2(vsub(vload(st + j * L + r * kLanes), m));
      vstore(st + j * L + r * kLanes, e);
      n = vadd(n, e);
    }
    mb[r] = m;
    nb[r] = n;
  }
}

// Dims of one row_pv pass for RV row vectors: kPvDims, twice as many for a single row
// vector (few rows per KV head: MHA models, small batches), where kPvDims chains were too
// few to hide the FMA's latency. Every head dim the kernels take is a multiple of both.
template <int RV>
constexpr int pv_dims() {
  return RV == 1 ? 2 * kPvDims : kPvDims;
}

// Rows in lanes: o_b of dims [d0, d0 + pv_dims<RV>()) for RV row vectors (v: [num_keys]
// [kVStride], e: st), then emit(dim, row vector, o_b). Each V value broadcast, each e vector
// loaded once per key; a row's FMAs run in key order from 0.
template <int RV, int kVStride, typename Emit>
inline void row_pv(const float* v, int num_keys, const float* st, int d0, Emit&& emit) {
  constexpr int L = RV * kLanes, PD = pv_dims<RV>();
  Vec acc[PD][RV];
#pragma GCC unroll 16
  for (int e = 0; e < PD; ++e)
#pragma GCC unroll 4
    for (int r = 0; r < RV; ++r) acc[e][r] = vzero();
  for (int j = 0; j < num_keys; ++j) {
    Vec pt[RV];
#pragma GCC unroll 4
    for (int r = 0; r < RV; ++r) pt[r] = vload(st + j * L + r * kLanes), vpin(pt[r]);
#pragma GCC unroll 16
    for (int e = 0; e < PD; ++e) {
      const Vec x = vset1(v[j * kVStride + d0 + e]);
#pragma GCC unroll 4
      for (int r = 0; r < RV; ++r) acc[e][r] = vfma(x, pt[r], acc[e][r]);
    }
  }
#pragma GCC unroll 16
  for (int e = 0; e < PD; ++e)
#pragma GCC unroll 4
    for (int r = 0; r < RV; ++r) emit(d0 + e, r, acc[e][r]);
}

// The fold's weights: m' = max(m, m_b), a = 2^(m - m'), c = 2^(m_b - m') (a lane per row).
struct FoldWeights {
  Vec m, a, c;
};
inline FoldWeights fold_weights(Vec m, Vec mb) {
  const Vec mn = vmax(m, mb);
  return {mn, vexp2(vsub(m, mn)), vexp2(vsub(mb, mn))};
}
// x' = fma(x_b, c, x * a): the fold of a block's n_b or o_b into the running n or o.
inline Vec fold(Vec x, Vec xb, const FoldWeights& w) { return vfma(xb, w.c, vmul(x, w.a)); }

// Keys in lanes: one query's running (m, n) (scalars) and o [D] folded with a block's
// partial (mb, nb, ob [D]), the same operations as the rows-in-lanes fold on one lane.
template <int D>
inline void fold_one(float& m, float& n, float* o, float mb, float nb, const float* ob) {
  const FoldWeights w = fold_weights(vset1(m), vset1(mb));
  m = vreduce_max(w.m);  // (all lanes equal)
  n = vreduce_max(fold(vset1(n), vset1(nb), w));
  for (int d = 0; d < D; d += kLanes) vstore(o + d, fold(vload(o + d), vload(ob + d), w));
}

// V's row stride for the P V product (row_pv), which walks V a column of a few values at a time
// down all the block's rows: at D >= 128 (512 bytes or more) those rows fall into one
// eighth of L1's sets or fewer and evict each other, so V is copied to rows 16 floats
// (a cache line) longer: D = 128 ran 4% faster in the prefill (one thread, 1,024 tokens),
// and decode's shared blocks with 8 rows per KV head 5.4 -> 4.9 ms (AVX2, 8 x 2,048 keys, 32
// heads). At D = 64 the rows spread over enough sets and the copy only cost time (about 5%).
template <int D>
constexpr int kVStride = D >= 128 ? D + 16 : D;

// Calls f(Count<n>{}) for a run-time n in [1, N]: each width of a register tile (row
// vectors, heads, dim vectors) is its own instantiation.
template <int N>
struct Count {
  static constexpr int value = N;
};
template <int N, typename F>
inline void with_count(int n, F&& f) {
  if constexpr (N >= 1) {
    if (n == N)
      f(Count<N>{});
    else
      with_count<N - 1>(n, f);
  }
}

}  // namespace CHUNK_ATTN_ISA
}  // namespace chunk_attn_cpu
