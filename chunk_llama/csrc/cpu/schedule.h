// The decode kernel's schedule for one plan, built by the caller (planned.cpp once per step,
// the test driver) from the step's plan with baseline flags, so the kernel variants need no
// std::vector: each sequence's whole path, the shared blocks and their partials, phase 1's
// items, the private blocks' slots and the folds (params.h has what each is).
#pragma once

#include <algorithm>
#include <vector>

#include "params.h"

namespace chunk_attn_cpu {

struct DecodeSchedule {
  std::vector<int64_t> path_ptr, path_chunk, path_start, path_pos, private_slot;
  std::vector<SharedBlock> blocks;
  std::vector<ChunkItem> items;
  std::vector<FoldItem> folds;
  std::vector<int32_t> fold_blocks;
  int64_t shared_floats = 0;  // of the shared blocks' partials

  // Floats of scratch the call needs: q_rows, the shared and private partials, then the
  // threads' workspaces (in that order: carve).
  int64_t scratch_floats(const Params& p, int num_threads) const {
    return p.num_kv_heads * q_rows_per_head(p.num_seqs, p.num_heads / p.num_kv_heads) * p.head_dim + shared_floats +
           private_slot.back() * p.num_heads * (p.head_dim + 2) + num_threads * workspace_floats(p.head_dim);
  }

  // Points p at the schedule (its arrays: valid while the schedule is).
  void point(Params& p) const {
    p.path_ptr = path_ptr.data(), p.path_chunk = path_chunk.data(), p.path_start = path_start.data();
    p.path_pos = path_pos.data(), p.private_slot = private_slot.data();
    p.shared_blocks = blocks.data(), p.num_shared_blocks = static_cast<int>(blocks.size());
    p.items = items.data(), p.num_items = static_cast<int>(items.size());
    p.folds = folds.data(), p.num_folds = static_cast<int>(folds.size());
    p.fold_blocks = fold_blocks.data();
  }

  // Points p's buffers into scratch (scratch_floats of them).
  void carve_scratch(Params& p, float* scratch) const {
    p.q_rows = scratch;
    p.shared_partials = p.q_rows + p.num_kv_heads * q_rows_per_head(p.num_seqs, p.num_heads / p.num_kv_heads) * p.head_dim;
    p.private_partials = p.shared_partials + shared_floats;
    p.workspace = p.private_partials + private_slot.back() * p.num_heads * (p.head_dim + 2);
    p.workspace_stride = workspace_floats(p.head_dim);
  }

  // Both (what a one-off call, as the test driver's, does).
  void carve(Params& p, float* scratch) const {
    point(p);
    carve_scratch(p, scratch);
  }

