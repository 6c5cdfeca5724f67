// Registration only: the functions live in tpp_torch.cpp.
#include <torch/extension.h>

torch::Tensor tpp_decode_cuda(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                              torch::Tensor shared_chunk_ids, torch::Tensor shared_begin, torch::Tensor shared_end,
                              torch::Tensor shared_row_offset, torch::Tensor private_chunk_ids,
                              torch::Tensor num_shared_tokens, torch::Tensor seq_lens, torch::Tensor seq_partial_ptr,
                              torch::Tensor seq_partial_rows, int64_t max_rows_per_shared,
                              int64_t max_pairs_per_seq, int64_t max_private_tokens, int64_t num_partial_rows,
                              double scale);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("tpp_decode", &tpp_decode_cuda, "Two-phase-partition decode attention over the chunk pool (CUDA)");
}
