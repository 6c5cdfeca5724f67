// What the C interface's translation units share: the plan handle (opaque in c_api.h), the
// checks a plan and a call go through (plan_checks.cpp), the planning and running of a
// checked plan (planned.cpp), the choice of variant (c_api.cpp), and the LoRA deltas
// (lora.cpp). layer.cpp runs the fused decoder layer through them. Torch-free; errors are thrown as chunk_llama/api_errors.h says.
#pragma once

#include <cstdint>
#include <vector>

#include "c_api.h"
#include "params.h"
#include "prefill_params.h"
#include "schedule.h"
#include "variants.h"

namespace chunk_llama_cpu_internal {

// The geometry a plan is checked against: its query rows and heads, and the pool's shape.
struct Geometry {
  int64_t q_rows, num_heads, head_dim, capacity, num_kv_heads, chunk_size;
};

// c_api.cpp
const chunk_attn_cpu::Variant& variant_for(const char* isa);
int64_t row_bytes_of(const char* op, int type, int64_t in_features);
// That a tiled type (quant_params.h) is multiplied with integer activations, as whole tiles.
void check_tiles(const char* op, int type, int64_t out_features, bool integer);
// quant_api.cpp: the int8 activations' linear layer (its variant chosen and its scratch given
// here; the caller checked the weight's size and the type's codes).
const chunk_attn_cpu::Variant& int8_variant_for(const char* isa);
void quant_int8_linear(const char* isa, const chunk_attn_cpu::QuantInt8Params& params);

// plan_checks.cpp: what a plan is checked for once, when it is made, and a call per layer.
void check_dtype(int dtype, const char* what, bool pool);  // pool: float16 too
chunk_attn_cpu::DType kernel_dtype(int dtype);
void check_window(int64_t window);
Geometry check_geometry(const chunk_llama_cpu_plan_params& params);
// The decode plan's arrays in p (geometry set), each checked inside `index` and against the
// pool; fills pair_seg with what decode_schedule takes (reach: the check's work array).
void check_decode_plan(chunk_attn_cpu::Params& p, int64_t capacity, const int64_t* index, int64_t index_numel,
                       const int64_t* layout, int64_t layout_size, std::vector<int64_t>& pair_seg,
                       std::vector<int64_t>& reach);
// The prefill plan's arrays and counts in p (geometry set), each checked.
void check_prefill_plan(chunk_attn_cpu::PrefillParams& p, const Geometry& g, const int64_t* index,
                        int64_t index_numel, const int64_t* layout, int64_t layout_size);
void check_writes(const int64_t* token, const int64_t* chunk, const int64_t* offset, int64_t num_writes,
                  const Geometry& g);
void check_row_order(const int64_t* row_order, int64_t rows);
// A layer's pool and scalars against the plan's geometry (O(1): per call).
void check_kv(const chunk_llama_cpu_kv& kv, const Geometry& g);

}  // namespace chunk_llama_cpu_internal

// A made plan: a copy of the step's plan arrays and writes (checked), the kernels'
// parameters pointing into them with the decode schedule built, and what a call needs.
// Re-planned in place each step (vectors keep their capacity: no allocation per step once
// warm); run by one thread at a time (its step's).
struct chunk_llama_cpu_plan {
  uint64_t generation = 0;  // advanced by every plan_make; a call names the one it was made for
  bool ready = false;       // the last plan_make succeeded
  int32_t kind = CHUNK_LLAMA_DECODE_PLAN;
  chunk_llama_cpu_internal::Geometry g{};
  const chunk_attn_cpu::Variant* variant = nullptr;
  int num_threads = 1;
  std::vector<int64_t> index;      // the plan's arrays, copied before they are checked
  std::vector<int64_t> writes;     // write_token, write_chunk, write_offset: num_writes each
  std::vector<int64_t> row_order;  // empty: plan rows are batch rows
  int64_t num_writes = 0;
  chunk_attn_cpu::Params decode{};        // arrays and schedule set; a call sets the rest
  chunk_attn_cpu::DecodeSchedule schedule;
  chunk_attn_cpu::PrefillParams prefill{};  // arrays and counts set; a call sets the rest
  int64_t scratch_floats = 0;
  std::vector<int64_t> pair_seg, reach;  // the checks' work arrays
  mutable std::vector<float> layer_buffer;  // the fused layers' intermediates (layer.cpp)
};

namespace chunk_llama_cpu_internal {

// planned.cpp
void make_plan(chunk_llama_cpu_plan& plan, const chunk_llama_cpu_plan_params& params);
// The plan a call names, refused if stale (re-planned since, or its planning failed) or if
// the call's scratch is too small.
const chunk_llama_cpu_plan& checked_plan(const chunk_llama_cpu_planned* planned);
// Attention of q (q_rows rows in plan order) over kv's pool (both checked) into out.
void run_attention(const chunk_llama_cpu_plan& plan, const chunk_llama_cpu_planned& planned,
                   const chunk_llama_cpu_kv& kv, const void* q, int q_dtype, void* out);

}  // namespace chunk_llama_cpu_internal

namespace chunk_llama_cpu_internal {

// lora.cpp: a fused layer's LoRA deltas (chunk_llama_cpu_lora_rows), targets in its tables'
// order: q, k, v, o, gate, up, down.
constexpr int kLoraTargets = 7;
// Checks lora's segments (NULL: none) against the step's rows and layer `layer`'s factors
// against L's weights; the floats of scratch add_lora then needs (0: none).
int64_t check_lora(const chunk_llama_cpu_lora_rows* lora, int64_t layer, const chunk_llama_cpu_decoder_layer& L,
                   int64_t rows);
// y [rows, out] += each segment's deltas of target `target` (lora checked) for x [rows, in].
void add_lora(const chunk_llama_cpu_plan& plan, const chunk_llama_cpu_lora_rows* lora, int64_t layer, int target,
              const float* x, float* y, float* scratch);

}  // namespace chunk_llama_cpu_internal
