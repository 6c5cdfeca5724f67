// Torch glue of the CPU kernels (decode: the two-phase partition; prefill): checks,
// scratch layout, the phase-1 schedule and the choice of variant, registered as torch ops
// (torch.ops.chunk_llama_cpu.*). The only translation unit that includes torch, so
// it is compiled once per build; it includes the light ATen headers rather than
// torch/extension.h (about 11 s instead of 45 s here) and needs no pybind11.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <string>
#include <vector>

#include "linear_params.h"
#include "params.h"
#include "plan_layout.h"
#include "prefill_params.h"
#include "schedule.h"
#include "variants.h"

namespace {

using chunk_attn_cpu::Variant;

const Variant& variant_for(const std::string& isa) {
  const Variant* v = chunk_attn_cpu::find_variant(isa.c_str());
  if (v == nullptr) {
    std::string compiled;
    for (const Variant& c : chunk_attn_cpu::kVariants) compiled += std::string(compiled.empty() ? "" : ", ") + c.name;
    TORCH_CHECK_VALUE(false, "the CPU kernel variant '", isa, "' is not in this build (it holds ", compiled, ")");
  }
  TORCH_CHECK_VALUE(v->host_runs(), "the CPU kernel variant '", isa, "' needs instructions this CPU does not have");
  return *v;
}

// A plan reaches an op as one int64 tensor and its layout (plan_layout.h).
void check_plan(const at::Tensor& plan, at::IntArrayRef layout, int layout_size, const char* what) {
  TORCH_CHECK_TYPE(plan.device().is_cpu() && plan.scalar_type() == at::kLong, "the ", what,
                   " plan must be an int64 CPU tensor, got ", plan.scalar_type(), " on ", plan.device());
  TORCH_CHECK_VALUE(plan.is_contiguous(), "the ", what, " plan must be contiguous");
  TORCH_CHECK_VALUE(static_cast<int>(layout.size()) == layout_size, "the ", what, " layout has ", layout_size,
                    " entries, got ", layout.size());
}

// The plan's array at layout[slot], of `count` entries, checked to lie inside the tensor.
const int64_t* plan_array(const at::Tensor& plan, at::IntArrayRef layout, int slot, int64_t count, const char* name) {
  const int64_t offset = layout[slot];
  TORCH_CHECK_VALUE(count >= 0 && offset >= 0 && offset + count <= plan.numel(), "plan array ", name, " (", count,
                    " entries from ", offset, ") is not inside the plan's ", plan.numel());
  return plan.data_ptr<int64_t>() + offset;
}

// The checks both kernels make on q and the pool (q_shape: what q must be).
// The caller keeps the scratch between calls: fresh pages for every step would cost a
// page fault per 4 KiB, more than the attention itself.
void check_scratch(const at::Tensor& scratch, int64_t needed) {
  TORCH_CHECK_VALUE(scratch.device().is_cpu() && scratch.scalar_type() == at::kFloat && scratch.is_contiguous() &&
                        scratch.numel() >= needed,
                    "scratch must be a contiguous float32 CPU tensor of at least ", needed, " elements, got ",
                    scratch.numel());
}

// A plan's segment, checked before any pointer into the pool is made from it: a wrong
// chunk id or slot range would read out of bounds.
void check_segment(int64_t chunk, int64_t start, int64_t count, int64_t capacity, int64_t chunk_size,
                   const char* what, int64_t index) {
  TORCH_CHECK_VALUE(chunk >= 0 && chunk < capacity && start >= 0 && count >= 1 && start + count <= chunk_size, what,
                    " ", index, ": chunk ", chunk, ", slots ", start, " + ", count, " are not inside the pool of ",
                    capacity, " chunks of ", chunk_size);
}

// Walks a sequence's segments (chunk, first slot, position of the first key; a segment
// ends at the next one's position) up to position `length`, checking each.
void check_segments(const int64_t* chunks, const int64_t* starts, const int64_t* positions, int64_t width,
                    int64_t from, int64_t length, int64_t capacity, int64_t chunk_size, const char* what,
                    int64_t seq) {
  TORCH_CHECK_VALUE(from >= length || (width > 0 && positions[0] == from), what, " of sequence ", seq,
                    " must start at position ", from);
  for (int64_t i = 0; i < width && positions[i] < length; ++i) {
    const int64_t next = i + 1 < width ? positions[i + 1] : chunk_attn_cpu::kNoPosition;
    TORCH_CHECK_VALUE(next > positions[i], what, " of sequence ", seq, ": positions must rise");
    check_segment(chunks[i], starts[i], std::min(next, length) - positions[i], capacity, chunk_size, what, i);
  }
}

void check_window(int64_t window) {
  TORCH_CHECK_VALUE(window >= 0 && window <= INT32_MAX, "window must be 0 (none) or a positive int32, got ", window);
}

void check_attention_tensors(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                             const char* q_shape) {
  TORCH_CHECK_TYPE(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(),
                   "the CPU kernel takes CPU tensors, got q on ", q.device(), ", k_cache on ", k_cache.device());
  TORCH_CHECK_VALUE(q.dim() == 3, q_shape, q.sizes());
  TORCH_CHECK_VALUE(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
                    "k_cache and v_cache must both be [capacity, num_kv_heads, chunk_size, head_dim], got ",
                    k_cache.sizes(), " and ", v_cache.sizes());
  TORCH_CHECK_TYPE(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
                   "q, k_cache and v_cache must share a dtype, got ", q.scalar_type(), ", ", k_cache.scalar_type(),
                   ", ", v_cache.scalar_type());
  TORCH_CHECK_TYPE(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
                   "the CPU kernel supports float32 and bfloat16, got ", q.scalar_type());
  TORCH_CHECK_VALUE(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
                    "q, k_cache and v_cache must be contiguous");
  const int num_heads = q.size(1), head_dim = q.size(2);
  const int num_kv_heads = k_cache.size(1), chunk_size = k_cache.size(2);
  TORCH_CHECK_VALUE(k_cache.size(3) == head_dim, "head_dim of q (", head_dim, ") and cache (", k_cache.size(3),
                    ") differ");
  TORCH_CHECK_VALUE(num_heads % num_kv_heads == 0, "num_heads ", num_heads, " is not a multiple of num_kv_heads ",
                    num_kv_heads);
  TORCH_CHECK_VALUE(chunk_attn_cpu::supports(chunk_size, head_dim), "the CPU kernel supports chunk sizes that are ",
                    "multiples of 16 and head dims 32/64/80/96/128/256, got chunk_size ", chunk_size, ", head_dim ", head_dim);
  // Score tiles read up to kGuardRows K/V rows past a segment that ends inside a chunk.
  for (const at::Tensor* cache : {&k_cache, &v_cache})
    TORCH_CHECK_VALUE(cache->storage_offset() + cache->numel() + chunk_attn_cpu::kGuardRows * head_dim <=
                          static_cast<int64_t>(cache->storage().nbytes() / cache->element_size()),
                      "k_cache and v_cache need ", chunk_attn_cpu::kGuardRows, " rows of memory behind their last ",
                      "chunk (a ChunkPool's K/V have a guard chunk)");
}

at::Tensor tpp_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& plan, at::IntArrayRef layout, const at::Tensor& scratch, double scale,
                      int64_t window, int64_t max_chunks_per_item, const std::string& isa) {
  using namespace chunk_attn_cpu;
  const Variant& variant = variant_for(isa);
  check_window(window);
  check_attention_tensors(q, k_cache, v_cache, "q must be [num_seqs, num_heads, head_dim], got ");
  const int num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int num_kv_heads = k_cache.size(1), chunk_size = k_cache.size(2);
  const int64_t capacity = k_cache.size(0);
  check_plan(plan, layout, kDecodeLayoutSize, "decode");
  const int64_t num_shared = layout[kDecodeNumShared], width = layout[kDecodeWidth];
  TORCH_CHECK_VALUE(layout[kDecodeNumSeqs] == num_seqs && num_shared >= 0 && width >= 1,
                    "the decode plan is for ", layout[kDecodeNumSeqs], " sequences (", num_shared,
                    " shared segments, width ", width, "), q has ", num_seqs);
  // each array's extent inside the plan tensor, before any pointer is made from it
  const auto array = [&](int slot, int64_t count) {
    return plan_array(plan, layout, slot, count, kDecodeArrayNames[slot - kDecodeCounts]);
  };
  const int64_t *shared_chunk_ids = array(kSharedChunkIds, num_shared), *shared_start = array(kSharedStart, num_shared),
                *shared_len = array(kSharedLen, num_shared), *shared_pos = array(kSharedPos, num_shared),
                *shared_begin = array(kSharedBegin, num_shared), *shared_end = array(kSharedEnd, num_shared),
                *shared_depth = array(kSharedDepth, num_shared),
                *private_chunk_ids = array(kPrivateChunkIds, num_seqs * width),
                *private_start = array(kPrivateStart, num_seqs * width),
                *private_pos = array(kPrivatePos, num_seqs * width),
                *num_shared_tokens = array(kNumSharedTokens, num_seqs), *lens = array(kSeqLens, num_seqs),
                *pair_ptr = array(kSeqPairPtr, num_seqs + 1);
  TORCH_CHECK_VALUE(max_chunks_per_item >= 1, "max_chunks_per_item must be >= 1, got ", max_chunks_per_item);
  for (int64_t s = 0; s < num_shared; ++s) {
    const int64_t begin = shared_begin[s], end = shared_end[s], depth = shared_depth[s];
    check_segment(shared_chunk_ids[s], shared_start[s], shared_len[s], capacity, chunk_size, "shared segment", s);
    TORCH_CHECK_VALUE(0 <= begin && begin < end && end <= num_seqs && depth >= 0, "shared segment ", s, ": rows ",
                      begin, " .. ", end, " at depth ", depth, " do not fit ", num_seqs, " sequences");
    for (int64_t row = begin; row < end; ++row)
      TORCH_CHECK_VALUE(pair_ptr[row] + depth < pair_ptr[row + 1], "shared segment ", s, " at depth ", depth,
                        " has no partial slot for sequence ", row);
  }
  for (int64_t i = 0; i < num_seqs; ++i) {
    TORCH_CHECK_VALUE(pair_ptr[i] >= 0 && pair_ptr[i] <= pair_ptr[i + 1] && lens[i] >= 1, "sequence ", i,
                      ": bad pair range or length");
    check_segments(private_chunk_ids + i * width, private_start + i * width, private_pos + i * width, width,
                   num_shared_tokens[i], lens[i], capacity, chunk_size, "private segment", i);
  }
  const int num_threads = at::get_num_threads();
  const int64_t num_pairs = pair_ptr[num_seqs];
  const int64_t needed = chunk_attn_cpu::scratch_floats(num_pairs, num_seqs, num_heads, num_kv_heads, head_dim,
                                                        chunk_size, num_threads);
  check_scratch(scratch, needed);

  auto out = at::empty_like(q);
  chunk_attn_cpu::Params p{};
  p.q = q.data_ptr();
  p.k_cache = k_cache.data_ptr();
  p.v_cache = v_cache.data_ptr();
  p.out = out.data_ptr();
  p.partial_o = scratch.data_ptr<float>();
  p.partial_m = p.partial_o + num_pairs * num_heads * head_dim;
  p.partial_n = p.partial_m + num_pairs * num_heads;
  p.q_t = p.partial_n + num_pairs * num_heads;
  p.workspace = p.q_t + static_cast<int64_t>(num_kv_heads) * head_dim *
                            chunk_attn_cpu::q_t_stride(num_seqs, num_heads, num_kv_heads);
  p.workspace_stride = chunk_attn_cpu::workspace_floats(chunk_size, head_dim, num_heads / num_kv_heads);
  p.num_threads = num_threads;
  p.shared_chunk_ids = shared_chunk_ids;
  p.shared_start = shared_start;
  p.shared_len = shared_len;
  p.shared_pos = shared_pos;
  p.shared_begin = shared_begin;
  p.shared_end = shared_end;
  p.shared_depth = shared_depth;
  p.private_chunk_ids = private_chunk_ids;
  p.private_start = private_start;
  p.private_pos = private_pos;
  p.num_shared_tokens = num_shared_tokens;
  p.seq_lens = lens;
  p.seq_pair_ptr = pair_ptr;
  p.num_seqs = num_seqs;
  p.num_heads = num_heads;
  p.num_kv_heads = num_kv_heads;
  p.head_dim = head_dim;
  p.chunk_size = chunk_size;
  p.num_shared = static_cast<int>(num_shared);
  p.max_private = static_cast<int>(width);
  p.dtype = q.scalar_type() == at::kBFloat16 ? chunk_attn_cpu::DType::kBFloat16 : chunk_attn_cpu::DType::kFloat32;
  p.scale = static_cast<float>(scale);
  p.window = static_cast<int>(window);
  const std::vector<chunk_attn_cpu::ChunkItem> items =
      chunk_attn_cpu::chunk_items(p, static_cast<int>(std::min<int64_t>(max_chunks_per_item, 1 << 30)));
  p.items = items.data();
  p.num_items = static_cast<int>(items.size());
  variant.run(p);
  return out;
}

