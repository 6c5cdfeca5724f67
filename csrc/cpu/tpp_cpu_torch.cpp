// Torch glue for the CPU two-phase-partition kernel: checks, scratch, OpenMP threads.
#include <ATen/Parallel.h>
#include <omp.h>
#include <torch/extension.h>

#include "tpp_cpu.h"
#include "tpp_cpu_torch.h"

torch::Tensor tpp_decode_cpu(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                             torch::Tensor shared_chunk_ids, torch::Tensor shared_begin, torch::Tensor shared_end,
                             torch::Tensor shared_depth, torch::Tensor private_chunk_ids,
                             torch::Tensor num_shared_tokens, torch::Tensor seq_lens, torch::Tensor seq_pair_ptr,
                             torch::Tensor scratch, double scale, int64_t max_chunks_per_item) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(),
              "tpp_decode_cpu takes CPU tensors");
  TORCH_CHECK(q.dim() == 3, "q must be [num_seqs, num_heads, head_dim], got ", q.sizes());
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "k_cache and v_cache must both be [capacity, num_kv_heads, chunk_size, head_dim]");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "q, k_cache and v_cache must share a dtype");
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 || q.scalar_type() == torch::kBFloat16,
              "the CPU kernel supports float32 and bfloat16, got ", q.scalar_type());
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "q, k_cache and v_cache must be contiguous");
  const int num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int num_kv_heads = k_cache.size(1);
  TORCH_CHECK(k_cache.size(3) == head_dim, "head_dim of q (", head_dim, ") and cache (", k_cache.size(3), ") differ");
  TORCH_CHECK(num_heads % num_kv_heads == 0, "num_heads ", num_heads, " not a multiple of num_kv_heads ",
              num_kv_heads);
  TORCH_CHECK(chunk_attn_cpu::supports(k_cache.size(2), head_dim), "the CPU kernel supports chunk sizes ",
              "that are multiples of 16 and head dims 64/128/256, got chunk_size ", k_cache.size(2), ", head_dim ", head_dim);
  for (const auto* t : {&shared_chunk_ids, &shared_begin, &shared_end, &shared_depth, &private_chunk_ids,
                        &num_shared_tokens, &seq_lens, &seq_pair_ptr}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == torch::kInt64 && t->is_contiguous(),
                "plan tensors must be contiguous int64 CPU tensors");
  }
  TORCH_CHECK(seq_lens.numel() == num_seqs && seq_pair_ptr.numel() == num_seqs + 1 &&
                  private_chunk_ids.dim() == 2 && private_chunk_ids.size(0) == num_seqs,
              "plan tensors do not match num_seqs=", num_seqs);
  TORCH_CHECK(max_chunks_per_item >= 1, "max_chunks_per_item must be >= 1, got ", max_chunks_per_item);
  const int64_t num_pairs = seq_pair_ptr[num_seqs].item<int64_t>();
  auto out = torch::empty_like(q);
  // The caller keeps the scratch between calls: fresh pages for every step would cost
  // a page fault per 4 KiB, more than the attention itself.
  const int64_t needed = chunk_attn_cpu::scratch_floats(num_pairs, num_seqs, num_heads, num_kv_heads, head_dim);
  TORCH_CHECK(scratch.device().is_cpu() && scratch.scalar_type() == torch::kFloat32 && scratch.is_contiguous() &&
                  scratch.numel() >= needed,
              "scratch must be a contiguous float32 CPU tensor of at least ", needed, " elements");

  chunk_attn_cpu::Params p{};
  p.q = q.data_ptr();
  p.k_cache = k_cache.data_ptr();
  p.v_cache = v_cache.data_ptr();
  p.out = out.data_ptr();
  p.partial_o = scratch.data_ptr<float>();
  p.partial_m = p.partial_o + num_pairs * num_heads * head_dim;
  p.partial_n = p.partial_m + num_pairs * num_heads;
  p.q_t = p.partial_n + num_pairs * num_heads;
  p.shared_chunk_ids = shared_chunk_ids.data_ptr<int64_t>();
  p.shared_begin = shared_begin.data_ptr<int64_t>();
  p.shared_end = shared_end.data_ptr<int64_t>();
  p.shared_depth = shared_depth.data_ptr<int64_t>();
  p.private_chunk_ids = private_chunk_ids.data_ptr<int64_t>();
  p.num_shared_tokens = num_shared_tokens.data_ptr<int64_t>();
  p.seq_lens = seq_lens.data_ptr<int64_t>();
  p.seq_pair_ptr = seq_pair_ptr.data_ptr<int64_t>();
  p.num_seqs = num_seqs;
  p.num_heads = num_heads;
  p.num_kv_heads = num_kv_heads;
  p.head_dim = head_dim;
  p.chunk_size = k_cache.size(2);
  p.num_shared = shared_chunk_ids.numel();
  p.max_private = private_chunk_ids.size(1);
  p.max_chunks_per_item = static_cast<int>(std::min<int64_t>(max_chunks_per_item, 1 << 30));
  p.scale = static_cast<float>(scale);
  omp_set_num_threads(at::get_num_threads());
  const bool done = q.scalar_type() == torch::kFloat32 ? chunk_attn_cpu::tpp_decode<float>(p)
                                                        : chunk_attn_cpu::tpp_decode<uint16_t>(p);
  TORCH_CHECK(done, "unreachable: shape checked above");
  return out;
}

int64_t tpp_scratch_floats(int64_t num_pairs, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                           int64_t head_dim) {
  return chunk_attn_cpu::scratch_floats(num_pairs, num_seqs, num_heads, num_kv_heads, head_dim);
}
