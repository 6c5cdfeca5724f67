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

#include <cstdint>

namespace chunk_attn_cpu {

enum class DType : int { kFloat32 = 0, kBFloat16 = 1 };  // bf16: raw uint16 storage

// Phase-1 work item: a piece of a run of shared segments, for one KV head and up to
// kRowsPerItem query rows (row = sequence * group + head of the group).
struct ChunkItem {
  int first, count;        // shared segments [first, first + count)
  int row_begin, row_end;  // query rows of this KV head
  int kv_head;
};

struct Params {
  const void* q;        // [num_seqs, num_heads, head_dim]
  const void* k_cache;  // [capacity, num_kv_heads, chunk_size, head_dim]
  const void* v_cache;
  void* out;            // [num_seqs, num_heads, head_dim]
  float* partial_o;     // [num_pairs, num_heads, head_dim]
  float* partial_m;     // [num_pairs, num_heads]; -inf marks a slot merged into an earlier slot
  float* partial_n;     // [num_pairs, num_heads]
  float* part_o;        // [num_seqs, kMaxParts, num_heads, head_dim]: phase 2's parts (see num_parts)
  float* part_m;        // [num_seqs, kMaxParts, num_heads]
  float* part_n;        // [num_seqs, kMaxParts, num_heads]
  float* q_t;           // [num_kv_heads, head_dim, q_t_stride]: Q^T per KV head, pre-scaled
  float* workspace;     // [num_threads, workspace_stride]: each thread's buffers
  // K/V are read by segment: slots [start, start + len) of one chunk, at consecutive
  // positions (chunk_llama/step/decode_plan.py). Most are whole chunks; one ends inside a chunk
  // where requests part (token-granular sharing).
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
  const ChunkItem* items;            // [num_items] phase-1 work (see schedule.h)
  int64_t workspace_stride;
  int num_items, num_threads;
  int num_seqs, num_heads, num_kv_heads, head_dim, chunk_size, num_shared, max_private;
  int window;  // sliding window: a query sees the `window` latest positions, itself included; 0: all
  DType dtype;
  float scale;
};

constexpr int64_t kNoPosition = int64_t{1} << 62;  // chunk_llama.step.decode_plan.NO_POSITION

// First position a query at `pos` sees under a sliding window of `window` (0: none).
static inline int64_t window_start(int64_t pos, int window) { return window > 0 ? pos - window + 1 : 0; }

// Rows a kernel may read past a segment that ends inside a chunk (its last key tile); the
// pool keeps a guard chunk behind the last so that such a read stays in bounds.
constexpr int kGuardRows = 16;

// Phase 2 cuts a sequence's private keys into parts, each a work item per KV head, so that
// one or two sequences still give every thread work (a batch of one has as many items as
// KV heads otherwise: 3 for 2 threads, one thread doing two), and merges the parts in order.
// The cut depends on the sequence's own keys only, never on the batch: a request's attention
// is computed the same alone or among others. Parts are kPartKeys keys (the last fewer),
// longer where that would make more than kMaxParts.
constexpr int kPartKeys = 128;
constexpr int kMaxParts = 16;
static inline int64_t part_keys(int64_t keys) {
  const int64_t spread = ((keys + kMaxParts - 1) / kMaxParts + 15) / 16 * 16;
  return spread > kPartKeys ? spread : kPartKeys;
}
static inline int num_parts(int64_t keys) {
  return keys <= kPartKeys ? 1 : static_cast<int>((keys + part_keys(keys) - 1) / part_keys(keys));
}

constexpr int kRowsPerItem = 128;  // bounds a phase-1 item's O buffer; more rows split into items
constexpr int kMaxBlockRows = 64;  // widest phase-1 row block of any variant (kRowVecs * kLanes)

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

// Q^T rows are padded (with zeros) so that a row block starting at any row stays
// inside; rounded to 16 floats to keep each dimension's row 64-byte aligned.
static inline int64_t q_t_stride(int num_seqs, int num_heads, int num_kv_heads) {
  return round_up(static_cast<int64_t>(num_seqs) * (num_heads / num_kv_heads) + kMaxBlockRows, 16);
}

// Floats of one thread's buffers, the larger of the two phases' needs (rounded to
// 64 bytes so that no two threads share a cache line).
//   phase 1: O^T [D][kRowsPerItem], m and n [kRowsPerItem], scores [C][kMaxBlockRows],
//            the chunk's K and V as fp32 [C][D] each (bf16 storage)
//   phase 2: q and O [group][D], m and n [group]
static inline int64_t workspace_floats(int chunk_size, int head_dim, int group) {
  const int64_t c = chunk_size, d = head_dim, g = group;
  const int64_t phase1 = kRowsPerItem * (d + 2) + c * kMaxBlockRows + 2 * c * d;
  const int64_t phase2 = g * (2 * d + 2);
  return round_up(phase1 > phase2 ? phase1 : phase2, 16);
}

// Scratch floats the caller provides: partials, phase 2's parts, Q^T, then the threads'
// workspaces.
static inline int64_t scratch_floats(int64_t num_pairs, int num_seqs, int num_heads, int num_kv_heads, int head_dim,
                                     int chunk_size, int num_threads) {
  return (num_pairs + static_cast<int64_t>(num_seqs) * kMaxParts) * num_heads * (head_dim + 2) +
         static_cast<int64_t>(num_kv_heads) * head_dim * q_t_stride(num_seqs, num_heads, num_kv_heads) +
         static_cast<int64_t>(num_threads) * workspace_floats(chunk_size, head_dim, num_heads / num_kv_heads);
}

// Points p's buffers into `scratch` (scratch_floats of them, in that function's order); p's
// geometry (num_seqs, num_heads, num_kv_heads, head_dim, chunk_size) is set.
static inline void carve_scratch(Params& p, float* scratch, int64_t num_pairs) {
  const int64_t H = p.num_heads, D = p.head_dim, part_slots = static_cast<int64_t>(p.num_seqs) * kMaxParts * H;
  p.partial_o = scratch;
  p.partial_m = p.partial_o + num_pairs * H * D;
  p.partial_n = p.partial_m + num_pairs * H;
  p.part_o = p.partial_n + num_pairs * H;
  p.part_m = p.part_o + part_slots * D;
  p.part_n = p.part_m + part_slots;
  p.q_t = p.part_n + part_slots;
  p.workspace = p.q_t + static_cast<int64_t>(p.num_kv_heads) * D * q_t_stride(p.num_seqs, p.num_heads, p.num_kv_heads);
  p.workspace_stride = workspace_floats(p.chunk_size, p.head_dim, p.num_heads / p.num_kv_heads);
}

// Entry points of the variants (one translation unit each, kernel_<isa>.cpp). Which
// ones a build holds depends on the architecture (see variants.h).
namespace avx512 { void tpp_decode(const Params& p); }
namespace avx2 { void tpp_decode(const Params& p); }
namespace neon { void tpp_decode(const Params& p); }
namespace generic { void tpp_decode(const Params& p); }

}  // namespace chunk_attn_cpu
