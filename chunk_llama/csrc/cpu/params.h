// One decode step of the CPU two-phase-partition kernel, free of torch and of any
// instruction set: the parameters, the scratch layout, and the entry point of each
// kernel variant. Included by the torch glue (baseline flags), by every variant's
// translation unit (before its target pragma) and by the torch-free test driver.
//
// Functions defined here are `static inline`: a variant's translation unit is
// compiled for a wider instruction set than the glue, and an out-of-line copy with
// external linkage could be merged by the linker with the glue's and then run on a
// CPU that lacks those instructions.
#pragma once

#include <algorithm>
#include <cstdint>

namespace chunk_attn_cpu {

enum class DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };  // bf16: raw uint16 storage; fp16: Half (pools only)

// Keys per block of the canonical attention (blocks.h): a query's keys are cut into blocks
// at positions [b * kBlockKeys, (b + 1) * kBlockKeys), whatever chunks hold them.
constexpr int kBlockKeys = 64;

// A block of keys on the paths of several sequences (their shared prefix holds its last
// key, so all of it): phase 1 computes its partial (o_b, m_b, n_b) for all their query rows
// at once. Its partials: per KV head [D + 2][stride] floats at offset + kv_head * (D + 2) *
// stride of shared_partials (o_b's D rows of lanes, then m_b's, then n_b's), a lane per query
// row seq * group + g - seq_begin * group, stride those rows rounded up to 16.
struct SharedBlock {
  int64_t block;
  int64_t seq_begin, seq_end;  // the sequences (plan rows) under it
  int64_t offset, stride;
};

// Phase-1 work item: shared blocks [first, first + count) (consecutive blocks on the same
// sequences' paths), for one KV head and up to kRowsPerItem of their query rows (row =
// sequence * group + head of the group), which start a multiple of kRowsPerItem into them.
struct ChunkItem {
  int first, count;
  int row_begin, row_end;
  int kv_head;
};

// Final work item: query rows [row_begin, row_end) of one KV head (at most kRowsPerItem) of
// sequences that share the same shared blocks (fold_blocks [first, first + count), in
// position order): those folded (rows in lanes), then each row's private blocks' partials,
// normalised into out.
struct FoldItem {
  int row_begin, row_end;
  int64_t first;
  int count;
  int kv_head;
};

struct Params {
  const void* q;        // [num_seqs, num_heads, head_dim]
  const void* k_cache;  // [capacity, num_kv_heads, chunk_size, head_dim]
  const void* v_cache;
  void* out;            // [num_seqs, num_heads, head_dim]
  // The step's plan (chunk_llama/step/decode_plan.py): K/V by segment, slots [start, start +
  // len) of one chunk at consecutive positions. Most are whole chunks; one ends inside a
  // chunk where requests part (token-granular sharing).
  const int64_t* shared_chunk_ids;   // [num_shared] the segments on >= 2 paths
  const int64_t* shared_start;       // [num_shared] first slot in the chunk
  const int64_t* shared_len;         // [num_shared] keys, 1 .. chunk_size - start
  const int64_t* shared_pos;         // [num_shared] position of the first key
  const int64_t* shared_begin;       // [num_shared] first plan row under the segment
  const int64_t* shared_end;         // [num_shared] one past the last
  const int64_t* shared_depth;       // [num_shared] index among the shared segments of its paths
  const int64_t* private_chunk_ids;  // [num_seqs, max_private] each sequence's own segments
  const int64_t* private_start;      // [num_seqs, max_private]
  const int64_t* private_pos;        // [num_seqs, max_private]; a segment ends at the next one's
                                     // position, or the sequence's length; kNoPosition: unused
  const int64_t* num_shared_tokens;  // [num_seqs]
  const int64_t* seq_lens;           // [num_seqs]
  const int64_t* seq_pair_ptr;       // [num_seqs + 1]
  // The call's schedule (schedule.h decode_schedule, from the plan):
  const int64_t* path_ptr;    // [num_seqs + 1] sequence i's whole path is path_* [path_ptr[i], path_ptr[i + 1])
  const int64_t* path_chunk;  //   chunk, first slot and position of each segment in order (a
  const int64_t* path_start;  //   segment runs to the next one's position, the last to the
  const int64_t* path_pos;    //   sequence's length)
  const int64_t* private_slot;  // [num_seqs + 1] sequence i's private blocks, from block
                                // num_shared_tokens[i] / kBlockKeys on, have the partial slots
                                // [private_slot[i], private_slot[i + 1]) ([num_heads][D + 2] each)
  const SharedBlock* shared_blocks;  // [num_shared_blocks]
  const ChunkItem* items;            // [num_items] phase-1 work
  const FoldItem* folds;             // [num_folds] final work
  const int32_t* fold_blocks;        // the shared blocks the folds take, by index
  float* q_rows;            // [num_kv_heads, q_rows_per_head(num_seqs, group), head_dim] Q pre-scaled
  float* shared_partials;   // see SharedBlock
  float* private_partials;  // [private slots, num_heads, head_dim + 2]: o_b, m_b, n_b
  float* workspace;         // [num_threads, workspace_stride]: each thread's buffers
  int64_t workspace_stride;
  int num_items, num_folds, num_shared_blocks, num_threads;
  int num_seqs, num_heads, num_kv_heads, head_dim, chunk_size, num_shared, max_private;
  int window;  // sliding window: a query sees the `window` latest positions, itself included; 0: all
  DType dtype;    // the pool's K/V
  DType q_dtype;  // q and out: the activations' (float32 over a bf16 or fp16 pool, or the pool's; never fp16)
  float scale;
};

