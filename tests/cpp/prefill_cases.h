// Torch-free correctness cases of the CPU prefill kernel (prefill_cases.cpp), run by
// kernel_test.cpp for every variant it tests.
#pragma once

#include "variants.h"

struct PrefillSummary {
  int cases = 0, failures = 0;
  double worst = 0;  // largest error in units of the allowed error (NaN sticks)
  // cases with a segment that starts inside a chunk, and with one that ends inside a
  // chunk before the sequence's next (token-granular sharing)
  int starts_inside = 0, ends_inside = 0;
};

PrefillSummary run_prefill_cases(const chunk_attn_cpu::Variant& variant);
