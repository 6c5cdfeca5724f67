// The C interface of the linear layers on GGML blocks with a choice of activations
// (c_api.h: chunk_llama_cpu_quant_matmul, _int8_variant): float32 (quant_linear.h) or int8 /
// int16 (quant_act.h), checks, the integer kernel's variant and its scratch. Baseline code, like
// c_api.cpp; failed checks are reported as chunk_llama/api_errors.h says.
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "api_internal.h"
#include "c_api.h"
#include "chunk_llama/api_errors.h"
#include "quant_act_params.h"
#include "quant_params.h"
#include "variants.h"

namespace chunk_llama_cpu_internal {

using chunk_attn_cpu::Variant;

// The variant whose int8 kernel runs for `isa`: itself where this CPU runs its integer code,
// else the next one down the list that does (AVX-512 without VNNI: AVX2's).
const Variant& int8_variant_for(const char* isa) {
  const Variant& requested = variant_for(isa);
  bool after = false;
  for (const Variant& v : chunk_attn_cpu::kVariants) {
    after = after || &v == &requested;
    if (after && v.host_runs() && v.int8_host_runs()) return v;
  }
  return requested;  // (generic's always runs: not reached)
}

// A weight of num_rows rows (weight_bytes in all) of an integer format in whole tiles, checked,
// and its tiles' layout (quant_params.h): per block, the 16 rows' lone fp16 (if any), then dword k
// of rows 0 .. 15 for each k. `what` names the caller in the errors.
struct TileLayout {
  chunk_attn_cpu::QuantFormat f;
  int64_t row_bytes, blocks, tile_bytes, tile_block;  // tile_block: one block of the 16 rows
  int half_at, halves, first, dwords;                 // the lone fp16's place in a row's block, ...
};

TileLayout tile_layout(const char* what, int type, int64_t weight_bytes, int64_t num_rows) {
  using chunk_attn_cpu::kTileRows;
  CHECK_VALUE(chunk_attn_cpu::quant_int8_supports(type) && !chunk_attn_cpu::is_tiled(type), what, ": GGML type ",
              type, " is not a format with integer codes (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K)");
  CHECK_VALUE(num_rows > 0 && num_rows % kTileRows == 0 && weight_bytes % num_rows == 0, what, ": ", num_rows,
              " rows (", weight_bytes, " bytes) are not whole tiles of ", kTileRows);
  TileLayout t;
  t.f = chunk_attn_cpu::quant_format(type);
  t.row_bytes = weight_bytes / num_rows;
  CHECK_VALUE(t.row_bytes % t.f.block_bytes == 0, what, ": rows of ", t.row_bytes, " bytes are not whole blocks of ",
              t.f.block_bytes);
  t.blocks = t.row_bytes / t.f.block_bytes;
  t.tile_bytes = kTileRows * t.row_bytes;
  t.tile_block = kTileRows * t.f.block_bytes;
  t.half_at = chunk_attn_cpu::tile_lone_half_at(type);
  t.halves = chunk_attn_cpu::tile_halves_bytes(type);
  t.first = chunk_attn_cpu::tile_first_dword(type);
  t.dwords = (t.f.block_bytes - (t.half_at >= 0 ? 2 : 0)) / 4;
  return t;
}

// A 64-byte aligned buffer of at least `bytes`, kept per calling thread between calls (the
// integer kernel's scratch: a decode step makes about 7 calls per layer).
uint8_t* int8_scratch_buffer(int64_t bytes) {
  thread_local std::unique_ptr<uint8_t[]> buffer;
  thread_local int64_t size = 0;
  if (bytes > size) {
    buffer.reset(new uint8_t[bytes + 64]);
    size = bytes;
  }
  const uintptr_t at = reinterpret_cast<uintptr_t>(buffer.get());
  return buffer.get() + ((64 - at % 64) % 64);
}

void quant_int8_linear(const char* isa, const chunk_attn_cpu::QuantInt8Params& params) {
  CHECK_VALUE(chunk_attn_cpu::quant_int8_supports(params.type), "integer activations: GGML type ", params.type,
              " has no integer codes (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K have)");
  chunk_attn_cpu::QuantInt8Params p = params;
  p.scratch = int8_scratch_buffer(chunk_attn_cpu::quant_int8_scratch_bytes(p.rows, p.in_features, p.num_threads,
                                                                           p.int16));
  int8_variant_for(isa).quant_linear_int8(p);
}

}  // namespace chunk_llama_cpu_internal

using chunk_llama_api::guarded;
using namespace chunk_llama_cpu_internal;

