// Torch-free two-phase-partition decode attention for the CPU (OpenMP).
//
// Phase 1 (chunk-first): the shared chunks are grouped into runs (consecutive chunks
// on the path of the same sequences), and one work item takes a segment of a run for
// one KV head and up to kRowsPerItem query rows (sequence x head of the GQA group).
// Per chunk and 32-row block it is a small GEMM S^T = K Q^T over the chunk's keys,
// an online-softmax update and O = O * correction + P V, FlashAttention style, so a
// whole segment leaves one partial (o, m, n) per row instead of one per chunk.
// Phase 2 (sequence-first), one item per (sequence, KV head): online softmax over the
// private chunks, then the merge with the sequence's shared partials.
// Scores are kept in the log2 domain (Q is pre-scaled by scale * log2 e).
#pragma once

#include <vector>

#include "vec16.h"

namespace chunk_attn_cpu {

struct Params {
  const void* q;        // [num_seqs, num_heads, head_dim]
  const void* k_cache;  // [capacity, num_kv_heads, chunk_size, head_dim]
  const void* v_cache;
  void* out;            // [num_seqs, num_heads, head_dim]
  float* partial_o;     // [num_pairs, num_heads, head_dim]
  float* partial_m;     // [num_pairs, num_heads]; -inf marks a slot whose chunk was merged into an earlier slot
  float* partial_n;     // [num_pairs, num_heads]
  float* q_t;           // [num_kv_heads, head_dim, q_t_stride]: Q^T per KV head, rows seq * group + g
  const int64_t* shared_chunk_ids;   // [num_shared]
  const int64_t* shared_begin;       // [num_shared]
  const int64_t* shared_end;         // [num_shared]
  const int64_t* shared_depth;       // [num_shared]
  const int64_t* private_chunk_ids;  // [num_seqs, max_private]
  const int64_t* num_shared_tokens;  // [num_seqs]
  const int64_t* seq_lens;           // [num_seqs]
  const int64_t* seq_pair_ptr;       // [num_seqs + 1]
  int num_seqs, num_heads, num_kv_heads, head_dim, chunk_size, num_shared, max_private;
  int max_chunks_per_item;  // segment length cap: fewer partials vs more parallel items
  float scale;
};

constexpr int kRowsPerItem = 128;  // bounds the per-thread O buffer; more rows split into items

// Q^T rows are padded so that a 32-row block starting at any row stays inside.
inline int64_t q_t_stride(int num_seqs, int num_heads, int num_kv_heads) {
  return (static_cast<int64_t>(num_seqs) * (num_heads / num_kv_heads) + 47) / 16 * 16;
}

// Scratch floats the caller provides: partials, then Q^T.
inline int64_t scratch_floats(int64_t num_pairs, int num_seqs, int num_heads, int num_kv_heads, int head_dim) {
  return num_pairs * num_heads * (head_dim + 2) +
         static_cast<int64_t>(num_kv_heads) * head_dim * q_t_stride(num_seqs, num_heads, num_kv_heads);
}

struct ChunkItem {
  int first, count;         // shared chunks [first, first + count): one segment of a run
  int row_begin, row_end;   // query rows seq * group + g of this KV head
  int kv_head;
};

// Runs split into near-equal segments of at most max_chunks_per_item chunks.
inline std::vector<ChunkItem> chunk_items(const Params& p) {
  const int group = p.num_heads / p.num_kv_heads;
  std::vector<ChunkItem> items;
  for (int s = 0; s < p.num_shared;) {
    int run = 1;
    while (s + run < p.num_shared && p.shared_begin[s + run] == p.shared_begin[s] &&
           p.shared_end[s + run] == p.shared_end[s] && p.shared_depth[s + run] == p.shared_depth[s] + run)
      ++run;
    const int num_segments = (run + p.max_chunks_per_item - 1) / p.max_chunks_per_item;
    const int row_begin = static_cast<int>(p.shared_begin[s]) * group, row_end = static_cast<int>(p.shared_end[s]) * group;
    for (int i = 0; i < num_segments; ++i) {
      const int first = s + run * i / num_segments, last = s + run * (i + 1) / num_segments;
      for (int r = row_begin; r < row_end; r += kRowsPerItem)
        for (int h = 0; h < p.num_kv_heads; ++h)
          items.push_back({first, last - first, r, std::min(row_end, r + kRowsPerItem), h});
    }
    s += run;
  }
  return items;
}

struct Workspace {
  std::vector<float> o, m, n, s, k, v, q;
};

// Offset of one chunk's [C][D] block for one KV head in k_cache / v_cache.
inline int64_t chunk_offset(const Params& p, int64_t chunk_id, int kv_head) {
  return (chunk_id * p.num_kv_heads + kv_head) * static_cast<int64_t>(p.chunk_size) * p.head_dim;
}

// A chunk's K or V ([C][D] of one KV head) as fp32: in place, or converted from bf16.
inline const float* as_float(const float* src, int64_t, std::vector<float>&) { return src; }
inline const float* as_float(const uint16_t* src, int64_t count, std::vector<float>& buf) {
  buf.resize(count);
  for (int64_t i = 0; i < count; ++i) buf[i] = load(src, i);
  return buf.data();
}

// One block of 16 * RV query rows against one chunk. qt: row b of dim d at
// qt[d * stride + b]; k, v: [C][D]; st: [C][16 * RV] scratch; o: [16 * RV][D];
// m, n: [16 * RV] running max and sum. Register tiles keep the loads per FMA low:
// S^T takes 8 keys x RV row vectors per dim, P V 4 rows x 4 dim vectors per key.
// next_k, next_v: the next chunk's K and V (next_bytes each) to prefetch, or null.
template <int D, int RV>
inline void block_update(const float* qt, int64_t stride, const float* k, const float* v, int C, float* st,
                         float* o, float* m, float* n, const char* next_k, const char* next_v, int64_t next_bytes) {
  constexpr int L = 16 * RV;
  for (int j = 0; j < C; j += 8) {
    if (next_k != nullptr) {  // spread over the chunk: C / 8 key blocks, D lines of 64 bytes each
      const int64_t at = static_cast<int64_t>(j / 8) * D * 64 % (2 * next_bytes);
      for (int64_t off = at; off < std::min(at + D * 64, 2 * next_bytes); off += 64)
        __builtin_prefetch(off < next_bytes ? next_k + off : next_v + off - next_bytes, 0, 2);
    }
    V16 acc[RV][8];
#pragma GCC unroll 16
    for (int r = 0; r < RV; ++r)
#pragma GCC unroll 8
      for (int u = 0; u < 8; ++u) acc[r][u] = vset1(0.f);
    for (int d = 0; d < D; ++d) {
      V16 q[RV];
#pragma GCC unroll 2
      for (int r = 0; r < RV; ++r) q[r] = vload(qt + d * stride + 16 * r), vpin(q[r]);
#pragma GCC unroll 8
      for (int u = 0; u < 8; ++u) {
        const V16 key = vset1(k[(j + u) * D + d]);
#pragma GCC unroll 2
        for (int r = 0; r < RV; ++r) acc[r][u] = vfma(key, q[r], acc[r][u]);
      }
    }
#pragma GCC unroll 8
    for (int u = 0; u < 8; ++u)
#pragma GCC unroll 2
      for (int r = 0; r < RV; ++r) vstore(st + (j + u) * L + 16 * r, acc[r][u]);
  }
  alignas(64) float corr[L];
  for (int r = 0; r < RV; ++r) {
    const V16 m_old = vload(m + 16 * r);
    V16 m_new = m_old;
    for (int j = 0; j < C; ++j) m_new = vmax(m_new, vload(st + j * L + 16 * r));
    const V16 correction = vexp2(vsub(m_old, m_new));  // 0 on the first chunk (m_old = -inf)
    V16 sum = vmul(vload(n + 16 * r), correction);
    for (int j = 0; j < C; ++j) {
      const V16 e = vexp2(vsub(vload(st + j * L + 16 * r), m_new));
      vstore(st + j * L + 16 * r, e);
      sum = vadd(sum, e);
    }
    vstore(m + 16 * r, m_new);
    vstore(n + 16 * r, sum);
    vstore(corr + 16 * r, correction);
  }
  for (int d0 = 0; d0 < D; d0 += 64) {
    for (int b = 0; b < L; b += 4) {
      V16 acc[4][4];
#pragma GCC unroll 4
      for (int u = 0; u < 4; ++u)
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i) acc[u][i] = vmul(vload(o + (b + u) * D + d0 + 16 * i), vset1(corr[b + u]));
      for (int j = 0; j < C; ++j) {
        V16 x[4];
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i) x[i] = vload(v + j * D + d0 + 16 * i), vpin(x[i]);
#pragma GCC unroll 4
        for (int u = 0; u < 4; ++u) {
          const V16 prob = vset1(st[j * L + b + u]);
#pragma GCC unroll 4
          for (int i = 0; i < 4; ++i) acc[u][i] = vfma(prob, x[i], acc[u][i]);
        }
      }
#pragma GCC unroll 4
      for (int u = 0; u < 4; ++u)
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i) vstore(o + (b + u) * D + d0 + 16 * i, acc[u][i]);
    }
  }
}

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
    for (int d = 0; d < D; ++d) qt[d * stride + r] = load(q, row + d) * qs;
  }
  for (int d = 0; d < D; ++d) std::fill(qt + d * stride + rows, qt + (d + 1) * stride, 0.f);
}

