// Torch-free two-phase-partition decode attention for the CPU (OpenMP).
//
// Phase 1 (chunk-first), one work item per (shared chunk, KV head): the chunk's K is
// transposed into a float buffer once, and the queries of every sequence under the
// chunk times the GQA group run against it as one small GEMM, blocked by 4 query rows
// so each loaded K/V vector feeds 4 FMAs. Partial (o, m, n) go to scratch, one slot
// per (chunk, sequence) pair: slot = seq_pair_ptr[seq] + shared_depth[chunk].
// Phase 2 (sequence-first), one item per (sequence, KV head): online softmax over the
// private chunks, then the merge with the sequence's shared partials.
// Storage is fp32 or bf16 (raw uint16); all math is fp32.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace chunk_attn_cpu {

struct Params {
  const void* q;        // [num_seqs, num_heads, head_dim]
  const void* k_cache;  // [capacity, num_kv_heads, chunk_size, head_dim]
  const void* v_cache;
  void* out;            // [num_seqs, num_heads, head_dim]
  float* partial_o;     // [num_pairs, num_heads, head_dim]
  float* partial_m;     // [num_pairs, num_heads]
  float* partial_n;     // [num_pairs, num_heads]
  const int64_t* shared_chunk_ids;   // [num_shared]
  const int64_t* shared_begin;       // [num_shared]
  const int64_t* shared_end;         // [num_shared]
  const int64_t* shared_depth;       // [num_shared]
  const int64_t* private_chunk_ids;  // [num_seqs, max_private]
  const int64_t* num_shared_tokens;  // [num_seqs]
  const int64_t* seq_lens;           // [num_seqs]
  const int64_t* seq_pair_ptr;       // [num_seqs + 1]
  int num_seqs, num_heads, num_kv_heads, head_dim, chunk_size, num_shared, max_private;
  float scale;
};

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const uint16_t* p, int64_t i) {
  uint32_t bits = static_cast<uint32_t>(p[i]) << 16;
  float x;
  std::memcpy(&x, &bits, sizeof(x));
  return x;
}
inline void store(float* p, int64_t i, float x) { p[i] = x; }
inline void store(uint16_t* p, int64_t i, float x) {  // round to nearest even
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  bits += 0x7fffu + ((bits >> 16) & 1u);
  p[i] = static_cast<uint16_t>(bits >> 16);
}

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// exp(x) for x <= 0 that the compiler vectorises inside `omp simd` loops (std::exp
// is a scalar libm call): x = n ln2 + r, |r| <= ln2 / 2, exp(r) by a degree-6
// polynomial (relative error ~1e-7), 2^n through the exponent bits. Below -87 the
// result flushes to 0, which is what softmax weights that small round to anyway.
#pragma omp declare simd
inline float fast_exp(float x) {
  x = std::max(x, -87.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float poly = 1.3888889e-3f;
  poly = poly * r + 8.3333333e-3f;
  poly = poly * r + 4.1666667e-2f;
  poly = poly * r + 1.6666667e-1f;
  poly = poly * r + 0.5f;
  poly = poly * r + 1.0f;
  poly = poly * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return poly * scale;
}
inline float rescale(float m, float m_all) { return m == kNegInf ? 0.f : std::exp(m - m_all); }

// Phase 1 for one (shared chunk, KV head). Query rows (sequence under the chunk x
// head of the GQA group) go in blocks of kRows, transposed to Qt [D][kRows] so that
// S^T[j][rows] = sum_d K[j][d] * Qt[d][rows] is one vector FMA per (j, d) with K read
// in place (4 keys at a time for independent FMA chains); the softmax statistics are
// then vector ops across rows, and O = P V runs two rows at a time so its
// accumulators stay in registers.
constexpr int kRows = 16;

// O[rows b, b + 1] = P[rows] V for one chunk: st is P^T [C][kRows], v is [C][D].
// GCC keeps array accumulators in memory here, so with AVX-512 the 2 x D/16 vectors
// are held in registers explicitly (one row at a time when D = 256).
template <int D>
inline void pv_rows(const float* __restrict__ st, int C, int b, int num_rows, const float* __restrict__ v,
                    float* __restrict__ o0, float* __restrict__ o1) {
#ifdef __AVX512F__
  constexpr int kVec = D / 16;
  constexpr int kPair = kVec <= 8 ? 2 : 1;
  for (int u0 = 0; u0 < num_rows; u0 += kPair) {
    __m512 acc[kPair][kVec];
    for (int u = 0; u < kPair; ++u)
      for (int i = 0; i < kVec; ++i) acc[u][i] = _mm512_setzero_ps();
    for (int j = 0; j < C; ++j) {
      const float* vj = v + j * D;
#pragma GCC unroll 16
      for (int i = 0; i < kVec; ++i) {
        const __m512 x = _mm512_loadu_ps(vj + 16 * i);
        for (int u = 0; u < kPair; ++u) acc[u][i] = _mm512_fmadd_ps(_mm512_set1_ps(st[j * kRows + b + u0 + u]), x, acc[u][i]);
      }
    }
    for (int u = 0; u < kPair && u0 + u < num_rows; ++u) {
      float* o = (u0 + u) == 0 ? o0 : o1;
      for (int i = 0; i < kVec; ++i) _mm512_storeu_ps(o + 16 * i, acc[u][i]);
    }
  }
#else
  for (int d = 0; d < D; ++d) o0[d] = o1[d] = 0.f;
  for (int j = 0; j < C; ++j) {
    const float p0 = st[j * kRows + b], p1 = num_rows > 1 ? st[j * kRows + b + 1] : 0.f;
    const float* __restrict__ vj = v + j * D;
#pragma omp simd
    for (int d = 0; d < D; ++d) {
      o0[d] += p0 * vj[d];
      o1[d] += p1 * vj[d];
    }
  }
#endif
}

template <typename T, int D>
void chunk_first_item(const Params& p, int s, int kv_head, std::vector<float>& buf) {
  const int H = p.num_heads;
  const int C = p.chunk_size;  // a multiple of 16 (keys go 4 at a time)
  const int group = H / p.num_kv_heads;
  const int64_t base = (p.shared_chunk_ids[s] * p.num_kv_heads + kv_head) * static_cast<int64_t>(C) * D;
  const T* __restrict__ k = static_cast<const T*>(p.k_cache) + base;
  const T* v_raw = static_cast<const T*>(p.v_cache) + base;
  buf.resize(static_cast<size_t>(D) * kRows + static_cast<size_t>(C) * kRows + static_cast<size_t>(C) * D);
  float* __restrict__ qt = buf.data();  // [D][kRows]
  float* __restrict__ st = qt + D * kRows;  // [C][kRows]: scores, then probabilities
  const float* __restrict__ v;
  if constexpr (std::is_same<T, float>::value) {
    v = v_raw;
  } else {
    float* vf = st + C * kRows;  // [C][D] V in fp32
    for (int i = 0; i < C * D; ++i) vf[i] = load(v_raw, i);
    v = vf;
  }
  const int begin = static_cast<int>(p.shared_begin[s]);
  const int rows = static_cast<int>(p.shared_end[s] - begin) * group;
  const T* q = static_cast<const T*>(p.q);
  for (int r0 = 0; r0 < rows; r0 += kRows) {
    const int nr = std::min(kRows, rows - r0);
    for (int b = 0; b < kRows; ++b) {
      if (b < nr) {
        const int r = r0 + b;
        const int64_t q_row = (static_cast<int64_t>(begin + r / group) * H + kv_head * group + r % group) * D;
        for (int d = 0; d < D; ++d) qt[d * kRows + b] = load(q, q_row + d) * p.scale;
      } else {
        for (int d = 0; d < D; ++d) qt[d * kRows + b] = 0.f;
      }
    }
    for (int j = 0; j < C; j += 4) {
      alignas(64) float a0[kRows] = {}, a1[kRows] = {}, a2[kRows] = {}, a3[kRows] = {};
      const T* k0 = k + j * D;
      for (int d = 0; d < D; ++d) {
        const float* __restrict__ qd = qt + d * kRows;
        const float x0 = load(k0, d), x1 = load(k0, D + d), x2 = load(k0, 2 * D + d), x3 = load(k0, 3 * D + d);
#pragma omp simd
        for (int b = 0; b < kRows; ++b) {
          a0[b] += x0 * qd[b];
          a1[b] += x1 * qd[b];
          a2[b] += x2 * qd[b];
          a3[b] += x3 * qd[b];
        }
      }
      for (int b = 0; b < kRows; ++b) {
        st[j * kRows + b] = a0[b];
        st[(j + 1) * kRows + b] = a1[b];
        st[(j + 2) * kRows + b] = a2[b];
        st[(j + 3) * kRows + b] = a3[b];
      }
    }
    alignas(64) float m[kRows], n[kRows];
    for (int b = 0; b < kRows; ++b) m[b] = kNegInf, n[b] = 0.f;
    for (int j = 0; j < C; ++j)
#pragma omp simd
      for (int b = 0; b < kRows; ++b) m[b] = std::max(m[b], st[j * kRows + b]);
    for (int j = 0; j < C; ++j)
#pragma omp simd
      for (int b = 0; b < kRows; ++b) {
        const float e = fast_exp(st[j * kRows + b] - m[b]);
        st[j * kRows + b] = e;
        n[b] += e;
      }
    for (int b = 0; b < nr; b += 2) {
      alignas(64) float o0[D], o1[D];
      pv_rows<D>(st, C, b, std::min(2, nr - b), v, o0, o1);
      for (int u = 0; u < 2 && b + u < nr; ++u) {
        const int r = r0 + b + u;
        const int seq = begin + r / group;
        const int64_t at = (p.seq_pair_ptr[seq] + p.shared_depth[s]) * H + kv_head * group + r % group;
        std::memcpy(p.partial_o + at * D, u == 0 ? o0 : o1, sizeof(float) * D);
        p.partial_m[at] = m[b + u];
        p.partial_n[at] = n[b + u];
      }
    }
  }
}

// Phase 2 for one (sequence, KV head): private chunks, then merge with shared partials.
template <typename T>
void seq_first_item(const Params& p, int seq, int kv_head, std::vector<float>& buf) {
  const int D = p.head_dim, C = p.chunk_size, H = p.num_heads;
  const int group = H / p.num_kv_heads;
  buf.resize(static_cast<size_t>(group) * (2 * D + C + 2));
  float* qf = buf.data();                 // [group][D]
  float* acc = qf + group * D;            // [group][D]
  float* sc = acc + group * D;            // [C] scores of one head in one chunk
  float* m = sc + C;                      // [group]
  float* n = m + group;                   // [group]
  const T* q = static_cast<const T*>(p.q);
  for (int g = 0; g < group; ++g) {
    const int64_t row = (static_cast<int64_t>(seq) * H + kv_head * group + g) * D;
    for (int d = 0; d < D; ++d) qf[g * D + d] = load(q, row + d) * p.scale;
    m[g] = kNegInf;
    n[g] = 0.f;
  }
  std::fill(acc, acc + group * D, 0.f);
  const int64_t first = p.num_shared_tokens[seq], length = p.seq_lens[seq];
  const T* kc = static_cast<const T*>(p.k_cache);
  const T* vc = static_cast<const T*>(p.v_cache);
  for (int64_t t0 = first; t0 < length; t0 += C) {
    const int64_t chunk = p.private_chunk_ids[static_cast<int64_t>(seq) * p.max_private + (t0 - first) / C];
    const int count = static_cast<int>(std::min<int64_t>(C, length - t0));
    const int64_t base = (chunk * p.num_kv_heads + kv_head) * static_cast<int64_t>(C) * D;
    for (int g = 0; g < group; ++g) {
      const float* qg = qf + g * D;
      float mx = m[g];
      for (int j = 0; j < count; ++j) {
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int d = 0; d < D; ++d) dot += qg[d] * load(kc, base + static_cast<int64_t>(j) * D + d);
        sc[j] = dot;
        mx = std::max(mx, dot);
      }
      const float correction = rescale(m[g], mx);
      float* ag = acc + g * D;
      float sum = n[g] * correction;
      for (int d = 0; d < D; ++d) ag[d] *= correction;
#pragma omp simd reduction(+ : sum)
      for (int j = 0; j < count; ++j) {
        sc[j] = fast_exp(sc[j] - mx);
        sum += sc[j];
      }
      for (int j = 0; j < count; ++j) {
        const float w = sc[j];
#pragma omp simd
        for (int d = 0; d < D; ++d) ag[d] += w * load(vc, base + static_cast<int64_t>(j) * D + d);
      }
      m[g] = mx;
      n[g] = sum;
    }
  }
  // merge the shared partials (slots seq_pair_ptr[seq] ..) and normalise
  const int64_t pair_begin = p.seq_pair_ptr[seq], pair_end = p.seq_pair_ptr[seq + 1];
  T* out = static_cast<T*>(p.out);
  for (int g = 0; g < group; ++g) {
    const int head = kv_head * group + g;
    float m_all = m[g];
    for (int64_t i = pair_begin; i < pair_end; ++i) m_all = std::max(m_all, p.partial_m[i * H + head]);
    const float own = rescale(m[g], m_all);
    float n_all = n[g] * own;
    float* ag = acc + g * D;
    for (int d = 0; d < D; ++d) ag[d] *= own;
    for (int64_t i = pair_begin; i < pair_end; ++i) {
      const float w = rescale(p.partial_m[i * H + head], m_all);
      n_all += p.partial_n[i * H + head] * w;
      const float* po = p.partial_o + (i * H + head) * D;
#pragma omp simd
      for (int d = 0; d < D; ++d) ag[d] += w * po[d];
    }
    const float inv = 1.f / n_all;
    const int64_t row = (static_cast<int64_t>(seq) * H + head) * D;
    for (int d = 0; d < D; ++d) store(out, row + d, ag[d] * inv);
  }
}

