// Work items [0, n) shared by a parallel region's threads, balanced as they run: each thread takes
// its own contiguous range's items in order from the front (one stream of reads, the next item
// prefetched), and a thread whose range is empty takes the back half of the range with the most
// items left as its own. A static split left a one-row call's threads waiting for the slower one
// 2-9% of the call (one core's reads ran slower than the other's; 1B file, Zen 5,
// docs/BENCHMARKS.md). Which thread computes an item changes none of its bits.
// In the variant's namespace: compiled with its flags (params.h on why).
#pragma once

namespace chunk_attn_cpu {
namespace CHUNK_ATTN_ISA {

class ItemRanges {
 public:
  // Range t of `parts`: items [n t / parts, n (t + 1) / parts).
  ItemRanges(int64_t n, int parts) : parts_(parts), ranges_(new Range[parts]) {
    for (int t = 0; t < parts; ++t) ranges_[t].word.store(pack(n * t / parts, n * (t + 1) / parts));
  }

  // Thread t's next item (its range's front, else the first of a half taken from the fullest
  // range), -1 once no range holds any. `end`: where thread t's range now ends (the item there
  // may be another thread's: a bound for prefetching the next one). The owner claims a run of up
  // to an eighth of what its range holds (at most 8) with one atomic step and hands it out one
  // item at a time: an atomic step per item cost ~18 ns, 2% of a one-row decode's C time.
  int64_t take(int t, int64_t& end) {
    Range& own = ranges_[t];
    if (own.claimed < own.claimed_end) {
      end = own.end;
      return own.claimed++;
    }
    for (;;) {
      uint64_t word = own.word.load(std::memory_order_relaxed);
      while (front(word) < back(word)) {  // (a thief may move the back meanwhile)
        const int64_t run = std::min<int64_t>(kMaxRun, std::max<int64_t>(1, (back(word) - front(word)) / 8));
        if (own.word.compare_exchange_weak(word, word + run, std::memory_order_relaxed)) {
          own.claimed = front(word) + 1, own.claimed_end = front(word) + run, own.end = back(word);
          end = own.end;
          return front(word);
        }
      }
      int victim = -1;
      int64_t most = 0;
      for (int v = 0; v < parts_; ++v) {
        const uint64_t w = ranges_[v].word.load(std::memory_order_relaxed);
        if (back(w) - front(w) > most) most = back(w) - front(w), victim = v;
      }
      if (victim < 0) return -1;
      uint64_t w = ranges_[victim].word.load(std::memory_order_relaxed);
      const int64_t f = front(w), b = back(w), middle = f + (b - f) / 2;
      if (f < b && ranges_[victim].word.compare_exchange_strong(w, pack(f, middle), std::memory_order_relaxed))
        own.word.store(pack(middle, b), std::memory_order_relaxed);  // (empty until now: no thief took it)
    }
  }

 private:
  static uint64_t pack(int64_t front, int64_t back) {
    return static_cast<uint64_t>(front) | static_cast<uint64_t>(back) << 32;
  }
  static int64_t front(uint64_t word) { return static_cast<int64_t>(word & 0xFFFFFFFFu); }
  static int64_t back(uint64_t word) { return static_cast<int64_t>(word >> 32); }

  static constexpr int64_t kMaxRun = 8;
  struct alignas(64) Range {  // (a cache line each: the owner's takes do not move the others')
    std::atomic<uint64_t> word{0};  // [front, back): the items no thread has claimed
    int64_t claimed = 0, claimed_end = 0, end = 0;  // the owner's claimed run, its range's end then (owner only)
  };
  int parts_;
  std::unique_ptr<Range[]> ranges_;
};

}  // namespace CHUNK_ATTN_ISA
}  // namespace chunk_attn_cpu
