// The C interface of the CUDA two-phase-partition kernels (c_api.h): a step's plan made once
// (plan_checks.h: the geometry, every plan array inside the plan; the launch's split chosen),
// then run per layer on the caller's stream with the caller's workspace (the CPU library's
// call convention). Torch-free; compiled by nvcc for the library's architectures, so the
// probe kernel below has code for exactly the GPUs the attention kernels have. Failed checks are reported as
// chunk_llama/api_errors.h says.
#include <cuda_runtime.h>

#include <algorithm>
#include <iterator>
#include <new>
#include <string>

#include "c_api.h"
#include "chunk_attn/params.h"
#include "chunk_llama/api_errors.h"
#include "plan_checks.h"

using namespace chunk_llama_cuda_internal;

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

// The launch a plan decides, with the layer's pointers and scalars set at each call.
TppParams planned_params(const CheckedPlan& c) {
  TppParams p{};
  p.num_seqs = c.num_seqs, p.num_heads = c.num_heads, p.num_kv_heads = c.num_kv_heads, p.head_dim = c.head_dim;
  p.chunk_size = c.chunk_size, p.num_shared = c.num_shared, p.max_private = c.width;
  p.max_rows_per_shared = c.max_rows_per_shared, p.max_pairs_per_seq = c.max_pairs_per_seq;
  p.max_private_tokens = c.max_private_tokens, p.num_partial_rows = c.num_partial_rows;
  p.shared_chunk_ids = c.arrays[kSharedChunkIds - kCudaDecodeCounts];
  p.shared_begin = c.arrays[kSharedBegin - kCudaDecodeCounts];
  p.shared_end = c.arrays[kSharedEnd - kCudaDecodeCounts];
  p.shared_row_offset = c.arrays[kSharedRowOffset - kCudaDecodeCounts];
  p.shared_depth = c.arrays[kSharedDepth - kCudaDecodeCounts];
  p.private_chunk_ids = c.arrays[kPrivateChunkIds - kCudaDecodeCounts];
  p.num_shared_tokens = c.arrays[kNumSharedTokens - kCudaDecodeCounts];
  p.seq_lens = c.arrays[kSeqLens - kCudaDecodeCounts];
  p.seq_partial_ptr = c.arrays[kSeqPartialPtr - kCudaDecodeCounts];
  p.seq_partial_rows = c.arrays[kSeqPartialRows - kCudaDecodeCounts];
  return p;
}

DType kernel_dtype(int dtype) { return dtype == CHUNK_LLAMA_FLOAT16 ? DType::kHalf : DType::kBFloat16; }

// Points p's partials and split states into the workspace (tpp_workspace_floats of it):
// shared partials o [kv, rows, D], m, n [kv, rows]; split states o, m, n.
void carve_workspace(TppParams& p, float* workspace) {
  const int64_t rows = std::max(p.num_partial_rows, 1);
  const int64_t split_states = p.num_splits > 1 ? static_cast<int64_t>(p.num_seqs) * p.num_heads * p.num_splits : 0;
  p.partial_o = workspace;
  p.partial_m = workspace + p.num_kv_heads * rows * p.head_dim;
  p.partial_n = p.partial_m + p.num_kv_heads * rows;
  p.split_o = p.partial_n + p.num_kv_heads * rows;
  p.split_m = p.split_o + split_states * p.head_dim;
  p.split_n = p.split_m + split_states;
}

}  // namespace

// A made plan: the checked plan and the launch it decides (the split of the sequence-first
// phase, chosen for the GPU's waves); re-planned in place each step.
struct chunk_llama_cuda_plan {
  uint64_t generation = 0;  // advanced by every plan_make; a call names the one it was made for
  bool ready = false;
  CheckedPlan checked{};
  TppParams params{};
};

namespace {

void make_plan(chunk_llama_cuda_plan& plan, const chunk_llama_cuda_plan_params& params) {
  plan.ready = false;
  ++plan.generation;  // every call planned before is stale from here on
  plan.checked = check_plan(params);
  const DeviceGuard guard(plan.checked.device);
  plan.params = planned_params(plan.checked);
  plan.params.num_splits = tpp_num_splits(plan.params, kernel_dtype(plan.checked.dtype));
  plan.ready = true;
}

void attend(const chunk_llama_cuda_planned* planned, const chunk_llama_cuda_kv* kv, const void* q, void* out,
            void* stream) {
  CHECK_VALUE(planned != nullptr && kv != nullptr && q != nullptr && out != nullptr,
              "attend needs the plan, the layer's pools, q and out");
  const chunk_llama_cuda_plan& plan =
      checked_call(planned->plan, planned->generation, planned->workspace, planned->workspace_numel);
  check_kv(*kv, plan.checked);
  TppParams p = plan.params;
  p.q = q, p.k_cache = kv->k, p.v_cache = kv->v, p.out = out;
  p.scale = static_cast<float>(kv->scale), p.window = static_cast<int>(kv->window);
  carve_workspace(p, planned->workspace);
  const DeviceGuard guard(plan.checked.device);
  check_cuda(chunk_attn::tpp_decode(p, kernel_dtype(plan.checked.dtype), static_cast<cudaStream_t>(stream)),
             "CUDA TPP launch failed");
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

chunk_llama_cuda_plan* chunk_llama_cuda_plan_new(void) { return new (std::nothrow) chunk_llama_cuda_plan(); }

void chunk_llama_cuda_plan_free(chunk_llama_cuda_plan* plan) { delete plan; }

int chunk_llama_cuda_plan_make(chunk_llama_cuda_plan* plan, const chunk_llama_cuda_plan_params* params,
                               uint64_t* generation, int64_t* workspace_floats) {
  return guarded([&] {
    CHECK_VALUE(plan != nullptr && params != nullptr && generation != nullptr && workspace_floats != nullptr,
                "plan_make needs a handle, its parameters and where to put the generation and workspace size");
    make_plan(*plan, *params);
    *generation = plan->generation;
    *workspace_floats = plan->checked.workspace_floats;
  });
}

int chunk_llama_cuda_attend(const chunk_llama_cuda_planned* planned, const chunk_llama_cuda_kv* kv, const void* q,
                            void* out, void* stream) {
  return guarded([&] { attend(planned, kv, q, out, stream); });
}

}  // extern "C"
