// The LoRA deltas a fused decoder layer adds per group of rows (chunk_llama_cpu_lora_rows,
// c_api.h): per-request adapters in a shared batch, as punica's and S-LoRA's segmented GEMM
// compute them. The base product runs once for every row (layer.cpp, whatever the weight's
// form: float32 or GGML blocks); each segment of rows under an adapter then gains
// scale * (x A^T) B^T: the first product through the variant's small_linear (the kernel of
// the op-by-op path, ops/lora.py add_lora_deltas through the step's linear), the second
// through its lora_expand (layer_ops.h: an outer product over B^T, which small_linear's
// tiles compute at a third of the speed for so short a rank), B transposed here once per
// call. Each output of either is a fixed sequence of FMAs whatever rows come with it, so a
// row's numbers do not depend on which other adapters (or none) share its step (batch
// invariance). The sum is rounded as PEFT's `result + delta * scaling` rounds it.
// Torch-free; baseline flags, like layer.cpp.
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "api_internal.h"
#include "c_api.h"
#include "chunk_llama/api_errors.h"

namespace chunk_llama_cpu_internal {

namespace {

const char* const kTargetNames[kLoraTargets] = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                "down_proj"};

const chunk_llama_cpu_weight& target_weight(const chunk_llama_cpu_decoder_layer& L, int target) {
  const chunk_llama_cpu_weight* weights[kLoraTargets] = {&L.q, &L.k, &L.v, &L.o, &L.gate, &L.up, &L.down};
  return *weights[target];
}

}  // namespace

int64_t check_lora(const chunk_llama_cpu_lora_rows* lora, int64_t layer, const chunk_llama_cpu_decoder_layer& L,
                   int64_t rows) {
  if (lora == nullptr) return 0;
  CHECK_VALUE(lora->num_segments >= 0 && (lora->num_segments == 0 || lora->segments != nullptr),
              "LoRA rows: ", lora->num_segments, " segments and ", lora->segments == nullptr ? "no" : "an",
              " array of them");
  int64_t floats = 0, previous_end = 0;
  for (int64_t s = 0; s < lora->num_segments; ++s) {
    const chunk_llama_cpu_lora_segment& seg = lora->segments[s];
    CHECK_VALUE(seg.row_start >= previous_end && seg.row_start < seg.row_end && seg.row_end <= rows,
                "LoRA segment ", s, ": rows [", seg.row_start, ", ", seg.row_end, ") are not a nonempty range of the ",
                "step's ", rows, " rows after the previous segment's (which end at ", previous_end, ")");
    previous_end = seg.row_end;
    CHECK_VALUE(layer >= 0 && layer < seg.num_layers && seg.index != nullptr, "LoRA segment ", s, ": its table of ",
                seg.num_layers, " layers has no layer ", layer);
    const int64_t* index = seg.index + layer * kLoraTargets;
    const int64_t total = seg.index[seg.num_layers * kLoraTargets];
    CHECK_VALUE(seg.index[0] == 0 && index[0] >= 0 && index[kLoraTargets] <= total && (total == 0 || seg.factors),
                "LoRA segment ", s, ": layer ", layer, "'s factors [", index[0], ", ", index[kLoraTargets],
                ") are not inside the table's ", total);
    const int64_t n = seg.row_end - seg.row_start;
    for (int t = 0; t < kLoraTargets; ++t) {
      CHECK_VALUE(index[t] <= index[t + 1], "LoRA segment ", s, ": layer ", layer, "'s index decreases at ",
                  kTargetNames[t]);
      const chunk_llama_cpu_weight& w = target_weight(L, t);
      for (int64_t f = index[t]; f < index[t + 1]; ++f) {
        const chunk_llama_cpu_lora_factor& factor = seg.factors[f];
        CHECK_VALUE(factor.a != nullptr && factor.b != nullptr && factor.rank >= 1 &&
                        factor.in_features == w.in_features && factor.out_features == w.out_features &&
                        std::isfinite(factor.scale),
                    "LoRA segment ", s, " (rows ", seg.row_start, " to ", seg.row_end, "), layer ", layer, ": a factor of ",
                    kTargetNames[t], " maps ", factor.in_features, " -> ", factor.out_features, " features with rank ",
                    factor.rank, ", the layer's ", kTargetNames[t], " ", w.in_features, " -> ", w.out_features);
        floats = std::max(floats, (n + factor.out_features) * factor.rank);
      }
    }
  }
  return floats;
}

void add_lora(const chunk_llama_cpu_plan& plan, const chunk_llama_cpu_lora_rows* lora, int64_t layer, int target,
              const float* x, float* y, float* scratch) {
  if (lora == nullptr) return;
  for (int64_t s = 0; s < lora->num_segments; ++s) {
    const chunk_llama_cpu_lora_segment& seg = lora->segments[s];
    const int64_t* index = seg.index + layer * kLoraTargets + target;
    const int64_t n = seg.row_end - seg.row_start;
    for (int64_t f = index[0]; f < index[1]; ++f) {
      const chunk_llama_cpu_lora_factor& factor = seg.factors[f];
      const int64_t in = factor.in_features, out = factor.out_features, rank = factor.rank;
      float *t = scratch, *bt = scratch + n * rank;
      // t [n, rank] = x[rows] A^T; bt [rank, out] = B^T; then y[rows] += (t bt) * scale
      plan.variant->linear(chunk_attn_cpu::LinearParams{x + seg.row_start * in, factor.a, nullptr, t, n, rank, in,
                                                        plan.num_threads});
      for (int64_t j = 0; j < out; ++j)
        for (int64_t k = 0; k < rank; ++k) bt[k * out + j] = factor.b[j * rank + k];
      plan.variant->lora_expand(chunk_attn_cpu::LoraExpandParams{t, bt, y + seg.row_start * out, n, rank, out,
                                                                 static_cast<float>(factor.scale), plan.num_threads});
    }
  }
}

}  // namespace chunk_llama_cpu_internal
