/* The C interface of the CPU kernel library (libchunk_llama_cpu): plain C types, no torch,
 * so one compiled library serves every torch release and any caller that can pass raw
 * pointers (chunk_llama/ops/cpu_lib.py binds it with ctypes; keep its argument lists the
 * same as these). One entry point per op. Each takes raw pointers and the sizes the
 * caller read off its tensors, checks everything that could make it read or write out of
 * bounds (shapes, the plan's arrays against the pool, the scratch's size), then runs the
 * variant named by `isa`. The caller checks what only it can see: devices, dtypes being
 * the same, contiguity. 0 is success; otherwise the error's kind (CHUNK_LLAMA_VALUE_ERROR,
 * CHUNK_LLAMA_TYPE_ERROR) and chunk_llama_cpu_last_error() its message (per thread). */
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
#define CHUNK_LLAMA_CPU_ABI_VERSION 8

enum { CHUNK_LLAMA_OK = 0, CHUNK_LLAMA_VALUE_ERROR = 1, CHUNK_LLAMA_TYPE_ERROR = 2 };
/* Element types of q and the pool (params.h DType). */
enum { CHUNK_LLAMA_FLOAT32 = 0, CHUNK_LLAMA_BFLOAT16 = 1 };

CHUNK_LLAMA_API int chunk_llama_cpu_abi_version(void);
/* The message of this thread's last failed call. */
CHUNK_LLAMA_API const char* chunk_llama_cpu_last_error(void);
/* The variants in this build, best first, comma-separated ("avx512,avx2,generic"). */
CHUNK_LLAMA_API const char* chunk_llama_cpu_variants(void);
/* 1 if this CPU runs the variant, 0 if not or if the build has no such variant. */
CHUNK_LLAMA_API int chunk_llama_cpu_host_runs(const char* isa);
/* The names of the plan arrays in layout order, comma-separated (plan_layout.h). */
CHUNK_LLAMA_API const char* chunk_llama_cpu_decode_layout(void);
CHUNK_LLAMA_API const char* chunk_llama_cpu_prefill_layout(void);

/* Floats of scratch one call needs (decode: for this plan, as chunk_llama_cpu_tpp_decode
 * takes it, any window); -1 (and an error) for a bad geometry or plan. */
CHUNK_LLAMA_API int64_t chunk_llama_cpu_decode_scratch_floats(int64_t q_rows, int64_t num_heads, int64_t head_dim,
                                                              int64_t num_kv_heads, int64_t chunk_size,
                                                              const int64_t* plan, int64_t plan_numel,
                                                              const int64_t* layout, int64_t layout_size,
                                                              int64_t num_threads);
CHUNK_LLAMA_API int64_t chunk_llama_cpu_prefill_scratch_floats(int64_t num_partial_rows, int64_t num_heads,
                                                               int64_t head_dim, int64_t num_threads);

/* Both attention ops take: q [q_rows, num_heads, head_dim]; the layer's K and V pools
 * [capacity, num_kv_heads, chunk_size, kv_head_dim] with, for each, the elements its
 * memory holds from its first element on (the guard chunk behind the last must be there);
 * out, shaped like q and in q's dtype (q_dtype, which need not be the pool's dtype: float32
 * activations over a bfloat16 pool); the step's plan (plan_numel int64s) and its layout
 * (layout_size host integers, plan_layout.h); the caller's float32 scratch; then the scalars
 * (max_blocks_per_item: the most shared blocks of keys one work item of decode's first
 * phase takes, 0: chosen for the threads). Both compute each query's attention in the same
 * blocks of keys and order (blocks.h): a query's output does not depend on the batch. */
CHUNK_LLAMA_API int chunk_llama_cpu_tpp_decode(
    const void* q, int64_t q_rows, int64_t num_heads, int64_t head_dim, int q_dtype, const void* k_cache,
    const void* v_cache, int64_t capacity, int64_t num_kv_heads, int64_t chunk_size, int64_t kv_head_dim,
    int64_t k_extent, int64_t v_extent, int dtype, void* out, const int64_t* plan, int64_t plan_numel,
    const int64_t* layout, int64_t layout_size, float* scratch, int64_t scratch_numel, double scale, int64_t window,
    int64_t max_blocks_per_item, const char* isa, int num_threads);

