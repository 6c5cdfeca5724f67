// One decoder layer of the Llama family (Llama, Mistral, Qwen2, Qwen3, Gemma 3, Phi-3) for a decode step, in one call
// (chunk_llama_cpu_decoder_layer_decode, c_api.h). A decode step of one sequence on a
// small model spends more time in Python and torch's dispatch around its kernels than in
// them (about 30 ops per layer); this runs the whole layer behind one ctypes call, with
// the same kernels the op-by-op path runs (small_linear or quant_linear per weight, the
// decode attention) and the elementwise steps written the way transformers computes them.
// Compiled with baseline flags, like c_api.cpp: the elementwise steps are a few thousand
// floats per row, next to the weights' millions.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>

#include "api_internal.h"
#include "c_api.h"
#include "chunk_llama/api_errors.h"

namespace chunk_llama_cpu_internal {
namespace {

using chunk_attn_cpu::Variant;

// y [rows, out] = x [rows, in] W^T (+ bias) with the variant's kernel for the weight's form.
void linear(const Variant& variant, const chunk_llama_cpu_weight& w, const float* x, float* y, int64_t rows,
            float* quant_scratch, int num_threads) {
  if (w.type == 0) {
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

// transformers' RMSNorm of each of `rows` vectors of n: t = x * rsqrt(mean(x^2) + eps), then
// t * (offset + weight) (Llama's weight * t with offset 0, Gemma's t * (1 + weight) with 1;
// the sum rounded once more). In place when out == x.
void rms_norm(const float* x, const float* weight, float offset, float eps, float* out, int64_t rows, int64_t n) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * n;
    double sum = 0.0;  // the mean of n floats, more exact than torch's float sum (within its error)
    for (int64_t i = 0; i < n; ++i) sum += static_cast<double>(xr[i]) * xr[i];
    const float inv = 1.0f / std::sqrt(static_cast<float>(sum / n) + eps);
    for (int64_t i = 0; i < n; ++i) {
      const float t = xr[i] * inv, scale = offset + weight[i];
      out[r * n + i] = t * scale;
    }
  }
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

// The MLP's gate: gate <- act(gate) * up, act as torch computes it: SiLU g / (1 + exp(-g)),
// or GELU's tanh approximation 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))).
void gate_mul(int64_t activation, float* gate, const float* up, int64_t n) {
  constexpr float kBeta = 0.7978845608028654f, kKappa = 0.044715f;
  for (int64_t i = 0; i < n; ++i) {
    const float g = gate[i];
    float act;
    if (activation == 0) {
      act = g / (1.0f + std::exp(-g));
    } else {
      const float cube = g * g * g, inner = kBeta * (g + kKappa * cube);
      act = 0.5f * g * (1.0f + std::tanh(inner));
    }
    gate[i] = act * up[i];
  }
}

}  // namespace
}  // namespace chunk_llama_cpu_internal

using chunk_llama_api::guarded;
using namespace chunk_llama_cpu_internal;

extern "C" {

// hidden_in may be hidden_out (the stack below runs layers in place): it is read whole into
// the norm's buffer before the first write, then only element by element.
int chunk_llama_cpu_decoder_layer_decode(
    const chunk_llama_cpu_decoder_layer* layer, const float* hidden_in, float* hidden_out, int64_t rows,
    const float* cos, const float* sin, const int64_t* write_token, const int64_t* write_chunk,
    const int64_t* write_offset, int64_t num_writes, const int64_t* row_order, void* k_cache, void* v_cache,
    int64_t capacity, int64_t num_kv_heads, int64_t chunk_size, int64_t kv_head_dim, int64_t k_extent,
    int64_t v_extent, int dtype, const int64_t* plan, int64_t plan_numel, const int64_t* layout,
    int64_t layout_size, float* scratch, int64_t scratch_numel, double scale, int64_t window,
    int64_t max_chunks_per_item, const char* isa, int num_threads) {
  return guarded([&] {
    const chunk_llama_cpu_decoder_layer& L = *layer;
    const Variant& variant = variant_for(isa);
    CHECK_VALUE(dtype == CHUNK_LLAMA_FLOAT32, "decoder layer: the pool must be float32 (dtype code ", dtype, ")");
    CHECK_VALUE(num_kv_heads == L.num_kv_heads, "decoder layer: the pool has ", num_kv_heads,
                " KV heads, the layer ", L.num_kv_heads);
    const Geometry g = check_geometry(rows, L.num_heads, L.head_dim, capacity, num_kv_heads, chunk_size, kv_head_dim,
                                      k_extent, v_extent, dtype);
    const int64_t hidden = L.hidden_size, d = L.head_dim, inter = L.intermediate_size;
    const int64_t q_width = L.num_heads * d, kv_width = num_kv_heads * d;
    CHECK_VALUE(hidden > 0 && inter > 0 && d % 2 == 0 && num_threads >= 1, "decoder layer: bad sizes (hidden ",
                hidden, ", intermediate ", inter, ", head_dim ", d, ")");
    CHECK_VALUE(L.activation == 0 || L.activation == 1, "decoder layer: activation ", L.activation,
                " is not 0 (SiLU) or 1 (GELU, tanh)");
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
    if (row_order != nullptr)
      for (int64_t i = 0; i < rows; ++i)
        CHECK_VALUE(row_order[i] >= 0 && row_order[i] < rows, "decoder layer: row_order[", i, "] = ", row_order[i],
                    " is not a row of ", rows);

    // one buffer for every intermediate: h [rows, hidden], q and its plan-ordered copy and
    // the attention's output [rows, q_width], k and v [rows, kv_width], gate and up
    // [rows, inter], and the quantized kernels' per-thread scratch
    const int64_t widest_in = std::max({inter, q_width, hidden});
    const int64_t floats = rows * (hidden + 3 * q_width + 2 * kv_width + 2 * inter) +
                           chunk_attn_cpu::quant_scratch_floats(rows, widest_in) * num_threads;
    std::unique_ptr<float[]> buffer(new float[floats]);
    float *h = buffer.get(), *q = h + rows * hidden, *q_plan = q + rows * q_width, *attn = q_plan + rows * q_width;
    float *k = attn + rows * q_width, *v = k + rows * kv_width, *gate = v + rows * kv_width, *up = gate + rows * inter;
    float* quant_scratch = up + rows * inter;

    const float eps = static_cast<float>(L.norm_eps), offset = static_cast<float>(L.norm_offset);
    // attention
    rms_norm(hidden_in, L.input_norm, offset, eps, h, rows, hidden);
    linear(variant, L.q, h, q, rows, quant_scratch, num_threads);
    linear(variant, L.k, h, k, rows, quant_scratch, num_threads);
    linear(variant, L.v, h, v, rows, quant_scratch, num_threads);
    if (L.q_norm != nullptr) {  // each head's vector
      rms_norm(q, L.q_norm, offset, eps, q, rows * L.num_heads, d);
      rms_norm(k, L.k_norm, offset, eps, k, rows * num_kv_heads, d);
    }
    for (int64_t r = 0; r < rows; ++r) {
      rotate(q + r * q_width, L.num_heads, d, cos + r * d, sin + r * d);
      rotate(k + r * kv_width, num_kv_heads, d, cos + r * d, sin + r * d);
    }
    float *k_pool = static_cast<float*>(k_cache), *v_pool = static_cast<float*>(v_cache);
    for (int64_t i = 0; i < num_writes; ++i)
      for (int64_t head = 0; head < num_kv_heads; ++head) {
        const int64_t slot = ((write_chunk[i] * num_kv_heads + head) * chunk_size + write_offset[i]) * d;
        const int64_t from = write_token[i] * kv_width + head * d;
        for (int64_t j = 0; j < d; ++j) k_pool[slot + j] = k[from + j], v_pool[slot + j] = v[from + j];
      }
    const float* q_in = q;
    if (row_order != nullptr) {  // the plan's rows are the batch's in another order
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t j = 0; j < q_width; ++j) q_plan[r * q_width + j] = q[row_order[r] * q_width + j];
      q_in = q_plan;
    }
    float* attn_plan = row_order != nullptr ? q : attn;  // q is not read again once q_plan holds it
    tpp_decode(q_in, k_cache, v_cache, g, dtype, attn_plan, plan, plan_numel, layout, layout_size, scratch,
               scratch_numel, scale, window, max_chunks_per_item, isa, num_threads);
    if (row_order != nullptr)
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t j = 0; j < q_width; ++j) attn[row_order[r] * q_width + j] = attn_plan[r * q_width + j];
    linear(variant, L.o, attn, h, rows, quant_scratch, num_threads);
    if (L.attn_out_norm != nullptr) rms_norm(h, L.attn_out_norm, offset, eps, h, rows, hidden);
    for (int64_t i = 0; i < rows * hidden; ++i) hidden_out[i] = hidden_in[i] + h[i];

    // MLP
    rms_norm(hidden_out, L.mlp_norm, offset, eps, h, rows, hidden);
    linear(variant, L.gate, h, gate, rows, quant_scratch, num_threads);
    linear(variant, L.up, h, up, rows, quant_scratch, num_threads);
    gate_mul(L.activation, gate, up, rows * inter);
    linear(variant, L.down, gate, h, rows, quant_scratch, num_threads);
    if (L.mlp_out_norm != nullptr) rms_norm(h, L.mlp_out_norm, offset, eps, h, rows, hidden);
    for (int64_t i = 0; i < rows * hidden; ++i) hidden_out[i] = hidden_out[i] + h[i];
  });
}

