// Torch-free correctness test of the CPU kernel variants: random prefix trees, shared
// token-granular (test_tree.h: shared and private segments that start and end inside
// chunks, beside whole chunks), GQA groups, head dims and both storage dtypes against a
// scalar double-precision reference computed from each sequence's own keys. Built and
// run by tests/test_cpu_kernel_arm.py (aarch64, under qemu) and
// tests/test_cpu_kernel_driver.py (this machine, AVX-512 through SIMDe where the CPU
// lacks it).
//
//   kernel_test VARIANT...    exit status 0 when every case of every variant passes
//
// The prefill kernel's cases are in prefill_cases.cpp, linked beside this file.
//
// Every pool slot no segment holds is NaN (behind a segment that ends inside a chunk
// too): a kernel that reads one into the result fails.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <type_traits>
#include <utility>
#include <vector>

#include "linear_params.h"
#include "params.h"
#include "prefill_cases.h"
#include "quant_params.h"
#include "scalar.h"
#include "schedule.h"
#include "test_rng.h"
#include "test_tree.h"
#include "variants.h"

using namespace chunk_attn_cpu;

namespace {

struct Case {
  int num_seqs, max_len, chunk_size, head_dim, num_kv_heads, group, max_blocks_per_item;
  DType pool;  // q and out: the pool's dtype, float32 over a float16 pool
  uint64_t seed;
  int window = 0;  // sliding window; 0: none
};

// The plan of a tree: what chunk_llama/step/decode_plan.py builds, for sequences in depth-first
// order (the rows under any shared segment are contiguous).
struct Plan {
  std::vector<int64_t> shared_ids, shared_start, shared_len, shared_pos, shared_begin, shared_end, shared_depth;
  std::vector<int64_t> private_ids, private_start, private_pos;  // [num_seqs, max_private]
  std::vector<int64_t> num_shared_tokens, seq_lens, seq_pair_ptr;
  int max_private = 0;
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
  // Depth-first order: the sequences through a node are those that begin with its path's
  // tokens, contiguous once sorted (a prefix sorts first).
  std::sort(seqs.begin(), seqs.end());
  return seqs;
}

// A case's random numbers: its tree first (case_tree), then K, V and Q.
Rng case_rng(const Case& cs) { return Rng{cs.seed * 0x9e3779b97f4a7c15ull + 1}; }

Tree case_tree(const Case& cs, Rng& rng) {
  return build_tree(random_sequences(rng, cs.num_seqs, cs.max_len), cs.chunk_size, rng);
}

// As plan.py: a segment on >= 2 paths is shared, found again by its first slot when a
// later sequence reaches it; shared_depth counts the shared segments before it on its paths.
Plan build_plan(const Tree& tree) {
  Plan plan;
  const int n = static_cast<int>(tree.paths.size());
  std::map<std::pair<int64_t, int64_t>, size_t> shared_index;  // (chunk, start) -> index
  std::vector<std::vector<Segment>> own(n);
  plan.seq_pair_ptr.push_back(0);
  for (int row = 0; row < n; ++row) {
    int64_t depth = 0, length = 0;
    for (const Segment& s : tree.paths[row]) {
      length = s.pos + s.len;
      if (s.users < 2) {
        own[row].push_back(s);
        continue;
      }
      const auto [it, added] = shared_index.insert({{s.chunk, s.start}, plan.shared_ids.size()});
      if (added) {
        plan.shared_ids.push_back(s.chunk), plan.shared_start.push_back(s.start), plan.shared_len.push_back(s.len);
        plan.shared_pos.push_back(s.pos), plan.shared_depth.push_back(depth);
        plan.shared_begin.push_back(row), plan.shared_end.push_back(row);
      }
      if (plan.shared_end[it->second] != row) {  // a bug of this driver, not of the kernel
        std::fprintf(stderr, "sequences under a shared segment are not contiguous\n");
        std::abort();
      }
      plan.shared_end[it->second] = row + 1;
      ++depth;
    }
    plan.num_shared_tokens.push_back(own[row].empty() ? length : own[row][0].pos);
    plan.seq_lens.push_back(length);
    plan.seq_pair_ptr.push_back(plan.seq_pair_ptr.back() + depth);
    plan.max_private = std::max(plan.max_private, static_cast<int>(own[row].size()) + 1);
  }
  // every row ends with at least one unused entry: its position ends the kernel's walk
  for (int row = 0; row < n; ++row)
    for (size_t c = 0; c < static_cast<size_t>(plan.max_private); ++c) {
      const bool used = c < own[row].size();
      plan.private_ids.push_back(used ? own[row][c].chunk : 0);
      plan.private_start.push_back(used ? own[row][c].start : 0);
      plan.private_pos.push_back(used ? own[row][c].pos : kNoPosition);
    }
  return plan;
}

// How many cases' trees hold each kind of segment token-granular sharing makes (the run
// fails when one is missing: the cases would no longer test it).
struct Coverage {
  int whole_shared = 0;    // a shared segment that is a whole chunk
  int shared_ends = 0;     // a shared segment that ends inside its chunk (requests part there)
  int shared_starts = 0;   // a shared segment that starts inside its chunk (below another split)
  int private_starts = 0;  // a private segment that starts inside its chunk (goes on in place)
  int private_short = 0;   // a private segment shorter than a chunk, not the sequence's last
  void add(const Tree& tree, int C) {
    Coverage one;  // this tree's: 0 or 1 each
    for (const auto& path : tree.paths)
      for (size_t i = 0; i < path.size(); ++i) {
        const Segment& s = path[i];
        const bool shared = s.users > 1;
        one.whole_shared |= shared && s.start == 0 && s.len == C;
        one.shared_ends |= shared && s.start + s.len < C;
        one.shared_starts |= shared && s.start > 0;
        one.private_starts |= !shared && s.start > 0;
        one.private_short |= !shared && s.len < C && i + 1 < path.size();
      }
    whole_shared += one.whole_shared, shared_ends += one.shared_ends, shared_starts += one.shared_starts;
    private_starts += one.private_starts, private_short += one.private_short;
  }
  bool complete() const {
    return whole_shared > 0 && shared_ends > 0 && shared_starts > 0 && private_starts > 0 && private_short > 0;
  }
};

const char* pool_name(DType pool) {
  return pool == DType::kBFloat16 ? "bf16" : pool == DType::kFloat16 ? "fp16" : "fp32";
}

template <typename T>
T to_storage(float x);
template <>
float to_storage<float>(float x) { return x; }
template <>
uint16_t to_storage<uint16_t>(float x) { return float_to_bf16(x); }
template <>
Half to_storage<Half>(float x) { return Half{float_to_fp16(x)}; }

// Runs one case on `variant`; returns the largest error in units of the allowed error
// (NaN or inf when an output is not finite).
template <typename T>
double run_case(const Variant& variant, const Case& cs) {
  using Q = std::conditional_t<std::is_same_v<T, Half>, float, T>;  // (no float16 q)
  Rng rng = case_rng(cs);
  const Tree tree = case_tree(cs, rng);
  const Plan plan = build_plan(tree);
  const int n = cs.num_seqs, C = cs.chunk_size, D = cs.head_dim, KV = cs.num_kv_heads, H = KV * cs.group;
  std::vector<T> k, v;
  std::vector<Q> q(static_cast<size_t>(n) * H * D), out(q.size());
  fill_pool(tree, KV, C, D, rng, to_storage<T>, k, v);
  for (auto& x : q) x = to_storage<Q>(rng.value());
  Params p{};
  p.q = q.data(), p.k_cache = k.data(), p.v_cache = v.data(), p.out = out.data();
  p.shared_chunk_ids = plan.shared_ids.data(), p.shared_start = plan.shared_start.data();
  p.shared_len = plan.shared_len.data(), p.shared_pos = plan.shared_pos.data();
  p.shared_begin = plan.shared_begin.data(), p.shared_end = plan.shared_end.data();
  p.shared_depth = plan.shared_depth.data();
  p.private_chunk_ids = plan.private_ids.data(), p.private_start = plan.private_start.data();
  p.private_pos = plan.private_pos.data(), p.num_shared_tokens = plan.num_shared_tokens.data();
  p.seq_lens = plan.seq_lens.data(), p.seq_pair_ptr = plan.seq_pair_ptr.data();
  p.num_seqs = n, p.num_heads = H, p.num_kv_heads = KV, p.head_dim = D, p.chunk_size = C;
  p.num_shared = static_cast<int>(plan.shared_ids.size()), p.max_private = plan.max_private;
  p.dtype = cs.pool, p.q_dtype = std::is_same_v<Q, float> ? DType::kFloat32 : DType::kBFloat16;
  p.scale = 1.f / std::sqrt(static_cast<float>(D));
  p.window = cs.window;
  p.num_threads = 2;
  const DecodeSchedule schedule = decode_schedule(p, pair_segments(p), cs.max_blocks_per_item);
  std::vector<float> scratch(schedule.scratch_floats(p, p.num_threads), std::nanf(""));
  schedule.carve(p, scratch.data());
  variant.run(p);

  double worst = 0;
  std::vector<double> scores;
  for (int i = 0; i < n; ++i) {
    const auto slots = key_slots(tree.paths[i]);  // the sequence's own keys, by position
    for (int h = 0; h < H; ++h) {
      const int kv = h / cs.group, length = static_cast<int>(plan.seq_lens[i]);
      auto at = [&](int t, int d) { return ((slots[t].first * KV + kv) * C + slots[t].second) * D + d; };
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
        if (sizeof(Q) == 2 && expected != 0) allowed += std::ldexp(1.0, std::ilogb(expected) - 8);
        const double error = std::fabs(got - expected) / allowed;
        if (!(error <= worst)) worst = error;  // NaN sticks
      }
    }
  }
  return worst;
}

}  // namespace

