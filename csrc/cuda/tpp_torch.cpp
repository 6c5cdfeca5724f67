// Torch glue of the CUDA two-phase-partition kernels, registered as torch ops
// (torch.ops.chunk_llama_cuda.*) with the CPU ops' call convention: q, the layer's K/V
// pool, the step's plan (one int32 device tensor and its layout, chunk_attn/params.h),
// the caller's workspace, then scalars. Checks shapes, dtypes, devices and that every
// array lies inside the plan, then launches on the current stream. Light ATen headers
// and torch/library.h only (no pybind11), so scripts/check_cuda_build.py also compiles
// it on a machine whose torch has no CUDA.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "chunk_attn/params.h"

namespace {

using namespace chunk_attn;

const int* plan_array(const at::Tensor& plan, at::IntArrayRef layout, int slot, int64_t count) {
  const int64_t offset = layout[slot];
  TORCH_CHECK_VALUE(count >= 0 && offset >= 0 && offset + count <= plan.numel(), "plan array ",
                    kCudaDecodeArrayNames[slot - kCudaDecodeCounts], " (", count, " entries from ", offset,
                    ") is not inside the plan's ", plan.numel());
  return plan.data_ptr<int>() + offset;
}

at::Tensor tpp_decode_op(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& plan, at::IntArrayRef layout, const at::Tensor& workspace, double scale,
                      int64_t window) {
  TORCH_CHECK_TYPE(q.is_cuda(), "q must be a CUDA tensor");
  const c10::Device device = q.device();
  TORCH_CHECK_VALUE(q.dim() == 3, "q must be [num_seqs, num_heads, head_dim], got ", q.sizes());
  TORCH_CHECK_VALUE(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
                    "k_cache and v_cache must both be [capacity, num_kv_heads, chunk_size, head_dim]");
  TORCH_CHECK_TYPE(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
                   "q, k_cache and v_cache must share a dtype");
  TORCH_CHECK_TYPE(q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16,
                   "CUDA TPP supports float16 and bfloat16, got ", q.scalar_type());
  TORCH_CHECK_VALUE(k_cache.device() == device && v_cache.device() == device && plan.device() == device &&
                        workspace.device() == device,
                    "k_cache, v_cache, plan and workspace must be on ", device);
  TORCH_CHECK_VALUE(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
                    "q, k_cache and v_cache must be contiguous");
  const int num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int num_kv_heads = k_cache.size(1), chunk_size = k_cache.size(2);
  TORCH_CHECK_VALUE(k_cache.size(3) == head_dim, "head_dim of q (", head_dim, ") and cache (", k_cache.size(3),
                    ") differ");
  TORCH_CHECK_VALUE(num_heads % num_kv_heads == 0, "num_heads ", num_heads, " is not a multiple of num_kv_heads ",
                    num_kv_heads);
  TORCH_CHECK_VALUE(tpp_supports(head_dim, chunk_size), "CUDA TPP supports head_dim 64/128/256 and ",
                    "chunk_size 32/64/128, got head_dim ", head_dim, ", chunk_size ", chunk_size);
  TORCH_CHECK_VALUE(window >= 0 && window <= INT32_MAX, "window must be 0 (none) or a positive int32, got ", window);
  TORCH_CHECK_TYPE(plan.scalar_type() == at::kInt && plan.is_contiguous(), "the plan must be a contiguous int32 tensor");
  TORCH_CHECK_VALUE(static_cast<int>(layout.size()) == kCudaDecodeLayoutSize, "the CUDA decode layout has ",
                    kCudaDecodeLayoutSize, " entries, got ", layout.size());
  const int64_t num_shared = layout[kNumShared], width = layout[kWidth], num_partial_rows = layout[kNumPartialRows];
  TORCH_CHECK_VALUE(layout[kNumSeqs] == num_seqs && num_shared >= 0 && width >= 1 && num_partial_rows >= 0,
                    "the plan is for ", layout[kNumSeqs], " sequences, q has ", num_seqs);
  const int64_t needed = tpp_workspace_floats(num_seqs, num_heads, num_kv_heads, head_dim,
                                              static_cast<int>(num_partial_rows));
  TORCH_CHECK_VALUE(workspace.scalar_type() == at::kFloat && workspace.is_contiguous() && workspace.numel() >= needed,
                    "workspace must be a contiguous float32 tensor of at least ", needed, " elements, got ",
                    workspace.numel());

  const c10::cuda::CUDAGuard guard(device);
  auto out = at::empty_like(q);
  TppParams p{};
  p.num_seqs = num_seqs;
  p.num_heads = num_heads;
  p.num_kv_heads = num_kv_heads;
  p.head_dim = head_dim;
  p.max_private_tokens = static_cast<int>(layout[kMaxPrivateTokens]);
  const auto dtype = q.scalar_type() == at::kHalf ? DType::kHalf : DType::kBFloat16;
  const int num_splits = tpp_num_splits(p, dtype);
  const int64_t split_states = num_splits > 1 ? static_cast<int64_t>(num_seqs) * num_heads * num_splits : 0;
  const int64_t rows = std::max<int64_t>(num_partial_rows, 1);
  // the workspace: shared partials o [kv, rows, D], m, n [kv, rows]; split states o, m, n
  float* partial_o = workspace.data_ptr<float>();
  p.q = q.data_ptr();
  p.k_cache = k_cache.data_ptr();
  p.v_cache = v_cache.data_ptr();
  p.out = out.data_ptr();
  p.partial_o = partial_o;
  p.partial_m = partial_o + num_kv_heads * rows * head_dim;
  p.partial_n = p.partial_m + num_kv_heads * rows;
  p.shared_chunk_ids = plan_array(plan, layout, kSharedChunkIds, num_shared);
  p.shared_begin = plan_array(plan, layout, kSharedBegin, num_shared);
  p.shared_end = plan_array(plan, layout, kSharedEnd, num_shared);
  p.shared_row_offset = plan_array(plan, layout, kSharedRowOffset, num_shared);
  p.shared_depth = plan_array(plan, layout, kSharedDepth, num_shared);
  p.private_chunk_ids = plan_array(plan, layout, kPrivateChunkIds, num_seqs * width);
  p.num_shared_tokens = plan_array(plan, layout, kNumSharedTokens, num_seqs);
  p.seq_lens = plan_array(plan, layout, kSeqLens, num_seqs);
  p.seq_partial_ptr = plan_array(plan, layout, kSeqPartialPtr, num_seqs + 1);
  // the pairs' count sits on the device (seq_partial_ptr[num_seqs]): the array must reach the plan's end
  p.seq_partial_rows = plan_array(plan, layout, kSeqPartialRows, 0);
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
  const cudaError_t err = chunk_attn::tpp_decode(p, dtype, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "CUDA TPP launch failed: ", cudaGetErrorString(err));
  return out;
}

int64_t workspace_floats(int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                         int64_t num_partial_rows) {
  return tpp_workspace_floats(static_cast<int>(num_seqs), static_cast<int>(num_heads), static_cast<int>(num_kv_heads),
                              static_cast<int>(head_dim), static_cast<int>(num_partial_rows));
}

std::vector<std::string> decode_layout() {
  return {std::begin(kCudaDecodeArrayNames), std::end(kCudaDecodeArrayNames)};
}

}  // namespace

TORCH_LIBRARY(chunk_llama_cuda, m) {
  m.def("tpp_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor plan, int[] layout, Tensor(a!) workspace, "
        "float scale, int window) -> Tensor");
  m.def("workspace_floats(int num_seqs, int num_heads, int num_kv_heads, int head_dim, int num_partial_rows) -> int",
        &workspace_floats);
  m.def("decode_layout() -> str[]", &decode_layout);
}

TORCH_LIBRARY_IMPL(chunk_llama_cuda, CUDA, m) { m.impl("tpp_decode", &tpp_decode_op); }
