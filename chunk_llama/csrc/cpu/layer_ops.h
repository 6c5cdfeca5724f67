// A decoder layer's elementwise steps (layer.cpp runs them around the linear and attention
// kernels), written once against the lane API: the same arithmetic for a decode step's
// rows and a prefill's, so that a token's K/V and hidden states are bit for bit the same
// whichever computed them (blocks.h has the attention's side of that).
#pragma once

namespace chunk_attn_cpu {
namespace CHUNK_ATTN_ISA {

// Rows of at least this many values split over the threads (fewer: one thread, no fork).
constexpr int64_t kParallelValues = 1 << 15;

// transformers' RMSNorm of each row: t = x * (1 / sqrt(mean(x^2) + eps)), then t * (offset +
// weight) (Llama's weight * t with offset 0, Gemma's t * (1 + weight) with 1; the sum rounded
// once more). A row's sum of squares in one order: FMAs along it a vector at a time, then
// vreduce_add's tree, then the rest one by one.
// (Functions called in a parallel loop are marked nothrow, as in linear.h: GCC cannot infer
// it for these interposable inline functions, and the loop would get unwinding data naming
// a symbol outside the variant's namespace.)
__attribute__((nothrow)) inline void rms_norm_row(const NormParams& p, int64_t r) {
  const int64_t n = p.n, whole = n / kLanes * kLanes;
  const float* x = p.x + r * n;
  float* out = p.out + r * n;
  Vec acc = vzero();
  for (int64_t i = 0; i < whole; i += kLanes) acc = vfma(vload(x + i), vload(x + i), acc);
  float sum = vreduce_add(acc);
  for (int64_t i = whole; i < n; ++i) sum += x[i] * x[i];
  const float inv = 1.0f / __builtin_sqrtf(sum / static_cast<float>(n) + p.eps);
  const Vec inv_v = vset1(inv), offset = vset1(p.offset);
  for (int64_t i = 0; i < whole; i += kLanes)
    vstore(out + i, vmul(vmul(vload(x + i), inv_v), vadd(offset, vload(p.weight + i))));
  for (int64_t i = whole; i < n; ++i) out[i] = (x[i] * inv) * (p.offset + p.weight[i]);
}

void rms_norm(const NormParams& p) {
#ifdef _OPENMP
#pragma omp parallel for num_threads(p.num_threads) schedule(static) if (p.rows * p.n >= kParallelValues)
#endif
  for (int64_t r = 0; r < p.rows; ++r) rms_norm_row(p, r);
}

// act(g) for a vector: SiLU g / (1 + e^-g), or GELU's tanh approximation 0.5 g (1 + tanh(u)),
// u = sqrt(2 / pi) (g + 0.044715 g^3). Both are (max(g, 0) + min(g, 0) t) / (1 + t): for
// SiLU t = e^-|g|, for GELU t = e^-2|u| (u has g's sign), from vexp2 on x <= 0 only (its
// domain), so nothing overflows.
__attribute__((nothrow)) inline Vec activation(int kind, Vec g) {
  const Vec zero = vzero(), pos = vmax(g, zero), neg = vsub(g, pos);
  Vec magnitude = vmax(g, vsub(zero, g));  // |g|
  if (kind == 1) {
    const Vec u = vmul(vset1(0.7978845608028654f), vadd(g, vmul(vset1(0.044715f), vmul(vmul(g, g), g))));
    magnitude = vmul(vset1(2.0f), vmax(u, vsub(zero, u)));
  }
  const Vec t = vexp2(vmul(vsub(zero, magnitude), vset1(kLog2e)));
  return vdiv(vfma(neg, t, pos), vadd(vset1(1.0f), t));
}

// gate <- act(gate) * up, a vector at a time (the last, shorter one through a buffer: the
// same lanes' arithmetic).
void gate_mul(const GateParams& p) {
  const int64_t whole = p.n / kLanes * kLanes;
#ifdef _OPENMP
#pragma omp parallel for num_threads(p.num_threads) schedule(static) if (p.n >= kParallelValues)
#endif
  for (int64_t i = 0; i < whole; i += kLanes)
    vstore(p.gate + i, vmul(activation(p.activation, vload(p.gate + i)), vload(p.up + i)));
  if (whole < p.n) {
    alignas(64) float g[kLanes] = {}, u[kLanes] = {};
    std::memcpy(g, p.gate + whole, sizeof(float) * (p.n - whole));
    std::memcpy(u, p.up + whole, sizeof(float) * (p.n - whole));
    vstore(g, vmul(activation(p.activation, vload(g)), vload(u)));
    std::memcpy(p.gate + whole, g, sizeof(float) * (p.n - whole));
  }
}

// A LoRA delta's second product (LoraExpandParams). Its dot products are only `rank` long (a
// few dozen), too short for small_linear's tiles, whose reduction across lanes then costs more
// than their FMAs (about 40 GFLOP/s against 130-170 for the first product): here each vector
// of outputs is an outer product instead, `rank` FMAs down bt's rows with t[r][k] broadcast,
// kExpandRows rows at a time per load of bt and kExpandCols columns of bt at a time (in L1).
// Every output is the same FMA chain over k, in order, however the rows and columns are split
// into tiles or threads: a row's delta does not depend on the rows beside it. It is then
// added as PEFT adds it, y + delta * scale.
constexpr int kExpandRows = 4;
constexpr int64_t kExpandCols = 256;

template <int MR>
__attribute__((nothrow)) inline void lora_expand_tile(const LoraExpandParams& p, int64_t row, int64_t col0,
                                                      int64_t col1) {
  const Vec scale = vset1(p.scale);
  for (int64_t j = col0; j < col1; j += kLanes) {
    const bool part = j + kLanes > p.out;  // (the last, shorter vector of a row: through buffers)
    alignas(64) float b_part[kLanes] = {}, y_part[MR][kLanes] = {};
    Vec acc[MR];
    for (int m = 0; m < MR; ++m) acc[m] = vzero();
    for (int64_t k = 0; k < p.rank; ++k) {
      const float* b = p.bt + k * p.out + j;
      if (part) std::memcpy(b_part, b, sizeof(float) * (p.out - j));
      const Vec bv = vload(part ? b_part : b);
      for (int m = 0; m < MR; ++m) acc[m] = vfma(vset1(p.t[(row + m) * p.rank + k]), bv, acc[m]);
    }
    for (int m = 0; m < MR; ++m) {
      float* y = p.y + (row + m) * p.out + j;
      if (!part) {
        vstore(y, vadd(vload(y), vmul(acc[m], scale)));
        continue;
      }
      std::memcpy(y_part[m], y, sizeof(float) * (p.out - j));
      vstore(y_part[m], vadd(vload(y_part[m]), vmul(acc[m], scale)));
      std::memcpy(y, y_part[m], sizeof(float) * (p.out - j));
    }
  }
}

void lora_expand(const LoraExpandParams& p) {
  const int64_t tiles = (p.rows + kExpandRows - 1) / kExpandRows, blocks = (p.out + kExpandCols - 1) / kExpandCols;
#ifdef _OPENMP
#pragma omp parallel for num_threads(p.num_threads) schedule(static) if (p.rows * p.out >= kParallelValues)
#endif
  for (int64_t item = 0; item < tiles * blocks; ++item) {
    const int64_t row = item % tiles * kExpandRows, col0 = item / tiles * kExpandCols;
    const int64_t col1 = col0 + kExpandCols < p.out ? col0 + kExpandCols : p.out;
    switch (p.rows - row < kExpandRows ? p.rows - row : kExpandRows) {
      case 1: lora_expand_tile<1>(p, row, col0, col1); break;
      case 2: lora_expand_tile<2>(p, row, col0, col1); break;
      case 3: lora_expand_tile<3>(p, row, col0, col1); break;
      default: lora_expand_tile<kExpandRows>(p, row, col0, col1);
    }
  }
}

}  // namespace CHUNK_ATTN_ISA
}  // namespace chunk_attn_cpu