// The largest error of y [rows, out] against a double-precision x W^T (+ b), in units of
// the allowed: a float32 dot product's rounding, 1e-6 of the sum of the terms' magnitudes.
double linear_error(const std::vector<float>& x, const std::vector<float>& w, const float* b,
                    const std::vector<float>& y, int rows, int out, int in) {
  double worst = 0;
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < out; ++c) {
      double exact = b ? b[c] : 0.0, magnitude = b ? std::fabs(b[c]) : 0.0;
      for (int i = 0; i < in; ++i) {
        exact += double(x[r * in + i]) * w[c * in + i];
        magnitude += std::fabs(double(x[r * in + i]) * w[c * in + i]);
      }
      const double error = std::fabs(y[r * out + c] - exact) / (1e-6 * magnitude + 1e-30);
      if (!(error <= worst)) worst = error;  // NaN sticks
    }
  return worst;
}

// small_linear (linear.h) of every odd size against a double-precision y = x W^T + b:
// tiles narrower than the register tile in rows and columns, in_features that are not a
// multiple of the lanes. Returns the largest error in units of the allowed (linear_error).
double run_linear_cases(const Variant& variant, int& cases) {
  Rng rng{12345};
  double worst = 0;
  for (int rows : {1, 3, 5, 17})
    for (int in : {7, 37, 96, 130})
      for (int out : {1, 5, 49})
        for (int bias = 0; bias < 2; ++bias) {
          std::vector<float> x(static_cast<size_t>(rows) * in), w(static_cast<size_t>(out) * in), b(out), y(rows * out);
          for (auto* v : {&x, &w, &b})
            for (float& e : *v) e = rng.value();
          LinearParams p{x.data(), w.data(), bias ? b.data() : nullptr, y.data(), rows, out, in, 1};
          variant.linear(p);
          ++cases;
          const double error = linear_error(x, w, bias ? b.data() : nullptr, y, rows, out, in);
          if (!(error <= worst)) worst = error;  // NaN sticks
        }
  return worst;
}

