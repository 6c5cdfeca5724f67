// A run of one row's int16 steps (quant_act_row.h's IRun; the API in lanes_int8_avx512.h) for the
// integer lanes whose idot is exact in int32 at any length (AVX-512 VNNI's, the portable ones): each
// half's own int32 sum, combined at the run's end. Included by those lanes inside the variant's
// namespace, after their idot, iadd and imul255.
#pragma once

template <int kMaxCode>
constexpr int kRunSteps = 8;
struct IRun {
  IVec low, high;
};
template <int kMaxCode>
inline IRun irun_first(IVec u, const int8_t* lo, const int8_t* hi) {
  return {idot<kMaxCode, 1>(iset1(0), &u, lo), idot<kMaxCode, 1>(iset1(0), &u, hi)};
}
template <int kMaxCode>
inline IRun irun_next(IRun run, IVec u, const int8_t* lo, const int8_t* hi) {
  return {idot<kMaxCode, 1>(run.low, &u, lo), idot<kMaxCode, 1>(run.high, &u, hi)};
}
inline IVec irun_end(IVec acc, IRun run) { return iadd(acc, iadd(run.low, imul255(run.high))); }
