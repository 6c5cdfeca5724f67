// What a step's plan is checked for before any pointer into the pool or the scratch is made
// from it (once per step, when the plan is made: planned.cpp), and what each layer's call is
// checked for (its pool against the planned geometry: O(1)). A wrong chunk id, slot range,
// row, pair slot or partial offset would read or write out of bounds. Torch-free; compiled
// with baseline flags. Failed checks throw as chunk_llama/api_errors.h says.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "api_internal.h"
#include "chunk_llama/api_errors.h"
#include "plan_layout.h"

namespace chunk_llama_cpu_internal {
namespace {

using namespace chunk_attn_cpu;

void check_layout(int64_t layout_size, int expected, const char* what) {
  CHECK_VALUE(layout_size == expected, "the ", what, " layout has ", expected, " entries, got ", layout_size);
}

// The plan's array at layout[slot], of `count` entries, checked to lie inside the plan.
const int64_t* plan_array(const int64_t* plan, int64_t plan_numel, const int64_t* layout, int slot, int64_t count,
                          const char* name) {
  const int64_t offset = layout[slot];
  CHECK_VALUE(count >= 0 && offset >= 0 && offset <= plan_numel && count <= plan_numel - offset, "plan array ", name,
              " (", count, " entries from ", offset, ") is not inside the plan's ", plan_numel);
  return plan + offset;
}

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
    const int64_t next = i + 1 < width ? positions[i + 1] : kNoPosition;
    CHECK_VALUE(next > positions[i], what, " of sequence ", seq, ": positions must rise");
    check_segment(chunks[i], starts[i], std::min(next, length) - positions[i], capacity, chunk_size, what, i);
  }
}

}  // namespace

void check_dtype(int dtype, const char* what, bool pool) {
  if (dtype != CHUNK_LLAMA_FLOAT32 && dtype != CHUNK_LLAMA_BFLOAT16 && !(pool && dtype == CHUNK_LLAMA_CPU_FLOAT16))
    chunk_llama_api::fail(chunk_llama_api::kTypeError, "the CPU kernel supports float32 and bfloat16",
                          pool ? " and float16" : "", ", got ", what, "'s dtype code ", dtype);
}

DType kernel_dtype(int dtype) {
  return dtype == CHUNK_LLAMA_BFLOAT16 ? DType::kBFloat16 : dtype == CHUNK_LLAMA_CPU_FLOAT16 ? DType::kFloat16 : DType::kFloat32;
}

void check_window(int64_t window) {
  CHECK_VALUE(window >= 0 && window <= INT32_MAX, "window must be 0 (none) or a positive int32, got ", window);
}

Geometry check_geometry(const chunk_llama_cpu_plan_params& p) {
  CHECK_VALUE(p.num_kv_heads > 0 && p.num_heads % p.num_kv_heads == 0, "num_heads ", p.num_heads,
              " is not a multiple of num_kv_heads ", p.num_kv_heads);
  CHECK_VALUE(p.q_rows >= 0 && p.capacity >= 0 && p.q_rows <= INT32_MAX && p.num_heads <= INT32_MAX &&
                  p.capacity <= INT32_MAX,
              "q and the pool are too large for the CPU kernel");
  CHECK_VALUE(supports(static_cast<int>(p.chunk_size), static_cast<int>(p.head_dim)),
              "the CPU kernel supports chunk sizes that are multiples of 16 and head dims 32/64/80/96/128/256, "
              "got chunk_size ", p.chunk_size, ", head_dim ", p.head_dim);
  CHECK_VALUE(p.num_threads >= 1, "num_threads must be >= 1, got ", p.num_threads);
  return {p.q_rows, p.num_heads, p.head_dim, p.capacity, p.num_kv_heads, p.chunk_size};
}

void check_decode_plan(Params& p, int64_t capacity, const int64_t* plan, int64_t plan_numel, const int64_t* layout,
                       int64_t layout_size, std::vector<int64_t>& pair_seg, std::vector<int64_t>& reach) {
  const int num_seqs = p.num_seqs, chunk_size = p.chunk_size;
  check_layout(layout_size, kDecodeLayoutSize, "decode");
  const int64_t num_shared = layout[kDecodeNumShared], width = layout[kDecodeWidth];
  CHECK_VALUE(layout[kDecodeNumSeqs] == num_seqs && num_shared >= 0 && num_shared <= INT32_MAX && width >= 1 &&
                  width <= INT32_MAX,
              "the decode plan is for ", layout[kDecodeNumSeqs], " sequences (", num_shared, " shared segments, width ",
              width, "), q has ", num_seqs);
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
  CHECK_VALUE(pair_ptr[0] == 0, "seq_pair_ptr must start at 0");
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
  reach.assign(num_seqs, 0);
  pair_segments_into(p, pair_seg);
  for (int64_t row = 0; row < num_seqs; ++row) {
    for (int64_t k = pair_ptr[row]; k < pair_ptr[row + 1]; ++k) {
      CHECK_VALUE(pair_seg[k] >= 0 && p.shared_pos[pair_seg[k]] == reach[row], "sequence ", row,
                  ": its shared segments do not run in order from position 0");
      reach[row] += p.shared_len[pair_seg[k]];
    }
    CHECK_VALUE(reach[row] == p.num_shared_tokens[row], "sequence ", row, ": its shared segments end at ", reach[row],
                ", not at its ", p.num_shared_tokens[row], " shared tokens");
  }
}