extern "C" {

int chunk_llama_cpu_quant_matmul(const chunk_llama_cpu_quant_matmul_args* args) {
  return guarded([&] {
    const chunk_llama_cpu_quant_matmul_args& a = *args;
    CHECK_VALUE(a.rows >= 0 && a.out_features >= 0 && a.num_threads >= 1 && a.num_threads <= INT32_MAX,
                "quant_matmul: bad sizes (", a.rows, " rows, ", a.out_features, " out, ", a.num_threads, " threads)");
    CHECK_VALUE(a.activations == CHUNK_LLAMA_ACTIVATIONS_FLOAT32 || a.activations == CHUNK_LLAMA_ACTIVATIONS_INT8 ||
                    a.activations == CHUNK_LLAMA_ACTIVATIONS_INT16,
                "quant_matmul: activations ", a.activations, " is not 0 (float32), 1 (int8) or 2 (int16)");
    const int type = static_cast<int>(a.type);
    const int64_t row_bytes = row_bytes_of("quant_matmul", type, a.in_features);
    check_tiles("quant_matmul", type, a.out_features, a.activations != CHUNK_LLAMA_ACTIVATIONS_FLOAT32);
    CHECK_VALUE(a.weight_bytes == row_bytes * a.out_features, "quant_matmul: the weight holds ", a.weight_bytes,
                " bytes, not ", a.out_features, " rows of ", row_bytes);
    const int threads = static_cast<int>(a.num_threads);
    if (a.activations != CHUNK_LLAMA_ACTIVATIONS_FLOAT32) {
      quant_int8_linear(a.isa, chunk_attn_cpu::QuantInt8Params{a.x, a.weight, type, a.bias, a.y, a.rows,
                                                                a.out_features, a.in_features, threads, nullptr,
                                                                a.activations == CHUNK_LLAMA_ACTIVATIONS_INT16});
      return;
    }
    std::unique_ptr<float[]> scratch(new float[chunk_attn_cpu::quant_scratch_floats(a.rows, a.in_features) * threads]);
    variant_for(a.isa).quant_linear(chunk_attn_cpu::QuantLinearParams{
        a.x, a.weight, type, a.bias, a.y, a.rows, a.out_features, a.in_features, threads, scratch.get()});
  });
}

int chunk_llama_cpu_tile_rows(const uint8_t* in, uint8_t* out, int64_t weight_bytes, int type, int64_t num_rows,
                              int untile, int num_threads) {
  return guarded([&] {
    using chunk_attn_cpu::kTileRows;
    const TileLayout t = tile_layout("tile_rows", type, weight_bytes, num_rows);
    CHECK_VALUE(num_threads >= 1, "tile_rows: ", num_threads, " threads");
    const int64_t tiles = num_rows / kTileRows, tile_bytes = t.tile_bytes, row_bytes = t.row_bytes;
    std::vector<uint8_t> copies(static_cast<size_t>(tile_bytes) * num_threads);
#pragma omp parallel num_threads(num_threads)
    {
#ifdef _OPENMP
      uint8_t* copy = copies.data() + omp_get_thread_num() * tile_bytes;
#else
      uint8_t* copy = copies.data();
#endif
      // each tile through a copy in cache, written in order: per block, the rows' lone fp16, then
      // dword k of rows 0 .. 15 for each k (2.2-2.8 GB/s here, where a dword at a time in the rows'
      // order ran at 0.8)
#pragma omp for schedule(static)
      for (int64_t tile = 0; tile < tiles; ++tile) {
        std::memcpy(copy, in + tile * tile_bytes, tile_bytes);
        uint8_t* to = out + tile * tile_bytes;
        for (int64_t b = 0; b < t.blocks; ++b) {
          uint8_t* tiled = (untile ? copy : to) + b * t.tile_block;
          uint8_t* rows = (untile ? to : copy) + b * t.f.block_bytes;  // row r's block at r * row_bytes
          const auto move = [&](uint8_t* tile_at, uint8_t* row_at, int bytes) {
            std::memcpy(untile ? row_at : tile_at, untile ? tile_at : row_at, bytes);
          };
          if (t.half_at >= 0)
            for (int r = 0; r < kTileRows; ++r) move(tiled + 2 * r, rows + r * row_bytes + t.half_at, 2);
          for (int k = 0; k < t.dwords; ++k)
            for (int r = 0; r < kTileRows; ++r)
              move(tiled + t.halves + (k * kTileRows + r) * 4, rows + r * row_bytes + t.first + 4 * k, 4);
        }
      }
    }
  });
}

int chunk_llama_cpu_take_rows(const uint8_t* tiled, int64_t weight_bytes, int type, int64_t num_rows,
                              const int64_t* ids, int64_t n, uint8_t* out) {
  return guarded([&] {
    using chunk_attn_cpu::kTileRows;
    const TileLayout t = tile_layout("take_rows", type, weight_bytes, num_rows);
    CHECK_VALUE(n >= 0, "take_rows: ", n, " rows asked");
    for (int64_t i = 0; i < n; ++i)  // (before anything is written)
      CHECK_VALUE(ids[i] >= 0 && ids[i] < num_rows, "take_rows: row ", ids[i], " is not one of the ", num_rows);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t r = ids[i] % kTileRows;
      const uint8_t* tile = tiled + ids[i] / kTileRows * t.tile_bytes;
      for (int64_t b = 0; b < t.blocks; ++b) {
        const uint8_t* from = tile + b * t.tile_block;
        uint8_t* to = out + i * t.row_bytes + b * t.f.block_bytes;
        if (t.half_at >= 0) std::memcpy(to + t.half_at, from + 2 * r, 2);
        for (int k = 0; k < t.dwords; ++k)
          std::memcpy(to + t.first + 4 * k, from + t.halves + (k * kTileRows + r) * 4, 4);
      }
    }
  });
}

const char* chunk_llama_cpu_int8_variant(const char* isa) {
  const char* name = nullptr;
  guarded([&] { name = int8_variant_for(isa).name; });
  return name;
}

}  // extern "C"
