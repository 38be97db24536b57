// tbegen runtime: the CUDA kernels for layouts the 4-wide kernels (cuda_kernels.cuh) do not take:
// a width D that is not a multiple of 4, a column offset (in the weights or the pooled output) that
// is not, or a row wider than kVectorMaxD. The host picks them per call (check_layout_and_choose in
// cuda_ops.cuh); a layout of multiples of 4 up to kVectorMaxD never runs this code.
//
// Column layout: lane l of a warp owns columns l, l + 32, l + 64, ... of a row, so every load and
// store is one float (or one 16-bit weight) and needs no alignment, and a warp's 32 loads are
// consecutive. Each lane touches only its own columns of every buffer it writes, so the only
// communication between lanes is the shuffles of the row reductions.
//
// A row does not live in registers here (4096 columns would be 128 values per lane per array):
//  - fp32 weights and fp32 per-element states are updated in place in global memory (each unique
//    row is updated by exactly one warp, as in the 4-wide path);
//  - the summed gradient, the temporaries, (for fp16/bf16 weights) a float copy of the weights
//    and (for each fp16/bf16 per-element state, common.h StateDtype) a float copy of the state
//    live in a per-warp scratch area in global memory, `scratch_slots` rows of max_D floats,
//    which the caches mostly keep close (the host caps the grid so that scratch stays small);
//    narrow copies are stored back with stochastic rounding (store_state), as in the 4-wide path;
//  - per-row states (float, read through load_state, and int) are a register copy per lane, as
//    in WarpRow; lane 0 writes them back.
// int8 rows (uint8 weights, common.h) are taken only here: a row is dequantized into a float copy
// in scratch (as 16-bit weights are), updated, and quantized again with the qparams of its updated
// min and max (a butterfly min/max over the warp; lane 0 stores the qparams). The forward kernels
// dequantize each code with its row's qparams, which the lane that fetched the row's index reads
// and passes around with the row's offset.
// Sums are taken in the same order as in the 4-wide path (occurrences in sorted order, fp32,
// per column); only the split of the row reductions over lanes differs, so results agree with
// the 4-wide path to rounding, and are deterministic (bitwise) for a given layout.
//
// The kPrefetch instantiation of the three update kernels is a variant for wide rows (issue 29)
// with the same arithmetic in the same order, so the same bits (tests/test_wide_rows.py). Which
// one a launch takes (launch_any_width; TBEGEN_ANY_WIDTH_PREFETCH, read at every launch): by
// default the variant for float weights when some row is wider than 512 columns (measured on the
// H200, landing8: 1024-wide fp32 rows' backward 1.2-1.4x faster, sgd 7.95 -> 6.53 ms, adam 14.66
// -> 10.49) and the default kernels otherwise; "1" the variant for float and fp16 weights whatever
// the width (fp16's 2048-wide rows: not yet measured), "0" never. The variant:
//  - with 4-wide float rows, the occurrence sum (add_occurrences_4wide_batched) issues each
//    occurrence's 8 slice loads together (ptxas interleaves the default's loads with its sums:
//    two 16-byte loads in flight per lane), starts from zero instead of re-loading the row that
//    begin_row cleared (which it then does not clear), and loads the output-gradient rows with
//    L1::no_allocate; a hot row's segment sums are added the same way (add_partials_4wide);
//  - before the optimizer's update the warp asks L1 for every 128-byte line of the row's arrays
//    (gradient, weights, element states, temporaries; prefetch.global.L1, one line per lane):
//    the update is the spec's scalar column loop, whose iterations each load and store before
//    the next loads (the arrays may alias, as far as the compiler knows), so without it the
//    update waits for a round trip to L2 or HBM once per 32 columns; 16-bit weight rows are
//    asked for the same way before begin_row converts them.
// The variant's warp and segment kernels take 124-128 registers (2 blocks of 256 threads per
// multiprocessor; the default's 80, with spills, fit 3): ptxas -v for sm_90, NOTES-gpu.md.
// For float weights the prefetching kernels are by default their occupancy variant (the
// `..._occupancy` kernels, kMinBlocks = 3: 3 blocks per multiprocessor, 512-column passes taking
// two occurrences at a time, each warp's summed row in shared memory where it fits; the same bits;
// TBEGEN_ANY_WIDTH_OCCUPANCY=0 the 2-block kernels above): see occupancy_from_env below. fp16
// weights take it only with TBEGEN_ANY_WIDTH_OCCUPANCY_HALF=1 (occupancy_half_from_env).
#pragma once

#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "tbegen/cuda_kernels.cuh"

namespace tbegen {
namespace cuda {
namespace any_width {

// ---- the kernels' environment switches ----------------------------------------------------------

// A kernel switch read from the environment: unset or empty kUnset, "0" kOff, "1" kOn; anything
// else is refused (std::invalid_argument: a typo must not time one path under the other's name).
enum class EnvSwitch { kUnset, kOff, kOn };
inline EnvSwitch env_switch(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return EnvSwitch::kUnset;
  if (std::strcmp(v, "0") == 0) return EnvSwitch::kOff;
  if (std::strcmp(v, "1") == 0) return EnvSwitch::kOn;
  throw std::invalid_argument(std::string("tbegen: ") + name + " must be 0 or 1 (or unset), got '" + v + "'");
}

// ---- the prefetching variant (TBEGEN_ANY_WIDTH_PREFETCH) -----------------------------------------

// The switch: unset or empty kAuto, "0" kOff, "1" kOn (env_switch).
enum class PrefetchMode { kAuto, kOff, kOn };
inline PrefetchMode prefetch_mode_from_env() {
  switch (env_switch("TBEGEN_ANY_WIDTH_PREFETCH")) {
    case EnvSwitch::kOff: return PrefetchMode::kOff;
    case EnvSwitch::kOn: return PrefetchMode::kOn;
    default: return PrefetchMode::kAuto;
  }
}

// kAuto's choice: the variant where it was measured faster, float and fp16 rows wider than this
// (fp16 since landing10, with the work list and 64-occurrence segments: cuda_ops.cuh, wide_half_rows).
constexpr int64_t kPrefetchAutoMinD = 512;

// ---- the occupancy variant of the prefetching kernels (TBEGEN_ANY_WIDTH_OCCUPANCY; issue 29) ------
//
// The prefetching kernels hold a 1024-column slice of the occurrence sum per lane (32 accumulators
// and 32 loaded floats): 124-128 registers, 2 blocks of 256 threads, 16 warps per multiprocessor.
// FBGEMM's backward at D = 1024 (FBGEMM_GPU 1.6.0, vector blocking: 2 float4 accumulators per lane,
// 256 columns a pass) keeps twice that or more resident, and a warp of the any-width kernels spends
// much of a row with no gradient load in flight (the run's bounds, key, row and states, each a
// dependent load; the scratch row written and read back; the optimizer's scalar column loop, one
// L1 round trip per 32 columns): with 16 warps per multiprocessor there are few others to cover it.
// The variant (kMinBlocks = 3, float weights, where the prefetching kernels are taken): the same
// kernels under __launch_bounds__(256, 3) (at most 85 registers: 24 warps per multiprocessor), the
// occurrence sum over 512-column slices (kVecs 4: 16 accumulators per lane, two passes over a
// 1024-wide row's occurrences) taking two occurrences at a time (their 8 loads issued together:
// the same 4 KB in flight per warp as the 1024-column pass, at 1.5x the warps), and a hot row's
// segment sums added two at a time the same way. Every column's sum is the same terms in the same
// order (occurrences, then segments, in sorted order, one fma or add each), so the bits are the
// prefetching kernels' (tests/test_any_width_occupancy.py). The default since landing12 (H100,
// docs/gpu-runs/2026-12-05-landing12, the sweep's D=1024 fp32 cells) together with the shared row
// below: the backward 5.4-8.8% faster (adagrad 10.682 -> 9.891 ms, sgd 8.785 -> 8.219, adam 13.075
// -> 11.931, rowwise_adagrad 8.725 -> 8.255; 0.81-0.86x FBGEMM -> 0.87-0.93x); the variant alone,
// with the scratch row, 0.2-2.1% faster. TBEGEN_ANY_WIDTH_OCCUPANCY: unset, empty or "1" on (the
// default), "0" the 2-block prefetching kernels (the way back, for A/Bs; rows wider than 1024
// columns, where the variant is unmeasured, take it too by default); anything else is refused; read
// (and checked) at every launch, whatever the dtype; bf16 and int8 weights and the default
// (non-prefetching) kernels do not have it, fp16 weights only with TBEGEN_ANY_WIDTH_OCCUPANCY_HALF=1
// (below).
inline bool occupancy_from_env() { return env_switch("TBEGEN_ANY_WIDTH_OCCUPANCY") != EnvSwitch::kOff; }
// The variant's blocks per multiprocessor (its kernels' kMinBlocks; the others' is 1).
constexpr int kOccupancyMinBlocks = 3;

// TBEGEN_ANY_WIDTH_OCCUPANCY_HALF (opt-in, issue 29; not yet measured): fp16 rows on the prefetching
// kernels (by default, rows wider than 512 columns: cuda_ops.cuh, wide_half_rows) take the occupancy
// variant too, the same `..._occupancy` kernels instantiated for c10::Half (the occurrence sum is over
// the float output-gradient rows, as for float weights; the 16-bit weights' float copy, update and
// rounding, stochastic rounding included, are begin_row_arrays' and update_and_store's code, unchanged:
// the same bits as the 2-block prefetching kernels, tests/test_any_width_occupancy_half.py), with each
// warp's summed row in shared memory where it fits, rows wider than kSharedRowMaxD included
// (launch_any_width, cuda_backward_kernels.cuh: more than 48 KB a block by opting in, where the
// device's sharedMemPerBlockOptin allows it and kOccupancyMinBlocks blocks still fit; else the scratch
// row). Unset, empty or "0" off (the 2-block prefetching kernels, as before), "1" on; anything else is
// refused; read (and checked) at every launch, whatever the dtype. TBEGEN_ANY_WIDTH_SHARED_ROW=0 keeps
// the scratch row with it. bf16 weights do not take the prefetching kernels, so have no variant.
inline bool occupancy_half_from_env() {
  return env_switch("TBEGEN_ANY_WIDTH_OCCUPANCY_HALF") == EnvSwitch::kOn;
}

// TBEGEN_ANY_WIDTH_SHARED_ROW (the occupancy variant's option, on by default with it): each warp's
// summed gradient row in dynamic shared memory (warp_shared_row: 8 warps x max_D floats a block,
// 32 KB at 1024 columns) instead of its global scratch row, as FBGEMM keeps a row's sum on chip
// (smem_grad_sum): the row's 4 KB store and read-back no longer go through L1 and L2, where the
// gradient stream may evict the scratch rows between them (up to ~1.5 GB a step of write-backs at
// D = 1024). The same arithmetic on the same values: the same bits. Rows wider than kSharedRowMaxD
// (the 48 KB a block takes without an opt-in) keep the scratch row. Unset or empty: on where the
// occupancy variant is (occupancy_from_env), "0" off (the variant with the scratch row), "1" on;
// anything else, or "1" with TBEGEN_ANY_WIDTH_OCCUPANCY=0, is refused. (fp16 rows with
// TBEGEN_ANY_WIDTH_OCCUPANCY_HALF=1: wider rows too, past 48 KB, where they fit: see above.)
constexpr int64_t kSharedRowMaxD = 1536;
inline bool shared_row_from_env(bool occupancy) {
  const EnvSwitch mode = env_switch("TBEGEN_ANY_WIDTH_SHARED_ROW");
  if (mode == EnvSwitch::kOff) return false;
  if (mode == EnvSwitch::kOn && !occupancy)
    throw std::invalid_argument(
        "tbegen: TBEGEN_ANY_WIDTH_SHARED_ROW=1 is an option of the occupancy kernels, which TBEGEN_ANY_WIDTH_OCCUPANCY=0 "
        "turns off");
  return occupancy;
}
// The 4-wide sums' slice (kVecs 16-byte loads per lane: 128 * kVecs columns a pass) and how many
// occurrences (or segment sums) each step loads together, per kMinBlocks.
template <int kMinBlocks>
constexpr int kSumVecs = kMinBlocks >= kOccupancyMinBlocks ? 4 : 8;
template <int kMinBlocks>
constexpr int kSumRows = kMinBlocks >= kOccupancyMinBlocks ? 2 : 1;

// Asks L1 for the 128-byte lines that hold bytes [p, p + bytes): lane l the lines l, l + 32, ...
// (a hint: no register waits for it; a later load of the line waits only for what is in flight).
__device__ __forceinline__ void prefetch_l1(const void* p, int64_t bytes, int lane) {
  if (bytes <= 0) return;
  const uintptr_t first = reinterpret_cast<uintptr_t>(p) & ~uintptr_t(127);
  const uintptr_t last = (reinterpret_cast<uintptr_t>(p) + uintptr_t(bytes) - 1) & ~uintptr_t(127);
  for (uintptr_t line = first + uintptr_t(lane) * 128; line <= last; line += uintptr_t(kWarpSize) * 128)
    asm volatile("prefetch.global.L1 [%0];" ::"l"(line));
}

// An output-gradient load of 4 floats (16-byte aligned) that does not allocate in L1.
__device__ __forceinline__ void load4_stream(const float* p, float* v) {
  float4 x;
  asm("ld.global.L1::no_allocate.v4.f32 {%0, %1, %2, %3}, [%4];"
      : "=f"(x.x), "=f"(x.y), "=f"(x.z), "=f"(x.w)
      : "l"(p));
  v[0] = x.x; v[1] = x.y; v[2] = x.z; v[3] = x.w;
}

// Whether the occurrence sum starts from zero in registers (the variant with 4-wide float rows):
// then the gradient (or partial) row it writes is not cleared first, as the sum writes all of
// its columns below D.
template <bool kPrefetch>
__device__ __forceinline__ bool sums_from_zero(const BackwardArgs& a) {
  return kPrefetch && a.float_rows_4wide;
}

// ---- the row view the optimizer sees ---------------------------------------------------------

// One lane's share of a row in the column layout. Element i of this lane is column
// i * 32 + lane; extent() is the same on every lane, so every lane runs the optimizer's loops the
// same number of times and reaches the same reductions.
template <int kElementSlots, int kRowSlots, int kIntRowSlots = 0, int kTableSlots = 0>
struct ColumnRow : TableSlots<kTableSlots> {  // (the per-table states of the row's table, if any)
  float* g_;                                            // summed gradient (scratch)
  float* w_;                                            // weights (in place, or a scratch copy)
  // element states (fp32 in place, narrow ones a scratch copy), then temporaries (scratch)
  float* element_[kElementSlots > 0 ? kElementSlots : 1];
  float row_[kRowSlots > 0 ? kRowSlots : 1];
  int64_t int_row_[kIntRowSlots > 0 ? kIntRowSlots : 1];  // int per-row states (lane 0's are stored)
  int D;
  int lane;

