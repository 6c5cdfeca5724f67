// Sequence-first phase: each sequence against its private chunks, then the merge
// of its shared-chunk partials by online softmax.
//
// Block = (sequence, KV head), all heads of the GQA group together so each private
// K/V row is read once. Lanes are split into groups of D/8 lanes; a lane group holds
// one token at a time, each lane 8 elements (one 16-byte load), so a warp covers
// 32 / (D/8) tokens per step. Heads of the group beyond MAX_G are done in passes.
#pragma once

#include "chunk_attn/common.cuh"
#include "chunk_attn/params.h"

namespace chunk_attn {

constexpr int kSeqFirstWarps = 4;
constexpr int kMaxStates = kMaxSplits > kSeqFirstWarps ? kMaxSplits : kSeqFirstWarps;

// Per warp and head: o [D], m, n; per shared partial of the sequence: its row and
// one merge weight per head.
template <int D, int MAX_G>
__host__ __device__ constexpr size_t seq_first_smem(int max_pairs) {
  return sizeof(float) * (kMaxStates * MAX_G * (D + 2) + MAX_G * 2 + max_pairs * (MAX_G + 1));
}

// Shared memory of the final merge: `num_states` private partials (o, m, n), then
// per head the overall max and 1 / normaliser, per shared partial its row and weights.
template <int MAX_G, int D>
struct MergeSmem {
  float* o;
  float* m;
  float* n;
  float* scale;
  float* m_all;
  float* weight;
  int* pair_row;
  __device__ MergeSmem(unsigned char* base, int max_pairs) {
    o = reinterpret_cast<float*>(base);
    m = o + kMaxStates * MAX_G * D;
    n = m + kMaxStates * MAX_G;
    scale = n + kMaxStates * MAX_G;
    m_all = scale + MAX_G;
    weight = m_all + MAX_G;
    pair_row = reinterpret_cast<int*>(weight + max_pairs * MAX_G);
  }
};

// Merge `num_states` private partials (in shared memory) with the sequence's shared-chunk
// partials and write the normalised output of heads g0 .. g0 + num_g. One warp per head
// finds the overall max and normaliser (lanes stride over partials, so their loads are in
// flight together) and leaves a weight per partial; then each element is a weighted sum.
template <typename T, int D, int MAX_G>
__device__ void merge_and_store(const TppParams& p, const MergeSmem<MAX_G, D>& sm, int seq, int kv_head, int g0,
                                int num_g, int num_states) {
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int num_warps = blockDim.x / 32;
  const int group = p.num_heads / p.num_kv_heads;
  const int pair_begin = p.seq_partial_ptr[seq];
  const int num_pairs = p.seq_partial_ptr[seq + 1] - pair_begin;
  const float* pm = p.partial_m + static_cast<size_t>(kv_head) * p.num_partial_rows;
  const float* pn = p.partial_n + static_cast<size_t>(kv_head) * p.num_partial_rows;
  const float* po = p.partial_o + static_cast<size_t>(kv_head) * p.num_partial_rows * D;
  for (int i = threadIdx.x; i < num_pairs; i += blockDim.x) sm.pair_row[i] = p.seq_partial_rows[pair_begin + i];
  __syncthreads();
  for (int g = warp; g < num_g; g += num_warps) {
    float m_all = lane < num_states ? sm.m[lane * MAX_G + g] : -INFINITY;
    for (int i = lane; i < num_pairs; i += 32) m_all = fmaxf(m_all, pm[sm.pair_row[i] + g0 + g]);
    m_all = warp_max(m_all);
    float n_all = lane < num_states ? sm.n[lane * MAX_G + g] * rescale(sm.m[lane * MAX_G + g], m_all) : 0.f;
    for (int i = lane; i < num_pairs; i += 32) {
      const int r = sm.pair_row[i] + g0 + g;
      const float w = rescale(pm[r], m_all);
      sm.weight[i * MAX_G + g] = w;
      n_all += pn[r] * w;
    }
    n_all = warp_sum(n_all);
    if (lane == 0) {
      sm.scale[g] = 1.f / n_all;
      sm.m_all[g] = m_all;
    }
  }
  __syncthreads();
  T* out = static_cast<T*>(p.out) + static_cast<size_t>(seq) * p.num_heads * D;
  for (int e = threadIdx.x; e < num_g * D; e += blockDim.x) {
    const int g = e / D;
    const int d = e % D;
    float o_all = 0.f;
    for (int w = 0; w < num_states; ++w) o_all += sm.o[(w * MAX_G + g) * D + d] * rescale(sm.m[w * MAX_G + g], sm.m_all[g]);
#pragma unroll 4
    for (int i = 0; i < num_pairs; ++i) {
      o_all += sm.weight[i * MAX_G + g] * po[static_cast<size_t>(sm.pair_row[i] + g0 + g) * D + d];
    }
    out[(kv_head * group + g0 + g) * D + d] = from_float<T>(o_all * sm.scale[g]);
  }
}

template <typename T, int D, int MAX_G>
__global__ void __launch_bounds__(kSeqFirstWarps * 32) seq_first_kernel(TppParams p) {
  constexpr int kLanesPerToken = D / 8;
  constexpr int kTokensPerWarp = 32 / kLanesPerToken;
  const int seq = blockIdx.x;
  const int kv_head = blockIdx.y;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int sub = lane % kLanesPerToken;   // which 8 elements of the head dim
  const int slot = lane / kLanesPerToken;  // which token of the warp's step
  const int group = p.num_heads / p.num_kv_heads;
  const int C = p.chunk_size;
  const int first = p.num_shared_tokens[seq];
  const int length = p.seq_lens[seq];
  const int* private_ids = p.private_chunk_ids + static_cast<size_t>(seq) * p.max_private;
  const T* q = static_cast<const T*>(p.q) + static_cast<size_t>(seq) * p.num_heads * D;

  extern __shared__ __align__(16) unsigned char smem[];
  MergeSmem<MAX_G, D> sm(smem, p.max_pairs_per_seq);
  float* o_s = sm.o;  // [warps][MAX_G][D]
  float* m_s = sm.m;  // [warps][MAX_G]
  float* n_s = sm.n;  // [warps][MAX_G]
  // This block's share of the private tail (all of it unless split), from the first
  // key in the query's sliding window if that comes later.
  const int start = p.window > 0 ? max(first, length - p.window) : first;
  const int span = (length - start + p.num_splits - 1) / p.num_splits;
  const int range_begin = start + blockIdx.z * span;
  const int range_end = min(length, range_begin + span);

  for (int g0 = 0; g0 < group; g0 += MAX_G) {
    const int num_g = min(MAX_G, group - g0);
    float qv[MAX_G][8];
    float acc[MAX_G][8];
    float m[MAX_G], n[MAX_G];
#pragma unroll
    for (int g = 0; g < MAX_G; ++g) {
      if (g < num_g) load8(q + (kv_head * group + g0 + g) * D + sub * 8, qv[g]);
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[g][i] = 0.f;
      m[g] = -INFINITY;
      n[g] = 0.f;
    }
    // Each lane group takes two tokens per step (both loads in flight before any
    // math). The loop bound is uniform across the warp: the shuffles need every lane.
    constexpr int kStep = kSeqFirstWarps * kTokensPerWarp;
    for (int base = range_begin + warp * kTokensPerWarp; base < range_end; base += 2 * kStep) {
      float k[2][8], v[2][8];
      bool valid[2];
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const int t = base + u * kStep + slot;
        valid[u] = t < range_end;
        if (valid[u]) {
          const int local = t - first;
          const size_t row =
              ((static_cast<size_t>(private_ids[local / C]) * p.num_kv_heads + kv_head) * C + local % C) * D + sub * 8;
          load8(static_cast<const T*>(p.k_cache) + row, k[u]);
          load8(static_cast<const T*>(p.v_cache) + row, v[u]);
        } else {
#pragma unroll
          for (int i = 0; i < 8; ++i) k[u][i] = v[u][i] = 0.f;
        }
      }
#pragma unroll
      for (int u = 0; u < 2; ++u) {
#pragma unroll
        for (int g = 0; g < MAX_G; ++g) {
          if (g >= num_g) break;
          float dot = 0.f;
#pragma unroll
          for (int i = 0; i < 8; ++i) dot += qv[g][i] * k[u][i];
          dot = warp_sum(dot, kLanesPerToken) * p.scale;  // xor within the lane group
          if (!valid[u]) continue;
          const float m_new = fmaxf(m[g], dot);
          const float correction = rescale(m[g], m_new);
          const float weight = __expf(dot - m_new);
          n[g] = n[g] * correction + weight;
#pragma unroll
          for (int i = 0; i < 8; ++i) acc[g][i] = acc[g][i] * correction + weight * v[u][i];
          m[g] = m_new;
        }
      }
    }
    // Merge the token slots of the warp (lanes with the same `sub`).
#pragma unroll
    for (int g = 0; g < MAX_G; ++g) {
      if (g >= num_g) break;
#pragma unroll
      for (int offset = kLanesPerToken; offset < 32; offset *= 2) {
        const float m_other = __shfl_xor_sync(0xffffffffu, m[g], offset);
        const float n_other = __shfl_xor_sync(0xffffffffu, n[g], offset);
        const float m_new = fmaxf(m[g], m_other);
        const float a = m_new == -INFINITY ? 0.f : rescale(m[g], m_new);
        const float b = m_new == -INFINITY ? 0.f : rescale(m_other, m_new);
        n[g] = n[g] * a + n_other * b;
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[g][i] = acc[g][i] * a + __shfl_xor_sync(0xffffffffu, acc[g][i], offset) * b;
        m[g] = m_new;
      }
      if (slot == 0) {
#pragma unroll
        for (int i = 0; i < 8; ++i) o_s[(warp * MAX_G + g) * D + sub * 8 + i] = acc[g][i];
        if (sub == 0) {
          m_s[warp * MAX_G + g] = m[g];
          n_s[warp * MAX_G + g] = n[g];
        }
      }
    }
    __syncthreads();

    if (p.num_splits == 1) {
      merge_and_store<T, D, MAX_G>(p, sm, seq, kv_head, g0, num_g, kSeqFirstWarps);
    } else {  // combine the warps into this split's state; the merge kernel finishes
      const size_t base = ((static_cast<size_t>(seq) * p.num_kv_heads + kv_head) * p.num_splits + blockIdx.z) * group;
      for (int e = threadIdx.x; e < num_g * D; e += blockDim.x) {
        const int g = e / D, d = e % D;
        float m_all = -INFINITY;
        for (int w = 0; w < kSeqFirstWarps; ++w) m_all = fmaxf(m_all, m_s[w * MAX_G + g]);
        float o_all = 0.f, n_all = 0.f;
        for (int w = 0; w < kSeqFirstWarps; ++w) {
          const float scale = rescale(m_s[w * MAX_G + g], m_all);
          o_all += o_s[(w * MAX_G + g) * D + d] * scale;
          n_all += n_s[w * MAX_G + g] * scale;
        }
        p.split_o[(base + g0 + g) * D + d] = o_all;
        if (d == 0) {
          p.split_m[base + g0 + g] = m_all;
          p.split_n[base + g0 + g] = n_all;
        }
      }
    }
    __syncthreads();
  }
}