// quant_linear and dequantize (quant.h) of every GGML format on random blocks (every bit
// pattern of the packed weights; the fp16 scales finite, about 1e-2), against the generic
// variant's decoding (the Python tests check that one, and every variant the host runs,
// against gguf-py; the driver links it on every architecture, an aarch64 library has it not)
// and a double-precision y = x W^T + b of it: a variant's lane functions
// (vscaled_nibbles, vnibbles5, vnibbles5k, vq6k, vint8) checked where the host cannot run it natively.
double run_quant_cases(const Variant& variant, int& cases) {
  Rng rng{777};
  double worst = 0;
  for (int type : {kQ4_0, kQ4_1, kQ5_0, kQ5_1, kQ8_0, kQ4_K, kQ5_K, kQ6_K}) {
    const QuantFormat f = quant_format(type);
    const int in = 2 * f.block_elems, row_bytes = 2 * f.block_bytes;
    for (int rows : {1, 3, 17})
      for (int out : {5, 9}) {
        std::vector<uint8_t> w(static_cast<size_t>(out) * row_bytes);
        for (uint8_t& byte : w) byte = static_cast<uint8_t>(rng.next() >> 56);
        const int scale_at = type == kQ6_K ? 208 : 0, num_scales = (type == kQ4_1 || type == kQ5_1 || type == kQ4_K || type == kQ5_K) ? 2 : 1;
        for (int block = 0; block < out * 2; ++block)
          for (int s = 0; s < num_scales; ++s) {  // a half of 2^-7 .. 2^-6, either sign
            const uint16_t half = static_cast<uint16_t>((rng.next() >> 63) << 15 | (8u << 10) | (rng.next() >> 54));
            std::memcpy(&w[block * f.block_bytes + scale_at + 2 * s], &half, 2);
          }
        std::vector<float> truth(static_cast<size_t>(out) * in), decoded(truth.size()), x(rows * in), b(out),
            y(rows * out), scratch(static_cast<size_t>(quant_scratch_floats(rows, in)));
        generic::dequantize(DequantizeParams{w.data(), type, truth.data(), out, in, 1});
        variant.dequantize(DequantizeParams{w.data(), type, decoded.data(), out, in, 1});
        for (size_t i = 0; i < truth.size(); ++i) {  // one fused multiply-add apart at most
          const double error = std::fabs(decoded[i] - truth[i]) / (1e-6 * std::fabs(truth[i]) + 1e-9);
          if (!(error <= worst)) worst = error;
        }
        for (auto* v : {&x, &b})
          for (float& e : *v) e = rng.value();
        variant.quant_linear(QuantLinearParams{x.data(), w.data(), type, b.data(), y.data(), rows, out, in, 1,
                                               scratch.data()});
        ++cases;
        const double error = linear_error(x, truth, b.data(), y, rows, out, in);
        if (!(error <= worst)) worst = error;  // NaN sticks
      }
  }
  return worst;
}

