// The portable variant of the CPU kernel: plain C++ lanes, compiled for the baseline
// of whatever architecture builds it. The fallback for CPUs without a lanes_<isa>.h.
#include "prelude.h"

#define CHUNK_ATTN_ISA generic
#include "lanes_generic.h"
#include "kernel.h"
namespace chunk_attn_cpu {
namespace generic {
#include "lanes_int8_portable.h"
}  // namespace generic
}  // namespace chunk_attn_cpu
#include "quant_act.h"
