// tbegen runtime: one optimizer's update kernels, as a table the shared backward launches from.
//
// The only CUDA code that depends on the optimizer is the update kernels of cuda_kernels.cuh
// (backward_segment_kernel, backward_finish_kernel, and backward_warp_kernel or, with a table of
// at most 64 columns, backward_group_kernel), for each weight dtype and each row width class
// kVecs. NAME/kernels_cuda.cu instantiates them with
// backward_kernels_for<Optimizer>(), in a translation unit that includes no torch headers (so nvcc
// compiles little besides the kernels); backward_cuda (cuda_ops.cuh, compiled once for every
// optimizer) computes the launch sizes and streams and calls the table's entry for the call.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include "tbegen/cuda_any_width.cuh"
#include "tbegen/cuda_kernels.cuh"

namespace tbegen {
namespace cuda {

// One launch of the update kernels: their arguments, grid sizes and streams.
struct BackwardLaunch {
  BackwardArgs a;
  Runs runs;
  Occurrences occurrences;
  const void* params;  // the optimizer's Params (its own type: see launch_backward)
  RowUpdateContext ctx;
  void* weights;       // W*, the dtype the table entry was chosen for
  float* partial;      // kVecs * 128 floats per partial sum of a run of several segments
  int segment_blocks = 0, finish_blocks = 0, warp_blocks = 0, threads = 0;
  int sms = 0;                    // the device's multiprocessors
  cudaStream_t side = nullptr;    // the long runs' kernels (segment, then finish)
  cudaStream_t stream = nullptr;  // the short runs' kernel (warp, or group)
  bool lane_groups = false;       // some table is at most 64 columns wide (the group kernel, where it exists)
  bool element_lane_groups = true;  // the group kernel also for optimizers with per-element state (kVecs = 1)
  bool long_runs = true;          // launch the long runs' kernels (one launch per call does: the widest class's)
  int short_run_waves = 1;        // > 0: the short runs' grid is at most this many resident waves (short_run_grid)
  // the segment kernel's occupancy variant (backward_segment_kernel at kSegmentOccupancyMinBlocks,
  // 4 blocks per multiprocessor) where kVecs = 1: TBEGEN_SEGMENT_OCCUPANCY=1 (cuda_ops.cuh,
  // segment_occupancy_enabled)
  bool segment_occupancy = false;
};

using BackwardLaunchFn = cudaError_t (*)(const BackwardLaunch&);

// One launch of the any-width update kernels (cuda_any_width.cuh), for layouts the 4-wide
// kernels do not take.
struct AnyWidthLaunch {
  BackwardArgs a;
  Runs runs;
  Occurrences occurrences;
  const void* params;  // the optimizer's Params
  RowUpdateContext ctx;
  void* weights;       // W*
  float* partial;      // max_D floats per partial sum of a run of several segments
  float* side_scratch; // the segment and finish kernels' scratch rows (side stream)
  float* scratch;      // the warp kernel's scratch rows
  int segment_blocks = 0, finish_blocks = 0, warp_blocks = 0, threads = 0;
  cudaStream_t side = nullptr;
  cudaStream_t stream = nullptr;
  // the single work list (TBEGEN_ANY_WIDTH_ITEMS=1; items.total nullptr: none), taken by the
  // prefetching variant's backward_items_kernel on `stream` instead of the segment and warp kernels
  WorkItems items;
};

// The any-width kernels of one weight dtype: their launch and their scratch rows per warp (which
// depend on the Params: a narrow per-element state takes a float copy, cuda_any_width.cuh).
struct AnyWidthKernels {
  cudaError_t (*launch)(const AnyWidthLaunch&);
  int64_t (*scratch_slots)(const void* params);
};

// The launch function of every (weight dtype, kVecs) pair of one optimizer.
struct BackwardKernels {
  // [weights: float, c10::Half, c10::BFloat16][kVecs: 1, 2, 4, 8]
  BackwardLaunchFn launch[3][4];
  // [weights: float, c10::Half, c10::BFloat16, uint8_t (int8 rows: any-width kernels only)]
  AnyWidthKernels any_width[4];
  // whether these Params' states suit the 4-wide kernels: every state float32 (the 4-wide kernels
  // have no narrow-state branches, cuda_kernels.cuh load_row) and every per-element state 16-byte
  // aligned (their 16-byte loads)
  bool (*vector_states_fit)(const void* params);

