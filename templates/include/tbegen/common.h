// tbegen runtime: definitions shared by the CPU and CUDA kernels of every optimizer.
//
// Layout (docs/layout.md): F features read T tables. `features` is an int64 [F, 5] tensor whose
// columns are kFeatWeightsOffset (where the feature's table starts in the flat weights buffer),
// kFeatRows (rows of that table), kFeatDim (its width D), kFeatOutOffset (first column of the
// feature's block in the pooled output) and kFeatKeyBase (first linear key of the table; the
// linear key key_base + row numbers every (table, row) pair and indexes per-row states).
// Bag (f, b) is indices[offsets[f * B + b] : offsets[f * B + b + 1]].
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#if defined(__CUDACC__)
#define TBEGEN_HD __host__ __device__
#define TBEGEN_INLINE __forceinline__
#define TBEGEN_UNROLL _Pragma("unroll")
#else
#define TBEGEN_HD
// Forced, so that the row loops of an update are compiled where the row's pointers are known
// (an outlined update_row vectorised its reductions with gathers).
#if defined(__GNUC__) || defined(__clang__)
#define TBEGEN_INLINE inline __attribute__((always_inline))
#else
#define TBEGEN_INLINE inline
#endif
#define TBEGEN_UNROLL
#endif

// Loop over the elements of a row view that this thread owns (all D on the CPU; this lane's
// 4-wide slices in CUDA, fully unrolled so that the per-element values stay in registers).
#define TBEGEN_FOR_ELEMENTS(row, i) \
  TBEGEN_UNROLL for (int i = 0; i < (row).extent(); ++i) if ((row).valid(i))

// The same loop for a body that only adds into the float accumulators listed after `i` (the
// row_sum / row_mean reductions of a row stage). On the CPU the compiler may then keep one
// partial sum per SIMD lane and add the lanes at the end (OpenMP simd, with -fopenmp or
// -fopenmp-simd; a plain loop without): the order of the additions is fixed by the build, not
// by the number of threads, as each row is updated by one thread. In CUDA it is the loop above.
// Eight lanes (simdlen): GCC adds the lanes' partial sums one after another at the end, and with
// sixteen (AVX-512) that chain of dependent additions took most of a narrow row's update (D = 8:
// sixteen additions for eight columns; benchmarks/NOTES-cpu.md, "CPU backward").
#if defined(__CUDACC__)
#define TBEGEN_FOR_ELEMENTS_SUM(row, i, ...) TBEGEN_FOR_ELEMENTS(row, i)
#else
#define TBEGEN_PRAGMA(x) _Pragma(#x)
#define TBEGEN_FOR_ELEMENTS_SUM(row, i, ...)                \
  TBEGEN_PRAGMA(omp simd simdlen(8) reduction(+ : __VA_ARGS__)) \
  for (int i = 0; i < (row).extent(); ++i) if ((row).valid(i))
#endif

namespace tbegen {

enum Pooling : int64_t { kPoolSum = 0, kPoolMean = 1, kPoolNone = 2 };

enum FeatureColumn : int64_t {
  kFeatWeightsOffset = 0,
  kFeatRows = 1,
  kFeatDim = 2,
  kFeatOutOffset = 3,
  kFeatKeyBase = 4,
  kFeatColumns = 5,
};

// Error codes the operators report. CUDA kernels record them in an int64 error record of
// kErrRecordSize entries that the host reads without stopping the GPU (host.h): slots
// [0, 3) hold the first bad index (code, position, value), which the caller may choose to skip;
// slots [3, 6) the first fatal error, which blocks every write of weights and states.
enum KernelError : int32_t {
  kErrNone = 0,
  kErrIndexOutOfRange = 1,
  kErrRowOutsideWeights = 2,
  kErrBadOffsets = 3,
  kErrNonFinitePerSampleWeight = 4,
  kErrNonFiniteGradient = 5,
};
constexpr int kErrIndexSlot = 0;
constexpr int kErrFatalSlot = 3;
constexpr int kErrRecordSize = 6;

// Row widths (docs/layout.md). Any D from 1 to kMaxD is accepted. The CUDA kernels have two
// paths: the 4-wide register path (cuda_kernels.cuh) for layouts whose every width and column
// offset is a multiple of 4 and whose widest row fits kVectorMaxD, and the any-width path
// (cuda_any_width.cuh) for the others; the CPU kernels take any width.
constexpr int64_t kMaxD = 4096;
constexpr int64_t kVectorMaxD = 1024;
// The pooled (sum/mean) forward takes 4-wide layouts of any width: it pools a row wider than
// kVectorMaxD in chunks of kVectorMaxD columns (cuda_kernels.cuh, forward_kernel).
constexpr int64_t kPooledForwardMaxD = kMaxD;

// Number of bits needed to represent keys in [0, n).
inline int bits_for(int64_t n) {
  int bits = 1;
  while (bits < 63 && (int64_t(1) << bits) < n) ++bits;
  return bits;
}


// Division of a bag number (0 <= n < 2^31) by the batch size, which the CUDA backward does for
// every occurrence: a multiply and a shift instead of the 64-bit division routine (about 30
// instructions). With s = ceil(log2 d) and m = ceil(2^(31+s) / d), n * m / 2^(31+s) exceeds n / d
// by less than 1/d (m * d - 2^(31+s) < d <= 2^s and n < 2^31), so its floor is n / d; m < 2^32
// because d > 2^(s-1). tests/test_fast_divisor.py checks the arithmetic.
struct FastDivisor {
  uint32_t d = 1;
  uint32_t m = uint32_t(1) << 31;
  uint32_t shift = 31;  // 31 + s

