// Torch-free launchers of the two-phase-partition decode attention: raw pointers
// and a cudaStream_t in, so this file builds with plain nvcc (scripts/check_cuda_build.py).
#include <algorithm>

#include "chunk_attn/chunk_first.cuh"
#include "chunk_attn/params.h"
#include "chunk_attn/seq_first.cuh"

namespace chunk_attn {
namespace {

constexpr int kMaxDevices = 64;

int max_dynamic_smem() {
  static int cached[kMaxDevices] = {};  // per device, read once
  int device = 0;
  cudaGetDevice(&device);
  if (device >= kMaxDevices) device = kMaxDevices - 1;
  if (cached[device] == 0) cudaDeviceGetAttribute(&cached[device], cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  return cached[device];
}

// Raise a kernel's dynamic shared-memory limit once per kernel and device, not per launch.
template <auto Kernel>
cudaError_t allow_smem(size_t smem) {
  static size_t allowed[kMaxDevices] = {};
  int device = 0;
  cudaGetDevice(&device);
  if (device >= kMaxDevices) device = kMaxDevices - 1;
  if (smem <= 48 * 1024 || smem <= allowed[device]) return cudaSuccess;
  const cudaError_t err = cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (err == cudaSuccess) allowed[device] = smem;
  return err;
}

template <typename T, int D, int C>
cudaError_t launch_chunk_first(const TppParams& p, cudaStream_t stream) {
  const int limit = max_dynamic_smem();
  const int group = p.num_heads / p.num_kv_heads;
  // 16 query rows per warp, up to 4 warps: no more warps than the widest chunk has rows
  // (idle warps still reserve shared memory, which limits the blocks per SM)
  int num_warps = std::min(4, std::max(1, (p.max_rows_per_shared * group + 15) / 16));
  while (num_warps > 1 && chunk_first_smem<T>(D, C, num_warps) > static_cast<size_t>(limit)) num_warps /= 2;
  const size_t smem = chunk_first_smem<T>(D, C, num_warps);
  if (smem > static_cast<size_t>(limit)) return cudaErrorInvalidConfiguration;
  const cudaError_t err = allow_smem<chunk_first_kernel<T, D, C>>(smem);
  if (err != cudaSuccess) return err;
  const int tile_rows = 16 * num_warps;
  const dim3 grid(p.num_shared, p.num_kv_heads, (p.max_rows_per_shared * group + tile_rows - 1) / tile_rows);
  chunk_first_kernel<T, D, C><<<grid, 32 * num_warps, smem, stream>>>(p);
  return cudaGetLastError();
}

// Splits of the sequence-first phase that fill the GPU's waves best: blocks run in
// waves of (SMs x resident blocks per SM), and a last wave a tenth full costs a whole
// wave. Each split keeps at least kMinSplitTokens tokens; ties go to fewer splits.
constexpr int kMinSplitTokens = 256;

template <typename T, int D, int MAX_G>
int choose_splits(const TppParams& p) {
  static int capacity[kMaxDevices] = {};  // resident blocks on the whole GPU
  int device = 0;
  cudaGetDevice(&device);
  if (device >= kMaxDevices) device = kMaxDevices - 1;
  if (capacity[device] == 0) {
    int num_sms = 0, per_sm = 0;
    cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device);
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, seq_first_kernel<T, D, MAX_G>, kSeqFirstWarps * 32,
                                                  seq_first_smem<D, MAX_G>(0));
    capacity[device] = max(1, num_sms * per_sm);
  }
  const long blocks = static_cast<long>(p.num_seqs) * p.num_kv_heads;
  const int most = max(1, min(kMaxSplits, p.max_private_tokens / kMinSplitTokens));
  int best = 1;
  double best_efficiency = 0.0;
  for (int splits = 1; splits <= most; ++splits) {
    const long total = blocks * splits;
    const long waves = (total + capacity[device] - 1) / capacity[device];
    const double efficiency = static_cast<double>(total) / (waves * capacity[device]);
    if (efficiency > best_efficiency + 0.02) {
      best = splits;
      best_efficiency = efficiency;
    }
  }
  return best;
}

template <typename T, int D>
int choose_splits_for_group(const TppParams& p) {
  const int group = p.num_heads / p.num_kv_heads;
  if (group <= 1) return choose_splits<T, D, 1>(p);
  if (group <= 2) return choose_splits<T, D, 2>(p);
  if (group <= 4) return choose_splits<T, D, 4>(p);
  return choose_splits<T, D, 8>(p);
}

template <typename T, int D, int MAX_G>
cudaError_t launch_seq_first_g(const TppParams& p, cudaStream_t stream) {
  const size_t smem = seq_first_smem<D, MAX_G>(p.max_pairs_per_seq);
  if (smem > static_cast<size_t>(max_dynamic_smem())) return cudaErrorInvalidConfiguration;
  const cudaError_t err = allow_smem<seq_first_kernel<T, D, MAX_G>>(smem);
  if (err != cudaSuccess) return err;
  seq_first_kernel<T, D, MAX_G><<<dim3(p.num_seqs, p.num_kv_heads, p.num_splits), kSeqFirstWarps * 32, smem, stream>>>(p);
  if (p.num_splits == 1) return cudaGetLastError();
  const cudaError_t merge_err = allow_smem<merge_splits_kernel<T, D, MAX_G>>(smem);
  if (merge_err != cudaSuccess) return merge_err;
  merge_splits_kernel<T, D, MAX_G><<<dim3(p.num_seqs, p.num_kv_heads), kSeqFirstWarps * 32, smem, stream>>>(p);
  return cudaGetLastError();
}

template <typename T, int D>
cudaError_t launch_seq_first(const TppParams& p, cudaStream_t stream) {
  const int group = p.num_heads / p.num_kv_heads;
  if (group <= 1) return launch_seq_first_g<T, D, 1>(p, stream);
  if (group <= 2) return launch_seq_first_g<T, D, 2>(p, stream);
  if (group <= 4) return launch_seq_first_g<T, D, 4>(p, stream);
  return launch_seq_first_g<T, D, 8>(p, stream);  // larger groups: passes of 8 heads
}

template <typename T, int D, int C>
cudaError_t launch_both(const TppParams& p, cudaStream_t stream) {
  if (p.num_shared > 0) {
    const cudaError_t err = launch_chunk_first<T, D, C>(p, stream);
    if (err != cudaSuccess) return err;
  }
  return launch_seq_first<T, D>(p, stream);
}

template <typename T, int D>
cudaError_t dispatch_chunk(const TppParams& p, cudaStream_t stream) {
  switch (p.chunk_size) {
    case 32: return launch_both<T, D, 32>(p, stream);
    case 64: return launch_both<T, D, 64>(p, stream);
    case 128: return launch_both<T, D, 128>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

template <typename T>
cudaError_t dispatch_head_dim(const TppParams& p, cudaStream_t stream) {
  switch (p.head_dim) {
    case 64: return dispatch_chunk<T, 64>(p, stream);
    case 128: return dispatch_chunk<T, 128>(p, stream);
    case 256: return dispatch_chunk<T, 256>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

int tpp_num_splits(const TppParams& p, DType dtype) {
  const bool half_type = dtype == DType::kHalf;
  switch (p.head_dim) {
    case 64: return half_type ? choose_splits_for_group<half, 64>(p) : choose_splits_for_group<__nv_bfloat16, 64>(p);
    case 128: return half_type ? choose_splits_for_group<half, 128>(p) : choose_splits_for_group<__nv_bfloat16, 128>(p);
    case 256: return half_type ? choose_splits_for_group<half, 256>(p) : choose_splits_for_group<__nv_bfloat16, 256>(p);
    default: return 1;
  }
}

cudaError_t tpp_decode(const TppParams& p, DType dtype, cudaStream_t stream) {
  if (!tpp_supports(p.head_dim, p.chunk_size) || p.num_kv_heads <= 0 || p.num_heads % p.num_kv_heads) {
    return cudaErrorInvalidValue;
  }
  if (p.num_seqs == 0) return cudaSuccess;
  return dtype == DType::kHalf ? dispatch_head_dim<half>(p, stream) : dispatch_head_dim<__nv_bfloat16>(p, stream);
}

}  // namespace chunk_attn