  __device__ __forceinline__ int extent() const { return (D + kWarpSize - 1) / kWarpSize; }
  __device__ __forceinline__ int column(int i) const { return i * kWarpSize + lane; }
  __device__ __forceinline__ bool valid(int i) const { return column(i) < D; }
  __device__ __forceinline__ int dim() const { return D; }
  __device__ __forceinline__ float g(int i) const { return g_[column(i)]; }
  __device__ __forceinline__ float& w(int i) { return w_[column(i)]; }
  __device__ __forceinline__ float& element(int k, int i) { return element_[k][column(i)]; }
  __device__ __forceinline__ float& row_state(int k) { return row_[k]; }
  __device__ __forceinline__ int64_t& int_row_state(int k) { return int_row_[k]; }
  static __device__ __forceinline__ float all_sum(float x) { return warp_sum(x); }
  static __device__ __forceinline__ float all_max(float x) {
    return WarpRow<1, 1, 1>::all_max(x);
  }
  static __device__ __forceinline__ float all_min(float x) {
    return WarpRow<1, 1, 1>::all_min(x);
  }
};

template <class Opt>
using OptColumnRow = ColumnRow<Opt::kElementStates + Opt::kTemporaries, Opt::kRowStates, Opt::kIntRowStates,
                               Opt::kTableStates>;

// Scratch rows per warp: the gradient, the temporaries, a float copy of 16-bit or int8 weights, and a
// float copy of each narrow (fp16/bf16) per-element state. The states' dtypes are known only at
// run time (Params), so the count is computed from them, the same way on the host (to size the
// area) and in the kernels (to find a warp's share).
template <class Opt, typename W>
__host__ __device__ __forceinline__ int scratch_slots(const typename Opt::Params& p) {
  int slots = 1 + Opt::kTemporaries + (sizeof(W) == 4 ? 0 : 1);
  for (int k = 0; k < Opt::kElementStates; ++k) slots += p.element_state_dtypes[k] != kStateFloat32;
  return slots;
}

// ---- forward -----------------------------------------------------------------------------------

// Columns a lane accumulates per pass over a bag: a warp pools 32 * kCols columns per pass, and
// wider rows take several passes (each reading the bag's indices again, from the caches).
constexpr int kCols = 4;

// One warp per bag; each pass adds the bag's rows in index order into kCols register
// accumulators per lane. (Pooling none copies each scaled row to its output row.)
template <typename W, typename I, bool kPad = false>
__global__ void __launch_bounds__(256) forward_kernel(ForwardArgs a, const W* __restrict__ weights,
                                                      const I* __restrict__ indices,
                                                      const I* __restrict__ offsets) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t nbags = a.F * a.B;
  const int64_t warps = int64_t(gridDim.x) * blockDim.x / kWarpSize;
  for (int64_t bag = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / kWarpSize; bag < nbags; bag += warps) {
    int64_t start, end;
    const bool bounds_ok = bag_bounds<kPad>(a, offsets, bag, nbags, &start, &end);
    if (!bounds_ok) start = end = 0;  // (sum/mean: the bag's output is written as zeros)
    if (!bounds_ok && a.pooling == kPoolNone) continue;
    const int64_t f = bag / a.B, b = bag % a.B;
    const int64_t* ft = a.feat + f * kFeatColumns;
    const int D = int(ft[kFeatDim]);
    const float scale = (a.pooling == kPoolMean && end > start) ? 1.0f / float(end - start) : 1.0f;
    // (a VBE padding bag has no lookups and no place in the output)
    const int64_t bag_at = bag_output_at(a, bag, b, ft);
    if (bag_at < 0) continue;
    float* out = a.out + bag_at;
    for (int c0 = 0; c0 < D; c0 += kWarpSize * kCols) {
      float acc[kCols];
#pragma unroll
      for (int c = 0; c < kCols; ++c) acc[c] = 0.0f;
      for (int64_t base = start; base < end; base += kWarpSize) {
        // lane j fetches index base + j and its row offset (a bad index is recorded again on
        // later passes, which changes nothing: the record keeps the first error)
        const int64_t my_i = base + lane;
        int64_t my_off = -1;
        float my_scale = 0.0f;
        Int8QParams my_q{0.0f, 0.0f};  // (int8 rows only)
        if (my_i < end) {
          const int64_t idx = int64_t(indices[my_i]);
          my_off = row_offset(ft, idx, my_i, a.weights_numel, a.error);
          my_scale = a.psw ? a.psw[my_i] : 1.0f;
          if constexpr (std::is_same<W, uint8_t>::value) {
            if (my_off >= 0) {
              my_off = weights_row_start<W>(my_off, ft[kFeatKeyBase] + idx);
              my_q = load_qparams(weights + my_off, D);
            }
          }
        }
        const int n = end - base < kWarpSize ? int(end - base) : kWarpSize;
        for (int j = 0; j < n; ++j) {
          const int64_t off = __shfl_sync(kFullMask, my_off, j);
          const float s = __shfl_sync(kFullMask, my_scale, j);
          Int8QParams q{0.0f, 0.0f};
          if constexpr (std::is_same<W, uint8_t>::value) {
            q.scale = __shfl_sync(kFullMask, my_q.scale, j);
            q.bias = __shfl_sync(kFullMask, my_q.bias, j);
          }
          if (off < 0) continue;
          if (a.pooling == kPoolNone) {
            float* o = a.out + (base + j) * a.max_D;
#pragma unroll
            for (int c = 0; c < kCols; ++c) {
              const int d = c0 + c * kWarpSize + lane;
              if (d < D) o[d] = s * load_weight(weights[off + d], q);
            }
          } else {
#pragma unroll
            for (int c = 0; c < kCols; ++c) {
              const int d = c0 + c * kWarpSize + lane;
              if (d < D) acc[c] += s * load_weight(weights[off + d], q);
            }
          }
        }
      }
      if (a.pooling == kPoolNone) continue;
#pragma unroll
      for (int c = 0; c < kCols; ++c) {
        const int d = c0 + c * kWarpSize + lane;
        if (d < D) out[d] = acc[c] * scale;
      }
    }
  }
}

// d loss / d per_sample_weights[i]: one warp per bag, a warp-wide dot product per index (each
// lane over its columns, then a butterfly sum).
template <typename W, typename I, bool kPad = false>
__global__ void __launch_bounds__(256) grad_psw_kernel(ForwardArgs a, const float* __restrict__ grad_output,
                                                       const W* __restrict__ weights,
                                                       const I* __restrict__ indices,
                                                       const I* __restrict__ offsets, float* grad) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t nbags = a.F * a.B;
  const int64_t warps = int64_t(gridDim.x) * blockDim.x / kWarpSize;
  for (int64_t bag = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / kWarpSize; bag < nbags; bag += warps) {
    int64_t start, end;
    if (!bag_bounds<kPad>(a, offsets, bag, nbags, &start, &end)) continue;
    const int64_t f = bag / a.B, b = bag % a.B;
    const int64_t* ft = a.feat + f * kFeatColumns;
    const int D = int(ft[kFeatDim]);
    const float scale = a.pooling == kPoolMean ? 1.0f / float(end > start ? end - start : 1) : 1.0f;
    for (int64_t i = start; i < end; ++i) {
      const int64_t idx = int64_t(indices[i]);
      int64_t off = row_offset(ft, idx, i, a.weights_numel, a.error);
      if (off < 0) continue;
      Int8QParams q{0.0f, 0.0f};  // (int8 rows only)
      if constexpr (std::is_same<W, uint8_t>::value) {
        off = weights_row_start<W>(off, ft[kFeatKeyBase] + idx);
        q = load_qparams(weights + off, D);
      }
      const float* go = grad_output + (a.pooling == kPoolNone ? i * a.max_D : bag_output_at(a, bag, b, ft));
      float dot = 0.0f;
      for (int d = lane; d < D; d += kWarpSize) dot += load_weight(weights[off + d], q) * go[d];
      dot = warp_sum(dot);
      if (lane == 0) grad[i] = dot * scale;
    }
  }
}

// ---- backward ----------------------------------------------------------------------------------

// Adds the scaled output-gradient rows of occurrences [first, first + n), n <= 32, in order, into
// this lane's columns of g.
__device__ __forceinline__ void add_chunk(const BackwardArgs& a, const Occurrences& o, int D, int lane, int64_t first,
                                          int n, float* g) {
  OccurrenceInfo mine;
  if (lane < n) mine.fetch(o, first + lane, a.pooling == kPoolNone);
  for (int k = 0; k < n; ++k) {
    const OccurrenceInfo occ = mine.from_lane(k);
    const float* go = grad_row(a, occ.position, occ.bag);
    for (int d = lane; d < D; d += kWarpSize) g[d] += occ.scale * go[d];
  }
}

// add_occurrences for layouts whose float rows can be read 4 at a time (a.float_rows_4wide: here,
// rows wider than kVectorMaxD, or 16-bit states or int8 weights, with widths a multiple of 4).
// Lane l sums the 4-wide slices at columns c0 + v * 128 + 4 * l in registers, 1024 columns per
// pass over the occurrences, and writes each pass's sums into g once: one 16-byte load per
// occurrence and slice, where the column loop of add_chunk loads and stores g for every
// occurrence. Each column's sum is add_chunk's, term by term (g's value, then s * x + sum per
// occurrence in order, one rounding each: add_chunk's `g += s * x` contracts to the same fma), so
// the bits do not depend on which of the two ran.
__device__ __forceinline__ void add_occurrences_4wide(const BackwardArgs& a, const Occurrences& o, int D, int lane,
                                                      int64_t first, int64_t last, float* g) {
  constexpr int kVecs = 8;
  __syncwarp();  // (g's columns were written in the column layout, by other lanes)
  for (int c0 = 0; c0 < D; c0 += kVecs * 128) {
    float acc[kVecs][4];
#pragma unroll
    for (int v = 0; v < kVecs; ++v) {
      const int d = c0 + v * 128 + 4 * lane;
      if (d < D) {
        load4(g + d, acc[v]);
      } else {
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[v][c] = 0.0f;
      }
    }
    for (int64_t base = first; base < last; base += kWarpSize) {
      const int n = last - base < kWarpSize ? int(last - base) : kWarpSize;
      OccurrenceInfo mine;
      if (lane < n) mine.fetch(o, base + lane, a.pooling == kPoolNone);
      for (int k = 0; k < n; ++k) {
        const OccurrenceInfo occ = mine.from_lane(k);
        const float* go = grad_row(a, occ.position, occ.bag) + c0;
#pragma unroll
        for (int v = 0; v < kVecs; ++v) {
          const int d = v * 128 + 4 * lane;
          if (c0 + d < D) {
            float x[4];
            load4(go + d, x);
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[v][c] = fmaf(occ.scale, x[c], acc[v][c]);
          }
        }
      }
    }
#pragma unroll
    for (int v = 0; v < kVecs; ++v) {
      const int d = c0 + v * 128 + 4 * lane;
      if (d < D) store4(g + d, acc[v]);
    }
  }
  __syncwarp();  // (the optimizer reads g in the column layout)
}

// One lane's kVecs 4-column slices of a 4-wide float row, the row's column c0 at `src`: columns
// c0 + v * 128 + 4 * lane .. + 3, zeros from column D on (`full`: every slice is below D, so the
// loads carry no predicates and ptxas issues them back to back). kStream: load4_stream (an
// occurrence's output-gradient row, read once), else load4.
template <int kVecs, bool kStream>
__device__ __forceinline__ void load_slices(const float* src, int c0, int D, int lane, bool full, float (&x)[kVecs][4]) {
  if (full) {
#pragma unroll
    for (int v = 0; v < kVecs; ++v) {
      if constexpr (kStream) load4_stream(src + v * 128 + 4 * lane, x[v]);
      else load4(src + v * 128 + 4 * lane, x[v]);
    }
  } else {
#pragma unroll
    for (int v = 0; v < kVecs; ++v) {
      const int d = v * 128 + 4 * lane;
      if (c0 + d < D) {
        if constexpr (kStream) load4_stream(src + d, x[v]);
        else load4(src + d, x[v]);
      } else {
#pragma unroll
        for (int c = 0; c < 4; ++c) x[v][c] = 0.0f;
      }
    }
  }
}

// The variant's occurrence sum (kPrefetch with 4-wide float rows): add_occurrences_4wide's terms
// in its order, from zero (sums_from_zero: g is not read), but each occurrence's kVecs loads are
// issued together before any of its sums, and each occurrence's output-gradient row is located
// by the lane that fetched the occurrence (one shuffle of the pointer, not a load of the
// features table per occurrence). ptxas (sm_90) interleaves add_occurrences_4wide's loads with
// its sums, two 16-byte loads in flight per lane: 1 KB per warp of a 1024-wide row, which at 24
// warps per multiprocessor keeps about 3 MB in flight on the H200, not enough for its HBM; here
// a warp has a whole 4 KB slice in flight. Columns past D load nothing and add zero to
// accumulators that are never stored.
// (kVecs 4, kRows 2: the occupancy variant's, TBEGEN_ANY_WIDTH_OCCUPANCY: 512-column passes, two
// occurrences' loads issued together, then the first's sums, then the second's: the same order.)
template <int kVecs = 8, int kRows = 1>
__device__ __forceinline__ void add_occurrences_4wide_batched(const BackwardArgs& a, const Occurrences& o, int D,
                                                              int lane, int64_t first, int64_t last, float* g) {
  static_assert(kRows == 1 || kRows == 2, "one or two occurrences a step");
  __syncwarp();  // (the previous row's update read g in the column layout, by other lanes)
  for (int c0 = 0; c0 < D; c0 += kVecs * 128) {
    const bool full = c0 + kVecs * 128 <= D;  // (every lane's every slice is a column below D)
    float acc[kVecs][4];
#pragma unroll
    for (int v = 0; v < kVecs; ++v) {
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[v][c] = 0.0f;
    }
    for (int64_t base = first; base < last; base += kWarpSize) {
      const int n = last - base < kWarpSize ? int(last - base) : kWarpSize;
      unsigned long long my_go = 0;
      float my_scale = 0.0f;
      if (lane < n) {
        OccurrenceInfo mine;
        mine.fetch(o, base + lane, a.pooling == kPoolNone);
        my_go = reinterpret_cast<unsigned long long>(grad_row(a, mine.position, mine.bag) + c0);
        my_scale = mine.scale;
      }
      int k = 0;
      if constexpr (kRows == 2) {
        for (; k + 1 < n; k += 2) {
          const float* go0 = reinterpret_cast<const float*>(__shfl_sync(kFullMask, my_go, k));
          const float s0 = __shfl_sync(kFullMask, my_scale, k);
          const float* go1 = reinterpret_cast<const float*>(__shfl_sync(kFullMask, my_go, k + 1));
          const float s1 = __shfl_sync(kFullMask, my_scale, k + 1);
          float x0[kVecs][4], x1[kVecs][4];
          load_slices<kVecs, true>(go0, c0, D, lane, full, x0);
          load_slices<kVecs, true>(go1, c0, D, lane, full, x1);
#pragma unroll
          for (int v = 0; v < kVecs; ++v) {
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[v][c] = fmaf(s0, x0[v][c], acc[v][c]);
          }
#pragma unroll
          for (int v = 0; v < kVecs; ++v) {
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[v][c] = fmaf(s1, x1[v][c], acc[v][c]);
          }
        }
      }
      for (; k < n; ++k) {
        const float* go = reinterpret_cast<const float*>(__shfl_sync(kFullMask, my_go, k));
        const float s = __shfl_sync(kFullMask, my_scale, k);
        float x[kVecs][4];
        load_slices<kVecs, true>(go, c0, D, lane, full, x);
#pragma unroll
        for (int v = 0; v < kVecs; ++v) {
#pragma unroll
          for (int c = 0; c < 4; ++c) acc[v][c] = fmaf(s, x[v][c], acc[v][c]);
        }
      }
    }
#pragma unroll
    for (int v = 0; v < kVecs; ++v) {
      const int d = c0 + v * 128 + 4 * lane;
      if (d < D) store4(g + d, acc[v]);
    }
  }
  __syncwarp();  // (the optimizer reads g in the column layout)
}

// The variant's sum of a hot row's segment sums (backward_finish_kernel, kPrefetch with 4-wide
// float rows): g = ((0 + s_0) + s_1) + ... per column in segment order, as the default column loop
// adds them into the cleared row, but 4 columns a load and a slice's loads issued together, where
// the column loop waits for a load of g and of s_j once per 32 columns and segment (a run of 24000
// occurrences, 94 segments of a 1024-wide row: about 3000 round trips one after another).
// (kVecs 4, kRows 2: the occupancy variant's, two segments' loads issued together, added in order.)
template <int kVecs = 8, int kRows = 1>
__device__ __forceinline__ void add_partials_4wide(const float* in, int32_t nseg, int64_t max_D, int D, int lane,
                                                   float* g) {
  static_assert(kRows == 1 || kRows == 2, "one or two segment sums a step");
  __syncwarp();  // (the previous row's update read g in the column layout, by other lanes)
  for (int c0 = 0; c0 < D; c0 += kVecs * 128) {
    const bool full = c0 + kVecs * 128 <= D;
    float acc[kVecs][4];
#pragma unroll
    for (int v = 0; v < kVecs; ++v) {
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[v][c] = 0.0f;
    }
    int32_t j = 0;
    if constexpr (kRows == 2) {
      for (; j + 1 < nseg; j += 2) {
        const float* src0 = in + int64_t(j) * max_D + c0;
        float x0[kVecs][4], x1[kVecs][4];
        load_slices<kVecs, false>(src0, c0, D, lane, full, x0);
        load_slices<kVecs, false>(src0 + max_D, c0, D, lane, full, x1);
#pragma unroll
        for (int v = 0; v < kVecs; ++v) {
#pragma unroll
          for (int c = 0; c < 4; ++c) acc[v][c] = acc[v][c] + x0[v][c];
        }
#pragma unroll
        for (int v = 0; v < kVecs; ++v) {
#pragma unroll
          for (int c = 0; c < 4; ++c) acc[v][c] = acc[v][c] + x1[v][c];
        }
      }
    }
    for (; j < nseg; ++j) {
      const float* src = in + int64_t(j) * max_D + c0;
      float x[kVecs][4];
      load_slices<kVecs, false>(src, c0, D, lane, full, x);
#pragma unroll
      for (int v = 0; v < kVecs; ++v) {
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[v][c] = acc[v][c] + x[v][c];
      }
    }
#pragma unroll
    for (int v = 0; v < kVecs; ++v) {
      const int d = c0 + v * 128 + 4 * lane;
      if (d < D) store4(g + d, acc[v]);
    }
  }
  __syncwarp();  // (the optimizer reads g in the column layout)
}

// Adds occurrences [first, last) into g (this lane's columns), 32 at a time.
// (kMinBlocks: the kernel's, kSumVecs and kSumRows: the occupancy variant's sum shape.)
template <bool kPrefetch, int kMinBlocks = 1>
__device__ __forceinline__ void add_occurrences(const BackwardArgs& a, const Occurrences& o, int D, int lane,
                                                int64_t first, int64_t last, float* g) {
  if (a.float_rows_4wide) {
    if constexpr (kPrefetch) {
      add_occurrences_4wide_batched<kSumVecs<kMinBlocks>, kSumRows<kMinBlocks>>(a, o, D, lane, first, last, g);
    } else {
      add_occurrences_4wide(a, o, D, lane, first, last, g);
    }
    return;
  }
  for (int64_t base = first; base < last; base += kWarpSize) {
    const int n = last - base < kWarpSize ? int(last - base) : kWarpSize;
    add_chunk(a, o, D, lane, base, n, g);
  }
}

// begin_row's arrays: points the row view at its weights and element states (fp32 in place; 16-bit
// or int8 weights and narrow states loaded into float copies in this warp's scratch rows after
// the gradient's) and clears its temporaries (scratch rows too). (prefetch: the variant asks L1 for
// a 16-bit or int8 weight row before converting it.)
template <class Opt, typename W>
__device__ __forceinline__ void begin_row_arrays(OptColumnRow<Opt>& row, const typename Opt::Params& p, W* weights,
                                                 int64_t key, int64_t woff, float* scratch, int64_t max_D,
                                                 bool prefetch) {
  float* next = scratch + max_D;
  if constexpr (sizeof(W) == 4) {
    row.w_ = reinterpret_cast<float*>(weights) + woff;
  } else {
    row.w_ = next;
    next += max_D;
    // (an int8 row starts further on, and its qparams follow its codes: common.h)
    const W* wrow = weights + weights_row_start<W>(woff, key);
    if (prefetch) prefetch_l1(wrow, int64_t(row.D) * int64_t(sizeof(W)), row.lane);
    Int8QParams q{0.0f, 0.0f};
    if constexpr (std::is_same<W, uint8_t>::value) q = load_qparams(wrow, row.D);
    for (int d = row.lane; d < row.D; d += kWarpSize) row.w_[d] = load_weight(wrow[d], q);
  }
#pragma unroll
  for (int k = Opt::kElementStates; k < Opt::kElementStates + Opt::kTemporaries; ++k) {
    row.element_[k] = next;
    next += max_D;
    for (int d = row.lane; d < row.D; d += kWarpSize) row.element_[k][d] = 0.0f;
  }
  // fp32 element states in place; a narrow one through a float copy in the next scratch row
  // (indexed like the weights row, from 0)
#pragma unroll
  for (int k = 0; k < Opt::kElementStates; ++k) {
    const int32_t dtype = p.element_state_dtypes[k];
    if (dtype == kStateFloat32) {
      row.element_[k] = p.element_states[k] + woff;
    } else {
      row.element_[k] = next;
      next += max_D;
      for (int d = row.lane; d < row.D; d += kWarpSize) row.element_[k][d] = load_state(p.element_states[k], dtype, woff + d);
    }
  }
}

// Points the row view at its weights and states (loading what is not updated in place) and at
// this warp's scratch, whose gradient row is cleared; per-row states are loaded into registers.
// (clear_g false: the caller's occurrence sum writes every column of the gradient row,
// sums_from_zero; prefetch: the variant asks L1 for a 16-bit or int8 weight row before converting it;
// shared_g: the occupancy variant's gradient row in shared memory, TBEGEN_ANY_WIDTH_SHARED_ROW, whose
// scratch row then goes unused.)
// kMinBlocks > 1 (the occupancy variant's kernels, issue 29): the arrays are not set up here; the
// kernel calls begin_row_arrays after the occurrence sum, so that the weights and element-state
// pointers (2 + 2 x kElementStates registers) are not live across the sum's 48 accumulator and load
// registers. At 80 registers ptxas spilled them there and reloaded them from local memory inside the
// optimizer's column loop, up to twice per 32 columns per pointer (ptxas -v and SASS before and
// after: benchmarks/NOTES-gpu.md, "The occupancy kernels' spills in the update loop"). The loads and
// stores moved are of other rows than the sum's (the state copies, the temporaries), and the update's
// arithmetic is untouched: the same bits.
template <class Opt, typename W, int kMinBlocks = 1>
__device__ __forceinline__ void begin_row(OptColumnRow<Opt>& row, const typename Opt::Params& p, W* weights,
                                          int64_t key, int64_t woff, float* scratch, int64_t max_D,
                                          bool clear_g = true, bool prefetch = false, float* shared_g = nullptr) {
  row.g_ = shared_g != nullptr ? shared_g : scratch;
  if constexpr (kMinBlocks == 1) begin_row_arrays<Opt, W>(row, p, weights, key, woff, scratch, max_D, prefetch);
#pragma unroll
  for (int k = 0; k < Opt::kRowStates; ++k) row.row_[k] = load_state(p.row_states[k], p.row_state_dtypes[k], key);
#pragma unroll
  for (int k = 0; k < Opt::kIntRowStates; ++k) row.int_row_[k] = p.int_row_states[k][key];
  if (clear_g) {
    for (int d = row.lane; d < row.D; d += kWarpSize) row.g_[d] = 0.0f;
  }
}

// Applies the optimizer to a row whose gradient has been summed, and writes back what was not
// updated in place (16-bit weights, rounded as in the 4-wide path; narrow element states, rounded
// stochastically by store_state with the same (slot, key, column) as the 4-wide path; per-row
// states from lane 0).
// (prefetch: the variant first asks L1 for every line of the row's float arrays, TBEGEN_ANY_WIDTH_PREFETCH;
// g_shared: the gradient row is in shared memory, not asked for: prefetch.global takes global addresses.)
template <class Opt, typename W>
__device__ __forceinline__ void update_and_store(OptColumnRow<Opt>& row, const typename Opt::Params& p,
                                                 const RowUpdateContext& ctx, const typename Opt::StepValues& sv,
                                                 W* weights, int64_t key, int64_t woff, bool prefetch = false,
                                                 bool g_shared = false) {
  if (prefetch) {
    __syncwarp();  // (the gradient row's columns were written by other lanes of the warp)
    const int64_t bytes = int64_t(row.D) * int64_t(sizeof(float));
    if (!g_shared) prefetch_l1(row.g_, bytes, row.lane);
    prefetch_l1(row.w_, bytes, row.lane);
#pragma unroll
    for (int k = 0; k < Opt::kElementStates + Opt::kTemporaries; ++k) prefetch_l1(row.element_[k], bytes, row.lane);
  }
  Opt::update_row(row, p, sv);
  if constexpr (std::is_same<W, uint8_t>::value) {
    // int8 row: fresh qparams from the updated row's min and max over the warp (every lane gets
    // the same values), then each lane quantizes its columns and lane 0 stores the qparams
    uint8_t* wrow = weights + weights_row_start<W>(woff, key);
    float lo = INFINITY, hi = -INFINITY;
    for (int d = row.lane; d < row.D; d += kWarpSize) {
      lo = fminf(lo, row.w_[d]);
      hi = fmaxf(hi, row.w_[d]);
    }
    const Int8QParams q = int8_qparams(OptColumnRow<Opt>::all_min(lo), OptColumnRow<Opt>::all_max(hi));
    for (int d = row.lane; d < row.D; d += kWarpSize) wrow[d] = quantize(row.w_[d], q);
    __syncwarp();  // (every lane has read the old qparams in begin_row long before; made explicit)
    if (row.lane == 0) store_qparams(wrow, row.D, q);
  } else if constexpr (sizeof(W) != 4) {
    for (int d = row.lane; d < row.D; d += kWarpSize) {
      const uint32_t bits = ctx.stochastic_rounding ? random_bits(ctx.seed, ctx.step, key, d) : 0u;
      weights[woff + d] = WeightTraits<W>::round(row.w_[d], bits, ctx.stochastic_rounding);
    }
  }
#pragma unroll
  for (int k = 0; k < Opt::kElementStates; ++k) {
    const int32_t dtype = p.element_state_dtypes[k];
    if (dtype == kStateFloat32) continue;  // (updated in place)
    for (int d = row.lane; d < row.D; d += kWarpSize)
      store_state(p.element_states[k], dtype, woff + d, row.element_[k][d], ctx, k, key, d);
  }
  if (row.lane == 0) {
#pragma unroll
    for (int k = 0; k < Opt::kRowStates; ++k)
      store_state(p.row_states[k], p.row_state_dtypes[k], key, row.row_[k], ctx, Opt::kElementStates + k, key, 0);
#pragma unroll
    for (int k = 0; k < Opt::kIntRowStates; ++k) p.int_row_states[k][key] = row.int_row_[k];
  }
}

// The occupancy variant's gradient row in shared memory (TBEGEN_ANY_WIDTH_SHARED_ROW): where the
// launch gave the block dynamic shared memory (8 warps x max_D floats), this warp's max_D floats of
// it, else nullptr (the scratch row). Only the `..._occupancy` kernels ask (kMinBlocks > 1); the
// kMinBlocks = 1 kernels' code (the non-prefetching kernels, the 2-block prefetching ones) does not
// change.
template <int kMinBlocks>
__device__ __forceinline__ float* warp_shared_row(int64_t max_D) {
  if constexpr (kMinBlocks == 1) {
    return nullptr;
  } else {
    extern __shared__ float4 shared_rows[];  // (float4: 16-byte aligned for the 4-wide sums' stores)
    uint32_t bytes;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(bytes));
    if (bytes == 0) return nullptr;
    return reinterpret_cast<float*>(shared_rows) + int64_t(threadIdx.x / kWarpSize) * max_D;
  }
}

// This warp's scratch area: warp w of the grid owns slots [w * slots, (w + 1) * slots) rows.
template <class Opt, typename W>
__device__ __forceinline__ float* warp_scratch(float* scratch, int64_t max_D, const typename Opt::Params& p) {
  const int64_t warp = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / kWarpSize;
  return scratch + warp * scratch_slots<Opt, W>(p) * max_D;
}

// Short runs: one warp per unique row, rows taken in turn (grid-stride).
// (Each kernel's body is a device function whose kMinBlocks is 1, or kOccupancyMinBlocks for the
// occupancy variant's kernel, `..._occupancy`, TBEGEN_ANY_WIDTH_OCCUPANCY: the other kernels keep
// __launch_bounds__(256) alone, under which ptxas chooses their registers as before.)
template <class Opt, typename W, bool kPrefetch, int kMinBlocks>
__device__ __forceinline__ void backward_warp_body(BackwardArgs a, Runs r, Occurrences o, typename Opt::Params p,
                                                   RowUpdateContext ctx, W* weights, float* scratch) {
  if (update_blocked(a)) return;
  // the values of the update that depend on the step only (Optimizer::StepValues), once per thread
  const typename Opt::StepValues sv = Opt::step_values(p, ctx.step);
  const int lane = threadIdx.x % kWarpSize;
  const int64_t warps = int64_t(gridDim.x) * blockDim.x / kWarpSize;
  const int32_t num_runs = r.counts[0];
  float* mine = warp_scratch<Opt, W>(scratch, a.max_D, p);
  float* const shared_g = warp_shared_row<kMinBlocks>(a.max_D);
  for (int64_t run = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / kWarpSize; run < num_runs; run += warps) {
    const int32_t start = r.starts[run];
    const int32_t len = r.end_of(run, num_runs) - start;
    const int64_t key = r.key_at(start);
    // long runs are the segment kernels'; skipped bad indices update nothing
    if (len >= r.max_segment_length_per_warp || key >= r.skipped_key) continue;
    OptColumnRow<Opt> row;
    row.lane = lane;
    int64_t woff;
    locate_row(a, o.bag[start], key, &row.D, &woff);
    load_table_states<Opt>(row, p, o.bag[start], a.B);
    begin_row<Opt, W, kMinBlocks>(row, p, weights, key, woff, mine, a.max_D, !sums_from_zero<kPrefetch>(a),
                                  kPrefetch, shared_g);
    add_occurrences<kPrefetch, kMinBlocks>(a, o, row.D, lane, start, int64_t(start) + len, row.g_);
    if constexpr (kMinBlocks > 1) begin_row_arrays<Opt, W>(row, p, weights, key, woff, mine, a.max_D, kPrefetch);
    update_and_store<Opt, W>(row, p, ctx, sv, weights, key, woff, kPrefetch, shared_g != nullptr);
  }
}
template <class Opt, typename W, bool kPrefetch = false>
__global__ void __launch_bounds__(256) backward_warp_kernel(BackwardArgs a, Runs r, Occurrences o,
                                  typename Opt::Params p, RowUpdateContext ctx, W* weights, float* scratch) {
  backward_warp_body<Opt, W, kPrefetch, 1>(a, r, o, p, ctx, weights, scratch);
}
// (the occupancy variant's instantiation: TBEGEN_ANY_WIDTH_OCCUPANCY)
template <class Opt, typename W>
__global__ void __launch_bounds__(256, kOccupancyMinBlocks) backward_warp_kernel_occupancy(BackwardArgs a, Runs r,
                                  Occurrences o, typename Opt::Params p, RowUpdateContext ctx, W* weights,
                                  float* scratch) {
  backward_warp_body<Opt, W, true, kOccupancyMinBlocks>(a, r, o, p, ctx, weights, scratch);
}

// Long runs, first pass: one warp per segment of r.segment_length occurrences. A run of one
// segment is summed and updated here; a run of several leaves each segment's sum (max_D floats)
// in `partial` for backward_finish_kernel.
template <class Opt, typename W, bool kPrefetch, int kMinBlocks>
__device__ __forceinline__ void backward_segment_body(BackwardArgs a, Runs r, Occurrences o, typename Opt::Params p,
                                                      RowUpdateContext ctx, W* weights, float* partial,
                                                      float* scratch) {
  if (update_blocked(a)) return;
  // the values of the update that depend on the step only (Optimizer::StepValues), once per thread
  const typename Opt::StepValues sv = Opt::step_values(p, ctx.step);
  const int lane = threadIdx.x % kWarpSize;
  const int64_t warps = int64_t(gridDim.x) * blockDim.x / kWarpSize;
  const int32_t num_runs = r.counts[0];
  const int32_t num_long = r.counts[1];
  if (num_long == 0) return;
  const int32_t total = r.segments[num_long].x;
  float* mine = warp_scratch<Opt, W>(scratch, a.max_D, p);
  float* const shared_g = warp_shared_row<kMinBlocks>(a.max_D);
  for (int64_t s = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / kWarpSize; s < total; s += warps) {
    // the long run owning segment s: the last k with segments[k].x <= s
    int32_t lo = 0, hi = num_long - 1;
    while (lo < hi) {
      const int32_t mid = (lo + hi + 1) >> 1;
      if (r.segments[mid].x <= s) lo = mid; else hi = mid - 1;
    }
    const LongRun run = long_run(r, lo, num_runs);
    if (run.key >= r.skipped_key) continue;
    const int32_t seg = int32_t(s) - run.segments.x;
    const int32_t begin = seg * r.segment_length;
    // (begin + segment_length could overflow for a run of nearly 2^31 occurrences)
    const int32_t end = run.len - begin > r.segment_length ? begin + r.segment_length : run.len;
    OptColumnRow<Opt> row;
    row.lane = lane;
    int64_t woff;
    locate_row(a, o.bag[run.first], run.key, &row.D, &woff);
    load_table_states<Opt>(row, p, o.bag[run.first], a.B);
    if (run.nseg == 1) {
      begin_row<Opt, W, kMinBlocks>(row, p, weights, run.key, woff, mine, a.max_D, !sums_from_zero<kPrefetch>(a),
                                    kPrefetch, shared_g);
      add_occurrences<kPrefetch, kMinBlocks>(a, o, row.D, lane, int64_t(run.first) + begin, int64_t(run.first) + end, row.g_);
      if constexpr (kMinBlocks > 1) begin_row_arrays<Opt, W>(row, p, weights, run.key, woff, mine, a.max_D, kPrefetch);
      update_and_store<Opt, W>(row, p, ctx, sv, weights, run.key, woff, kPrefetch, shared_g != nullptr);
    } else {
      float* out = partial + int64_t(run.segments.y + seg) * a.max_D;
      if (!sums_from_zero<kPrefetch>(a)) {
        for (int d = lane; d < row.D; d += kWarpSize) out[d] = 0.0f;
      }
      add_occurrences<kPrefetch, kMinBlocks>(a, o, row.D, lane, int64_t(run.first) + begin, int64_t(run.first) + end, out);
    }
  }
}
template <class Opt, typename W, bool kPrefetch = false>
__global__ void __launch_bounds__(256) backward_segment_kernel(BackwardArgs a, Runs r, Occurrences o,
                                  typename Opt::Params p, RowUpdateContext ctx, W* weights, float* partial,
                                  float* scratch) {
  backward_segment_body<Opt, W, kPrefetch, 1>(a, r, o, p, ctx, weights, partial, scratch);
}
// (the occupancy variant's instantiation: TBEGEN_ANY_WIDTH_OCCUPANCY)
template <class Opt, typename W>
__global__ void __launch_bounds__(256, kOccupancyMinBlocks) backward_segment_kernel_occupancy(BackwardArgs a, Runs r,
                                  Occurrences o, typename Opt::Params p, RowUpdateContext ctx, W* weights,
                                  float* partial, float* scratch) {
  backward_segment_body<Opt, W, true, kOccupancyMinBlocks>(a, r, o, p, ctx, weights, partial, scratch);
}

