// Prefill attention of the CPU kernel, free of torch and of any instruction set: the
// parameters, the per-thread workspace and the entry point of each variant. Included
// like params.h (by the glue, every variant's translation unit before its target
// pragma, and the test driver); functions here are `static inline` for the same reason.
//
// One call covers every sequence prefilled in a forward step ("packed"): sequence s
// has num_tokens[s] new query tokens at rows token_start[s] .. of q and out, at
// positions q_start[s] .. of the sequence, whose K/V (cached prefix and new tokens
// alike) are already in the pool, in the segments of seg_chunk[s] (as params.h). A
// query row is r = token * group + g over the flattened tokens (the GQA group's heads
// of one token are consecutive rows of one KV head).
//
// Context items (the chunk-first phase of prefill, chunk_llama/step/prefill_schedule.py):
// where several sequences' new tokens all see the same blocks of keys (blocks.h) whole
// (their common prefix, cached or written by one of them in this forward), one item = (a
// sequence whose path holds them, blocks [first, end), up to kRowsPerItem rows of those
// sequences' tokens, which are contiguous, the partial offset of the rows' states, the
// partial offset of the states they start from or kNoState, KV head) folds those blocks into each
// row's state (o, m, n) at row (partial offset + token) of partial_*. Items come in levels
// (ctx_levels): a level's items start from the states of an earlier level's (a wider group
// of sequences that shares a shorter prefix), so each row folds its blocks in order. A tile
// = (up to kRowsPerItem rows of one sequence, KV head) starts from its sequence's last state
// (seq_ctx_*: none, or one) and folds its blocks from ctx_end[s] on.
#pragma once

#include <cstdint>

#include "params.h"

namespace chunk_attn_cpu {

// A context item that starts from nothing (partial offsets may be negative: offset + token).
constexpr int64_t kNoState = -(int64_t{1} << 62);  // chunk_llama.step.prefill_schedule.NO_STATE

struct PrefillParams {
  const void* q;        // [num_q_tokens, num_heads, head_dim]
  const void* k_cache;  // [capacity, num_kv_heads, chunk_size, head_dim]
  const void* v_cache;
  void* out;            // [num_q_tokens, num_heads, head_dim]; rows of no sequence untouched
  float* workspace;     // [num_threads, workspace_stride]
  const int64_t* seg_chunk;    // [num_seqs, max_segments] each sequence's segments in order:
  const int64_t* seg_start;    //   chunk, first slot, position of the first key; a segment
  const int64_t* seg_pos;      //   ends at the next one's position (kNoPosition: unused)
  const int64_t* q_start;      // [num_seqs] position of the first new token
  const int64_t* num_tokens;   // [num_seqs]
  const int64_t* token_start;  // [num_seqs] its row in q and out
  const int64_t* tiles;        // [num_tiles, 3] (seq, row_begin, row_end), most work first
  const int64_t* token_pos;    // [num_q_tokens] each query token's position in its sequence
  const int64_t* ctx_end;      // [num_seqs] the context items fold the blocks before it
  const int64_t* ctx_items;    // [num_ctx_items, 7] (sequence, first block, end block, row_begin,
                               //   row_end, partial offset, partial offset started from or kNoState)
  const int64_t* ctx_levels;   // [num_ctx_levels + 1] level l's items are [ctx_levels[l], ctx_levels[l + 1])
  const int64_t* seq_ctx_ptr;  // [num_seqs + 1] sequence s's context pieces are
  const int64_t* seq_ctx_offset;  // seq_ctx_offset[seq_ctx_ptr[s] ..]: partial offset (one at most)
  float* partial_o;            // [num_kv_heads, head_dim, num_partial_rows * group] like O^T:
  float* partial_m;            // [num_kv_heads, num_partial_rows * group]   the partial of
  float* partial_n;            // [num_kv_heads, num_partial_rows * group]   row r of token t's
                               //   partial row is (offset + t) * group + (r % group)
  int64_t workspace_stride;
  int64_t num_partial_rows;
  int num_tiles, num_ctx_items, num_ctx_levels, num_threads;
  int num_seqs, max_segments, num_heads, num_kv_heads, head_dim, chunk_size;
  int window;  // sliding window, as in Params; 0: none
  DType dtype, q_dtype;  // the pool's, and q's and out's (as in Params)
  float scale;
};

// Floats of one thread's prefill buffers, rounded to 64 bytes (no shared cache lines):
// Q [kRowsPerItem][D], O^T [D][kRowsPerItem + 16], m and n [kRowsPerItem], a block's scores
// [kBlockKeys][kMaxBlockRows], its K as fp32 [kBlockKeys][D] and V [kBlockKeys][D + 16].
static inline int64_t prefill_workspace_floats(int head_dim) {
  const int64_t d = head_dim;
  return round_up(kRowsPerItem * d + (kRowsPerItem + 16) * d + 2 * kRowsPerItem + kBlockKeys * kMaxBlockRows +
                      kBlockKeys * (2 * d + 16),
                  16);
}

// Entry points of the variants (kernel_<isa>.cpp), beside tpp_decode in params.h.
namespace avx512 { void tpp_prefill(const PrefillParams& p); }
namespace avx2 { void tpp_prefill(const PrefillParams& p); }
namespace neon { void tpp_prefill(const PrefillParams& p); }
namespace generic { void tpp_prefill(const PrefillParams& p); }

}  // namespace chunk_attn_cpu