void check_prefill_plan(PrefillParams& p, const Geometry& g, const int64_t* plan, int64_t plan_numel,
                        const int64_t* layout, int64_t layout_size) {
  const int64_t num_q_tokens = g.q_rows, group = g.num_heads / g.num_kv_heads;
  check_layout(layout_size, kPrefillLayoutSize, "prefill");
  const int64_t num_seqs = layout[kPrefillNumSeqs], width = layout[kPrefillWidth], num_tiles = layout[kNumTiles];
  const int64_t num_items = layout[kNumCtxItems], num_levels = layout[kNumCtxLevels];
  const int64_t num_partial_rows = layout[kNumPartialRows];
  CHECK_VALUE(num_seqs >= 0 && num_seqs <= INT32_MAX && width >= 1 && width <= INT32_MAX && num_tiles >= 0 &&
                  num_tiles <= INT32_MAX && num_items >= 0 && num_items <= INT32_MAX && num_levels >= 0 &&
                  num_levels <= INT32_MAX && num_partial_rows >= 0 && layout[kNumQTokens] == num_q_tokens,
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
    CHECK_VALUE(starts[s] >= 0 && counts[s] >= 0 && rows_at[s] >= 0 && counts[s] <= num_q_tokens &&
                    rows_at[s] <= num_q_tokens - counts[s],
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
                   g.capacity, g.chunk_size, "prefill segment", s);
  }
  CHECK_VALUE(ctx_levels[0] == 0 && ctx_levels[num_levels] == num_items, "ctx_levels must run from 0 to the ",
              num_items, " context items");
  for (int64_t l = 0; l < num_levels; ++l)
    CHECK_VALUE(ctx_levels[l] <= ctx_levels[l + 1], "ctx_levels must not fall");
  const int64_t* item = ctx_items;
  for (int64_t i = 0; i < num_items; ++i, item += 7) {
    CHECK_VALUE(item[0] >= 0 && item[0] < num_seqs && item[1] >= 0 && item[1] < item[2] && item[3] >= 0 &&
                    item[3] < item[4] && item[4] <= num_q_tokens * group && item[4] - item[3] <= kRowsPerItem,
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
  p.seg_chunk = seg_chunk, p.seg_start = seg_start, p.seg_pos = seg_pos;
  p.q_start = starts, p.num_tokens = counts, p.token_start = rows_at;
  p.tiles = tiles, p.token_pos = token_pos, p.ctx_end = ctx_end;
  p.ctx_items = ctx_items, p.ctx_levels = ctx_levels, p.seq_ctx_ptr = ctx_ptr, p.seq_ctx_offset = ctx_offset;
  p.num_partial_rows = num_partial_rows;
  p.num_tiles = static_cast<int>(num_tiles);
  p.num_ctx_items = static_cast<int>(num_items);
  p.num_ctx_levels = static_cast<int>(num_levels);
  p.num_seqs = static_cast<int>(num_seqs);
  p.max_segments = static_cast<int>(width);
}

void check_writes(const int64_t* token, const int64_t* chunk, const int64_t* offset, int64_t num_writes,
                  const Geometry& g) {
  for (int64_t i = 0; i < num_writes; ++i)
    CHECK_VALUE(token[i] >= 0 && token[i] < g.q_rows && chunk[i] >= 0 && chunk[i] < g.capacity && offset[i] >= 0 &&
                    offset[i] < g.chunk_size,
                "write ", i, " (token ", token[i], " to chunk ", chunk[i], " slot ", offset[i], ") is not inside ",
                g.q_rows, " rows and the pool of ", g.capacity, " chunks of ", g.chunk_size);
}

void check_row_order(const int64_t* row_order, int64_t rows) {
  for (int64_t i = 0; i < rows; ++i)
    CHECK_VALUE(row_order[i] >= 0 && row_order[i] < rows, "row_order[", i, "] = ", row_order[i], " is not a row of ",
                rows);
}

void check_kv(const chunk_llama_cpu_kv& kv, const Geometry& g) {
  CHECK_VALUE(kv.capacity == g.capacity && kv.num_kv_heads == g.num_kv_heads && kv.chunk_size == g.chunk_size &&
                  kv.head_dim == g.head_dim,
              "the layer's pool [", kv.capacity, ", ", kv.num_kv_heads, ", ", kv.chunk_size, ", ", kv.head_dim,
              "] is not the pool the plan was checked against [", g.capacity, ", ", g.num_kv_heads, ", ",
              g.chunk_size, ", ", g.head_dim, "]");
  CHECK_VALUE(kv.k != nullptr && kv.v != nullptr, "the layer's K/V pool has no memory");
  check_dtype(kv.dtype, "the pool", true);
  // Score tiles read up to kGuardRows K/V rows past a segment that ends inside a chunk.
  const int64_t needed = g.capacity * g.num_kv_heads * g.chunk_size * g.head_dim + kGuardRows * g.head_dim;
  CHECK_VALUE(kv.k_extent >= needed && kv.v_extent >= needed, "k_cache and v_cache need ", kGuardRows,
              " rows of memory behind their last chunk (a ChunkPool's K/V have a guard chunk)");
  check_window(kv.window);
}

}  // namespace chunk_llama_cpu_internal
