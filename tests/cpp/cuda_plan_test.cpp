// The CUDA C interface's host-side checks (chunk_llama/csrc/cuda/plan_checks.h), built with a
// plain C++ compiler and run without a GPU (tests/test_cuda_plan_checks.py): what a plan is
// checked for once per step (geometry, layout, every array inside the plan tensor) and what a
// layer's call is checked for (its pools against the plan, its window, the plan's generation
// and the workspace's size). The pointers are host memory: nothing here reads through them.
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "plan_checks.h"

using namespace chunk_llama_cuda_internal;

namespace {

int cases = 0, failing = 0;

// Runs `body` as an entry point would; expects `kind` (0: success) and, on failure, `message`
// in the error's text.
template <typename Body>
void expect(const char* name, int kind, const std::string& message, Body&& body) {
  ++cases;
  const int got = chunk_llama_api::guarded(body);
  const std::string& text = chunk_llama_api::last_error();
  if (got != kind || (kind != 0 && text.find(message) == std::string::npos)) {
    ++failing;
    std::printf("FAIL %s: kind %d (expected %d), message '%s' (expected '%s')\n", name, got, kind,
                got ? text.c_str() : "", message.c_str());
  }
}

struct Plan {  // what checked_call reads of the handle (c_api.cu's chunk_llama_cuda_plan)
  uint64_t generation = 0;
  bool ready = false;
  CheckedPlan checked{};
};

}  // namespace

int main() {
  // 3 sequences, 2 shared chunks, 4 private entries each: the arrays one after another
  const int64_t seqs = 3, shared = 2, width = 4;
  const int64_t counts[kNumArrays] = {shared, shared, shared, shared, shared, seqs * width, seqs, seqs, seqs + 1, 5};
  std::vector<int64_t> layout = {seqs, shared, width, 3, 2, 16, 40};
  int64_t total = 0;
  for (int64_t count : counts) layout.push_back(total), total += count;
  std::vector<int32_t> index(total, 0);
  const auto params = [&] {
    chunk_llama_cuda_plan_params p{};
    p.device = 0, p.dtype = CHUNK_LLAMA_CUDA_BFLOAT16, p.index = index.data(), p.index_numel = total;
    p.layout = layout.data(), p.layout_size = static_cast<int64_t>(layout.size());
    p.num_seqs = seqs, p.num_heads = 8, p.num_kv_heads = 2, p.head_dim = 128, p.chunk_size = 64;
    return p;
  };
  CheckedPlan good{};
  expect("a good plan", 0, "", [&] { good = check_plan(params()); });
  if (good.arrays[kSeqPartialRows - kCudaDecodeCounts] != index.data() + layout[kSeqPartialRows] ||
      good.workspace_floats != tpp_workspace_floats(3, 8, 2, 128, 16) || good.max_private_tokens != 40) {
    ++failing;
    std::printf("FAIL a good plan: its arrays, counts or workspace are not the layout's\n");
  }
  expect("a short layout", 1, "the CUDA decode layout has 17 entries, got 16", [&] {
    auto p = params();
    p.layout_size -= 1;
    check_plan(p);
  });
  expect("another number of sequences", 1, "the plan is for 3 sequences, q has 4", [&] {
    auto p = params();
    p.num_seqs = 4;
    check_plan(p);
  });
  expect("an array past the plan", 1, "plan array seq_lens (3 entries from", [&] {
    auto p = params();
    p.index_numel = layout[kSeqLens] + 2;
    check_plan(p);
  });
  expect("a negative offset", 1, "plan array shared_begin (2 entries from -1)", [&] {
    auto bad = layout;
    bad[kSharedBegin] = -1;
    auto p = params();
    p.layout = bad.data();
    check_plan(p);
  });
  expect("a count too large for the kernels", 1, "count 5 is 4294967296", [&] {
    auto bad = layout;
    bad[kNumPartialRows] = int64_t{1} << 32;
    auto p = params();
    p.layout = bad.data();
    check_plan(p);
  });
  expect("a head dim without kernels", 1, "got head_dim 96, chunk_size 64", [&] {
    auto p = params();
    p.head_dim = 96;
    check_plan(p);
  });
  expect("float32", 2, "got dtype code 7", [&] {
    auto p = params();
    p.dtype = 7;
    check_plan(p);
  });
  // a layer's call
  chunk_llama_cuda_kv kv{};
  int pool = 0;
  kv.k = kv.v = &pool, kv.num_kv_heads = 2, kv.chunk_size = 64, kv.head_dim = 128, kv.dtype = CHUNK_LLAMA_CUDA_BFLOAT16;
  expect("the plan's pools", 0, "", [&] { check_kv(kv, good); });
  expect("another pool", 1, "is not the one the plan was made for (2, 64, 128)", [&] {
    auto other = kv;
    other.chunk_size = 32;
    check_kv(other, good);
  });
  expect("another dtype", 2, "dtype code 0, the plan 1", [&] {
    auto other = kv;
    other.dtype = CHUNK_LLAMA_FLOAT16;
    check_kv(other, good);
  });
  expect("a negative window", 1, "window must be 0 (none) or a positive int32, got -1", [&] {
    auto other = kv;
    other.window = -1;
    check_kv(other, good);
  });
  Plan plan;
  plan.generation = 2, plan.ready = true, plan.checked = good;
  std::vector<float> workspace(good.workspace_floats);
  const auto call = [&](uint64_t generation, int64_t numel) {
    checked_call(&plan, generation, workspace.data(), numel);
  };
  expect("this step's call", 0, "", [&] { call(2, good.workspace_floats); });
  expect("the last step's call", 1, "stale (generation 1; its handle holds 2)", [&] { call(1, good.workspace_floats); });
  expect("a small workspace", 1, "workspace must be a contiguous float32 tensor of at least", [&] {
    call(2, good.workspace_floats - 1);
  });
  plan.ready = false;  // a planning that failed
  expect("after a failed planning", 1, "its handle holds 2, not planned", [&] { call(2, good.workspace_floats); });
  std::printf("cuda plan checks: %d cases, %d failing\n", cases, failing);
  return failing == 0 ? 0 : 1;
}
