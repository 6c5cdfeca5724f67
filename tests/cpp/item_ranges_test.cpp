// ItemRanges (csrc/cpu/item_ranges.h) under real threads: every item taken exactly once, however
// the threads race, each inside the range its thread held as it took it. Threads sleep on
// some items (more than the cores: they are preempted too), so that ranges empty unevenly and
// stealing runs. Built and run with OpenMP by tests/test_cpu_kernel_driver.py.
//
//   item_ranges_test     exit status 0 when every trial passes
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <memory>  // (item_ranges.h's, as prelude.h gives the kernels)
#include <thread>
#include <vector>

#include <omp.h>

#define CHUNK_ATTN_ISA item_ranges_test
#include "item_ranges.h"
#include "test_rng.h"

using chunk_attn_cpu::item_ranges_test::ItemRanges;

int main() {
  int failures = 0, trials = 0;
  long stolen = 0;
  Rng rng{7};
  for (int threads : {1, 2, 3, 8})
    for (int64_t n : {0, 1, 2, 5, 17, 64, 1000})
      for (int trial = 0; trial < 20; ++trial, ++trials) {
        ItemRanges ranges(n, threads);
        std::vector<std::atomic<int>> taken(static_cast<size_t>(n));
        std::vector<std::vector<int64_t>> order(threads);
        const uint64_t slow = rng.next();  // (bit t % 64: thread t sleeps on some items)
#pragma omp parallel num_threads(threads)
        {
          const int t = omp_get_thread_num();
          int64_t end = 0;
          for (int64_t item; (item = ranges.take(t, end)) >= 0;) {
            taken[item].fetch_add(1);
            order[t].push_back(item);
            if (item >= end) {
              std::printf("FAIL threads=%d n=%lld: item %lld taken with its range ending at %lld\n", threads,
                          static_cast<long long>(n), static_cast<long long>(item), static_cast<long long>(end));
              ++failures;
            }
            if ((slow >> (t % 64) & 1) && item % 3 == 0) std::this_thread::sleep_for(std::chrono::microseconds(50));
          }
        }
        for (int64_t i = 0; i < n; ++i)
          if (taken[i].load() != 1 && ++failures <= 10)
            std::printf("FAIL threads=%d n=%lld trial=%d: item %lld taken %d times\n", threads,
                        static_cast<long long>(n), trial, static_cast<long long>(i), taken[i].load());
        for (int t = 0; t < threads; ++t) {  // what it took past the run from its own range's front
          size_t k = 0;
          while (k < order[t].size() && order[t][k] == n * t / threads + static_cast<int64_t>(k)) ++k;
          stolen += static_cast<long>(order[t].size() - k);
        }
      }
  std::printf("item_ranges: %d trials, %ld items taken from another thread's range, %d failing\n", trials, stolen,
              failures);
  return failures == 0 && stolen > 0 ? 0 : 1;
}
