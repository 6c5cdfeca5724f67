// Torch-facing entry point of the CPU two-phase-partition kernel (defined in tpp_cpu_torch.cpp).
#pragma once

#include <torch/extension.h>

// q: [num_seqs, num_heads, head_dim] (plan order); k_cache, v_cache: [capacity, num_kv_heads, chunk_size, head_dim];
// the plan's int64 tensors (see chunk_llama/kv/plan.py); scratch: float32, at least
// tpp_scratch_floats(...) elements; max_chunks_per_item: shared chunks one work item
// merges before writing a partial. Returns [num_seqs, num_heads, head_dim].
torch::Tensor tpp_decode_cpu(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                             torch::Tensor shared_chunk_ids, torch::Tensor shared_begin, torch::Tensor shared_end,
                             torch::Tensor shared_depth, torch::Tensor private_chunk_ids,
                             torch::Tensor num_shared_tokens, torch::Tensor seq_lens, torch::Tensor seq_pair_ptr,
                             torch::Tensor scratch, double scale, int64_t max_chunks_per_item);

int64_t tpp_scratch_floats(int64_t num_pairs, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                           int64_t head_dim);