// Short runs and long runs' segments from one list in key order (WorkItems, TBEGEN_ANY_WIDTH_ITEMS=1):
// one warp per item, items taken in turn (grid-stride), so that the warps in flight sum one band of
// the sorted batch (the two kernels above, on two streams, sum two bands, often in different tables,
// whose output-gradient rows then compete for L2: benchmarks/tools/l2_model.py). An item is either a
// whole run, summed and updated as backward_warp_kernel does (or a one-segment long run, as
// backward_segment_kernel does: the same calls), or a segment of a run of several, whose sum goes
// to its partial-sum slot for backward_finish_kernel: the same arithmetic in the same order as the
// two kernels, so the same bits (tests/test_wide_rows.py).
template <class Opt, typename W, bool kPrefetch, int kMinBlocks>
__device__ __forceinline__ void backward_items_body(BackwardArgs a, Runs r, WorkItems items, Occurrences o,
                                                    typename Opt::Params p, RowUpdateContext ctx, W* weights,
                                                    float* partial, float* scratch) {
  if (update_blocked(a)) return;
  // the values of the update that depend on the step only (Optimizer::StepValues), once per thread
  const typename Opt::StepValues sv = Opt::step_values(p, ctx.step);
  const int lane = threadIdx.x % kWarpSize;
  const int64_t warps = int64_t(gridDim.x) * blockDim.x / kWarpSize;
  const int32_t total = *items.total;
  float* mine = warp_scratch<Opt, W>(scratch, a.max_D, p);
  float* const shared_g = warp_shared_row<kMinBlocks>(a.max_D);
  for (int64_t i = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / kWarpSize; i < total; i += warps) {
    const int32_t start = items.start[i];
    const int32_t end = items.start[i + 1];
    const int64_t key = r.key_at(start);
    if (key >= r.skipped_key) continue;  // (skipped bad indices update nothing)
    const int32_t slot = items.partial[i];
    OptColumnRow<Opt> row;
    row.lane = lane;
    int64_t woff;
    locate_row(a, o.bag[start], key, &row.D, &woff);
    if (slot < 0) {
      load_table_states<Opt>(row, p, o.bag[start], a.B);
      begin_row<Opt, W, kMinBlocks>(row, p, weights, key, woff, mine, a.max_D, !sums_from_zero<kPrefetch>(a),
                                  kPrefetch, shared_g);
      add_occurrences<kPrefetch, kMinBlocks>(a, o, row.D, lane, start, end, row.g_);
      if constexpr (kMinBlocks > 1) begin_row_arrays<Opt, W>(row, p, weights, key, woff, mine, a.max_D, kPrefetch);
      update_and_store<Opt, W>(row, p, ctx, sv, weights, key, woff, kPrefetch, shared_g != nullptr);
    } else {
      float* out = partial + int64_t(slot) * a.max_D;
      if (!sums_from_zero<kPrefetch>(a)) {
        for (int d = lane; d < row.D; d += kWarpSize) out[d] = 0.0f;
      }
      add_occurrences<kPrefetch, kMinBlocks>(a, o, row.D, lane, start, end, out);
    }
  }
}
template <class Opt, typename W, bool kPrefetch>
__global__ void __launch_bounds__(256) backward_items_kernel(BackwardArgs a, Runs r, WorkItems items, Occurrences o,
                                  typename Opt::Params p, RowUpdateContext ctx, W* weights, float* partial,
                                  float* scratch) {
  backward_items_body<Opt, W, kPrefetch, 1>(a, r, items, o, p, ctx, weights, partial, scratch);
}
// (the occupancy variant's instantiation: TBEGEN_ANY_WIDTH_OCCUPANCY)
template <class Opt, typename W>
__global__ void __launch_bounds__(256, kOccupancyMinBlocks) backward_items_kernel_occupancy(BackwardArgs a, Runs r,
                                  WorkItems items, Occurrences o, typename Opt::Params p, RowUpdateContext ctx,
                                  W* weights, float* partial, float* scratch) {
  backward_items_body<Opt, W, true, kOccupancyMinBlocks>(a, r, items, o, p, ctx, weights, partial, scratch);
}