// Prefill attention of every sequence of a step (prefill_params.h has the layout). The
// per-step metadata (segment tables, context items, tiles) comes from
// chunk_llama/step/prefill_schedule.py, built once per forward; it is checked here before any
// pointer into the pool or the scratch is made from it, since a wrong chunk id, slot,
// row or partial offset would reach out of bounds.
at::Tensor tpp_prefill(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& plan, at::IntArrayRef layout, const at::Tensor& scratch, double scale,
                       int64_t window, const std::string& isa) {
  using namespace chunk_attn_cpu;
  const Variant& variant = variant_for(isa);
  check_window(window);
  check_attention_tensors(q, k_cache, v_cache, "q must be [num_q_tokens, num_heads, head_dim], got ");
  const int num_q_tokens = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int capacity = k_cache.size(0), num_kv_heads = k_cache.size(1), chunk_size = k_cache.size(2);
  const int group = num_heads / num_kv_heads;
  check_plan(plan, layout, kPrefillLayoutSize, "prefill");
  const int64_t num_seqs = layout[kPrefillNumSeqs], width = layout[kPrefillWidth], num_tiles = layout[kNumTiles];
  const int64_t num_ctx = layout[kNumCtxSegments], num_items = layout[kNumCtxItems];
  const int64_t num_partial_rows = layout[kNumPartialRows];
  TORCH_CHECK_VALUE(num_seqs >= 0 && width >= 1 && num_tiles >= 0 && num_ctx >= 0 && num_items >= 0 &&
                        num_partial_rows >= 0 && layout[kNumQTokens] == num_q_tokens,
                    "the prefill plan (", num_seqs, " sequences, ", layout[kNumQTokens], " query tokens) does not ",
                    "match q's ", num_q_tokens, " rows");
  const auto array = [&](int slot, int64_t count) {
    return plan_array(plan, layout, slot, count, kPrefillArrayNames[slot - kPrefillCounts]);
  };
  const int64_t *seg_chunk = array(kSegChunk, num_seqs * width), *seg_start = array(kSegStart, num_seqs * width),
                *seg_pos = array(kSegPos, num_seqs * width), *starts = array(kQStart, num_seqs),
                *counts = array(kNumTokens, num_seqs), *rows_at = array(kTokenStart, num_seqs),
                *tiles = array(kTiles, num_tiles * 3), *token_pos = array(kTokenPos, num_q_tokens),
                *ctx_end = array(kCtxEnd, num_seqs), *ctx_chunk = array(kCtxChunk, num_ctx),
                *ctx_start = array(kCtxStart, num_ctx), *ctx_len = array(kCtxLen, num_ctx),
                *ctx_pos = array(kCtxPos, num_ctx), *ctx_items = array(kCtxItems, num_items * 5),
                *ctx_ptr = array(kSeqCtxPtr, num_seqs + 1);
  const int64_t* ctx_offset = array(kSeqCtxOffset, ctx_ptr[num_seqs]);
  TORCH_CHECK_VALUE(ctx_ptr[0] == 0, "seq_ctx_ptr must index seq_ctx_offset from 0");
  // a partial row's whole range of tokens [first, last] inside the partials
  const auto check_partials = [&](int64_t offset, int64_t first, int64_t last, const char* what, int64_t i) {
    TORCH_CHECK_VALUE(offset + first >= 0 && offset + last < num_partial_rows, what, " ", i, ": partial rows ",
                      offset + first, " .. ", offset + last, " outside the ", num_partial_rows, " partials");
  };
  for (int64_t s = 0; s < num_seqs; ++s) {
    TORCH_CHECK_VALUE(starts[s] >= 0 && counts[s] >= 0 && rows_at[s] >= 0 && rows_at[s] + counts[s] <= num_q_tokens,
                      "prefill sequence ", s, ": tokens ", rows_at[s], " + ", counts[s], " outside q's ",
                      num_q_tokens);
    TORCH_CHECK_VALUE(ctx_end[s] >= 0 && ctx_end[s] <= starts[s], "prefill sequence ", s, ": context end ",
                      ctx_end[s], " past its first new token at ", starts[s]);
    TORCH_CHECK_VALUE(ctx_ptr[s] <= ctx_ptr[s + 1], "seq_ctx_ptr must not fall");
    for (int64_t c = ctx_ptr[s]; c < ctx_ptr[s + 1] && counts[s] > 0; ++c)
      check_partials(ctx_offset[c], rows_at[s], rows_at[s] + counts[s] - 1, "prefill sequence", s);
    // from position 0, each segment to the next one's position: every position up to the
    // last query's, each inside its chunk
    check_segments(seg_chunk + s * width, seg_start + s * width, seg_pos + s * width, width, 0, starts[s] + counts[s],
                   capacity, chunk_size, "prefill segment", s);
  }
  for (int64_t i = 0; i < num_ctx; ++i)
    check_segment(ctx_chunk[i], ctx_start[i], ctx_len[i], capacity, chunk_size, "context segment", i);
  const int64_t* item = ctx_items;
  for (int64_t i = 0; i < num_items; ++i, item += 5) {
    TORCH_CHECK_VALUE(item[0] >= 0 && item[1] >= 1 && item[0] + item[1] <= num_ctx && item[2] >= 0 &&
                          item[2] < item[3] && item[3] <= int64_t{num_q_tokens} * group &&
                          item[3] - item[2] <= chunk_attn_cpu::kRowsPerItem,
                      "context item ", i, " is not a run of context segments and at most ",
                      chunk_attn_cpu::kRowsPerItem, " query rows");
    check_partials(item[4], item[2] / group, (item[3] - 1) / group, "context item", i);
  }
  const int64_t* tile = tiles;
  for (int64_t i = 0; i < num_tiles; ++i, tile += 3)
    TORCH_CHECK_VALUE(tile[0] >= 0 && tile[0] < num_seqs && tile[1] >= 0 && tile[1] < tile[2] &&
                          tile[2] <= counts[tile[0]] * group && tile[2] - tile[1] <= chunk_attn_cpu::kRowsPerItem,
                      "prefill tile ", i, " (", tile[0], ", ", tile[1], ", ", tile[2], ") is not a range of at most ",
                      chunk_attn_cpu::kRowsPerItem, " rows of its sequence");
  const int num_threads = at::get_num_threads();
  const int64_t stride = chunk_attn_cpu::prefill_workspace_floats(chunk_size, head_dim);
  const int64_t partial_floats = num_partial_rows * num_heads * (head_dim + 2);
  check_scratch(scratch, partial_floats + stride * num_threads);

  auto out = at::empty_like(q);
  chunk_attn_cpu::PrefillParams p{};
  p.q = q.data_ptr();
  p.k_cache = k_cache.data_ptr();
  p.v_cache = v_cache.data_ptr();
  p.out = out.data_ptr();
  p.partial_o = scratch.data_ptr<float>();
  p.partial_m = p.partial_o + num_partial_rows * num_heads * head_dim;
  p.partial_n = p.partial_m + num_partial_rows * num_heads;
  p.num_partial_rows = num_partial_rows;
  p.workspace = scratch.data_ptr<float>() + partial_floats;
  p.workspace_stride = stride;
  p.seg_chunk = seg_chunk, p.seg_start = seg_start, p.seg_pos = seg_pos;
  p.q_start = starts, p.num_tokens = counts, p.token_start = rows_at;
  p.tiles = tiles, p.token_pos = token_pos, p.ctx_end = ctx_end;
  p.ctx_chunk = ctx_chunk, p.ctx_start = ctx_start, p.ctx_len = ctx_len, p.ctx_pos = ctx_pos;
  p.ctx_items = ctx_items, p.seq_ctx_ptr = ctx_ptr, p.seq_ctx_offset = ctx_offset;
  p.num_tiles = static_cast<int>(num_tiles);
  p.num_ctx_items = static_cast<int>(num_items);
  p.num_threads = num_threads;
  p.num_seqs = static_cast<int>(num_seqs);
  p.max_segments = static_cast<int>(width);
  p.num_heads = num_heads;
  p.num_kv_heads = num_kv_heads;
  p.head_dim = head_dim;
  p.chunk_size = chunk_size;
  p.dtype = q.scalar_type() == at::kBFloat16 ? chunk_attn_cpu::DType::kBFloat16 : chunk_attn_cpu::DType::kFloat32;
  p.scale = static_cast<float>(scale);
  p.window = static_cast<int>(window);
  variant.prefill(p);
  return out;
}

