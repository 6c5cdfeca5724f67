// The AVX2 + FMA variant of the CPU kernel (x86-64 only; empty elsewhere). Only the
// code after the target pragma, all in namespace chunk_attn_cpu::avx2, may use AVX2.
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

#include "prelude.h"

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif

#define CHUNK_ATTN_ISA avx2
#include "lanes_avx2.h"
#include "kernel.h"
#include "lanes_int8_avx2.h"
#include "quant_act.h"

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif
