// What the CUDA C interface checks once per step, when a plan is made (the geometry, that
// every array of the plan lies inside the plan tensor, the layout's counts), and per layer
// call (the layer's pools against the plan, its window: O(1)). Host code without CUDA types,
// so that it also builds with a plain C++ compiler: tests/cpp/cuda_plan_test.cpp runs these
// checks on machines without a GPU. Failed checks throw as chunk_llama/api_errors.h says.
#pragma once

#include <cstdint>

#include "c_api.h"
#include "chunk_attn/plan_layout.h"
#include "chunk_llama/api_errors.h"

namespace chunk_llama_cuda_internal {

using namespace chunk_attn;

constexpr int kNumArrays = kCudaDecodeLayoutSize - kCudaDecodeCounts;

// A plan as checked: its geometry, its counts, and each array's device pointer.
struct CheckedPlan {
  int device, dtype;
  int num_seqs, num_heads, num_kv_heads, head_dim, chunk_size;
  int num_shared, width, max_rows_per_shared, max_pairs_per_seq, num_partial_rows, max_private_tokens;
  const int32_t* arrays[kNumArrays];  // in kCudaDecodeArrayNames' order
  int64_t workspace_floats;
};

inline bool fits_int(int64_t value) { return value >= 0 && value <= INT32_MAX; }

inline CheckedPlan check_plan(const chunk_llama_cuda_plan_params& p) {
  CHECK_VALUE(fits_int(p.num_seqs) && fits_int(p.num_heads) && fits_int(p.device),
              "q is too large for the CUDA kernels, or the device is not one");
  CHECK_VALUE(p.num_kv_heads > 0 && p.num_heads % p.num_kv_heads == 0, "num_heads ", p.num_heads,
              " is not a multiple of num_kv_heads ", p.num_kv_heads);
  CHECK_VALUE(tpp_supports(static_cast<int>(p.head_dim), static_cast<int>(p.chunk_size)) && fits_int(p.head_dim) &&
                  fits_int(p.chunk_size),
              "CUDA TPP supports head_dim 64/128/256 and chunk_size 32/64/128, got head_dim ", p.head_dim,
              ", chunk_size ", p.chunk_size);
  CHECK_TYPE(p.dtype == CHUNK_LLAMA_FLOAT16 || p.dtype == CHUNK_LLAMA_CUDA_BFLOAT16,
             "CUDA TPP supports float16 and bfloat16, got dtype code ", p.dtype);
  CHECK_VALUE(p.index != nullptr && p.layout != nullptr && p.index_numel >= 0, "the plan needs its index and layout");
  CHECK_VALUE(p.layout_size == kCudaDecodeLayoutSize, "the CUDA decode layout has ", kCudaDecodeLayoutSize,
              " entries, got ", p.layout_size);
  const int64_t* layout = p.layout;
  for (int i = 0; i < kCudaDecodeCounts; ++i)
    CHECK_VALUE(fits_int(layout[i]), "the CUDA decode layout's count ", i, " is ", layout[i]);
  CHECK_VALUE(layout[kNumSeqs] == p.num_seqs && layout[kWidth] >= 1, "the plan is for ", layout[kNumSeqs],
              " sequences, q has ", p.num_seqs);
  CheckedPlan c{};
  c.device = static_cast<int>(p.device), c.dtype = p.dtype;
  c.num_seqs = static_cast<int>(p.num_seqs), c.num_heads = static_cast<int>(p.num_heads);
  c.num_kv_heads = static_cast<int>(p.num_kv_heads), c.head_dim = static_cast<int>(p.head_dim);
  c.chunk_size = static_cast<int>(p.chunk_size);
  c.num_shared = static_cast<int>(layout[kNumShared]), c.width = static_cast<int>(layout[kWidth]);
  c.max_rows_per_shared = static_cast<int>(layout[kMaxRowsPerShared]);
  c.max_pairs_per_seq = static_cast<int>(layout[kMaxPairsPerSeq]);
  c.num_partial_rows = static_cast<int>(layout[kNumPartialRows]);
  c.max_private_tokens = static_cast<int>(layout[kMaxPrivateTokens]);
  const int64_t shared = c.num_shared, seqs = c.num_seqs;
  // each array's entries; the pairs' count sits on the device (seq_partial_ptr[num_seqs]): that
  // array must only start inside the plan
  const int64_t counts[kNumArrays] = {shared, shared, shared, shared, shared, seqs * c.width, seqs, seqs, seqs + 1, 0};
  for (int i = 0; i < kNumArrays; ++i) {
    const int64_t offset = layout[kCudaDecodeCounts + i];
    CHECK_VALUE(offset >= 0 && offset <= p.index_numel && counts[i] <= p.index_numel - offset, "plan array ",
                kCudaDecodeArrayNames[i], " (", counts[i], " entries from ", offset, ") is not inside the plan's ",
                p.index_numel);
    c.arrays[i] = p.index + offset;
  }
  c.workspace_floats = tpp_workspace_floats(c.num_seqs, c.num_heads, c.num_kv_heads, c.head_dim, c.num_partial_rows);
  return c;
}

// A layer's pools, scale and window against the plan's geometry.
inline void check_kv(const chunk_llama_cuda_kv& kv, const CheckedPlan& c) {
  CHECK_VALUE(kv.num_kv_heads == c.num_kv_heads && kv.chunk_size == c.chunk_size && kv.head_dim == c.head_dim,
              "the layer's pool (", kv.num_kv_heads, " KV heads, chunks of ", kv.chunk_size, ", head_dim ",
              kv.head_dim, ") is not the one the plan was made for (", c.num_kv_heads, ", ", c.chunk_size, ", ",
              c.head_dim, ")");
  CHECK_TYPE(kv.dtype == c.dtype, "the layer's pool has dtype code ", kv.dtype, ", the plan ", c.dtype);
  CHECK_VALUE(kv.k != nullptr && kv.v != nullptr, "the layer's K/V pool has no memory");
  CHECK_VALUE(kv.window >= 0 && kv.window <= INT32_MAX, "window must be 0 (none) or a positive int32, got ",
              kv.window);
}

// The made plan a call names, refused if stale or if its workspace is too small (Plan: the
// handle, with `generation`, `ready` and `checked`).
template <typename Plan>
const Plan& checked_call(const Plan* plan, uint64_t generation, const float* workspace, int64_t workspace_numel) {
  CHECK_VALUE(plan != nullptr, "the call names no plan");
  CHECK_VALUE(plan->ready && generation == plan->generation, "the call's plan is stale (generation ", generation,
              "; its handle holds ", plan->generation, plan->ready ? "" : ", not planned",
              "): the handle was planned again since, for another step; make this step's plan again");
  CHECK_VALUE(workspace != nullptr && workspace_numel >= plan->checked.workspace_floats,
              "workspace must be a contiguous float32 tensor of at least ", plan->checked.workspace_floats,
              " elements, got ", workspace_numel);
  return *plan;
}

}  // namespace chunk_llama_cuda_internal