// y = x W^T (+ bias) for a few rows of x (linear_params.h): float32 CPU tensors, W an
// nn.Linear's weight in place.
at::Tensor small_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                        const std::string& isa) {
  const Variant& variant = variant_for(isa);
  TORCH_CHECK_TYPE(x.device().is_cpu() && weight.device().is_cpu() && x.scalar_type() == at::kFloat &&
                       weight.scalar_type() == at::kFloat,
                   "small_linear takes float32 CPU tensors, got x ", x.scalar_type(), " on ", x.device(), ", weight ",
                   weight.scalar_type(), " on ", weight.device());
  TORCH_CHECK_VALUE(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1) && x.is_contiguous() &&
                        weight.is_contiguous(),
                    "small_linear needs contiguous x [rows, in] and weight [out, in], got ", x.sizes(), " and ",
                    weight.sizes());
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias)
    TORCH_CHECK_VALUE(bias->device().is_cpu() && bias->scalar_type() == at::kFloat && bias->dim() == 1 &&
                          bias->size(0) == weight.size(0) && bias->is_contiguous(),
                      "small_linear's bias must be a contiguous float32 CPU vector of ", weight.size(0));
  auto y = at::empty({x.size(0), weight.size(0)}, x.options());
  chunk_attn_cpu::LinearParams p{x.data_ptr<float>(), weight.data_ptr<float>(),
                                 has_bias ? bias->data_ptr<float>() : nullptr, y.data_ptr<float>(), x.size(0),
                                 weight.size(0), x.size(1), at::get_num_threads()};
  variant.linear(p);
  return y;
}