// After a split sequence-first phase: merge each (sequence, KV head)'s split states
// with its shared partials. Block = (sequence, KV head).
template <typename T, int D, int MAX_G>
__global__ void __launch_bounds__(kSeqFirstWarps * 32) merge_splits_kernel(TppParams p) {
  const int seq = blockIdx.x;
  const int kv_head = blockIdx.y;
  const int group = p.num_heads / p.num_kv_heads;
  extern __shared__ __align__(16) unsigned char smem[];
  MergeSmem<MAX_G, D> sm(smem, p.max_pairs_per_seq);
  const size_t base = (static_cast<size_t>(seq) * p.num_kv_heads + kv_head) * p.num_splits * group;
  for (int g0 = 0; g0 < group; g0 += MAX_G) {
    const int num_g = min(MAX_G, group - g0);
    for (int e = threadIdx.x; e < p.num_splits * num_g * D; e += blockDim.x) {
      const int split = e / (num_g * D), g = e / D % num_g, d = e % D;
      const size_t state = base + static_cast<size_t>(split) * group + g0 + g;
      sm.o[(split * MAX_G + g) * D + d] = p.split_o[state * D + d];
      if (d == 0) {
        sm.m[split * MAX_G + g] = p.split_m[state];
        sm.n[split * MAX_G + g] = p.split_n[state];
      }
    }
    __syncthreads();
    merge_and_store<T, D, MAX_G>(p, sm, seq, kv_head, g0, num_g, p.num_splits);
    __syncthreads();
  }
}

}  // namespace chunk_attn
