// Chunk-first phase: every shared chunk against all queries under it, on tensor cores.
//
// Block = (shared chunk, KV head, tile of 16 * num_warps query rows). A query row is
// (sequence under the chunk, head of the GQA group), so the rows of one chunk and KV
// head form one matrix Q [rows, D] and the block computes the partial softmax of
// Q K^T against the chunk's K, V [C, D] with WMMA (fp16/bf16 in, fp32 accumulate):
// a small GEMM instead of one GEMV per sequence.
#pragma once

#include <climits>
#include <mma.h>

#include "chunk_attn/common.cuh"
#include "chunk_attn/params.h"

namespace chunk_attn {

// Shared memory: K, V [C][D] and Q [rows][D] in T, scores [rows][C] in fp32,
// probabilities [rows][C] in T.
template <typename T>
__host__ __device__ constexpr size_t chunk_first_smem(int head_dim, int chunk_size, int num_warps) {
  return sizeof(T) * (2 * chunk_size * head_dim + 16 * num_warps * head_dim + 16 * num_warps * chunk_size) +
         sizeof(float) * 16 * num_warps * chunk_size;
}

// One warp: C[16, N] = A[16, K] @ B[K, N] on tensor cores, fp32 accumulate. A is
// row-major with leading dimension lda; the 16x16 tile (k, n) of B starts at
// b + k * k_step + n * n_step with leading dimension ldb and layout LayoutB.
template <typename T, int N, int K, typename LayoutB>
__device__ __forceinline__ void warp_gemm_16(const T* a, int lda, const T* b, int ldb, int k_step, int n_step,
                                             float* c, int ldc) {
  using namespace nvcuda;
#pragma unroll
  for (int n = 0; n < N / 16; ++n) {
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
    wmma::fill_fragment(acc, 0.f);
#pragma unroll
    for (int k = 0; k < K / 16; ++k) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a_frag;
      wmma::fragment<wmma::matrix_b, 16, 16, 16, T, LayoutB> b_frag;
      wmma::load_matrix_sync(a_frag, a + k * 16, lda);
      wmma::load_matrix_sync(b_frag, b + k * k_step + n * n_step, ldb);
      wmma::mma_sync(acc, a_frag, b_frag, acc);
    }
    wmma::store_matrix_sync(c + n * 16, acc, ldc, wmma::mem_row_major);
  }
}