int64_t prefill_scratch_floats(int64_t num_partial_rows, int64_t num_heads, int64_t chunk_size, int64_t head_dim,
                               int64_t num_threads) {
  return num_partial_rows * num_heads * (head_dim + 2) +
         chunk_attn_cpu::prefill_workspace_floats(chunk_size, head_dim) * num_threads;
}

int64_t scratch_floats(int64_t num_pairs, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                       int64_t head_dim, int64_t chunk_size, int64_t num_threads) {
  TORCH_CHECK_VALUE(num_kv_heads > 0 && num_heads % num_kv_heads == 0 && num_threads > 0,
                    "scratch_floats: bad geometry");
  return chunk_attn_cpu::scratch_floats(num_pairs, num_seqs, num_heads, num_kv_heads, head_dim, chunk_size,
                                        num_threads);
}

// The names of the plan arrays in layout order (the Python side checks its own against them).
std::vector<std::string> decode_layout() {
  return {std::begin(chunk_attn_cpu::kDecodeArrayNames), std::end(chunk_attn_cpu::kDecodeArrayNames)};
}
std::vector<std::string> prefill_layout() {
  return {std::begin(chunk_attn_cpu::kPrefillArrayNames), std::end(chunk_attn_cpu::kPrefillArrayNames)};
}