  template <typename W>
  const AnyWidthKernels& any_width_for() const {
    return any_width[std::is_same<W, float>::value       ? 0
                     : std::is_same<W, c10::Half>::value ? 1
                     : std::is_same<W, uint8_t>::value   ? 3
                                                         : 2];
  }

  // The launch function for weights W and kVecs = 1 << width_class (width_class 0..3).
  template <typename W>
  BackwardLaunchFn get(int width_class) const {
    constexpr int w = std::is_same<W, float>::value ? 0 : std::is_same<W, c10::Half>::value ? 1 : 2;
    static_assert(w < 2 || std::is_same<W, c10::BFloat16>::value, "weights are float, Half or BFloat16");
    return launch[w][width_class];
  }
};

// How many blocks of `threads` threads of `kernel` fit on one multiprocessor at once (0 if CUDA
// cannot say).
template <typename Kernel>
int resident_blocks_per_sm(Kernel kernel, int threads) {
  int blocks = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, threads, 0) != cudaSuccess) {
    (void)cudaGetLastError();  // (cleared: the launch goes on with the bound it was given)
    return 0;
  }
  return blocks;
}

// At most `waves` resident waves of `blocks` blocks, for a kernel of which `resident_per_sm`
// blocks fit on one multiprocessor (0: unknown, `blocks` as they are).
inline int within_waves(int blocks, int waves, int resident_per_sm, int sms) {
  return resident_per_sm > 0 ? std::max(1, std::min(blocks, waves * resident_per_sm * sms)) : blocks;
}

// The grid of a short-run kernel with `resident_per_sm` blocks per multiprocessor: with
// l.short_run_waves = n > 0 (the default: 1) at most n resident waves, else l.warp_blocks (sized
// by the bound on the runs: up to 32 blocks per multiprocessor, several waves). The warps take
// their groups of runs by ticket (BackwardArgs::ticket), so a block stays until the runs are
// done, and the blocks of a later wave would only start at the end to find no ticket left.
inline int short_run_grid(const BackwardLaunch& l, int resident_per_sm) {
  return l.short_run_waves > 0 ? within_waves(l.warp_blocks, l.short_run_waves, resident_per_sm, l.sms) : l.warp_blocks;
}

// TBEGEN_GROUP_ROWS_CACHED (issue 29, read at every launch): whether the group kernel for float
// weights reads and writes its rows' weights and states with the default cache policy instead of
// evict-first (backward_group_kernel's kStreamRows = false: the same bits). Unset or empty: on for
// optimizers with state (element or row-wise), off for stateless ones, as measured on the H200
// (docs/gpu-runs/2026-12-05-landing10, T=32 E=500000 B=8192 L=20 Zipf 1.1, D = 4 to 64 beside
// FBGEMM: the backward of adam 11-21% faster at D = 4-32, adagrad and rowwise_adagrad 8-24% at
// D = 4-20, within +-5% at D = 32-64; sgd mixed, -10% to +11%); "0" off, "1" on; anything else is
// refused (a typo must not time one path under the other's name: any_width::env_switch).
template <class Opt>
bool group_rows_cached() {
  const any_width::EnvSwitch mode = any_width::env_switch("TBEGEN_GROUP_ROWS_CACHED");
  return mode == any_width::EnvSwitch::kOn ||
         (mode == any_width::EnvSwitch::kUnset && Opt::kElementStates + Opt::kRowStates + Opt::kIntRowStates > 0);
}

// Launches the short runs' kernel: backward_group_kernel<Opt, W, kVecs, kStreamRows> where
// kGroup, else backward_warp_kernel<Opt, W, kVecs>, on short_run_grid's grid.
template <class Opt, typename W, int kVecs, bool kGroup, bool kStreamRows>
cudaError_t launch_short_runs(const BackwardLaunch& l, const typename Opt::Params& p, W* weights) {
  if constexpr (kGroup) {
    static const int resident_per_sm =
        resident_blocks_per_sm(backward_group_kernel<Opt, W, kVecs, kStreamRows>, l.threads);
    backward_group_kernel<Opt, W, kVecs, kStreamRows><<<short_run_grid(l, resident_per_sm), l.threads, 0, l.stream>>>(
        l.a, l.runs, l.occurrences, p, l.ctx, weights);
  } else {
    static const int resident_per_sm = resident_blocks_per_sm(backward_warp_kernel<Opt, W, kVecs>, l.threads);
    backward_warp_kernel<Opt, W, kVecs><<<short_run_grid(l, resident_per_sm), l.threads, 0, l.stream>>>(
        l.a, l.runs, l.occurrences, p, l.ctx, weights);
  }
  return cudaGetLastError();
}

// Launches the long runs' segment kernel backward_segment_kernel<Opt, W, kVecs, kMinBlocks> on
// l.side, on at most one resident wave of its blocks: each block strides over the segments, so a
// block that starts late (a second, partial wave: 1.6 waves in C2, ncu of run Y) ends late.
// (resident_blocks_per_sm reads the instantiation's own registers: 3 blocks per multiprocessor for
// the default's, 4 for the occupancy variant's.)
template <class Opt, typename W, int kVecs, int kMinBlocks>
cudaError_t launch_segment_kernel(const BackwardLaunch& l, const typename Opt::Params& p, W* weights) {
  static const int resident_per_sm =
      resident_blocks_per_sm(backward_segment_kernel<Opt, W, kVecs, kMinBlocks>, l.threads);
  const int segment_blocks = within_waves(l.segment_blocks, 1, resident_per_sm, l.sms);
  backward_segment_kernel<Opt, W, kVecs, kMinBlocks><<<segment_blocks, l.threads, 0, l.side>>>(
      l.a, l.runs, l.occurrences, p, l.ctx, weights, l.partial);
  return cudaGetLastError();
}

// The segment kernel for this launch: with l.segment_occupancy (TBEGEN_SEGMENT_OCCUPANCY=1) and
// kVecs = 1 the occupancy variant (kSegmentOccupancyMinBlocks; the same bits), else the default's.
template <class Opt, typename W, int kVecs>
cudaError_t launch_segments(const BackwardLaunch& l, const typename Opt::Params& p, W* weights) {
  if constexpr (kVecs == 1) {
    if (l.segment_occupancy) return launch_segment_kernel<Opt, W, kVecs, kSegmentOccupancyMinBlocks>(l, p, weights);
  }
  return launch_segment_kernel<Opt, W, kVecs, kSegmentMinBlocks>(l, p, weights);
}

// Launches the three update kernels for optimizer Opt; returns the first launch error.
template <class Opt, typename W, int kVecs>
cudaError_t launch_backward(const BackwardLaunch& l) {
  const typename Opt::Params& p = *static_cast<const typename Opt::Params*>(l.params);
  W* weights = static_cast<W*>(l.weights);
  const bool rows_cached = group_rows_cached<Opt>();  // (read, and checked, whichever kernel runs)
  (void)rows_cached;
  if (l.long_runs) {
    cudaError_t err = launch_segments<Opt, W, kVecs>(l, p, weights);
    if (err != cudaSuccess) return err;
    backward_finish_kernel<Opt, W, kVecs><<<l.finish_blocks, l.threads, 0, l.side>>>(
        l.a, l.runs, l.occurrences, p, l.ctx, weights, l.partial);
    err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  // The group kernel only for rows of up to 256 columns (a table of at most 64 columns among
  // wider ones is rare, and each variant is compiled for every optimizer and weight dtype), and
  // at 256 columns (kVecs = 2) only for optimizers without per-element state: measured on C3
  // (benchmarks/NOTES-gpu.md, runs O and P), there it made sgd 2% and rowwise_adagrad 3% faster,
  // but adagrad 4% and adam 7% slower (its extra registers, 96 against 80 for adam, cost the wide
  // rows more than the narrow rows gain). At kVecs = 1 (a batch of narrow rows, or the narrow
  // width class of a mixed one, backward_cuda) every optimizer may take it, unless
  // TBEGEN_ELEMENT_LANE_GROUPS=0 (l.element_lane_groups).
  if constexpr (kVecs == 1 || (kVecs == 2 && Opt::kElementStates == 0)) {
    if (l.lane_groups && (Opt::kElementStates == 0 || l.element_lane_groups)) {
      // group_rows_cached (by default for optimizers with state): the variant whose rows take the
      // default cache policy instead of evict-first, float weights only; the same bits
      if constexpr (std::is_same<W, float>::value) {
        if (rows_cached) return launch_short_runs<Opt, W, kVecs, true, false>(l, p, weights);
      }
      return launch_short_runs<Opt, W, kVecs, true, true>(l, p, weights);
    }
  }
  return launch_short_runs<Opt, W, kVecs, false, true>(l, p, weights);
}

// Launches the three any-width update kernels for optimizer Opt; returns the first launch error.
// (The prefetching variant with a work list, l.items: the items kernel, then the finish kernel.)
// (kPrefetch: their prefetching variant for wide rows, chosen by launch_any_width below;
// kOccupancy: the prefetching kernels' occupancy variant, the `..._occupancy` kernels, float
// weights' default, TBEGEN_ANY_WIDTH_OCCUPANCY, fp16 weights' with TBEGEN_ANY_WIDTH_OCCUPANCY_HALF=1;
// shared_bytes: their dynamic shared memory, the summed rows', TBEGEN_ANY_WIDTH_SHARED_ROW.)
template <class Opt, typename W, bool kPrefetch, bool kOccupancy = false>
cudaError_t launch_any_width_kernels(const AnyWidthLaunch& l, size_t shared_bytes = 0) {
  static_assert(kPrefetch || !kOccupancy, "the occupancy variant is the prefetching kernels'");
  if constexpr (!kOccupancy) shared_bytes = 0;
  const typename Opt::Params& p = *static_cast<const typename Opt::Params*>(l.params);
  W* weights = static_cast<W*>(l.weights);
  auto* const finish = [] {
    if constexpr (kOccupancy) return &any_width::backward_finish_kernel_occupancy<Opt, W>;
    else return &any_width::backward_finish_kernel<Opt, W, kPrefetch>;
  }();
  if constexpr (kPrefetch) {
    if (l.items.total != nullptr) {
      auto* const items = [] {
        if constexpr (kOccupancy) return &any_width::backward_items_kernel_occupancy<Opt, W>;
        else return &any_width::backward_items_kernel<Opt, W, kPrefetch>;
      }();
      // one list on `stream` (every item in key order, the whole grid on it), then the runs of
      // several segments finished after it, on the same stream
      items<<<l.warp_blocks, l.threads, shared_bytes, l.stream>>>(l.a, l.runs, l.items, l.occurrences, p, l.ctx,
                                                                  weights, l.partial, l.scratch);
      cudaError_t err = cudaGetLastError();
      if (err != cudaSuccess) return err;
      finish<<<l.finish_blocks, l.threads, shared_bytes, l.stream>>>(l.a, l.runs, l.occurrences, p, l.ctx, weights,
                                                                     l.partial, l.side_scratch);
      return cudaGetLastError();
    }
  }
  auto* const segment = [] {
    if constexpr (kOccupancy) return &any_width::backward_segment_kernel_occupancy<Opt, W>;
    else return &any_width::backward_segment_kernel<Opt, W, kPrefetch>;
  }();
  auto* const warp = [] {
    if constexpr (kOccupancy) return &any_width::backward_warp_kernel_occupancy<Opt, W>;
    else return &any_width::backward_warp_kernel<Opt, W, kPrefetch>;
  }();
  segment<<<l.segment_blocks, l.threads, shared_bytes, l.side>>>(l.a, l.runs, l.occurrences, p, l.ctx, weights,
                                                                 l.partial, l.side_scratch);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  finish<<<l.finish_blocks, l.threads, shared_bytes, l.side>>>(l.a, l.runs, l.occurrences, p, l.ctx, weights,
                                                               l.partial, l.side_scratch);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  warp<<<l.warp_blocks, l.threads, shared_bytes, l.stream>>>(l.a, l.runs, l.occurrences, p, l.ctx, weights,
                                                             l.scratch);
  return cudaGetLastError();
}
// Whether `kernel` (an occupancy kernel) runs any_width::kOccupancyMinBlocks blocks of `threads` per
// multiprocessor of the current device with `bytes` of dynamic shared memory, more than the 48 KB a
// block takes without an opt-in: bytes at most the device's sharedMemPerBlockOptin and
// kOccupancyMinBlocks x (bytes + reservedSharedMemPerBlock) at most its sharedMemPerMultiprocessor
// (both queried, not hard-coded), then the kernel's cudaFuncAttributeMaxDynamicSharedMemorySize raised
// to bytes before the launch (once per kernel, device and size: only ever raised, so a size found to
// fit stays launchable), and the occupancy calculator's blocks at that size (registers, the shared
// memory each block reserves, the multiprocessor's) at least kOccupancyMinBlocks. A size that would cost the variant a block, or any CUDA error (cleared), is
// false: the caller then keeps the scratch row. Memoized per (kernel, device, size), under a lock.
// (TBEGEN_ANY_WIDTH_OCCUPANCY_HALF's wide shared row: launch_any_width.)
template <typename Kernel>
bool shared_row_opt_in_fits(Kernel kernel, int threads, size_t bytes) {
  static std::mutex lock;
  static std::map<std::tuple<const void*, int, size_t>, bool> fits;
  static std::map<std::pair<const void*, int>, size_t> raised;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  const void* const k = reinterpret_cast<const void*>(kernel);
  const std::lock_guard<std::mutex> guard(lock);
  const auto key = std::make_tuple(k, device, bytes);
  const auto found = fits.find(key);
  if (found != fits.end()) return found->second;
  bool ok = false;
  int optin = 0, per_sm = 0, reserved = 0;
  cudaError_t err = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&reserved, cudaDevAttrReservedSharedMemoryPerBlock, device);
  // (the attribute is raised only for a size of which kOccupancyMinBlocks blocks can fit a
  // multiprocessor at all: a row that can never have a shared row, 4096 columns, leaves the limit alone)
  if (err == cudaSuccess && optin > 0 && bytes <= size_t(optin) &&
      size_t(any_width::kOccupancyMinBlocks) * (bytes + size_t(reserved)) <= size_t(per_sm)) {
    size_t& done = raised[std::make_pair(k, device)];
    if (bytes > done) {
      err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes));
      if (err == cudaSuccess) done = bytes;
    }
    int blocks = 0;
    if (err == cudaSuccess) err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, threads, bytes);
    ok = err == cudaSuccess && blocks >= any_width::kOccupancyMinBlocks;
  }
  if (err != cudaSuccess) (void)cudaGetLastError();  // (cleared: an error here only means no shared row)
  fits[key] = ok;
  return ok;
}

// The occupancy kernels' dynamic shared memory for fp16 weights (TBEGEN_ANY_WIDTH_OCCUPANCY_HALF=1):
// 8 warps x max_D floats where max_D <= kSharedRowMaxD (48 KB at most, no opt-in, as for float
// weights); wider rows (up to 8 x 2048 floats = 64 KB a block at D = 2048, 3 blocks = 192 KB of the
// H100's 228 KB) only where every kernel of this launch (the items and finish kernels, or the segment,
// finish and warp kernels) fits kOccupancyMinBlocks blocks with it (shared_row_opt_in_fits), else 0
// (the scratch row: at the module's widest rows, 4096 columns, 128 KB a block, never).
// The occupancy kernels' summed rows in shared memory: one max_D-float row per warp of a block.
inline size_t shared_row_bytes(const AnyWidthLaunch& l) {
  return size_t(l.threads / kWarpSize) * size_t(l.a.max_D) * sizeof(float);
}

template <class Opt, typename W>
size_t half_shared_row_bytes(const AnyWidthLaunch& l) {
  const size_t bytes = shared_row_bytes(l);
  if (l.a.max_D <= any_width::kSharedRowMaxD) return bytes;
  const bool fit =
      shared_row_opt_in_fits(&any_width::backward_finish_kernel_occupancy<Opt, W>, l.threads, bytes) &&
      (l.items.total != nullptr
           ? shared_row_opt_in_fits(&any_width::backward_items_kernel_occupancy<Opt, W>, l.threads, bytes)
           : shared_row_opt_in_fits(&any_width::backward_segment_kernel_occupancy<Opt, W>, l.threads, bytes) &&
                 shared_row_opt_in_fits(&any_width::backward_warp_kernel_occupancy<Opt, W>, l.threads, bytes));
  return fit ? bytes : 0;
}