constexpr int64_t kNoPosition = int64_t{1} << 62;  // chunk_llama.step.decode_plan.NO_POSITION

// First position a query at `pos` sees under a sliding window of `window` (0: none).
static inline int64_t window_start(int64_t pos, int window) { return window > 0 ? pos - window + 1 : 0; }

// Rows a kernel may read past a segment that ends inside a chunk (its last key tile); the
// pool keeps a guard chunk behind the last so that such a read stays in bounds.
constexpr int kGuardRows = 16;

// Phase 2 cuts a sequence's private blocks into parts of part_len blocks (the last fewer),
// each a work item per KV head, so that one or two sequences still give every thread work
// (a batch of one has as many items as KV heads otherwise: 3 for 2 threads, one thread
// doing two). Each block's partial goes to its slot and the blocks are folded in order
// afterwards, so the cut changes no number. A call's part_len gives about kPartsPerThread
// items per thread over all its blocks, and at least kPartBlocks blocks: longer parts keep
// the next block's prefetch going (an item's first block is not prefetched; at 2 blocks a
// part, 32 x 1,024 keys read their K/V from DRAM at 26 GB/s).
constexpr int kPartBlocks = 2, kPartsPerThread = 8;
static inline int64_t phase2_part_len(int64_t total_blocks, int num_kv_heads, int num_threads) {
  const int64_t parts = static_cast<int64_t>(kPartsPerThread) * (num_threads > 0 ? num_threads : 1);
  const int64_t len = (total_blocks * num_kv_heads + parts - 1) / parts;
  return len > kPartBlocks ? len : kPartBlocks;
}
static inline int num_parts(int64_t blocks, int64_t part_len) {
  return blocks <= 0 ? 0 : static_cast<int>((blocks + part_len - 1) / part_len);
}

constexpr int kRowsPerItem = 128;  // bounds a work item's rows (its O buffer); more rows split into items
constexpr int kMaxBlockRows = 64;  // widest phase-1 row block of any variant (kRowVecs * kLanes)
constexpr int kMaxSeqHeads = 4;    // widest phase-2 head tile of any variant (kSeqHeads)

// The head dims the kernels are instantiated for (X(D) once each): those of the model
// families people run (32: tiny configs; 64, 128: most; 80: Phi-2, StableLM; 96: Phi-3;
// 256: Gemma). Any multiple of 16 works in the code; each one costs build time.
#define CHUNK_ATTN_CPU_HEAD_DIMS(X) X(32) X(64) X(80) X(96) X(128) X(256)

static inline bool supports(int chunk_size, int head_dim) {
#define CHUNK_ATTN_IS_HEAD_DIM(D) || head_dim == D
  return chunk_size > 0 && chunk_size % 16 == 0 && (false CHUNK_ATTN_CPU_HEAD_DIMS(CHUNK_ATTN_IS_HEAD_DIM));
#undef CHUNK_ATTN_IS_HEAD_DIM
}

static inline int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

// Rows of q_rows per KV head: the query rows, then zeros up to a row block past them (a
// block starting at any row stays inside), rounded to 16.
static inline int64_t q_rows_per_head(int num_seqs, int group) {
  return round_up(static_cast<int64_t>(num_seqs) * group + kMaxBlockRows, 16);
}

// Floats of one thread's buffers, the largest of the passes' needs (rounded to 64 bytes so
// that no two threads share a cache line):
//   phase 1: a block's scores [kBlockKeys][kMaxBlockRows], its K and V as fp32 [kBlockKeys][D]
//            and [kBlockKeys][D + 16] (blocks.h kVStride)
//   phase 2: a block's scores for a tile of heads [kMaxSeqHeads][kBlockKeys]
//   folds:   O^T [D][kRowsPerItem], m and n [kRowsPerItem], a row's o [D]
static inline int64_t workspace_floats(int head_dim) {
  const int64_t d = head_dim;
  const int64_t phase1 = kBlockKeys * kMaxBlockRows + kBlockKeys * (2 * d + 16);
  const int64_t phase2 = kMaxSeqHeads * kBlockKeys;
  const int64_t folds = kRowsPerItem * (d + 2) + d;
  return round_up(std::max(phase1, std::max(phase2, folds)), 16);
}

// Entry points of the variants (one translation unit each, kernel_<isa>.cpp). Which
// ones a build holds depends on the architecture (see variants.h).
namespace avx512 { void tpp_decode(const Params& p); }
namespace avx2 { void tpp_decode(const Params& p); }
namespace neon { void tpp_decode(const Params& p); }
namespace generic { void tpp_decode(const Params& p); }

}  // namespace chunk_attn_cpu
