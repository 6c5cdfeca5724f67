// Prefill cases for the torch-free driver (kernel_test.cpp): packed steps over
// token-granular prefix trees (test_tree.h: sequences part inside chunks, so segments
// start and end inside chunks), tiles of 128 and of 37 rows (so tiles end inside a
// token's GQA group), GQA groups 1/2/3, head dims 64/128/256, fp32 and bf16, a sliding
// window on some, against a scalar double-precision causal attention over each
// sequence's own keys. Two kinds of steps:
// - plain: three sequences (the second parts from the first inside a chunk), new tokens
//   from 0, a segment's first position, inside a segment or only the last token, one
//   spare row between sequences and no context phase; the tiles walk the decode plan's
//   segments (cut where a path's users change);
// - with context (the context phase, chunk_llama/step/prefill_schedule.py): 4 to 6 sequences
//   sharing prefixes of different lengths, packed next to each other in token order,
//   most of them reading a shared prefix whole and some computing part of it in the
//   step (no readers of it then), under a context plan built as prefill_schedule.py builds
//   it: runs of adjacent readers in whole blocks of keys, level by level (a narrower group
//   goes on from a wider one's states), in items of 128 or 37 rows (so items end inside a
//   token's GQA group too); the tiles walk the prefill plan's segments (a chunk's run of
//   slots as one), so a sequence's context can end inside one of them.
// Pool slots no segment holds are NaN (behind a segment's end inside a chunk, spare
// chunks, the guard chunk), and so is the partials' scratch: a kernel that reads one no
// context item wrote fails. Query rows of no sequence must stay NaN. The run fails when
// the cases no longer hold what they are there to test (run_prefill_cases).
#include "prefill_cases.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <map>
#include <set>
#include <type_traits>
#include <utility>
#include <vector>

#include "params.h"
#include "prefill_params.h"
#include "scalar.h"
#include "test_rng.h"
#include "test_tree.h"

using namespace chunk_attn_cpu;

