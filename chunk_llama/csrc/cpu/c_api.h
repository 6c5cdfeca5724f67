/* The C interface of the CPU kernel library (libchunk_llama_cpu): plain C types, no torch,
 * so one compiled library serves every torch release and any caller that can pass raw
 * pointers (chunk_llama/ops/cpu/binding.py binds it with ctypes; keep its structs and
 * argument lists the same as these). What is fixed for a step or a layer crosses as a struct
 * made once (the plan, a layer's weights, its pool); a call passes that and the tensors that
 * change per call. Every entry point checks what could make it read or write out of bounds
 * (shapes, the plan's arrays against the pool, the scratch's size) before it makes a pointer
 * from it; the caller checks what only it can see: devices, dtypes being the same,
 * contiguity. 0 is success; otherwise the error's kind (CHUNK_LLAMA_VALUE_ERROR,
 * CHUNK_LLAMA_TYPE_ERROR) and chunk_llama_cpu_last_error() its message (per thread). The
 * files behind it: c_api.cpp (this surface), plan_checks.cpp (what a plan is checked for),
 * planned.cpp (a checked plan made into the kernels' parameters, and run), layer.cpp (the
 * fused decoder layer), lora.cpp (the LoRA deltas it adds per group of rows). */
#ifndef CHUNK_LLAMA_CPU_C_API_H
#define CHUNK_LLAMA_CPU_C_API_H

#include <stdint.h>

#if defined(_WIN32)
#define CHUNK_LLAMA_API __declspec(dllexport)
#else
#define CHUNK_LLAMA_API __attribute__((visibility("default")))
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* Bumped whenever an entry point's arguments change: a loader refuses a library whose
 * version differs from the one its binding was written for. */
#define CHUNK_LLAMA_CPU_ABI_VERSION 14

enum { CHUNK_LLAMA_OK = 0, CHUNK_LLAMA_VALUE_ERROR = 1, CHUNK_LLAMA_TYPE_ERROR = 2 };
/* Element types of q and the pool (params.h DType); float16 for pools only (under float32 or
 * bfloat16 q). (The CUDA library's float16 code is another name: CHUNK_LLAMA_FLOAT16.) */
enum { CHUNK_LLAMA_FLOAT32 = 0, CHUNK_LLAMA_BFLOAT16 = 1, CHUNK_LLAMA_CPU_FLOAT16 = 2 };

CHUNK_LLAMA_API int chunk_llama_cpu_abi_version(void);
/* The message of this thread's last failed call. */
CHUNK_LLAMA_API const char* chunk_llama_cpu_last_error(void);
/* The variants in this build, best first, comma-separated ("avx512,avx2,generic"). */
CHUNK_LLAMA_API const char* chunk_llama_cpu_variants(void);
/* 1 if this CPU runs the variant, 0 if not or if the build has no such variant. */
CHUNK_LLAMA_API int chunk_llama_cpu_host_runs(const char* isa);
/* Asks the caches for the line at each of `count` addresses (software prefetches, which never
 * fault: an address that holds nothing any more reads nothing). A decode step's last weights
 * evict what the host reads next; the host names those objects' addresses, and their misses
 * overlap here instead of coming one at a time (hf/fused/stack.py). */
CHUNK_LLAMA_API void chunk_llama_cpu_prefetch(const uint64_t* addresses, int64_t count);
/* The names of the plan arrays in layout order, comma-separated (plan_layout.h). */
CHUNK_LLAMA_API const char* chunk_llama_cpu_decode_layout(void);
CHUNK_LLAMA_API const char* chunk_llama_cpu_prefill_layout(void);

/* ---- Attention: a step's plan is made once (checked, copied, scheduled), then run per layer.
 *
 * FlashInfer's convention: a plan handle (chunk_llama_cpu_plan, opaque) is made once per
 * cache and device and re-planned in place every step (its memory reused); planning checks
 * every array of the step's plan against the plan tensor and every segment against the pool
 * geometry, copies what it read (a later write to the caller's tensor cannot reach the
 * kernels), builds the decode schedule and says how much scratch a call needs. Each layer's
 * call then only runs it: O(1) checks of the layer's pool against the planned geometry and
 * of the generation. The caller owns the scratch (kept across steps: fresh pages every step
 * cost a page fault per 4 KiB, more than the attention itself). */

typedef struct chunk_llama_cpu_plan chunk_llama_cpu_plan;

enum { CHUNK_LLAMA_DECODE_PLAN = 0, CHUNK_LLAMA_PREFILL_PLAN = 1 };