// Long runs, second pass: one warp per run of several segments adds their partial sums in
// segment order and updates the row.
template <class Opt, typename W, bool kPrefetch, int kMinBlocks>
__device__ __forceinline__ void backward_finish_body(BackwardArgs a, Runs r, Occurrences o, typename Opt::Params p,
                                                     RowUpdateContext ctx, W* weights, const float* partial,
                                                     float* scratch) {
  if (update_blocked(a)) return;
  // the values of the update that depend on the step only (Optimizer::StepValues), once per thread
  const typename Opt::StepValues sv = Opt::step_values(p, ctx.step);
  const int lane = threadIdx.x % kWarpSize;
  const int64_t warps = int64_t(gridDim.x) * blockDim.x / kWarpSize;
  const int32_t num_runs = r.counts[0];
  const int32_t num_long = r.counts[1];
  float* mine = warp_scratch<Opt, W>(scratch, a.max_D, p);
  float* const shared_g = warp_shared_row<kMinBlocks>(a.max_D);
  for (int64_t k = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / kWarpSize; k < num_long; k += warps) {
    const LongRun run = long_run(r, int32_t(k), num_runs);
    if (run.nseg <= 1 || run.key >= r.skipped_key) continue;
    OptColumnRow<Opt> row;
    row.lane = lane;
    int64_t woff;
    locate_row(a, o.bag[run.first], run.key, &row.D, &woff);
    load_table_states<Opt>(row, p, o.bag[run.first], a.B);
    begin_row<Opt, W, kMinBlocks>(row, p, weights, run.key, woff, mine, a.max_D, !sums_from_zero<kPrefetch>(a),
                                  kPrefetch, shared_g);
    const float* in = partial + int64_t(run.segments.y) * a.max_D;
    if (sums_from_zero<kPrefetch>(a)) {
      add_partials_4wide<kSumVecs<kMinBlocks>, kSumRows<kMinBlocks>>(in, run.nseg, a.max_D, row.D, lane, row.g_);
    } else {
      for (int32_t j = 0; j < run.nseg; ++j) {
        for (int d = lane; d < row.D; d += kWarpSize) row.g_[d] += in[int64_t(j) * a.max_D + d];
      }
    }
    if constexpr (kMinBlocks > 1) begin_row_arrays<Opt, W>(row, p, weights, run.key, woff, mine, a.max_D, kPrefetch);
    update_and_store<Opt, W>(row, p, ctx, sv, weights, run.key, woff, kPrefetch, shared_g != nullptr);
  }
}
template <class Opt, typename W, bool kPrefetch = false>
__global__ void __launch_bounds__(256) backward_finish_kernel(BackwardArgs a, Runs r, Occurrences o,
                                  typename Opt::Params p, RowUpdateContext ctx, W* weights, const float* partial,
                                  float* scratch) {
  backward_finish_body<Opt, W, kPrefetch, 1>(a, r, o, p, ctx, weights, partial, scratch);
}
// (the occupancy variant's instantiation: TBEGEN_ANY_WIDTH_OCCUPANCY)
template <class Opt, typename W>
__global__ void __launch_bounds__(256, kOccupancyMinBlocks) backward_finish_kernel_occupancy(BackwardArgs a, Runs r,
                                  Occurrences o, typename Opt::Params p, RowUpdateContext ctx, W* weights,
                                  const float* partial, float* scratch) {
  backward_finish_body<Opt, W, true, kOccupancyMinBlocks>(a, r, o, p, ctx, weights, partial, scratch);
}

}  // namespace any_width
}  // namespace cuda
}  // namespace tbegen