CHUNK_LLAMA_API int chunk_llama_cpu_tpp_prefill(
    const void* q, int64_t q_rows, int64_t num_heads, int64_t head_dim, int q_dtype, const void* k_cache,
    const void* v_cache, int64_t capacity, int64_t num_kv_heads, int64_t chunk_size, int64_t kv_head_dim,
    int64_t k_extent, int64_t v_extent, int dtype, void* out, const int64_t* plan, int64_t plan_numel,
    const int64_t* layout, int64_t layout_size, float* scratch, int64_t scratch_numel, double scale, int64_t window,
    const char* isa, int num_threads);

/* y [rows, out_features] = x [rows, in_features] W^T (+ bias), float32, W an nn.Linear's
 * weight [out_features, in_features] in place; bias may be NULL. */
CHUNK_LLAMA_API int chunk_llama_cpu_small_linear(const float* x, int64_t rows, int64_t in_features, const float* weight,
                                                 int64_t out_features, const float* bias, float* y, const char* isa,
                                                 int num_threads);

/* Weights in a GGML block format (GGUF files' quantized tensors; `type` is GGML's type id:
 * 2 Q4_0, 3 Q4_1, 6 Q5_0, 7 Q5_1, 8 Q8_0, 12 Q4_K, 13 Q5_K, 14 Q6_K): `weight` holds
 * out_features (num_rows) rows of in_features / block weights, `weight_bytes` bytes in all.
 * quant_linear: y [rows, out_features] = x [rows, in_features] W^T (+ bias), float32.
 * dequantize: out [num_rows, in_features] = W, float32. */
CHUNK_LLAMA_API int chunk_llama_cpu_quant_linear(const float* x, int64_t rows, int64_t in_features,
                                                 const uint8_t* weight, int64_t weight_bytes, int type,
                                                 int64_t out_features, const float* bias, float* y, const char* isa,
                                                 int num_threads);
CHUNK_LLAMA_API int chunk_llama_cpu_dequantize(const uint8_t* weight, int64_t weight_bytes, int type, int64_t num_rows,
                                               int64_t in_features, float* out, const char* isa, int num_threads);
/* Bytes of one row of in_features weights of `type`; -1 (and an error) if the type is not
 * one of the above or in_features is not a multiple of its block. */
CHUNK_LLAMA_API int64_t chunk_llama_cpu_quant_row_bytes(int type, int64_t in_features);

/* What a layer on GGML blocks multiplies its weights with: x as it is (float32), or x
 * quantized to int8 per group of 32 (quant_act_params.h; the formats with integer codes:
 * Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K). */
enum { CHUNK_LLAMA_ACTIVATIONS_FLOAT32 = 0, CHUNK_LLAMA_ACTIVATIONS_INT8 = 1 };

/* quant_linear's product with a choice of activations, its arguments in one struct. */
typedef struct {
  const float* x;          /* [rows, in_features] */
  int64_t rows, in_features;
  const uint8_t* weight;   /* out_features rows of GGML blocks, weight_bytes in all */
  int64_t weight_bytes, type, out_features;
  const float* bias;       /* [out_features] or NULL */
  float* y;                /* [rows, out_features] */
  int64_t activations;     /* CHUNK_LLAMA_ACTIVATIONS_* */
  const char* isa;         /* the variant; int8 runs chunk_llama_cpu_int8_variant(isa)'s kernel */
  int64_t num_threads;
} chunk_llama_cpu_quant_matmul_args;
CHUNK_LLAMA_API int chunk_llama_cpu_quant_matmul(const chunk_llama_cpu_quant_matmul_args* args);
/* The variant whose int8 kernel runs for variant `isa` on this CPU: `isa` itself, or the
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
  int64_t activations; /* CHUNK_LLAMA_ACTIVATIONS_*: int8 for the weights in formats with integer codes */
} chunk_llama_cpu_decoder_layer;