template <typename T, int D>
void tpp_decode_fixed(const Params& p) {
  const int items1 = p.num_shared * p.num_kv_heads;
#pragma omp parallel
  {
    std::vector<float> buf;
#pragma omp for schedule(dynamic, 1)
    for (int item = 0; item < items1; ++item) chunk_first_item<T, D>(p, item / p.num_kv_heads, item % p.num_kv_heads, buf);
    // implicit barrier: every partial is written before any merge reads it
    const int items2 = p.num_seqs * p.num_kv_heads;
#pragma omp for schedule(dynamic, 1)
    for (int item = 0; item < items2; ++item) seq_first_item<T>(p, item / p.num_kv_heads, item % p.num_kv_heads, buf);
  }
}

inline bool supports(int chunk_size, int head_dim) {
  return chunk_size > 0 && chunk_size % 16 == 0 && (head_dim == 64 || head_dim == 128 || head_dim == 256);
}

// Returns false for an unsupported (chunk_size, head_dim).
template <typename T>
bool tpp_decode(const Params& p) {
  if (!supports(p.chunk_size, p.head_dim)) return false;
  switch (p.head_dim) {
    case 64: tpp_decode_fixed<T, 64>(p); return true;
    case 128: tpp_decode_fixed<T, 128>(p); return true;
    default: tpp_decode_fixed<T, 256>(p); return true;
  }
}

}  // namespace chunk_attn_cpu
