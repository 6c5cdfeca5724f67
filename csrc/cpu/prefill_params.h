// Prefill attention of the CPU kernel, free of torch and of any instruction set: the
// parameters, the per-thread workspace and the entry point of each variant. Included
// like params.h (by the glue, every variant's translation unit before its target
// pragma, and the test driver); functions here are `static inline` for the same reason.
//
// One call covers every sequence prefilled in a forward step ("packed"): sequence s
// has num_tokens[s] new query tokens at rows token_start[s] .. of q and out, at
// positions q_start[s] .. of the sequence, whose K/V (cached prefix and new tokens
// alike) are already in the pool, in the segments of seg_chunk[s] (as params.h). A query row of a sequence is
// r = token * group + g (the GQA group's heads of one token are consecutive rows of
// one KV head); a tile is a range of at most kRowsPerItem such rows, and a work item
// is (tile, KV head).
#pragma once

#include <cstdint>

#include "params.h"

namespace chunk_attn_cpu {

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
  int64_t workspace_stride;
  int num_tiles, num_threads;
  int num_seqs, max_segments, num_heads, num_kv_heads, head_dim, chunk_size;
  int window;  // sliding window, as in Params; 0: none
  DType dtype;
  float scale;
};

// Floats of one thread's prefill buffers, rounded to 64 bytes (no shared cache lines):
// Q^T and O^T [D][kRowsPerItem + 16], m and n [kRowsPerItem], scores [C][kMaxBlockRows],
// the chunk's K as fp32 [C][D] (bf16 storage) and V as fp32 [C][D + 16].
static inline int64_t prefill_workspace_floats(int chunk_size, int head_dim) {
  const int64_t c = chunk_size, d = head_dim;
  return round_up(2 * (kRowsPerItem + 16) * d + 2 * kRowsPerItem + c * kMaxBlockRows + c * (2 * d + 16), 16);
}

// Entry points of the variants (kernel_<isa>.cpp), beside tpp_decode in params.h.
namespace avx512 { void tpp_prefill(const PrefillParams& p); }
namespace avx2 { void tpp_prefill(const PrefillParams& p); }
namespace neon { void tpp_prefill(const PrefillParams& p); }
namespace generic { void tpp_prefill(const PrefillParams& p); }

}  // namespace chunk_attn_cpu
