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

// The update kernels read and write each row's weights and states once per step; with kOnce their
// loads and stores take the streaming cache policy (ld/st.global.cs: evict first), so that the
// stream of rows (18 GB a step in C1 adagrad) does not push out of L2 the output-gradient rows,
// each of which is read once per occurrence (20 times a step in C1). ncu on C1 adagrad's update
// kernel (benchmarks/NOTES-gpu.md, run S) found 22 GB moved to or from DRAM for 18.6 GB of ideal bytes.
template <bool kOnce>
__device__ __forceinline__ void load4_row(const float* p, float* v) {
  const float4 x = kOnce ? __ldcs(reinterpret_cast<const float4*>(p)) : *reinterpret_cast<const float4*>(p);
  v[0] = x.x; v[1] = x.y; v[2] = x.z; v[3] = x.w;
}
template <bool kOnce>
__device__ __forceinline__ void store4_row(float* p, const float* v) {
  const float4 x = make_float4(v[0], v[1], v[2], v[3]);
  if (kOnce) {
    __stcs(reinterpret_cast<float4*>(p), x);
  } else {
    *reinterpret_cast<float4*>(p) = x;
  }
}

template <typename W, bool kOnce = false>
__device__ __forceinline__ void load_weights4(const W* p, float* v) {
  if constexpr (sizeof(W) == 4) {
    load4_row<kOnce>(reinterpret_cast<const float*>(p), v);
  } else {
    // four 16-bit values in one 8-byte load
    const uint2 raw = kOnce ? __ldcs(reinterpret_cast<const uint2*>(p)) : *reinterpret_cast<const uint2*>(p);
    const W* h = reinterpret_cast<const W*>(&raw);
#pragma unroll
    for (int c = 0; c < 4; ++c) v[c] = WeightTraits<W>::load(h[c]);
  }
}

template <typename W, bool kOnce = false>
__device__ __forceinline__ void store_weights4(W* p, const float* v, const RowUpdateContext& ctx,
                                               int64_t key, int d) {
  if constexpr (sizeof(W) == 4) {
    store4_row<kOnce>(reinterpret_cast<float*>(p), v);
  } else {
    uint2 raw;
    W* h = reinterpret_cast<W*>(&raw);
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const uint32_t bits = ctx.stochastic_rounding ? random_bits(ctx.seed, ctx.step, key, d + c) : 0u;
      h[c] = WeightTraits<W>::round(v[c], bits, ctx.stochastic_rounding);
    }
    if (kOnce) {
      __stcs(reinterpret_cast<uint2*>(p), raw);
    } else {
      *reinterpret_cast<uint2*>(p) = raw;
    }
  }
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = kWarpSize / 2; o > 0; o >>= 1) x += __shfl_xor_sync(kFullMask, x, o);
  return x;
}

// Records the first error of its kind a kernel finds (host.h describes the record): a bad index
// goes to the index slot, anything else to the fatal slot. The host reads the record when it
// likes; every kernel that writes weights or states checks it first (update_blocked).
__device__ __forceinline__ void record_error(int64_t* error, int64_t code, int64_t where, int64_t value) {
  int64_t* slot = error + (code == kErrIndexOutOfRange ? kErrIndexSlot : kErrFatalSlot);
  if (atomicCAS(reinterpret_cast<unsigned long long*>(slot), 0ull, static_cast<unsigned long long>(code)) == 0ull) {
    slot[1] = where;
    slot[2] = value;
  }
}

// ---- the row view the optimizer sees -----------------------------------------------------------

// One lane's share of a row: kVecs 4-wide slices of the gradient, the weights, each per-element
// state and temporary, all in registers (every index is a compile-time constant once the
// optimizer's loops are unrolled), plus a register copy of each per-row state.
template <int kVecs, int kElementSlots, int kRowSlots, int kIntRowSlots = 0, int kTableSlots = 0>
struct WarpRow : TableSlots<kTableSlots> {  // (the per-table states of the row's table, if any)
  static constexpr int kN = kVecs * 4;
  float g_[kN];
  float w_[kN];
  float element_[kElementSlots > 0 ? kElementSlots : 1][kN];
  float row_[kRowSlots > 0 ? kRowSlots : 1];
  int64_t int_row_[kIntRowSlots > 0 ? kIntRowSlots : 1];  // int per-row states (lane 0's are stored)
  int D;
  int lane;

  static constexpr __device__ int extent() { return kN; }
  __device__ __forceinline__ bool valid(int i) const { return (i >> 2) * 128 + 4 * lane < D; }
  __device__ __forceinline__ int dim() const { return D; }
  __device__ __forceinline__ float g(int i) const { return g_[i]; }
  __device__ __forceinline__ float& w(int i) { return w_[i]; }
  __device__ __forceinline__ float& element(int k, int i) { return element_[k][i]; }
  __device__ __forceinline__ float& row_state(int k) { return row_[k]; }
  __device__ __forceinline__ int64_t& int_row_state(int k) { return int_row_[k]; }
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

// A row held by a group of `lanes` lanes of the warp (a power of two; the groups are aligned, so
// lane l belongs to group l / lanes), for rows of at most 4 * lanes columns: `lane` is the lane's
// place in its group, and the reductions combine the group's lanes only. The butterfly is the
// whole warp's with the steps across groups left out; those steps add what the lanes past the
// row hold, the reductions' identity (0, -inf, +inf), so a row gets the bits the whole warp would
// give it (tests/test_cuda.py, test_lane_groups_give_the_whole_warp_bits). `lanes` is the same in
// every group of the warp at a time, so the shuffles stay convergent.
template <int kVecs, int kElementSlots, int kRowSlots, int kIntRowSlots = 0, int kTableSlots = 0>
struct GroupRow : WarpRow<kVecs, kElementSlots, kRowSlots, kIntRowSlots, kTableSlots> {
  int lanes;

  __device__ __forceinline__ float all_sum(float x) const {
#pragma unroll
    for (int o = kWarpSize / 2; o > 0; o >>= 1)
      if (o < lanes) x += __shfl_xor_sync(kFullMask, x, o);
    return x;
  }
  __device__ __forceinline__ float all_max(float x) const {
#pragma unroll
    for (int o = kWarpSize / 2; o > 0; o >>= 1)
      if (o < lanes) x = fmaxf(x, __shfl_xor_sync(kFullMask, x, o));
    return x;
  }
  __device__ __forceinline__ float all_min(float x) const {
#pragma unroll
    for (int o = kWarpSize / 2; o > 0; o >>= 1)
      if (o < lanes) x = fminf(x, __shfl_xor_sync(kFullMask, x, o));
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
  // a VBE batch (vbe.h): each bag's element offset in the 1-D output, -1 for a padding bag
  // (empty: nothing written); nullptr: bag b of feature f at out + b * total_D + f's column
  const int64_t* bag_out = nullptr;
  // a VBE batch read through its plan's padding index (Batch::pad, host.h): bag i's bounds are
  // offsets[pad[i]] and offsets[pad[i + 1]], pad values checked against the offsets' `pad_limit`
  // entries; nullptr: the offsets are the padded batch's
  const int64_t* pad = nullptr;
  int64_t pad_limit = 0;
};

// Where bag `bag` (bag b of the feature whose features-table row is ft) has its pooled row in the
// output, and its gradient row in the output gradient: bag_out[bag] in a VBE batch (-1 for a
// padding bag, which has no place), else row b at the feature's columns.
__device__ __forceinline__ int64_t bag_output_at(const ForwardArgs& a, int64_t bag, int64_t b, const int64_t* ft) {
  return a.bag_out != nullptr ? a.bag_out[bag] : b * a.total_D + ft[kFeatOutOffset];
}

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

// Bag `bag` = (feature f, sample b) of a batch read through its padding index (kPad): its bounds
// offsets[pad[bag]] and offsets[pad[bag + 1]], pad values outside the offsets (`pad_limit` entries)
// recorded as malformed offsets, each bag's start, end and errors those of bag_bounds over the
// padded offsets offsets[pad]. Read as pad[bag] and then the offsets, the offsets wait for the pad
// entries: one more dependent global load before each bag's indices (on an H100 the kPad forward
// took 6% longer than the padded batch's at ~400K bags; benchmarks/NOTES-gpu.md, "VBE: the padding
// index's cost in the kernels"). The plan's index (vbe.h, vbe_plan_entry) has pad[f * B + b] =
// first_f + min(b, B_f), with first_f = pad[f * B] and first_f + B_f = pad[(f + 1) * B]: two
// entries that every bag of the feature reads (from L1 after the first bag), so the offsets are
// read at the entries they predict while the bag's own pad entries are on their way; those are
// then compared, and where they differ (an index of another layout) the offsets read again at
// them. The same loaded values, hence the same start, end and errors, whatever the index holds:
// only the order of the loads changes. (The prediction in unsigned arithmetic and checked against
// pad_limit before it is used: an index of another layout may hold anything.)
template <typename I>
__device__ __forceinline__ bool pad_bag_bounds(const ForwardArgs& a, const I* offsets, int64_t bag, int64_t f,
                                               int64_t b, int64_t nbags, int64_t* start, int64_t* end) {
  const int64_t* __restrict__ pad = a.pad;
  const int64_t p0 = pad[bag], p1 = pad[bag + 1];                 // (the bag's)
  const int64_t first = pad[f * a.B], next = pad[(f + 1) * a.B];  // (the feature's: hot)
  const uint64_t count = uint64_t(next) - uint64_t(first);
  const uint64_t q0 = uint64_t(first) + min(uint64_t(b), count);
  const uint64_t q1 = uint64_t(first) + min(uint64_t(b) + 1, count);
  const bool predicted = q0 < uint64_t(a.pad_limit) && q1 < uint64_t(a.pad_limit);
  int64_t s = 0, e = 0;
  if (predicted) {
    s = offsets[q0];
    e = offsets[q1];
  }
  const bool in_range = p0 >= 0 && p1 >= 0 && p0 < a.pad_limit && p1 < a.pad_limit;
  if (in_range && !(predicted && uint64_t(p0) == q0 && uint64_t(p1) == q1)) {  // (not the plan's layout)
    s = offsets[p0];
    e = offsets[p1];
  }
  if (!in_range) s = e = 0;  // (a pad value outside the offsets: malformed, nothing read through it)
  *start = s;
  *end = e;
  const bool ok = in_range && s >= 0 && s <= e && e <= a.N && (bag != 0 || s == 0) &&
                  (bag != nbags - 1 || e == a.N);
  if (!ok) record_error(a.error, kErrBadOffsets, bag, 0);
  return ok;
}

// bag_bounds of the call's bag: with kPad through the padding index (ForwardArgs::pad, which the
// host launches the kPad instantiations for: TBEGEN_VBE_PAD_IN_KERNELS=1 or the module's CPU twin;
// pad_bag_bounds above), else exactly as above. A compile-time choice, so that the kernels without
// a padding index are the code they were (registers, spills, instructions). The caller's feature f
// and sample b of the bag (bag = f * B + b) where it has them; else worked out here as the
// kernels that read them after the bounds do (bag / a.B, bag % a.B: the same divisions, once).
template <bool kPad, typename I>
__device__ __forceinline__ bool bag_bounds(const ForwardArgs& a, const I* offsets, int64_t bag, int64_t f, int64_t b,
                                           int64_t nbags, int64_t* start, int64_t* end) {
  if constexpr (!kPad) {
    return bag_bounds(offsets, bag, nbags, a.N, a.error, start, end);
  } else {
    return pad_bag_bounds(a, offsets, bag, f, b, nbags, start, end);
  }
}
template <bool kPad, typename I>
__device__ __forceinline__ bool bag_bounds(const ForwardArgs& a, const I* offsets, int64_t bag, int64_t nbags,
                                           int64_t* start, int64_t* end) {
  if constexpr (!kPad) {
    return bag_bounds(offsets, bag, nbags, a.N, a.error, start, end);
  } else {
    return pad_bag_bounds(a, offsets, bag, bag / a.B, bag % a.B, nbags, start, end);
  }
}

// Lanes that cover a row of D columns in 4-wide slices (a power of two, all 32 from D = 128 up).
__host__ __device__ __forceinline__ int lanes_for_row(int D) {
  int lanes = 1;
  while (lanes < kWarpSize && 4 * lanes < D) lanes <<= 1;
  return lanes;
}

// Checks index i (of a table of `rows` < 2^31 rows, starting at element `base` of the weights) and
// returns its row number, or -1 after recording why.
__device__ __forceinline__ int32_t checked_row(int64_t idx, int64_t rows, int64_t base, int D,
                                               int64_t weights_numel, int64_t i, int64_t* error) {
  if (idx < 0 || idx >= rows) {
    record_error(error, kErrIndexOutOfRange, i, idx);
    return -1;
  }
  if (base + idx * D + D > weights_numel) {
    record_error(error, kErrRowOutsideWeights, i, idx);
    return -1;
  }
  return int32_t(idx);
}

// Adds one 4-wide slice of a row into an accumulator, scaled by its per-sample weight when the
// call has them (s * x + acc in one rounding; without weights, x + acc: the same bits as s = 1).
template <bool kWeighted>
__device__ __forceinline__ void accumulate4(float* acc, const float* x, float s) {
#pragma unroll
  for (int c = 0; c < 4; ++c) acc[c] = kWeighted ? fmaf(s, x[c], acc[c]) : acc[c] + x[c];
}

// Pooled lookup (sum or mean): one warp per bag, launched with a warp for every bag (no grid-stride
// loop: the blocks run in bag order, so the GPU works on neighbouring bags of one table at a time,
// which share hot rows in the caches). The bag's indices are read 32 at a time, one per lane, each
// lane checking its own, and the lanes pass each other 32-bit row numbers (the host takes this
// kernel only for tables of fewer than 2^31 rows, and batches have fewer than 2^31 indices and
// bags). A row of D >= 128 is spread over the whole warp (each lane holds kVecs 4-wide slices of
// the accumulator); a narrower row needs only lanes_for_row(D) lanes, so the warp splits into
// groups of that many lanes that each add every (32 / lanes)-th row of the bag, several rows'
// loads in flight at once, and the groups' sums are added at the end (a fixed order for a given
// D). kLaneGroups: some table is 64 columns wide or less (else, with kVecs = 1, a plainer loop).
// kWeighted: the call has per-sample weights (without them the loop passes one value per row, not
// two). Both are compile-time choices, made on the host per call. Measured against the
// grid-stride, 64-bit version it replaced: benchmarks/NOTES-gpu.md, run M.
// kChunked (kVecs = 8 only): some row is wider than kVectorMaxD, so rows are pooled in chunks of
// 1024 columns (below); a separate instantiation, since the chunk loop costs registers (92 against
// 80 per thread at kVecs = 8: two resident blocks per SM instead of three, the 1024-wide forward
// 17% slower on the H200, docs/gpu-runs/2026-12-04-probe6), which rows of up to 1024 columns keep.
template <typename W, typename I, int kVecs, bool kLaneGroups, bool kWeighted, bool kChunked = false,
          bool kPad = false>
__global__ void __launch_bounds__(256) forward_kernel(ForwardArgs a, const W* __restrict__ weights,
                                                      const I* __restrict__ indices,
                                                      const I* __restrict__ offsets) {
  const int lane = threadIdx.x % kWarpSize;
  const int nbags = int(a.F * a.B);
  const int bag = int((int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / kWarpSize);
  if (bag >= nbags) return;
  int64_t start64, end64;
  bool bounds_ok;
  if constexpr (kPad) {  // (f and b as below; unsigned: 40 registers at kVecs = 1 with lane groups, not 47)
    const unsigned f = unsigned(bag) / unsigned(a.B);
    bounds_ok = bag_bounds<kPad>(a, offsets, bag, f, unsigned(bag) - f * unsigned(a.B), nbags, &start64, &end64);
  } else {
    bounds_ok = bag_bounds<kPad>(a, offsets, bag, nbags, &start64, &end64);
  }
  // (a bag with bad offsets: its output is written as zeros)
  const int start = bounds_ok ? int(start64) : 0, end = bounds_ok ? int(end64) : 0;
  const int B = int(a.B);
  const int f = bag / B, b = bag - f * B;
  const int64_t* ft = a.feat + f * kFeatColumns;
  const int D = int(ft[kFeatDim]);
  const int64_t rows = ft[kFeatRows], base = ft[kFeatWeightsOffset];
  const W* table = weights + base;
  // (without lane groups a row spans the warp: no per-bag group arithmetic)
  const int group_lanes = (kLaneGroups || kVecs > 1) ? lanes_for_row(D) : kWarpSize;
  const int groups = kWarpSize / group_lanes;
  const int group = lane / group_lanes;
  const int d0 = 4 * (lane % group_lanes);  // this lane's first column (groups > 1: its only one)
  // Rows wider than a warp's kVecs * 128 columns (kVecs = 8 only: rows past kVectorMaxD, which
  // the host sends here for pooled lookups) are pooled one chunk of kChunk columns at a time,
  // each chunk a pass over the bag (its indices come again from L1); other rows take one pass.
  static_assert(!kChunked || kVecs == 8, "only the widest kernel pools in chunks");
  constexpr int kChunk = kVecs * 128;
  // (not kChunked: one pass, c0 = 0, the loop gone at compile time)
  for (int c0 = 0; c0 < (kChunked ? D : 1); c0 += kChunk) {
    const int Dc = !kChunked ? D : (D - c0 < kChunk ? D - c0 : kChunk);  // columns of this chunk
    float acc[kVecs][4];
#pragma unroll
    for (int v = 0; v < kVecs; ++v)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[v][c] = 0.0f;
    for (int i0 = start; i0 < end; i0 += kWarpSize) {
      // lane j checks index i0 + j and holds its row number (-1: skipped)
      const int my_i = i0 + lane;
      int32_t my_row = -1;
      float my_scale = 0.0f;
      if (my_i < end) {
        my_row = checked_row(int64_t(indices[my_i]), rows, base, D, a.weights_numel, my_i, a.error);
        if (kWeighted) my_scale = a.psw[my_i];
      }
      const int n = end - i0 < kWarpSize ? end - i0 : kWarpSize;
      if (kVecs == 1 && !kLaneGroups) {
        // every row 65 to 128 columns wide: one row at a time over the whole warp, four rows' loads
        // in flight (this plain loop measured 15% faster than the lane-group loop below on C2 with
        // D = 128: benchmarks/NOTES-gpu.md, run M)
        const int d = 4 * lane;
#pragma unroll 4
        for (int j = 0; j < n; ++j) {
          const int32_t r = __shfl_sync(kFullMask, my_row, j);
          const float s = kWeighted ? __shfl_sync(kFullMask, my_scale, j) : 1.0f;
          if (r >= 0 && d < D) {
            float x[4];
            load_weights4(table + int64_t(r) * D + d, x);
            accumulate4<kWeighted>(acc[0], x, s);
          }
        }
      } else if (kVecs == 1 || D <= 128) {
        // rows of up to 128 columns: a group of lanes per row, 32 / group_lanes rows at a time;
        // unrolled so that several rows' loads are in flight at once
        const int rounds = (n + groups - 1) / groups;
#pragma unroll 4
        for (int k = 0; k < rounds; ++k) {
          const int j = k * groups + group;
          const int src = j < n ? j : 0;
          const int32_t r = __shfl_sync(kFullMask, my_row, src);
          const float s = kWeighted ? __shfl_sync(kFullMask, my_scale, src) : 1.0f;
          if (j < n && r >= 0 && d0 < D) {
            float x[4];
            load_weights4(table + int64_t(r) * D + d0, x);
            accumulate4<kWeighted>(acc[0], x, s);
          }
        }
      } else {
        // wider rows: each row (chunk) over the whole warp, kVecs slices per lane
#pragma unroll 4
        for (int j = 0; j < n; ++j) {
          const int32_t r = __shfl_sync(kFullMask, my_row, j);
          const float s = kWeighted ? __shfl_sync(kFullMask, my_scale, j) : 1.0f;
          if (r < 0) continue;
          const W* row = table + int64_t(r) * D + c0;
#pragma unroll
          for (int v = 0; v < kVecs; ++v) {
            const int d = v * 128 + 4 * lane;
            if (d < Dc) {
              float x[4];
              load_weights4(row + d, x);
              accumulate4<kWeighted>(acc[v], x, s);
            }
          }
        }
      }
    }
    // the groups' partial sums, added across the warp (every group ends with the total)
    for (int o = group_lanes; o < kWarpSize; o <<= 1) {
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[0][c] += __shfl_xor_sync(kFullMask, acc[0][c], o);
    }
    // (the scale and the bag's output row, worked out here rather than before the loops: kept
    // live across them they cost 8 registers per thread at kVecs = 1)
    const float scale = (a.pooling == kPoolMean && end > start) ? 1.0f / float(end - start) : 1.0f;
    // (a VBE padding bag has no lookups and no place in the output: the warp leaves)
    const int64_t bag_at = bag_output_at(a, bag, b, ft);
    if (bag_at < 0) return;
    float* const o_bag = a.out + bag_at;
    if (groups > 1) {
      if (group == 0 && d0 < D) {
        float x[4];
#pragma unroll
        for (int c = 0; c < 4; ++c) x[c] = acc[0][c] * scale;
        store4(o_bag + d0, x);
      }
      return;
    }
    float* const o = o_bag + c0;
#pragma unroll
    for (int v = 0; v < kVecs; ++v) {
      const int d = v * 128 + 4 * lane;
      if (d < Dc) {
        float x[4];
#pragma unroll
        for (int c = 0; c < 4; ++c) x[c] = acc[v][c] * scale;
        store4(o + d, x);
      }
    }
  }
}

// Pooled lookup of narrow rows, a bag per group of lanes: when no row of the batch is wider than
// 64 columns (4 * lanes, lanes = lanes_for_row(max_D) <= 16), each warp pools 32 / lanes bags at
// once, one per group of `lanes` lanes, each lane one 4-wide slice of its group's rows. The
// warp-per-bag forward_kernel gives such a bag the whole warp and adds its groups' partial sums
// at the end: per bag it pays the warp's setup and a cross-group reduction that cost more than the
// few rows of a narrow bag (sweep probe6: D = 8-64 forward 0.63-0.85x FBGEMM's). A group reads its
// bag's indices `lanes` at a time (each lane checks one), passes the row numbers round its lanes
// (shuffles within the group: its lanes run the same bag, so the same iterations), and adds the
// rows in index order. Chosen on the host (forward_cuda) unless TBEGEN_FORWARD_BAG_GROUPS=0.
template <typename W, typename I, bool kWeighted, bool kPad = false>
__global__ void __launch_bounds__(256) forward_bag_groups_kernel(ForwardArgs a, const W* __restrict__ weights,
                                                                 const I* __restrict__ indices,
                                                                 const I* __restrict__ offsets, int lanes) {
  const int lane = threadIdx.x % kWarpSize;
  const int group = lane / lanes, sub = lane % lanes;
  const int64_t warp = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / kWarpSize;
  const int64_t nbags = a.F * a.B;
  const int64_t bag = warp * (kWarpSize / lanes) + group;
  if (bag >= nbags) return;  // (a whole group: its lanes share the bag)
  const unsigned mask = lanes == kWarpSize ? kFullMask : ((1u << lanes) - 1u) << (group * lanes);
  int64_t start64, end64;
  bool bounds_ok;
  if constexpr (kPad) {  // (f and b as below)
    const unsigned f = unsigned(bag) / unsigned(a.B);
    bounds_ok = bag_bounds<kPad>(a, offsets, bag, f, unsigned(bag) - f * unsigned(a.B), nbags, &start64, &end64);
  } else {
    bounds_ok = bag_bounds<kPad>(a, offsets, bag, nbags, &start64, &end64);
  }
  // (a bag with bad offsets: its output is written as zeros)
  const int start = bounds_ok ? int(start64) : 0, end = bounds_ok ? int(end64) : 0;
  const int B = int(a.B);
  const int f = int(bag) / B, b = int(bag) - f * B;
  const int64_t* ft = a.feat + f * kFeatColumns;
  const int D = int(ft[kFeatDim]);
  const int64_t rows = ft[kFeatRows], base = ft[kFeatWeightsOffset];
  const W* table = weights + base;
  const int d = 4 * sub;  // this lane's first column
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (int i0 = start; i0 < end; i0 += lanes) {
    // lane `sub` checks index i0 + sub and holds its row number (-1: skipped)
    const int my_i = i0 + sub;
    int32_t my_row = -1;
    float my_scale = 0.0f;
    if (my_i < end) {
      my_row = checked_row(int64_t(indices[my_i]), rows, base, D, a.weights_numel, my_i, a.error);
      if (kWeighted) my_scale = a.psw[my_i];
    }
    const int n = end - i0 < lanes ? end - i0 : lanes;
#pragma unroll 4
    for (int j = 0; j < n; ++j) {
      const int32_t r = __shfl_sync(mask, my_row, j, lanes);
      const float s = kWeighted ? __shfl_sync(mask, my_scale, j, lanes) : 1.0f;
      if (r >= 0 && d < D) {
        float x[4];
        load_weights4(table + int64_t(r) * D + d, x);
        accumulate4<kWeighted>(acc, x, s);
      }
    }
  }
  // (a VBE padding bag, bag_out < 0, has no lookups and no place in the output)
  const int64_t bag_at = bag_output_at(a, bag, b, ft);
  if (d < D && bag_at >= 0) {
    const float scale = (a.pooling == kPoolMean && end > start) ? 1.0f / float(end - start) : 1.0f;
    float x[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) x[c] = acc[c] * scale;
    store4(a.out + bag_at + d, x);
  }
}

// Lookup without pooling (pooling none): output row i is row indices[i] scaled by its per-sample
// weight (zeros for a bad index). One warp per bag, each row spread over the warp in 4-wide slices.
template <typename W, typename I, int kVecs>
__global__ void __launch_bounds__(256) forward_rows_kernel(ForwardArgs a, const W* __restrict__ weights,
                                                           const I* __restrict__ indices,
                                                           const I* __restrict__ offsets) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t nbags = a.F * a.B;
  const int64_t warps = int64_t(gridDim.x) * blockDim.x / kWarpSize;
  for (int64_t bag = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / kWarpSize; bag < nbags; bag += warps) {
    int64_t start, end;
    if (!bag_bounds(offsets, bag, nbags, a.N, a.error, &start, &end)) continue;  // (pooling none: never padded)
    const int64_t* ft = a.feat + (bag / a.B) * kFeatColumns;
    const int D = int(ft[kFeatDim]);
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
      for (int j = 0; j < n; ++j) {
        const int64_t off = __shfl_sync(kFullMask, my_off, j);
        const float s = __shfl_sync(kFullMask, my_scale, j);
        if (off < 0) continue;
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
      }
    }
  }
}

// d loss / d per_sample_weights[i]: one warp per bag, a warp-wide dot product per index.
template <typename W, typename I, int kVecs, bool kPad = false>
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
      const int64_t off = row_offset(ft, int64_t(indices[i]), i, a.weights_numel, a.error);
      if (off < 0) continue;
      const float* go = grad_output + (a.pooling == kPoolNone ? i * a.max_D : bag_output_at(a, bag, b, ft));
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

// Step 1 of the backward: writes, for each index, the linear key (table's first key + row; a bad
// index gets `total_hash_size`, past every row, and is skipped) and the value sorted with it: the
// bag itself when that is all the update needs (sum/mean pooling without per-sample weights), else
// the index's position, with its bag and gradient scale (per-sample weight, divided by the bag
// length for mean pooling) beside. A warp takes 32 bags at a time (one per lane, which checks its
// offsets) and walks their indices 32 at a time, so every read and write is contiguous; each lane
// finds its index's bag by a binary search over the lanes' bag starts. With `spread` > 1 (a power
// of two dividing the warps of a block; TBEGEN_LINEARIZE_SPREAD, linearize_spread) that many warps
// share each group of 32 bags, warp p of them taking the group's 32-index blocks p, p + spread,
// ...: for batches of few, long bags (T=8 B=4096 L=80: 1024 groups of 2560 indices, 8 warps per
// multiprocessor of the H200) more warps in flight; every index is written as with one warp.
// It also zeroes `zero_count` int32 words at `zero` (the update kernels' ticket counters, which
// run after it on the same stream: one cudaMemsetAsync fewer per backward, issue 29) and
// `zero2_count` at `zero2` (with TBEGEN_SORT_NO_MEMSETS=1 the sort's counters, histograms and
// look-back flags: cuda_sort.cuh, OnesweepSort), whatever the offsets say (before the loop, which
// skips malformed bags).
template <typename I, typename K, bool kPad = false>
__global__ void __launch_bounds__(256) linearize_kernel(ForwardArgs a, const I* __restrict__ indices,
                                                        const I* __restrict__ offsets,
                                                        int64_t total_hash_size, bool check_finite, K* keys,
                                                        int32_t* values, int32_t* bag_of, float* scale_of,
                                                        int spread, int32_t* zero, int64_t zero_count,
                                                        int32_t* zero2, int64_t zero2_count) {
  for (int64_t j = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; j < zero_count; j += int64_t(gridDim.x) * blockDim.x) {
    zero[j] = 0;
  }
  for (int64_t j = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; j < zero2_count; j += int64_t(gridDim.x) * blockDim.x) {
    zero2[j] = 0;
  }
  const int lane = threadIdx.x % kWarpSize;
  const int64_t nbags = a.F * a.B;
  const int64_t warp = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / kWarpSize;
  const int64_t groups_at_once = int64_t(gridDim.x) * blockDim.x / kWarpSize / spread;
  const int part = int(warp % spread);
  for (int64_t bag0 = warp / spread * kWarpSize; bag0 < nbags; bag0 += groups_at_once * kWarpSize) {
    const int64_t my_bag = bag0 + lane;
    int64_t start = a.N, end = a.N;  // (lanes past the last bag: empty, after every index)
    bool ok = true;
    int64_t my_f = 0;  // (kPad: the bag's feature, found once for its bounds and my_feature)
    if constexpr (kPad) {
      if (my_bag < nbags) {
        my_f = my_bag / a.B;
        ok = bag_bounds<kPad>(a, offsets, my_bag, my_f, my_bag - my_f * a.B, nbags, &start, &end);
      }
    } else {
      if (my_bag < nbags) ok = bag_bounds<kPad>(a, offsets, my_bag, nbags, &start, &end);
    }
    // malformed offsets are a fatal error (nothing will be updated): leave these bags alone
    if (__any_sync(kFullMask, !ok)) continue;
    const float my_inv_len = (a.pooling == kPoolMean && end > start) ? 1.0f / float(end - start) : 1.0f;
    const int32_t my_feature = my_bag < nbags ? int32_t(kPad ? my_f : my_bag / a.B) : 0;  // (once per bag, not per index)
    const int64_t first = __shfl_sync(kFullMask, start, 0);
    const int64_t last = __shfl_sync(kFullMask, end, kWarpSize - 1);
    for (int64_t base = first + int64_t(part) * kWarpSize; base < last; base += int64_t(spread) * kWarpSize) {
      const int64_t i = base + lane;
      // the bag of index i: the last lane whose bag starts at or before i
      int l = 0;
#pragma unroll
      for (int step = kWarpSize / 2; step > 0; step >>= 1) {
        if (__shfl_sync(kFullMask, start, l + step) <= i) l += step;
      }
      const float inv_len = __shfl_sync(kFullMask, my_inv_len, l);
      const int32_t feature = __shfl_sync(kFullMask, my_feature, l);
      if (i >= last) continue;
      const int64_t bag = bag0 + l;
      const int64_t* ft = a.feat + int64_t(feature) * kFeatColumns;
      const int64_t idx = indices[i];
      int64_t key = total_hash_size;
      if (row_offset(ft, idx, i, a.weights_numel, a.error) >= 0) {
        key = ft[kFeatKeyBase] + idx;
        if (key >= total_hash_size) {
          record_error(a.error, kErrRowOutsideWeights, i, idx);
          key = total_hash_size;
        }
      }
      keys[i] = K(key);
      if (bag_of == nullptr) {
        values[i] = int32_t(bag);
      } else {
        values[i] = int32_t(i);
        bag_of[i] = int32_t(bag);
      }
      if (a.psw && check_finite && !isfinite(a.psw[i])) record_error(a.error, kErrNonFinitePerSampleWeight, i, 0);
      if (scale_of) scale_of[i] = (a.psw ? a.psw[i] : 1.0f) * inv_len;
    }
  }
}

// NaN/Inf anywhere in x (the output gradient) is a fatal error: nothing is updated.
static __global__ void __launch_bounds__(256) check_finite_kernel(int64_t n, const float* __restrict__ x,
                                                                   int64_t* error) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t n4 = (reinterpret_cast<uintptr_t>(x) % 16 == 0) ? n / 4 : 0;
  for (int64_t j = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; j < n4; j += stride) {
    const float4 v = reinterpret_cast<const float4*>(x)[j];
    if (!(isfinite(v.x) && isfinite(v.y) && isfinite(v.z) && isfinite(v.w))) {
      const int c = !isfinite(v.x) ? 0 : !isfinite(v.y) ? 1 : !isfinite(v.z) ? 2 : 3;
      record_error(error, kErrNonFiniteGradient, 4 * j + c, 0);
    }
  }
  for (int64_t j = 4 * n4 + int64_t(blockIdx.x) * blockDim.x + threadIdx.x; j < n; j += stride) {
    if (!isfinite(x[j])) record_error(error, kErrNonFiniteGradient, j, 0);
  }
}

// Segments of long runs: a run of at least max_segment_length_per_warp occurrences is cut into
// segments of Runs::segment_length occurrences (kSegmentLength unless the host chose another:
// cuda_ops.cuh, segment_length(...)); each segment is summed by one warp, and a run of several
// segments is finished by one more warp that adds the segments' partial sums in segment order (so
// the result does not depend on which warp ran first) and updates the row.
constexpr int32_t kSegmentLength = 256;

// The sorted view of a batch that the update kernels walk: run r (one per unique key) covers
// sorted positions [starts[r], starts[r + 1]) (the last one ends at n).
struct Runs {
  const void* keys;         // sorted keys, int32 or int64 (wide_keys)
  bool wide_keys;
  const int32_t* starts;    // first sorted position of each run
  const int32_t* counts;    // device: [number of runs, number of long runs]
  const int32_t* long_ids;  // the long runs, in key order
  const int2* segments;     // per long run: first segment, first partial-sum slot (exclusive scan)
  int32_t n;                // occurrences
  int32_t max_segment_length_per_warp;
  int32_t segment_length = kSegmentLength;  // occurrences per segment of a long run (the last may be shorter)
  int64_t skipped_key;      // the key of skipped bad indices (total_hash_size)

  __device__ __forceinline__ int64_t key_at(int64_t j) const {
    return wide_keys ? static_cast<const int64_t*>(keys)[j] : int64_t(static_cast<const int32_t*>(keys)[j]);
  }
  __device__ __forceinline__ int32_t end_of(int64_t run, int32_t num_runs) const {
    return run + 1 < num_runs ? starts[run + 1] : n;
  }
};

// The any-width update's work in one list (TBEGEN_ANY_WIDTH_ITEMS=1; prepare_backward's step 4):
// every short run one item, every long run its segments, in key order, so that one kernel's warps
// sum one band of the sorted batch instead of two kernels' two bands in different tables.
struct WorkItems {
  const int32_t* start = nullptr;    // item i covers sorted positions [start[i], start[i + 1])
  const int32_t* partial = nullptr;  // a segment of a run of several: its partial-sum slot; else -1
  const int32_t* total = nullptr;    // device: the number of items (nullptr: no list was made)
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
  FastDivisor by_B;  // bag -> feature (bag / B) without a division
  // The update kernels read `pooling` only to find output-gradient rows (grad_row; mean pooling's
  // 1 / L is in Occurrences::scale): kPoolNone means that occurrence j's row is at grad_output +
  // position[j] * position_stride (max_D). A VBE batch with TBEGEN_VBE_GRAD_OFFSETS=1 (issue 25)
  // goes that way too, with position_stride 1 and Occurrences::position each occurrence's
  // bag_out[bag], gathered once after the sort (prepare_backward, step 3c), so that the kernels
  // fetch it with the bag instead of reading bag_out at random per occurrence between the bag and
  // the row; the default kernels' code is unchanged (the switch is a host-side choice).
  int64_t pooling;
  int64_t position_stride = 0;
  const float* grad_output;
  // a VBE batch (vbe.h): bag b's output-gradient row at grad_output + bag_out[b]; else nullptr
  const int64_t* bag_out = nullptr;
  const int64_t* error;
  bool skip_bad_indices;  // else a bad index anywhere in the batch blocks every update
  // Width classes (backward_cuda): when a batch mixes rows of several 4-wide slice counts, the
  // short runs are updated by one launch per class, each taking the runs whose rows are wider
  // than short_min_D columns and at most its kVecs * 128 (short_run_fits); else one launch takes
  // them all.
  bool split_widths = false;
  int32_t short_min_D = 0;
  // Whether the segment kernel loads output-gradient rows with the evict-last L2 hint, as the
  // short-run kernels do (load4_keep), or plainly (load4): TBEGEN_LONG_RUN_L2_HINT=1 / the default.
  // ncu of C2's segment kernel (run Z) found 39% L2 hits with the hint; the landing run times both.
  bool long_run_l2_hint = false;
  // Whether the long runs' kernels sum rows of at most 32 columns with the warp's four groups of 8
  // lanes loading other occurrences' rows (add_chunk_batched_narrow, add_partials_narrow: 32 rows
  // in flight instead of 8, the sum in the same order) or with lanes 0-7 alone, the default
  // (TBEGEN_SEGMENT_LANE_GROUPS=1 / unset or 0; the same bits either way).
  bool segment_lane_groups = false;
  // Whether every output-gradient row, and every scratch and partial row of max_D floats, starts
  // on a 16-byte boundary and spans a multiple of 4 columns, whatever the widths: the any-width
  // kernels then sum occurrences 4 columns at a time (any_width::add_occurrences).
  bool float_rows_4wide = false;
  // The short-run launch's ticket counter, zero at launch (backward_cuda): the warps take the
  // groups of 32 runs in order, one ticket each (take_group), so that the rows updated at any
  // moment are neighbours in key order, one table's or two, whose output-gradient rows (read once
  // per occurrence, 20 times a step in C1) stay in L2; and a warp that finishes early takes the
  // next group instead of idling at the end. A grid stride did neither: its blocks of later waves
  // started at the first runs while earlier ones were tables further on (benchmarks/NOTES-gpu.md,
  // run AD: the backward 5-10% faster on C1, 2-6% on C2 and C3).
  int32_t* ticket = nullptr;
  // The same for the long runs' segments (backward_segment_kernel; run AE: C2's backward 3-10%
  // faster than its one resident wave striding over the segments).
  int32_t* segment_ticket = nullptr;
};

// Lane 0 asks `ticket` for this warp's next ticket (the other lanes get 0; the warp learns it
// from lane 0 with a shuffle, which waits for the atomic's answer: a kernel that asks early and
// shuffles late hides that round trip).
__device__ __forceinline__ int32_t ask_ticket(int32_t* ticket, int lane) { return lane == 0 ? atomicAdd(ticket, 1) : 0; }

// The first run of this warp's next group of 32 runs (num_runs or beyond: none left).
__device__ __forceinline__ int64_t take_group(int32_t* ticket, int lane) {
  return int64_t(__shfl_sync(kFullMask, ask_ticket(ticket, lane), 0)) * kWarpSize;
}

// The width of the row of the run whose first occurrence is in `bag`.
__device__ __forceinline__ int run_width(const BackwardArgs& a, int32_t bag) {
  return int(a.feat[a.by_B.quotient(bag) * kFeatColumns + kFeatDim]);
}

// Whether a short-run kernel with kVecs slices per lane takes a row of D columns.
template <int kVecs>
__device__ __forceinline__ bool short_run_fits(const BackwardArgs& a, int D) {
  return !a.split_widths || (D > a.short_min_D && D <= kVecs * 128);
}

// Whether the error record forbids writing weights and states.
__device__ __forceinline__ bool update_blocked(const BackwardArgs& a) {
  return a.error[kErrFatalSlot] != kErrNone || (!a.skip_bad_indices && a.error[kErrIndexSlot] != kErrNone);
}

// Where a run's row lives: its width and offset in the weights buffer, from the bag of any of its
// occurrences (features sharing a table share the table's width and offset).
__device__ __forceinline__ void locate_row(const BackwardArgs& a, int32_t bag, int64_t key, int* D, int64_t* woff) {
  const int64_t* ft = a.feat + a.by_B.quotient(bag) * kFeatColumns;
  *D = int(ft[kFeatDim]);
  *woff = ft[kFeatWeightsOffset] + (key - ft[kFeatKeyBase]) * *D;
}

