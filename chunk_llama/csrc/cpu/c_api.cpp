// The C interface of the CPU kernels (c_api.h): checks, scratch layout, the phase-1
// schedule and the choice of variant. Torch-free, so the library it makes does not depend
// on any torch release's C++ ABI and needs no torch headers to build; compiled with
// baseline flags (each kernel_<isa>.cpp raises its own target). Failed checks are reported
// as chunk_llama/api_errors.h says.
#include "c_api.h"
#include "api_internal.h"

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <string>
#include <vector>

#include "chunk_llama/api_errors.h"
#include "linear_params.h"
#include "params.h"
#include "plan_layout.h"
#include "prefill_params.h"
#include "quant_params.h"
#include "schedule.h"
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

// A plan reaches an op as one int64 array and its layout (plan_layout.h).
void check_layout(int64_t layout_size, int expected, const char* what) {
  CHECK_VALUE(layout_size == expected, "the ", what, " layout has ", expected, " entries, got ", layout_size);
}

// The plan's array at layout[slot], of `count` entries, checked to lie inside the plan.
const int64_t* plan_array(const int64_t* plan, int64_t plan_numel, const int64_t* layout, int slot, int64_t count,
                          const char* name) {
  const int64_t offset = layout[slot];
  CHECK_VALUE(count >= 0 && offset >= 0 && offset + count <= plan_numel, "plan array ", name, " (", count,
              " entries from ", offset, ") is not inside the plan's ", plan_numel);
  return plan + offset;
}

// The caller keeps the scratch between calls: fresh pages for every step would cost a
// page fault per 4 KiB, more than the attention itself.
void check_scratch(int64_t scratch_numel, int64_t needed) {
  CHECK_VALUE(scratch_numel >= needed, "scratch must be a contiguous float32 CPU tensor of at least ", needed,
              " elements, got ", scratch_numel);
}

// A plan's segment, checked before any pointer into the pool is made from it: a wrong
// chunk id or slot range would read out of bounds.
void check_segment(int64_t chunk, int64_t start, int64_t count, int64_t capacity, int64_t chunk_size,
                   const char* what, int64_t index) {
  CHECK_VALUE(chunk >= 0 && chunk < capacity && start >= 0 && count >= 1 && start + count <= chunk_size, what, " ",
              index, ": chunk ", chunk, ", slots ", start, " + ", count, " are not inside the pool of ", capacity,
              " chunks of ", chunk_size);
}

// Walks a sequence's segments (chunk, first slot, position of the first key; a segment
// ends at the next one's position) up to position `length`, checking each.
void check_segments(const int64_t* chunks, const int64_t* starts, const int64_t* positions, int64_t width,
                    int64_t from, int64_t length, int64_t capacity, int64_t chunk_size, const char* what,
                    int64_t seq) {
  CHECK_VALUE(from >= length || (width > 0 && positions[0] == from), what, " of sequence ", seq,
              " must start at position ", from);
  for (int64_t i = 0; i < width && positions[i] < length; ++i) {
    const int64_t next = i + 1 < width ? positions[i + 1] : chunk_attn_cpu::kNoPosition;
    CHECK_VALUE(next > positions[i], what, " of sequence ", seq, ": positions must rise");
    check_segment(chunks[i], starts[i], std::min(next, length) - positions[i], capacity, chunk_size, what, i);
  }
}

void check_window(int64_t window) {
  CHECK_VALUE(window >= 0 && window <= INT32_MAX, "window must be 0 (none) or a positive int32, got ", window);
}

void check_dtype(int dtype, const char* what) {
  if (dtype != CHUNK_LLAMA_FLOAT32 && dtype != CHUNK_LLAMA_BFLOAT16)
    fail(chunk_llama_api::kTypeError, "the CPU kernel supports float32 and bfloat16, got ", what, "'s dtype code ",
         dtype);
}

