// One decoder layer of the Llama family (Llama, Mistral, Qwen2, Qwen3, Gemma 3, Phi-3) for a
// decode step or a prefill, in one call on the step's made plan (chunk_llama_cpu_decoder_layer_run;
// a model's layers in a row: chunk_llama_cpu_decoder_stack_run, c_api.h). A decode step of
// one sequence on a small model spends more time in Python and torch's dispatch around its kernels than in them (about 30 ops per layer); this runs the
// whole layer behind one ctypes call, with the same kernels the op-by-op path runs
// (small_linear or quant_linear per weight, the attention) and the elementwise steps in
// transformers' order: the norms and the gated activation are the variant's (layer_ops.h),
// the rest here (compiled with baseline flags, like c_api.cpp). Decode and prefill run the
// same code on their rows, so a token's K/V and outputs do not depend on which one computed
// them (the attention's blocks, blocks.h, see to the rest). Rows under LoRA adapters gain
// their deltas after each projection (lora.cpp), so adapters share the fused call too.
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "api_internal.h"
#include "c_api.h"
#include "chunk_llama/api_errors.h"
#include "scalar.h"

namespace chunk_llama_cpu_internal {
namespace {

using chunk_attn_cpu::Variant;

// y [rows, out] = x [rows, in] W^T (+ bias) with the variant's kernel for the weight's form
// (activations int8 or int16: GGML blocks with integer codes multiply x quantized so, quant_act.h).
void linear(const Variant& variant, const chunk_llama_cpu_weight& w, const float* x, float* y, int64_t rows,
            float* quant_scratch, int num_threads, int64_t activations) {
  if (activations != CHUNK_LLAMA_ACTIVATIONS_FLOAT32 && w.type != 0 && chunk_attn_cpu::quant_int8_supports(static_cast<int>(w.type))) {
    quant_int8_linear(variant.name, chunk_attn_cpu::QuantInt8Params{x, static_cast<const uint8_t*>(w.data),
                                                                    static_cast<int>(w.type), w.bias, y, rows,
                                                                    w.out_features, w.in_features, num_threads,
                                                                    nullptr,
                                                                    activations == CHUNK_LLAMA_ACTIVATIONS_INT16});
  } else if (w.type == 0) {
    variant.linear(chunk_attn_cpu::LinearParams{x, static_cast<const float*>(w.data), w.bias, y, rows,
                                                w.out_features, w.in_features, num_threads});
  } else {
    variant.quant_linear(chunk_attn_cpu::QuantLinearParams{x, static_cast<const uint8_t*>(w.data),
                                                           static_cast<int>(w.type), w.bias, y, rows, w.out_features,
                                                           w.in_features, num_threads, quant_scratch});
  }
}

void check_weight(const chunk_llama_cpu_weight& w, const char* name, int64_t out_features, int64_t in_features,
                  bool integer) {
  CHECK_VALUE(w.data != nullptr && w.out_features == out_features && w.in_features == in_features, "decoder layer: ",
              name, " is [", w.out_features, ", ", w.in_features, "], the layer needs [", out_features, ", ",
              in_features, "]");
  const int64_t bytes = w.type == 0 ? out_features * in_features * 4
                                    : row_bytes_of("decoder layer", static_cast<int>(w.type), in_features) * out_features;
  CHECK_VALUE(w.bytes == bytes, "decoder layer: ", name, " holds ", w.bytes, " bytes, not the ", bytes,
              " its shape and type need");
  check_tiles("decoder layer", static_cast<int>(w.type), out_features, integer);
}

// transformers' apply_rotary_pos_emb on one row of heads: x * cos + rotate_half(x) * sin,
// rotate_half(x) = cat(-x[d/2:], x[:d/2]). x [heads, d], cos/sin [d], in place.
void rotate(float* x, int64_t heads, int64_t d, const float* cos, const float* sin) {
  const int64_t half = d / 2;
  for (int64_t h = 0; h < heads; ++h, x += d) {
    for (int64_t i = 0; i < half; ++i) {
      const float a = x[i], b = x[i + half];
      const float first = a * cos[i], first_rot = -b * sin[i];
      const float second = b * cos[i + half], second_rot = a * sin[i + half];
      x[i] = first + first_rot;
      x[i + half] = second + second_rot;
    }
  }
}

}  // namespace
}  // namespace chunk_llama_cpu_internal

using chunk_llama_api::guarded;
using namespace chunk_llama_cpu_internal;

namespace chunk_llama_cpu_internal {
namespace {

// The layer applied to hidden_in [rows, hidden_size] into hidden_out (which may be hidden_in:
// it is read whole into the norm's buffer before the first write, then only element by
// element), rows the plan's, its K/V written to the plan's slots of kv's pool (both checked
// when the plan was made, the pool against it here); attend(q [rows, q_width], out [rows,
// q_width], spare [rows, q_width]) runs the attention once the new K/V are in the pool.
// lora (or NULL): the deltas of its rows under adapters, from its tables' layer `layer`.
template <typename Attend>
void run_layer(const chunk_llama_cpu_plan& plan, const chunk_llama_cpu_decoder_layer& L,
               const chunk_llama_cpu_kv& kv, const float* hidden_in, float* hidden_out, const float* cos,
               const float* sin, const chunk_llama_cpu_lora_rows* lora, int64_t layer, Attend&& attend) {
  const Variant& variant = *plan.variant;
  const int64_t rows = plan.g.q_rows, num_kv_heads = plan.g.num_kv_heads, chunk_size = plan.g.chunk_size;
  const int num_threads = plan.num_threads;
  check_kv(kv, plan.g);
  CHECK_VALUE(L.num_kv_heads == num_kv_heads && L.num_heads == plan.g.num_heads && L.head_dim == plan.g.head_dim,
              "decoder layer: its ", L.num_heads, " heads, ", L.num_kv_heads, " KV heads of ", L.head_dim,
              " are not the plan's ", plan.g.num_heads, ", ", num_kv_heads, " of ", plan.g.head_dim);
  CHECK_VALUE(hidden_in != nullptr && hidden_out != nullptr && cos != nullptr && sin != nullptr,
              "decoder layer: hidden states, cos and sin are needed");
  const int64_t hidden = L.hidden_size, d = L.head_dim, inter = L.intermediate_size;
  const int64_t q_width = L.num_heads * d, kv_width = num_kv_heads * d;
  CHECK_VALUE(hidden > 0 && inter > 0 && d % 2 == 0 && num_threads >= 1, "decoder layer: bad sizes (hidden ",
              hidden, ", intermediate ", inter, ", head_dim ", d, ")");
  CHECK_VALUE(L.activation == 0 || L.activation == 1, "decoder layer: activation ", L.activation,
              " is not 0 (SiLU) or 1 (GELU, tanh)");
  CHECK_VALUE(L.activations == CHUNK_LLAMA_ACTIVATIONS_FLOAT32 || L.activations == CHUNK_LLAMA_ACTIVATIONS_INT8 ||
                  L.activations == CHUNK_LLAMA_ACTIVATIONS_INT16,
              "decoder layer: activations ", L.activations, " is not 0 (float32), 1 (int8) or 2 (int16)");
  CHECK_VALUE(L.input_norm != nullptr && L.mlp_norm != nullptr && (L.q_norm == nullptr) == (L.k_norm == nullptr),
              "decoder layer: the input and MLP norms are needed, q and k norms both or neither");
  const bool integer = L.activations != CHUNK_LLAMA_ACTIVATIONS_FLOAT32;
  check_weight(L.q, "q_proj", q_width, hidden, integer);
  check_weight(L.k, "k_proj", kv_width, hidden, integer);
  check_weight(L.v, "v_proj", kv_width, hidden, integer);
  check_weight(L.o, "o_proj", hidden, q_width, integer);
  check_weight(L.gate, "gate_proj", inter, hidden, integer);
  check_weight(L.up, "up_proj", inter, hidden, integer);
  check_weight(L.down, "down_proj", hidden, inter, integer);
  const int64_t lora_floats = check_lora(lora, layer, L, rows);  // (before anything is written)
  // one buffer for every intermediate: h [rows, hidden], q and the attention's output (and
  // their plan-ordered copies) [rows, q_width] each, k and v [rows, kv_width], gate and up
  // [rows, inter], the quantized kernels' per-thread scratch, and the LoRA products'
  const int64_t widest_in = std::max({inter, q_width, hidden});
  const int64_t quant_floats = chunk_attn_cpu::quant_scratch_floats(rows, widest_in) * num_threads;
  const int64_t floats = rows * (hidden + 3 * q_width + 2 * kv_width + 2 * inter) + quant_floats + lora_floats;
  if (plan.layer_buffer.size() < static_cast<size_t>(floats)) plan.layer_buffer.resize(floats);  // (grown once)
  float *h = plan.layer_buffer.data(), *q = h + rows * hidden, *scratch_q = q + rows * q_width, *attn = scratch_q + rows * q_width;
  float *k = attn + rows * q_width, *v = k + rows * kv_width, *gate = v + rows * kv_width, *up = gate + rows * inter;
  float *quant_scratch = up + rows * inter, *lora_scratch = quant_scratch + quant_floats;
  // a projection, then its rows' LoRA deltas (target: c_api.h's order q, k, v, o, gate, up, down)
  const auto project = [&](const chunk_llama_cpu_weight& w, int target, const float* x, float* y) {
    linear(variant, w, x, y, rows, quant_scratch, num_threads, L.activations);
    add_lora(plan, lora, layer, target, x, y, lora_scratch);
  };

  const float eps = static_cast<float>(L.norm_eps), offset = static_cast<float>(L.norm_offset);
  const auto norm = [&](const float* x, const float* weight, float* out, int64_t count, int64_t n) {
    variant.rms_norm(chunk_attn_cpu::NormParams{x, weight, offset, eps, out, count, n, num_threads});
  };
  // attention
  norm(hidden_in, L.input_norm, h, rows, hidden);
  project(L.q, 0, h, q);
  project(L.k, 1, h, k);
  project(L.v, 2, h, v);
  if (L.q_norm != nullptr) {  // each head's vector
    norm(q, L.q_norm, q, rows * L.num_heads, d);
    norm(k, L.k_norm, k, rows * num_kv_heads, d);
  }
  for (int64_t r = 0; r < rows; ++r) {
    rotate(q + r * q_width, L.num_heads, d, cos + r * d, sin + r * d);
    rotate(k + r * kv_width, num_kv_heads, d, cos + r * d, sin + r * d);
  }
  // a 16-bit pool (check_kv took float32, bfloat16 or float16) holds them rounded to nearest even, as torch's copy does
  const int64_t num_writes = plan.num_writes;
  const int64_t *write_token = plan.writes.data(), *write_chunk = write_token + num_writes;
  const int64_t* write_offset = write_chunk + num_writes;
  const auto store = [&](auto* k_cache, auto* v_cache) {
    for (int64_t i = 0; i < num_writes; ++i)
      for (int64_t head = 0; head < num_kv_heads; ++head) {
        const int64_t slot = ((write_chunk[i] * num_kv_heads + head) * chunk_size + write_offset[i]) * d;
        const int64_t from = write_token[i] * kv_width + head * d;
        for (int64_t j = 0; j < d; ++j) {
          chunk_attn_cpu::store_scalar(k_cache, slot + j, k[from + j]);
          chunk_attn_cpu::store_scalar(v_cache, slot + j, v[from + j]);
        }
      }
  };
  if (kv.dtype == CHUNK_LLAMA_BFLOAT16)
    store(static_cast<uint16_t*>(kv.k), static_cast<uint16_t*>(kv.v));
  else if (kv.dtype == CHUNK_LLAMA_CPU_FLOAT16)
    store(static_cast<chunk_attn_cpu::Half*>(kv.k), static_cast<chunk_attn_cpu::Half*>(kv.v));
  else
    store(static_cast<float*>(kv.k), static_cast<float*>(kv.v));
  attend(q, attn, scratch_q);
  project(L.o, 3, attn, h);
  if (L.attn_out_norm != nullptr) norm(h, L.attn_out_norm, h, rows, hidden);
  for (int64_t i = 0; i < rows * hidden; ++i) hidden_out[i] = hidden_in[i] + h[i];

  // MLP
  norm(hidden_out, L.mlp_norm, h, rows, hidden);
  project(L.gate, 4, h, gate);
  project(L.up, 5, h, up);
  variant.gate_mul(chunk_attn_cpu::GateParams{static_cast<int>(L.activation), gate, up, rows * inter, num_threads});
  project(L.down, 6, gate, h);
  if (L.mlp_out_norm != nullptr) norm(h, L.mlp_out_norm, h, rows, hidden);
  for (int64_t i = 0; i < rows * hidden; ++i) hidden_out[i] = hidden_out[i] + h[i];
}

}  // namespace
}  // namespace chunk_llama_cpu_internal

