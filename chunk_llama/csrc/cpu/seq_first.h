// Phase 2 (sequence-first) of the CPU kernel, written once against the lane API.
//
// One work item per (sequence, KV head, part of its private keys: see num_parts): online
// softmax over the part's keys for every head of the GQA group; then the merge of the
// parts, in order, with the sequence's shared-segment partials. This phase reads each
// private K/V byte once and does little math per byte, so it is bound by memory reads,
// and its loop order is chosen for the hardware prefetchers: blocks of kLanes keys, each
// K and V row read whole and in address order (reading eight rows side by side, a vector
// of each at a time, ran at 60% of the speed), the rows reused from L1 by the other heads
// of the group, and the rows a few blocks on prefetched in software, which also covers the
// jump from one segment to the next that the hardware prefetchers do not follow.
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
// How far ahead the walk prefetches, in blocks, into L2 (hint 2): with the next block into
// L1 only, the step's K/V (evicted from every cache by the weights' stream) arrived at 12-15
// GB/s; 4 blocks ahead into L2, 15-18 (30 layers of 1,300 keys, 2 threads, Zen 4, 2026-11-25).
constexpr int kPrefetchBlocks = 4;

template <typename T, int D>
inline void prefetch_block(const Params& p, int64_t at) {
  const char* k = reinterpret_cast<const char*>(static_cast<const T*>(p.k_cache) + at);
  const char* v = reinterpret_cast<const char*>(static_cast<const T*>(p.v_cache) + at);
  constexpr int kBytes = kLanes * D * sizeof(T);
  for (int off = 0; off < kBytes; off += 64) {
    __builtin_prefetch(k + off, 0, 2);
    __builtin_prefetch(v + off, 0, 2);
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

// The sequence's first private key the query sees: after its shared keys, and inside its window.
inline int64_t private_begin(const Params& p, int seq) {
  const int64_t first = p.num_shared_tokens[seq], window_first = window_start(p.seq_lens[seq] - 1, p.window);
  return window_first > first ? window_first : first;
}

// Online softmax of the GQA group's heads (q [group][D], pre-scaled by scale * log2(e))
// over the sequence's private keys at positions [lo, hi), into o [group][D] (unnormalised),
// m and n [group], which start empty (0, -inf, 0).
template <typename T, int D>
void private_keys(const Params& p, int seq, int kv_head, int64_t lo, int64_t hi, const float* q, float* o, float* m,
                  float* n) {
  constexpr int kVecs = D / kLanes;
  const int group = p.num_heads / p.num_kv_heads;
  const int64_t* chunk_ids = p.private_chunk_ids + static_cast<int64_t>(seq) * p.max_private;
  const int64_t* starts = p.private_start + static_cast<int64_t>(seq) * p.max_private;
  const int64_t* positions = p.private_pos + static_cast<int64_t>(seq) * p.max_private;
  alignas(64) float probs[kLanes];
  // Segment seg holds positions [positions[seg], its end): the next one's position, or the length.
  const auto segment_end = [&](int seg) {
    const int64_t next = seg + 1 < p.max_private ? positions[seg + 1] : kNoPosition;
    return next < hi ? next : hi;
  };
  for (int seg = 0; seg < p.max_private && positions[seg] < hi; ++seg) {
    const int64_t t0 = positions[seg], end = segment_end(seg);
    if (end <= lo) continue;  // wholly before the range (the window, or an earlier part)
    const int count = static_cast<int>(end - t0);
    const int64_t base = chunk_offset(p, chunk_ids[seg], kv_head) + starts[seg] * D;
    const T* k = static_cast<const T*>(p.k_cache) + base;
    const T* v = static_cast<const T*>(p.v_cache) + base;
    // kLanes keys at a time, FlashAttention style: the scores of the block for one head,
    // the online-softmax update, then the block's V rows into O, so the K and V rows
    // are read together (two streams in flight); the block's rows stay in L1 for the
    // other heads of the group. The block holding the range's first key masks the keys
    // before it.
    for (int j0 = static_cast<int>(t0 < lo ? (lo - t0) / kLanes * kLanes : 0); j0 < count; j0 += kLanes) {
      // the rows kPrefetchBlocks blocks on, in this segment or in the next
      constexpr int kAhead = kPrefetchBlocks * kLanes;
      if (j0 + kAhead < count)
        prefetch_block<T, D>(p, base + static_cast<int64_t>(j0 + kAhead) * D);
      else if (seg + 1 < p.max_private && positions[seg + 1] < hi) {
        const int64_t into = j0 + kAhead - (count + kLanes - 1) / kLanes * kLanes;
        if (into >= 0 && into < p.chunk_size - starts[seg + 1])
          prefetch_block<T, D>(p, chunk_offset(p, chunk_ids[seg + 1], kv_head) + (starts[seg + 1] + into) * D);
      }
      const int num_keys = count - j0 < kLanes ? count - j0 : kLanes;
      const int skip = static_cast<int>(lo - (t0 + j0) > 0 ? lo - (t0 + j0) : 0);  // < kLanes
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
}

// One head's output: its private partials (num_parts of them, in order: o at o0 + i *
// o_stride, m and n at m0, n0 + i * mn_stride) merged with the sequence's shared partials,
// normalised, into out. o_acc [D]: a buffer (it may be o0).
template <typename T, int D>
void merge_head(const Params& p, int seq, int head, int num_parts, const float* o0, const float* m0, const float* n0,
                int64_t o_stride, int64_t mn_stride, float* o_acc) {
  const int H = p.num_heads;
  const int64_t pair_begin = p.seq_pair_ptr[seq], pair_end = p.seq_pair_ptr[seq + 1];
  float m_all = m0[0];
  for (int i = 1; i < num_parts; ++i) m_all = m_all > m0[i * mn_stride] ? m_all : m0[i * mn_stride];
  for (int64_t i = pair_begin; i < pair_end; ++i) {
    const float m_i = p.partial_m[i * H + head];
    m_all = m_all > m_i ? m_all : m_i;
  }
  const float own = exp2_scalar(m0[0] - m_all);  // 0 when the sequence has no private token
  float n_all = n0[0] * own;
  for (int d = 0; d < D; d += kLanes) vstore(o_acc + d, vmul(vload(o0 + d), vset1(own)));
  for (int i = 1; i < num_parts; ++i) {  // the later parts, in order
    const float weight = exp2_scalar(m0[i * mn_stride] - m_all);
    n_all += n0[i * mn_stride] * weight;
    const float* po = o0 + i * o_stride;
    for (int d = 0; d < D; d += kLanes) vstore(o_acc + d, vfma(vset1(weight), vload(po + d), vload(o_acc + d)));
  }
  for (int64_t i = pair_begin; i < pair_end; ++i) {
    const float m_i = p.partial_m[i * H + head];
    if (m_i == kNegInf) continue;  // merged into an earlier slot of its segment
    const float weight = exp2_scalar(m_i - m_all);
    n_all += p.partial_n[i * H + head] * weight;
    const float* po = p.partial_o + (i * H + head) * D;
    for (int d = 0; d < D; d += kLanes) vstore(o_acc + d, vfma(vset1(weight), vload(po + d), vload(o_acc + d)));
  }
  const Vec inv = vset1(1.f / n_all);
  T* row = static_cast<T*>(p.out) + (static_cast<int64_t>(seq) * H + head) * D;
  for (int d = 0; d < D; d += kLanes) vstore(row + d, vmul(vload(o_acc + d), inv));
}

// Work item (sequence, KV head, part) of phase 2 (see num_parts): the part's keys for the
// group's heads; a sequence of one part is merged and written at once, the parts of a
// longer one go to their slots for merge_parts. A part past the sequence's last: nothing.
template <typename T, int D>
void seq_first_item(const Params& p, int seq, int kv_head, int part, float* ws) {
  const int H = p.num_heads, group = H / p.num_kv_heads;
  const int64_t begin = private_begin(p, seq), length = p.seq_lens[seq];
  const int64_t keys = length > begin ? length - begin : 0;
  const int parts = num_parts(keys);
  if (part >= parts) return;
  float* q = ws;             // [group][D]
  float* o = q + group * D;  // [group][D]
  float* m = o + group * D;  // [group]
  float* n = m + group;      // [group]
  // the group's heads are consecutive: one run of group * D values
  const T* q_src = static_cast<const T*>(p.q) + (static_cast<int64_t>(seq) * H + kv_head * group) * D;
  const Vec q_scale = vset1(p.scale * kLog2e);
  for (int i = 0; i < group * D; i += kLanes) {
    vstore(q + i, vmul(vload(q_src + i), q_scale));
    vstore(o + i, vzero());
  }
  for (int g = 0; g < group; ++g) m[g] = kNegInf, n[g] = 0.f;
  const int64_t span = part_keys(keys), lo = begin + part * span, hi = lo + span < length ? lo + span : length;
  private_keys<T, D>(p, seq, kv_head, lo, hi, q, o, m, n);
  if (parts == 1) {
    for (int g = 0; g < group; ++g)
      merge_head<T, D>(p, seq, kv_head * group + g, 1, o + g * D, m + g, n + g, 0, 0, o + g * D);
    return;
  }
  const int64_t slot = (static_cast<int64_t>(seq) * kMaxParts + part) * H + kv_head * group;
  std::memcpy(p.part_o + slot * D, o, sizeof(float) * group * D);
  std::memcpy(p.part_m + slot, m, sizeof(float) * group);
  std::memcpy(p.part_n + slot, n, sizeof(float) * group);
}

// After every part is written: a sequence of several parts, its group's heads merged and
// written (ws: D floats of the thread's workspace).
template <typename T, int D>
void merge_parts(const Params& p, int seq, int kv_head, float* ws) {
  const int H = p.num_heads, group = H / p.num_kv_heads;
  const int64_t begin = private_begin(p, seq), length = p.seq_lens[seq];
  const int parts = num_parts(length > begin ? length - begin : 0);
  if (parts == 1) return;  // (written by its item)
  for (int g = 0; g < group; ++g) {
    const int64_t slot = static_cast<int64_t>(seq) * kMaxParts * H + kv_head * group + g;
    merge_head<T, D>(p, seq, kv_head * group + g, parts, p.part_o + slot * D, p.part_m + slot, p.part_n + slot,
                     static_cast<int64_t>(H) * D, H, ws);
  }
}

}  // namespace CHUNK_ATTN_ISA
}  // namespace chunk_attn_cpu