Geometry check_geometry(int64_t q_rows, int64_t num_heads, int64_t head_dim, int64_t capacity, int64_t num_kv_heads,
                        int64_t chunk_size, int64_t kv_head_dim, int64_t k_extent, int64_t v_extent, int dtype) {
  CHECK_VALUE(kv_head_dim == head_dim, "head_dim of q (", head_dim, ") and cache (", kv_head_dim, ") differ");
  CHECK_VALUE(num_kv_heads > 0 && num_heads % num_kv_heads == 0, "num_heads ", num_heads,
              " is not a multiple of num_kv_heads ", num_kv_heads);
  CHECK_VALUE(q_rows >= 0 && capacity >= 0 && q_rows <= INT32_MAX && num_heads <= INT32_MAX,
              "q and the pool are too large for the CPU kernel");
  CHECK_VALUE(chunk_attn_cpu::supports(static_cast<int>(chunk_size), static_cast<int>(head_dim)),
              "the CPU kernel supports chunk sizes that are multiples of 16 and head dims 32/64/80/96/128/256, "
              "got chunk_size ", chunk_size, ", head_dim ", head_dim);
  check_dtype(dtype, "the pool");
  // Score tiles read up to kGuardRows K/V rows past a segment that ends inside a chunk.
  const int64_t needed = capacity * num_kv_heads * chunk_size * head_dim + chunk_attn_cpu::kGuardRows * head_dim;
  CHECK_VALUE(k_extent >= needed && v_extent >= needed, "k_cache and v_cache need ", chunk_attn_cpu::kGuardRows,
              " rows of memory behind their last chunk (a ChunkPool's K/V have a guard chunk)");
  return {q_rows, num_heads, head_dim, capacity, num_kv_heads, chunk_size};
}

chunk_attn_cpu::DType kernel_dtype(int dtype) {
  return dtype == CHUNK_LLAMA_BFLOAT16 ? chunk_attn_cpu::DType::kBFloat16 : chunk_attn_cpu::DType::kFloat32;
}

// The decode plan's arrays in p (geometry set), each checked before any pointer into the pool
// or the scratch is made from it: a wrong chunk id, slot range or pair slot would reach out
// of bounds. Returns the plan's pair_segments (checked: what decode_schedule takes).
std::vector<int64_t> decode_plan(chunk_attn_cpu::Params& p, int64_t capacity, const int64_t* plan, int64_t plan_numel,
                 const int64_t* layout, int64_t layout_size) {
  using namespace chunk_attn_cpu;
  const int num_seqs = p.num_seqs, chunk_size = p.chunk_size;
  check_layout(layout_size, kDecodeLayoutSize, "decode");
  const int64_t num_shared = layout[kDecodeNumShared], width = layout[kDecodeWidth];
  CHECK_VALUE(layout[kDecodeNumSeqs] == num_seqs && num_shared >= 0 && width >= 1, "the decode plan is for ",
              layout[kDecodeNumSeqs], " sequences (", num_shared, " shared segments, width ", width, "), q has ",
              num_seqs);
  // each array's extent inside the plan, before any pointer is made from it
  const auto array = [&](int slot, int64_t count) {
    return plan_array(plan, plan_numel, layout, slot, count, kDecodeArrayNames[slot - kDecodeCounts]);
  };
  p.shared_chunk_ids = array(kSharedChunkIds, num_shared), p.shared_start = array(kSharedStart, num_shared);
  p.shared_len = array(kSharedLen, num_shared), p.shared_pos = array(kSharedPos, num_shared);
  p.shared_begin = array(kSharedBegin, num_shared), p.shared_end = array(kSharedEnd, num_shared);
  p.shared_depth = array(kSharedDepth, num_shared);
  p.private_chunk_ids = array(kPrivateChunkIds, num_seqs * width), p.private_start = array(kPrivateStart, num_seqs * width);
  p.private_pos = array(kPrivatePos, num_seqs * width);
  p.num_shared_tokens = array(kNumSharedTokens, num_seqs), p.seq_lens = array(kSeqLens, num_seqs);
  p.seq_pair_ptr = array(kSeqPairPtr, num_seqs + 1);
  p.num_shared = static_cast<int>(num_shared);
  p.max_private = static_cast<int>(width);
  const int64_t* pair_ptr = p.seq_pair_ptr;
  for (int64_t i = 0; i < num_seqs; ++i) {
    CHECK_VALUE(pair_ptr[i] >= 0 && pair_ptr[i] <= pair_ptr[i + 1] && p.seq_lens[i] >= 1 &&
                    p.num_shared_tokens[i] >= 0 && p.num_shared_tokens[i] <= p.seq_lens[i],
                "sequence ", i, ": bad pair range, length or shared tokens");
    check_segments(p.private_chunk_ids + i * width, p.private_start + i * width, p.private_pos + i * width, width,
                   p.num_shared_tokens[i], p.seq_lens[i], capacity, chunk_size, "private segment", i);
  }
  for (int64_t s = 0; s < num_shared; ++s) {
    const int64_t begin = p.shared_begin[s], end = p.shared_end[s], depth = p.shared_depth[s];
    check_segment(p.shared_chunk_ids[s], p.shared_start[s], p.shared_len[s], capacity, chunk_size, "shared segment", s);
    CHECK_VALUE(0 <= begin && begin < end && end <= num_seqs && depth >= 0 && p.shared_pos[s] >= 0, "shared segment ",
                s, ": rows ", begin, " .. ", end, " at depth ", depth, " do not fit ", num_seqs, " sequences");
    for (int64_t row = begin; row < end; ++row)
      CHECK_VALUE(pair_ptr[row] + depth < pair_ptr[row + 1] && p.shared_pos[s] + p.shared_len[s] <=
                      p.num_shared_tokens[row],
                  "shared segment ", s, " at depth ", depth, " has no partial slot for sequence ", row,
                  " or lies past its shared tokens");
  }
  // each sequence's shared segments, by depth, run from position 0 to its shared tokens
  std::vector<int64_t> reach(num_seqs, 0);
  const std::vector<int64_t> at = pair_segments(p);
  for (int64_t row = 0; row < num_seqs; ++row) {
    for (int64_t k = pair_ptr[row]; k < pair_ptr[row + 1]; ++k) {
      CHECK_VALUE(at[k] >= 0 && p.shared_pos[at[k]] == reach[row], "sequence ", row,
                  ": its shared segments do not run in order from position 0");
      reach[row] += p.shared_len[at[k]];
    }
    CHECK_VALUE(reach[row] == p.num_shared_tokens[row], "sequence ", row, ": its shared segments end at ", reach[row],
                ", not at its ", p.num_shared_tokens[row], " shared tokens");
  }
  return at;
}

