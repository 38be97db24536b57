// tbegen runtime: the definition of prepare_backward (declared in cuda_backward_prep.cuh).
// Included by cuda_forward.cu only, so that it is compiled once for every optimizer.
#pragma once

#include <thrust/iterator/tabulate_output_iterator.h>
#include <thrust/iterator/transform_iterator.h>

#include "tbegen/cuda_ops.cuh"
#include "tbegen/cuda_sort.cuh"

namespace tbegen {
namespace cuda {

// Predicate of the run selection: sorted position j starts a run.
template <typename K>
struct IsRunStart {
  const K* keys;
  __device__ __forceinline__ bool operator()(int32_t j) const { return j == 0 || keys[j] != keys[j - 1]; }
};

// The occurrences of run r of `runs` (r < runs): its sorted positions [starts[r], starts[r + 1]),
// the last run's ending at n.
__device__ __forceinline__ int32_t run_length(const int32_t* starts, int32_t runs, int32_t n, int32_t r) {
  return (r + 1 < runs ? starts[r + 1] : n) - starts[r];
}

// Predicate of the long-run selection: run i exists and has at least `threshold` occurrences.
struct IsLongRun {
  const int32_t* starts;
  const int32_t* counts;
  int32_t n;
  int32_t threshold;
  __device__ __forceinline__ bool operator()(int32_t i) const {
    const int32_t runs = counts[0];
    if (i >= runs) return false;
    return run_length(starts, runs, n, i) >= threshold;
  }
};

// A long run of `len` occurrences cut into segments of `length`: (segments, partial-sum slots); a
// run of one segment needs no partial sums. (A run has at least one occurrence; len + length - 1
// would overflow for a run of nearly 2^31 occurrences.) SegmentsOfLongRun and ItemsOfRun both count
// with it, so that the work list's partial-sum slots are the long runs' scan's.
__device__ __forceinline__ int2 segments_of_long_run(int32_t len, int32_t length) {
  const int32_t segments = (len - 1) / length + 1;
  return make_int2(segments, segments > 1 ? segments : 0);
}

// Long run k's (segments, partial-sum slots).
struct SegmentsOfLongRun {
  const int32_t* starts;
  const int32_t* counts;
  const int32_t* long_ids;
  int32_t n;
  int32_t length;  // occurrences per segment (Runs::segment_length)
  __device__ __forceinline__ int2 operator()(int32_t k) const {
    if (k >= counts[1]) return make_int2(0, 0);
    return segments_of_long_run(run_length(starts, counts[0], n, long_ids[k]), length);
  }
};

// Run r's (work items, partial sums) for the single work list (WorkItems): a short run is one item,
// a long run its segments, and a long run of several segments takes as many partial sums (so that
// each long run's first partial-sum slot is the one SegmentsOfLongRun gives it); (0, 0) past the
// last run.
struct ItemsOfRun {
  const int32_t* starts;
  const int32_t* counts;
  int32_t n;
  int32_t threshold;  // Runs::max_segment_length_per_warp
  int32_t length;     // Runs::segment_length
  __device__ __forceinline__ int2 operator()(int32_t r) const {
    if (r >= counts[0]) return make_int2(0, 0);
    const int32_t len = run_length(starts, counts[0], n, r);
    return len < threshold ? make_int2(1, 0) : segments_of_long_run(len, length);
  }
};

struct SumInt2 {
  __device__ __forceinline__ int2 operator()(const int2& x, const int2& y) const {
    return make_int2(x.x + y.x, x.y + y.y);
  }
};

// TBEGEN_LONG_RUN_SCAN=1 (long_run_scan): the long-run selection and the segments' scan as one
// exclusive scan over the runs. Run r's (long, segments, partial-sum slots): (1, and
// segments_of_long_run's pair) for a run of at least `threshold` occurrences (IsLongRun's test),
// else, and past the last run, (0, 0, 0).
struct LongRunOfRun {
  const int32_t* starts;
  const int32_t* counts;
  int32_t n;
  int32_t threshold;  // Runs::max_segment_length_per_warp
  int32_t length;     // Runs::segment_length
  __device__ __forceinline__ int3 operator()(int32_t r) const {
    const int32_t runs = counts[0];
    if (r >= runs) return make_int3(0, 0, 0);
    const int32_t len = run_length(starts, runs, n, r);
    if (len < threshold) return make_int3(0, 0, 0);
    const int2 s = segments_of_long_run(len, length);
    return make_int3(1, s.x, s.y);
  }
};

struct SumInt3 {
  __device__ __forceinline__ int3 operator()(const int3& x, const int3& y) const {
    return make_int3(x.x + y.x, x.y + y.y, x.z + y.z);
  }
};

// The scan's output (through thrust's tabulate_output_iterator): run r with the exclusive prefix p
// of the runs before it. A long run is long run p.x: long_ids[p.x] = r and segments[p.x] = its
// first segment and partial-sum slot (p.y, p.z), what the selection and the scan over the long runs
// wrote; the last run also writes the totals, counts[1] (the long runs) and segments[counts[1]]
// (the update kernels read segments[k] for k <= counts[1] only).
struct ScatterLongRun {
  LongRunOfRun of;
  int32_t* long_ids;
  int2* segments;
  int32_t* num_long;
  __device__ __forceinline__ void operator()(ptrdiff_t r, const int3& p) const {
    const int32_t runs = of.counts[0];
    if (r >= runs) return;
    const int3 mine = of(int32_t(r));
    if (mine.x != 0) {
      long_ids[p.x] = int32_t(r);
      segments[p.x] = make_int2(p.y, p.z);
    }
    if (r == runs - 1) {
      *num_long = p.x + mine.x;
      segments[p.x + mine.x] = make_int2(p.y + mine.y, p.z + mine.z);
    }
  }
};

// TBEGEN_LONG_RUN_SCAN left unset: on for a batch of at most kFewerCallsMaxIndices indices, off
// above. Measured on an H100 (docs/gpu-runs/2026-12-06-landing15, the sweep's cells beside FBGEMM):
// the host-bound sub-millisecond steps of 164k-327k indices (T=1, L=1, B=512) gained 5-15% with it
// and TBEGEN_SORT_NO_MEMSETS (backward geometric mean 1.13x -> 1.21x FBGEMM's), where every launch
// the host saves is step time; alone on the kernel-bound steps of 5.2M indices (D=20, D=32, base:
// T=32, B=8192, L=20) it costs 25-55 us each (+2-8%, geometric mean +5.7% over 12 cells,
// docs/gpu-runs/2026-12-06-landing16/sort-cuts: its one scan walks all n runs where the selection
// walks them once and the scan only the long ones). Either way the same bits
// (tests/test_step_runtime_calls.py), so the choice moves only time.
constexpr int64_t kFewerCallsMaxIndices = int64_t(1) << 20;
inline bool few_calls_by_default(int64_t n) { return n <= kFewerCallsMaxIndices; }

// Whether step 3 finds the long runs and their segments with one CUB scan over the runs
// (LongRunOfRun, ScatterLongRun) instead of a selection of the long runs and a scan over them: one
// CUB algorithm fewer, its init kernel and its kernel (issue 29: -2 launches per backward). The same
// long_ids, counts[1] and segments[0..counts[1]], so the same bits. TBEGEN_LONG_RUN_SCAN: unset or
// empty: on for batches of at most kFewerCallsMaxIndices indices (few_calls_by_default), "0" off,
// "1" on; anything else refused. Read at every call.
inline bool long_run_scan(int64_t n) { return switch_or("TBEGEN_LONG_RUN_SCAN", few_calls_by_default(n)); }

// An occurrence's output-gradient row offset, bag_out[bag] of its sorted bag (step 3c, or 3b with
// the fused gather). Clamped: after malformed offsets some bags are never written, and nothing is
// updated; a bag with occurrences is no padding, so its offset is >= 0 and, the output being at
// most INT32_MAX elements (vbe_grad_offsets_enabled's caller), fits.
__device__ __forceinline__ int32_t grad_offset_of(int32_t sorted_bag, int64_t nbags, const int64_t* __restrict__ bag_out) {
  const int32_t bag = int32_t(min(max(int64_t(sorted_bag), int64_t(0)), nbags - 1));
  return int32_t(bag_out[bag]);
}

// The run selection's predicate with step 3c in it (TBEGEN_VBE_GATHER_IN_SELECT=1,
// vbe_gather_in_select: a VBE batch whose sorted values are the bags, unweighted sum): besides
// whether sorted position j starts a run (IsRunStart's answer), it writes j's output-gradient
// offset, grad_at[j] = bag_out[bag] of its sorted bag, as 3c's kernel does, so that kernel is not
// launched (issue 25: one launch fewer per VBE step). Sound because CUB's selection calls the
// predicate on every position in [0, n) (agent_select_if.cuh, InitializeSelections: each tile's
// in-range items once), the sorted bags are there (the sort ran before it on the stream), and the
// write is idempotent (a second call writes the same value); it runs before the update kernels on
// the caller's stream. A type of its own, so that IsRunStart's kernel is the code it was.
template <typename K>
struct IsRunStartGathering {
  const K* keys;
  int32_t n;
  const int32_t* sorted_bag;
  const int64_t* bag_out;
  int64_t nbags;
  int32_t* grad_at;
  __device__ __forceinline__ bool operator()(int32_t j) const {
    if (j < n) grad_at[j] = grad_offset_of(sorted_bag[j], nbags, bag_out);
    return IsRunStart<K>{keys}(j);
  }
};

// Whether a VBE batch whose sorted values are the bags (unweighted sum) writes its occurrences'
// output-gradient offsets in the run selection's predicate (IsRunStartGathering) instead of step
// 3c's kernel: TBEGEN_VBE_GATHER_IN_SELECT, unset, empty or "0" off (the default), "1" on, anything
// else refused. Read at every VBE call that gathers offsets (TBEGEN_VBE_GRAD_OFFSETS on), whatever
// its pooling; weighted and mean batches keep 3c (their sorted bags come from step 3b, after the
// selection; TBEGEN_VBE_FUSED_GATHER is theirs). The same offsets, so the same bits. Opt-in until a
// GPU has run it.
inline bool vbe_gather_in_select() { return opt_in_switch("TBEGEN_VBE_GATHER_IN_SELECT"); }

// Step 3b when the values sorted were positions: each occurrence's bag and scale in sorted order.
// kGradOffsets (TBEGEN_VBE_FUSED_GATHER=1, vbe_fused_gather: a VBE batch whose values are positions,
// i.e. weighted or mean pooling) also writes step 3c's output-gradient offset, bag_out[bag] of the
// bag it has just read, so that 3c's kernel does not run: one launch fewer, and the sorted bags
// are not read back. The same values as 3c's kernel (the same clamp of the same bag).
template <bool kGradOffsets>
static __global__ void __launch_bounds__(256) gather_occurrences_kernel(int64_t n, const int32_t* __restrict__ sorted_positions,
                                                                        const int32_t* __restrict__ bag_of,
                                                                        const float* __restrict__ scale_of,
                                                                        int32_t* sorted_bag, float* sorted_scale,
                                                                        int64_t nbags,
                                                                        const int64_t* __restrict__ bag_out,
                                                                        int32_t* grad_at) {
  for (int64_t j = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; j < n; j += int64_t(gridDim.x) * blockDim.x) {
    // (clamped: after malformed offsets some positions are never written, and nothing is updated)
    const int32_t pos = min(max(sorted_positions[j], 0), int32_t(n - 1));
    const int32_t bag_j = bag_of[pos];
    sorted_bag[j] = bag_j;
    if (scale_of) sorted_scale[j] = scale_of[pos];
    if constexpr (kGradOffsets) grad_at[j] = grad_offset_of(bag_j, nbags, bag_out);
  }
}

// Step 3c of a VBE batch with TBEGEN_VBE_GRAD_OFFSETS=1 (BackwardArgs::pooling): each occurrence's
// output-gradient row offset in sorted order, bag_out[bag] of its sorted bag. One coalesced read
// and write per occurrence, and the random read of bag_out that the update kernels would
// otherwise make per occurrence, on their critical path, between the bag and the row.
static __global__ void __launch_bounds__(256) gather_grad_offsets_kernel(int64_t n, int64_t nbags,
                                                                         const int32_t* __restrict__ sorted_bag,
                                                                         const int64_t* __restrict__ bag_out,
                                                                         int32_t* grad_at) {
  for (int64_t j = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; j < n; j += int64_t(gridDim.x) * blockDim.x) {
    grad_at[j] = grad_offset_of(sorted_bag[j], nbags, bag_out);
  }
}

// Whether a VBE batch whose sorted values are positions (per-sample weights or mean pooling) writes
// its occurrences' output-gradient offsets in step 3b's kernel (gather_occurrences_kernel<true>)
// instead of step 3c's kernel after it (issue 25): TBEGEN_VBE_FUSED_GATHER, unset, empty or "0" off
// (the default), "1" on, anything else refused. Read at every VBE call that gathers offsets
// (TBEGEN_VBE_GRAD_OFFSETS on), whatever its pooling; the same bits either way (the same offsets).
// An unweighted sum batch (values_are_bags: no step 3b) keeps 3c: its sort carries the bag, which
// the update kernels need (locate_row, load_table_states, run_width: the run's table, read at
// run and segment starts), so the sort cannot carry the offset in its place (benchmarks/NOTES-gpu.md,
// "VBE: the fused gather").
inline bool vbe_fused_gather() { return opt_in_switch("TBEGEN_VBE_FUSED_GATHER"); }

// How many warps share each group of 32 bags in the linearize (linearize_kernel's `spread`):
// TBEGEN_LINEARIZE_SPREAD (issue 29): unset, empty or "1" the batch's choice (the default since
// docs/gpu-runs/2026-12-05-landing11: on the H100 the sweep's "random 3" cell, T=8 B=4096 L=80,
// 1025 groups of bags, backward sgd 0.621 -> 0.556 ms, rowwise_adagrad 0.664 -> 0.544, adagrad
// 0.838 -> 0.581, adam 0.699 -> 0.578), "0" one warp per group, anything else refused. The choice: doubled (up to
// 8, a divisor of a block's 8 warps) while the warps stay within half of what the multiprocessors
// hold (32 each) and each warp keeps at least 4 blocks of 32 indices to walk; 1 wherever the
// batch has many bags (C2's 16385 groups: 1). Every index gets the same key and value either way.
inline int linearize_spread(int64_t nbags, int64_t N) {
  if (!switch_or("TBEGEN_LINEARIZE_SPREAD", true)) return 1;
  const int64_t groups = nbags / kWarpSize + 1;
  const int64_t room = int64_t(at::cuda::getCurrentDeviceProperties()->multiProcessorCount) * 32;
  const int64_t per_group = N / groups;
  int spread = 1;
  while (spread < 8 && groups * spread * 2 <= room && per_group >= int64_t(kWarpSize) * spread * 2 * 4) spread *= 2;
  return spread;
}

// Whether the backward's sort runs without CUB's cudaMemsetAsync calls (2 + one per pass: issue 29,
// 5 of a 3-pass step's 6 memsets): OnesweepSort (cuda_sort.cuh), the same CUB kernels on a scratch
// allocated before the linearize kernel, which zeroes its counters, histograms and one look-back
// area per pass. TBEGEN_SORT_NO_MEMSETS: unset, empty or "1" on, "0" off (CUB's dispatch); anything
// else refused. On by default at every size: on an H100 it gained 5-15% with TBEGEN_LONG_RUN_SCAN
// on the host-bound steps of 164k-327k indices (docs/gpu-runs/2026-12-06-landing15) and, alone, 1-2%
// on the kernel-bound steps of 5.2M indices (11 of 12 cells faster, geometric mean -1.5%,
// docs/gpu-runs/2026-12-06-landing16/sort-cuts), where it had been off under the two cuts' shared
// size rule (landing15's ~30 us there was the one scan's, not the sort's). The same sorted pairs
// either way (the same kernels in the same order; a stable sort of the same pairs), which
// tests/test_step_runtime_calls.py checks bitwise on CUDA beside the memsets it removes. Batches
// that CUB sorts in one tile (no memsets), or in several portions (2^28 pairs or more), keep CUB's
// dispatch. Read at every call.
inline bool sort_no_memsets() { return switch_or("TBEGEN_SORT_NO_MEMSETS", true); }

// Bytes of an array of `n` elements of `size` bytes carved from a shared allocation, rounded up
// to 256 so that every array starts 256-byte aligned (as an allocation of its own would).
inline int64_t slice_bytes(int64_t n, int64_t size) { return (std::max<int64_t>(n, 1) * size + 255) / 256 * 256; }

// The arrays are carved from four allocations, not one each (up to 19 per call, each a trip
// through torch's caching allocator on the host): the pairs in index order with the sort's scratch
// (both freed after the sort), each position's bag and scale (kept until step 3b; only where the
// values are positions), the sorted pairs with the update kernels' ticket counters, and the runs'
// arrays with the sorted bags and scales, the selections' scratch and the update kernels' partial
// sums.
template <typename K>
void linearize_and_sort(const Batch& b, const ForwardArgs& fa, const at::Tensor& weights, const at::Tensor& indices,
                        const at::Tensor& offsets, int64_t total_hash_size, bool check_finite, bool values_are_bags,
                        bool scaled, bool with_tickets, const int64_t* vbe_grad_offsets, bool fused_gather,
                        bool gather_in_select, int64_t partial_row_floats, bool no_memsets, bool one_scan,
                        cudaStream_t stream, PreparedBackward& out) {
  TBEGEN_CHECK(!(scaled && values_are_bags), "tbegen: internal error: scaled occurrences need their positions");
  const auto bytes_opts = weights.options().dtype(at::kByte);
  const int n = int(b.N);
  const int64_t key_bytes = slice_bytes(b.N, sizeof(K));
  const int64_t int_bytes = slice_bytes(b.N, sizeof(int32_t));
  //    (the sort of step 2, sized first: cuda_sort.cuh, 9-bit digits where they save a pass;
  //    TBEGEN_SORT_NO_MEMSETS=1: OnesweepSort, whose counters the linearize kernel zeroes, where it
  //    takes the batch, `prezeroed`; else CUB's dispatch, sort_pairs)
  const int end_bit = bits_for(total_hash_size + 1);
  const int digit_bits = sort_digit_bits(end_bit);
  PrezeroedSort<K> sort(n, end_bit, digit_bits, at::cuda::getCurrentDeviceProperties()->multiProcessorCount, stream);
  bool prezeroed = false;
  if (no_memsets) TBEGEN_CUDA_CHECK(sort.size(&prezeroed));
  size_t sort_bytes = 0;
  if (prezeroed) {
    sort_bytes = sort.bytes();
  } else {  // (sizing only: CUB reads no pointer)
    TBEGEN_CUDA_CHECK(sort_pairs<K>(nullptr, sort_bytes, nullptr, nullptr, nullptr, nullptr, n, end_bit, digit_bits,
                                    stream));
  }
  // 1. (key, value) pairs in index order, and after them the sort's scratch (one allocation, freed
  //    after the sort: the sort's own allocation until issue 29); where the values are positions,
  //    each position's bag (and scale)
  at::Tensor unsorted = at::empty({key_bytes + int_bytes + slice_bytes(int64_t(sort_bytes), 1)}, bytes_opts);
  K* keys = reinterpret_cast<K*>(unsorted.data_ptr<uint8_t>());
  int32_t* values = reinterpret_cast<int32_t*>(unsorted.data_ptr<uint8_t>() + key_bytes);
  void* sort_scratch = unsorted.data_ptr<uint8_t>() + key_bytes + int_bytes;
  const at::Tensor per_position =
      values_are_bags ? at::Tensor() : at::empty({int_bytes * (scaled ? 2 : 1)}, bytes_opts);
  int32_t* bag_of = values_are_bags ? nullptr : reinterpret_cast<int32_t*>(per_position.data_ptr<uint8_t>());
  float* scale_of = scaled ? reinterpret_cast<float*>(per_position.data_ptr<uint8_t>() + int_bytes) : nullptr;
  // (the sorted pairs' allocation, made before the linearize launch so that the kernel can zero
  // the ticket counters carved after them: with_tickets, PreparedBackward::tickets)
  at::Tensor sorted = at::empty({key_bytes + int_bytes + (with_tickets ? slice_bytes(5, sizeof(int32_t)) : 0)},
                                bytes_opts);
  K* sorted_keys = reinterpret_cast<K*>(sorted.data_ptr<uint8_t>());
  int32_t* sorted_values = reinterpret_cast<int32_t*>(sorted.data_ptr<uint8_t>() + key_bytes);
  if (with_tickets) out.tickets = reinterpret_cast<int32_t*>(sorted.data_ptr<uint8_t>() + key_bytes + int_bytes);
  const int spread = linearize_spread(b.F * b.B, b.N);
  dispatch_index(indices, [&](auto i) {
    using I = decltype(i);
    // (a VBE batch read through its padding index, Batch::pad: the kPad instantiation)
    dispatch_pad(b, [&](auto pad) {
      linearize_kernel<I, K, decltype(pad)::value>
          <<<grid_for((b.F * b.B / kWarpSize + 1) * spread), kThreads, 0, stream>>>(
              fa, indices.data_ptr<I>(), offsets.data_ptr<I>(), total_hash_size, check_finite, keys, values, bag_of,
              scale_of, spread, out.tickets, with_tickets ? 5 : 0,
              prezeroed ? static_cast<int32_t*>(sort_scratch) : nullptr,
              prezeroed ? int64_t(sort.zero_bytes() / sizeof(int32_t)) : 0);
    });
    TBEGEN_CUDA_CHECK(cudaGetLastError());
  });
  // 2. sort (key, value) pairs on the bits a key can use (the skipped-index key included); the
  //    sort is stable, so occurrences of a row stay in index order and the sums are deterministic
  if (prezeroed) {
    TBEGEN_CUDA_CHECK(sort.run(sort_scratch, keys, sorted_keys, values, sorted_values));
  } else {
    TBEGEN_CUDA_CHECK(sort_pairs<K>(sort_scratch, sort_bytes, keys, sorted_keys, values, sorted_values, n, end_bit,
                                    digit_bits, stream));
  }
  unsorted.reset();
  // 3. runs: the sorted positions where the key changes; the long runs (at most n / threshold of
  //    them), and their segments. One allocation: starts, counts [runs, long runs, work items],
  //    long_ids, segments, for step 3b the sorted bags and scales, and for step 3c the
  //    occurrences' output-gradient offsets
  const int32_t threshold = out.runs.max_segment_length_per_warp;
  out.max_long_runs = b.N / threshold + 1;
  const int64_t at_counts = int_bytes;
  const int64_t at_long_ids = at_counts + slice_bytes(4, sizeof(int32_t));  // counts [0, 3)
  const int64_t at_segments = at_long_ids + slice_bytes(out.max_long_runs, sizeof(int32_t));
  const int64_t at_bags = at_segments + slice_bytes(out.max_long_runs + 1, sizeof(int2));
  const int64_t at_scales = at_bags + (values_are_bags ? 0 : int_bytes);
  const int64_t at_grad_at = at_scales + (scaled ? int_bytes : 0);
  const int64_t at_cub = at_grad_at + (vbe_grad_offsets != nullptr ? int_bytes : 0);
  const int32_t segment_length = out.runs.segment_length;
  // each long run has at most len / segment_length + 1 segments; runs of several segments
  // (len > segment_length) at most 2 len / segment_length partial sums
  out.max_segments = b.N / segment_length + out.max_long_runs;
  out.max_partials = 2 * (b.N / segment_length) + 1;
  // The three CUB algorithms of step 3, one after the other on the stream, share one scratch area
  // (the largest any of them asks for), carved after the runs' arrays, and after it the update
  // kernels' partial sums (partial_row_floats > 0): one allocation, not three (issue 29: two
  // aten::empty fewer per backward; the scratch is now held until the backward returns, a few
  // bytes per tile). Sized first: with tmp == nullptr CUB reads no pointer, and the pointers
  // below are set once the allocation exists.
  int32_t *starts = nullptr, *counts = nullptr, *num_long = nullptr, *long_ids = nullptr;
  int2* segments = nullptr;
  // (TBEGEN_VBE_GATHER_IN_SELECT=1 on an unweighted sum VBE batch: step 3c in the run selection's
  // predicate, writing at grad_in_select, set with the other pointers below)
  const bool offsets_in_select = vbe_grad_offsets != nullptr && values_are_bags && gather_in_select;
  int32_t* grad_in_select = nullptr;
  auto select_starts = [&](void* tmp, size_t& bytes) {
    if (offsets_in_select) {
      return cub::DeviceSelect::If(tmp, bytes, thrust::counting_iterator<int32_t>(0), starts, counts, n,
                                   IsRunStartGathering<K>{sorted_keys, n, sorted_values, vbe_grad_offsets,
                                                          b.F * b.B, grad_in_select},
                                   stream);
    }
    return cub::DeviceSelect::If(tmp, bytes, thrust::counting_iterator<int32_t>(0), starts, counts, n,
                                 IsRunStart<K>{sorted_keys}, stream);
  };
  auto select_long = [&](void* tmp, size_t& bytes) {
    return cub::DeviceSelect::If(tmp, bytes, thrust::counting_iterator<int32_t>(0), long_ids, num_long, n,
                                 IsLongRun{starts, counts, n, threshold}, stream);
  };
  auto scan_segments = [&](void* tmp, size_t& bytes) {
    const SegmentsOfLongRun per_run{starts, counts, long_ids, n, segment_length};
    auto segment_counts = thrust::make_transform_iterator(thrust::counting_iterator<int32_t>(0), per_run);
    return cub::DeviceScan::ExclusiveScan(tmp, bytes, segment_counts, segments, SumInt2{}, make_int2(0, 0),
                                          int(out.max_long_runs + 1), stream);
  };
  // (TBEGEN_LONG_RUN_SCAN=1, one_scan: the last two as one scan over the runs)
  auto scan_long_runs = [&](void* tmp, size_t& bytes) {
    const LongRunOfRun of{starts, counts, n, threshold, segment_length};
    auto per_run = thrust::make_transform_iterator(thrust::counting_iterator<int32_t>(0), of);
    auto scatter = thrust::make_tabulate_output_iterator(ScatterLongRun{of, long_ids, segments, num_long});
    return cub::DeviceScan::ExclusiveScan(tmp, bytes, per_run, scatter, SumInt3{}, make_int3(0, 0, 0), n, stream);
  };
  size_t cub_bytes[3] = {0, 0, 0};
  TBEGEN_CUDA_CHECK(select_starts(nullptr, cub_bytes[0]));
  if (one_scan) {
    TBEGEN_CUDA_CHECK(scan_long_runs(nullptr, cub_bytes[1]));
  } else {
    TBEGEN_CUDA_CHECK(select_long(nullptr, cub_bytes[1]));
    TBEGEN_CUDA_CHECK(scan_segments(nullptr, cub_bytes[2]));
  }
  const int64_t at_partial = at_cub + slice_bytes(int64_t(std::max({cub_bytes[0], cub_bytes[1], cub_bytes[2]})), 1);
  const int64_t partial_bytes =
      partial_row_floats > 0 ? slice_bytes(std::max<int64_t>(out.max_partials, 1) * partial_row_floats, sizeof(float))
                             : 0;
  at::Tensor run_storage = at::empty({at_partial + partial_bytes}, bytes_opts);
  uint8_t* base = run_storage.data_ptr<uint8_t>();
  starts = reinterpret_cast<int32_t*>(base);
  counts = reinterpret_cast<int32_t*>(base + at_counts);
  num_long = counts + 1;
  long_ids = reinterpret_cast<int32_t*>(base + at_long_ids);
  segments = reinterpret_cast<int2*>(base + at_segments);
  int32_t* sorted_bag = values_are_bags ? sorted_values : reinterpret_cast<int32_t*>(base + at_bags);
  float* sorted_scale = scaled ? reinterpret_cast<float*>(base + at_scales) : nullptr;
  int32_t* grad_at = vbe_grad_offsets != nullptr ? reinterpret_cast<int32_t*>(base + at_grad_at) : nullptr;
  if (partial_row_floats > 0) out.partial = reinterpret_cast<float*>(base + at_partial);
  grad_in_select = grad_at;
  // (the stream runs them in order, so none touches the scratch while another does)
  void* cub_scratch = base + at_cub;
  TBEGEN_CUDA_CHECK(select_starts(cub_scratch, cub_bytes[0]));
  if (one_scan) {
    TBEGEN_CUDA_CHECK(scan_long_runs(cub_scratch, cub_bytes[1]));
  } else {
    TBEGEN_CUDA_CHECK(select_long(cub_scratch, cub_bytes[1]));
    TBEGEN_CUDA_CHECK(scan_segments(cub_scratch, cub_bytes[2]));
  }

  // 3b. each occurrence's bag and scale in sorted order, when the values were positions; with
  //     fused_gather (TBEGEN_VBE_FUSED_GATHER=1) also 3c's offsets
  const bool offsets_in_3b = grad_at != nullptr && !values_are_bags && fused_gather;
  if (offsets_in_3b) {
    gather_occurrences_kernel<true><<<grid_for(b.N / kWarpSize + 1), kThreads, 0, stream>>>(
        b.N, sorted_values, bag_of, scale_of, sorted_bag, sorted_scale, b.F * b.B, vbe_grad_offsets, grad_at);
    TBEGEN_CUDA_CHECK(cudaGetLastError());
  } else if (!values_are_bags) {
    gather_occurrences_kernel<false><<<grid_for(b.N / kWarpSize + 1), kThreads, 0, stream>>>(
        b.N, sorted_values, bag_of, scale_of, sorted_bag, sorted_scale, 0, nullptr, nullptr);
    TBEGEN_CUDA_CHECK(cudaGetLastError());
  }
  // 3c. (VBE, TBEGEN_VBE_GRAD_OFFSETS=1) each occurrence's output-gradient offset in sorted order
  if (grad_at != nullptr && !offsets_in_3b && !offsets_in_select) {
    gather_grad_offsets_kernel<<<grid_for(b.N / kWarpSize + 1), kThreads, 0, stream>>>(b.N, b.F * b.B, sorted_bag,
                                                                                       vbe_grad_offsets, grad_at);
    TBEGEN_CUDA_CHECK(cudaGetLastError());
  }

  out.runs.keys = sorted_keys;
  out.runs.wide_keys = sizeof(K) == 8;
  out.runs.starts = starts;
  out.runs.counts = counts;
  out.runs.long_ids = long_ids;
  out.runs.segments = segments;
  out.runs.n = n;
  // (read for pooling none only; a VBE batch's gathered offsets stand in for the positions)
  out.occurrences.position = grad_at != nullptr ? grad_at : sorted_values;
  out.grad_offsets = grad_at != nullptr;
  out.occurrences.bag = sorted_bag;
  out.occurrences.scale = sorted_scale;
  out.storage = {sorted, run_storage};
}

// Step 4 (work_items): each run's items, from the exclusive scan of ItemsOfRun (`first`): item i's
// first sorted position and partial-sum slot; the last item's end (n) after it, and the number of
// items in counts[2]. One thread per run (a hot run writes its segments in turn).
static __global__ void __launch_bounds__(256) build_work_items_kernel(const int32_t* __restrict__ starts, int32_t* counts,
                                                                      int32_t n, const int2* __restrict__ first,
                                                                      int32_t length, int32_t* item_start,
                                                                      int32_t* item_partial) {
  const int32_t runs = counts[0];
  for (int64_t r = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; r < runs; r += int64_t(gridDim.x) * blockDim.x) {
    // (run r's items and partial sums are the scan's differences: ItemsOfRun counted them)
    const int32_t s = starts[r];
    const int2 f = first[r], next = first[r + 1];
    const bool several = next.y > f.y;  // (a run of several segments: one partial sum each)
    for (int32_t j = 0; j < next.x - f.x; ++j) {
      item_start[f.x + j] = s + j * length;
      item_partial[f.x + j] = several ? f.y + j : -1;
    }
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    const int32_t total = first[runs].x;
    item_start[total] = n;
    counts[2] = total;
  }
}

// Step 4: the single work list of the any-width update (WorkItems), from the runs found in step 3.
static void prepare_work_items(const at::Tensor& like, cudaStream_t stream, PreparedBackward& out) {
  const int32_t n = out.runs.n;
  // (at most n runs, so at most n items: a scan of n + 1 entries ends with the total)
  const int64_t at_start = slice_bytes(int64_t(n) + 1, sizeof(int2));
  const int64_t at_partial = at_start + slice_bytes(int64_t(n) + 1, sizeof(int32_t));
  at::Tensor storage = at::empty({at_partial + slice_bytes(n, sizeof(int32_t))}, like.options().dtype(at::kByte));
  uint8_t* base = storage.data_ptr<uint8_t>();
  int2* first = reinterpret_cast<int2*>(base);
  int32_t* item_start = reinterpret_cast<int32_t*>(base + at_start);
  int32_t* item_partial = reinterpret_cast<int32_t*>(base + at_partial);
  int32_t* counts = const_cast<int32_t*>(out.runs.counts);
  const ItemsOfRun per_run{out.runs.starts, counts, n, out.runs.max_segment_length_per_warp, out.runs.segment_length};
  auto item_counts = thrust::make_transform_iterator(thrust::counting_iterator<int32_t>(0), per_run);
  run_cub(like, [&](void* tmp, size_t& bytes) {
    return cub::DeviceScan::ExclusiveScan(tmp, bytes, item_counts, first, SumInt2{}, make_int2(0, 0), int(n) + 1,
                                          stream);
  });
  build_work_items_kernel<<<grid_for(int64_t(n) / kWarpSize + 1), kThreads, 0, stream>>>(
      out.runs.starts, counts, n, first, out.runs.segment_length, item_start, item_partial);
  TBEGEN_CUDA_CHECK(cudaGetLastError());
  out.items.start = item_start;
  out.items.partial = item_partial;
  out.items.total = counts + 2;
  out.storage.push_back(storage);
}

PreparedBackward prepare_backward(const Batch& b, const at::Tensor& grad_output, const at::Tensor& weights,
                                  const at::Tensor& features, int64_t total_hash_size, const at::Tensor& indices,
                                  const at::Tensor& offsets, const c10::optional<at::Tensor>& per_sample_weights,
                                  int64_t max_segment_length_per_warp, const at::Tensor& error, bool check_finite,
                                  bool with_tickets, const int64_t* vbe_grad_offsets, int32_t segment_length,
                                  bool work_items, int64_t partial_row_floats) {
  const auto stream = at::cuda::getCurrentCUDAStream();
  PreparedBackward out;
  TBEGEN_CHECK(segment_length >= 1, "tbegen: segment_length must be >= 1, got ", segment_length);
  out.runs.max_segment_length_per_warp = int32_t(std::min<int64_t>(max_segment_length_per_warp, INT32_MAX));
  out.runs.segment_length = segment_length;
  out.runs.skipped_key = total_hash_size;

  // (TBEGEN_SORT_NO_MEMSETS, TBEGEN_LONG_RUN_SCAN: read, and a bad value refused, before anything
  // is launched)
  const bool no_memsets = sort_no_memsets(), one_scan = long_run_scan(b.N);
  // The finite check of grad_output reads it once, on a side stream, while the batch is sorted.
  const c10::DeviceIndex device = weights.device().index();
  const at::cuda::CUDAStream side = at::cuda::getStreamFromPool(false, device);
  // (cuda_ops.cuh: this thread's events, reused by every call)
  const cudaEvent_t forked = call_event(kEventPrepFork, device), checked = call_event(kEventPrepChecked, device);
  if (check_finite && grad_output.numel() > 0) {
    order_after(forked, stream, side);
    const int64_t n4 = grad_output.numel() / 4 + 1;
    const int blocks = int(std::min<int64_t>((n4 + kThreads - 1) / kThreads,
                                             int64_t(at::cuda::getCurrentDeviceProperties()->multiProcessorCount) * 8));
    check_finite_kernel<<<blocks, kThreads, 0, side.stream()>>>(grad_output.numel(), grad_output.data_ptr<float>(),
                                                                error.data_ptr<int64_t>());
    TBEGEN_CUDA_CHECK(cudaGetLastError());
    record_event(checked, side);
  }

  const bool scaled = b.weighted || b.pooling == kPoolMean;
  // sum/mean pooling without per-sample weights needs only each occurrence's bag
  const bool values_are_bags = !scaled && b.pooling != kPoolNone;
  TBEGEN_CHECK(vbe_grad_offsets == nullptr || b.pooling != kPoolNone,
               "tbegen: internal error: VBE gradient offsets for a batch without pooling");
  // (read, and a bad value refused, at every call that gathers offsets, whichever the pooling)
  const bool fused_gather = vbe_grad_offsets != nullptr && vbe_fused_gather();
  const bool gather_in_select = vbe_grad_offsets != nullptr && vbe_gather_in_select();
  const ForwardArgs fa = forward_args(b, features, weights, per_sample_weights, nullptr, error);
  if (total_hash_size + 1 <= int64_t(INT32_MAX)) {
    linearize_and_sort<int32_t>(b, fa, weights, indices, offsets, total_hash_size, check_finite, values_are_bags,
                                scaled, with_tickets, vbe_grad_offsets, fused_gather, gather_in_select,
                                partial_row_floats, no_memsets, one_scan, stream, out);
  } else {
    linearize_and_sort<int64_t>(b, fa, weights, indices, offsets, total_hash_size, check_finite, values_are_bags,
                                scaled, with_tickets, vbe_grad_offsets, fused_gather, gather_in_select,
                                partial_row_floats, no_memsets, one_scan, stream, out);
  }
  // (the list's scan takes n + 1 entries as an int: a batch of 2^31 - 1 indices keeps the two
  // kernels, which give the same bits)
  if (work_items && b.N > 0 && b.N < int64_t(INT32_MAX)) prepare_work_items(weights, stream, out);
  if (check_finite && grad_output.numel() > 0) wait_event(checked, stream);
  return out;
}

}  // namespace cuda
}  // namespace tbegen
