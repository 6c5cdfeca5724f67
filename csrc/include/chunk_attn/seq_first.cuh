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

template <int D, int MAX_G>
__host__ __device__ constexpr size_t seq_first_smem() {
  // per warp and head: o [D], m, n
  return sizeof(float) * kSeqFirstWarps * MAX_G * (D + 2);
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
  T* out = static_cast<T*>(p.out) + static_cast<size_t>(seq) * p.num_heads * D;

  extern __shared__ __align__(16) unsigned char smem[];
  float* o_s = reinterpret_cast<float*>(smem);        // [warps][MAX_G][D]
  float* m_s = o_s + kSeqFirstWarps * MAX_G * D;      // [warps][MAX_G]
  float* n_s = m_s + kSeqFirstWarps * MAX_G;          // [warps][MAX_G]

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
    // The loop bound is uniform across the warp (shuffles below need every lane).
    for (int base = first + warp * kTokensPerWarp; base < length; base += kSeqFirstWarps * kTokensPerWarp) {
      const int t = base + slot;
      const bool valid = t < length;
      float k[8], v[8];
      if (valid) {
        const int local = t - first;
        const size_t row =
            ((static_cast<size_t>(private_ids[local / C]) * p.num_kv_heads + kv_head) * C + local % C) * D + sub * 8;
        load8(static_cast<const T*>(p.k_cache) + row, k);
        load8(static_cast<const T*>(p.v_cache) + row, v);
      } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) k[i] = v[i] = 0.f;
      }
#pragma unroll
      for (int g = 0; g < MAX_G; ++g) {
        if (g >= num_g) break;
        float dot = 0.f;
#pragma unroll
        for (int i = 0; i < 8; ++i) dot += qv[g][i] * k[i];
        dot = warp_sum(dot, kLanesPerToken) * p.scale;  // xor within the lane group
        if (!valid) continue;
        const float m_new = fmaxf(m[g], dot);
        const float correction = rescale(m[g], m_new);
        const float weight = __expf(dot - m_new);
        n[g] = n[g] * correction + weight;
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[g][i] = acc[g][i] * correction + weight * v[i];
        m[g] = m_new;
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

    // Final merge: the warps' private partials and the shared-chunk partials.
    const int pair_begin = p.seq_partial_ptr[seq];
    const int pair_end = p.seq_partial_ptr[seq + 1];
    const float* pm = p.partial_m + static_cast<size_t>(kv_head) * p.num_partial_rows;
    const float* pn = p.partial_n + static_cast<size_t>(kv_head) * p.num_partial_rows;
    const float* po = p.partial_o + static_cast<size_t>(kv_head) * p.num_partial_rows * D;
    for (int e = threadIdx.x; e < num_g * D; e += blockDim.x) {
      const int g = e / D;
      const int d = e % D;
      float m_all = -INFINITY;
      for (int w = 0; w < kSeqFirstWarps; ++w) m_all = fmaxf(m_all, m_s[w * MAX_G + g]);
      for (int i = pair_begin; i < pair_end; ++i) m_all = fmaxf(m_all, pm[p.seq_partial_rows[i] + g0 + g]);
      float n_all = 0.f, o_all = 0.f;
      for (int w = 0; w < kSeqFirstWarps; ++w) {
        const float scale = rescale(m_s[w * MAX_G + g], m_all);
        n_all += n_s[w * MAX_G + g] * scale;
        o_all += o_s[(w * MAX_G + g) * D + d] * scale;
      }
      for (int i = pair_begin; i < pair_end; ++i) {
        const int r = p.seq_partial_rows[i] + g0 + g;
        const float scale = rescale(pm[r], m_all);
        n_all += pn[r] * scale;
        o_all += po[static_cast<size_t>(r) * D + d] * scale;
      }
      out[(kv_head * group + g0 + g) * D + d] = from_float<T>(o_all / n_all);
    }
    __syncthreads();
  }
}

}  // namespace chunk_attn
