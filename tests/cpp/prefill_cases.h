// Torch-free correctness cases of the CPU prefill kernel (prefill_cases.cpp), run by
// kernel_test.cpp for every variant it tests.
#pragma once

#include "variants.h"

struct PrefillSummary {
  // plain steps (no context phase)
  int cases = 0;
  double worst = 0;  // largest error in units of the allowed error (NaN sticks)
  // cases with a segment that starts inside a chunk, and with one that ends inside a
  // chunk before the sequence's next (token-granular sharing)
  int starts_inside = 0, ends_inside = 0;
  // steps through the context phase (shared prefixes read by several sequences at once)
  int context_cases = 0;
  double context_worst = 0;
  int with_context = 0;     // cases with context items
  int chained = 0;          // ... with an item starting from a wider run's states
  int partly_covered = 0;   // ... with a tile segment that starts before its sequence's ctx_end
  int writers = 0;          // ... with a sequence computing keys another reads as context
  int items_in_group = 0;   // ... with an item that ends inside a token's GQA group
  int failures = 0;         // of either kind, and coverage the cases lack
};

PrefillSummary run_prefill_cases(const chunk_attn_cpu::Variant& variant);