template <typename T, int D>
void chunk_first_item(const Params& p, const ChunkItem& item, Workspace& w) {
  const int C = p.chunk_size, H = p.num_heads, group = H / p.num_kv_heads;
  const int num_rows = item.row_end - item.row_begin, padded = (num_rows + 15) / 16 * 16;
  w.o.assign(static_cast<size_t>(padded) * D, 0.f);
  w.m.assign(padded, kNegInf);
  w.n.assign(padded, 0.f);
  w.s.resize(static_cast<size_t>(C) * 32);
  const int64_t stride = q_t_stride(p.num_seqs, H, p.num_kv_heads);
  const float* qt = p.q_t + static_cast<int64_t>(item.kv_head) * D * stride + item.row_begin;
  for (int c = 0; c < item.count; ++c) {
    const int64_t base = chunk_offset(p, p.shared_chunk_ids[item.first + c], item.kv_head);
    const float* k = as_float(static_cast<const T*>(p.k_cache) + base, static_cast<int64_t>(C) * D, w.k);
    const float* v = as_float(static_cast<const T*>(p.v_cache) + base, static_cast<int64_t>(C) * D, w.v);
    const char *next_k = nullptr, *next_v = nullptr;
    if (c + 1 < item.count) {
      const int64_t next = chunk_offset(p, p.shared_chunk_ids[item.first + c + 1], item.kv_head);
      next_k = reinterpret_cast<const char*>(static_cast<const T*>(p.k_cache) + next);
      next_v = reinterpret_cast<const char*>(static_cast<const T*>(p.v_cache) + next);
    }
    const int64_t next_bytes = static_cast<int64_t>(C) * D * sizeof(T);
    for (int b = 0; b < padded; b += 32) {  // 32-row blocks, a last 16-row one; the first prefetches
      float* o = w.o.data() + static_cast<size_t>(b) * D;
      if (padded - b >= 32)
        block_update<D, 2>(qt + b, stride, k, v, C, w.s.data(), o, w.m.data() + b, w.n.data() + b, next_k, next_v,
                           next_bytes);
      else
        block_update<D, 1>(qt + b, stride, k, v, C, w.s.data(), o, w.m.data() + b, w.n.data() + b, next_k, next_v,
                           next_bytes);
      next_k = next_v = nullptr;
    }
  }
  for (int r = 0; r < num_rows; ++r) {
    const int row = item.row_begin + r, seq = row / group, head = item.kv_head * group + row % group;
    const int64_t slot = p.seq_pair_ptr[seq] + p.shared_depth[item.first];
    const int64_t at = slot * H + head;
    std::memcpy(p.partial_o + at * D, w.o.data() + static_cast<size_t>(r) * D, sizeof(float) * D);
    p.partial_m[at] = w.m[r];
    p.partial_n[at] = w.n[r];
    for (int c = 1; c < item.count; ++c) p.partial_m[(slot + c) * H + head] = kNegInf;
  }
}

