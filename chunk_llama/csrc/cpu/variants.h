// The kernel variants a build holds (by architecture) and whether this CPU runs each.
// Used by the torch glue and the test driver; baseline code.
#pragma once

#include <cstring>

#include "linear_params.h"
#include "params.h"
#include "prefill_params.h"
#include "quant_params.h"
#include "quant_act_params.h"

namespace chunk_attn_cpu {

struct Variant {
  const char* name;
  void (*run)(const Params&);                  // decode
  void (*prefill)(const PrefillParams&);
  void (*linear)(const LinearParams&);        // a linear layer of few rows
  void (*quant_linear)(const QuantLinearParams&);  // a linear layer on GGML blocks
  void (*dequantize)(const DequantizeParams&);
  void (*rms_norm)(const NormParams&);        // a decoder layer's elementwise steps
  void (*gate_mul)(const GateParams&);
  bool (*host_runs)();
  void (*quant_linear_int8)(const QuantInt8Params&);  // int8 activations (quant_act.h)
  bool (*int8_host_runs)();                            // whether this CPU runs the one above
  void (*lora_expand)(const LoraExpandParams&);        // a LoRA delta's second product (layer_ops.h)
};

#if defined(__x86_64__) || defined(_M_X64)
// __builtin_cpu_supports also checks that the OS saves the wider registers.
static inline bool host_runs_avx512() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c");
}
static inline bool host_runs_avx2() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}
// The AVX-512 variant's integer kernel adds BW, VL and VNNI (vpdpbusd) to its AVX-512F.
static inline bool host_runs_avx512_int8() {
#ifdef CHUNK_ATTN_EMULATE_AVX512
  return true;  // (the test driver's SIMDe build: no AVX-512 instruction)
#else
  return host_runs_avx512() && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512vnni");
#endif
}
#endif
static inline bool host_runs_always() { return true; }

// Best first; the last one runs on every CPU of the architecture (generic; neon on aarch64).
static const Variant kVariants[] = {
#if defined(__x86_64__) || defined(_M_X64)
    {"avx512", avx512::tpp_decode, avx512::tpp_prefill, avx512::small_linear, avx512::quant_linear, avx512::dequantize, avx512::rms_norm, avx512::gate_mul,
     host_runs_avx512, avx512::quant_linear_int8, host_runs_avx512_int8,
     avx512::lora_expand},
    {"avx2", avx2::tpp_decode, avx2::tpp_prefill, avx2::small_linear, avx2::quant_linear, avx2::dequantize, avx2::rms_norm, avx2::gate_mul,
     host_runs_avx2, avx2::quant_linear_int8, host_runs_avx2, avx2::lora_expand},
#elif defined(__aarch64__)
    {"neon", neon::tpp_decode, neon::tpp_prefill, neon::small_linear, neon::quant_linear, neon::dequantize, neon::rms_norm, neon::gate_mul,
     host_runs_always, neon::quant_linear_int8, host_runs_always, neon::lora_expand},  // Advanced SIMD is part of ARMv8-A
#endif
#if !defined(__aarch64__)  // (every aarch64 CPU runs neon: a build there leaves generic's out, the largest compile)
    {"generic", generic::tpp_decode, generic::tpp_prefill, generic::small_linear, generic::quant_linear, generic::dequantize, generic::rms_norm, generic::gate_mul,
     host_runs_always, generic::quant_linear_int8, host_runs_always, generic::lora_expand},
#endif
};
constexpr int kNumVariants = sizeof(kVariants) / sizeof(kVariants[0]);

static inline const Variant* find_variant(const char* name) {
  for (const Variant& v : kVariants)
    if (std::strcmp(v.name, name) == 0) return &v;
  return nullptr;
}

}  // namespace chunk_attn_cpu
