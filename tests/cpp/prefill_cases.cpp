// Prefill cases for the torch-free driver (kernel_test.cpp): packed steps of a few
// sequences (two share their first chunks' ids), new tokens from 0, a chunk boundary,
// inside a chunk or only the last token, tiles of 128 and of 37 rows (so tiles end
// inside a token's GQA group), GQA groups 1/2/3, head dims 64/128/256, fp32 and bf16,
// against a scalar double-precision causal attention over each sequence's own keys.
// Pool rows a step must not read hold NaN: past each sequence's length in its last
// chunk, and every chunk of no sequence; query rows of no sequence must stay NaN.
#include "prefill_cases.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "params.h"
#include "prefill_params.h"
#include "scalar.h"
#include "test_rng.h"

using namespace chunk_attn_cpu;

namespace {

template <typename T>
T to_storage(float x) {
  if constexpr (sizeof(T) == 2) return float_to_bf16(x);
  else return x;
}

template <typename T>
double run(const Variant& variant, int C, int D, int KV, int group, int tile_rows, int window, uint64_t seed) {
  Rng rng{seed * 0x9e3779b97f4a7c15ull + 7};
  const bool bf16 = sizeof(T) == 2;
  const int H = KV * group, num_seqs = 3;
  std::vector<int> lengths, q_starts;
  for (int s = 0; s < num_seqs; ++s) {
    const int length = rng.uniform(C + 1, 60);
    const int boundary = C * rng.uniform(0, (length - 1) / C);
    const int choices[4] = {0, boundary, std::min(length - 1, boundary + rng.uniform(1, C - 1)), length - 1};
    lengths.push_back(length), q_starts.push_back(choices[rng.uniform(0, 3)]);
  }
  // chunk tables: sequence 1 shares sequence 0's first chunk; ids in scrambled pool order
  int max_chunks = 0, capacity = 2;
  for (int len : lengths) max_chunks = std::max(max_chunks, (len + C - 1) / C), capacity += (len + C - 1) / C;
  std::vector<int64_t> table(num_seqs * max_chunks, 0);
  int next_id = capacity - 1;
  for (int s = 0; s < num_seqs; ++s)
    for (int c = 0; c < (lengths[s] + C - 1) / C; ++c)
      table[s * max_chunks + c] = (s == 1 && c == 0) ? table[0] : next_id--;
  const int64_t chunk_elems = static_cast<int64_t>(C) * D;
  std::vector<T> k(capacity * KV * chunk_elems, to_storage<T>(std::nanf(""))), v(k);
  for (int s = 0; s < num_seqs; ++s)
    for (int t = 0; t < lengths[s]; ++t)
      for (int h = 0; h < KV; ++h)
        for (int d = 0; d < D; ++d) {
          const int64_t at = ((table[s * max_chunks + t / C] * KV + h) * C + t % C) * D + d;
          k[at] = to_storage<T>(rng.value()), v[at] = to_storage<T>(rng.value());
        }
  // packed queries: sequences in reverse order, one spare (NaN) row between them
  std::vector<int64_t> q_start(q_starts.begin(), q_starts.end()), num_tokens, token_start(num_seqs);
  int rows = 0;
  for (int s = 0; s < num_seqs; ++s) num_tokens.push_back(lengths[s] - q_starts[s]);
  for (int s = num_seqs - 1; s >= 0; --s) token_start[s] = rows, rows += static_cast<int>(num_tokens[s]) + 1;
  std::vector<T> q(static_cast<size_t>(rows) * H * D), out(q.size(), to_storage<T>(std::nanf("")));
  for (auto& x : q) x = to_storage<T>(rng.value());
  std::vector<int64_t> tiles;
  for (int s = 0; s < num_seqs; ++s)
    for (int64_t r = 0; r < num_tokens[s] * group; r += tile_rows)
      tiles.insert(tiles.end(), {s, r, std::min<int64_t>(num_tokens[s] * group, r + tile_rows)});

  PrefillParams p{};
  p.q = q.data(), p.k_cache = k.data(), p.v_cache = v.data(), p.out = out.data();
  p.chunk_table = table.data(), p.q_start = q_start.data(), p.num_tokens = num_tokens.data();
  p.token_start = token_start.data(), p.tiles = tiles.data();
  p.num_tiles = static_cast<int>(tiles.size() / 3), p.num_threads = 1;
  p.num_seqs = num_seqs, p.max_chunks = max_chunks, p.num_heads = H, p.num_kv_heads = KV, p.head_dim = D;
  p.chunk_size = C, p.dtype = bf16 ? DType::kBFloat16 : DType::kFloat32, p.scale = 1.f / std::sqrt(float(D));
  p.window = window;
  p.workspace_stride = prefill_workspace_floats(C, D);
  std::vector<float> workspace(p.workspace_stride, std::nanf(""));
  p.workspace = workspace.data();
  variant.prefill(p);

  double worst = 0;
  std::vector<double> w;
  for (int s = 0; s < num_seqs; ++s)
    for (int i = 0; i < num_tokens[s]; ++i)
      for (int h = 0; h < H; ++h) {
        const int pos = q_starts[s] + i, kv = h / group;
        const int64_t q_row = ((token_start[s] + i) * H + h) * D;
        auto at = [&](int t, int d) { return ((table[s * max_chunks + t / C] * KV + kv) * C + t % C) * D + d; };
        w.assign(pos + 1, 0.0);
        double m = -INFINITY, sum = 0;
        for (int t = 0; t <= pos; ++t) {
          for (int d = 0; d < D; ++d) w[t] += load_scalar(q.data(), q_row + d) * double(load_scalar(k.data(), at(t, d)));
          w[t] *= p.scale;
          if (window > 0 && t <= pos - window) w[t] = -INFINITY;  // before the window
          m = std::max(m, w[t]);
        }
        for (double& x : w) sum += (x = std::exp(x - m));
        for (int d = 0; d < D; ++d) {
          double expected = 0;
          for (int t = 0; t <= pos; ++t) expected += w[t] * load_scalar(v.data(), at(t, d));
          expected /= sum;
          double allowed = 1e-6 + 1e-6 * std::fabs(expected);  // as kernel_test.cpp's decode cases
          if (bf16 && expected != 0) allowed += std::ldexp(1.0, std::ilogb(expected) - 8);
          const double error = std::fabs(load_scalar(out.data(), q_row + d) - expected) / allowed;
          if (!(error <= worst)) worst = error;  // NaN sticks
        }
      }
  for (int s = 0; s < num_seqs; ++s)  // the spare row after each sequence is untouched
    for (int64_t i = (token_start[s] + num_tokens[s]) * H * D; i < (token_start[s] + num_tokens[s] + 1) * H * D; ++i)
      if (!std::isnan(load_scalar(out.data(), i))) worst = INFINITY;
  return worst;
}

}  // namespace