namespace chunk_llama_cpu_internal {
namespace {

// One layer of the planned step: a decode plan's rows reordered for the attention where the
// plan says so (plan row i is batch row row_order[i]).
void decoder_layer(const chunk_llama_cpu_plan& plan, const chunk_llama_cpu_planned& planned,
                   const chunk_llama_cpu_decoder_layer& L, const chunk_llama_cpu_kv& kv, const float* hidden_in,
                   float* hidden_out, const float* cos, const float* sin, const chunk_llama_cpu_lora_rows* lora,
                   int64_t layer) {
  const int64_t rows = plan.g.q_rows, q_width = L.num_heads * L.head_dim;
  const int64_t* row_order = plan.row_order.empty() ? nullptr : plan.row_order.data();
  run_layer(plan, L, kv, hidden_in, hidden_out, cos, sin, lora, layer, [&](float* q, float* attn, float* spare) {
    // the plan's rows are the batch's in another order: q and the output through spare
    const float* q_in = q;
    if (row_order != nullptr) {
      for (int64_t r = 0; r < rows; ++r)
        std::copy(q + row_order[r] * q_width, q + (row_order[r] + 1) * q_width, spare + r * q_width);
      q_in = spare;
    }
    float* out = row_order != nullptr ? q : attn;  // q is not read again once spare holds it
    run_attention(plan, planned, kv, q_in, CHUNK_LLAMA_FLOAT32, out);
    if (row_order != nullptr)
      for (int64_t r = 0; r < rows; ++r)
        std::copy(out + r * q_width, out + (r + 1) * q_width, attn + row_order[r] * q_width);
  });
}

}  // namespace
}  // namespace chunk_llama_cpu_internal

