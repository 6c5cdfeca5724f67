// A step's plan made into the kernels' parameters once (marshalling: plan_checks.cpp says
// what is checked), and run per layer. Making a plan copies the caller's arrays into the
// handle before checking them, so nothing written to the caller's tensors later can reach
// the kernels; the decode schedule is built into the handle's vectors, which keep their
// memory from step to step. A call copies the planned parameters, points them at its
// tensors and the caller's scratch, and runs the variant. Torch-free; baseline flags.
#include <algorithm>
#include <cstdint>

#include "api_internal.h"
#include "chunk_llama/api_errors.h"

namespace chunk_llama_cpu_internal {
namespace {

using namespace chunk_attn_cpu;

void make_decode(chunk_llama_cpu_plan& plan, const chunk_llama_cpu_plan_params& params) {
  const Geometry& g = plan.g;
  CHECK_VALUE(params.max_blocks_per_item >= 0, "max_blocks_per_item must be >= 0 (0: chosen), got ",
              params.max_blocks_per_item);
  Params& p = plan.decode;
  p = Params{};
  p.num_seqs = static_cast<int>(g.q_rows);
  p.num_heads = static_cast<int>(g.num_heads);
  p.num_kv_heads = static_cast<int>(g.num_kv_heads);
  p.head_dim = static_cast<int>(g.head_dim);
  p.chunk_size = static_cast<int>(g.chunk_size);
  p.num_threads = params.num_threads;
  check_decode_plan(p, g.capacity, plan.index.data(), static_cast<int64_t>(plan.index.size()), params.layout,
                    params.layout_size, plan.pair_seg, plan.reach);
  decode_schedule_into(plan.schedule, p, plan.pair_seg,
                       static_cast<int>(std::min<int64_t>(params.max_blocks_per_item, 1 << 30)));
  plan.schedule.point(p);
  plan.scratch_floats = plan.schedule.scratch_floats(p, params.num_threads);
}

void make_prefill(chunk_llama_cpu_plan& plan, const chunk_llama_cpu_plan_params& params) {
  const Geometry& g = plan.g;
  PrefillParams& p = plan.prefill;
  p = PrefillParams{};
  check_prefill_plan(p, g, plan.index.data(), static_cast<int64_t>(plan.index.size()), params.layout,
                     params.layout_size);
  p.num_heads = static_cast<int>(g.num_heads);
  p.num_kv_heads = static_cast<int>(g.num_kv_heads);
  p.head_dim = static_cast<int>(g.head_dim);
  p.chunk_size = static_cast<int>(g.chunk_size);
  p.num_threads = params.num_threads;
  p.workspace_stride = prefill_workspace_floats(p.head_dim);
  plan.scratch_floats = p.num_partial_rows * g.num_heads * (g.head_dim + 2) + p.workspace_stride * params.num_threads;
}

}  // namespace

void make_plan(chunk_llama_cpu_plan& plan, const chunk_llama_cpu_plan_params& params) {
  plan.ready = false;
  ++plan.generation;  // every call planned before is stale from here on, whatever happens next
  CHECK_VALUE(params.kind == CHUNK_LLAMA_DECODE_PLAN || params.kind == CHUNK_LLAMA_PREFILL_PLAN, "plan kind ",
              params.kind, " is neither decode (0) nor prefill (1)");
  plan.kind = params.kind;
  plan.variant = &variant_for(params.isa);
  plan.g = check_geometry(params);
  plan.num_threads = params.num_threads;
  CHECK_VALUE(params.index != nullptr && params.layout != nullptr && params.index_numel >= 0,
              "the plan needs its index and layout");
  plan.index.assign(params.index, params.index + params.index_numel);  // (checked from here on: the copy)
  const int64_t n = params.num_writes;
  CHECK_VALUE(n >= 0 && n <= plan.g.q_rows &&
                  (n == 0 || (params.write_token != nullptr && params.write_chunk != nullptr &&
                              params.write_offset != nullptr)),
              "the plan's ", n, " writes must be at most its ", plan.g.q_rows, " rows, with their token, chunk and ",
              "offset arrays");
  plan.writes.clear();
  plan.writes.insert(plan.writes.end(), params.write_token, params.write_token + n);
  plan.writes.insert(plan.writes.end(), params.write_chunk, params.write_chunk + n);
  plan.writes.insert(plan.writes.end(), params.write_offset, params.write_offset + n);
  plan.num_writes = n;
  check_writes(plan.writes.data(), plan.writes.data() + n, plan.writes.data() + 2 * n, n, plan.g);
  plan.row_order.clear();
  if (params.row_order != nullptr) {
    CHECK_VALUE(params.kind == CHUNK_LLAMA_DECODE_PLAN, "a prefill's rows have no row order");
    plan.row_order.assign(params.row_order, params.row_order + plan.g.q_rows);
    check_row_order(plan.row_order.data(), plan.g.q_rows);
  }
  if (params.kind == CHUNK_LLAMA_DECODE_PLAN) {
    make_decode(plan, params);
  } else {
    make_prefill(plan, params);
  }
  plan.ready = true;
}

const chunk_llama_cpu_plan& checked_plan(const chunk_llama_cpu_planned* planned) {
  CHECK_VALUE(planned != nullptr && planned->plan != nullptr, "the call names no plan");
  const chunk_llama_cpu_plan& plan = *planned->plan;
  CHECK_VALUE(plan.ready && planned->generation == plan.generation, "the call's plan is stale (generation ",
              planned->generation, "; its handle holds ", plan.generation, plan.ready ? "" : ", not planned",
              "): the handle was planned again since, for another step; make this step's plan again");
  CHECK_VALUE(planned->scratch != nullptr && planned->scratch_numel >= plan.scratch_floats,
              "scratch must be a contiguous float32 CPU tensor of at least ", plan.scratch_floats, " elements, got ",
              planned->scratch_numel);
  return plan;
}

void run_attention(const chunk_llama_cpu_plan& plan, const chunk_llama_cpu_planned& planned,
                   const chunk_llama_cpu_kv& kv, const void* q, int q_dtype, void* out) {
  check_kv(kv, plan.g);
  check_dtype(q_dtype, "q", false);
  if (plan.kind == CHUNK_LLAMA_DECODE_PLAN) {
    Params p = plan.decode;
    p.q = q, p.k_cache = kv.k, p.v_cache = kv.v, p.out = out;
    p.dtype = kernel_dtype(kv.dtype), p.q_dtype = kernel_dtype(q_dtype);
    p.scale = static_cast<float>(kv.scale), p.window = static_cast<int>(kv.window);
    plan.schedule.carve_scratch(p, planned.scratch);
    plan.variant->run(p);
    return;
  }
  PrefillParams p = plan.prefill;
  p.q = q, p.k_cache = kv.k, p.v_cache = kv.v, p.out = out;
  p.dtype = kernel_dtype(kv.dtype), p.q_dtype = kernel_dtype(q_dtype);
  p.scale = static_cast<float>(kv.scale), p.window = static_cast<int>(kv.window);
  p.partial_o = planned.scratch;
  p.partial_m = p.partial_o + p.num_partial_rows * p.num_heads * p.head_dim;
  p.partial_n = p.partial_m + p.num_partial_rows * p.num_heads;
  p.workspace = planned.scratch + p.num_partial_rows * p.num_heads * (p.head_dim + 2);
  plan.variant->prefill(p);
}

}  // namespace chunk_llama_cpu_internal