// float_to_fp16 (a float16 pool's stores) against the nearest half found by search: the
// largest half at or below |f| and the next one up (the largest finite's next taken as 2^16,
// so that |f| >= 65520 overflows to infinity as IEEE's rounding says), ties to the even
// code; every half, its float neighbours, the midpoints between halves and theirs, random
// bit patterns, both signs; a NaN stays a NaN.
int check_fp16_rounding() {
  const auto value = [](uint16_t h) {
    return h >= 0x7c00 ? 65536.0 : static_cast<double>(fp16_to_float(reinterpret_cast<const uint8_t*>(&h)));
  };
  const auto nearest = [&](float f) -> uint16_t {
    const double a = std::fabs(static_cast<double>(f));
    uint16_t low = 0, high = 0x7c00;  // value(low) <= a < value(high), or a past 2^16
    if (a >= 65536.0) return static_cast<uint16_t>((std::signbit(f) ? 0x8000 : 0) | 0x7c00);
    while (high - low > 1) {
      const uint16_t mid = static_cast<uint16_t>((low + high) / 2);
      (value(mid) <= a ? low : high) = mid;
    }
    const double below = a - value(low), above = value(high) - a;
    const uint16_t h = below < above ? low : above < below ? high : (low % 2 == 0 ? low : high);
    return static_cast<uint16_t>((std::signbit(f) ? 0x8000 : 0) | h);
  };
  std::vector<float> values;
  for (uint32_t h = 0; h < 0x7c00; ++h) {
    const float x = static_cast<float>(value(static_cast<uint16_t>(h)));
    const float mid = static_cast<float>((value(static_cast<uint16_t>(h)) + value(static_cast<uint16_t>(h + 1))) / 2);
    for (float y : {x, mid})
      for (float z : {y, std::nextafter(y, 0.f), std::nextafter(y, INFINITY)}) values.insert(values.end(), {z, -z});
  }
  Rng rng{99};
  for (int i = 0; i < 1 << 20; ++i) {
    const uint32_t bits = static_cast<uint32_t>(rng.next() >> 32);
    float f;
    std::memcpy(&f, &bits, sizeof f);
    values.push_back(f);
  }
  values.insert(values.end(), {INFINITY, -INFINITY, 65519.996f, 65520.f, 1e30f, -0.f, 1e-45f, 2.9802322e-08f});
  int failures = 0;
  for (float f : values) {
    const uint16_t got = float_to_fp16(f);
    const bool ok = std::isnan(f) ? (got & 0x7c00) == 0x7c00 && (got & 0x3ff) != 0 : got == nearest(f);
    if (!ok && ++failures <= 5) std::printf("FAIL fp16 rounding: %.9g gave 0x%04x, not 0x%04x\n", f, got, nearest(f));
  }
  std::printf("fp16 rounding: %zu floats, %d wrong\n", values.size(), failures);
  return failures;
}

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s VARIANT...\n", argv[0]);
    return 2;
  }
  // A few trees per (dtype, head dim, group, chunk size, segment length), kept small: under
  // qemu every instruction is emulated.
  std::vector<Case> cases;
  uint64_t seed = 1;
  for (DType pool : {DType::kFloat32, DType::kBFloat16, DType::kFloat16})
    for (int head_dim : {64, 128, 256})
      for (int group : {1, 3, 4}) {
        if (pool == DType::kFloat16 && group != 3) continue;  // (its loads are all it adds: a few cases)
        const int chunk_size = (head_dim == 256 ? 16 : (group == 3 ? 48 : 32));
        for (int max_blocks : {1, 1000}) {
          const int num_seqs = group == 1 ? 37 : (group == 3 ? 17 : 5);
          cases.push_back({num_seqs, group == 4 ? 300 : 130, chunk_size, head_dim, 2, group, max_blocks, pool, seed++});
        }
      }
  const DType f32 = DType::kFloat32;
  cases.push_back({1, 200, 64, 64, 3, 3, 1, f32, seed++});  // one sequence: nothing shared
  cases.push_back({40, 40, 16, 128, 1, 1, 2, f32, seed++});  // many short sequences over a few chunks
  cases.push_back({17, 130, 16, 80, 2, 2, 1000, f32, seed++});  // D = 80: an odd number of 16-lane vectors
  cases.push_back({17, 130, 16, 80, 2, 2, 1000, DType::kFloat16, seed++});  // (its fp16 loads likewise)
  cases.push_back({9, 150, 32, 96, 2, 3, 1, DType::kBFloat16, seed++});  // D = 96: a narrower last P V slice (8 lanes)
  // sliding windows shorter than, across and longer than the shared prefixes
  for (int window : {1, 23, 77})
    for (int max_blocks : {1, 1000}) {
      cases.push_back({17, 200, 16, 64, 2, 3, max_blocks, window == 77 ? DType::kFloat16 : f32, seed++, window});
      cases.push_back({5, 300, 32, 256, 1, 4, max_blocks, window == 23 ? DType::kBFloat16 : f32, seed++, window});
    }
  int failures = check_fp16_rounding() > 0, runs = 0;
  Coverage coverage;  // the same trees for every variant
  for (const Case& cs : cases) {
    Rng rng = case_rng(cs);
    coverage.add(case_tree(cs, rng), cs.chunk_size);
  }
  std::printf("decode trees: of %zu cases, %d with a whole shared chunk, %d with a shared segment ending inside a "
              "chunk, %d starting inside one, %d with a private segment starting inside a chunk, %d with one shorter "
              "than a chunk before the sequence's next\n", cases.size(), coverage.whole_shared, coverage.shared_ends,
              coverage.shared_starts, coverage.private_starts, coverage.private_short);
  if (!coverage.complete()) {
    ++failures;
    std::printf("FAIL decode trees: a kind of segment is in no case\n");
  }
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
      const double error = cs.pool == DType::kBFloat16  ? run_case<uint16_t>(*variant, cs)
                           : cs.pool == DType::kFloat16 ? run_case<Half>(*variant, cs)
                                                        : run_case<float>(*variant, cs);
      ++runs;
      if (!(error <= worst)) worst = error;  // NaN sticks
      if (!(error <= 1.0)) {
        ++failures;
        std::printf("FAIL %s: %s d=%d group=%d chunk=%d seqs=%d max_blocks=%d window=%d seed=%llu: max error %.3g x "
                    "the allowed\n", argv[a], pool_name(cs.pool), cs.head_dim, cs.group, cs.chunk_size,
                    cs.num_seqs, cs.max_blocks_per_item, cs.window, static_cast<unsigned long long>(cs.seed), error);
      }
    }
    std::printf("variant %s: %zu cases, largest error %.2f x the allowed\n", argv[a], cases.size(), worst);
    const std::pair<const char*, double (*)(const Variant&, int&)> linear_kinds[] = {{"linear", run_linear_cases},
                                                                                     {"quant", run_quant_cases}};
    for (const auto& [kind, run_cases] : linear_kinds) {
      int kind_cases = 0;
      const double kind_worst = run_cases(*variant, kind_cases);
      runs += kind_cases;
      if (!(kind_worst <= 1.0)) {
        ++failures;
        std::printf("FAIL %s %s: max error %.3g x the allowed\n", argv[a], kind, kind_worst);
      }
      std::printf("variant %s %s: %d cases, largest error %.2f x the allowed\n", argv[a], kind, kind_cases,
                  kind_worst);
    }
    const PrefillSummary prefill = run_prefill_cases(*variant);
    runs += prefill.cases + prefill.context_cases, failures += prefill.failures;
    std::printf("variant %s prefill: %d cases, largest error %.2f x the allowed (%d with a segment starting inside "
                "a chunk, %d with one ending inside a chunk before the next)\n", argv[a], prefill.cases,
                prefill.worst, prefill.starts_inside, prefill.ends_inside);
    std::printf("variant %s prefill with context: %d cases, largest error %.2f x the allowed (%d with context items, "
                "%d with an item starting from a wider run's states, %d with a segment the context covers in part, %d "
                "with a sequence computing keys another reads as context, %d with an item ending inside a GQA "
                "group)\n",
                argv[a], prefill.context_cases, prefill.context_worst, prefill.with_context, prefill.chained,
                prefill.partly_covered, prefill.writers, prefill.items_in_group);
  }
  std::printf("kernel_test: %d runs, %d failing\n", runs, failures);
  return failures == 0 ? 0 : 1;
}
