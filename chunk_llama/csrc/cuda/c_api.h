/* The C interface of the CUDA kernel library (libchunk_llama_cuda_*): plain C types, no
 * torch, the CUDA runtime linked in statically, so one compiled library serves every torch
 * release and needs only the NVIDIA driver (chunk_llama/ops/cuda/binding.py binds it with
 * ctypes; keep its structs and argument lists the same as these). Errors as in ../cpu/c_api.h: 0, or
 * CHUNK_LLAMA_VALUE_ERROR / CHUNK_LLAMA_TYPE_ERROR with chunk_llama_cuda_last_error()'s
 * message (per thread); a CUDA error is reported as CHUNK_LLAMA_CUDA_ERROR. */
#ifndef CHUNK_LLAMA_CUDA_C_API_H
#define CHUNK_LLAMA_CUDA_C_API_H

#include <stdint.h>

#define CHUNK_LLAMA_API __attribute__((visibility("default")))

#ifdef __cplusplus
extern "C" {
#endif

#define CHUNK_LLAMA_CUDA_ABI_VERSION 2

enum { CHUNK_LLAMA_CUDA_ERROR = 3 };  /* beside CHUNK_LLAMA_OK, _VALUE_ERROR (1), _TYPE_ERROR (2) */
/* Element types of q and the pool (chunk_attn/params.h DType). */
enum { CHUNK_LLAMA_FLOAT16 = 0, CHUNK_LLAMA_CUDA_BFLOAT16 = 1 };

CHUNK_LLAMA_API int chunk_llama_cuda_abi_version(void);
CHUNK_LLAMA_API const char* chunk_llama_cuda_last_error(void);
/* The CUDA runtime version the library was built with (e.g. 13000). */
CHUNK_LLAMA_API int chunk_llama_cuda_runtime_version(void);
/* 0 if the kernels run on GPU `device`: the driver is new enough for this library's CUDA
 * runtime and the library holds code for the GPU's architecture (a cubin, or PTX the
 * driver compiles); else CHUNK_LLAMA_CUDA_ERROR and the reason. */
CHUNK_LLAMA_API int chunk_llama_cuda_check_device(int device);
/* The names of the plan arrays in layout order, comma-separated (chunk_attn/params.h). */
CHUNK_LLAMA_API const char* chunk_llama_cuda_decode_layout(void);

/* Decode attention, planned once per step and run per layer (the CPU library's convention,
 * ../cpu/c_api.h): a handle made once per cache and GPU is re-planned in place each step;
 * planning checks the geometry, that every array of the plan lies inside the plan tensor
 * and the workspace's size, and decides the launch (the split of the sequence-first phase);
 * a layer's call checks its pool against the plan in O(1) and launches. */
typedef struct chunk_llama_cuda_plan chunk_llama_cuda_plan;

/* The step's plan on GPU `device`: its int32 arrays (index_numel of them on the device,
 * `DecodePlan.cuda_index`; their chunk ids are trusted: built from the tree on the device)
 * and its layout (layout_size host integers); q [num_seqs, num_heads, head_dim] and the
 * pools [capacity, num_kv_heads, chunk_size, head_dim] in `dtype`. */
typedef struct {
  int32_t device;
  int32_t dtype;
  const int32_t* index;
  int64_t index_numel;
  const int64_t* layout;
  int64_t layout_size;
  int64_t num_seqs, num_heads, num_kv_heads, head_dim, chunk_size;
} chunk_llama_cuda_plan_params;

/* A made plan as every call of its step passes it: the handle, the generation plan_make
 * returned (another is refused: re-planned since, or its planning failed) and the caller's
 * float32 workspace on the device, of at least the floats plan_make returned. */
typedef struct {
  const chunk_llama_cuda_plan* plan;
  uint64_t generation;
  float* workspace;
  int64_t workspace_numel;
} chunk_llama_cuda_planned;

/* One layer's K and V pools (the plan's geometry and dtype), its scale and sliding window. */
typedef struct {
  const void* k;
  const void* v;
  int64_t num_kv_heads, chunk_size, head_dim;
  int64_t window;
  double scale;
  int32_t dtype;
} chunk_llama_cuda_kv;

CHUNK_LLAMA_API chunk_llama_cuda_plan* chunk_llama_cuda_plan_new(void);
CHUNK_LLAMA_API void chunk_llama_cuda_plan_free(chunk_llama_cuda_plan* plan);
/* Plans `params` into `plan` (its generation advances whether or not this succeeds); on
 * success *generation and *workspace_floats (what one call needs). */
CHUNK_LLAMA_API int chunk_llama_cuda_plan_make(chunk_llama_cuda_plan* plan, const chunk_llama_cuda_plan_params* params,
                                               uint64_t* generation, int64_t* workspace_floats);
/* Decode attention of q [num_seqs, num_heads, head_dim] in plan order over one layer's pools
 * into out (shaped like q), launched on `stream` (a cudaStream_t) of the plan's GPU. */
CHUNK_LLAMA_API int chunk_llama_cuda_attend(const chunk_llama_cuda_planned* planned, const chunk_llama_cuda_kv* kv,
                                            const void* q, void* out, void* stream);

#ifdef __cplusplus
}
#endif

#endif
