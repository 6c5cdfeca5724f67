// How a step's decode plan reaches the CUDA op, and what a call needs beside it: host code
// without CUDA types, so that the C interface's plan checks (cuda/plan_checks.h) also build
// with a plain C++ compiler (tests/cpp/cuda_plan_test.cpp runs them on machines without a GPU).
#pragma once

#include <cstdint>

namespace chunk_attn {

// Most blocks that share one sequence's private tail (the split of the sequence-first phase).
constexpr int kMaxSplits = 8;

// How a step's plan reaches the op: one int32 device tensor holding every index array of
// TppParams, and `layout` (host integers): these counts, then each array's offset in the
// tensor, in the order of kCudaDecodeArrayNames (chunk_llama/step/decode_plan.py
// CUDA_DECODE_ARRAYS writes them so).
enum CudaDecodeLayout : int {
  kNumSeqs, kNumShared, kWidth, kMaxRowsPerShared, kMaxPairsPerSeq, kNumPartialRows, kMaxPrivateTokens,  // counts
  kSharedChunkIds, kSharedBegin, kSharedEnd, kSharedRowOffset, kSharedDepth, kPrivateChunkIds, kNumSharedTokens,
  kSeqLens, kSeqPartialPtr, kSeqPartialRows,
  kCudaDecodeLayoutSize,
};
constexpr int kCudaDecodeCounts = kSharedChunkIds;
constexpr const char* kCudaDecodeArrayNames[] = {
    "shared_chunk_ids", "shared_begin", "shared_end", "shared_row_offset", "shared_depth", "private_chunk_ids",
    "num_shared_tokens", "seq_lens", "seq_partial_ptr", "seq_partial_rows"};

// Floats of the caller's workspace for one call: the shared partials (o, m, n per KV head
// and partial row) and the split states of up to kMaxSplits splits per (sequence, head).
inline int64_t tpp_workspace_floats(int num_seqs, int num_heads, int num_kv_heads, int head_dim,
                                    int num_partial_rows) {
  const int64_t rows = num_partial_rows > 1 ? num_partial_rows : 1;
  return (static_cast<int64_t>(num_kv_heads) * rows + static_cast<int64_t>(num_seqs) * num_heads * kMaxSplits) *
         (head_dim + 2);
}

// Whether (head_dim, chunk_size) has compiled kernels.
inline bool tpp_supports(int head_dim, int chunk_size) {
  return (head_dim == 64 || head_dim == 128 || head_dim == 256) &&
         (chunk_size == 32 || chunk_size == 64 || chunk_size == 128);
}

}  // namespace chunk_attn
