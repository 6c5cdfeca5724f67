// Phase-1 work items of the CPU kernel, built by the caller (the torch glue, the
// test driver) with baseline flags, so the kernel variants need no std::vector.
#pragma once

#include <algorithm>
#include <vector>

#include "params.h"

namespace chunk_attn_cpu {

// Shared chunks are grouped into runs (consecutive chunks in the plan's depth-first
// order on the paths of the same sequences); each run is split into near-equal
// segments of at most max_chunks_per_item chunks, each segment into items of at most
// kRowsPerItem rows per KV head. Longer segments write fewer partials, shorter ones
// balance the threads.
static inline std::vector<ChunkItem> chunk_items(const Params& p, int max_chunks_per_item) {
  const int group = p.num_heads / p.num_kv_heads;
  std::vector<ChunkItem> items;
  for (int s = 0; s < p.num_shared;) {
    int run = 1;
    while (s + run < p.num_shared && p.shared_begin[s + run] == p.shared_begin[s] &&
           p.shared_end[s + run] == p.shared_end[s] && p.shared_depth[s + run] == p.shared_depth[s] + run)
      ++run;
    const int num_segments = (run + max_chunks_per_item - 1) / max_chunks_per_item;
    const int row_begin = static_cast<int>(p.shared_begin[s]) * group;
    const int row_end = static_cast<int>(p.shared_end[s]) * group;
    for (int i = 0; i < num_segments; ++i) {
      const int first = s + static_cast<int>(static_cast<int64_t>(run) * i / num_segments);
      const int last = s + static_cast<int>(static_cast<int64_t>(run) * (i + 1) / num_segments);
      for (int r = row_begin; r < row_end; r += kRowsPerItem)
        for (int h = 0; h < p.num_kv_heads; ++h)
          items.push_back({first, last - first, r, std::min(row_end, r + kRowsPerItem), h});
    }
    s += run;
  }
  return items;
}

}  // namespace chunk_attn_cpu