/* What a step's plan is checked against and holds. q_rows: the step's query rows (decode:
 * sequences in plan order; prefill: packed tokens); q [q_rows, num_heads, head_dim]. The
 * pool: [capacity, num_kv_heads, chunk_size, head_dim] per layer. index (index_numel
 * int64s) and layout (layout_size, plan_layout.h): the plan's arrays. The step's K/V writes
 * (what the fused decoder layers store; num_writes 0 and NULLs for none): query row
 * write_token[i]'s K/V go to slot write_offset[i] of chunk write_chunk[i]. row_order (decode,
 * or NULL): plan row i is batch row row_order[i] of the fused layers' hidden states.
 * max_blocks_per_item: the most shared blocks of keys one work item of decode's first phase
 * takes (0: chosen for the threads); isa: the kernel variant; num_threads: OpenMP's. */
typedef struct {
  int32_t kind; /* CHUNK_LLAMA_DECODE_PLAN or CHUNK_LLAMA_PREFILL_PLAN */
  int32_t num_threads;
  const int64_t* index;
  int64_t index_numel;
  const int64_t* layout;
  int64_t layout_size;
  int64_t q_rows, num_heads, num_kv_heads, head_dim, capacity, chunk_size;
  const int64_t* write_token;
  const int64_t* write_chunk;
  const int64_t* write_offset;
  int64_t num_writes;
  const int64_t* row_order;
  int64_t max_blocks_per_item;
  const char* isa;
} chunk_llama_cpu_plan_params;

/* A made plan as every call of its step passes it: the handle, the generation
 * chunk_llama_cpu_plan_make returned (a call with another is refused: the handle was
 * re-planned since, or its planning failed), and the caller's float32 scratch of at least
 * the floats plan_make returned. */
typedef struct {
  const chunk_llama_cpu_plan* plan;
  uint64_t generation;
  float* scratch;
  int64_t scratch_numel;
} chunk_llama_cpu_planned;

/* One layer's attention inputs beside q: its K and V pools (as the plan's geometry says,
 * dtype a CHUNK_LLAMA_* code, each with the elements its memory holds from its first
 * element on: the guard chunk behind the last must be there), the scale of the scores and
 * the sliding window (0: none; a query sees its `window` latest positions). */
typedef struct {
  void* k;
  void* v;
  int64_t capacity, num_kv_heads, chunk_size, head_dim, k_extent, v_extent;
  int64_t window;
  double scale;
  int32_t dtype;
} chunk_llama_cpu_kv;

/* A new handle (holding no plan), or NULL if out of memory; free it with plan_free. */
CHUNK_LLAMA_API chunk_llama_cpu_plan* chunk_llama_cpu_plan_new(void);
CHUNK_LLAMA_API void chunk_llama_cpu_plan_free(chunk_llama_cpu_plan* plan);
/* Plans `params` into `plan` (what it held before is replaced; its generation advances
 * whether or not this succeeds). On success *generation is the new generation and
 * *scratch_floats what one call needs. */
CHUNK_LLAMA_API int chunk_llama_cpu_plan_make(chunk_llama_cpu_plan* plan, const chunk_llama_cpu_plan_params* params,
                                              uint64_t* generation, int64_t* scratch_floats);

/* Attention of q [q_rows, num_heads, head_dim] (q_dtype: float32, or bfloat16 where the pool
 * is) over one layer's pool into out (shaped like q, in q's dtype), as `planned` says. Both
 * kinds compute each query's attention in the same blocks of keys and order (blocks.h): a
 * query's output does not depend on the batch. */
CHUNK_LLAMA_API int chunk_llama_cpu_attend(const chunk_llama_cpu_planned* planned, const chunk_llama_cpu_kv* kv,
                                           const void* q, int32_t q_dtype, void* out);

/* y [rows, out_features] = x [rows, in_features] W^T (+ bias), float32, W an nn.Linear's
 * weight [out_features, in_features] in place; bias may be NULL. */
CHUNK_LLAMA_API int chunk_llama_cpu_small_linear(const float* x, int64_t rows, int64_t in_features, const float* weight,
                                                 int64_t out_features, const float* bias, float* y, const char* isa,
                                                 int num_threads);

