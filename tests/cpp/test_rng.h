// The torch-free drivers' random numbers: xorshift64*, so every platform (qemu
// included) builds the same cases.
#pragma once

#include <cstdint>

struct Rng {
  uint64_t s;
  uint64_t next() {
    s ^= s >> 12, s ^= s << 25, s ^= s >> 27;
    return s * 2685821657736338717ull;
  }
  int uniform(int lo, int hi) { return lo + static_cast<int>(next() % static_cast<uint64_t>(hi - lo + 1)); }
  double unit() { return (next() >> 11) * (1.0 / 9007199254740992.0); }
  // triangular on (-2, 2), variance 2/3: cheap (qemu emulates every instruction) and
  // spread enough that the softmax is neither flat nor one-hot
  float value() { return static_cast<float>(2 * (unit() + unit()) - 2); }
};
