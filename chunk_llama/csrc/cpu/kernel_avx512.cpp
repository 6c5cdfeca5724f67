// The AVX-512 variant of the CPU kernel (x86-64 only; empty elsewhere). Only the code
// after the target pragma, all in namespace chunk_attn_cpu::avx512, may use AVX-512.
// CHUNK_ATTN_EMULATE_AVX512 (the torch-free test driver only) builds it on SIMDe's
// portable AVX-512 instead, so its logic is tested on CPUs without AVX-512.
#if defined(CHUNK_ATTN_EMULATE_AVX512)
#include "avx512_emulation.h"
#include "prelude.h"
#define CHUNK_ATTN_ISA avx512
#include "lanes_avx512.h"
#include "kernel.h"
#include "lanes_int8_avx512.h"
#include "quant_act.h"

#elif defined(__x86_64__) || defined(_M_X64)
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ < 13
// GCC 12's _mm512_undefined_ps() is `__m512 __Y = __Y;`, which -Wuninitialized flags
// at every inlined use (GCC bug 105593, fixed in 13): not this file's code.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>

#include "prelude.h"

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma,f16c")
#endif

#define CHUNK_ATTN_ISA avx512
#include "lanes_avx512.h"
#include "kernel.h"

// The int8 activations' kernel (quant_act.h) also needs AVX512-BW and VNNI: only its code,
// which the variant runs where the CPU has them (variants.h), is compiled for them.
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512bw,avx512vl,avx512vnni"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")
#endif
#include "lanes_int8_avx512.h"
#include "quant_act.h"
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif
