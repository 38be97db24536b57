// tbegen runtime: CUDA kernels (forward pooled lookup, per-sample-weight gradient, and the backward
// pass with a fused optimizer). See docs/algorithm.md for the algorithm and the reasons behind it.
//
// Register layout of a row: lane l of a warp owns the 4-wide slices starting at columns
// v * 128 + 4 * l for v < kVecs, so a warp covers up to kVecs * 128 columns, each lane loading and
// storing 16 bytes (fp32) or 8 bytes (fp16/bf16) at a time.
#pragma once

#include <cuda_runtime.h>

#include "tbegen/common.h"

namespace tbegen {
namespace cuda {

constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xffffffffu;

// ---- 4-wide loads and stores ------------------------------------------------------------------

__device__ __forceinline__ void load4(const float* p, float* v) {
  const float4 x = *reinterpret_cast<const float4*>(p);
  v[0] = x.x; v[1] = x.y; v[2] = x.z; v[3] = x.w;
}
__device__ __forceinline__ void store4(float* p, const float* v) {
  *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
}

template <typename W>
__device__ __forceinline__ void load_weights4(const W* p, float* v) {
  if constexpr (sizeof(W) == 4) {
    load4(reinterpret_cast<const float*>(p), v);
  } else {
    // four 16-bit values in one 8-byte load
    const uint2 raw = *reinterpret_cast<const uint2*>(p);
    const W* h = reinterpret_cast<const W*>(&raw);
#pragma unroll
    for (int c = 0; c < 4; ++c) v[c] = WeightTraits<W>::load(h[c]);
  }
}

template <typename W>
__device__ __forceinline__ void store_weights4(W* p, const float* v, const RowUpdateContext& ctx,
                                               int64_t key, int d) {
  if constexpr (sizeof(W) == 4) {
    store4(reinterpret_cast<float*>(p), v);
  } else {
    uint2 raw;
    W* h = reinterpret_cast<W*>(&raw);
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const uint32_t bits = ctx.stochastic_rounding ? random_bits(ctx.seed, ctx.step, key, d + c) : 0u;
      h[c] = WeightTraits<W>::round(v[c], bits, ctx.stochastic_rounding);
    }
    *reinterpret_cast<uint2*>(p) = raw;
  }
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = kWarpSize / 2; o > 0; o >>= 1) x += __shfl_xor_sync(kFullMask, x, o);
  return x;
}

// Records the first error a kernel finds; the host raises it after the launch (host.h). Every
// kernel that writes weights or states checks the record first, so bad input changes nothing.
__device__ __forceinline__ void record_error(int64_t* error, int64_t code, int64_t where, int64_t value) {
  if (atomicCAS(reinterpret_cast<unsigned long long*>(error), 0ull,
                static_cast<unsigned long long>(code)) == 0ull) {
    error[1] = where;
    error[2] = value;
  }
}

// ---- the row view the optimizer sees -----------------------------------------------------------

// One lane's share of a row: kVecs 4-wide slices of the gradient, the weights, each per-element
// state and temporary, all in registers (every index is a compile-time constant once the
// optimizer's loops are unrolled), plus a register copy of each per-row state.
template <int kVecs, int kElementSlots, int kRowSlots>
struct WarpRow {
  static constexpr int kN = kVecs * 4;
  float g_[kN];
  float w_[kN];
  float element_[kElementSlots > 0 ? kElementSlots : 1][kN];
  float row_[kRowSlots > 0 ? kRowSlots : 1];
  int D;
  int lane;

  static constexpr __device__ int extent() { return kN; }
  __device__ __forceinline__ bool valid(int i) const { return (i >> 2) * 128 + 4 * lane < D; }
  __device__ __forceinline__ int dim() const { return D; }
  __device__ __forceinline__ float g(int i) const { return g_[i]; }
  __device__ __forceinline__ float& w(int i) { return w_[i]; }
  __device__ __forceinline__ float& element(int k, int i) { return element_[k][i]; }
  __device__ __forceinline__ float& row_state(int k) { return row_[k]; }
  // Butterfly reductions: every lane ends with the same, bitwise identical value.
  static __device__ __forceinline__ float all_sum(float x) { return warp_sum(x); }
  static __device__ __forceinline__ float all_max(float x) {
#pragma unroll
    for (int o = kWarpSize / 2; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(kFullMask, x, o));
    return x;
  }
  static __device__ __forceinline__ float all_min(float x) {
#pragma unroll
    for (int o = kWarpSize / 2; o > 0; o >>= 1) x = fminf(x, __shfl_xor_sync(kFullMask, x, o));
    return x;
  }
};

// ---- forward -----------------------------------------------------------------------------------

struct ForwardArgs {
  const int64_t* feat;
  int64_t F, B, N, total_D, max_D, weights_numel;
  const float* psw;  // nullptr when unweighted
  int64_t pooling;
  float* out;
  int64_t* error;
};

// Checks an index and returns its row's offset in the weights buffer, or -1 after recording why.
__device__ __forceinline__ int64_t row_offset(const int64_t* ft, int64_t idx, int64_t i,
                                              int64_t weights_numel, int64_t* error) {
  const int64_t D = ft[kFeatDim];
  if (idx < 0 || idx >= ft[kFeatRows]) {
    record_error(error, kErrIndexOutOfRange, i, idx);
    return -1;
  }
  const int64_t off = ft[kFeatWeightsOffset] + idx * D;
  if (off < 0 || off + D > weights_numel) {
    record_error(error, kErrRowOutsideWeights, i, idx);
    return -1;
  }
  return off;
}

// Checks a bag's boundaries (see host.h's check_indices_host for the rules).
template <typename I>
__device__ __forceinline__ bool bag_bounds(const I* offsets, int64_t bag, int64_t nbags, int64_t N,
                                           int64_t* error, int64_t* start, int64_t* end) {
  *start = offsets[bag];
  *end = offsets[bag + 1];
  const bool ok = *start >= 0 && *start <= *end && *end <= N && (bag != 0 || *start == 0) &&
                  (bag != nbags - 1 || *end == N);
  if (!ok) record_error(error, kErrBadOffsets, bag, 0);
  return ok;
}

// One warp per bag. Each lane holds kVecs 4-wide slices of the accumulator; the bag's indices are
// read 32 at a time, one per lane, and broadcast with shuffles.
template <typename W, typename I, int kVecs>
__global__ void __launch_bounds__(256) forward_kernel(ForwardArgs a, const W* __restrict__ weights,
                                                      const I* __restrict__ indices,
                                                      const I* __restrict__ offsets) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t nbags = a.F * a.B;
  const int64_t warps = int64_t(gridDim.x) * blockDim.x / kWarpSize;
  for (int64_t bag = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / kWarpSize; bag < nbags; bag += warps) {
    int64_t start, end;
    if (!bag_bounds(offsets, bag, nbags, a.N, a.error, &start, &end)) continue;
    const int64_t f = bag / a.B, b = bag % a.B;
    const int64_t* ft = a.feat + f * kFeatColumns;
    const int D = int(ft[kFeatDim]);
    float acc[kVecs][4];
#pragma unroll
    for (int v = 0; v < kVecs; ++v)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[v][c] = 0.0f;
    for (int64_t base = start; base < end; base += kWarpSize) {
      // lane j fetches index base + j and its row offset
      const int64_t my_i = base + lane;
      int64_t my_off = -1;
      float my_scale = 0.0f;
      if (my_i < end) {
        my_off = row_offset(ft, int64_t(indices[my_i]), my_i, a.weights_numel, a.error);
        my_scale = a.psw ? a.psw[my_i] : 1.0f;
      }
      const int n = end - base < kWarpSize ? int(end - base) : kWarpSize;
      // unrolled so that several rows' loads are in flight at once
#pragma unroll 8
      for (int j = 0; j < n; ++j) {
        const int64_t off = __shfl_sync(kFullMask, my_off, j);
        const float s = __shfl_sync(kFullMask, my_scale, j);
        if (off < 0) continue;
        if (a.pooling == kPoolNone) {
          float* o = a.out + (base + j) * a.max_D;
#pragma unroll
          for (int v = 0; v < kVecs; ++v) {
            const int d = v * 128 + 4 * lane;
            if (d < D) {
              float x[4];
              load_weights4(weights + off + d, x);
#pragma unroll
              for (int c = 0; c < 4; ++c) x[c] *= s;
              store4(o + d, x);
            }
          }
        } else {
#pragma unroll
          for (int v = 0; v < kVecs; ++v) {
            const int d = v * 128 + 4 * lane;
            if (d < D) {
              float x[4];
              load_weights4(weights + off + d, x);
#pragma unroll
              for (int c = 0; c < 4; ++c) acc[v][c] += s * x[c];
            }
          }
        }
      }
    }
    if (a.pooling != kPoolNone) {
      const float scale = (a.pooling == kPoolMean && end > start) ? 1.0f / float(end - start) : 1.0f;
      float* o = a.out + b * a.total_D + ft[kFeatOutOffset];
#pragma unroll
      for (int v = 0; v < kVecs; ++v) {
        const int d = v * 128 + 4 * lane;
        if (d < D) {
          float x[4];
#pragma unroll
          for (int c = 0; c < 4; ++c) x[c] = acc[v][c] * scale;
          store4(o + d, x);
        }
      }
    }
  }
}

// d loss / d per_sample_weights[i]: one warp per bag, a warp-wide dot product per index.
template <typename W, typename I, int kVecs>
__global__ void __launch_bounds__(256) grad_psw_kernel(ForwardArgs a, const float* __restrict__ grad_output,
                                                       const W* __restrict__ weights,
                                                       const I* __restrict__ indices,
                                                       const I* __restrict__ offsets, float* grad) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t nbags = a.F * a.B;
  const int64_t warps = int64_t(gridDim.x) * blockDim.x / kWarpSize;
  for (int64_t bag = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / kWarpSize; bag < nbags; bag += warps) {
    int64_t start, end;
    if (!bag_bounds(offsets, bag, nbags, a.N, a.error, &start, &end)) continue;
    const int64_t f = bag / a.B, b = bag % a.B;
    const int64_t* ft = a.feat + f * kFeatColumns;
    const int D = int(ft[kFeatDim]);
    const float scale = a.pooling == kPoolMean ? 1.0f / float(end > start ? end - start : 1) : 1.0f;
    for (int64_t i = start; i < end; ++i) {
      const int64_t off = row_offset(ft, int64_t(indices[i]), i, a.weights_numel, a.error);
      if (off < 0) continue;
      const float* go = a.pooling == kPoolNone ? grad_output + i * a.max_D
                                               : grad_output + b * a.total_D + ft[kFeatOutOffset];
      float dot = 0.0f;
#pragma unroll
      for (int v = 0; v < kVecs; ++v) {
        const int d = v * 128 + 4 * lane;
        if (d < D) {
          float x[4], y[4];
          load_weights4(weights + off + d, x);
          load4(go + d, y);
#pragma unroll
          for (int c = 0; c < 4; ++c) dot += x[c] * y[c];
        }
      }
      dot = warp_sum(dot);
      if (lane == 0) grad[i] = dot * scale;
    }
  }
}

// ---- backward ----------------------------------------------------------------------------------

// Step 1 of the backward: one warp per bag writes, for each of its indices, the linear key
// (table's first key + row), the index's position, its bag and its gradient scale
// (per-sample weight, divided by the bag length for mean pooling).
template <typename I>
__global__ void __launch_bounds__(256) linearize_kernel(ForwardArgs a, const I* __restrict__ indices,
                                                        const I* __restrict__ offsets,
                                                        int64_t total_hash_size, int64_t* keys,
                                                        int32_t* positions, int32_t* bag_of, float* scale_of) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t nbags = a.F * a.B;
  const int64_t warps = int64_t(gridDim.x) * blockDim.x / kWarpSize;
  for (int64_t bag = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / kWarpSize; bag < nbags; bag += warps) {
    int64_t start, end;
    if (!bag_bounds(offsets, bag, nbags, a.N, a.error, &start, &end)) continue;
    const int64_t* ft = a.feat + (bag / a.B) * kFeatColumns;
    const float inv_len = (a.pooling == kPoolMean && end > start) ? 1.0f / float(end - start) : 1.0f;
    for (int64_t i = start + lane; i < end; i += kWarpSize) {
      const int64_t idx = indices[i];
      int64_t key = 0;
      if (row_offset(ft, idx, i, a.weights_numel, a.error) >= 0) {
        key = ft[kFeatKeyBase] + idx;
        if (key >= total_hash_size) {
          record_error(a.error, kErrRowOutsideWeights, i, idx);
          key = 0;
        }
      }
      keys[i] = key;
      positions[i] = int32_t(i);
      bag_of[i] = int32_t(bag);
      if (scale_of) scale_of[i] = (a.psw ? a.psw[i] : 1.0f) * inv_len;
    }
  }
}

// The sorted, run-length-encoded view of a batch that the update kernels walk.
struct Runs {
  const int64_t* keys;       // unique linear keys, one per run
  const int32_t* starts;     // first sorted position of each run
  const int32_t* lengths;    // occurrences of each run
  const int32_t* num_runs;   // device scalar
  const int32_t* long_ids;   // runs of at least max_segment_length_per_warp occurrences
  const int32_t* num_long;   // device scalar
  int32_t max_segment_length_per_warp;
};

// What the update kernels need of each occurrence, in sorted order, so that a run's entries are
// contiguous (gathered once after the sort by gather_occurrences_kernel).
struct Occurrences {
  const int32_t* position;  // index position (for pooling none: the row of grad_output)
  const int32_t* bag;       // bag f * B + b of the index
  const float* scale;       // per-sample weight (/ L for mean); nullptr when every scale is 1
};

struct BackwardArgs {
  const int64_t* feat;
  int64_t B, total_D, max_D;
  int64_t pooling;
  const float* grad_output;
  const int64_t* error;
};

// Step 3b of the backward: lays out each occurrence's bag and scale in sorted order.
static __global__ void __launch_bounds__(256) gather_occurrences_kernel(int64_t n, const int32_t* __restrict__ sorted_positions,
                                                                 const int32_t* __restrict__ bag_of,
                                                                 const float* __restrict__ scale_of,
                                                                 int32_t* sorted_bag, float* sorted_scale) {
  for (int64_t j = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; j < n; j += int64_t(gridDim.x) * blockDim.x) {
    const int32_t pos = sorted_positions[j];
    sorted_bag[j] = bag_of[pos];
    if (scale_of) sorted_scale[j] = scale_of[pos];
  }
}

// Where a run's row lives: its width and offset in the weights buffer, from the bag of any of its
// occurrences (features sharing a table share the table's width and offset).
__device__ __forceinline__ void locate_row(const BackwardArgs& a, int32_t bag, int64_t key, int* D, int64_t* woff) {
  const int64_t* ft = a.feat + (bag / a.B) * kFeatColumns;
  *D = int(ft[kFeatDim]);
  *woff = ft[kFeatWeightsOffset] + (key - ft[kFeatKeyBase]) * *D;
}

__device__ __forceinline__ const float* grad_row(const BackwardArgs& a, int32_t position, int32_t bag) {
  return a.pooling == kPoolNone ? a.grad_output + int64_t(position) * a.max_D
                                : a.grad_output + (bag % a.B) * a.total_D +
                                      a.feat[(bag / a.B) * kFeatColumns + kFeatOutOffset];
}

// One occurrence's metadata, held by one lane and broadcast to the warp with shuffles.
struct OccurrenceInfo {
  int32_t position = 0;
  int32_t bag = 0;
  float scale = 0.0f;

  __device__ __forceinline__ void fetch(const Occurrences& o, int64_t j, bool none_pooling) {
    bag = o.bag[j];
    scale = o.scale ? o.scale[j] : 1.0f;
    position = none_pooling ? o.position[j] : 0;
  }
  __device__ __forceinline__ OccurrenceInfo from_lane(int src) const {
    OccurrenceInfo r;
    r.position = __shfl_sync(kFullMask, position, src);
    r.bag = __shfl_sync(kFullMask, bag, src);
    r.scale = __shfl_sync(kFullMask, scale, src);
    return r;
  }
};

template <int kVecs>
__device__ __forceinline__ void add_gradient(const BackwardArgs& a, const OccurrenceInfo& occ, int D, int lane, float* g) {
  const float* go = grad_row(a, occ.position, occ.bag);
#pragma unroll
  for (int v = 0; v < kVecs; ++v) {
    const int d = v * 128 + 4 * lane;
    if (d < D) {
      float x[4];
      load4(go + d, x);
#pragma unroll
      for (int c = 0; c < 4; ++c) g[v * 4 + c] += occ.scale * x[c];
    }
  }
}

// Adds the scaled output-gradient rows of occurrences [first, first + n), n <= 32, in order: the
// lanes fetch the n occurrences' metadata at once, then the rows are loaded several at a time.
template <int kVecs>
__device__ __forceinline__ void add_chunk(const BackwardArgs& a, const Occurrences& o, int D, int lane, int64_t first,
                                          int n, float* g) {
  OccurrenceInfo mine;
  if (lane < n) mine.fetch(o, first + lane, a.pooling == kPoolNone);
#pragma unroll 4
  for (int k = 0; k < n; ++k) add_gradient<kVecs>(a, mine.from_lane(k), D, lane, g);
}

// Loads the row's weights and states into `row` (issued before the gradient is summed, so that
// both streams of loads are in flight together).
template <class Opt, typename W, class Row>
__device__ __forceinline__ void load_row(Row& row, const typename Opt::Params& p, const W* weights, int64_t key,
                                         int64_t woff) {
  constexpr int kVecs = Row::kN / 4;
#pragma unroll
  for (int v = 0; v < kVecs; ++v) {
    const int d = v * 128 + 4 * row.lane;
    if (d < row.D) {
      load_weights4(weights + woff + d, &row.w_[v * 4]);
#pragma unroll
      for (int k = 0; k < Opt::kElementStates; ++k) load4(p.element_states[k] + woff + d, &row.element_[k][v * 4]);
#pragma unroll
      for (int k = Opt::kElementStates; k < Opt::kElementStates + Opt::kTemporaries; ++k)
#pragma unroll
        for (int c = 0; c < 4; ++c) row.element_[k][v * 4 + c] = 0.0f;
    }
  }
#pragma unroll
  for (int k = 0; k < Opt::kRowStates; ++k) row.row_[k] = p.row_states[k][key];
}

// Applies the optimizer to a loaded row whose `g_` holds the summed gradient, and writes the
// weights and states back.
template <class Opt, typename W, class Row>
__device__ __forceinline__ void update_and_store(Row& row, const typename Opt::Params& p, const RowUpdateContext& ctx,
                                                 W* weights, int64_t key, int64_t woff) {
  constexpr int kVecs = Row::kN / 4;
  Opt::update_row(row, p, ctx.step);
#pragma unroll
  for (int v = 0; v < kVecs; ++v) {
    const int d = v * 128 + 4 * row.lane;
    if (d < row.D) {
      store_weights4(weights + woff + d, &row.w_[v * 4], ctx, key, d);
#pragma unroll
      for (int k = 0; k < Opt::kElementStates; ++k) store4(p.element_states[k] + woff + d, &row.element_[k][v * 4]);
    }
  }
  if (row.lane == 0) {
#pragma unroll
    for (int k = 0; k < Opt::kRowStates; ++k) p.row_states[k][key] = row.row_[k];
  }
}

template <class Opt, int kVecs>
using OptRow = WarpRow<kVecs, Opt::kElementStates + Opt::kTemporaries, Opt::kRowStates>;

// Short runs: one warp per unique row. A warp takes 32 consecutive runs at a time; each lane
// first fetches one run's description (length, start, key, and its first occurrence), so that a
// row seen once (the common case) costs one round trip to memory for its weights and gradient
// row, issued together. Occurrences are summed in sorted (= index) order.
template <class Opt, typename W, int kVecs>
__global__ void __launch_bounds__(256) backward_warp_kernel(BackwardArgs a, Runs r, Occurrences o, typename Opt::Params p,
                                                            RowUpdateContext ctx, W* weights) {
  if (a.error[0] != kErrNone) return;
  const int lane = threadIdx.x % kWarpSize;
  const int64_t warps = int64_t(gridDim.x) * blockDim.x / kWarpSize;
  const int64_t num_runs = *r.num_runs;
  const bool none_pooling = a.pooling == kPoolNone;
  for (int64_t group = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / kWarpSize * kWarpSize; group < num_runs;
       group += warps * kWarpSize) {
    int32_t my_len = 0, my_start = 0;
    int64_t my_key = 0;
    OccurrenceInfo my_first;
    if (group + lane < num_runs) {
      my_len = r.lengths[group + lane];
      my_start = r.starts[group + lane];
      my_key = r.keys[group + lane];
      my_first.fetch(o, my_start, none_pooling);
    }
    const int runs_here = num_runs - group < kWarpSize ? int(num_runs - group) : kWarpSize;
    for (int k = 0; k < runs_here; ++k) {
      const int32_t len = __shfl_sync(kFullMask, my_len, k);
      if (len >= r.max_segment_length_per_warp) continue;  // backward_block_kernel's
      const int32_t start = __shfl_sync(kFullMask, my_start, k);
      const int64_t key = __shfl_sync(kFullMask, my_key, k);
      const OccurrenceInfo first = my_first.from_lane(k);
      OptRow<Opt, kVecs> row;
      row.lane = lane;
      int64_t woff;
      locate_row(a, first.bag, key, &row.D, &woff);
      load_row<Opt, W>(row, p, weights, key, woff);
#pragma unroll
      for (int i = 0; i < row.kN; ++i) row.g_[i] = 0.0f;
      add_gradient<kVecs>(a, first, row.D, lane, row.g_);
      for (int32_t base = 1; base < len; base += kWarpSize) {
        const int n = len - base < kWarpSize ? len - base : kWarpSize;
        add_chunk<kVecs>(a, o, row.D, lane, start + base, n, row.g_);
      }
      update_and_store<Opt, W>(row, p, ctx, weights, key, woff);
    }
  }
}

// Warps per block of the hot-row kernel: 32 (the most a block has), fewer for wide rows so that
// its shared memory stays at 32 KiB.
template <int kVecs>
constexpr int block_kernel_warps() {
  return kVecs <= 2 ? 32 : 64 / kVecs;
}

// Long runs (hot rows): one block per unique row. The run's occurrences are cut into one
// contiguous slice per warp, of equal length (a run of 40 keeps 20 warps busy with 2 occurrences
// each, rather than one warp with 32), so a run takes about len / warps sequential loads. The
// partial sums meet in shared memory and warp 0 adds them in warp order (a fixed order, so the
// result is deterministic), then applies the optimizer. Warp 0 loads the row's weights and
// states before summing its own slice, so that load is off the critical path.
template <class Opt, typename W, int kVecs>
__global__ void __launch_bounds__(block_kernel_warps<kVecs>() * kWarpSize) backward_block_kernel(BackwardArgs a, Runs r, Occurrences o, typename Opt::Params p,
                                                              RowUpdateContext ctx, W* weights) {
  if (a.error[0] != kErrNone) return;
  extern __shared__ float partial[];  // [warps][kVecs * 128]
  constexpr int kWidth = kVecs * 128;
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int warps = blockDim.x / kWarpSize;
  const int32_t num_long = *r.num_long;
  for (int32_t k = blockIdx.x; k < num_long; k += gridDim.x) {
    const int64_t run = r.long_ids[k];
    const int64_t key = r.keys[run];
    const int64_t first = r.starts[run];
    const int32_t len = r.lengths[run];
    // warp w sums occurrences [w * per_warp, (w + 1) * per_warp) of the run; `used` warps have any
    const int32_t per_warp = (len + warps - 1) / warps;
    const int used = int((len + per_warp - 1) / per_warp);
    const int32_t lo = warp < used ? warp * per_warp : len;
    const int32_t hi = lo + per_warp < len ? lo + per_warp : len;
    OptRow<Opt, kVecs> row;
    row.lane = lane;
    int64_t woff;
    locate_row(a, o.bag[first], key, &row.D, &woff);
    if (warp == 0) load_row<Opt, W>(row, p, weights, key, woff);
#pragma unroll
    for (int i = 0; i < row.kN; ++i) row.g_[i] = 0.0f;
    for (int32_t base = lo; base < hi; base += kWarpSize) {
      const int n = hi - base < kWarpSize ? int(hi - base) : kWarpSize;
      add_chunk<kVecs>(a, o, row.D, lane, first + base, n, row.g_);
    }
    if (used > 1) {  // (uniform across the block, like every branch around a barrier here)
      if (warp > 0 && warp < used) {
#pragma unroll
        for (int v = 0; v < kVecs; ++v)
#pragma unroll
          for (int c = 0; c < 4; ++c) partial[warp * kWidth + v * 128 + 4 * lane + c] = row.g_[v * 4 + c];
      }
      __syncthreads();
      if (warp == 0) {
        for (int other = 1; other < used; ++other) {
#pragma unroll
          for (int v = 0; v < kVecs; ++v)
#pragma unroll
            for (int c = 0; c < 4; ++c) row.g_[v * 4 + c] += partial[other * kWidth + v * 128 + 4 * lane + c];
        }
      }
    }
    if (warp == 0) update_and_store<Opt, W>(row, p, ctx, weights, key, woff);
    __syncthreads();  // partial[] is reused by the next run
  }
}

// Predicate of the long-run selection: run i exists and has at least the threshold occurrences.
struct IsLongRun {
  const int32_t* lengths;
  const int32_t* num_runs;
  int32_t threshold;
  __device__ __forceinline__ bool operator()(int32_t i) const { return i < *num_runs && lengths[i] >= threshold; }
};

}  // namespace cuda
}  // namespace tbegen