__device__ __forceinline__ const float* grad_row(const BackwardArgs& a, int32_t position, int32_t bag) {
  if (a.pooling == kPoolNone) return a.grad_output + int64_t(position) * a.position_stride;
  if (a.bag_out != nullptr) return a.grad_output + a.bag_out[bag];  // (a bag with occurrences is no padding)
  const int32_t f = a.by_B.quotient(bag);
  return a.grad_output + int64_t(bag - f * int32_t(a.B)) * a.total_D + a.feat[f * kFeatColumns + kFeatOutOffset];
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

// An output-gradient load that asks L2 to keep the line (evict last): a gradient row is read once
// per occurrence, 20 times a step in C1, while the rows' weights and states stream past
// (benchmarks/NOTES-gpu.md, run U: 1-2% off C1's backward beside the same code without the hint).
__device__ __forceinline__ void load4_keep(const float* p, float* v) {
  uint64_t policy;
  asm("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
  float4 x;
  asm("ld.global.L2::cache_hint.v4.f32 {%0, %1, %2, %3}, [%4], %5;"
      : "=f"(x.x), "=f"(x.y), "=f"(x.z), "=f"(x.w)
      : "l"(p), "l"(policy));
  v[0] = x.x; v[1] = x.y; v[2] = x.z; v[3] = x.w;
}

template <int kVecs>
__device__ __forceinline__ void add_gradient(const BackwardArgs& a, const OccurrenceInfo& occ, int D, int lane, float* g) {
  const float* go = grad_row(a, occ.position, occ.bag);
#pragma unroll
  for (int v = 0; v < kVecs; ++v) {
    const int d = v * 128 + 4 * lane;
    if (d < D) {
      float x[4];
      load4_keep(go + d, x);
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

// add_chunk for the long runs' segment kernel, which does nothing but sum rows and is
// latency-bound (ncu of C2's segment kernel, run Y: 74% of its stalls wait for loads): the rows
// are loaded kAhead at a time, all of a batch's loads issued before the first is added. The sum is
// taken in occurrence order, one row after another, as add_chunk takes it: the same bits. (Not
// for the short runs' kernels: the batch's registers would cost them occupancy.)
template <int kVecs>
__device__ __forceinline__ void add_chunk_batched(const BackwardArgs& a, const Occurrences& o, int D, int lane,
                                                  int64_t first, int n, float* g) {
  constexpr int kAhead = kVecs == 1 ? 8 : kVecs == 2 ? 4 : 2;  // (32 registers of rows in flight)
  // lane l finds occurrence l's output-gradient row and scale, so that a batch needs only shuffles
  const float* my_row = a.grad_output;
  float my_scale = 0.0f;
  if (lane < n) {
    OccurrenceInfo mine;
    mine.fetch(o, first + lane, a.pooling == kPoolNone);
    my_row = grad_row(a, mine.position, mine.bag);
    my_scale = mine.scale;
  }
#pragma unroll 1
  for (int k0 = 0; k0 < n; k0 += kAhead) {
    float x[kAhead][kVecs * 4];
    float scale[kAhead];
#pragma unroll
    for (int j = 0; j < kAhead; ++j) {
      // (every lane shuffles, for occurrences past n too: their values are not used)
      const int src = (k0 + j) & (kWarpSize - 1);
      scale[j] = __shfl_sync(kFullMask, my_scale, src);
      const float* go = reinterpret_cast<const float*>(
          __shfl_sync(kFullMask, reinterpret_cast<unsigned long long>(my_row), src));
#pragma unroll
      for (int v = 0; v < kVecs; ++v) {
        const int d = v * 128 + 4 * lane;
        if (k0 + j < n && d < D) {
          if (a.long_run_l2_hint) {
            load4_keep(go + d, &x[j][v * 4]);
          } else {
            load4(go + d, &x[j][v * 4]);
          }
        }
      }
    }
#pragma unroll
    for (int j = 0; j < kAhead; ++j) {
      if (k0 + j < n) {
#pragma unroll
        for (int v = 0; v < kVecs; ++v) {
          if (v * 128 + 4 * lane < D) {
#pragma unroll
            for (int c = 0; c < 4; ++c) g[v * 4 + c] += scale[j] * x[j][v * 4 + c];
          }
        }
      }
    }
  }
}

// add_chunk_batched for rows of at most 32 columns (kVecs = 1; BackwardArgs::segment_lane_groups):
// there only lanes 0-7 hold columns, so add_chunk_batched keeps 24 lanes idle and 8 rows in flight.
// Here lane 8h + c loads columns 4c..4c+3 of occurrence 4i + h for i = 0..7, 32 rows in flight, and
// lanes 0-7 (those whose columns are below D, as in add_chunk_batched) add occurrence 4i + h's
// columns, shuffled from lane 8h + c, in occurrence order: the same products added in the same
// order, so the same bits.
__device__ __forceinline__ void add_chunk_batched_narrow(const BackwardArgs& a, const Occurrences& o, int D, int lane,
                                                         int64_t first, int n, float* g) {
  constexpr int kGroups = 4, kSteps = kWarpSize / kGroups;  // (n <= 32 = kGroups x kSteps: one batch)
  const int group = lane / 8, column = lane % 8;
  const float* my_row = a.grad_output;
  float my_scale = 0.0f;
  if (lane < n) {
    OccurrenceInfo mine;
    mine.fetch(o, first + lane, a.pooling == kPoolNone);
    my_row = grad_row(a, mine.position, mine.bag);
    my_scale = mine.scale;
  }
  float x[kSteps][4];
#pragma unroll
  for (int i = 0; i < kSteps; ++i) {
    const int k = i * kGroups + group;  // this lane's occurrence at step i
    const float* go = reinterpret_cast<const float*>(
        __shfl_sync(kFullMask, reinterpret_cast<unsigned long long>(my_row), k));
#pragma unroll
    for (int c = 0; c < 4; ++c) x[i][c] = 0.0f;
    if (k < n && 4 * column < D) {
      if (a.long_run_l2_hint) {
        load4_keep(go + 4 * column, x[i]);
      } else {
        load4(go + 4 * column, x[i]);
      }
    }
  }
#pragma unroll
  for (int i = 0; i < kSteps; ++i) {
#pragma unroll
    for (int h = 0; h < kGroups; ++h) {
      const int k = i * kGroups + h;
      const float s = __shfl_sync(kFullMask, my_scale, k);
      float y[4];
#pragma unroll
      for (int c = 0; c < 4; ++c) y[c] = __shfl_sync(kFullMask, x[i][c], h * 8 + column);
      if (k < n && 4 * lane < D) {
#pragma unroll
        for (int c = 0; c < 4; ++c) g[c] += s * y[c];
      }
    }
  }
}

// The finish kernel's sum of a run's nseg partial sums (each `width` floats apart) for rows of at
// most 32 columns (kVecs = 1; BackwardArgs::segment_lane_groups): lane 8h + c loads partial 4i + h's
// columns 4c..4c+3, 16 partials in flight, and lanes 0-7 add them in segment order from shuffles, as
// the default loop adds them: the same bits.
__device__ __forceinline__ void add_partials_narrow(const float* in, int32_t nseg, int64_t width, int D, int lane,
                                                    float* g) {
  constexpr int kGroups = 4, kSteps = 4;
  const int group = lane / 8, column = lane % 8;
  for (int32_t j0 = 0; j0 < nseg; j0 += kGroups * kSteps) {
    float x[kSteps][4];
#pragma unroll
    for (int i = 0; i < kSteps; ++i) {
      const int32_t j = j0 + i * kGroups + group;
#pragma unroll
      for (int c = 0; c < 4; ++c) x[i][c] = 0.0f;
      if (j < nseg && 4 * column < D) load4(in + int64_t(j) * width + 4 * column, x[i]);
    }
#pragma unroll
    for (int i = 0; i < kSteps; ++i) {
#pragma unroll
      for (int h = 0; h < kGroups; ++h) {
        float y[4];
#pragma unroll
        for (int c = 0; c < 4; ++c) y[c] = __shfl_sync(kFullMask, x[i][c], h * 8 + column);
        if (j0 + i * kGroups + h < nseg && 4 * lane < D) {
#pragma unroll
          for (int c = 0; c < 4; ++c) g[c] += y[c];
        }
      }
    }
  }
}

// Loads the row's weights and states into `row` (issued before the gradient is summed, so that
// both streams of loads are in flight together). The 4-wide kernels take float32 states only
// (the host sends a module with a float16/bfloat16 state to the any-width kernels,
// BackwardKernels::vector_states_fit): a run-time choice of state dtype here raised every
// kernel's register count and made the float32 kernels spill (benchmarks/NOTES-gpu.md, run J).
// kOnce (load4_row): the streaming (evict-first) policy for the row's weights and states, the
// default; the group kernel's TBEGEN_GROUP_ROWS_CACHED variant loads and stores them plainly.
template <class Opt, typename W, bool kOnce = true, class Row>
__device__ __forceinline__ void load_row(Row& row, const typename Opt::Params& p, const W* weights, int64_t key,
                                         int64_t woff) {
  constexpr int kVecs = Row::kN / 4;
#pragma unroll
  for (int v = 0; v < kVecs; ++v) {
    const int d = v * 128 + 4 * row.lane;
    if (d < row.D) {
      load_weights4<W, kOnce>(weights + woff + d, &row.w_[v * 4]);
#pragma unroll
      for (int k = 0; k < Opt::kElementStates; ++k) load4_row<kOnce>(p.element_states[k] + woff + d, &row.element_[k][v * 4]);
#pragma unroll
      for (int k = Opt::kElementStates; k < Opt::kElementStates + Opt::kTemporaries; ++k)
#pragma unroll
        for (int c = 0; c < 4; ++c) row.element_[k][v * 4 + c] = 0.0f;
    }
  }
#pragma unroll
  for (int k = 0; k < Opt::kRowStates; ++k) row.row_[k] = kOnce ? __ldcs(p.row_states[k] + key) : p.row_states[k][key];  // (streaming, as the rows)
#pragma unroll
  for (int k = 0; k < Opt::kIntRowStates; ++k) row.int_row_[k] = p.int_row_states[k][key];
}

// Writes an updated row's weights and states back.
// (kOnce: as load_row's.)
template <class Opt, typename W, bool kOnce = true, class Row>
__device__ __forceinline__ void store_row(Row& row, const typename Opt::Params& p, const RowUpdateContext& ctx,
                                          W* weights, int64_t key, int64_t woff) {
  constexpr int kVecs = Row::kN / 4;
#pragma unroll
  for (int v = 0; v < kVecs; ++v) {
    const int d = v * 128 + 4 * row.lane;
    if (d < row.D) {
      store_weights4<W, kOnce>(weights + woff + d, &row.w_[v * 4], ctx, key, d);
#pragma unroll
      for (int k = 0; k < Opt::kElementStates; ++k) store4_row<kOnce>(p.element_states[k] + woff + d, &row.element_[k][v * 4]);
    }
  }
  if (row.lane == 0) {
#pragma unroll
    for (int k = 0; k < Opt::kRowStates; ++k) {
      if (kOnce) {
        __stcs(p.row_states[k] + key, row.row_[k]);
      } else {
        p.row_states[k][key] = row.row_[k];
      }
    }
#pragma unroll
    for (int k = 0; k < Opt::kIntRowStates; ++k) p.int_row_states[k][key] = row.int_row_[k];
  }
}

// Applies the optimizer to a loaded row whose `g_` holds the summed gradient, and writes the
// weights and states back.
template <class Opt, typename W, class Row>
__device__ __forceinline__ void update_and_store(Row& row, const typename Opt::Params& p, const RowUpdateContext& ctx,
                                                 const typename Opt::StepValues& sv, W* weights, int64_t key,
                                                 int64_t woff) {
  Opt::update_row(row, p, sv);
  store_row<Opt, W>(row, p, ctx, weights, key, woff);
}

template <class Opt, int kVecs>
using OptRow = WarpRow<kVecs, Opt::kElementStates + Opt::kTemporaries, Opt::kRowStates, Opt::kIntRowStates,
                       Opt::kTableStates>;

// One short run's row as the warp kernel holds it: the row view, where it lives, and the run.
template <class Opt, int kVecs>
struct ShortRun {
  OptRow<Opt, kVecs> row;
  int64_t key;
  int64_t woff;
  int32_t start;
  int32_t len;
  OccurrenceInfo first;
};

// Short runs: one warp per unique row. A warp takes 32 consecutive runs at a time (the next
// group by ticket, BackwardArgs::ticket); each lane first fetches one run's description (start,
// length, key, and its first occurrence), so that a row seen once (the common case) costs one
// round trip to memory for its weights and gradient row, issued together. For rows of up to 128 columns without per-element state, the next run's
// weights and states are loaded while the current one is summed and updated, so each warp keeps
// two rows' loads in flight.
// Occurrences are summed in sorted (= index) order.
template <class Opt, typename W, int kVecs>
__global__ void __launch_bounds__(256) backward_warp_kernel(BackwardArgs a, Runs r, Occurrences o, typename Opt::Params p,
                                                            RowUpdateContext ctx, W* weights) {
  if (update_blocked(a)) return;
  // the values of the update that depend on the step only (Optimizer::StepValues), once per thread
  const typename Opt::StepValues sv = Opt::step_values(p, ctx.step);
  // (measured on the H200, run G: a gain for rows of <= 128 columns without per-element state; with
  // element states or wider rows the extra registers cost more than the overlap brings)
  constexpr bool kLoadAhead = kVecs == 1 && Opt::kElementStates == 0;
  const int lane = threadIdx.x % kWarpSize;
  const int32_t num_runs = r.counts[0];
  const bool none_pooling = a.pooling == kPoolNone;
  for (int64_t group = take_group(a.ticket, lane); group < num_runs; group = take_group(a.ticket, lane)) {
    int32_t my_len = 0, my_start = 0;
    int64_t my_key = 0;
    OccurrenceInfo my_first;
    if (group + lane < num_runs) {
      my_start = r.starts[group + lane];
      my_len = r.end_of(group + lane, num_runs) - my_start;
      my_key = r.key_at(my_start);
      my_first.fetch(o, my_start, none_pooling);
    }
    // the runs of this group that are this kernel's: long runs are backward_segment_kernel's,
    // skipped bad indices update nothing, and with split widths, rows of another width class are
    // another launch's
    bool mine = group + lane < num_runs && my_len < r.max_segment_length_per_warp && my_key < r.skipped_key;
    if (a.split_widths && mine) mine = short_run_fits<kVecs>(a, run_width(a, my_first.bag));
    unsigned todo = __ballot_sync(kFullMask, mine);
    if (todo == 0) continue;
    // takes the next run of `todo` into `x` and issues the loads of its row
    auto begin_run = [&](ShortRun<Opt, kVecs>& x) {
      const int k = __ffs(todo) - 1;
      todo &= todo - 1;
      x.len = __shfl_sync(kFullMask, my_len, k);
      x.key = __shfl_sync(kFullMask, my_key, k);
      x.start = __shfl_sync(kFullMask, my_start, k);
      x.first = my_first.from_lane(k);
      x.row.lane = lane;
      locate_row(a, x.first.bag, x.key, &x.row.D, &x.woff);
      load_table_states<Opt>(x.row, p, x.first.bag, a.B);
      load_row<Opt, W>(x.row, p, weights, x.key, x.woff);
    };
    ShortRun<Opt, kVecs> cur;
    begin_run(cur);
    while (true) {
      const bool more = todo != 0;
      ShortRun<Opt, kVecs> next;
      if (kLoadAhead && more) begin_run(next);
#pragma unroll
      for (int i = 0; i < cur.row.kN; ++i) cur.row.g_[i] = 0.0f;
      add_gradient<kVecs>(a, cur.first, cur.row.D, lane, cur.row.g_);
      for (int32_t base = 1; base < cur.len; base += kWarpSize) {
        const int n = cur.len - base < kWarpSize ? cur.len - base : kWarpSize;
        add_chunk<kVecs>(a, o, cur.row.D, lane, cur.start + base, n, cur.row.g_);
      }
      update_and_store<Opt, W>(cur.row, p, ctx, sv, weights, cur.key, cur.woff);
      if (!more) break;
      if (kLoadAhead) {
        cur = next;
      } else {
        begin_run(cur);
      }
    }
  }
}

// Short runs when some table is at most 64 columns wide: backward_warp_kernel, except that a row
// of D <= 64 columns occupies only lanes_for_row(D) lanes (8 for D = 32), so the warp splits into
// groups that update 32 / lanes_for_row(D) such rows at once, each group one row, where the warp
// kernel would leave the other lanes idle. A warp takes 32 consecutive runs at a time by ticket,
// as there, and works through them in rounds: each round takes the first remaining run, and with
// it up to 32 / lanes - 1 more of the remaining runs whose rows need as many lanes (runs of the
// same table are neighbours in key order, so rounds are full but at a table's edge); rows wider than 64
// columns go one per round over the whole warp, as in the warp kernel. A row's gradient is summed
// in the same order and updated by the same code as there, with reductions over its group
// (GroupRow): the same bits. The host takes this kernel when the narrowest table (of the launch's
// width class) has at most 64 columns and rows are at most 128 wide (kVecs = 1), or 256 wide for
// optimizers without per-element state, else backward_warp_kernel (cuda_backward_kernels.cuh,
// launch_backward, says why).
// kStreamRows: the rows' weights and states are read and written with the streaming (evict-first)
// policy, as in the other update kernels (load4_row); false is the TBEGEN_GROUP_ROWS_CACHED=1
// variant (issue 29), the same code with plain loads and stores, so the same bits. Why it exists:
// a row of D = 20 floats (80 bytes) shares a 32-byte sector with its neighbour, so its store
// writes part of a sector; if the evict-first line was evicted between the row's load and its
// store, L2 holds a partial sector that costs a read from HBM to merge on the way out (the
// evidence and the A/B to run: benchmarks/NOTES-gpu.md, "Narrow rows with an element state").
template <class Opt, typename W, int kVecs, bool kStreamRows = true>
__global__ void __launch_bounds__(256) backward_group_kernel(BackwardArgs a, Runs r, Occurrences o, typename Opt::Params p,
                                                             RowUpdateContext ctx, W* weights) {
  if (update_blocked(a)) return;
  // the values of the update that depend on the step only (Optimizer::StepValues), once per thread
  const typename Opt::StepValues sv = Opt::step_values(p, ctx.step);
  const int lane = threadIdx.x % kWarpSize;
  const int32_t num_runs = r.counts[0];
  const bool none_pooling = a.pooling == kPoolNone;
  for (int64_t group = take_group(a.ticket, lane); group < num_runs; group = take_group(a.ticket, lane)) {
    // lane l describes run group + l: where it starts, its length, key and first occurrence, and
    // how many lanes its row needs
    int32_t my_len = 0, my_start = 0;
    int64_t my_key = 0;
    int my_lanes = 0, my_D = 0;
    OccurrenceInfo my_first;
    if (group + lane < num_runs) {
      my_start = r.starts[group + lane];
      my_len = r.end_of(group + lane, num_runs) - my_start;
      my_key = r.key_at(my_start);
      my_first.fetch(o, my_start, none_pooling);
      my_D = run_width(a, my_first.bag);
      my_lanes = lanes_for_row(my_D);
    }
    // (as in backward_warp_kernel: long runs, skipped bad indices and, with split widths, rows of
    // another width class are not this kernel's)
    unsigned todo = __ballot_sync(kFullMask, group + lane < num_runs && my_len < r.max_segment_length_per_warp &&
                                                 my_key < r.skipped_key && short_run_fits<kVecs>(a, my_D));
    while (todo != 0) {
      // this round's runs: `lanes` lanes each, at most 32 / lanes of them, taken in key order
      const int lanes = __shfl_sync(kFullMask, my_lanes, __ffs(todo) - 1);
      unsigned round = todo & __ballot_sync(kFullMask, my_lanes == lanes);
      const int groups = kWarpSize / lanes;
      if (__popc(round) > groups) round &= (1u << __fns(round, 0, groups + 1)) - 1u;  // the first `groups`
      todo &= ~round;
      // my group's run: the (lane / lanes)-th of the round, described by lane `src`
      const unsigned src = __fns(round, 0, lane / lanes + 1);
      const bool active = src < unsigned(kWarpSize);
      const int from = active ? int(src) : 0;
      GroupRow<kVecs, Opt::kElementStates + Opt::kTemporaries, Opt::kRowStates, Opt::kIntRowStates, Opt::kTableStates> row;
      row.lanes = lanes;
      row.lane = lane % lanes;
      // (every lane shuffles, a group without a run too: a shuffle needs all 32 lanes)
      const int32_t run_len = __shfl_sync(kFullMask, my_len, from);
      const int32_t len = active ? run_len : 0;
      const int32_t start = __shfl_sync(kFullMask, my_start, from);
      const int64_t key = __shfl_sync(kFullMask, my_key, from);
      const OccurrenceInfo first = my_first.from_lane(from);
      int64_t woff = 0;
      row.D = 0;  // (a group without a run: no columns)
      if (active) {
        locate_row(a, first.bag, key, &row.D, &woff);
        load_table_states<Opt>(row, p, first.bag, a.B);
        load_row<Opt, W, kStreamRows>(row, p, weights, key, woff);
      }
#pragma unroll
      for (int i = 0; i < row.kN; ++i) row.g_[i] = 0.0f;
      if (active) add_gradient<kVecs>(a, first, row.D, row.lane, row.g_);
      // the other occurrences, in order, `lanes` at a time: each lane of a group fetches one
      // occurrence's metadata, then the group adds their rows one by one
      int32_t longest = len;
#pragma unroll
      for (int m = kWarpSize / 2; m > 0; m >>= 1) longest = max(longest, __shfl_xor_sync(kFullMask, longest, m));
      for (int32_t base = 1; base < longest; base += lanes) {
        OccurrenceInfo mine;
        if (base + row.lane < len) mine.fetch(o, int64_t(start) + base + row.lane, none_pooling);
        const int n = longest - base < lanes ? longest - base : lanes;
        for (int k = 0; k < n; ++k) {
          const OccurrenceInfo occ = mine.from_lane(lane - row.lane + k);
          if (base + k < len) add_gradient<kVecs>(a, occ, row.D, row.lane, row.g_);
        }
      }
      // every lane runs the update (its reductions are shuffles); a group without a run stores nothing
      Opt::update_row(row, p, sv);
      if (active) store_row<Opt, W, kStreamRows>(row, p, ctx, weights, key, woff);
    }
  }
}

// A long run as the segment kernels see it.
struct LongRun {
  int32_t first;     // first sorted position
  int32_t len;       // occurrences
  int64_t key;
  int2 segments;     // first segment, first partial-sum slot
  int32_t nseg;      // segments
};

__device__ __forceinline__ LongRun long_run(const Runs& r, int32_t k, int32_t num_runs) {
  LongRun x;
  const int32_t run = r.long_ids[k];
  x.first = r.starts[run];
  x.len = r.end_of(run, num_runs) - x.first;
  x.key = r.key_at(x.first);
  x.segments = r.segments[k];
  x.nseg = r.segments[k + 1].x - x.segments.x;
  return x;
}

// Long runs, first pass: one warp per segment of r.segment_length occurrences (so that the work is
// cut into equal pieces however skewed the batch is). A run of one segment is summed and updated
// here; a run of several leaves each segment's sum in `partial` for backward_finish_kernel.
// (At least 3 blocks per multiprocessor, 80 registers: the batched sum's rows in flight would
// otherwise take about 100, leaving room for 2 blocks, 16 warps.)
// kMinBlocks: the blocks per multiprocessor it is compiled for: kSegmentMinBlocks, the default's, or
// kSegmentOccupancyMinBlocks, the occupancy variant's (TBEGEN_SEGMENT_OCCUPANCY=1, issue 29; opt-in,
// rows of at most 128 columns, kVecs = 1): the same code under __launch_bounds__(256, 4), at most 64
// registers, 4 blocks (32 warps) per multiprocessor instead of 3 (24). ncu of the sweep's "random 3"
// cell (T=8 D=32 Zipf 1.3, H100, landing14) found the default latency-bound at 31.7% achieved
// occupancy (block limit: registers), DRAM at 6.6%: more warps, each with its 8 rows in flight.
// ptxas -v for sm_90 (benchmarks/NOTES-gpu.md, "The 4-wide segment kernel's occupancy"): the
// default 76-80 registers (85-108 unbounded); the variant 64, its spills (8-48 bytes) outside the
// occurrence loop, once per segment (at 5 blocks, 48 registers, they fall inside it; at kVecs = 2,
// 12-192 bytes). The same code, so the same sums in the same order: the default's bits
// (tests/test_segment_occupancy.py). A template argument rather than a device-function body under
// two kernels: that wrapper renumbered the default's registers (ptxas), this keeps its SASS
// instruction for instruction (only the symbol gains the argument, `..., 1, 3>`).
constexpr int kSegmentMinBlocks = 3;
constexpr int kSegmentOccupancyMinBlocks = 4;
template <class Opt, typename W, int kVecs, int kMinBlocks = kSegmentMinBlocks>
__global__ void __launch_bounds__(256, kMinBlocks) backward_segment_kernel(BackwardArgs a, Runs r, Occurrences o, typename Opt::Params p,
                                                               RowUpdateContext ctx, W* weights, float* partial) {
  if (update_blocked(a)) return;
  // the values of the update that depend on the step only (Optimizer::StepValues), once per thread
  const typename Opt::StepValues sv = Opt::step_values(p, ctx.step);
  constexpr int kWidth = kVecs * 128;
  const int lane = threadIdx.x % kWarpSize;
  const int32_t num_runs = r.counts[0];
  const int32_t num_long = r.counts[1];
  if (num_long == 0) return;
  const int32_t total = r.segments[num_long].x;
  // segments by ticket (a.segment_ticket), as the short runs' groups: the next segment's ticket is
  // asked for when this one starts, so that its round trip overlaps the sum
  int32_t ticket = ask_ticket(a.segment_ticket, lane);
  for (int64_t s = __shfl_sync(kFullMask, ticket, 0); s < total; s = __shfl_sync(kFullMask, ticket, 0)) {
    ticket = ask_ticket(a.segment_ticket, lane);
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
    OptRow<Opt, kVecs> row;
    row.lane = lane;
    int64_t woff;
    locate_row(a, o.bag[run.first], run.key, &row.D, &woff);
    if (run.nseg == 1) load_table_states<Opt>(row, p, o.bag[run.first], a.B);
    if (run.nseg == 1) load_row<Opt, W>(row, p, weights, run.key, woff);
#pragma unroll
    for (int i = 0; i < row.kN; ++i) row.g_[i] = 0.0f;
    const bool narrow = kVecs == 1 && a.segment_lane_groups && row.D <= 32;
    for (int32_t base = begin; base < end; base += kWarpSize) {
      const int n = end - base < kWarpSize ? int(end - base) : kWarpSize;
      if (narrow) {
        add_chunk_batched_narrow(a, o, row.D, lane, run.first + base, n, row.g_);
      } else {
        add_chunk_batched<kVecs>(a, o, row.D, lane, run.first + base, n, row.g_);
      }
    }
    if (run.nseg == 1) {
      update_and_store<Opt, W>(row, p, ctx, sv, weights, run.key, woff);
    } else {
      float* out = partial + int64_t(run.segments.y + seg) * kWidth;
#pragma unroll
      for (int v = 0; v < kVecs; ++v) store4(out + v * 128 + 4 * lane, &row.g_[v * 4]);
    }
  }
}

// Long runs, second pass: one warp per run of several segments adds their partial sums in
// segment order and updates the row.
template <class Opt, typename W, int kVecs>
__global__ void __launch_bounds__(256) backward_finish_kernel(BackwardArgs a, Runs r, Occurrences o, typename Opt::Params p,
                                                              RowUpdateContext ctx, W* weights, const float* partial) {
  if (update_blocked(a)) return;
  // the values of the update that depend on the step only (Optimizer::StepValues), once per thread
  const typename Opt::StepValues sv = Opt::step_values(p, ctx.step);
  constexpr int kWidth = kVecs * 128;
  const int lane = threadIdx.x % kWarpSize;
  const int64_t warps = int64_t(gridDim.x) * blockDim.x / kWarpSize;
  const int32_t num_runs = r.counts[0];
  const int32_t num_long = r.counts[1];
  for (int64_t k = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / kWarpSize; k < num_long; k += warps) {
    const LongRun run = long_run(r, int32_t(k), num_runs);
    if (run.nseg <= 1 || run.key >= r.skipped_key) continue;
    OptRow<Opt, kVecs> row;
    row.lane = lane;
    int64_t woff;
    locate_row(a, o.bag[run.first], run.key, &row.D, &woff);
    load_table_states<Opt>(row, p, o.bag[run.first], a.B);
    load_row<Opt, W>(row, p, weights, run.key, woff);
#pragma unroll
    for (int i = 0; i < row.kN; ++i) row.g_[i] = 0.0f;
    const float* in = partial + int64_t(run.segments.y) * kWidth;
    if (kVecs == 1 && a.segment_lane_groups && row.D <= 32) {
      add_partials_narrow(in, run.nseg, kWidth, row.D, lane, row.g_);
      update_and_store<Opt, W>(row, p, ctx, sv, weights, run.key, woff);
      continue;
    }
#pragma unroll 4
    for (int32_t j = 0; j < run.nseg; ++j) {
#pragma unroll
      for (int v = 0; v < kVecs; ++v) {
        float x[4];
        load4(in + int64_t(j) * kWidth + v * 128 + 4 * lane, x);
#pragma unroll
        for (int c = 0; c < 4; ++c) row.g_[v * 4 + c] += x[c];
      }
    }
    update_and_store<Opt, W>(row, p, ctx, sv, weights, run.key, woff);
  }
}

}  // namespace cuda
}  // namespace tbegen
