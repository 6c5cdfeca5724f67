// How a step's plan reaches the CPU ops: one int64 tensor holding every index array of
// the plan, and `layout`, a short list of host integers: the plan's counts, then the
// offset of each array in that tensor, in the order below (the Python side writes them
// in the same order: chunk_llama/step/decode_plan.py DECODE_ARRAYS and
// chunk_llama/step/prefill_plan.py PREFILL_ARRAYS; the ops `decode_layout()` and
// `prefill_layout()` return these names, and a test compares them). Torch-free.
#pragma once

namespace chunk_attn_cpu {

enum DecodeLayout : int {
  kDecodeNumSeqs, kDecodeNumShared, kDecodeWidth,  // counts
  kSharedChunkIds, kSharedStart, kSharedLen, kSharedPos, kSharedBegin, kSharedEnd, kSharedDepth,
  kPrivateChunkIds, kPrivateStart, kPrivatePos, kNumSharedTokens, kSeqLens, kSeqPairPtr,
  kDecodeLayoutSize,
};
constexpr int kDecodeCounts = kSharedChunkIds;
constexpr const char* kDecodeArrayNames[] = {
    "shared_chunk_ids", "shared_start", "shared_len", "shared_pos", "shared_begin", "shared_end", "shared_depth",
    "private_chunk_ids", "private_start", "private_pos", "num_shared_tokens", "seq_lens", "seq_pair_ptr"};

enum PrefillLayout : int {
  kPrefillNumSeqs, kPrefillWidth, kNumQTokens, kNumTiles, kNumCtxItems, kNumCtxLevels, kNumPartialRows,  // counts
  kSegChunk, kSegStart, kSegPos, kQStart, kNumTokens, kTokenStart, kTiles, kTokenPos, kCtxEnd, kCtxItems,
  kCtxLevels, kSeqCtxPtr, kSeqCtxOffset,
  kPrefillLayoutSize,
};
constexpr int kPrefillCounts = kSegChunk;
constexpr const char* kPrefillArrayNames[] = {
    "seg_chunk", "seg_start", "seg_pos", "q_start", "num_tokens", "token_start", "tiles", "token_pos", "ctx_end",
    "ctx_items", "ctx_levels", "seq_ctx_ptr", "seq_ctx_offset"};

}  // namespace chunk_attn_cpu