  static FastDivisor of(int64_t d) {
    FastDivisor r;
    if (d < 1) return r;  // (no bags: nothing is divided)
    uint32_t s = 0;
    while ((int64_t(1) << s) < d) ++s;
    r.d = uint32_t(d);
    r.m = uint32_t(((uint64_t(1) << (31 + s)) + uint64_t(d) - 1) / uint64_t(d));
    r.shift = 31 + s;
    return r;
  }
  TBEGEN_HD TBEGEN_INLINE int32_t quotient(int32_t n) const {
    return int32_t((uint64_t(uint32_t(n)) * m) >> shift);
  }
};
// ---- weight element conversion ---------------------------------------------------------------

template <typename T>
struct WeightTraits;

template <>
struct WeightTraits<float> {
  static TBEGEN_HD TBEGEN_INLINE float load(float x) { return x; }
  static TBEGEN_HD TBEGEN_INLINE float round(float x, uint32_t /*random_bits*/, bool /*sr*/) { return x; }
};

// fp16 and bf16 are both sign-magnitude 16-bit formats, so one stochastic rounding works for both:
// take the nearest value, find its neighbour on the other side of x, and move to the neighbour
// with probability proportional to x's distance from the nearest. The expected value of the
// result is x exactly (for x within the finite range).
template <typename H>
struct Half16Traits {
  static TBEGEN_HD TBEGEN_INLINE float load(H x) { return static_cast<float>(x); }

  static TBEGEN_HD TBEGEN_INLINE H from_bits(uint16_t bits) { return H(bits, typename H::from_bits_t{}); }

  // The neighbouring representable value of h, one step up (towards +inf) or down.
  static TBEGEN_HD TBEGEN_INLINE H step(H h, bool up) {
    const uint16_t bits = h.x;
    const bool negative = (bits & 0x8000u) != 0;
    if ((bits & 0x7fffu) == 0) return from_bits(up ? 0x0001u : 0x8001u);  // +-0
    const bool grow = (up != negative);                                    // magnitude grows
    return from_bits(static_cast<uint16_t>(grow ? bits + 1 : bits - 1));
  }

