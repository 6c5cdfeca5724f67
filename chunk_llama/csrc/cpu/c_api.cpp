// The C interface of the CPU kernels (c_api.h): its entry points, each a guarded call into
// the checks (plan_checks.cpp), the planning and running of a step's plan (planned.cpp) or a
// linear kernel; and the choice of variant. Torch-free, so the library it makes does not
// depend on any torch release's C++ ABI and needs no torch headers to build; compiled with
// baseline flags (each kernel_<isa>.cpp raises its own target). Failed checks are reported
// as chunk_llama/api_errors.h says.
#include "c_api.h"
#include "api_internal.h"

#include <cstdint>
#include <iterator>
#include <new>
#include <string>
#include <vector>

#include "chunk_llama/api_errors.h"
#include "linear_params.h"
#include "plan_layout.h"
#include "quant_params.h"
#include "variants.h"

namespace chunk_llama_cpu_internal {

using chunk_attn_cpu::Variant;

using chunk_llama_api::fail;
using chunk_llama_api::guarded;

std::string join(const char* const* names, int count) {
  std::string joined;
  for (int i = 0; i < count; ++i) joined += std::string(i ? "," : "") + names[i];
  return joined;
}

const Variant& variant_for(const char* isa) {
  CHECK_VALUE(isa != nullptr, "no CPU kernel variant named");
  const Variant* v = chunk_attn_cpu::find_variant(isa);
  if (v == nullptr) {
    std::string compiled;
    for (const Variant& c : chunk_attn_cpu::kVariants) compiled += std::string(compiled.empty() ? "" : ", ") + c.name;
    fail(chunk_llama_api::kValueError, "the CPU kernel variant '", isa, "' is not in this build (it holds ", compiled,
         ")");
  }
  CHECK_VALUE(v->host_runs(), "the CPU kernel variant '", isa, "' needs instructions this CPU does not have");
  return *v;
}

}  // namespace chunk_llama_cpu_internal

using namespace chunk_llama_cpu_internal;

extern "C" {

int chunk_llama_cpu_abi_version(void) { return CHUNK_LLAMA_CPU_ABI_VERSION; }

const char* chunk_llama_cpu_last_error(void) { return chunk_llama_api::last_error().c_str(); }

const char* chunk_llama_cpu_variants(void) {
  static const std::string names = [] {
    std::vector<const char*> list;
    for (const Variant& v : chunk_attn_cpu::kVariants) list.push_back(v.name);
    return join(list.data(), static_cast<int>(list.size()));
  }();
  return names.c_str();
}

void chunk_llama_cpu_prefetch(const uint64_t* addresses, int64_t count) {
  for (int64_t i = 0; i < count; ++i) __builtin_prefetch(reinterpret_cast<const void*>(addresses[i]));
}

int chunk_llama_cpu_host_runs(const char* isa) {
  const Variant* v = chunk_attn_cpu::find_variant(isa);
  return v != nullptr && v->host_runs();
}

const char* chunk_llama_cpu_decode_layout(void) {
  static const std::string names =
      join(chunk_attn_cpu::kDecodeArrayNames, std::size(chunk_attn_cpu::kDecodeArrayNames));
  return names.c_str();
}

const char* chunk_llama_cpu_prefill_layout(void) {
  static const std::string names =
      join(chunk_attn_cpu::kPrefillArrayNames, std::size(chunk_attn_cpu::kPrefillArrayNames));
  return names.c_str();
}

chunk_llama_cpu_plan* chunk_llama_cpu_plan_new(void) { return new (std::nothrow) chunk_llama_cpu_plan(); }

void chunk_llama_cpu_plan_free(chunk_llama_cpu_plan* plan) { delete plan; }

int chunk_llama_cpu_plan_make(chunk_llama_cpu_plan* plan, const chunk_llama_cpu_plan_params* params,
                              uint64_t* generation, int64_t* scratch_floats) {
  return guarded([&] {
    CHECK_VALUE(plan != nullptr && params != nullptr && generation != nullptr && scratch_floats != nullptr,
                "plan_make needs a handle, its parameters and where to put the generation and scratch size");
    make_plan(*plan, *params);
    *generation = plan->generation;
    *scratch_floats = plan->scratch_floats;
  });
}

int chunk_llama_cpu_attend(const chunk_llama_cpu_planned* planned, const chunk_llama_cpu_kv* kv, const void* q,
                           int32_t q_dtype, void* out) {
  return guarded([&] {
    const chunk_llama_cpu_plan& plan = checked_plan(planned);
    CHECK_VALUE(kv != nullptr && q != nullptr && out != nullptr, "attend needs the layer's pool, q and out");
    run_attention(plan, *planned, *kv, q, q_dtype, out);
  });
}

int chunk_llama_cpu_small_linear(const float* x, int64_t rows, int64_t in_features, const float* weight,
                                 int64_t out_features, const float* bias, float* y, const char* isa,
                                 int num_threads) {
  return guarded([&] {
    const Variant& variant = variant_for(isa);
    CHECK_VALUE(rows >= 0 && in_features >= 0 && out_features >= 0 && num_threads >= 1,
                "small_linear: bad sizes (", rows, " rows, ", in_features, " in, ", out_features, " out)");
    variant.linear(chunk_attn_cpu::LinearParams{x, weight, bias, y, rows, out_features, in_features, num_threads});
  });
}

}  // extern "C"

