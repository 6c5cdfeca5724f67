// The CPU kernel of one variant: both phases and the entry point, in namespace
// chunk_attn_cpu::CHUNK_ATTN_ISA. Included by kernel_<isa>.cpp after its
// lanes_<isa>.h, which defines the lane API this code is written against.
#pragma once

#ifndef CHUNK_ATTN_ISA
#error "kernel.h needs CHUNK_ATTN_ISA (the variant's namespace) and its lanes_<isa>.h"
#endif

namespace chunk_attn_cpu {
namespace CHUNK_ATTN_ISA {

static_assert(kKeyTile <= kGuardRows, "a key tile may read past a segment: the pool's guard must cover it");

// Offset of one chunk's [C][D] block for one KV head in k_cache / v_cache.
inline int64_t chunk_offset(int num_kv_heads, int chunk_size, int head_dim, int64_t chunk_id, int kv_head) {
  return (chunk_id * num_kv_heads + kv_head) * static_cast<int64_t>(chunk_size) * head_dim;
}
inline int64_t chunk_offset(const Params& p, int64_t chunk_id, int kv_head) {
  return chunk_offset(p.num_kv_heads, p.chunk_size, p.head_dim, chunk_id, kv_head);
}

// The next chunk's K and V (`bytes` each), prefetched (locality hint 2: the outer
// caches) in `num_parts` parts spread over the work on the current chunk, so their
// reads overlap its arithmetic without a burst of misses at any one point. Used by
// phase 1, whose chunks are far apart in the pool. Empty (k == nullptr): nothing to do.
struct Prefetch {
  const char* k = nullptr;
  const char* v = nullptr;
  int64_t bytes = 0;
  void part(int index, int num_parts) const {
    if (k == nullptr) return;
    const int64_t lines = 2 * ((bytes + 63) / 64), per_part = (lines + num_parts - 1) / num_parts;
    const int64_t end = (index + 1) * per_part < lines ? (index + 1) * per_part : lines;
    for (int64_t line = index * per_part; line < end; ++line) {
      const int64_t at = line * 64;
      __builtin_prefetch(at < bytes ? k + at : v + (at - bytes), 0, 2);
    }
  }
};

}  // namespace CHUNK_ATTN_ISA
}  // namespace chunk_attn_cpu

#include "chunk_first.h"
#include "seq_first.h"
#include "prefill.h"
#include "linear.h"
#include "quant.h"
#include "quant_linear.h"

namespace chunk_attn_cpu {
namespace CHUNK_ATTN_ISA {

template <typename T, int D>
void decode(const Params& p) {
  const int num_seq_items = p.num_seqs * p.num_kv_heads;
  int max_parts = 1;  // phase 2's items: (sequence, KV head, part), parts innermost
  for (int seq = 0; seq < p.num_seqs; ++seq) {
    const int64_t begin = private_begin(p, seq), length = p.seq_lens[seq];
    const int parts = num_parts(length > begin ? length - begin : 0);
    max_parts = parts > max_parts ? parts : max_parts;
  }
  const int64_t num_part_items = static_cast<int64_t>(num_seq_items) * max_parts;
#ifdef _OPENMP
  // items taken a few at a time where there are many (an item past its sequence's parts is
  // empty; one at a time, the shared counter's traffic would cost more than they do)
  const int64_t spread = num_part_items / (16 * p.num_threads);
  const int per_take = static_cast<int>(spread > 1 ? spread : 1);
#endif
#ifdef _OPENMP
#pragma omp parallel num_threads(p.num_threads)
#endif
  {
#ifdef _OPENMP
    float* ws = p.workspace + omp_get_thread_num() * p.workspace_stride;
#else
    float* ws = p.workspace;
#endif
    if (p.num_items > 0) {
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
      for (int h = 0; h < p.num_kv_heads; ++h) transpose_q<T, D>(p, h);
#ifdef _OPENMP
#pragma omp for schedule(dynamic, 1)
#endif
      for (int i = 0; i < p.num_items; ++i) chunk_first_item<T, D>(p, p.items[i], ws);
    }
    // (implicit barrier) every partial is written before any merge reads it
#ifdef _OPENMP
#pragma omp for schedule(dynamic, per_take)
#endif
    for (int64_t i = 0; i < num_part_items; ++i) {
      const int item = static_cast<int>(i / max_parts);
      seq_first_item<T, D>(p, item / p.num_kv_heads, item % p.num_kv_heads, static_cast<int>(i % max_parts), ws);
    }
    if (max_parts > 1) {  // (implicit barrier) every part is written before its merge
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
      for (int i = 0; i < num_seq_items; ++i) merge_parts<T, D>(p, i / p.num_kv_heads, i % p.num_kv_heads, ws);
    }
  }
}

// The caller checked supports(chunk_size, head_dim) and sized the scratch.
void tpp_decode(const Params& p) {
  const bool bf16 = p.dtype == DType::kBFloat16;
  switch (p.head_dim) {
#define CHUNK_ATTN_DECODE_CASE(D) \
  case D: return bf16 ? decode<uint16_t, D>(p) : decode<float, D>(p);
    CHUNK_ATTN_CPU_HEAD_DIMS(CHUNK_ATTN_DECODE_CASE)
#undef CHUNK_ATTN_DECODE_CASE
  }
}

}  // namespace CHUNK_ATTN_ISA
}  // namespace chunk_attn_cpu