  static TBEGEN_HD TBEGEN_INLINE H round(float x, uint32_t random_bits, bool stochastic) {
    const H nearest = H(x);
    if (!stochastic) return nearest;
    const float n = static_cast<float>(nearest);
    if (n == x || !(fabsf(n) <= 3.0e38f)) return nearest;  // exact, NaN or overflow
    const H other = step(nearest, n < x);
    const float o = static_cast<float>(other);
    if (!(fabsf(o) <= 3.0e38f)) return nearest;
    // take `other` with probability |x - n| / |o - n| (< 1/2: nearest is the closer one): u < that
    // ratio, written without the division (|o - n|, the distance between neighbours, is a power
    // of two, so u * |o - n| is exact wherever it does not underflow: the same decisions)
    const float u = static_cast<float>(random_bits >> 8) * (1.0f / 16777216.0f);
    return u * fabsf(o - n) < fabsf(x - n) ? other : nearest;
  }
};

template <>
struct WeightTraits<c10::Half> : Half16Traits<c10::Half> {};
template <>
struct WeightTraits<c10::BFloat16> : Half16Traits<c10::BFloat16> {};

// ---- int8 rows (weights dtype uint8; docs/layout.md, "int8 rows") ---------------------------------
//
// An int8 table stores each row as D code bytes q followed by its quantization parameters, a
// float32 scale and a float32 bias (kInt8QparamBytes = 8 bytes, unaligned in general); the row's
// value is w = scale * q + bias. Rows are packed, D + 8 bytes each, so the row whose
// per-element states start at element offset `woff` (the features table's offsets, shared with
// the states) and whose linear key is `key` starts at byte woff + 8 * key: every earlier row of
// every table adds its 8 bytes. The kernels read codes and qparams bytewise (memcpy), so no row
// needs more than byte alignment. The update dequantizes a row into float32, runs the optimizer
// and quantizes it again with fresh parameters from the updated row's min and max.
constexpr int64_t kInt8QparamBytes = 8;

// Bytes after a row's D elements: the qparams of an int8 row, nothing for float weights.
template <typename W>
TBEGEN_HD TBEGEN_INLINE constexpr int64_t row_extra_bytes() {
  return std::is_same<W, uint8_t>::value ? kInt8QparamBytes : 0;
}

// Where (in elements of W) the row with element offset `woff` and linear key `key` starts.
template <typename W>
TBEGEN_HD TBEGEN_INLINE int64_t weights_row_start(int64_t woff, int64_t key) {
  return woff + row_extra_bytes<W>() * key;
}

struct Int8QParams {
  float scale;
  float bias;
};

TBEGEN_HD TBEGEN_INLINE Int8QParams load_qparams(const uint8_t* row, int64_t D) {
  Int8QParams q;
  memcpy(&q.scale, row + D, 4);
  memcpy(&q.bias, row + D + 4, 4);
  return q;
}

TBEGEN_HD TBEGEN_INLINE void store_qparams(uint8_t* row, int64_t D, const Int8QParams& q) {
  memcpy(row + D, &q.scale, 4);
  memcpy(row + D + 4, &q.bias, 4);
}

// One weight as a float: float/fp16/bf16 converted, an int8 code dequantized with its row's
// qparams as one fused multiply-add (a single rounding, the same on the CPU and the GPU).
template <typename W>
TBEGEN_HD TBEGEN_INLINE float load_weight(W x, const Int8QParams& /*q*/) { return WeightTraits<W>::load(x); }
TBEGEN_HD TBEGEN_INLINE float load_weight(uint8_t x, const Int8QParams& q) {
  return fmaf(q.scale, static_cast<float>(x), q.bias);
}

// The qparams of a row whose values lie in [lo, hi] (its min and max): 256 levels from lo to hi.
TBEGEN_HD TBEGEN_INLINE Int8QParams int8_qparams(float lo, float hi) { return Int8QParams{(hi - lo) / 255.0f, lo}; }

// The code of x: (x - bias) / scale rounded to nearest (ties to even), clamped to 0..255. A row
// whose min equals its max (scale 0) is all bias: code 0.
TBEGEN_HD TBEGEN_INLINE uint8_t quantize(float x, const Int8QParams& q) {
  if (!(q.scale > 0.0f)) return 0;
  const float c = rintf((x - q.bias) / q.scale);
  return static_cast<uint8_t>(fminf(fmaxf(c, 0.0f), 255.0f));
}

// Quantizes the float row `w` (D values) into the int8 row `wrow` (codes, then qparams from the
// row's min and max), by one thread: what the CPU update does after each row's update and the
// whole-table stages after theirs (the CUDA kernels take the min and max over a warp instead:
// the same values, min and max being exact in any order).
TBEGEN_HD TBEGEN_INLINE void quantize_row_int8(uint8_t* wrow, const float* w, int D) {
  float lo = INFINITY, hi = -INFINITY;
  for (int d = 0; d < D; ++d) {
    lo = fminf(lo, w[d]);
    hi = fmaxf(hi, w[d]);
  }
  const Int8QParams q = int8_qparams(lo, hi);
  for (int d = 0; d < D; ++d) wrow[d] = quantize(w[d], q);
  store_qparams(wrow, D, q);
}

// Counter-based random bits for stochastic rounding: a pure function of (seed, step, key,
// element), so a step is reproducible bit for bit and different steps draw different bits. Two
// parts: a 64-bit mix of (seed, step, key), the same for every element of a row (inlined, it is
// computed once per row and lane: the compiler shares it between the row's calls), and a cheap
// 32-bit mix of the element number into it (murmur3's finaliser, a bijection, so a row's elements
// never share bits). Measured: ncu found the C3 update kernels limited by instructions, not
// memory (benchmarks/NOTES-gpu.md, run Q), and a 64-bit hash per element was the bulk of them.
TBEGEN_HD TBEGEN_INLINE uint32_t random_row_bits(int64_t seed, int64_t step, int64_t key) {
  uint64_t z = static_cast<uint64_t>(seed) * 0x9E3779B97F4A7C15ull;
  z ^= static_cast<uint64_t>(step) + 0x632BE59BD9B4E019ull + (z << 6) + (z >> 2);
  z ^= static_cast<uint64_t>(key) * 0xBF58476D1CE4E5B9ull + (z << 6) + (z >> 2);
  // splitmix64 finaliser
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return static_cast<uint32_t>(z >> 32) ^ static_cast<uint32_t>(z);
}

TBEGEN_HD TBEGEN_INLINE uint32_t random_bits(int64_t seed, int64_t step, int64_t key, int32_t d) {
  uint32_t h = random_row_bits(seed, step, key) ^ (static_cast<uint32_t>(d) * 0x9E3779B9u);
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  h ^= h >> 16;
  return h;
}

// What every backward kernel needs besides the optimizer's own parameters.
struct RowUpdateContext {
  bool stochastic_rounding;
  int64_t seed;
  int64_t step;
};

// The per-table state values a row view holds (filled by load_table_states): nothing at all for
// optimizers without per-table states. An empty base adds no member to the row view, so their
// kernels are the same instruction for instruction as before per-table states existed (a member
// left unused still moved the scheduling of a copied row view: benchmarks/tools/compare_sass.py).
template <int kTableSlots>
struct TableSlots {
  float table_[kTableSlots];
  TBEGEN_HD TBEGEN_INLINE float table_state(int k) const { return table_[k]; }
};
template <>
struct TableSlots<0> {};

// The values of the per-table states (a spec's `per: table`) for a row of feature `feature` (the
// bag's feature: bag / B), copied into the row view's table_ before the update; constants during
// the step. Compiled only for optimizers that declare per-table states (Opt::kTableStates > 0):
// for the others this is nothing at all, so their kernels are the same instruction for
// instruction as before per-table states existed.
template <class Opt, class Row>
TBEGEN_HD TBEGEN_INLINE void load_table_states(Row& row, const typename Opt::Params& p, int64_t bag, int64_t B) {
  if constexpr (Opt::kTableStates > 0) {
    const int64_t t = p.feature_table[bag / B];
    for (int k = 0; k < Opt::kTableStates; ++k) row.table_[k] = p.table_states[k][t];
  } else {
    (void)row;
    (void)p;
    (void)bag;
    (void)B;
  }
}

// ---- optimizer state storage ----------------------------------------------------------------
//
// A state is stored as float32 (the default), float16 or bfloat16 (a spec's `dtype`, or the
// module's `state_dtypes`); the update always computes in float. The kernels receive each state's
// storage as a float pointer plus its StateDtype (the generated Params), and read and write narrow
// states only through load_state / store_state, which reinterpret the pointer.
enum StateDtype : int32_t { kStateFloat32 = 0, kStateFloat16 = 1, kStateBFloat16 = 2 };

// Element i of a state stored as `dtype`, as a float.
TBEGEN_HD TBEGEN_INLINE float load_state(const float* base, int32_t dtype, int64_t i) {
  if (dtype == kStateFloat16) return static_cast<float>(reinterpret_cast<const c10::Half*>(base)[i]);
  if (dtype == kStateBFloat16) return static_cast<float>(reinterpret_cast<const c10::BFloat16*>(base)[i]);
  return base[i];
}

// Stores x into element i of a state stored as `dtype`. A narrow state is always rounded
// stochastically (with round-to-nearest, a small increment to a large accumulator would be lost
// every step); the bits are the weights' counter-based stream (random_bits) with the seed moved
// by the state's `slot` (element states 0.., then row states), so each state draws its own bits,
// reproducibly: a pure function of (seed, step, slot, key, element).
TBEGEN_HD TBEGEN_INLINE void store_state(float* base, int32_t dtype, int64_t i, float x, const RowUpdateContext& ctx,
                                         int32_t slot, int64_t key, int32_t d) {
  if (dtype == kStateFloat32) {
    base[i] = x;
    return;
  }
  const uint64_t moved = static_cast<uint64_t>(ctx.seed) ^ (static_cast<uint64_t>(slot + 1) * 0xD6E8FEB86659FD93ull);
  const uint32_t bits = random_bits(static_cast<int64_t>(moved), ctx.step, key, d);
  if (dtype == kStateFloat16) {
    reinterpret_cast<c10::Half*>(base)[i] = WeightTraits<c10::Half>::round(x, bits, true);
  } else {
    reinterpret_cast<c10::BFloat16*>(base)[i] = WeightTraits<c10::BFloat16>::round(x, bits, true);
  }
}

// Bytes per element of a state stored as `dtype`.
TBEGEN_HD TBEGEN_INLINE int state_element_size(int32_t dtype) { return dtype == kStateFloat32 ? 4 : 2; }

}  // namespace tbegen
