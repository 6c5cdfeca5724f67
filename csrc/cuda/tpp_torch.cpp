// Torch glue for the CUDA two-phase-partition kernels: checks shapes, dtypes,
// contiguity and devices, allocates the partial buffers, launches on the current stream.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include "tpp_torch.h"

#include "chunk_attn/params.h"

namespace {

void check_index(const torch::Tensor& t, const char* name, const torch::Device& device) {
  TORCH_CHECK(t.device() == device, name, " must be on ", device, ", got ", t.device());
  TORCH_CHECK(t.scalar_type() == torch::kInt32, name, " must be int32, got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

}  // namespace

torch::Tensor tpp_decode_cuda(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                              torch::Tensor shared_chunk_ids, torch::Tensor shared_begin, torch::Tensor shared_end,
                              torch::Tensor shared_row_offset, torch::Tensor shared_depth,
                              torch::Tensor private_chunk_ids,
                              torch::Tensor num_shared_tokens, torch::Tensor seq_lens, torch::Tensor seq_partial_ptr,
                              torch::Tensor seq_partial_rows, int64_t max_rows_per_shared,
                              int64_t max_pairs_per_seq, int64_t max_private_tokens, int64_t num_partial_rows,
                              double scale, int64_t window) {
  TORCH_CHECK(q.is_cuda(), "q must be a CUDA tensor");
  const torch::Device device = q.device();
  TORCH_CHECK(q.dim() == 3, "q must be [num_seqs, num_heads, head_dim], got ", q.sizes());
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "k_cache and v_cache must both be [capacity, num_kv_heads, chunk_size, head_dim]");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "q, k_cache and v_cache must share a dtype");
  TORCH_CHECK(q.scalar_type() == torch::kHalf || q.scalar_type() == torch::kBFloat16,
              "CUDA TPP supports float16 and bfloat16, got ", q.scalar_type());
  TORCH_CHECK(k_cache.device() == device && v_cache.device() == device, "caches must be on ", device);
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "q, k_cache and v_cache must be contiguous");
  const int num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int num_kv_heads = k_cache.size(1), chunk_size = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == head_dim, "head_dim of q (", head_dim, ") and cache (", k_cache.size(3), ") differ");
  TORCH_CHECK(num_heads % num_kv_heads == 0, "num_heads ", num_heads, " not a multiple of num_kv_heads ", num_kv_heads);
  TORCH_CHECK(chunk_attn::tpp_supports(head_dim, chunk_size), "CUDA TPP supports head_dim 64/128/256 and ",
              "chunk_size 32/64/128, got head_dim ", head_dim, ", chunk_size ", chunk_size);
  const torch::Tensor* index[] = {&shared_chunk_ids, &shared_begin, &shared_end, &shared_row_offset,
                                  &shared_depth, &private_chunk_ids, &num_shared_tokens, &seq_lens,
                                  &seq_partial_ptr, &seq_partial_rows};
  const char* names[] = {"shared_chunk_ids", "shared_begin", "shared_end", "shared_row_offset", "shared_depth",
                         "private_chunk_ids", "num_shared_tokens", "seq_lens", "seq_partial_ptr",
                         "seq_partial_rows"};
  for (int i = 0; i < 10; ++i) check_index(*index[i], names[i], device);
  TORCH_CHECK(shared_depth.numel() == shared_chunk_ids.numel(), "shared_depth must have num_shared entries");
  TORCH_CHECK(window >= 0 && window <= INT32_MAX, "window must be 0 (none) or a positive int32, got ", window);
  TORCH_CHECK(private_chunk_ids.dim() == 2 && private_chunk_ids.size(0) == num_seqs,
              "private_chunk_ids must be [num_seqs, max_private]");
  TORCH_CHECK(seq_lens.numel() == num_seqs && seq_partial_ptr.numel() == num_seqs + 1,
              "seq_lens must have num_seqs entries and seq_partial_ptr num_seqs + 1");

  const c10::cuda::CUDAGuard guard(device);
  auto out = torch::empty_like(q);
  auto f32 = q.options().dtype(torch::kFloat32);
  const int64_t rows = std::max<int64_t>(num_partial_rows, 1);
  chunk_attn::TppParams p{};
  p.num_seqs = num_seqs;
  p.num_heads = num_heads;
  p.num_kv_heads = num_kv_heads;
  p.head_dim = head_dim;
  p.max_private_tokens = static_cast<int>(max_private_tokens);
  const auto dtype = q.scalar_type() == torch::kHalf ? chunk_attn::DType::kHalf : chunk_attn::DType::kBFloat16;
  const int num_splits = chunk_attn::tpp_num_splits(p, dtype);
  const int64_t split_states = num_splits > 1 ? static_cast<int64_t>(num_seqs) * num_heads * num_splits : 0;
  // one scratch allocation: shared partials o [kv, rows, D], m, n [kv, rows]; split states o, m, n
  auto partials = torch::empty({num_kv_heads * rows * (head_dim + 2) + split_states * (head_dim + 2)}, f32);
  float* partial_o = partials.data_ptr<float>();

  p.q = q.data_ptr();
  p.k_cache = k_cache.data_ptr();
  p.v_cache = v_cache.data_ptr();
  p.out = out.data_ptr();
  p.partial_o = partial_o;
  p.partial_m = partial_o + num_kv_heads * rows * head_dim;
  p.partial_n = p.partial_m + num_kv_heads * rows;
  p.shared_chunk_ids = shared_chunk_ids.data_ptr<int>();
  p.shared_begin = shared_begin.data_ptr<int>();
  p.shared_end = shared_end.data_ptr<int>();
  p.shared_row_offset = shared_row_offset.data_ptr<int>();
  p.shared_depth = shared_depth.data_ptr<int>();
  p.private_chunk_ids = private_chunk_ids.data_ptr<int>();
  p.num_shared_tokens = num_shared_tokens.data_ptr<int>();
  p.seq_lens = seq_lens.data_ptr<int>();
  p.seq_partial_ptr = seq_partial_ptr.data_ptr<int>();
  p.seq_partial_rows = seq_partial_rows.data_ptr<int>();
  p.chunk_size = chunk_size;
  p.num_shared = shared_chunk_ids.numel();
  p.max_private = private_chunk_ids.size(1);
  p.max_rows_per_shared = max_rows_per_shared;
  p.max_pairs_per_seq = max_pairs_per_seq;
  p.num_splits = num_splits;
  p.split_o = p.partial_n + num_kv_heads * rows;
  p.split_m = p.split_o + split_states * head_dim;
  p.split_n = p.split_m + split_states;
  p.num_partial_rows = num_partial_rows;
  p.scale = static_cast<float>(scale);
  p.window = static_cast<int>(window);
  const cudaError_t err = chunk_attn::tpp_decode(p, dtype, at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "CUDA TPP launch failed: ", cudaGetErrorString(err));
  return out;
}
