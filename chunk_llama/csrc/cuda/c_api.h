/* The C interface of the CUDA kernel library (libchunk_llama_cuda_*): plain C types, no
 * torch, the CUDA runtime linked in statically, so one compiled library serves every torch
 * release and needs only the NVIDIA driver (chunk_llama/ops/cuda_lib.py binds it with
 * ctypes; keep its argument lists the same as these). Errors as in ../cpu/c_api.h: 0, or
 * CHUNK_LLAMA_VALUE_ERROR / CHUNK_LLAMA_TYPE_ERROR with chunk_llama_cuda_last_error()'s
 * message (per thread); a CUDA error is reported as CHUNK_LLAMA_CUDA_ERROR. */
#ifndef CHUNK_LLAMA_CUDA_C_API_H
#define CHUNK_LLAMA_CUDA_C_API_H

#include <stdint.h>

#define CHUNK_LLAMA_API __attribute__((visibility("default")))

#ifdef __cplusplus
extern "C" {
#endif

#define CHUNK_LLAMA_CUDA_ABI_VERSION 1

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
/* Floats of workspace one decode call needs. */
CHUNK_LLAMA_API int64_t chunk_llama_cuda_workspace_floats(int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                                                          int64_t head_dim, int64_t num_partial_rows);

/* Decode attention on GPU `device`, launched on `stream` (a cudaStream_t): q [num_seqs,
 * num_heads, head_dim]; K and V pools [capacity, num_kv_heads, chunk_size, kv_head_dim]
 * (the plan's chunk ids are trusted: built from the tree on the device);
 * out, shaped like q; the plan (plan_numel int32s on the device, `DecodePlan.cuda_index`)
 * and its layout (layout_size host integers); the caller's float32 workspace. */
CHUNK_LLAMA_API int chunk_llama_cuda_tpp_decode(int device, const void* q, int64_t num_seqs, int64_t num_heads,
                                                int64_t head_dim, const void* k_cache, const void* v_cache,
                                                int64_t num_kv_heads, int64_t chunk_size, int64_t kv_head_dim,
                                                int dtype, void* out, const int32_t* plan,
                                                int64_t plan_numel, const int64_t* layout, int64_t layout_size,
                                                float* workspace, int64_t workspace_numel, double scale,
                                                int64_t window, void* stream);

#ifdef __cplusplus
}
#endif

#endif
