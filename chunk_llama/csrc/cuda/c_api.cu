// The C interface of the CUDA two-phase-partition kernels (c_api.h): checks the geometry,
// that every plan array lies inside the plan and the workspace's size, then launches on the
// caller's stream (the CPU ops' call convention: q, the layer's K/V pool, the step's plan as
// one int32 device tensor and its layout, the caller's workspace, then scalars). Torch-free;
// compiled by nvcc for the library's architectures, so the probe kernel below has code for
// exactly the GPUs the attention kernels have. Failed checks are reported as
// chunk_llama/api_errors.h says.
#include <cuda_runtime.h>

#include <algorithm>
#include <iterator>
#include <string>

#include "c_api.h"
#include "chunk_attn/params.h"
#include "chunk_llama/api_errors.h"

namespace {

using namespace chunk_attn;
using chunk_llama_api::fail;
using chunk_llama_api::guarded;

constexpr int kCudaError = CHUNK_LLAMA_CUDA_ERROR;

// Compiled like the kernels: whether it has an image for a GPU says whether they do.
__global__ void probe_kernel() {}

void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess) fail(kCudaError, what, ": ", cudaGetErrorString(err));
}

const int* plan_array(const int32_t* plan, int64_t plan_numel, const int64_t* layout, int slot, int64_t count) {
  const int64_t offset = layout[slot];
  CHECK_VALUE(count >= 0 && offset >= 0 && offset + count <= plan_numel, "plan array ",
              kCudaDecodeArrayNames[slot - kCudaDecodeCounts], " (", count, " entries from ", offset,
              ") is not inside the plan's ", plan_numel);
  return plan + offset;
}

// Makes `device` current for the launch and restores the caller's device after (torch's
// CUDAGuard, without torch).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    check_cuda(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != device) check_cuda(cudaSetDevice(device), "cudaSetDevice");
  }
  ~DeviceGuard() { cudaSetDevice(previous_); }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
};

void tpp_decode(int device, const void* q, int64_t num_seqs_, int64_t num_heads_, int64_t head_dim_,
                const void* k_cache, const void* v_cache, int64_t num_kv_heads_, int64_t chunk_size_,
                int64_t kv_head_dim, int dtype_code, void* out, const int32_t* plan, int64_t plan_numel,
                const int64_t* layout, int64_t layout_size, float* workspace, int64_t workspace_numel, double scale,
                int64_t window, void* stream) {
  CHECK_VALUE(num_seqs_ >= 0 && num_seqs_ <= INT32_MAX && num_heads_ <= INT32_MAX,
              "q is too large for the CUDA kernels");
  const int num_seqs = static_cast<int>(num_seqs_), num_heads = static_cast<int>(num_heads_);
  const int head_dim = static_cast<int>(head_dim_), num_kv_heads = static_cast<int>(num_kv_heads_);
  const int chunk_size = static_cast<int>(chunk_size_);
  CHECK_VALUE(kv_head_dim == head_dim, "head_dim of q (", head_dim, ") and cache (", kv_head_dim, ") differ");
  CHECK_VALUE(num_kv_heads > 0 && num_heads % num_kv_heads == 0, "num_heads ", num_heads,
              " is not a multiple of num_kv_heads ", num_kv_heads);
  CHECK_VALUE(tpp_supports(head_dim, chunk_size), "CUDA TPP supports head_dim 64/128/256 and ",
              "chunk_size 32/64/128, got head_dim ", head_dim, ", chunk_size ", chunk_size);
  CHECK_TYPE(dtype_code == CHUNK_LLAMA_FLOAT16 || dtype_code == CHUNK_LLAMA_CUDA_BFLOAT16,
             "CUDA TPP supports float16 and bfloat16, got dtype code ", dtype_code);
  CHECK_VALUE(window >= 0 && window <= INT32_MAX, "window must be 0 (none) or a positive int32, got ", window);
  CHECK_VALUE(layout_size == kCudaDecodeLayoutSize, "the CUDA decode layout has ", kCudaDecodeLayoutSize,
              " entries, got ", layout_size);
  const int64_t num_shared = layout[kNumShared], width = layout[kWidth], num_partial_rows = layout[kNumPartialRows];
  CHECK_VALUE(layout[kNumSeqs] == num_seqs && num_shared >= 0 && width >= 1 && num_partial_rows >= 0,
              "the plan is for ", layout[kNumSeqs], " sequences, q has ", num_seqs);
  const int64_t needed =
      tpp_workspace_floats(num_seqs, num_heads, num_kv_heads, head_dim, static_cast<int>(num_partial_rows));
  CHECK_VALUE(workspace_numel >= needed, "workspace must be a contiguous float32 tensor of at least ", needed,
              " elements, got ", workspace_numel);

  const DeviceGuard guard(device);
  TppParams p{};
  p.num_seqs = num_seqs;
  p.num_heads = num_heads;
  p.num_kv_heads = num_kv_heads;
  p.head_dim = head_dim;
  p.max_private_tokens = static_cast<int>(layout[kMaxPrivateTokens]);
  const auto dtype = dtype_code == CHUNK_LLAMA_FLOAT16 ? DType::kHalf : DType::kBFloat16;
  const int num_splits = tpp_num_splits(p, dtype);
  const int64_t split_states = num_splits > 1 ? static_cast<int64_t>(num_seqs) * num_heads * num_splits : 0;
  const int64_t rows = std::max<int64_t>(num_partial_rows, 1);
  // the workspace: shared partials o [kv, rows, D], m, n [kv, rows]; split states o, m, n
  p.q = q;
  p.k_cache = k_cache;
  p.v_cache = v_cache;
  p.out = out;
  p.partial_o = workspace;
  p.partial_m = workspace + num_kv_heads * rows * head_dim;
  p.partial_n = p.partial_m + num_kv_heads * rows;
  p.shared_chunk_ids = plan_array(plan, plan_numel, layout, kSharedChunkIds, num_shared);
  p.shared_begin = plan_array(plan, plan_numel, layout, kSharedBegin, num_shared);
  p.shared_end = plan_array(plan, plan_numel, layout, kSharedEnd, num_shared);
  p.shared_row_offset = plan_array(plan, plan_numel, layout, kSharedRowOffset, num_shared);
  p.shared_depth = plan_array(plan, plan_numel, layout, kSharedDepth, num_shared);
  p.private_chunk_ids = plan_array(plan, plan_numel, layout, kPrivateChunkIds, num_seqs * width);
  p.num_shared_tokens = plan_array(plan, plan_numel, layout, kNumSharedTokens, num_seqs);
  p.seq_lens = plan_array(plan, plan_numel, layout, kSeqLens, num_seqs);
  p.seq_partial_ptr = plan_array(plan, plan_numel, layout, kSeqPartialPtr, num_seqs + 1);
  // the pairs' count sits on the device (seq_partial_ptr[num_seqs]): the array must reach the plan's end
  p.seq_partial_rows = plan_array(plan, plan_numel, layout, kSeqPartialRows, 0);
  p.chunk_size = chunk_size;
  p.num_shared = static_cast<int>(num_shared);
  p.max_private = static_cast<int>(width);
  p.max_rows_per_shared = static_cast<int>(layout[kMaxRowsPerShared]);
  p.max_pairs_per_seq = static_cast<int>(layout[kMaxPairsPerSeq]);
  p.num_splits = num_splits;
  p.split_o = p.partial_n + num_kv_heads * rows;
  p.split_m = p.split_o + split_states * head_dim;
  p.split_n = p.split_m + split_states;
  p.num_partial_rows = static_cast<int>(num_partial_rows);
  p.scale = static_cast<float>(scale);
  p.window = static_cast<int>(window);
  check_cuda(chunk_attn::tpp_decode(p, dtype, static_cast<cudaStream_t>(stream)), "CUDA TPP launch failed");
}

}  // namespace