extern "C" {

int chunk_llama_cpu_decoder_layer_run(const chunk_llama_cpu_planned* planned, const chunk_llama_cpu_decoder_layer* layer,
                                  const chunk_llama_cpu_kv* kv, const float* hidden_in, float* hidden_out,
                                  const float* cos, const float* sin, const chunk_llama_cpu_lora_rows* lora,
                                  int64_t layer_index) {
  return guarded([&] {
    const chunk_llama_cpu_plan& plan = checked_plan(planned);
    CHECK_VALUE(layer != nullptr && kv != nullptr, "decoder layer: the layer and its pool are needed");
    decoder_layer(plan, *planned, *layer, *kv, hidden_in, hidden_out, cos, sin, lora, layer_index);
  });
}

int chunk_llama_cpu_decoder_stack_run(const chunk_llama_cpu_planned* planned, const chunk_llama_cpu_decoder_stack* stack,
                                      const float* hidden_in, float* hidden_out, const float* const* cos,
                                      const float* const* sin, const chunk_llama_cpu_lora_rows* lora) {
  return guarded([&] {
    const chunk_llama_cpu_plan& plan = checked_plan(planned);
    CHECK_VALUE(stack != nullptr && stack->num_layers >= 1 && stack->layers != nullptr && stack->kvs != nullptr &&
                    cos != nullptr && sin != nullptr && hidden_in != nullptr && hidden_out != nullptr,
                "decoder stack: its layers, pools, rotary tables and hidden states are needed");
    const int64_t hidden = stack->layers[0]->hidden_size;
    for (int64_t i = 0; i < stack->num_layers; ++i) {  // (before any layer runs: a failed check writes nothing)
      CHECK_VALUE(stack->layers[i] != nullptr && stack->layers[i]->hidden_size == hidden && cos[i] != nullptr &&
                      sin[i] != nullptr,
                  "decoder stack: layer ", i, " has another hidden size than layer 0's ", hidden, " or no rotary");
      check_kv(stack->kvs[i], plan.g);
      check_lora(lora, i, *stack->layers[i], plan.g.q_rows);
    }
    std::copy(hidden_in, hidden_in + plan.g.q_rows * hidden, hidden_out);
    for (int64_t i = 0; i < stack->num_layers; ++i)  // each layer in place on hidden_out
      decoder_layer(plan, *planned, *stack->layers[i], stack->kvs[i], hidden_out, hidden_out, cos[i], sin[i], lora,
                    i);
  });
}

}  // extern "C"