namespace chunk_llama_cpu_internal {

// The bytes of one row of in_features weights of `type`, or the error why not.
int64_t row_bytes_of(const char* op, int type, int64_t in_features) {
  // (a tiled type's rows take the bytes of its format's)
  const chunk_attn_cpu::QuantFormat f = chunk_attn_cpu::quant_format(
      chunk_attn_cpu::quant_int8_supports(type) ? chunk_attn_cpu::untiled(type) : type);
  CHECK_VALUE(f.block_elems > 0, op, ": GGML type ", type, " is not one the kernels decode (F16, Q4_0, Q4_1, Q5_0, Q5_1, "
              "Q8_0, Q4_K, Q5_K, Q6_K, BF16, or the integer formats + 256 for tiled rows)");
  CHECK_VALUE(in_features > 0 && in_features % f.block_elems == 0, op, ": ", in_features,
              " weights a row is not a whole number of blocks of ", f.block_elems);
  return in_features / f.block_elems * f.block_bytes;
}

void check_tiles(const char* op, int type, int64_t out_features, bool integer) {
  if (!chunk_attn_cpu::is_tiled(type)) return;
  CHECK_VALUE(integer, op, ": GGML type ", type, " is tiled (", chunk_attn_cpu::untiled(type),
              " + 256): only integer activations read tiles, the float32 kernel reads rows");
  CHECK_VALUE(out_features % chunk_attn_cpu::kTileRows == 0, op, ": ", out_features,
              " rows are not a whole number of tiles of ", chunk_attn_cpu::kTileRows);
}

}  // namespace chunk_llama_cpu_internal

extern "C" {

int64_t chunk_llama_cpu_quant_row_bytes(int type, int64_t in_features) {
  int64_t bytes = -1;
  if (guarded([&] { bytes = row_bytes_of("quant_row_bytes", type, in_features); }) != CHUNK_LLAMA_OK) return -1;
  return bytes;
}

int chunk_llama_cpu_dequantize(const uint8_t* weight, int64_t weight_bytes, int type, int64_t num_rows,
                               int64_t in_features, float* out, const char* isa, int num_threads) {
  return guarded([&] {
    const Variant& variant = variant_for(isa);
    CHECK_VALUE(num_rows >= 0 && num_threads >= 1, "dequantize: bad sizes (", num_rows, " rows)");
    const int64_t row_bytes = row_bytes_of("dequantize", type, in_features);
    check_tiles("dequantize", type, num_rows, false);
    CHECK_VALUE(weight_bytes == row_bytes * num_rows, "dequantize: the weight holds ", weight_bytes, " bytes, not ",
                num_rows, " rows of ", row_bytes);
    variant.dequantize(chunk_attn_cpu::DequantizeParams{weight, type, out, num_rows, in_features, num_threads});
  });
}

}  // extern "C"