  // The work arrays of decode_schedule_into, kept with the schedule so that building it again
  // allocates nothing once every vector has grown to the plan's size.
  std::vector<int64_t> deepest, leaf_first;
};

// The shared segment of each pair slot (seq_pair_ptr[row] + depth), -1 where none says so
// (the caller checks there is none such; its rows' slots at their depth exist), into pair_seg.
static inline void pair_segments_into(const Params& p, std::vector<int64_t>& pair_seg) {
  pair_seg.assign(static_cast<size_t>(p.seq_pair_ptr[p.num_seqs]), -1);
  for (int i = 0; i < p.num_shared; ++i)
    for (int64_t row = p.shared_begin[i]; row < p.shared_end[i]; ++row)
      pair_seg[p.seq_pair_ptr[row] + p.shared_depth[i]] = i;
}

static inline std::vector<int64_t> pair_segments(const Params& p) {
  std::vector<int64_t> pair_seg;
  pair_segments_into(p, pair_seg);
  return pair_seg;
}

// The schedule of p's plan, pair_seg its pair_segments (checked by the caller: every pair
// slot has its segment, in position order from 0; every private segment lies inside its
// chunk). max_blocks_per_item: the most shared blocks one phase-1 item takes (0: chosen for
// p.num_threads). Built into s, whose vectors keep their memory (a plan made again each step).
static inline void decode_schedule_into(DecodeSchedule& s, const Params& p, const std::vector<int64_t>& pair_seg,
                                        int max_blocks_per_item) {
  const int group = p.num_heads / p.num_kv_heads, n = p.num_seqs, B = kBlockKeys;
  for (auto* v : {&s.path_ptr, &s.path_chunk, &s.path_start, &s.path_pos, &s.private_slot}) v->clear();
  s.blocks.clear(), s.items.clear(), s.folds.clear(), s.fold_blocks.clear();
  s.shared_floats = 0;
  // each sequence's path: its shared segments by depth (a pair slot each), then its own
  s.path_ptr.push_back(0);
  s.private_slot.push_back(0);
  for (int row = 0; row < n; ++row) {
    for (int64_t k = p.seq_pair_ptr[row]; k < p.seq_pair_ptr[row + 1]; ++k) {
      const int64_t i = pair_seg[k];
      s.path_chunk.push_back(p.shared_chunk_ids[i]), s.path_start.push_back(p.shared_start[i]);
      s.path_pos.push_back(p.shared_pos[i]);
    }
    const int64_t* own = p.private_pos + static_cast<int64_t>(row) * p.max_private;
    for (int c = 0; c < p.max_private && own[c] < p.seq_lens[row]; ++c) {
      s.path_chunk.push_back(p.private_chunk_ids[static_cast<int64_t>(row) * p.max_private + c]);
      s.path_start.push_back(p.private_start[static_cast<int64_t>(row) * p.max_private + c]);
      s.path_pos.push_back(own[c]);
    }
    s.path_ptr.push_back(static_cast<int64_t>(s.path_pos.size()));
    // private blocks: from the first that holds a key past the shared ones to the last
    const int64_t first = p.num_shared_tokens[row] / B, last = (p.seq_lens[row] - 1) / B;
    s.private_slot.push_back(s.private_slot.back() + std::max<int64_t>(0, last - first + 1));
  }
  // The shared blocks: each whose last key lies in a shared segment, for that segment's rows
  // (a path holds each position once, so each (sequence, block) has one), in plan order.
  std::vector<int64_t>& deepest = s.deepest;  // each sequence's block num_shared_tokens / B - 1
  deepest.assign(n, -1);
  for (int i = 0; i < p.num_shared; ++i) {
    const int64_t pos = p.shared_pos[i], end = pos + p.shared_len[i];
    for (int64_t b = (pos + 1 + B - 1) / B - 1; (b + 1) * B <= end; ++b) {
      const int64_t seq_begin = p.shared_begin[i], seq_end = p.shared_end[i];
      const int64_t stride = round_up((seq_end - seq_begin) * group, 16);
      for (int64_t row = seq_begin; row < seq_end; ++row)
        if (b == p.num_shared_tokens[row] / B - 1) deepest[row] = static_cast<int64_t>(s.blocks.size());
      s.blocks.push_back({b, seq_begin, seq_end, s.shared_floats, stride});
      s.shared_floats += p.num_kv_heads * (p.head_dim + 2) * stride + 16;  // (16: vectors may run past a row)
    }
  }
  // Phase 1: runs of consecutive blocks on the same rows, cut into near-equal pieces of at
  // most max_blocks_per_item blocks (0: about 8 items per thread; fewer, longer pieces read
  // the same K/V, shorter ones balance the threads), each into items of at most kRowsPerItem
  // rows per KV head.
  if (max_blocks_per_item <= 0)
    max_blocks_per_item = static_cast<int>(
        std::max<int64_t>(1, static_cast<int64_t>(s.blocks.size()) * p.num_kv_heads / (8 * p.num_threads)));
  for (size_t e = 0; e < s.blocks.size();) {
    size_t run = 1;
    while (e + run < s.blocks.size() && s.blocks[e + run].seq_begin == s.blocks[e].seq_begin &&
           s.blocks[e + run].seq_end == s.blocks[e].seq_end && s.blocks[e + run].block == s.blocks[e].block + static_cast<int64_t>(run))
      ++run;
    const size_t pieces = (run + max_blocks_per_item - 1) / max_blocks_per_item;
    const int row_begin = static_cast<int>(s.blocks[e].seq_begin) * group;
    const int row_end = static_cast<int>(s.blocks[e].seq_end) * group;
    for (size_t i = 0; i < pieces; ++i) {
      const int first = static_cast<int>(e + run * i / pieces), last = static_cast<int>(e + run * (i + 1) / pieces);
      for (int r = row_begin; r < row_end; r += kRowsPerItem)
        for (int h = 0; h < p.num_kv_heads; ++h)
          s.items.push_back({first, last - first, r, std::min(row_end, r + kRowsPerItem), h});
    }
    e += run;
  }
  // Folds: runs of consecutive sequences whose deepest shared block is the same (then all
  // their shared blocks are), their blocks in position order, rows in items of kRowsPerItem.
  std::vector<int64_t>& leaf_first = s.leaf_first;  // fold_blocks offset of a run that starts at this sequence
  leaf_first.assign(n, -1);
  for (int row = 0; row < n;) {
    int end = row + 1;
    while (end < n && deepest[end] == deepest[row]) ++end;
    const int64_t count = p.num_shared_tokens[row] / B;
    leaf_first[row] = static_cast<int64_t>(s.fold_blocks.size());
    s.fold_blocks.resize(s.fold_blocks.size() + count, -1);
    for (int r = row * group; r < end * group; r += kRowsPerItem)
      for (int h = 0; h < p.num_kv_heads; ++h)
        s.folds.push_back({r, std::min(end * group, r + kRowsPerItem), leaf_first[row], static_cast<int>(count), h});
    row = end;
  }
  for (size_t e = 0; e < s.blocks.size(); ++e)  // each run's blocks, from its first sequence's
    for (int64_t row = s.blocks[e].seq_begin; row < s.blocks[e].seq_end; ++row)
      if (leaf_first[row] >= 0) s.fold_blocks[leaf_first[row] + s.blocks[e].block] = static_cast<int32_t>(e);
}

static inline DecodeSchedule decode_schedule(const Params& p, const std::vector<int64_t>& pair_seg,
                                             int max_blocks_per_item) {
  DecodeSchedule s;
  decode_schedule_into(s, p, pair_seg, max_blocks_per_item);
  return s;
}

}  // namespace chunk_attn_cpu
