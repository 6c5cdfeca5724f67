// Torch-free correctness test of the CPU kernel variants: random prefix trees, GQA
// groups, head dims and both storage dtypes against a scalar double-precision
// reference computed from each sequence's own keys. Built and run by
// tests/test_cpu_kernel_arm.py (aarch64, under qemu) and tests/test_cpu_kernel_driver.py
// (this machine, AVX-512 through SIMDe where the CPU lacks it).
//
//   kernel_test VARIANT...    exit status 0 when every case of every variant passes
//
// The prefill kernel's cases are in prefill_cases.cpp, linked beside this file.
//
// Rows past a sequence's length in its last chunk hold NaN: a kernel that reads them
// into the result fails.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "params.h"
#include "prefill_cases.h"
#include "scalar.h"
#include "test_rng.h"
#include "schedule.h"
#include "variants.h"

using namespace chunk_attn_cpu;

namespace {

struct Case {
  int num_seqs, max_len, chunk_size, head_dim, num_kv_heads, group, max_chunks_per_item;
  bool bf16;
  uint64_t seed;
  int window = 0;  // sliding window; 0: none
};

// The plan of a tree: what chunk_llama/kv/plan.py builds, for sequences sorted so the
// ones under any chunk are contiguous.
struct Plan {
  std::vector<int64_t> shared_ids, shared_begin, shared_end, shared_depth, private_ids, num_shared_tokens, seq_lens,
      seq_pair_ptr;
  std::vector<std::vector<int64_t>> paths;  // every sequence's chunk ids in order
  int max_private = 0, capacity = 0;
};

std::vector<std::vector<int>> random_sequences(Rng& rng, int num_seqs, int max_len) {
  std::vector<std::vector<int>> seqs;
  for (int i = 0; i < num_seqs; ++i) {
    const int length = rng.uniform(1, max_len);
    std::vector<int> seq;
    if (!seqs.empty() && rng.unit() < 0.8) {  // branch off an earlier sequence
      const std::vector<int>& parent = seqs[rng.uniform(0, static_cast<int>(seqs.size()) - 1)];
      const int keep = rng.uniform(0, std::min<int>(static_cast<int>(parent.size()), length));
      seq.assign(parent.begin(), parent.begin() + keep);
    }
    while (static_cast<int>(seq.size()) < length) seq.push_back(rng.uniform(0, 2));
    seqs.push_back(seq);
  }
  std::sort(seqs.begin(), seqs.end());  // depth-first order: shared prefixes are contiguous
  return seqs;
}

Plan build_plan(const std::vector<std::vector<int>>& seqs, int C, Rng& rng) {
  Plan plan;
  const int n = static_cast<int>(seqs.size());
  // a full chunk is identified by its whole prefix; shared when on >= 2 paths
  std::map<std::vector<int>, int> users;
  for (const auto& s : seqs)
    for (size_t end = C; end <= s.size(); end += C) ++users[std::vector<int>(s.begin(), s.begin() + end)];
  int num_chunks = 0;
  for (const auto& s : seqs) num_chunks += static_cast<int>((s.size() + C - 1) / C);
  plan.capacity = num_chunks + 3;
  std::vector<int64_t> free_ids(plan.capacity);  // pool ids in random order
  for (int i = 0; i < plan.capacity; ++i) free_ids[i] = i;
  for (int i = plan.capacity - 1; i > 0; --i) std::swap(free_ids[i], free_ids[rng.uniform(0, i)]);
  std::map<std::vector<int>, int64_t> shared_id;
  plan.seq_pair_ptr.push_back(0);
  std::vector<std::vector<int64_t>> privates(n);
  for (int i = 0; i < n; ++i) {
    const auto& s = seqs[i];
    std::vector<int64_t> path;
    int depth = 0;
    for (size_t end = C; end <= s.size(); end += C, ++depth) {
      const std::vector<int> key(s.begin(), s.begin() + end);
      if (users[key] < 2) break;
      if (!shared_id.count(key)) {  // first sequence under it: the range is i .. i + users - 1
        shared_id[key] = free_ids.back(), free_ids.pop_back();
        plan.shared_ids.push_back(shared_id[key]);
        plan.shared_begin.push_back(i);
        plan.shared_end.push_back(i + users[key]);
        plan.shared_depth.push_back(depth);
      }
      path.push_back(shared_id[key]);
    }
    plan.num_shared_tokens.push_back(static_cast<int64_t>(depth) * C);
    plan.seq_lens.push_back(static_cast<int64_t>(s.size()));
    plan.seq_pair_ptr.push_back(plan.seq_pair_ptr.back() + depth);
    for (size_t t = static_cast<size_t>(depth) * C; t < s.size(); t += C)
      privates[i].push_back(free_ids.back()), path.push_back(free_ids.back()), free_ids.pop_back();
    plan.max_private = std::max(plan.max_private, static_cast<int>(privates[i].size()));
    plan.paths.push_back(path);
  }
  plan.private_ids.assign(static_cast<size_t>(n) * std::max(plan.max_private, 1), 0);
  for (int i = 0; i < n; ++i)
    for (size_t c = 0; c < privates[i].size(); ++c) plan.private_ids[i * std::max(plan.max_private, 1) + c] = privates[i][c];
  return plan;
}

template <typename T>
T to_storage(float x);
template <>
float to_storage<float>(float x) { return x; }
template <>
uint16_t to_storage<uint16_t>(float x) { return float_to_bf16(x); }

// Runs one case on `variant`; returns the largest error in units of the allowed error
// (NaN or inf when an output is not finite).
template <typename T>
double run_case(const Variant& variant, const Case& cs) {
  Rng rng{cs.seed * 0x9e3779b97f4a7c15ull + 1};
  const auto seqs = random_sequences(rng, cs.num_seqs, cs.max_len);
  Plan plan = build_plan(seqs, cs.chunk_size, rng);
  const int n = cs.num_seqs, C = cs.chunk_size, D = cs.head_dim, KV = cs.num_kv_heads, H = KV * cs.group;
  const int64_t chunk_elems = static_cast<int64_t>(C) * D, pool_elems = plan.capacity * KV * chunk_elems;
  std::vector<T> k(pool_elems), v(pool_elems), q(static_cast<size_t>(n) * H * D), out(q.size());
  for (auto& x : k) x = to_storage<T>(rng.value());
  for (auto& x : v) x = to_storage<T>(rng.value());
  for (auto& x : q) x = to_storage<T>(rng.value());
  for (int i = 0; i < n; ++i) {  // NaN past each sequence's length in its last chunk
    const int64_t length = plan.seq_lens[i], last = plan.paths[i].back();
    for (int64_t row = (length - 1) % C + 1; row < C; ++row)
      for (int h = 0; h < KV; ++h)
        for (int d = 0; d < D; ++d) {
          const int64_t at = ((last * KV + h) * C + row) * D + d;
          k[at] = v[at] = to_storage<T>(std::nanf(""));
        }
  }
  Params p{};
  p.q = q.data(), p.k_cache = k.data(), p.v_cache = v.data(), p.out = out.data();
  p.shared_chunk_ids = plan.shared_ids.data(), p.shared_begin = plan.shared_begin.data();
  p.shared_end = plan.shared_end.data(), p.shared_depth = plan.shared_depth.data();
  p.private_chunk_ids = plan.private_ids.data(), p.num_shared_tokens = plan.num_shared_tokens.data();
  p.seq_lens = plan.seq_lens.data(), p.seq_pair_ptr = plan.seq_pair_ptr.data();
  p.num_seqs = n, p.num_heads = H, p.num_kv_heads = KV, p.head_dim = D, p.chunk_size = C;
  p.num_shared = static_cast<int>(plan.shared_ids.size()), p.max_private = std::max(plan.max_private, 1);
  p.dtype = sizeof(T) == 2 ? DType::kBFloat16 : DType::kFloat32;
  p.scale = 1.f / std::sqrt(static_cast<float>(D));
  p.window = cs.window;
  p.num_threads = 2;
  const std::vector<ChunkItem> items = chunk_items(p, cs.max_chunks_per_item);
  p.items = items.data(), p.num_items = static_cast<int>(items.size());
  const int64_t num_pairs = plan.seq_pair_ptr.back();
  std::vector<float> scratch(scratch_floats(num_pairs, n, H, KV, D, C, p.num_threads), std::nanf(""));
  p.partial_o = scratch.data();
  p.partial_m = p.partial_o + num_pairs * H * D;
  p.partial_n = p.partial_m + num_pairs * H;
  p.q_t = p.partial_n + num_pairs * H;
  p.workspace = p.q_t + static_cast<int64_t>(KV) * D * q_t_stride(n, H, KV);
  p.workspace_stride = workspace_floats(C, D, cs.group);
  variant.run(p);

  double worst = 0;
  std::vector<double> scores;
  for (int i = 0; i < n; ++i)
    for (int h = 0; h < H; ++h) {
      const int kv = h / cs.group, length = static_cast<int>(plan.seq_lens[i]);
      auto at = [&](int t, int d) { return ((plan.paths[i][t / C] * KV + kv) * C + t % C) * D + d; };
      scores.assign(length, 0.0);
      double m = -INFINITY, sum = 0;
      for (int t = 0; t < length; ++t) {
        for (int d = 0; d < D; ++d) scores[t] += load_scalar(q.data(), (static_cast<int64_t>(i) * H + h) * D + d) *
                                                 static_cast<double>(load_scalar(k.data(), at(t, d)));
        scores[t] *= p.scale;
        if (cs.window > 0 && t < length - cs.window) scores[t] = -INFINITY;  // before the window
        m = std::max(m, scores[t]);
      }
      for (double& s : scores) sum += (s = std::exp(s - m));
      for (int d = 0; d < D; ++d) {
        double expected = 0;
        for (int t = 0; t < length; ++t) expected += scores[t] * load_scalar(v.data(), at(t, d));
        const double got = load_scalar(out.data(), (static_cast<int64_t>(i) * H + h) * D + d);
        expected /= sum;
        // in units of the allowed error: fp32 math (1e-6 relative, 1e-6 absolute) and
        // for bf16 storage the output's rounding to nearest (half a unit in the last place)
        double allowed = 1e-6 + 1e-6 * std::fabs(expected);
        if (sizeof(T) == 2 && expected != 0) allowed += std::ldexp(1.0, std::ilogb(expected) - 8);
        const double error = std::fabs(got - expected) / allowed;
        if (!(error <= worst)) worst = error;  // NaN sticks
      }
    }
  return worst;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s VARIANT...\n", argv[0]);
    return 2;
  }
  // A few trees per (dtype, head dim, group, chunk size, segment length), kept small: under
  // qemu every instruction is emulated.
  std::vector<Case> cases;
  uint64_t seed = 1;
  for (int bf16 = 0; bf16 < 2; ++bf16)
    for (int head_dim : {64, 128, 256})
      for (int group : {1, 3, 4}) {
        const int chunk_size = (head_dim == 256 ? 16 : (group == 3 ? 48 : 32));
        for (int max_chunks : {1, 1000}) {
          const int num_seqs = group == 1 ? 37 : (group == 3 ? 17 : 5);
          cases.push_back({num_seqs, group == 4 ? 300 : 130, chunk_size, head_dim, 2, group, max_chunks, bf16 == 1, seed++});
        }
      }
  cases.push_back({1, 200, 64, 64, 3, 3, 1, false, seed++});  // one sequence: nothing shared
  cases.push_back({40, 40, 16, 128, 1, 1, 2, false, seed++});  // many sequences of exactly shared chunks
  // sliding windows shorter than, across and longer than the shared prefixes
  for (int window : {1, 23, 77})
    for (int max_chunks : {1, 1000}) {
      cases.push_back({17, 200, 16, 64, 2, 3, max_chunks, false, seed++, window});
      cases.push_back({5, 300, 32, 256, 1, 4, max_chunks, window == 23, seed++, window});
    }
  int failures = 0, runs = 0;
  for (int a = 1; a < argc; ++a) {
    double worst = 0;
    const Variant* variant = find_variant(argv[a]);
    if (variant == nullptr) {
      std::fprintf(stderr, "variant %s is not in this build\n", argv[a]);
      return 2;
    }
    bool runnable = variant->host_runs();
#ifdef CHUNK_ATTN_EMULATE_AVX512
    runnable = runnable || std::strcmp(argv[a], "avx512") == 0;  // SIMDe: no AVX-512 instruction
#endif
    if (!runnable) {
      std::fprintf(stderr, "this CPU cannot run variant %s\n", argv[a]);
      return 2;
    }
    for (const Case& cs : cases) {
      const double error = cs.bf16 ? run_case<uint16_t>(*variant, cs) : run_case<float>(*variant, cs);
      ++runs;
      if (!(error <= worst)) worst = error;  // NaN sticks
      if (!(error <= 1.0)) {
        ++failures;
        std::printf("FAIL %s: %s d=%d group=%d chunk=%d seqs=%d max_chunks=%d window=%d seed=%llu: max error %.3g x "
                    "the allowed\n", argv[a], cs.bf16 ? "bf16" : "fp32", cs.head_dim, cs.group, cs.chunk_size,
                    cs.num_seqs, cs.max_chunks_per_item, cs.window, static_cast<unsigned long long>(cs.seed), error);
      }
    }
    std::printf("variant %s: %zu cases, largest error %.2f x the allowed\n", argv[a], cases.size(), worst);
    const PrefillSummary prefill = run_prefill_cases(*variant);
    runs += prefill.cases, failures += prefill.failures;
    std::printf("variant %s prefill: %d cases, largest error %.2f x the allowed\n", argv[a], prefill.cases,
                prefill.worst);
  }
  std::printf("kernel_test: %d runs, %d failing\n", runs, failures);
  return failures == 0 ? 0 : 1;
}