// Phase 2 for one (sequence, KV head): private chunks, then merge with shared partials.
template <typename T, int D>
void seq_first_item(const Params& p, int seq, int kv_head, Workspace& w) {
  constexpr int kVec = D / 16;
  const int C = p.chunk_size, H = p.num_heads, group = H / p.num_kv_heads;  // C: a multiple of 16
  w.q.resize(static_cast<size_t>(group) * D);
  w.o.assign(static_cast<size_t>(group) * D, 0.f);
  w.m.assign(group, kNegInf);
  w.n.assign(group, 0.f);
  w.s.resize(static_cast<size_t>(group) * C);
  const T* q = static_cast<const T*>(p.q);
  for (int g = 0; g < group; ++g) {
    const int64_t row = (static_cast<int64_t>(seq) * H + kv_head * group + g) * D;
    for (int d = 0; d < D; ++d) w.q[g * D + d] = load(q, row + d) * p.scale * kLog2e;
  }
  const int64_t first = p.num_shared_tokens[seq], length = p.seq_lens[seq];
  for (int64_t t0 = first; t0 < length; t0 += C) {
    const int64_t chunk = p.private_chunk_ids[static_cast<int64_t>(seq) * p.max_private + (t0 - first) / C];
    const int count = static_cast<int>(std::min<int64_t>(C, length - t0));
    const int64_t base = chunk_offset(p, chunk, kv_head);
    const float* k = as_float(static_cast<const T*>(p.k_cache) + base, static_cast<int64_t>(count) * D, w.k);
    const float* v = as_float(static_cast<const T*>(p.v_cache) + base, static_cast<int64_t>(count) * D, w.v);
    for (int g = 0; g < group; ++g) {  // 16 keys at a time, reduced together
      V16 qg[kVec];
#pragma GCC unroll 16
      for (int i = 0; i < kVec; ++i) qg[i] = vload(w.q.data() + g * D + 16 * i);
      for (int j0 = 0; j0 < count; j0 += 16) {
        V16 acc[16];
#pragma GCC unroll 16
        for (int j = 0; j < 16; ++j) {
          acc[j] = vset1(0.f);
          if (j0 + j < count)
#pragma GCC unroll 16
            for (int i = 0; i < kVec; ++i) acc[j] = vfma(vload(k + (j0 + j) * D + 16 * i), qg[i], acc[j]);
        }
        vstore(w.s.data() + g * C + j0, vsum16(acc));
      }
    }
    for (int g = 0; g < group; ++g) {
      float* sg = w.s.data() + g * C;
      std::fill(sg + count, sg + C, kNegInf);  // 2^-inf = 0: the tail adds nothing
      V16 mx = vset1(w.m[g]);
      for (int j = 0; j < C; j += 16) mx = vmax(mx, vload(sg + j));
      const float m_new = vmax_lane(mx);
      V16 sum = vset1(0.f);
      for (int j = 0; j < C; j += 16) {
        const V16 e = vexp2(vsub(vload(sg + j), vset1(m_new)));
        vstore(sg + j, e);
        sum = vadd(sum, e);
      }
      const float correction = exp2_scalar(w.m[g] - m_new);
      float* og = w.o.data() + g * D;
      V16 acc[kVec];
#pragma GCC unroll 16
      for (int i = 0; i < kVec; ++i) acc[i] = vmul(vload(og + 16 * i), vset1(correction));
      for (int j = 0; j < count; ++j) {
        const V16 pj = vset1(sg[j]);
#pragma GCC unroll 16
        for (int i = 0; i < kVec; ++i) acc[i] = vfma(pj, vload(v + j * D + 16 * i), acc[i]);
      }
#pragma GCC unroll 16
      for (int i = 0; i < kVec; ++i) vstore(og + 16 * i, acc[i]);
      w.n[g] = w.n[g] * correction + vsum(sum);
      w.m[g] = m_new;
    }
  }
  // merge the shared partials (slots seq_pair_ptr[seq] ..) and normalise
  const int64_t pair_begin = p.seq_pair_ptr[seq], pair_end = p.seq_pair_ptr[seq + 1];
  T* out = static_cast<T*>(p.out);
  for (int g = 0; g < group; ++g) {
    const int head = kv_head * group + g;
    float m_all = w.m[g];
    for (int64_t i = pair_begin; i < pair_end; ++i) m_all = std::max(m_all, p.partial_m[i * H + head]);
    const float own = exp2_scalar(w.m[g] - m_all);
    float n_all = w.n[g] * own;
    float* og = w.o.data() + g * D;
    for (int d = 0; d < D; ++d) og[d] *= own;
    for (int64_t i = pair_begin; i < pair_end; ++i) {
      const float m_i = p.partial_m[i * H + head];
      if (m_i == kNegInf) continue;  // merged into an earlier slot of its segment
      const float weight = exp2_scalar(m_i - m_all);
      n_all += p.partial_n[i * H + head] * weight;
      const float* po = p.partial_o + (i * H + head) * D;
      for (int d = 0; d < D; ++d) og[d] += weight * po[d];
    }
    const float inv = 1.f / n_all;
    const int64_t row = (static_cast<int64_t>(seq) * H + head) * D;
    for (int d = 0; d < D; ++d) store(out, row + d, og[d] * inv);
  }
}

