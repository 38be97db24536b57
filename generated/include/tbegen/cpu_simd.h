// tbegen runtime: the CPU kernels' inner loops over float rows, with the partial sums held in
// registers.
//
// Pooling a bag (forward) and summing a unique row's gradient (backward) both add a scaled row
// into an accumulator once per occurrence. Written as a plain loop over a float array, the
// accumulator goes through memory on every occurrence; here it is a few SIMD vectors (GCC/Clang
// vector extensions: one AVX-512 register per 16 floats with -march=native, split into narrower
// registers by the compiler otherwise), 64 columns at a time. Every column is still summed in
// occurrence order, one rounding per addition, so the results are those of the plain loop.
// fp16 and bf16 rows are widened to float vectors as they are loaded (exact conversions: F16C's
// vcvtph2ps for fp16, a 16-bit shift for bf16), so they take the same path.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#if defined(__F16C__) && (defined(__x86_64__) || defined(__i386__))
#define TBEGEN_CPU_F16C 1
#else
#define TBEGEN_CPU_F16C 0
#endif

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

// Row element types that the vector paths read: float, fp16 and bf16 (widened exactly).
template <typename T>
constexpr bool kVectorElement =
    std::is_same_v<T, float> || std::is_same_v<T, c10::Half> || std::is_same_v<T, c10::BFloat16>;

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

template <int kLanes>
struct U16VecOf {
  typedef uint16_t type __attribute__((vector_size(kLanes * sizeof(uint16_t))));
};
template <int kLanes>
struct U32VecOf {
  typedef uint32_t type __attribute__((vector_size(kLanes * sizeof(uint32_t))));
};

// kLanes values of p as floats. fp16 -> float and bf16 -> float are exact, so a sum of widened
// values is the sum of the values that static_cast<float> gives, in the same order.
template <int kLanes, typename T>
TBEGEN_INLINE_LAMBDA inline Vec<kLanes> load_floats(const T* p) {
  Vec<kLanes> x;
  if constexpr (std::is_same_v<T, float>) {
    __builtin_memcpy(&x, p, sizeof(x));
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    // a bf16 value is the upper 16 bits of the float it stands for
    typename U16VecOf<kLanes>::type h;
    __builtin_memcpy(&h, p, sizeof(h));
    const typename U32VecOf<kLanes>::type u = __builtin_convertvector(h, typename U32VecOf<kLanes>::type) << 16;
    __builtin_memcpy(&x, &u, sizeof(x));
  } else {
    static_assert(std::is_same_v<T, c10::Half>, "tbegen: load_floats reads float, fp16 or bf16");
#if TBEGEN_CPU_F16C
    if constexpr (kLanes == 16) {
#if defined(__AVX512F__)
      const __m512 v = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
      __builtin_memcpy(&x, &v, sizeof(x));
#else
      const __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
      const __m256 hi = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
      __builtin_memcpy(&x, &lo, sizeof(lo));
      __builtin_memcpy(reinterpret_cast<char*>(&x) + sizeof(lo), &hi, sizeof(hi));
#endif
    } else if constexpr (kLanes == 8) {
      const __m256 v = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
      __builtin_memcpy(&x, &v, sizeof(x));
    } else {
      static_assert(kLanes == 4, "tbegen: vectors of 4, 8 or 16 floats");
      const __m128 v = _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
      __builtin_memcpy(&x, &v, sizeof(x));
    }
#else
    float f[kLanes];
    for (int i = 0; i < kLanes; ++i) f[i] = static_cast<float>(p[i]);
    __builtin_memcpy(&x, f, sizeof(x));
#endif
  }
  return x;
}

// `op` applied to the registers of type Reg that hold two vectors' lanes (a vector of kLanes
// floats is sizeof(Vec) / sizeof(Reg) registers): the bits moved in and out with memcpy.
template <typename Reg, int kLanes, typename Op>
TBEGEN_INLINE_LAMBDA inline Vec<kLanes> in_registers(const Vec<kLanes>& x, const Vec<kLanes>& acc, Op op) {
  constexpr int kRegs = int(sizeof(Vec<kLanes>) / sizeof(Reg));
  Reg a[kRegs], b[kRegs], r[kRegs];
  __builtin_memcpy(a, &x, sizeof(a));
  __builtin_memcpy(b, &acc, sizeof(b));
  for (int h = 0; h < kRegs; ++h) r[h] = op(a[h], b[h]);
  Vec<kLanes> out;
  __builtin_memcpy(&out, r, sizeof(out));
  return out;
}

