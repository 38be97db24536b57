// tbegen runtime: the CPU kernels' inner loops over float rows, with the partial sums held in
// registers.
//
// Pooling a bag (forward) and summing a unique row's gradient (backward) both add a scaled row
// into an accumulator once per occurrence. Written as a plain loop over a float array, the
// accumulator goes through memory on every occurrence; here it is a few SIMD vectors (GCC/Clang
// vector extensions: one AVX-512 register per 16 floats with -march=native, split into narrower
// registers by the compiler otherwise), 64 columns at a time. Every column is still summed in
// occurrence order, one rounding per addition, so the results are those of the plain loop.
#pragma once

#include <algorithm>
#include <cstdint>

// A function or lambda the compiler must inline: GCC left the backward's per-occurrence row
// lambdas out of line, a call per occurrence with the vector accumulators spilled around it.
#if defined(__GNUC__) || defined(__clang__)
#define TBEGEN_INLINE_LAMBDA __attribute__((always_inline))
#else
#define TBEGEN_INLINE_LAMBDA
#endif

namespace tbegen {
namespace cpu {
namespace simd {

#if defined(__GNUC__) || defined(__clang__)
#define TBEGEN_CPU_VECTORS 1

constexpr int kMaxVectors = 4;  // vectors held at once: 64 columns of 16-float vectors
// kLanes floats per vector: 16 (one AVX-512 register with -march=native, split into narrower
// registers by the compiler otherwise) where the width allows, else 8 or 4, so that narrow rows
// (D = 8, 20, 24, ...) take vectors too.
// (a member typedef: GCC ignores vector_size on an alias template, which would be a plain float)
template <int kLanes>
struct VecOf {
  typedef float type __attribute__((vector_size(kLanes * sizeof(float))));
};
template <int kLanes>
using Vec = typename VecOf<kLanes>::type;
static_assert(sizeof(Vec<16>) == 16 * sizeof(float) && sizeof(Vec<4>) == 4 * sizeof(float),
              "tbegen: the compiler must honour vector_size");

// Unaligned loads and stores (rows start at any multiple of 16 bytes).
#define TBEGEN_VLOAD(v, p) __builtin_memcpy(&(v), (p), sizeof(v))
#define TBEGEN_VSTORE(p, v) __builtin_memcpy((p), &(v), sizeof(v))

// The floats per vector for rows of D columns: 16, 8 or 4, the widest that divides D; 0: no
// vector width divides D (the plain loops).
inline int lanes_for(int64_t D) { return D % 16 == 0 ? 16 : D % 8 == 0 ? 8 : D % 4 == 0 ? 4 : 0; }

// Whether a row width takes the vector path (the others use the plain loops).
inline bool vector_width(int64_t D) { return lanes_for(D) != 0; }

// out[c : c + kV*kLanes) = scale * sum over k in [0, n) of s_k * row_k[c : c + kV*kLanes), where
// row_k = rows(k) and s_k = weight(k), summed in k order. `before(k)` runs before occurrence k is
// read (the caller's prefetching); only the first chunk of a row calls it.
template <int kLanes, int kV, bool kWeighted, class Rows, class Weight, class Before>
TBEGEN_INLINE_LAMBDA inline void sum_chunk(int64_t n, int64_t c, const Rows& rows, const Weight& weight, const Before& before,
                      float scale, float* out) {
  Vec<kLanes> acc[kV];
  for (int v = 0; v < kV; ++v) acc[v] = Vec<kLanes>{};
  for (int64_t k = 0; k < n; ++k) {
    if (c == 0) before(k);
    const float* r = rows(k) + c;
    if (kWeighted) {
      const float s = weight(k);
      for (int v = 0; v < kV; ++v) {
        Vec<kLanes> x;
        TBEGEN_VLOAD(x, r + v * kLanes);
        acc[v] += s * x;
      }
    } else {
      for (int v = 0; v < kV; ++v) {
        Vec<kLanes> x;
        TBEGEN_VLOAD(x, r + v * kLanes);
        acc[v] += x;
      }
    }
  }
  for (int v = 0; v < kV; ++v) {
    const Vec<kLanes> y = acc[v] * scale;
    TBEGEN_VSTORE(out + c + v * kLanes, y);
  }
}

// The whole row in chunks of up to kMaxVectors vectors of kLanes floats (kLanes divides D).
template <int kLanes, bool kWeighted, class Rows, class Weight, class Before>
TBEGEN_INLINE_LAMBDA inline void sum_rows_of(int64_t n, int64_t D, const Rows& rows, const Weight& weight, const Before& before,
                        float scale, float* out) {
  for (int64_t c = 0; c < D; c += kMaxVectors * kLanes) {
    switch (std::min<int64_t>(D - c, kMaxVectors * kLanes) / kLanes) {
      case 4: sum_chunk<kLanes, 4, kWeighted>(n, c, rows, weight, before, scale, out); break;
      case 3: sum_chunk<kLanes, 3, kWeighted>(n, c, rows, weight, before, scale, out); break;
      case 2: sum_chunk<kLanes, 2, kWeighted>(n, c, rows, weight, before, scale, out); break;
      default: sum_chunk<kLanes, 1, kWeighted>(n, c, rows, weight, before, scale, out); break;
    }
  }
}

// The whole row, D a multiple of 4 (vector_width), at the widest vectors that divide it.
template <bool kWeighted, class Rows, class Weight, class Before>
inline void sum_rows(int64_t n, int64_t D, const Rows& rows, const Weight& weight, const Before& before,
                     float scale, float* out) {
  switch (lanes_for(D)) {
    case 16: sum_rows_of<16, kWeighted>(n, D, rows, weight, before, scale, out); break;
    case 8: sum_rows_of<8, kWeighted>(n, D, rows, weight, before, scale, out); break;
    default: sum_rows_of<4, kWeighted>(n, D, rows, weight, before, scale, out); break;
  }
}

#undef TBEGEN_VLOAD
#undef TBEGEN_VSTORE
#else
#define TBEGEN_CPU_VECTORS 0
// Without vector extensions the kernels use their plain loops for every width.
inline bool vector_width(int64_t) { return false; }
template <bool kWeighted, class Rows, class Weight, class Before>
inline void sum_rows(int64_t n, int64_t D, const Rows& rows, const Weight& weight, const Before& before,
                     float scale, float* out) {
  std::fill(out, out + D, 0.0f);
  for (int64_t k = 0; k < n; ++k) {
    before(k);
    const float* r = rows(k);
    const float s = kWeighted ? weight(k) : 1.0f;
    for (int64_t d = 0; d < D; ++d) out[d] += s * r[d];
  }
  for (int64_t d = 0; d < D; ++d) out[d] *= scale;
}
#endif

}  // namespace simd
}  // namespace cpu
}  // namespace tbegen
