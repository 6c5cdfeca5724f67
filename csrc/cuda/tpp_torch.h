// Torch-facing entry point of the CUDA two-phase-partition kernels (defined in tpp_torch.cpp).
#pragma once

#include <torch/extension.h>

// q: [num_seqs, num_heads, head_dim]; k_cache, v_cache: [capacity, num_kv_heads, chunk_size, head_dim];
// the plan's int32 tensors as described in chunk_attn/params.h. Returns [num_seqs, num_heads, head_dim].
torch::Tensor tpp_decode_cuda(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                              torch::Tensor shared_chunk_ids, torch::Tensor shared_begin, torch::Tensor shared_end,
                              torch::Tensor shared_row_offset, torch::Tensor shared_depth,
                              torch::Tensor private_chunk_ids,
                              torch::Tensor num_shared_tokens, torch::Tensor seq_lens, torch::Tensor seq_partial_ptr,
                              torch::Tensor seq_partial_rows, int64_t max_rows_per_shared,
                              int64_t max_pairs_per_seq, int64_t max_private_tokens, int64_t num_partial_rows,
                              double scale, int64_t window);
