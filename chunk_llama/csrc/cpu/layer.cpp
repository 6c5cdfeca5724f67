// One decoder layer of the Llama family (Llama, Mistral, Qwen2, Qwen3, Gemma 3, Phi-3) for a
// decode step or a prefill, in one call (chunk_llama_cpu_decoder_layer_decode and _prefill,
// c_api.h). A decode step of one sequence on a small model spends more time in Python and
// torch's dispatch around its kernels than in them (about 30 ops per layer); this runs the
// whole layer behind one ctypes call, with the same kernels the op-by-op path runs
// (small_linear or quant_linear per weight, the attention) and the elementwise steps in
// transformers' order: the norms and the gated activation are the variant's (layer_ops.h),
// the rest here (compiled with baseline flags, like c_api.cpp). Decode and prefill run the
// same code on their rows, so a token's K/V and outputs do not depend on which one computed
// them (the attention's blocks, blocks.h, see to the rest).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>

#include "api_internal.h"
#include "c_api.h"
#include "chunk_llama/api_errors.h"
#include "scalar.h"

namespace chunk_llama_cpu_internal {
namespace {

using chunk_attn_cpu::Variant;

// y [rows, out] = x [rows, in] W^T (+ bias) with the variant's kernel for the weight's form
// (int8: GGML blocks with integer codes multiply x quantized to int8, quant_act.h).
void linear(const Variant& variant, const chunk_llama_cpu_weight& w, const float* x, float* y, int64_t rows,
            float* quant_scratch, int num_threads, bool int8) {
  if (int8 && w.type != 0 && chunk_attn_cpu::quant_int8_supports(static_cast<int>(w.type))) {
    quant_int8_linear(variant.name, chunk_attn_cpu::QuantInt8Params{x, static_cast<const uint8_t*>(w.data),
                                                                    static_cast<int>(w.type), w.bias, y, rows,
                                                                    w.out_features, w.in_features, num_threads,
                                                                    nullptr});
  } else if (w.type == 0) {
    variant.linear(chunk_attn_cpu::LinearParams{x, static_cast<const float*>(w.data), w.bias, y, rows,
                                                w.out_features, w.in_features, num_threads});
  } else {
    variant.quant_linear(chunk_attn_cpu::QuantLinearParams{x, static_cast<const uint8_t*>(w.data),
                                                           static_cast<int>(w.type), w.bias, y, rows, w.out_features,
                                                           w.in_features, num_threads, quant_scratch});
  }
}

void check_weight(const chunk_llama_cpu_weight& w, const char* name, int64_t out_features, int64_t in_features) {
  CHECK_VALUE(w.data != nullptr && w.out_features == out_features && w.in_features == in_features, "decoder layer: ",
              name, " is [", w.out_features, ", ", w.in_features, "], the layer needs [", out_features, ", ",
              in_features, "]");
  const int64_t bytes = w.type == 0 ? out_features * in_features * 4
                                    : row_bytes_of("decoder layer", static_cast<int>(w.type), in_features) * out_features;
  CHECK_VALUE(w.bytes == bytes, "decoder layer: ", name, " holds ", w.bytes, " bytes, not the ", bytes,
              " its shape and type need");
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
// element); attend(q [rows, q_width], out [rows, q_width]) runs the attention once the new
// K/V are in the pool.
template <typename Attend>
void run_layer(const chunk_llama_cpu_decoder_layer& L, const Variant& variant, const float* hidden_in,
               float* hidden_out, int64_t rows, const float* cos, const float* sin, const int64_t* write_token,
               const int64_t* write_chunk, const int64_t* write_offset, int64_t num_writes, void* k_cache,
               void* v_cache, int64_t capacity, int64_t num_kv_heads, int64_t chunk_size, int dtype, int num_threads,
               Attend&& attend) {
  CHECK_VALUE(num_kv_heads == L.num_kv_heads, "decoder layer: the pool has ", num_kv_heads,
              " KV heads, the layer ", L.num_kv_heads);
  const int64_t hidden = L.hidden_size, d = L.head_dim, inter = L.intermediate_size;
  const int64_t q_width = L.num_heads * d, kv_width = num_kv_heads * d;
  CHECK_VALUE(hidden > 0 && inter > 0 && d % 2 == 0 && num_threads >= 1, "decoder layer: bad sizes (hidden ",
              hidden, ", intermediate ", inter, ", head_dim ", d, ")");
  CHECK_VALUE(L.activation == 0 || L.activation == 1, "decoder layer: activation ", L.activation,
              " is not 0 (SiLU) or 1 (GELU, tanh)");
  CHECK_VALUE(L.activations == CHUNK_LLAMA_ACTIVATIONS_FLOAT32 || L.activations == CHUNK_LLAMA_ACTIVATIONS_INT8,
              "decoder layer: activations ", L.activations, " is not 0 (float32) or 1 (int8)");
  const bool int8 = L.activations == CHUNK_LLAMA_ACTIVATIONS_INT8;
  CHECK_VALUE(L.input_norm != nullptr && L.mlp_norm != nullptr && (L.q_norm == nullptr) == (L.k_norm == nullptr),
              "decoder layer: the input and MLP norms are needed, q and k norms both or neither");
  check_weight(L.q, "q_proj", q_width, hidden);
  check_weight(L.k, "k_proj", kv_width, hidden);
  check_weight(L.v, "v_proj", kv_width, hidden);
  check_weight(L.o, "o_proj", hidden, q_width);
  check_weight(L.gate, "gate_proj", inter, hidden);
  check_weight(L.up, "up_proj", inter, hidden);
  check_weight(L.down, "down_proj", hidden, inter);
  for (int64_t i = 0; i < num_writes; ++i)
    CHECK_VALUE(write_token[i] >= 0 && write_token[i] < rows && write_chunk[i] >= 0 && write_chunk[i] < capacity &&
                    write_offset[i] >= 0 && write_offset[i] < chunk_size,
                "decoder layer: write ", i, " (token ", write_token[i], " to chunk ", write_chunk[i], " slot ",
                write_offset[i], ") is not inside ", rows, " rows and the pool of ", capacity, " chunks of ",
                chunk_size);

  // one buffer for every intermediate: h [rows, hidden], q and the attention's output (and
  // their plan-ordered copies) [rows, q_width] each, k and v [rows, kv_width], gate and up
  // [rows, inter], and the quantized kernels' per-thread scratch
  const int64_t widest_in = std::max({inter, q_width, hidden});
  const int64_t floats = rows * (hidden + 3 * q_width + 2 * kv_width + 2 * inter) +
                         chunk_attn_cpu::quant_scratch_floats(rows, widest_in) * num_threads;
  std::unique_ptr<float[]> buffer(new float[floats]);
  float *h = buffer.get(), *q = h + rows * hidden, *scratch_q = q + rows * q_width, *attn = scratch_q + rows * q_width;
  float *k = attn + rows * q_width, *v = k + rows * kv_width, *gate = v + rows * kv_width, *up = gate + rows * inter;
  float* quant_scratch = up + rows * inter;

  const float eps = static_cast<float>(L.norm_eps), offset = static_cast<float>(L.norm_offset);
  const auto norm = [&](const float* x, const float* weight, float* out, int64_t count, int64_t n) {
    variant.rms_norm(chunk_attn_cpu::NormParams{x, weight, offset, eps, out, count, n, num_threads});
  };
  // attention
  norm(hidden_in, L.input_norm, h, rows, hidden);
  linear(variant, L.q, h, q, rows, quant_scratch, num_threads, int8);
  linear(variant, L.k, h, k, rows, quant_scratch, num_threads, int8);
  linear(variant, L.v, h, v, rows, quant_scratch, num_threads, int8);
  if (L.q_norm != nullptr) {  // each head's vector
    norm(q, L.q_norm, q, rows * L.num_heads, d);
    norm(k, L.k_norm, k, rows * num_kv_heads, d);
  }
  for (int64_t r = 0; r < rows; ++r) {
    rotate(q + r * q_width, L.num_heads, d, cos + r * d, sin + r * d);
    rotate(k + r * kv_width, num_kv_heads, d, cos + r * d, sin + r * d);
  }
  // a bfloat16 pool (check_geometry took no other dtype) holds them rounded to nearest even, as torch's copy does
  const bool bf16_pool = dtype == CHUNK_LLAMA_BFLOAT16;
  for (int64_t i = 0; i < num_writes; ++i)
    for (int64_t head = 0; head < num_kv_heads; ++head) {
      const int64_t slot = ((write_chunk[i] * num_kv_heads + head) * chunk_size + write_offset[i]) * d;
      const int64_t from = write_token[i] * kv_width + head * d;
      for (int64_t j = 0; j < d; ++j) {
        chunk_attn_cpu::store_scalar(k_cache, bf16_pool, slot + j, k[from + j]);
        chunk_attn_cpu::store_scalar(v_cache, bf16_pool, slot + j, v[from + j]);
      }
    }
  attend(q, attn, scratch_q);
  linear(variant, L.o, attn, h, rows, quant_scratch, num_threads, int8);
  if (L.attn_out_norm != nullptr) norm(h, L.attn_out_norm, h, rows, hidden);
  for (int64_t i = 0; i < rows * hidden; ++i) hidden_out[i] = hidden_in[i] + h[i];

  // MLP
  norm(hidden_out, L.mlp_norm, h, rows, hidden);
  linear(variant, L.gate, h, gate, rows, quant_scratch, num_threads, int8);
  linear(variant, L.up, h, up, rows, quant_scratch, num_threads, int8);
  variant.gate_mul(chunk_attn_cpu::GateParams{static_cast<int>(L.activation), gate, up, rows * inter, num_threads});
  linear(variant, L.down, gate, h, rows, quant_scratch, num_threads, int8);
  if (L.mlp_out_norm != nullptr) norm(h, L.mlp_out_norm, h, rows, hidden);
  for (int64_t i = 0; i < rows * hidden; ++i) hidden_out[i] = hidden_out[i] + h[i];
}

}  // namespace
}  // namespace chunk_llama_cpu_internal

extern "C" {

int chunk_llama_cpu_decoder_layer_decode(
    const chunk_llama_cpu_decoder_layer* layer, const float* hidden_in, float* hidden_out, int64_t rows,
    const float* cos, const float* sin, const int64_t* write_token, const int64_t* write_chunk,
    const int64_t* write_offset, int64_t num_writes, const int64_t* row_order, void* k_cache, void* v_cache,
    int64_t capacity, int64_t num_kv_heads, int64_t chunk_size, int64_t kv_head_dim, int64_t k_extent,
    int64_t v_extent, int dtype, const int64_t* plan, int64_t plan_numel, const int64_t* layout,
    int64_t layout_size, float* scratch, int64_t scratch_numel, double scale, int64_t window,
    int64_t max_blocks_per_item, const char* isa, int num_threads) {
  return guarded([&] {
    const chunk_llama_cpu_decoder_layer& L = *layer;
    const Geometry g = check_geometry(rows, L.num_heads, L.head_dim, capacity, num_kv_heads, chunk_size, kv_head_dim,
                                      k_extent, v_extent, dtype);
    if (row_order != nullptr)
      for (int64_t i = 0; i < rows; ++i)
        CHECK_VALUE(row_order[i] >= 0 && row_order[i] < rows, "decoder layer: row_order[", i, "] = ", row_order[i],
                    " is not a row of ", rows);
    const int64_t q_width = L.num_heads * L.head_dim;
    run_layer(L, variant_for(isa), hidden_in, hidden_out, rows, cos, sin, write_token, write_chunk, write_offset,
              num_writes, k_cache, v_cache, capacity, num_kv_heads, chunk_size, dtype, num_threads,
              [&](float* q, float* attn, float* spare) {
                // the plan's rows are the batch's in another order: q and the output through spare
                const float* q_in = q;
                if (row_order != nullptr) {
                  for (int64_t r = 0; r < rows; ++r)
                    std::copy(q + row_order[r] * q_width, q + (row_order[r] + 1) * q_width, spare + r * q_width);
                  q_in = spare;
                }
                float* out = row_order != nullptr ? q : attn;  // q is not read again once spare holds it
                tpp_decode(q_in, CHUNK_LLAMA_FLOAT32, k_cache, v_cache, g, dtype, out, plan, plan_numel, layout,
                           layout_size, scratch, scratch_numel, scale, window, max_blocks_per_item, isa, num_threads);
                if (row_order != nullptr)
                  for (int64_t r = 0; r < rows; ++r)
                    std::copy(out + r * q_width, out + (r + 1) * q_width, attn + row_order[r] * q_width);
              });
  });
}

int chunk_llama_cpu_decoder_layer_prefill(
    const chunk_llama_cpu_decoder_layer* layer, const float* hidden_in, float* hidden_out, int64_t rows,
    const float* cos, const float* sin, const int64_t* write_token, const int64_t* write_chunk,
    const int64_t* write_offset, int64_t num_writes, void* k_cache, void* v_cache, int64_t capacity,
    int64_t num_kv_heads, int64_t chunk_size, int64_t kv_head_dim, int64_t k_extent, int64_t v_extent, int dtype,
    const int64_t* plan, int64_t plan_numel, const int64_t* layout, int64_t layout_size, float* scratch,
    int64_t scratch_numel, double scale, int64_t window, const char* isa, int num_threads) {
  return guarded([&] {
    const chunk_llama_cpu_decoder_layer& L = *layer;
    const Geometry g = check_geometry(rows, L.num_heads, L.head_dim, capacity, num_kv_heads, chunk_size, kv_head_dim,
                                      k_extent, v_extent, dtype);
    run_layer(L, variant_for(isa), hidden_in, hidden_out, rows, cos, sin, write_token, write_chunk, write_offset,
              num_writes, k_cache, v_cache, capacity, num_kv_heads, chunk_size, dtype, num_threads,
              [&](float* q, float* attn, float*) {
                tpp_prefill(q, CHUNK_LLAMA_FLOAT32, k_cache, v_cache, g, dtype, attn, plan, plan_numel, layout,
                            layout_size, scratch, scratch_numel, scale, window, isa, num_threads);
              });
  });
}

int chunk_llama_cpu_decoder_stack_decode(
    const chunk_llama_cpu_decoder_layer* const* layers, void* const* k_caches, void* const* v_caches,
    int64_t num_layers, const float* hidden_in, float* hidden_out, int64_t rows, const float* const* cos,
    const float* const* sin, const int64_t* write_token, const int64_t* write_chunk, const int64_t* write_offset,
    int64_t num_writes, const int64_t* row_order, int64_t capacity, int64_t num_kv_heads, int64_t chunk_size,
    int64_t kv_head_dim, const int64_t* k_extents, const int64_t* v_extents, int dtype, const int64_t* plan,
    int64_t plan_numel, const int64_t* layout, int64_t layout_size, float* scratch, int64_t scratch_numel,
    double scale, const int64_t* windows, int64_t max_blocks_per_item, const char* isa, int num_threads) {
  const int checked = guarded([&] {
    CHECK_VALUE(num_layers >= 1 && rows >= 0, "decoder stack: ", num_layers, " layers of ", rows, " rows");
    const int64_t hidden = layers[0]->hidden_size;
    for (int64_t i = 0; i < num_layers; ++i)
      CHECK_VALUE(layers[i]->hidden_size == hidden && k_caches[i] != nullptr && v_caches[i] != nullptr &&
                      cos[i] != nullptr && sin[i] != nullptr && windows[i] >= 0 && windows[i] <= INT32_MAX,
                  "decoder stack: layer ", i, " has hidden size ", layers[i]->hidden_size, " (layer 0: ", hidden,
                  "), window ", windows[i], ", or no K/V pool or rotary");
    std::copy(hidden_in, hidden_in + rows * hidden, hidden_out);
  });
  for (int64_t i = 0; checked == CHUNK_LLAMA_OK && i < num_layers; ++i) {  // each layer in place on hidden_out
    const int code = chunk_llama_cpu_decoder_layer_decode(
        layers[i], hidden_out, hidden_out, rows, cos[i], sin[i], write_token, write_chunk, write_offset, num_writes,
        row_order, k_caches[i], v_caches[i], capacity, num_kv_heads, chunk_size, kv_head_dim, k_extents[i],
        v_extents[i], dtype, plan, plan_numel, layout, layout_size, scratch, scratch_numel, scale, windows[i],
        max_blocks_per_item, isa, num_threads);
    if (code != CHUNK_LLAMA_OK) return code;
  }
  return checked;
}

}  // extern "C"