chunk_attn_cpu::Params decode_geometry(const Geometry& g, int num_threads, double scale, int64_t window) {
  chunk_attn_cpu::Params p{};
  check_window(window);
  CHECK_VALUE(num_threads >= 1, "num_threads must be >= 1, got ", num_threads);
  p.num_seqs = static_cast<int>(g.q_rows);
  p.num_heads = static_cast<int>(g.num_heads);
  p.num_kv_heads = static_cast<int>(g.num_kv_heads);
  p.head_dim = static_cast<int>(g.head_dim);
  p.chunk_size = static_cast<int>(g.chunk_size);
  p.num_threads = num_threads;
  p.scale = static_cast<float>(scale);
  p.window = static_cast<int>(window);
  return p;
}

void tpp_decode(const void* q, int q_dtype, const void* k_cache, const void* v_cache, const Geometry& g, int dtype,
                void* out, const int64_t* plan, int64_t plan_numel, const int64_t* layout, int64_t layout_size,
                float* scratch, int64_t scratch_numel, double scale, int64_t window, int64_t max_blocks_per_item,
                const char* isa, int num_threads) {
  using namespace chunk_attn_cpu;
  const Variant& variant = variant_for(isa);
  Params p = decode_geometry(g, num_threads, scale, window);
  const std::vector<int64_t> pair_seg = decode_plan(p, g.capacity, plan, plan_numel, layout, layout_size);
  CHECK_VALUE(max_blocks_per_item >= 0, "max_blocks_per_item must be >= 0 (0: chosen), got ", max_blocks_per_item);
  const DecodeSchedule schedule =
      decode_schedule(p, pair_seg, static_cast<int>(std::min<int64_t>(max_blocks_per_item, 1 << 30)));
  check_scratch(scratch_numel, schedule.scratch_floats(p, num_threads));
  p.q = q;
  p.k_cache = k_cache;
  p.v_cache = v_cache;
  p.out = out;
  p.dtype = kernel_dtype(dtype);
  p.q_dtype = kernel_dtype(q_dtype);
  schedule.carve(p, scratch);
  variant.run(p);
}

