// Phase 2 (sequence-first) of the CPU kernel, written once against the lane API.
//
// One work item per (sequence, KV head): online softmax over the sequence's private
// segments for every head of the GQA group, then the merge with the sequence's
// shared-segment partials. This phase reads each private K/V byte once and does little
// math per byte, so it is bound by memory reads, and its loop order is chosen for
// the hardware prefetchers: blocks of kLanes keys, each K and V row read whole and in
// address order (reading eight rows side by side, a vector of each at a time, ran at
// 60% of the speed), the rows reused from L1 by the other heads of the group, and the
// next block's rows prefetched in software, which also covers the jump from one
// segment to the next that the hardware prefetchers do not follow.
#pragma once

namespace chunk_attn_cpu {
namespace CHUNK_ATTN_ISA {

// kLanes zeros then kLanes -inf: loaded at kLanes - num_keys, it masks the lanes of
// a block past its last key.
struct TailMask {
  float v[2 * kLanes];
};
constexpr TailMask make_tail_mask() {
  TailMask t{};
  for (int i = 0; i < 2 * kLanes; ++i) t.v[i] = i < kLanes ? 0.f : kNegInf;
  return t;
}
alignas(64) static constexpr TailMask kTailMask = make_tail_mask();
// kLanes -inf then kLanes zeros: loaded at kLanes - skip, it masks a block's first
// `skip` lanes (keys before a sliding window).
constexpr TailMask make_head_mask() {
  TailMask t{};
  for (int i = 0; i < 2 * kLanes; ++i) t.v[i] = i < kLanes ? kNegInf : 0.f;
  return t;
}
alignas(64) static constexpr TailMask kHeadMask = make_head_mask();

// Prefetches kLanes K and V rows at `at` (one block; its rows are contiguous).
template <typename T, int D>
inline void prefetch_block(const Params& p, int64_t at) {
  const char* k = reinterpret_cast<const char*>(static_cast<const T*>(p.k_cache) + at);
  const char* v = reinterpret_cast<const char*>(static_cast<const T*>(p.v_cache) + at);
  constexpr int kBytes = kLanes * D * sizeof(T);
  for (int off = 0; off < kBytes; off += 64) {
    __builtin_prefetch(k + off, 0, 3);
    __builtin_prefetch(v + off, 0, 3);
  }
}

// o[0 : NV * kLanes] += sum over u < num_keys of probs[u] * v[u * D : ...]: NV dim
// vectors of O_g in registers, each V row read in order.
template <int NV, typename T, int D>
inline void accumulate_pv(float* o, const T* v, const float* probs, int num_keys) {
  Vec out[NV];
#pragma GCC unroll 16
  for (int i = 0; i < NV; ++i) out[i] = vload(o + i * kLanes);
  for (int u = 0; u < num_keys; ++u) {
    const Vec pu = vset1(probs[u]);
#pragma GCC unroll 16
    for (int i = 0; i < NV; ++i) out[i] = vfma(pu, vload(v + u * D + i * kLanes), out[i]);
  }
#pragma GCC unroll 16
  for (int i = 0; i < NV; ++i) vstore(o + i * kLanes, out[i]);
}

template <typename T, int D>
void seq_first_item(const Params& p, int seq, int kv_head, float* ws) {
  constexpr int kVecs = D / kLanes;
  const int H = p.num_heads, group = H / p.num_kv_heads;
  float* q = ws;                // [group][D]
  float* o = q + group * D;     // [group][D]
  float* m = o + group * D;     // [group]
  float* n = m + group;         // [group]
  // the group's heads are consecutive: one run of group * D values
  const T* q_src = static_cast<const T*>(p.q) + (static_cast<int64_t>(seq) * H + kv_head * group) * D;
  const Vec q_scale = vset1(p.scale * kLog2e);
  for (int i = 0; i < group * D; i += kLanes) {
    vstore(q + i, vmul(vload(q_src + i), q_scale));
    vstore(o + i, vzero());
  }
  for (int g = 0; g < group; ++g) m[g] = kNegInf, n[g] = 0.f;

  const int64_t first = p.num_shared_tokens[seq], length = p.seq_lens[seq];
  const int64_t* chunk_ids = p.private_chunk_ids + static_cast<int64_t>(seq) * p.max_private;
  const int64_t* starts = p.private_start + static_cast<int64_t>(seq) * p.max_private;
  const int64_t* positions = p.private_pos + static_cast<int64_t>(seq) * p.max_private;
  // Under a sliding window the walk starts at the block holding the window's first
  // key, and that block's earlier lanes are masked (the query's own key is private or
  // shared, so the first block visited always has a visible key).
  const int64_t window_first = window_start(length - 1, p.window);
  const int64_t start = window_first > first ? window_first : first;
  alignas(64) float probs[kLanes];
  // Segment seg holds positions [positions[seg], its end): the next one's position, or the length.
  const auto segment_end = [&](int seg) {
    const int64_t next = seg + 1 < p.max_private ? positions[seg + 1] : kNoPosition;
    return next < length ? next : length;
  };
  for (int seg = 0; seg < p.max_private && positions[seg] < length; ++seg) {
    const int64_t t0 = positions[seg], end = segment_end(seg);
    if (end <= start) continue;  // wholly before the window
    const int count = static_cast<int>(end - t0);
    const int64_t base = chunk_offset(p, chunk_ids[seg], kv_head) + starts[seg] * D;
    const T* k = static_cast<const T*>(p.k_cache) + base;
    const T* v = static_cast<const T*>(p.v_cache) + base;
    // kLanes keys at a time, FlashAttention style: the scores of the block for one head,
    // the online-softmax update, then the block's V rows into O, so the K and V rows
    // are read together (two streams in flight); the block's rows stay in L1 for the
    // other heads of the group.
    for (int j0 = static_cast<int>(t0 < start ? (start - t0) / kLanes * kLanes : 0); j0 < count; j0 += kLanes) {
      // the next block's rows, in this segment or at the start of the next
      if (j0 + kLanes < count)
        prefetch_block<T, D>(p, base + static_cast<int64_t>(j0 + kLanes) * D);
      else if (seg + 1 < p.max_private && positions[seg + 1] < length)
        prefetch_block<T, D>(p, chunk_offset(p, chunk_ids[seg + 1], kv_head) + starts[seg + 1] * D);
      const int num_keys = count - j0 < kLanes ? count - j0 : kLanes;
      const int skip = static_cast<int>(start - (t0 + j0) > 0 ? start - (t0 + j0) : 0);  // < kLanes
      const T* kb = k + static_cast<int64_t>(j0) * D;
      const T* vb = v + static_cast<int64_t>(j0) * D;
      for (int g = 0; g < group; ++g) {
        Vec acc[kLanes];
#pragma GCC unroll 16
        for (int u = 0; u < kLanes; ++u) acc[u] = vzero();
        for (int u = 0; u < num_keys; ++u) {  // row by row: the reads of K are sequential
          Vec a0 = vzero(), a1 = vzero();
#pragma GCC unroll 16
          for (int i = 0; i + 1 < kVecs; i += 2) {
            a0 = vfma(vload(kb + u * D + i * kLanes), vload(q + g * D + i * kLanes), a0);
            a1 = vfma(vload(kb + u * D + (i + 1) * kLanes), vload(q + g * D + (i + 1) * kLanes), a1);
          }
          if constexpr (kVecs % 2)  // an odd number of dim vectors (e.g. D = 80 in 16 lanes)
            a0 = vfma(vload(kb + u * D + (kVecs - 1) * kLanes), vload(q + g * D + (kVecs - 1) * kLanes), a0);
          acc[u] = vadd(a0, a1);
        }
        // lanes past num_keys: + -inf, so 2^(s - m) = 0 there
        Vec scores = vadd(vsum_lanes(acc), vload(kTailMask.v + kLanes - num_keys));
        if (skip > 0) scores = vadd(scores, vload(kHeadMask.v + kLanes - skip));
        const float m_new = m[g] > vreduce_max(scores) ? m[g] : vreduce_max(scores);
        const Vec e = vexp2(vsub(scores, vset1(m_new)));
        vstore(probs, e);
        float* og = o + g * D;
        if (m_new > m[g]) {  // a new maximum: rescale what is summed so far (rare after the first blocks)
          const float correction = exp2_scalar(m[g] - m_new);  // 0 on the first block (m = -inf)
          n[g] *= correction;
          for (int d = 0; d < D; d += kLanes) vstore(og + d, vmul(vload(og + d), vset1(correction)));
          m[g] = m_new;
        }
        n[g] += vreduce_add(e);
        // O_g in registers where it fits; wider, a slice of dims at a time (measured faster
        // than all of O_g through L1 a few keys at a time), the last one narrower where
        // kSeqPvVecs vectors do not divide D
        constexpr int kSlice = (kVecs < kSeqPvVecs ? kVecs : kSeqPvVecs) * kLanes, kWhole = D / kSlice * kSlice;
        for (int d0 = 0; d0 < kWhole; d0 += kSlice) accumulate_pv<kSlice / kLanes, T, D>(og + d0, vb + d0, probs, num_keys);
        if constexpr (kWhole < D) accumulate_pv<(D - kWhole) / kLanes, T, D>(og + kWhole, vb + kWhole, probs, num_keys);
      }
    }
  }

  // Merge the shared partials (slots seq_pair_ptr[seq] ..) and normalise.
  const int64_t pair_begin = p.seq_pair_ptr[seq], pair_end = p.seq_pair_ptr[seq + 1];
  T* out = static_cast<T*>(p.out);
  for (int g = 0; g < group; ++g) {
    const int head = kv_head * group + g;
    float m_all = m[g];
    for (int64_t i = pair_begin; i < pair_end; ++i) {
      const float m_i = p.partial_m[i * H + head];
      m_all = m_all > m_i ? m_all : m_i;
    }
    const float own = exp2_scalar(m[g] - m_all);  // 0 when the sequence has no private token
    float n_all = n[g] * own;
    float* og = o + g * D;
    for (int d = 0; d < D; d += kLanes) vstore(og + d, vmul(vload(og + d), vset1(own)));
    for (int64_t i = pair_begin; i < pair_end; ++i) {
      const float m_i = p.partial_m[i * H + head];
      if (m_i == kNegInf) continue;  // merged into an earlier slot of its segment
      const float weight = exp2_scalar(m_i - m_all);
      n_all += p.partial_n[i * H + head] * weight;
      const float* po = p.partial_o + (i * H + head) * D;
      for (int d = 0; d < D; d += kLanes) vstore(og + d, vfma(vset1(weight), vload(po + d), vload(og + d)));
    }
    const Vec inv = vset1(1.f / n_all);
    T* row = out + (static_cast<int64_t>(seq) * H + head) * D;
    for (int d = 0; d < D; d += kLanes) vstore(row + d, vmul(vload(og + d), inv));
  }
}

}  // namespace CHUNK_ATTN_ISA
}  // namespace chunk_attn_cpu