// acc + s * x with one rounding (a fused multiply-add), whatever the compiler would contract:
// GCC fused `acc += s * x` for some vector widths and element types and not for others, so fp16
// rows pooled with per-sample weights differed from float rows of the same values in the last bit.
template <int kLanes>
TBEGEN_INLINE_LAMBDA inline Vec<kLanes> fma_lanes(float s, const Vec<kLanes>& x, const Vec<kLanes>& acc) {
#if defined(__AVX512F__)
  if constexpr (kLanes == 16) {
    return in_registers<__m512, kLanes>(x, acc, [s](__m512 a, __m512 b) { return _mm512_fmadd_ps(_mm512_set1_ps(s), a, b); });
  }
#endif
#if defined(__FMA__)
  if constexpr (kLanes == 16 || kLanes == 8) {  // (16 lanes without AVX-512: two 8-float halves;
    // with it, the branch above has returned)
    return in_registers<__m256, kLanes>(x, acc, [s](__m256 a, __m256 b) { return _mm256_fmadd_ps(_mm256_set1_ps(s), a, b); });
  } else if constexpr (kLanes == 4) {
    return in_registers<__m128, kLanes>(x, acc, [s](__m128 a, __m128 b) { return _mm_fmadd_ps(_mm_set1_ps(s), a, b); });
  }
#endif
  Vec<kLanes> out;
  for (int i = 0; i < kLanes; ++i) out[i] = std::fma(s, x[i], acc[i]);
  return out;
}

// out[0, D) = the D values of p as floats (a row's float copy; D a multiple of 4, vector_width).
template <typename T>
inline void to_floats(const T* p, int64_t D, float* out) {
  int64_t d = 0;
  for (; d + 16 <= D; d += 16) {
    const Vec<16> x = load_floats<16>(p + d);
    __builtin_memcpy(out + d, &x, sizeof(x));
  }
  for (; d + 4 <= D; d += 4) {
    const Vec<4> x = load_floats<4>(p + d);
    __builtin_memcpy(out + d, &x, sizeof(x));
  }
  for (; d < D; ++d) out[d] = static_cast<float>(p[d]);
}

// out[0, D) = the D floats of p rounded to nearest (ties to even) as T, fp16 or bf16: the values
// that T(p[d]) gives, bit for bit (fp16: F16C's vcvtps2ph, the instruction c10::Half uses where
// F16C is compiled for, else c10's own conversion; bf16: c10's rounding, NaN as 0x7FC0).
template <typename T>
inline void from_floats_nearest(const float* p, int64_t D, T* out) {
  static_assert(std::is_same_v<T, c10::Half> || std::is_same_v<T, c10::BFloat16>,
                "tbegen: from_floats_nearest writes fp16 or bf16");
  int64_t d = 0;
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    typedef uint32_t U32x16 __attribute__((vector_size(16 * sizeof(uint32_t))));
    typedef int32_t I32x16 __attribute__((vector_size(16 * sizeof(int32_t))));
    typedef uint16_t U16x16 __attribute__((vector_size(16 * sizeof(uint16_t))));
    for (; d + 16 <= D; d += 16) {
      Vec<16> x;
      U32x16 u;
      __builtin_memcpy(&x, p + d, sizeof(x));
      __builtin_memcpy(&u, p + d, sizeof(u));
      const U32x16 rounded = (u + ((u >> 16) & 1u) + 0x7FFFu) >> 16;
      const I32x16 nan = x != x;  // -1 where x is NaN
      const U32x16 bits = nan ? U32x16{} + 0x7FC0u : rounded;
      const U16x16 h = __builtin_convertvector(bits, U16x16);
      __builtin_memcpy(out + d, &h, sizeof(h));
    }
  } else {
#if TBEGEN_CPU_F16C
#if defined(__AVX512F__)
    for (; d + 16 <= D; d += 16) {
      const __m256i h = _mm512_cvtps_ph(_mm512_loadu_ps(p + d), _MM_FROUND_TO_NEAREST_INT);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + d), h);
    }
#endif
    for (; d + 8 <= D; d += 8) {
      const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(p + d), _MM_FROUND_TO_NEAREST_INT);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + d), h);
    }
#endif
  }
  for (; d < D; ++d) out[d] = T(p[d]);
}

// Stochastic rounding of p[0, D) to T (fp16 or bf16), 16 values at a time: the vector form of
// common.h's Half16Traits<T>::round(p[d], random_bits(seed, step, key, d), true), bit for bit,
// given row_bits = random_row_bits(seed, step, key). The columns past the last multiple of 16 (and
// every column, where the vector forms are not compiled) are left to `rest(d0)`, which rounds
// [d0, D) with the scalar functions. (One rounding with a hash per element was 60% of an fp16
// rowwise_adagrad backward: benchmarks/NOTES-cpu.md.)
template <typename T, class Rest>
inline void from_floats_stochastic(const float* p, int64_t D, uint32_t row_bits, T* out, const Rest& rest) {
  static_assert(std::is_same_v<T, c10::Half> || std::is_same_v<T, c10::BFloat16>,
                "tbegen: from_floats_stochastic writes fp16 or bf16");
  int64_t d = 0;
#if defined(__AVX512F__) && TBEGEN_CPU_F16C
  typedef uint32_t U32x16 __attribute__((vector_size(16 * sizeof(uint32_t))));
  typedef int32_t I32x16 __attribute__((vector_size(16 * sizeof(int32_t))));
  typedef uint16_t U16x16 __attribute__((vector_size(16 * sizeof(uint16_t))));
  // the 16-bit patterns (in 32-bit lanes) of x rounded to nearest, and the floats they stand for
  auto nearest_bits = [](const Vec<16>& x) TBEGEN_INLINE_LAMBDA {
    U32x16 b;
    if constexpr (std::is_same_v<T, c10::Half>) {
      __m512 v;
      __builtin_memcpy(&v, &x, sizeof(v));
      const __m256i h = _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT);
      U16x16 h16;
      __builtin_memcpy(&h16, &h, sizeof(h16));
      b = __builtin_convertvector(h16, U32x16);
    } else {
      U32x16 u;
      __builtin_memcpy(&u, &x, sizeof(u));
      const I32x16 nan = x != x;
      b = nan ? U32x16{} + 0x7FC0u : (u + ((u >> 16) & 1u) + 0x7FFFu) >> 16;
    }
    return b;
  };
  auto widen = [](const U32x16& b) TBEGEN_INLINE_LAMBDA {
    Vec<16> f;
    if constexpr (std::is_same_v<T, c10::Half>) {
      const U16x16 h16 = __builtin_convertvector(b, U16x16);
      __m256i h;
      __builtin_memcpy(&h, &h16, sizeof(h));
      const __m512 v = _mm512_cvtph_ps(h);
      __builtin_memcpy(&f, &v, sizeof(f));
    } else {
      const U32x16 u = b << 16;
      __builtin_memcpy(&f, &u, sizeof(f));
    }
    return f;
  };
  auto magnitude = [](const Vec<16>& f) TBEGEN_INLINE_LAMBDA {
    U32x16 u;
    __builtin_memcpy(&u, &f, sizeof(u));
    u &= 0x7FFFFFFFu;
    Vec<16> a;
    __builtin_memcpy(&a, &u, sizeof(a));
    return a;
  };
  const U32x16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  for (; d + 16 <= D; d += 16) {
    Vec<16> x;
    __builtin_memcpy(&x, p + d, sizeof(x));
    const U32x16 nb = nearest_bits(x);
    const Vec<16> n = widen(nb);
    // the neighbour of nearest on x's side (Half16Traits::step), as a 16-bit pattern
    const I32x16 up = n < x;
    const I32x16 negative = (nb & 0x8000u) != 0;
    const I32x16 zero = (nb & 0x7FFFu) == 0;
    const U32x16 ob = (zero ? (up ? U32x16{} + 0x0001u : U32x16{} + 0x8001u)
                            : ((up != negative) ? nb + 1u : nb - 1u)) & 0xFFFFu;
    const Vec<16> o = widen(ob);
    // random_bits(seed, step, key, d) for the 16 columns (common.h: murmur3's finaliser)
    U32x16 h = row_bits ^ ((lane + uint32_t(d)) * 0x9E3779B9u);
    h ^= h >> 16;
    h *= 0x85EBCA6Bu;
    h ^= h >> 13;
    h *= 0xC2B2AE35u;
    h ^= h >> 16;
    const Vec<16> u = __builtin_convertvector(h >> 8, Vec<16>) * (1.0f / 16777216.0f);
    const I32x16 keep = (n == x) | !(magnitude(n) <= 3.0e38f) | !(magnitude(o) <= 3.0e38f) |
                        !(u * magnitude(o - n) < magnitude(x - n));
    const U16x16 result = __builtin_convertvector(keep ? nb : ob, U16x16);
    __builtin_memcpy(out + d, &result, sizeof(result));
  }
#endif
  (void)row_bits;
  (void)out;
  (void)p;
  if (d < D) rest(d);
}

// The floats per vector for rows of D columns: 16, 8 or 4, the widest that divides D; 0: no
// vector width divides D (the plain loops).
inline int lanes_for(int64_t D) { return D % 16 == 0 ? 16 : D % 8 == 0 ? 8 : D % 4 == 0 ? 4 : 0; }

// Whether a row width takes the vector path (the others use the plain loops).
inline bool vector_width(int64_t D) { return lanes_for(D) != 0; }