extern "C" {

int chunk_llama_cuda_abi_version(void) { return CHUNK_LLAMA_CUDA_ABI_VERSION; }

const char* chunk_llama_cuda_last_error(void) { return chunk_llama_api::last_error().c_str(); }

int chunk_llama_cuda_runtime_version(void) { return CUDART_VERSION; }

int chunk_llama_cuda_check_device(int device) {
  return guarded([&] {
    int driver = 0;
    check_cuda(cudaDriverGetVersion(&driver), "cudaDriverGetVersion");
    if (driver == 0) fail(kCudaError, "no NVIDIA driver is installed");
    if (driver < CUDART_VERSION / 1000 * 1000)  // minor-version compatibility: a driver of the same major release
      fail(kCudaError, "the NVIDIA driver supports CUDA ", driver / 1000, ".", driver % 1000 / 10,
           "; this library's kernels need ", CUDART_VERSION / 1000, ".0 or newer");
    const DeviceGuard guard(device);
    cudaFuncAttributes attributes{};
    const cudaError_t err = cudaFuncGetAttributes(&attributes, probe_kernel);
    if (err == cudaErrorNoKernelImageForDevice || err == cudaErrorInvalidDeviceFunction) {
      cudaDeviceProp prop{};
      cudaGetDeviceProperties(&prop, device);
      fail(kCudaError, "this library has no code for ", prop.name, " (compute capability ", prop.major, ".",
           prop.minor, ")");
    }
    check_cuda(err, "cudaFuncGetAttributes");
  });
}

const char* chunk_llama_cuda_decode_layout(void) {
  static const std::string names = [] {
    std::string joined;
    for (const char* name : kCudaDecodeArrayNames) joined += std::string(joined.empty() ? "" : ",") + name;
    return joined;
  }();
  return names.c_str();
}

int64_t chunk_llama_cuda_workspace_floats(int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                                          int64_t head_dim, int64_t num_partial_rows) {
  return tpp_workspace_floats(static_cast<int>(num_seqs), static_cast<int>(num_heads), static_cast<int>(num_kv_heads),
                              static_cast<int>(head_dim), static_cast<int>(num_partial_rows));
}

int chunk_llama_cuda_tpp_decode(int device, const void* q, int64_t num_seqs, int64_t num_heads, int64_t head_dim,
                                const void* k_cache, const void* v_cache, int64_t num_kv_heads, int64_t chunk_size,
                                int64_t kv_head_dim, int dtype, void* out, const int32_t* plan, int64_t plan_numel,
                                const int64_t* layout, int64_t layout_size, float* workspace, int64_t workspace_numel,
                                double scale, int64_t window, void* stream) {
  return guarded([&] {
    tpp_decode(device, q, num_seqs, num_heads, head_dim, k_cache, v_cache, num_kv_heads, chunk_size, kv_head_dim, dtype,
               out, plan, plan_numel, layout, layout_size, workspace, workspace_numel, scale, window, stream);
  });
}

}  // extern "C"