PrefillSummary run_prefill_cases(const Variant& variant) {
  PrefillSummary summary;
  uint64_t seed = 1;
  for (int bf16 = 0; bf16 < 2; ++bf16)
    for (int head_dim : {64, 128, 256})
      for (int group : {1, 2, 3}) {
        const int chunk_size = head_dim == 256 ? 16 : 32, tile_rows = group == 2 ? 128 : 37;
        // a sliding window on every other case: shorter than a chunk, or across chunks
        const int window = (seed % 2) * (head_dim == 128 ? 7 : 21);
        const double error = bf16 ? run<uint16_t>(variant, chunk_size, head_dim, 2, group, tile_rows, window, seed)
                                  : run<float>(variant, chunk_size, head_dim, 2, group, tile_rows, window, seed);
        ++summary.cases;
        if (!(error <= summary.worst)) summary.worst = error;
        if (!(error <= 1.0)) {
          ++summary.failures;
          std::printf("FAIL %s prefill: %s d=%d group=%d chunk=%d tile=%d window=%d seed=%llu: max error %.3g x the "
                      "allowed\n", variant.name, bf16 ? "bf16" : "fp32", head_dim, group, chunk_size, tile_rows, window,
                      static_cast<unsigned long long>(seed), error);
        }
        ++seed;
      }
  return summary;
}