/* Weights in a GGML block format (GGUF files' quantized tensors; `type` is GGML's type id:
 * 2 Q4_0, 3 Q4_1, 6 Q5_0, 7 Q5_1, 8 Q8_0, 12 Q4_K, 13 Q5_K, 14 Q6_K): `weight` holds
 * out_features (num_rows) rows of in_features / block weights, `weight_bytes` bytes in all.
 * dequantize: out [num_rows, in_features] = W, float32 (the product: chunk_llama_cpu_quant_matmul). */
CHUNK_LLAMA_API int chunk_llama_cpu_dequantize(const uint8_t* weight, int64_t weight_bytes, int type, int64_t num_rows,
                                               int64_t in_features, float* out, const char* isa, int num_threads);
/* Bytes of one row of in_features weights of `type`; -1 (and an error) if the type is not
 * one of the above or in_features is not a multiple of its block. */
CHUNK_LLAMA_API int64_t chunk_llama_cpu_quant_row_bytes(int type, int64_t in_features);
/* `num_rows` rows of `type` (an integer format: Q4_0 ... Q6_K) from `in` to `out` (both
 * weight_bytes, not overlapping) tiled for the integer activations'
 * kernel, `type` + 256 (quant_params.h's kTiled; num_rows whole tiles of 16), or back to rows
 * with `untile`. */
CHUNK_LLAMA_API int chunk_llama_cpu_tile_rows(const uint8_t* in, uint8_t* out, int64_t weight_bytes, int type,
                                              int64_t num_rows, int untile, int num_threads);
/* Rows ids[0 .. n) (each below num_rows) of a weight `tile_rows` tiled (`type` its format, not
 * + 256) to out [n, row_bytes] in the file's layout: an embedding's lookup in a table tied to a
 * tiled LM head. */
CHUNK_LLAMA_API int chunk_llama_cpu_take_rows(const uint8_t* tiled, int64_t weight_bytes, int type, int64_t num_rows,
                                              const int64_t* ids, int64_t n, uint8_t* out);

/* What a layer on GGML blocks multiplies its weights with: x as it is (float32), or x
 * quantized to int8 or int16 per group of 32 (quant_act_params.h; the formats with integer
 * codes: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K). */
enum { CHUNK_LLAMA_ACTIVATIONS_FLOAT32 = 0, CHUNK_LLAMA_ACTIVATIONS_INT8 = 1, CHUNK_LLAMA_ACTIVATIONS_INT16 = 2 };

/* y [rows, out_features] = x [rows, in_features] W^T (+ bias), float32, W in a GGML block format
 * (above), x multiplied as `activations` says; its arguments in one struct. */
typedef struct {
  const float* x;          /* [rows, in_features] */
  int64_t rows, in_features;
  const uint8_t* weight;   /* out_features rows of GGML blocks, weight_bytes in all */
  int64_t weight_bytes, type, out_features;
  const float* bias;       /* [out_features] or NULL */
  float* y;                /* [rows, out_features] */
  int64_t activations;     /* CHUNK_LLAMA_ACTIVATIONS_* */
  const char* isa;         /* the variant; int8 and int16 run chunk_llama_cpu_int8_variant(isa)'s kernel */
  int64_t num_threads;
} chunk_llama_cpu_quant_matmul_args;
CHUNK_LLAMA_API int chunk_llama_cpu_quant_matmul(const chunk_llama_cpu_quant_matmul_args* args);
/* The variant whose integer (int8 and int16) kernel runs for variant `isa` on this CPU: `isa` itself, or the
 * next one that runs its integer code (AVX-512 without VNNI: avx2); NULL (and an error) for
 * a variant this CPU cannot run. */
CHUNK_LLAMA_API const char* chunk_llama_cpu_int8_variant(const char* isa);

/* One linear layer's weight in chunk_llama_cpu_decoder_layer: float32 [out_features,
 * in_features] (type 0: an nn.Linear's weight in place) or GGML blocks (a type id above),
 * `bytes` bytes in all; bias [out_features] float32 or NULL. */
typedef struct {
  const void* data;
  const float* bias;
  int64_t type, out_features, in_features, bytes;
} chunk_llama_cpu_weight;

/* A Llama-family decoder layer: RMSNorm before attention and before the MLP, rotary
 * attention (rotate-half), a gated MLP, residuals around both; optionally RMSNorm on each
 * head of q and k before the rotation (Qwen3, Gemma 3) and on the attention's and the MLP's
 * outputs before their residuals (Gemma 3). A norm multiplies by (norm_offset + weight):
 * offset 0 as Llama's, 1 as Gemma's. All norms take norm_eps. */