int64_t decode_scratch_floats(const Geometry& g, const int64_t* plan, int64_t plan_numel, const int64_t* layout,
                              int64_t layout_size, int num_threads) {
  chunk_attn_cpu::Params p = decode_geometry(g, num_threads, 1.0, 0);
  const std::vector<int64_t> pair_seg = decode_plan(p, g.capacity, plan, plan_numel, layout, layout_size);
  return chunk_attn_cpu::decode_schedule(p, pair_seg, 0).scratch_floats(p, num_threads);
}

// Prefill attention of every sequence of a step (prefill_params.h has the layout). The
// per-step metadata (segment tables, context items, tiles) comes from
// chunk_llama/step/prefill_schedule.py, built once per forward; it is checked here before any
// pointer into the pool or the scratch is made from it, since a wrong chunk id, slot,
// row or partial offset would reach out of bounds.
void tpp_prefill(const void* q, int q_dtype, const void* k_cache, const void* v_cache, const Geometry& g, int dtype,
                 void* out, const int64_t* plan, int64_t plan_numel, const int64_t* layout, int64_t layout_size,
                 float* scratch, int64_t scratch_numel, double scale, int64_t window, const char* isa,
                 int num_threads) {
  using namespace chunk_attn_cpu;
  const Variant& variant = variant_for(isa);
  check_window(window);
  const int num_q_tokens = static_cast<int>(g.q_rows), num_heads = static_cast<int>(g.num_heads);
  const int head_dim = static_cast<int>(g.head_dim), num_kv_heads = static_cast<int>(g.num_kv_heads);
  const int capacity = static_cast<int>(g.capacity), chunk_size = static_cast<int>(g.chunk_size);
  const int group = num_heads / num_kv_heads;
  check_layout(layout_size, kPrefillLayoutSize, "prefill");
  const int64_t num_seqs = layout[kPrefillNumSeqs], width = layout[kPrefillWidth], num_tiles = layout[kNumTiles];
  const int64_t num_items = layout[kNumCtxItems], num_levels = layout[kNumCtxLevels];
  const int64_t num_partial_rows = layout[kNumPartialRows];
  CHECK_VALUE(num_seqs >= 0 && width >= 1 && num_tiles >= 0 && num_items >= 0 && num_levels >= 0 &&
                  num_partial_rows >= 0 &&
                  layout[kNumQTokens] == num_q_tokens,
              "the prefill plan (", num_seqs, " sequences, ", layout[kNumQTokens], " query tokens) does not ",
              "match q's ", num_q_tokens, " rows");
  const auto array = [&](int slot, int64_t count) {
    return plan_array(plan, plan_numel, layout, slot, count, kPrefillArrayNames[slot - kPrefillCounts]);
  };
  const int64_t *seg_chunk = array(kSegChunk, num_seqs * width), *seg_start = array(kSegStart, num_seqs * width),
                *seg_pos = array(kSegPos, num_seqs * width), *starts = array(kQStart, num_seqs),
                *counts = array(kNumTokens, num_seqs), *rows_at = array(kTokenStart, num_seqs),
                *tiles = array(kTiles, num_tiles * 3), *token_pos = array(kTokenPos, num_q_tokens),
                *ctx_end = array(kCtxEnd, num_seqs), *ctx_items = array(kCtxItems, num_items * 7),
                *ctx_levels = array(kCtxLevels, num_levels + 1), *ctx_ptr = array(kSeqCtxPtr, num_seqs + 1);
  const int64_t* ctx_offset = array(kSeqCtxOffset, ctx_ptr[num_seqs]);
  CHECK_VALUE(ctx_ptr[0] == 0, "seq_ctx_ptr must index seq_ctx_offset from 0");
  // a partial row's whole range of tokens [first, last] inside the partials
  const auto check_partials = [&](int64_t offset, int64_t first, int64_t last, const char* what, int64_t i) {
    CHECK_VALUE(offset + first >= 0 && offset + last < num_partial_rows, what, " ", i, ": partial rows ",
                offset + first, " .. ", offset + last, " outside the ", num_partial_rows, " partials");
  };
  for (int64_t s = 0; s < num_seqs; ++s) {
    CHECK_VALUE(starts[s] >= 0 && counts[s] >= 0 && rows_at[s] >= 0 && rows_at[s] + counts[s] <= num_q_tokens,
                "prefill sequence ", s, ": tokens ", rows_at[s], " + ", counts[s], " outside q's ", num_q_tokens);
    CHECK_VALUE(ctx_end[s] >= 0 && ctx_end[s] <= starts[s] && ctx_end[s] % kBlockKeys == 0, "prefill sequence ", s,
                ": context end ", ctx_end[s], " is past its first new token at ", starts[s], " or not a multiple of ",
                kBlockKeys);
    CHECK_VALUE(ctx_ptr[s] <= ctx_ptr[s + 1] && ctx_ptr[s + 1] - ctx_ptr[s] == (ctx_end[s] > 0 ? 1 : 0),
                "prefill sequence ", s, " must have one context state where its context end is past 0, else none");
    for (int64_t c = ctx_ptr[s]; c < ctx_ptr[s + 1] && counts[s] > 0; ++c)
      check_partials(ctx_offset[c], rows_at[s], rows_at[s] + counts[s] - 1, "prefill sequence", s);
    // from position 0, each segment to the next one's position: every position up to the
    // last query's, each inside its chunk
    check_segments(seg_chunk + s * width, seg_start + s * width, seg_pos + s * width, width, 0, starts[s] + counts[s],
                   capacity, chunk_size, "prefill segment", s);
  }
  CHECK_VALUE(ctx_levels[0] == 0 && ctx_levels[num_levels] == num_items, "ctx_levels must run from 0 to the ",
              num_items, " context items");
  for (int64_t l = 0; l < num_levels; ++l)
    CHECK_VALUE(ctx_levels[l] <= ctx_levels[l + 1], "ctx_levels must not fall");
  const int64_t* item = ctx_items;
  for (int64_t i = 0; i < num_items; ++i, item += 7) {
    CHECK_VALUE(item[0] >= 0 && item[0] < num_seqs && item[1] >= 0 && item[1] < item[2] && item[3] >= 0 &&
                    item[3] < item[4] && item[4] <= int64_t{num_q_tokens} * group && item[4] - item[3] <= kRowsPerItem,
                "context item ", i, " is not a run of blocks and at most ", kRowsPerItem, " query rows");
    // its keys inside its sequence's path before that sequence's new tokens (checked above)
    CHECK_VALUE(item[2] * kBlockKeys <= starts[item[0]], "context item ", i, ": blocks up to ", item[2],
                " reach past its sequence's first new token at ", starts[item[0]]);
    check_partials(item[5], item[3] / group, (item[4] - 1) / group, "context item", i);
    if (item[6] != kNoState) check_partials(item[6], item[3] / group, (item[4] - 1) / group, "context item", i);
  }
  const int64_t* tile = tiles;
  for (int64_t i = 0; i < num_tiles; ++i, tile += 3)
    CHECK_VALUE(tile[0] >= 0 && tile[0] < num_seqs && tile[1] >= 0 && tile[1] < tile[2] &&
                    tile[2] <= counts[tile[0]] * group && tile[2] - tile[1] <= kRowsPerItem,
                "prefill tile ", i, " (", tile[0], ", ", tile[1], ", ", tile[2], ") is not a range of at most ",
                kRowsPerItem, " rows of its sequence");
  CHECK_VALUE(num_threads >= 1, "num_threads must be >= 1, got ", num_threads);
  const int64_t stride = prefill_workspace_floats(head_dim);
  const int64_t partial_floats = num_partial_rows * num_heads * (head_dim + 2);
  check_scratch(scratch_numel, partial_floats + stride * num_threads);

  PrefillParams p{};
  p.q = q;
  p.k_cache = k_cache;
  p.v_cache = v_cache;
  p.out = out;
  p.partial_o = scratch;
  p.partial_m = p.partial_o + num_partial_rows * num_heads * head_dim;
  p.partial_n = p.partial_m + num_partial_rows * num_heads;
  p.num_partial_rows = num_partial_rows;
  p.workspace = scratch + partial_floats;
  p.workspace_stride = stride;
  p.seg_chunk = seg_chunk, p.seg_start = seg_start, p.seg_pos = seg_pos;
  p.q_start = starts, p.num_tokens = counts, p.token_start = rows_at;
  p.tiles = tiles, p.token_pos = token_pos, p.ctx_end = ctx_end;
  p.ctx_items = ctx_items, p.ctx_levels = ctx_levels, p.seq_ctx_ptr = ctx_ptr, p.seq_ctx_offset = ctx_offset;
  p.num_tiles = static_cast<int>(num_tiles);
  p.num_ctx_items = static_cast<int>(num_items);
  p.num_ctx_levels = static_cast<int>(num_levels);
  p.num_threads = num_threads;
  p.num_seqs = static_cast<int>(num_seqs);
  p.max_segments = static_cast<int>(width);
  p.num_heads = num_heads;
  p.num_kv_heads = num_kv_heads;
  p.head_dim = head_dim;
  p.chunk_size = chunk_size;
  p.dtype = kernel_dtype(dtype);
  p.q_dtype = kernel_dtype(q_dtype);
  p.scale = static_cast<float>(scale);
  p.window = static_cast<int>(window);
  variant.prefill(p);
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

int64_t chunk_llama_cpu_decode_scratch_floats(int64_t q_rows, int64_t num_heads, int64_t head_dim,
                                              int64_t num_kv_heads, int64_t chunk_size, const int64_t* plan,
                                              int64_t plan_numel, const int64_t* layout, int64_t layout_size,
                                              int64_t num_threads) {
  int64_t floats = -1;
  guarded([&] {
    CHECK_VALUE(num_threads >= 1 && num_threads <= INT32_MAX, "decode_scratch_floats: bad thread count ", num_threads);
    CHECK_VALUE(q_rows >= 0 && q_rows <= INT32_MAX && num_kv_heads > 0 && num_heads % num_kv_heads == 0 &&
                    chunk_attn_cpu::supports(static_cast<int>(chunk_size), static_cast<int>(head_dim)),
                "decode_scratch_floats: bad geometry");
    // (no pool here: the call checks the plan's chunks against its pool; sizing reads the plan only)
    const Geometry g{q_rows, num_heads, head_dim, INT64_MAX, num_kv_heads, chunk_size};
    floats = decode_scratch_floats(g, plan, plan_numel, layout, layout_size, static_cast<int>(num_threads));
  });
  return floats;
}

int64_t chunk_llama_cpu_prefill_scratch_floats(int64_t num_partial_rows, int64_t num_heads, int64_t head_dim,
                                               int64_t num_threads) {
  return num_partial_rows * num_heads * (head_dim + 2) +
         chunk_attn_cpu::prefill_workspace_floats(static_cast<int>(head_dim)) * num_threads;
}

int chunk_llama_cpu_tpp_decode(const void* q, int64_t q_rows, int64_t num_heads, int64_t head_dim, int q_dtype,
                               const void* k_cache, const void* v_cache, int64_t capacity, int64_t num_kv_heads,
                               int64_t chunk_size, int64_t kv_head_dim, int64_t k_extent, int64_t v_extent, int dtype,
                               void* out, const int64_t* plan, int64_t plan_numel, const int64_t* layout,
                               int64_t layout_size, float* scratch, int64_t scratch_numel, double scale,
                               int64_t window, int64_t max_blocks_per_item, const char* isa, int num_threads) {
  return guarded([&] {
    const Geometry g = check_geometry(q_rows, num_heads, head_dim, capacity, num_kv_heads, chunk_size, kv_head_dim,
                                      k_extent, v_extent, dtype);
    check_dtype(q_dtype, "q");
    tpp_decode(q, q_dtype, k_cache, v_cache, g, dtype, out, plan, plan_numel, layout, layout_size, scratch,
               scratch_numel, scale, window, max_blocks_per_item, isa, num_threads);
  });
}

int chunk_llama_cpu_tpp_prefill(const void* q, int64_t q_rows, int64_t num_heads, int64_t head_dim, int q_dtype,
                                const void* k_cache, const void* v_cache, int64_t capacity, int64_t num_kv_heads,
                                int64_t chunk_size, int64_t kv_head_dim, int64_t k_extent, int64_t v_extent,
                                int dtype, void* out, const int64_t* plan, int64_t plan_numel, const int64_t* layout,
                                int64_t layout_size, float* scratch, int64_t scratch_numel, double scale,
                                int64_t window, const char* isa, int num_threads) {
  return guarded([&] {
    const Geometry g = check_geometry(q_rows, num_heads, head_dim, capacity, num_kv_heads, chunk_size, kv_head_dim,
                                      k_extent, v_extent, dtype);
    check_dtype(q_dtype, "q");
    tpp_prefill(q, q_dtype, k_cache, v_cache, g, dtype, out, plan, plan_numel, layout, layout_size, scratch,
                scratch_numel, scale, window, isa, num_threads);
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
  const chunk_attn_cpu::QuantFormat f = chunk_attn_cpu::quant_format(type);
  CHECK_VALUE(f.block_elems > 0, op, ": GGML type ", type, " is not one the kernels decode (F16, Q4_0, Q4_1, Q5_0, Q5_1, "
              "Q8_0, Q4_K, Q5_K, Q6_K, BF16)");
  CHECK_VALUE(in_features > 0 && in_features % f.block_elems == 0, op, ": ", in_features,
              " weights a row is not a whole number of blocks of ", f.block_elems);
  return in_features / f.block_elems * f.block_bytes;
}

}  // namespace chunk_llama_cpu_internal

extern "C" {

int64_t chunk_llama_cpu_quant_row_bytes(int type, int64_t in_features) {
  int64_t bytes = -1;
  if (guarded([&] { bytes = row_bytes_of("quant_row_bytes", type, in_features); }) != CHUNK_LLAMA_OK) return -1;
  return bytes;
}

int chunk_llama_cpu_quant_linear(const float* x, int64_t rows, int64_t in_features, const uint8_t* weight,
                                 int64_t weight_bytes, int type, int64_t out_features, const float* bias, float* y,
                                 const char* isa, int num_threads) {
  return guarded([&] {
    const Variant& variant = variant_for(isa);
    CHECK_VALUE(rows >= 0 && out_features >= 0 && num_threads >= 1, "quant_linear: bad sizes (", rows, " rows, ",
                out_features, " out)");
    const int64_t row_bytes = row_bytes_of("quant_linear", type, in_features);
    CHECK_VALUE(weight_bytes == row_bytes * out_features, "quant_linear: the weight holds ", weight_bytes,
                " bytes, not ", out_features, " rows of ", row_bytes);
    std::vector<float> scratch(static_cast<size_t>(chunk_attn_cpu::quant_scratch_floats(rows, in_features)) * num_threads);
    variant.quant_linear(chunk_attn_cpu::QuantLinearParams{x, weight, type, bias, y, rows, out_features, in_features,
                                                           num_threads, scratch.data()});
  });
}

int chunk_llama_cpu_dequantize(const uint8_t* weight, int64_t weight_bytes, int type, int64_t num_rows,
                               int64_t in_features, float* out, const char* isa, int num_threads) {
  return guarded([&] {
    const Variant& variant = variant_for(isa);
    CHECK_VALUE(num_rows >= 0 && num_threads >= 1, "dequantize: bad sizes (", num_rows, " rows)");
    const int64_t row_bytes = row_bytes_of("dequantize", type, in_features);
    CHECK_VALUE(weight_bytes == row_bytes * num_rows, "dequantize: the weight holds ", weight_bytes, " bytes, not ",
                num_rows, " rows of ", row_bytes);
    variant.dequantize(chunk_attn_cpu::DequantizeParams{weight, type, out, num_rows, in_features, num_threads});
  });
}

}  // extern "C"
