// A linear layer of few rows (decode batches) on the CPU, free of torch and of any
// instruction set: y = x W^T (+ bias), W an nn.Linear's weight in place. Included like
// params.h (the glue, every variant before its target pragma, the test driver).
#pragma once

#include <cstdint>

namespace chunk_attn_cpu {

struct LinearParams {
  const float* x;     // [rows, in_features]
  const float* w;     // [out_features, in_features], row-major (nn.Linear.weight)
  const float* bias;  // [out_features] or nullptr
  float* y;           // [rows, out_features]
  int64_t rows, out_features, in_features;
  int num_threads;
};

// Entry points of the variants (kernel_<isa>.cpp), beside tpp_decode and tpp_prefill.
namespace avx512 { void small_linear(const LinearParams& p); }
namespace avx2 { void small_linear(const LinearParams& p); }
namespace neon { void small_linear(const LinearParams& p); }
namespace generic { void small_linear(const LinearParams& p); }

}  // namespace chunk_attn_cpu