// Names of the variants in this build, best first.
std::vector<std::string> variants() {
  std::vector<std::string> names;
  for (const Variant& v : chunk_attn_cpu::kVariants) names.emplace_back(v.name);
  return names;
}

// Whether this CPU runs the variant (false for one not in this build).
bool host_runs(const std::string& isa) {
  const Variant* v = chunk_attn_cpu::find_variant(isa.c_str());
  return v != nullptr && v->host_runs();
}

}  // namespace

TORCH_LIBRARY(chunk_llama_cpu, m) {
  // One call convention for both attention ops: q, the layer's K/V pool, the step's plan
  // (one int64 tensor and its layout, plan_layout.h), the caller's scratch, then scalars.
  m.def("tpp_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor plan, int[] layout, Tensor(a!) scratch, "
        "float scale, int window, int max_chunks_per_item, str isa) -> Tensor",
        &tpp_decode);
  m.def("tpp_prefill(Tensor q, Tensor k_cache, Tensor v_cache, Tensor plan, int[] layout, Tensor(a!) scratch, "
        "float scale, int window, str isa) -> Tensor",
        &tpp_prefill);
  m.def("scratch_floats(int num_pairs, int num_seqs, int num_heads, int num_kv_heads, int head_dim, "
        "int chunk_size, int num_threads) -> int",
        &scratch_floats);
  m.def("prefill_scratch_floats(int num_partial_rows, int num_heads, int chunk_size, int head_dim, int num_threads) "
        "-> int",
        &prefill_scratch_floats);
  m.def("decode_layout() -> str[]", &decode_layout);
  m.def("prefill_layout() -> str[]", &prefill_layout);
  m.def("small_linear(Tensor x, Tensor weight, Tensor? bias, str isa) -> Tensor", &small_linear);
  m.def("variants() -> str[]", &variants);
  m.def("host_runs(str isa) -> bool", &host_runs);
}