int chunk_llama_cpu_decoder_stack_decode(
    const chunk_llama_cpu_decoder_layer* const* layers, void* const* k_caches, void* const* v_caches,
    int64_t num_layers, const float* hidden_in, float* hidden_out, int64_t rows, const float* cos, const float* sin,
    const int64_t* write_token, const int64_t* write_chunk, const int64_t* write_offset, int64_t num_writes,
    const int64_t* row_order, int64_t capacity, int64_t num_kv_heads, int64_t chunk_size, int64_t kv_head_dim,
    const int64_t* k_extents, const int64_t* v_extents, int dtype, const int64_t* plan, int64_t plan_numel,
    const int64_t* layout, int64_t layout_size, float* scratch, int64_t scratch_numel, double scale, int64_t window,
    int64_t max_chunks_per_item, const char* isa, int num_threads) {
  const int checked = guarded([&] {
    CHECK_VALUE(num_layers >= 1 && rows >= 0, "decoder stack: ", num_layers, " layers of ", rows, " rows");
    const int64_t hidden = layers[0]->hidden_size;
    for (int64_t i = 0; i < num_layers; ++i)
      CHECK_VALUE(layers[i]->hidden_size == hidden && k_caches[i] != nullptr && v_caches[i] != nullptr,
                  "decoder stack: layer ", i, " has hidden size ", layers[i]->hidden_size, " (layer 0: ", hidden,
                  ") or no K/V pool");
    std::copy(hidden_in, hidden_in + rows * hidden, hidden_out);
  });
  for (int64_t i = 0; checked == CHUNK_LLAMA_OK && i < num_layers; ++i) {  // each layer in place on hidden_out
    const int code = chunk_llama_cpu_decoder_layer_decode(
        layers[i], hidden_out, hidden_out, rows, cos, sin, write_token, write_chunk, write_offset, num_writes,
        row_order, k_caches[i], v_caches[i], capacity, num_kv_heads, chunk_size, kv_head_dim, k_extents[i],
        v_extents[i], dtype, plan, plan_numel, layout, layout_size, scratch, scratch_numel, scale, window,
        max_chunks_per_item, isa, num_threads);
    if (code != CHUNK_LLAMA_OK) return code;
  }
  return checked;
}

}  // extern "C"
