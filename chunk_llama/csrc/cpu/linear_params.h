// A linear layer on the CPU, free of torch and of any instruction set: y = x W^T (+ bias),
// W an nn.Linear's weight in place; and a decoder layer's elementwise steps. Included like
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

// A decoder layer's RMSNorm of `rows` vectors of n (layer_ops.h): out = t * (offset + weight),
// t = x * (1 / sqrt(mean(x^2) + eps)); out may be x.
struct NormParams {
  const float* x;
  const float* weight;  // [n]
  float offset, eps;
  float* out;
  int64_t rows, n;
  int num_threads;
};

// A decoder layer's gated activation (layer_ops.h): gate <- act(gate) * up over n values;
// activation 0: SiLU, 1: GELU's tanh approximation.
struct GateParams {
  int activation;
  float* gate;
  const float* up;
  int64_t n;
  int num_threads;
};

// A LoRA delta's second product, added (layer_ops.h, for lora.cpp): y[r] += scale * (t[r] B^T)
// for each of `rows` rows, from bt = B^T [rank, out] (B is PEFT's lora_B [out, rank]).
struct LoraExpandParams {
  const float* t;   // [rows, rank]
  const float* bt;  // [rank, out]
  float* y;         // [rows, out]
  int64_t rows, rank, out;
  float scale;
  int num_threads;
};

// Entry points of the variants (kernel_<isa>.cpp), beside tpp_decode and tpp_prefill.
#define CHUNK_ATTN_DECLARE_LAYER_OPS(isa)      \
  namespace isa {                              \
  void small_linear(const LinearParams& p);    \
  void rms_norm(const NormParams& p);          \
  void gate_mul(const GateParams& p);          \
  void lora_expand(const LoraExpandParams& p); \
  }
CHUNK_ATTN_DECLARE_LAYER_OPS(avx512)
CHUNK_ATTN_DECLARE_LAYER_OPS(avx2)
CHUNK_ATTN_DECLARE_LAYER_OPS(neon)
CHUNK_ATTN_DECLARE_LAYER_OPS(generic)
#undef CHUNK_ATTN_DECLARE_LAYER_OPS

}  // namespace chunk_attn_cpu