template <class Opt, typename W>
cudaError_t launch_any_width(const AnyWidthLaunch& l) {
  using any_width::PrefetchMode;
  const PrefetchMode mode = any_width::prefetch_mode_from_env();  // (read, and checked, whatever the dtype)
  const bool occupancy = any_width::occupancy_from_env();          // (the same)
  const bool shared_row = any_width::shared_row_from_env(occupancy);
  const bool occupancy_half = any_width::occupancy_half_from_env();  // (read, and checked, whatever the dtype)
  if constexpr (std::is_same<W, float>::value) {
    if (mode == PrefetchMode::kOn || (mode == PrefetchMode::kAuto && l.a.max_D > any_width::kPrefetchAutoMinD)) {
      // (by default the occupancy variant: the same kernels at 3 blocks per multiprocessor, the same
      // bits, each warp's summed row in shared memory where it fits, max_D <= kSharedRowMaxD, else in
      // its scratch row; TBEGEN_ANY_WIDTH_SHARED_ROW=0 the scratch row always,
      // TBEGEN_ANY_WIDTH_OCCUPANCY=0 the 2-block kernels)
      if (occupancy) {
        const size_t shared_bytes = shared_row && l.a.max_D <= any_width::kSharedRowMaxD ? shared_row_bytes(l) : 0;
        return launch_any_width_kernels<Opt, W, true, true>(l, shared_bytes);
      }
      return launch_any_width_kernels<Opt, W, true>(l);
    }
  } else if constexpr (std::is_same<W, c10::Half>::value) {
    // (fp16 rows wider than 512 columns by default since landing10: cuda_ops.cuh, wide_half_rows)
    if (mode == PrefetchMode::kOn || (mode == PrefetchMode::kAuto && l.a.max_D > any_width::kPrefetchAutoMinD)) {
      // (TBEGEN_ANY_WIDTH_OCCUPANCY_HALF=1, opt-in: the occupancy kernels, the same bits, each warp's
      // summed row in shared memory where it fits, half_shared_row_bytes, unless
      // TBEGEN_ANY_WIDTH_SHARED_ROW=0; TBEGEN_ANY_WIDTH_SHARED_ROW=1 with TBEGEN_ANY_WIDTH_OCCUPANCY=0
      // is refused above, as for float rows)
      if (occupancy_half) {
        // (the shared row's switch as for float rows' occupancy kernels, which these are)
        const bool half_shared_row = any_width::shared_row_from_env(/*occupancy=*/true);
        return launch_any_width_kernels<Opt, W, true, true>(l, half_shared_row ? half_shared_row_bytes<Opt, W>(l) : 0);
      }
      return launch_any_width_kernels<Opt, W, true>(l);
    }
  }
  (void)mode;  // (bf16 and int8 weights: the default kernels)
  (void)occupancy;  // (float weights only)
  (void)shared_row;
  (void)occupancy_half;  // (fp16 weights only)
  return launch_any_width_kernels<Opt, W, false>(l);
}

// The any-width kernels' scratch rows per warp for optimizer Opt's `params` (any_width::scratch_slots).
template <class Opt, typename W>
int64_t any_width_scratch_slots(const void* params) {
  return any_width::scratch_slots<Opt, W>(*static_cast<const typename Opt::Params*>(params));
}

template <class Opt>
bool vector_states_fit(const void* params) {
  const typename Opt::Params& p = *static_cast<const typename Opt::Params*>(params);
  for (int k = 0; k < Opt::kElementStates; ++k) {
    if (p.element_state_dtypes[k] != kStateFloat32) return false;
    if (reinterpret_cast<uintptr_t>(p.element_states[k]) % 16 != 0) return false;
  }
  for (int k = 0; k < Opt::kRowStates; ++k) {
    if (p.row_state_dtypes[k] != kStateFloat32) return false;
  }
  return true;
}

// The table of optimizer Opt's kernels (instantiates all 36 4-wide ones, 3 dtypes x 4 widths x 3
// kernels, plus the group kernel for 3 dtypes x 1 width (x 2 without per-element state), and the 12
// any-width ones: 3 kernels for each of the 3 float dtypes and int8 rows). tbegen/build.py lists
// these entries too (_LAUNCH_WEIGHTS, _WIDTHS, _ANY_WIDTH_WEIGHTS: the float32 library's stubs and
// the split's parts); tests/test_cuda_quick_build.py keeps the two the same.
template <class Opt>
const BackwardKernels& backward_kernels_for() {
  static const BackwardKernels table = {{
      {&launch_backward<Opt, float, 1>, &launch_backward<Opt, float, 2>, &launch_backward<Opt, float, 4>,
       &launch_backward<Opt, float, 8>},
      {&launch_backward<Opt, c10::Half, 1>, &launch_backward<Opt, c10::Half, 2>,
       &launch_backward<Opt, c10::Half, 4>, &launch_backward<Opt, c10::Half, 8>},
      {&launch_backward<Opt, c10::BFloat16, 1>, &launch_backward<Opt, c10::BFloat16, 2>,
       &launch_backward<Opt, c10::BFloat16, 4>, &launch_backward<Opt, c10::BFloat16, 8>},
  }, {
      {&launch_any_width<Opt, float>, &any_width_scratch_slots<Opt, float>},
      {&launch_any_width<Opt, c10::Half>, &any_width_scratch_slots<Opt, c10::Half>},
      {&launch_any_width<Opt, c10::BFloat16>, &any_width_scratch_slots<Opt, c10::BFloat16>},
      {&launch_any_width<Opt, uint8_t>, &any_width_scratch_slots<Opt, uint8_t>},
  }, &vector_states_fit<Opt>};
  return table;
}

}  // namespace cuda
}  // namespace tbegen