typedef struct {
  int64_t hidden_size, num_heads, num_kv_heads, head_dim, intermediate_size;
  int64_t activation; /* the MLP's gate: 0 SiLU, 1 GELU (tanh approximation) */
  double norm_eps, norm_offset;
  const float* input_norm;    /* [hidden_size] */
  const float* q_norm;        /* [head_dim] or NULL */
  const float* k_norm;        /* [head_dim] or NULL */
  const float* attn_out_norm; /* [hidden_size] or NULL */
  const float* mlp_norm;      /* [hidden_size] */
  const float* mlp_out_norm;  /* [hidden_size] or NULL */
  chunk_llama_cpu_weight q, k, v, o, gate, up, down;
  int64_t activations; /* CHUNK_LLAMA_ACTIVATIONS_*: int8 or int16 for the weights in formats with integer codes */
} chunk_llama_cpu_decoder_layer;

/* One adapter's LoRA on one projection: the projection's output gains
 * scale * (x A^T) B^T, a [rank, in_features] and b [out_features, rank] float32 row-major
 * (PEFT's lora_A and lora_B weights; b may be a range of a fused projection's rows). */
typedef struct {
  const float* a;
  const float* b;
  int64_t rank, in_features, out_features;
  double scale;
} chunk_llama_cpu_lora_factor;

/* The rows [row_start, row_end) of a step that run under one adapter, and that adapter's
 * factors for a run of num_layers decoder layers: those of layer l's target t (0..6: q, k,
 * v, o, gate, up, down) are factors[index[l * 7 + t] .. index[l * 7 + t + 1]) (several:
 * adapters applied together, added in that order), index [num_layers * 7 + 1]
 * nondecreasing from 0, factors holding index[num_layers * 7] of them. */
typedef struct {
  int64_t row_start, row_end;
  const chunk_llama_cpu_lora_factor* factors;
  const int64_t* index;
  int64_t num_layers;
} chunk_llama_cpu_lora_segment;

/* A step's rows by adapter: segments in row order, disjoint; rows in none run the base. */
typedef struct {
  const chunk_llama_cpu_lora_segment* segments;
  int64_t num_segments;
} chunk_llama_cpu_lora_rows;

/* `layer` for the step `planned` was made for, float32: hidden_out [q_rows, hidden_size] = the
 * layer applied to hidden_in [q_rows, hidden_size] (a decode step's rows, one new token each,
 * or a prefill's packed tokens), with the rotary cos and sin [q_rows, head_dim] as the model
 * computed them. The step's new K/V go to the plan's write slots of `kv`'s pool, then its
 * attention runs over the plan (a decode plan's row i is batch row row_order[i]). Decode and
 * prefill run the same arithmetic per row. hidden_out may be hidden_in. lora (NULL: none):
 * after each projection, each segment's rows gain its factors' deltas for layer `layer_index`
 * of the segments' tables, each product through the same linear kernel as the rest (so a
 * row's numbers do not depend on the rows beside it); every factor is checked against the
 * weight's sizes before anything is written. */
CHUNK_LLAMA_API int chunk_llama_cpu_decoder_layer_run(const chunk_llama_cpu_planned* planned,
                                                      const chunk_llama_cpu_decoder_layer* layer,
                                                      const chunk_llama_cpu_kv* kv, const float* hidden_in,
                                                      float* hidden_out, const float* cos, const float* sin,
                                                      const chunk_llama_cpu_lora_rows* lora, int64_t layer_index);

/* A model's decoder layers in a row: layer i with its own K/V pool, scale and window kvs[i]. */
typedef struct {
  const chunk_llama_cpu_decoder_layer* const* layers;
  const chunk_llama_cpu_kv* kvs;
  int64_t num_layers;
} chunk_llama_cpu_decoder_stack;

/* Every layer of `stack` as chunk_llama_cpu_decoder_layer_run would run them one after the
 * other, each in place on hidden_out (hidden_in copied there first), layer i with its own
 * rotary cos[i], sin[i] (Gemma 3's sliding and global layers turn by different bases), and
 * layer i of lora's tables (NULL: none; every layer's factors checked before any runs). */
CHUNK_LLAMA_API int chunk_llama_cpu_decoder_stack_run(const chunk_llama_cpu_planned* planned,
                                                      const chunk_llama_cpu_decoder_stack* stack,
                                                      const float* hidden_in, float* hidden_out,
                                                      const float* const* cos, const float* const* sin,
                                                      const chunk_llama_cpu_lora_rows* lora);

#ifdef __cplusplus
}
#endif

#endif