template <typename T, int D, int C>
__global__ void chunk_first_kernel(TppParams p) {
  using namespace nvcuda;
  const int s = blockIdx.x;
  const int kv_head = blockIdx.y;
  const int num_warps = blockDim.x / 32;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int group = p.num_heads / p.num_kv_heads;
  const int begin = p.shared_begin[s];
  const int num_rows = (p.shared_end[s] - begin) * group;
  const int tile_rows = 16 * num_warps;
  const int tile_start = blockIdx.z * tile_rows;
  if (tile_start >= num_rows) return;

  extern __shared__ __align__(16) unsigned char smem[];
  T* k_s = reinterpret_cast<T*>(smem);  // [C][D]
  T* v_s = k_s + C * D;                 // [C][D]
  T* q_s = v_s + C * D;                 // [tile_rows][D]
  T* p_s = q_s + tile_rows * D;         // [tile_rows][C]
  float* s_s = reinterpret_cast<float*>(p_s + tile_rows * C);  // [tile_rows][C]

  // K and V of this chunk and KV head are contiguous [C][D]: copy as 16-byte vectors.
  const size_t kv_offset = (static_cast<size_t>(p.shared_chunk_ids[s]) * p.num_kv_heads + kv_head) * C * D;
  const uint4* k_src = reinterpret_cast<const uint4*>(static_cast<const T*>(p.k_cache) + kv_offset);
  const uint4* v_src = reinterpret_cast<const uint4*>(static_cast<const T*>(p.v_cache) + kv_offset);
  constexpr int kVecPerChunk = C * D * sizeof(T) / 16;
  constexpr int kUnroll = 4;  // loads in flight per thread before the shared-memory stores
  for (int base = threadIdx.x; base < kVecPerChunk; base += kUnroll * blockDim.x) {
    uint4 k_reg[kUnroll], v_reg[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int i = base + u * blockDim.x;
      if (i < kVecPerChunk) {
        k_reg[u] = k_src[i];
        v_reg[u] = v_src[i];
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int i = base + u * blockDim.x;
      if (i < kVecPerChunk) {
        reinterpret_cast<uint4*>(k_s)[i] = k_reg[u];
        reinterpret_cast<uint4*>(v_s)[i] = v_reg[u];
      }
    }
  }
  // Q rows of this tile; rows past the chunk's last sequence are zero.
  constexpr int kVecPerRow = D * sizeof(T) / 16;
  const T* q = static_cast<const T*>(p.q);
  for (int i = threadIdx.x; i < tile_rows * kVecPerRow; i += blockDim.x) {
    const int r = i / kVecPerRow;
    const int row = tile_start + r;
    uint4 value = make_uint4(0, 0, 0, 0);
    if (row < num_rows) {
      const int seq = begin + row / group;
      const int head = kv_head * group + row % group;
      value = reinterpret_cast<const uint4*>(q + (static_cast<size_t>(seq) * p.num_heads + head) * D)[i % kVecPerRow];
    }
    reinterpret_cast<uint4*>(q_s)[i] = value;
  }
  __syncthreads();
  // A chunk's partial rows are padded to 16 only: warps wholly past them stop here.
  if (tile_start + warp * 16 >= num_rows) return;

  // S = Q K^T for this warp's 16 rows (K^T: the chunk's [C][D] read column-major).
  const T* q_warp = q_s + warp * 16 * D;
  float* s_warp = s_s + warp * 16 * C;
  warp_gemm_16<T, C, D, wmma::col_major>(q_warp, D, k_s, D, /*k_step=*/16, /*n_step=*/16 * D, s_warp, C);
  __syncwarp();

  // Row softmax statistics; P = exp(S - m) in T for the second product.
  T* p_warp = p_s + warp * 16 * C;
  float* m_out = p.partial_m + static_cast<size_t>(kv_head) * p.num_partial_rows + p.shared_row_offset[s] + tile_start;
  float* n_out = p.partial_n + static_cast<size_t>(kv_head) * p.num_partial_rows + p.shared_row_offset[s] + tile_start;
  // Under a sliding window a key before the row's window scores -inf; a row with no
  // visible key in the chunk leaves m = -inf, n = 0 and O = 0, which the merge weighs 0.
  const int key0 = p.shared_depth[s] * C;
  for (int r = 0; r < 16; ++r) {
    const float* row = s_warp + r * C;
    const int local_row = tile_start + warp * 16 + r;
    const int window_first =
        p.window > 0 && local_row < num_rows ? p.seq_lens[begin + local_row / group] - p.window : INT_MIN;
    float mx = -INFINITY;
    for (int c = lane; c < C; c += 32) mx = fmaxf(mx, key0 + c < window_first ? -INFINITY : row[c] * p.scale);
    mx = warp_max(mx);
    float sum = 0.f;
    for (int c = lane; c < C; c += 32) {
      const float e = key0 + c < window_first || mx == -INFINITY ? 0.f : __expf(row[c] * p.scale - mx);
      p_warp[r * C + c] = from_float<T>(e);
      sum += e;
    }
    sum = warp_sum(sum);
    if (lane == 0) {  // padding rows land in the chunk's padding: never read
      m_out[warp * 16 + r] = mx;
      n_out[warp * 16 + r] = sum;
    }
  }
  __syncwarp();

  // O = P V, stored straight to the partial rows (16 consecutive rows of D floats).
  float* o_out = p.partial_o +
                 (static_cast<size_t>(kv_head) * p.num_partial_rows + p.shared_row_offset[s] + tile_start + warp * 16) * D;
  warp_gemm_16<T, D, C, wmma::row_major>(p_warp, C, v_s, D, /*k_step=*/16 * D, /*n_step=*/16, o_out, D);
}

}  // namespace chunk_attn