template <typename T, int D>
void tpp_decode_fixed(const Params& p) {
  const std::vector<ChunkItem> items = chunk_items(p);
  const int num_items = static_cast<int>(items.size()), num_seq_items = p.num_seqs * p.num_kv_heads;
#pragma omp parallel
  {
    Workspace w;
    if (num_items > 0) {
#pragma omp for schedule(static)
      for (int h = 0; h < p.num_kv_heads; ++h) transpose_q<T, D>(p, h);
#pragma omp for schedule(dynamic, 1)
      for (int i = 0; i < num_items; ++i) chunk_first_item<T, D>(p, items[i], w);
    }
    // implicit barrier: every partial is written before any merge reads it
#pragma omp for schedule(dynamic, 1)
    for (int i = 0; i < num_seq_items; ++i) seq_first_item<T, D>(p, i / p.num_kv_heads, i % p.num_kv_heads, w);
  }
}

inline bool supports(int chunk_size, int head_dim) {
  return chunk_size > 0 && chunk_size % 16 == 0 && (head_dim == 64 || head_dim == 128 || head_dim == 256);
}

// Returns false for an unsupported (chunk_size, head_dim).
template <typename T>
bool tpp_decode(const Params& p) {
  if (!supports(p.chunk_size, p.head_dim) || p.max_chunks_per_item < 1) return false;
  switch (p.head_dim) {
    case 64: tpp_decode_fixed<T, 64>(p); return true;
    case 128: tpp_decode_fixed<T, 128>(p); return true;
    default: tpp_decode_fixed<T, 256>(p); return true;
  }
}

}  // namespace chunk_attn_cpu
