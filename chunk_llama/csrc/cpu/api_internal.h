// What the C interface's translation units share (c_api.cpp defines it): the choice of
// variant and the checked attention and linear entry points, for the fused layer
// (layer.cpp). Torch-free; errors are thrown as chunk_llama/api_errors.h says.
#pragma once

#include <cstdint>

#include "variants.h"

namespace chunk_llama_cpu_internal {

// The geometry both attention ops check on q and the pool.
struct Geometry {
  int64_t q_rows, num_heads, head_dim, capacity, num_kv_heads, chunk_size;
};

const chunk_attn_cpu::Variant& variant_for(const char* isa);
Geometry check_geometry(int64_t q_rows, int64_t num_heads, int64_t head_dim, int64_t capacity, int64_t num_kv_heads,
                        int64_t chunk_size, int64_t kv_head_dim, int64_t k_extent, int64_t v_extent, int dtype);
void tpp_decode(const void* q, int q_dtype, const void* k_cache, const void* v_cache, const Geometry& g, int dtype,
                void* out, const int64_t* plan, int64_t plan_numel, const int64_t* layout, int64_t layout_size,
                float* scratch, int64_t scratch_numel, double scale, int64_t window, int64_t max_blocks_per_item,
                const char* isa, int num_threads);
void tpp_prefill(const void* q, int q_dtype, const void* k_cache, const void* v_cache, const Geometry& g, int dtype,
                 void* out, const int64_t* plan, int64_t plan_numel, const int64_t* layout, int64_t layout_size,
                 float* scratch, int64_t scratch_numel, double scale, int64_t window, const char* isa,
                 int num_threads);
int64_t row_bytes_of(const char* op, int type, int64_t in_features);
// quant_api.cpp: the int8 activations' linear layer (its variant chosen and its scratch given
// here; the caller checked the weight's size and the type's codes).
const chunk_attn_cpu::Variant& int8_variant_for(const char* isa);
void quant_int8_linear(const char* isa, const chunk_attn_cpu::QuantInt8Params& params);

}  // namespace chunk_llama_cpu_internal
