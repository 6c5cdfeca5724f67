// The NEON variant of the CPU kernel (aarch64 only, where Advanced SIMD is part of the
// base architecture, so no target pragma is needed; empty elsewhere).
#if defined(__aarch64__)
#include <arm_neon.h>

#include "prelude.h"

#define CHUNK_ATTN_ISA neon
#include "lanes_neon.h"
#include "kernel.h"
namespace chunk_attn_cpu {
namespace neon {
#include "lanes_int8_portable.h"
}  // namespace neon
}  // namespace chunk_attn_cpu
#include "quant_act.h"
#endif
