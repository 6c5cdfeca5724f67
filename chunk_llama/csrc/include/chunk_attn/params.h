// Torch-free parameters of the two-phase-partition decode attention.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "chunk_attn/plan_layout.h"

namespace chunk_attn {

enum class DType { kHalf = 0, kBFloat16 = 1 };

// One decode step: one query per sequence, sequences in depth-first plan order.
// Partials of the chunk-first phase are laid out per KV head as rows
// `row_offset[s] + local_seq * group + g`, each shared chunk's rows padded to 16,
// so a 16-row tile of one chunk is 16 consecutive rows.
struct TppParams {
  const void* q;        // [num_seqs, num_heads, head_dim]
  const void* k_cache;  // [capacity, num_kv_heads, chunk_size, head_dim]
  const void* v_cache;  // [capacity, num_kv_heads, chunk_size, head_dim]
  void* out;            // [num_seqs, num_heads, head_dim]
  float* partial_o;     // [num_kv_heads, num_partial_rows, head_dim]  (unnormalised)
  float* partial_m;     // [num_kv_heads, num_partial_rows]            (row max)
  float* partial_n;     // [num_kv_heads, num_partial_rows]            (sum of exp)

  const int* shared_chunk_ids;   // [num_shared]
  const int* shared_begin;       // [num_shared] first plan row under the chunk
  const int* shared_end;         // [num_shared] one past the last
  const int* shared_row_offset;  // [num_shared] first partial row of the chunk
  const int* shared_depth;       // [num_shared] position of the chunk on the paths through it
  const int* private_chunk_ids;  // [num_seqs, max_private]
  const int* num_shared_tokens;  // [num_seqs] tokens in shared chunks (a multiple of chunk_size)
  const int* seq_lens;           // [num_seqs] context length including the new token
  const int* seq_partial_ptr;    // [num_seqs + 1] CSR into seq_partial_rows
  const int* seq_partial_rows;   // [num_pairs] partial row of (chunk, sequence) for group head 0

  int num_seqs;
  int num_heads;
  int num_kv_heads;
  int head_dim;
  int chunk_size;
  int num_shared;
  int max_private;
  int max_rows_per_shared;  // widest shared chunk, in sequences
  int max_pairs_per_seq;    // most shared chunks on one sequence's path
  int max_private_tokens;   // longest private tail (sizes the split of the sequence-first phase)
  int num_splits;           // blocks per (sequence, KV head) in the sequence-first phase
  float* split_o;           // [num_seqs, num_kv_heads, num_splits, group, head_dim] when num_splits > 1
  float* split_m;           // [num_seqs, num_kv_heads, num_splits, group]
  float* split_n;
  int num_partial_rows;
  int window;  // sliding window: a query sees its `window` latest positions, itself included; 0: all
  float scale;
};

// Launches both phases on `stream`. Returns cudaErrorInvalidValue for an
// unsupported head_dim / chunk_size, or the launch error.
cudaError_t tpp_decode(const TppParams& params, DType dtype, cudaStream_t stream);

// How many blocks share one sequence's private tail (the split of the sequence-first
// phase), chosen to fill the GPU's waves; reads num_seqs, heads, head_dim, max_private_tokens.
int tpp_num_splits(const TppParams& params, DType dtype);


}  // namespace chunk_attn
