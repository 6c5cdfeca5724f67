// Prefill cases for the torch-free driver (kernel_test.cpp): packed steps of three
// sequences in a token-granular prefix tree (test_tree.h: the second parts from the first
// inside a chunk, so segments start and end inside chunks), new tokens from 0, a
// segment's first position, inside a segment or only the last token, tiles of 128 and of
// 37 rows (so tiles end inside a token's GQA group), GQA groups 1/2/3, head dims
// 64/128/256, fp32 and bf16, against a scalar double-precision causal attention over
// each sequence's own keys. Pool slots no segment holds are NaN (behind a segment's end
// inside a chunk, spare chunks, the guard chunk); query rows of no sequence must stay NaN.
#include "prefill_cases.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <utility>
#include <vector>

#include "params.h"
#include "prefill_params.h"
#include "scalar.h"
#include "test_rng.h"
#include "test_tree.h"

using namespace chunk_attn_cpu;

namespace {

template <typename T>
T to_storage(float x) {
  if constexpr (sizeof(T) == 2) return float_to_bf16(x);
  else return x;
}

// Three sequences of C + 1 .. 60 tokens: the second parts from the first after a random
// number of its tokens (inside a chunk but for one in C), the third branches off the second
// anywhere, its whole included (then it goes on in place behind the second's last token
// when that chunk has room).
std::vector<std::vector<int>> prefill_sequences(Rng& rng, int C) {
  std::vector<std::vector<int>> seqs(3);
  for (int s = 0; s < 3; ++s) {
    const int length = rng.uniform(C + 1, 60);
    if (s == 1) {
      const int keep = rng.uniform(1, static_cast<int>(seqs[0].size()) - 1);
      seqs[1].assign(seqs[0].begin(), seqs[0].begin() + keep);
      seqs[1].push_back((seqs[0][keep] + 1) % 3);  // parts here
    } else if (s == 2) {
      seqs[2].assign(seqs[1].begin(), seqs[1].begin() + rng.uniform(0, static_cast<int>(seqs[1].size())));
    }
    while (static_cast<int>(seqs[s].size()) < length) seqs[s].push_back(rng.uniform(0, 2));
  }
  return seqs;
}

template <typename T>
double run(const Variant& variant, int C, int D, int KV, int group, int tile_rows, int window, uint64_t seed,
           PrefillSummary& summary) {
  Rng rng{seed * 0x9e3779b97f4a7c15ull + 7};
  const bool bf16 = sizeof(T) == 2;
  const int H = KV * group, num_seqs = 3;
  const Tree tree = build_tree(prefill_sequences(rng, C), C, rng);
  // Segment tables, [num_seqs, max_segments] with at least one unused entry per sequence.
  // The segments are the decode plan's, cut where a path's users change: finer than the
  // prefill plan's (PrefixTree.segments: one per chunk of a path, from slot 0), which the
  // kernel reads alike, and they also start inside chunks.
  int max_segments = 0;
  for (const auto& path : tree.paths) max_segments = std::max(max_segments, static_cast<int>(path.size()) + 1);
  std::vector<int64_t> seg_chunk, seg_start, seg_pos;
  bool starts_inside = false, ends_inside = false;
  for (const auto& path : tree.paths)
    for (size_t i = 0; i < static_cast<size_t>(max_segments); ++i) {
      const bool used = i < path.size();
      seg_chunk.push_back(used ? path[i].chunk : 0);
      seg_start.push_back(used ? path[i].start : 0);
      seg_pos.push_back(used ? path[i].pos : kNoPosition);
      starts_inside |= used && path[i].start > 0;
      ends_inside |= i + 1 < path.size() && path[i].start + path[i].len < C;
    }
  summary.starts_inside += starts_inside, summary.ends_inside += ends_inside;
  // new tokens from 0, from a segment's first position, from inside a segment, or only the last
  std::vector<int> lengths, q_starts;
  for (const auto& path : tree.paths) {
    const int length = static_cast<int>(path.back().pos + path.back().len);
    const int boundary = static_cast<int>(path[rng.uniform(0, static_cast<int>(path.size()) - 1)].pos);
    const int choices[4] = {0, boundary, std::min(length - 1, boundary + rng.uniform(1, C - 1)), length - 1};
    lengths.push_back(length), q_starts.push_back(choices[rng.uniform(0, 3)]);
  }
  std::vector<T> k, v;
  fill_pool(tree, KV, C, D, rng, to_storage<T>, k, v);
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
  p.seg_chunk = seg_chunk.data(), p.seg_start = seg_start.data(), p.seg_pos = seg_pos.data();
  p.q_start = q_start.data(), p.num_tokens = num_tokens.data();
  p.token_start = token_start.data(), p.tiles = tiles.data();
  p.num_tiles = static_cast<int>(tiles.size() / 3), p.num_threads = 1;
  p.num_seqs = num_seqs, p.max_segments = max_segments, p.num_heads = H, p.num_kv_heads = KV, p.head_dim = D;
  p.chunk_size = C, p.dtype = bf16 ? DType::kBFloat16 : DType::kFloat32, p.scale = 1.f / std::sqrt(float(D));
  p.window = window;
  p.workspace_stride = prefill_workspace_floats(C, D);
  std::vector<float> workspace(p.workspace_stride, std::nanf(""));
  p.workspace = workspace.data();
  variant.prefill(p);

  double worst = 0;
  std::vector<double> w;
  std::vector<std::vector<std::pair<int64_t, int64_t>>> slots;  // each sequence's own keys, by position
  for (const auto& path : tree.paths) slots.push_back(key_slots(path));
  for (int s = 0; s < num_seqs; ++s)
    for (int i = 0; i < num_tokens[s]; ++i)
      for (int h = 0; h < H; ++h) {
        const int pos = q_starts[s] + i, kv = h / group;
        const int64_t q_row = ((token_start[s] + i) * H + h) * D;
        auto at = [&](int t, int d) { return ((slots[s][t].first * KV + kv) * C + slots[s][t].second) * D + d; };
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
        const double error =
            bf16 ? run<uint16_t>(variant, chunk_size, head_dim, 2, group, tile_rows, window, seed, summary)
                 : run<float>(variant, chunk_size, head_dim, 2, group, tile_rows, window, seed, summary);
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
  if (summary.starts_inside == 0 || summary.ends_inside == 0) {  // the cases would no longer test them
    ++summary.failures;
    std::printf("FAIL %s prefill: no case has a segment starting inside a chunk, or ending inside one before the "
                "next\n", variant.name);
  }
  return summary;
}