namespace {

struct Case {
  int chunk_size, head_dim, num_kv_heads, group, tile_rows, item_rows, window;  // window 0: none
  DType pool;  // q and out: the pool's dtype, float32 over a float16 pool
  bool context;  // context: a step with shared prefixes, through the context phase
  uint64_t seed;
};

template <typename T>
T to_storage(float x) {
  if constexpr (std::is_same_v<T, Half>) return Half{float_to_fp16(x)};
  else if constexpr (sizeof(T) == 2) return float_to_bf16(x);
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

// 4 to 6 sequences of up to 180 tokens sharing prefixes of different lengths: the first of
// 2C .. 180 tokens, each later one copies a prefix of an earlier one's (mostly its longer
// half, so that shared prefixes span chunks and blocks of keys), parts from it there and
// goes on at random.
// Sorted: the sequences under a common prefix are next to each other (depth-first
// order), as the step packs them.
std::vector<std::vector<int>> shared_prefix_sequences(Rng& rng, int C) {
  std::vector<std::vector<int>> seqs(rng.uniform(4, 6));
  for (size_t s = 0; s < seqs.size(); ++s) {
    size_t length = rng.uniform(2 * C, 180);
    if (s > 0) {
      const std::vector<int>& parent = seqs[rng.uniform(0, static_cast<int>(s) - 1)];
      const int size = static_cast<int>(parent.size());
      const int keep = rng.uniform(0, 2) == 0 ? rng.uniform(1, size - 1) : rng.uniform(size / 2, size - 1);
      seqs[s].assign(parent.begin(), parent.begin() + keep);
      seqs[s].push_back((parent[keep] + 1) % 3);  // parts here
    }
    while (seqs[s].size() < length) seqs[s].push_back(rng.uniform(0, 2));
  }
  std::sort(seqs.begin(), seqs.end());
  return seqs;
}

// A path's segments as the prefill plan cuts them (prefill_schedule.py's merged): consecutive
// slots of one chunk are one segment, whoever else holds a part of them.
std::vector<Segment> merged(const std::vector<Segment>& segments) {
  std::vector<Segment> out;
  for (const Segment& x : segments)
    if (!out.empty() && out.back().chunk == x.chunk && out.back().start + out.back().len == x.start)
      out.back().len += x.len;
    else
      out.push_back(x);
  return out;
}

// One packed step: the tree, the segments each sequence's tiles walk, its new tokens
// (from q_start, num_tokens of them) and their rows in q (from token_start; q has rows
// of no sequence too).
struct Step {
  Tree tree;
  std::vector<std::vector<Segment>> walk;
  std::vector<int64_t> q_start, num_tokens, token_start;
  int64_t rows = 0;
  int num_seqs() const { return static_cast<int>(q_start.size()); }
};

// Three sequences, each from 0, a segment's first position, inside a segment or only its
// last token, packed in reverse order with one spare row behind each; the decode plan's
// segments: finer than the prefill plan's, which the kernel reads alike.
Step plain_step(Rng& rng, int C) {
  Step step;
  step.tree = build_tree(prefill_sequences(rng, C), C, rng);
  step.walk = step.tree.paths;
  for (const auto& path : step.tree.paths) {
    const int length = static_cast<int>(path.back().pos + path.back().len);
    const int boundary = static_cast<int>(path[rng.uniform(0, static_cast<int>(path.size()) - 1)].pos);
    const int choices[4] = {0, boundary, std::min(length - 1, boundary + rng.uniform(1, C - 1)), length - 1};
    step.q_start.push_back(choices[rng.uniform(0, 3)]);
    step.num_tokens.push_back(length - step.q_start.back());
  }
  step.token_start.resize(3);
  for (int s = 2; s >= 0; --s) step.token_start[s] = step.rows, step.rows += step.num_tokens[s] + 1;
  return step;
}

// Sequences sharing prefixes, new tokens mostly from the end of a segment they share (or
// past all they share, or only the last token): readers of their shared prefix; some from
// inside a shared segment, computing the rest of it in the step. Packed in order, next to
// each other, between two spare rows (the first: global rows do not start at 0); the
// prefill plan's segments.
Step shared_step(Rng& rng, int C) {
  Step step;
  step.tree = build_tree(shared_prefix_sequences(rng, C), C, rng);
  for (const auto& path : step.tree.paths) {
    step.walk.push_back(merged(path));
    const int64_t length = path.back().pos + path.back().len;
    int shared = 0;  // the path's leading segments other sequences hold too (users only fall along it)
    while (shared < static_cast<int>(path.size()) && path[shared].users > 1) ++shared;
    int64_t q_start = length - 1;
    if (shared > 0) {
      const Segment& x = path[rng.uniform(0, shared - 1)];
      const int64_t shared_end = path[shared - 1].pos + path[shared - 1].len;
      switch (rng.uniform(0, 4)) {
        case 0:
        case 1: q_start = x.pos + x.len; break;                                      // reads up to x
        case 2: q_start = shared_end + rng.uniform(0, C - 1); break;                 // reads all it shares
        case 3: q_start = x.pos + rng.uniform(0, static_cast<int>(x.len) - 1); break;  // computes part of x
        default: break;                                                              // only the last token
      }
    }
    step.q_start.push_back(std::min(q_start, length - 1));
    step.num_tokens.push_back(length - step.q_start.back());
  }
  step.rows = 1;
  for (int s = 0; s < step.num_seqs(); ++s) step.token_start.push_back(step.rows), step.rows += step.num_tokens[s];
  ++step.rows;
  return step;
}

// The context phase's plan (PrefillParams' ctx_* and seq_ctx_*, sized as it is there).
struct ContextPlan {
  std::vector<int64_t> ctx_end, items, levels{0}, seq_ctx_ptr, seq_ctx_offset;
  int64_t num_partial_rows = 0;
};

ContextPlan no_context(int num_seqs) {
  ContextPlan plan;
  plan.ctx_end.assign(num_seqs, 0);
  plan.seq_ctx_ptr.assign(num_seqs + 1, 0);
  return plan;
}

// The context plan of a step as prefill_schedule.py builds it (context_runs and
// context_work), the tree's segments standing for its nodes, less the choice of runs by
// the work they save (any plan must be right). A segment is read as context by the
// sequences whose new tokens all come after it, those of them packed next to each other (2
// or more) together; a sequence's runs are its path's leading segments read so, one per
// group of readers, each in whole blocks of keys from where the run before it (a wider
// group's, a level up) stopped, in items of at most item_rows query rows that start from
// that run's states.
ContextPlan context_plan(const Step& step, int group, int item_rows) {
  const int n = step.num_seqs(), B = kBlockKeys;
  ContextPlan plan = no_context(n);
  std::vector<int> order(n);  // sequences in token order
  for (int s = 0; s < n; ++s) order[s] = s;
  std::sort(order.begin(), order.end(), [&](int a, int b) { return step.token_start[a] < step.token_start[b]; });
  std::vector<int> next(n, -1);  // the sequence whose tokens follow each one's, no row between
  for (int i = 0; i + 1 < n; ++i)
    if (step.token_start[order[i]] + step.num_tokens[order[i]] == step.token_start[order[i + 1]])
      next[order[i]] = order[i + 1];
  using Key = std::pair<int64_t, int64_t>;  // a segment of the tree: its chunk and first slot
  std::map<Key, std::vector<int>> readers;  // the sequences whose new tokens see it whole, in token order
  for (int s : order)
    for (const Segment& x : step.tree.paths[s]) {
      if (step.q_start[s] < x.pos + x.len) break;
      readers[{x.chunk, x.start}].push_back(s);
    }
  std::map<std::pair<Key, int>, std::vector<int>> run_of;  // (segment, sequence) -> its adjacent readers
  for (const auto& [key, seqs] : readers)
    for (size_t i = 0, j = 1; i < seqs.size(); i = j++) {
      while (j < seqs.size() && next[seqs[j - 1]] == seqs[j]) ++j;
      const std::vector<int> run(seqs.begin() + i, seqs.begin() + j);
      if (run.size() > 1)
        for (int s : run) run_of[{key, s}] = run;
    }
  struct ContextRun {
    std::vector<int> seqs;
    int64_t first, end;
    int level;
  };
  std::vector<ContextRun> runs;
  for (int s : order) {
    std::vector<std::pair<std::vector<int>, int64_t>> spans;  // each group's segments' end
    for (const Segment& x : step.tree.paths[s]) {
      const auto it = run_of.find({{x.chunk, x.start}, s});
      if (it == run_of.end()) break;
      if (spans.empty() || spans.back().first != it->second) spans.push_back({it->second, 0});
      spans.back().second = x.pos + x.len;
    }
    int64_t first = 0;
    for (const auto& [seqs, span_end] : spans) {
      const int64_t end = span_end / B * B;
      if (end <= first) continue;  // within the block the run before reached
      bool made = false;
      int level = 0;
      for (const ContextRun& r : runs) {
        made |= r.seqs == seqs && r.first == first;
        level += std::includes(r.seqs.begin(), r.seqs.end(), seqs.begin(), seqs.end()) && r.seqs != seqs;
      }
      if (!made) runs.push_back({seqs, first, end, level});
      first = plan.ctx_end[s] = end;
    }
  }
  std::vector<int64_t> last(n, kNoState);  // each sequence's states so far
  int max_level = 0;
  for (const ContextRun& r : runs) max_level = std::max(max_level, r.level);
  for (int level = 0; level <= max_level && !runs.empty(); ++level) {
    for (const ContextRun& r : runs) {
      if (r.level != level) continue;
      const int64_t token_begin = step.token_start[r.seqs.front()];
      const int64_t token_end = step.token_start[r.seqs.back()] + step.num_tokens[r.seqs.back()];
      const int64_t offset = plan.num_partial_rows - token_begin;  // token t's state: row offset + t
      plan.num_partial_rows += token_end - token_begin;
      const int64_t start = r.first > 0 ? last[r.seqs.front()] : kNoState;
      for (int64_t row = token_begin * group; row < token_end * group; row += item_rows)
        plan.items.insert(plan.items.end(), {r.seqs.front(), r.first / B, r.end / B, row,
                                             std::min(token_end * group, row + item_rows), offset, start});
      for (int s : r.seqs) last[s] = offset;
    }
    plan.levels.push_back(static_cast<int64_t>(plan.items.size() / 7));
  }
  for (int s = 0; s < n; ++s) {
    if (last[s] != kNoState) plan.seq_ctx_offset.push_back(last[s]);
    plan.seq_ctx_ptr[s + 1] = static_cast<int64_t>(plan.seq_ctx_offset.size());
  }
  return plan;
}

// Adds what a context case holds to the summary's counts (each 0 or 1 per case).
void count_context(const Step& step, const ContextPlan& plan, int group, PrefillSummary& summary) {
  bool partly_covered = false, writer = false, item_in_group = false, chained = false;
  for (int s = 0; s < step.num_seqs(); ++s) {
    const int64_t end = plan.ctx_end[s];
    for (const Segment& x : step.walk[s]) partly_covered |= x.pos < end && end < x.pos + x.len;
    // a sequence that computes in the step keys another reads as context
    const auto slots = key_slots(step.tree.paths[s]);
    for (int r = 0; r < step.num_seqs(); ++r) {
      const auto theirs = key_slots(step.tree.paths[r]);
      for (int64_t pos = step.q_start[s]; pos < plan.ctx_end[r] && pos < static_cast<int64_t>(slots.size()); ++pos)
        writer |= r != s && slots[pos] == theirs[pos];
    }
  }
  for (size_t i = 0; i < plan.items.size(); i += 7) {
    item_in_group |= plan.items[i + 4] % group != 0;
    chained |= plan.items[i + 6] != kNoState;
  }
  summary.with_context += !plan.items.empty(), summary.chained += chained;
  summary.partly_covered += partly_covered, summary.writers += writer, summary.items_in_group += item_in_group;
}

template <typename T>
double run(const Variant& variant, const Case& cs, PrefillSummary& summary) {
  Rng rng{cs.seed * 0x9e3779b97f4a7c15ull + 7};
  const int C = cs.chunk_size, D = cs.head_dim, KV = cs.num_kv_heads, group = cs.group, H = KV * group;
  const Step step = cs.context ? shared_step(rng, C) : plain_step(rng, C);
  const int num_seqs = step.num_seqs();
  // Segment tables, [num_seqs, max_segments] with at least one unused entry per sequence.
  int max_segments = 0;
  for (const auto& walk : step.walk) max_segments = std::max(max_segments, static_cast<int>(walk.size()) + 1);
  std::vector<int64_t> seg_chunk, seg_start, seg_pos;
  bool starts_inside = false, ends_inside = false;
  for (const auto& walk : step.walk)
    for (size_t i = 0; i < static_cast<size_t>(max_segments); ++i) {
      const bool used = i < walk.size();
      seg_chunk.push_back(used ? walk[i].chunk : 0);
      seg_start.push_back(used ? walk[i].start : 0);
      seg_pos.push_back(used ? walk[i].pos : kNoPosition);
      starts_inside |= used && walk[i].start > 0;
      ends_inside |= i + 1 < walk.size() && walk[i].start + walk[i].len < C;
    }
  if (!cs.context) summary.starts_inside += starts_inside, summary.ends_inside += ends_inside;
  std::vector<T> k, v;
  fill_pool(step.tree, KV, C, D, rng, to_storage<T>, k, v);
  using Q = std::conditional_t<std::is_same_v<T, Half>, float, T>;  // (no float16 q)
  std::vector<Q> q(static_cast<size_t>(step.rows) * H * D), out(q.size(), to_storage<Q>(std::nanf("")));
  for (auto& x : q) x = to_storage<Q>(rng.value());
  std::vector<int64_t> token_pos(step.rows, 0);  // rows of no sequence: 0
  for (int s = 0; s < num_seqs; ++s)
    for (int64_t i = 0; i < step.num_tokens[s]; ++i) token_pos[step.token_start[s] + i] = step.q_start[s] + i;
  std::vector<int64_t> tiles;
  for (int s = 0; s < num_seqs; ++s)
    for (int64_t r = 0; r < step.num_tokens[s] * group; r += cs.tile_rows)
      tiles.insert(tiles.end(), {s, r, std::min<int64_t>(step.num_tokens[s] * group, r + cs.tile_rows)});
  const ContextPlan plan = cs.context ? context_plan(step, group, cs.item_rows) : no_context(num_seqs);
  if (cs.context) count_context(step, plan, group, summary);
  std::vector<float> partial_o(plan.num_partial_rows * H * D, std::nanf(""));  // NaN: unwritten
  std::vector<float> partial_m(plan.num_partial_rows * H, std::nanf("")), partial_n = partial_m;

  PrefillParams p{};
  p.q = q.data(), p.k_cache = k.data(), p.v_cache = v.data(), p.out = out.data();
  p.seg_chunk = seg_chunk.data(), p.seg_start = seg_start.data(), p.seg_pos = seg_pos.data();
  p.q_start = step.q_start.data(), p.num_tokens = step.num_tokens.data();
  p.token_start = step.token_start.data(), p.tiles = tiles.data(), p.token_pos = token_pos.data();
  p.ctx_end = plan.ctx_end.data(), p.ctx_items = plan.items.data(), p.ctx_levels = plan.levels.data();
  p.seq_ctx_ptr = plan.seq_ctx_ptr.data(), p.seq_ctx_offset = plan.seq_ctx_offset.data();
  p.partial_o = partial_o.data(), p.partial_m = partial_m.data(), p.partial_n = partial_n.data();
  p.num_partial_rows = plan.num_partial_rows;
  p.num_tiles = static_cast<int>(tiles.size() / 3), p.num_ctx_items = static_cast<int>(plan.items.size() / 7);
  p.num_ctx_levels = static_cast<int>(plan.levels.size()) - 1;
  p.num_threads = 1;
  p.num_seqs = num_seqs, p.max_segments = max_segments, p.num_heads = H, p.num_kv_heads = KV, p.head_dim = D;
  p.chunk_size = C, p.dtype = cs.pool, p.scale = 1.f / std::sqrt(float(D));
  p.q_dtype = std::is_same_v<Q, float> ? DType::kFloat32 : DType::kBFloat16;
  p.window = cs.window;
  p.workspace_stride = prefill_workspace_floats(D);
  std::vector<float> workspace(p.workspace_stride, std::nanf(""));
  p.workspace = workspace.data();
  variant.prefill(p);

  double worst = 0;
  std::vector<double> w;
  std::vector<bool> owned(step.rows);  // query rows of some sequence
  for (int s = 0; s < num_seqs; ++s) {
    const auto slots = key_slots(step.tree.paths[s]);  // the sequence's own keys, by position
    for (int64_t i = 0; i < step.num_tokens[s]; ++i) {
      owned[step.token_start[s] + i] = true;
      for (int h = 0; h < H; ++h) {
        const int64_t pos = step.q_start[s] + i, kv = h / group;
        const int64_t q_row = ((step.token_start[s] + i) * H + h) * D;
        auto at = [&](int64_t t, int d) { return ((slots[t].first * KV + kv) * C + slots[t].second) * D + d; };
        w.assign(pos + 1, 0.0);
        double m = -INFINITY, sum = 0;
        for (int64_t t = 0; t <= pos; ++t) {
          for (int d = 0; d < D; ++d) w[t] += load_scalar(q.data(), q_row + d) * double(load_scalar(k.data(), at(t, d)));
          w[t] *= p.scale;
          if (cs.window > 0 && t <= pos - cs.window) w[t] = -INFINITY;  // before the window
          m = std::max(m, w[t]);
        }
        for (double& x : w) sum += (x = std::exp(x - m));
        for (int d = 0; d < D; ++d) {
          double expected = 0;
          for (int64_t t = 0; t <= pos; ++t) expected += w[t] * load_scalar(v.data(), at(t, d));
          expected /= sum;
          double allowed = 1e-6 + 1e-6 * std::fabs(expected);  // as kernel_test.cpp's decode cases
          if (sizeof(Q) == 2 && expected != 0) allowed += std::ldexp(1.0, std::ilogb(expected) - 8);
          const double error = std::fabs(load_scalar(out.data(), q_row + d) - expected) / allowed;
          if (!(error <= worst)) worst = error;  // NaN sticks
        }
      }
    }
  }
  for (int64_t row = 0; row < step.rows; ++row)  // rows of no sequence are untouched
    if (!owned[row])
      for (int64_t i = row * H * D; i < (row + 1) * H * D; ++i)
        if (!std::isnan(load_scalar(out.data(), i))) worst = INFINITY;
  return worst;
}

}  // namespace

PrefillSummary run_prefill_cases(const Variant& variant) {
  PrefillSummary summary;
  uint64_t seed = 1;
  for (int context = 0; context < 2; ++context)
    for (DType pool : {DType::kFloat32, DType::kBFloat16, DType::kFloat16})
      for (int head_dim : {64, 80, 96, 128, 256})
        for (int group : {1, 2, 3}) {
          if (pool == DType::kFloat16 && group != 3) continue;  // (its loads are all it adds: a few cases)
          const int chunk_size = head_dim == 256 ? 16 : 32, tile_rows = group == 2 ? 128 : 37;
          // items of 128 rows or of 37, with group 2 or 3 either ending inside a token's group
          const int item_rows = (seed / 2) % 2 ? 128 : 37;
          // a sliding window on every other case: shorter than a chunk, across chunks, and
          // with context across several of them (items that skip a segment, partials of
          // rows that see none of the context)
          const int window = (seed % 2) * (head_dim == 128 ? 7 : (head_dim == 64 || !context ? 21 : 40));
          const Case cs{chunk_size, head_dim, 2, group, tile_rows, item_rows, window, pool, context == 1, seed++};
          const double error = pool == DType::kBFloat16  ? run<uint16_t>(variant, cs, summary)
                               : pool == DType::kFloat16 ? run<Half>(variant, cs, summary)
                                                         : run<float>(variant, cs, summary);
          double& worst = context ? summary.context_worst : summary.worst;
          ++(context ? summary.context_cases : summary.cases);
          if (!(error <= worst)) worst = error;
          if (!(error <= 1.0)) {
            ++summary.failures;
            std::printf("FAIL %s prefill%s: %s d=%d group=%d chunk=%d tile=%d item=%d window=%d seed=%llu: max error "
                        "%.3g x the allowed\n", variant.name, context ? " with context" : "",
                        pool == DType::kBFloat16 ? "bf16" : pool == DType::kFloat16 ? "fp16" : "fp32",
                        head_dim, group, chunk_size, tile_rows, item_rows, window,
                        static_cast<unsigned long long>(cs.seed), error);
          }
        }
  // the cases would no longer test what they are there for
  if (summary.starts_inside == 0 || summary.ends_inside == 0) {
    ++summary.failures;
    std::printf("FAIL %s prefill: no case has a segment starting inside a chunk, or ending inside one before the "
                "next\n", variant.name);
  }
  if (summary.chained == 0 || summary.partly_covered == 0 || summary.writers == 0 || summary.items_in_group == 0) {
    ++summary.failures;
    std::printf("FAIL %s prefill with context: no case has an item starting from a wider run's states, a segment the "
                "context covers in part, a sequence computing keys another reads as context, or an item ending inside "
                "a GQA group\n", variant.name);
  }
  return summary;
}
