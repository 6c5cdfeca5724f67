// The CPU kernel of one variant: both phases and the entry point, in namespace
// chunk_attn_cpu::CHUNK_ATTN_ISA. Included by kernel_<isa>.cpp after its
// lanes_<isa>.h, which defines the lane API this code is written against.
#pragma once

#ifndef CHUNK_ATTN_ISA
#error "kernel.h needs CHUNK_ATTN_ISA (the variant's namespace) and its lanes_<isa>.h"
#endif

namespace chunk_attn_cpu {
namespace CHUNK_ATTN_ISA {

static_assert(kRowVecs * kLanes <= kMaxBlockRows, "the workspaces hold kMaxBlockRows rows of a block");
static_assert(kSeqHeads <= kMaxSeqHeads, "the workspace holds kMaxSeqHeads heads' scores");

// Offset of one chunk's [C][D] block for one KV head in k_cache / v_cache.
inline int64_t chunk_offset(int num_kv_heads, int chunk_size, int head_dim, int64_t chunk_id, int kv_head) {
  return (chunk_id * num_kv_heads + kv_head) * static_cast<int64_t>(chunk_size) * head_dim;
}

}  // namespace CHUNK_ATTN_ISA
}  // namespace chunk_attn_cpu

#include "linear.h"
#include "blocks.h"
#include "chunk_first.h"
#include "seq_first.h"
#include "prefill.h"
#include "layer_ops.h"
#include "quant.h"
#include "quant_linear.h"

namespace chunk_attn_cpu {
namespace CHUNK_ATTN_ISA {

template <typename T, int D>
void decode(const Params& p) {
  const int num_seq_items = p.num_seqs * p.num_kv_heads;
  int64_t total_blocks = 0, max_blocks = 0;  // phase 2's items: (sequence, KV head, part), parts innermost
  for (int seq = 0; seq < p.num_seqs; ++seq) {
    const PrivateBlocks blocks = private_blocks(p, seq);
    total_blocks += std::max<int64_t>(0, blocks.last - blocks.from + 1);
    max_blocks = std::max(max_blocks, blocks.last - blocks.from + 1);
  }
  const int64_t part_len = phase2_part_len(total_blocks, p.num_kv_heads, p.num_threads);
  const int max_parts = num_parts(max_blocks, part_len);  // (the longest sequence has the most)
  const int64_t num_work = p.num_items + static_cast<int64_t>(num_seq_items) * max_parts;
#ifdef _OPENMP
#pragma omp parallel num_threads(p.num_threads)
#endif
  {
#ifdef _OPENMP
    float* ws = p.workspace + omp_get_thread_num() * p.workspace_stride;
#else
    float* ws = p.workspace;
#endif
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
    for (int h = 0; h < p.num_kv_heads; ++h) scale_q<D>(p, h);
    // (implicit barrier) Phase 1's shared blocks first (the larger items), then phase 2's
    // parts: every block's partial, in any order (no number depends on it).
#ifdef _OPENMP
#pragma omp for schedule(dynamic, 1)
#endif
    for (int64_t i = 0; i < num_work; ++i) {
      if (i < p.num_items) {
        shared_item<T, D>(p, p.items[i], ws);
        continue;
      }
      const int64_t j = i - p.num_items, item = j / std::max(max_parts, 1);
      private_item<T, D>(p, static_cast<int>(item / p.num_kv_heads), static_cast<int>(item % p.num_kv_heads),
                         static_cast<int>(j % std::max(max_parts, 1)), part_len, ws);
    }
    // (implicit barrier) the folds, in position order, and the output
#ifdef _OPENMP
#pragma omp for schedule(dynamic, 1)
#endif
    for (int i = 0; i < p.num_folds; ++i) fold_item<D>(p, p.folds[i], ws);
  }
}

// The caller checked supports(chunk_size, head_dim) and sized the scratch.
void tpp_decode(const Params& p) {
  switch (p.head_dim) {
#define CHUNK_ATTN_DECODE_CASE(D)                                              \
  case D:                                                                      \
    return p.dtype == DType::kBFloat16  ? decode<uint16_t, D>(p)              \
           : p.dtype == DType::kFloat16 ? decode<Half, D>(p)                  \
                                        : decode<float, D>(p);
    CHUNK_ATTN_CPU_HEAD_DIMS(CHUNK_ATTN_DECODE_CASE)
#undef CHUNK_ATTN_DECODE_CASE
  }
}

}  // namespace CHUNK_ATTN_ISA
}  // namespace chunk_attn_cpu