// out[c : c + kV*kLanes) = scale * sum over k in [0, n) of s_k * row_k[c : c + kV*kLanes), where
// row_k = rows(k) (float, fp16 or bf16 elements) and s_k = weight(k), summed in k order.
// `before(k)` runs before occurrence k is read (the caller's prefetching); only the first chunk of a row calls it.
template <int kLanes, int kV, bool kWeighted, class Rows, class Weight, class Before>
TBEGEN_INLINE_LAMBDA inline void sum_chunk(int64_t n, int64_t c, const Rows& rows, const Weight& weight, const Before& before,
                      float scale, float* out) {
  Vec<kLanes> acc[kV];
  for (int v = 0; v < kV; ++v) acc[v] = Vec<kLanes>{};
  for (int64_t k = 0; k < n; ++k) {
    if (c == 0) before(k);
    const auto* r = rows(k) + c;  // float, fp16 or bf16 (load_floats)
    if (kWeighted) {
      const float s = weight(k);
      for (int v = 0; v < kV; ++v) acc[v] = fma_lanes<kLanes>(s, load_floats<kLanes>(r + v * kLanes), acc[v]);
    } else {
      for (int v = 0; v < kV; ++v) acc[v] += load_floats<kLanes>(r + v * kLanes);
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

// out[0, D) = 0 + r0[0, D) and (0 + r0[0, D)) + r1[0, D), D a multiple of 4: the unweighted
// sums of one and of two float rows that sum_rows computes (from 0, in order, then * 1: the
// same bits, 0 + -0 being +0), inline, without sum_rows' call and chunk dispatch (the backward's
// runs of one or two occurrences: most runs of a uniform batch).
TBEGEN_INLINE_LAMBDA inline void sum_of_one(const float* r0, int64_t D, float* out) {
  int64_t d = 0;
  for (; d + 16 <= D; d += 16) {
    Vec<16> x;
    TBEGEN_VLOAD(x, r0 + d);
    x = Vec<16>{} + x;
    TBEGEN_VSTORE(out + d, x);
  }
  for (; d < D; d += 4) {
    Vec<4> x;
    TBEGEN_VLOAD(x, r0 + d);
    x = Vec<4>{} + x;
    TBEGEN_VSTORE(out + d, x);
  }
}
TBEGEN_INLINE_LAMBDA inline void sum_of_two(const float* r0, const float* r1, int64_t D, float* out) {
  int64_t d = 0;
  for (; d + 16 <= D; d += 16) {
    Vec<16> x, y;
    TBEGEN_VLOAD(x, r0 + d);
    TBEGEN_VLOAD(y, r1 + d);
    x = (Vec<16>{} + x) + y;
    TBEGEN_VSTORE(out + d, x);
  }
  for (; d < D; d += 4) {
    Vec<4> x, y;
    TBEGEN_VLOAD(x, r0 + d);
    TBEGEN_VLOAD(y, r1 + d);
    x = (Vec<4>{} + x) + y;
    TBEGEN_VSTORE(out + d, x);
  }
}

#undef TBEGEN_VLOAD
#undef TBEGEN_VSTORE
#else
#define TBEGEN_CPU_VECTORS 0
// Without vector extensions the kernels use their plain loops for every width.
inline bool vector_width(int64_t) { return false; }
template <typename T>
inline void to_floats(const T* p, int64_t D, float* out) {
  for (int64_t d = 0; d < D; ++d) out[d] = static_cast<float>(p[d]);
}
template <typename T>
inline void from_floats_nearest(const float* p, int64_t D, T* out) {
  for (int64_t d = 0; d < D; ++d) out[d] = T(p[d]);
}
template <typename T, class Rest>
inline void from_floats_stochastic(const float*, int64_t D, uint32_t, T*, const Rest& rest) {
  if (D > 0) rest(0);
}
inline void sum_of_one(const float* r0, int64_t D, float* out) {
  for (int64_t d = 0; d < D; ++d) out[d] = 0.0f + r0[d];
}
inline void sum_of_two(const float* r0, const float* r1, int64_t D, float* out) {
  for (int64_t d = 0; d < D; ++d) out[d] = (0.0f + r0[d]) + r1[d];
}
template <bool kWeighted, class Rows, class Weight, class Before>
inline void sum_rows(int64_t n, int64_t D, const Rows& rows, const Weight& weight, const Before& before,
                     float scale, float* out) {
  std::fill(out, out + D, 0.0f);
  for (int64_t k = 0; k < n; ++k) {
    before(k);
    const auto* r = rows(k);
    const float s = kWeighted ? weight(k) : 1.0f;
    for (int64_t d = 0; d < D; ++d) out[d] += s * static_cast<float>(r[d]);
  }
  for (int64_t d = 0; d < D; ++d) out[d] *= scale;
}
#endif

}  // namespace simd
}  // namespace cpu
}  // namespace tbegen