/* One decode step of `layer` for `rows` sequences (one new token each), float32:
 * hidden_out [rows, hidden_size] = the layer applied to hidden_in [rows, hidden_size], the
 * rotary cos and sin [rows, head_dim] as the model computed them. The new K/V of token
 * write_token[i] go to slot write_offset[i] of chunk write_chunk[i] of the pool (as
 * chunk_llama_cpu_tpp_decode takes it), then attention runs over the decode plan, whose
 * row i is batch row row_order[i] (row_order NULL: the same order). */
CHUNK_LLAMA_API int chunk_llama_cpu_decoder_layer_decode(
    const chunk_llama_cpu_decoder_layer* layer, const float* hidden_in, float* hidden_out, int64_t rows,
    const float* cos, const float* sin, const int64_t* write_token, const int64_t* write_chunk,
    const int64_t* write_offset, int64_t num_writes, const int64_t* row_order, void* k_cache, void* v_cache,
    int64_t capacity, int64_t num_kv_heads, int64_t chunk_size, int64_t kv_head_dim, int64_t k_extent,
    int64_t v_extent, int dtype, const int64_t* plan, int64_t plan_numel, const int64_t* layout,
    int64_t layout_size, float* scratch, int64_t scratch_numel, double scale, int64_t window,
    int64_t max_blocks_per_item, const char* isa, int num_threads);

/* The same layer for a prefill step: hidden_in [rows, hidden_size] the step's new tokens
 * (packed), their rotary cos and sin [rows, head_dim]; attention over the prefill plan (as
 * chunk_llama_cpu_tpp_prefill takes it). The same arithmetic per row as the decode entry. */
CHUNK_LLAMA_API int chunk_llama_cpu_decoder_layer_prefill(
    const chunk_llama_cpu_decoder_layer* layer, const float* hidden_in, float* hidden_out, int64_t rows,
    const float* cos, const float* sin, const int64_t* write_token, const int64_t* write_chunk,
    const int64_t* write_offset, int64_t num_writes, void* k_cache, void* v_cache, int64_t capacity,
    int64_t num_kv_heads, int64_t chunk_size, int64_t kv_head_dim, int64_t k_extent, int64_t v_extent, int dtype,
    const int64_t* plan, int64_t plan_numel, const int64_t* layout, int64_t layout_size, float* scratch,
    int64_t scratch_numel, double scale, int64_t window, const char* isa, int num_threads);

/* num_layers decoder layers in a row, as chunk_llama_cpu_decoder_layer_decode would run
 * them one after the other, each in place on hidden_out (the input copied there first):
 * layer i writes to and attends over k_caches[i], v_caches[i] (k_extents[i], v_extents[i]
 * elements), pools of one geometry, with its own rotary cos[i], sin[i] and attention
 * window windows[i] (Gemma 3's sliding and global layers differ in both); rows, writes,
 * row order and the rest of the decode call's tail are the step's, shared. */
CHUNK_LLAMA_API int chunk_llama_cpu_decoder_stack_decode(
    const chunk_llama_cpu_decoder_layer* const* layers, void* const* k_caches, void* const* v_caches,
    int64_t num_layers, const float* hidden_in, float* hidden_out, int64_t rows, const float* const* cos,
    const float* const* sin, const int64_t* write_token, const int64_t* write_chunk, const int64_t* write_offset,
    int64_t num_writes, const int64_t* row_order, int64_t capacity, int64_t num_kv_heads, int64_t chunk_size,
    int64_t kv_head_dim, const int64_t* k_extents, const int64_t* v_extents, int dtype, const int64_t* plan,
    int64_t plan_numel, const int64_t* layout, int64_t layout_size, float* scratch, int64_t scratch_numel,
    double scale, const int64_t* windows, int64_t max_blocks_per_item, const char* isa, int num_threads);

#ifdef __cplusplus
}
#endif

#endif
