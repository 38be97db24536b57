// tbegen runtime: the definition of prepare_backward (declared in cuda_backward_prep.cuh).
// Included by cuda_forward.cu only, so that it is compiled once for every optimizer.
#pragma once

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

// Predicate of the long-run selection: run i exists and has at least `threshold` occurrences.
struct IsLongRun {
  const int32_t* starts;
  const int32_t* counts;
  int32_t n;
  int32_t threshold;
  __device__ __forceinline__ bool operator()(int32_t i) const {
    const int32_t runs = counts[0];
    if (i >= runs) return false;
    const int32_t end = i + 1 < runs ? starts[i + 1] : n;
    return end - starts[i] >= threshold;
  }
};

// Long run k's (segments, partial-sum slots): a run of one segment needs no partial sums.
struct SegmentsOfLongRun {
  const int32_t* starts;
  const int32_t* counts;
  const int32_t* long_ids;
  int32_t n;
  __device__ __forceinline__ int2 operator()(int32_t k) const {
    if (k >= counts[1]) return make_int2(0, 0);
    const int32_t run = long_ids[k];
    const int32_t end = run + 1 < counts[0] ? starts[run + 1] : n;
    const int32_t segments = (end - starts[run] + kSegmentLength - 1) / kSegmentLength;
    return make_int2(segments, segments > 1 ? segments : 0);
  }
};

struct SumInt2 {
  __device__ __forceinline__ int2 operator()(const int2& x, const int2& y) const {
    return make_int2(x.x + y.x, x.y + y.y);
  }
};

// Step 3b when the values sorted were positions: each occurrence's bag and scale in sorted order.
static __global__ void __launch_bounds__(256) gather_occurrences_kernel(int64_t n, const int32_t* __restrict__ sorted_positions,
                                                                        const int32_t* __restrict__ bag_of,
                                                                        const float* __restrict__ scale_of,
                                                                        int32_t* sorted_bag, float* sorted_scale) {
  for (int64_t j = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; j < n; j += int64_t(gridDim.x) * blockDim.x) {
    // (clamped: after malformed offsets some positions are never written, and nothing is updated)
    const int32_t pos = min(max(sorted_positions[j], 0), int32_t(n - 1));
    sorted_bag[j] = bag_of[pos];
    if (scale_of) sorted_scale[j] = scale_of[pos];
  }
}

template <typename K>
void linearize_and_sort(const Batch& b, const ForwardArgs& fa, const at::Tensor& weights, const at::Tensor& indices,
                        const at::Tensor& offsets, int64_t total_hash_size, bool check_finite, bool values_are_bags,
                        bool scaled, cudaStream_t stream, PreparedBackward& out) {
  const auto opts = weights.options();
  const int n = int(b.N);
  at::Tensor keys = at::empty({b.N}, opts.dtype(sizeof(K) == 8 ? at::kLong : at::kInt));
  at::Tensor values = at::empty({b.N}, opts.dtype(at::kInt));
  at::Tensor bag_of = values_are_bags ? at::Tensor() : at::empty({b.N}, opts.dtype(at::kInt));
  at::Tensor scale_of = scaled ? at::empty({b.N}, opts.dtype(at::kFloat)) : at::Tensor();
  dispatch_index(indices, [&](auto i) {
    using I = decltype(i);
    linearize_kernel<I, K><<<grid_for(b.F * b.B / kWarpSize + 1), kThreads, 0, stream>>>(
        fa, indices.data_ptr<I>(), offsets.data_ptr<I>(), total_hash_size, check_finite,
        reinterpret_cast<K*>(keys.data_ptr()), values.data_ptr<int32_t>(),
        values_are_bags ? nullptr : bag_of.data_ptr<int32_t>(), scaled ? scale_of.data_ptr<float>() : nullptr);
    TBEGEN_CUDA_CHECK(cudaGetLastError());
  });
  // 2. sort (key, value) pairs on the bits a key can use (the skipped-index key included); the
  //    sort is stable, so occurrences of a row stay in index order and the sums are deterministic
  at::Tensor sorted_keys = at::empty_like(keys);
  at::Tensor sorted_values = at::empty_like(values);
  //    (cuda_sort.cuh: 9-bit digits where they save a pass)
  const int end_bit = bits_for(total_hash_size + 1);
  const int digit_bits = sort_digit_bits(end_bit);
  run_cub(weights, [&](void* tmp, size_t& bytes) {
    return sort_pairs<K>(tmp, bytes, reinterpret_cast<const K*>(keys.data_ptr()),
                         reinterpret_cast<K*>(sorted_keys.data_ptr()), values.data_ptr<int32_t>(),
                         sorted_values.data_ptr<int32_t>(), n, end_bit, digit_bits, stream);
  });
  keys.reset();
  values.reset();
  // 3. runs: the sorted positions where the key changes
  at::Tensor starts = at::empty({b.N}, opts.dtype(at::kInt));
  at::Tensor counts = at::empty({2}, opts.dtype(at::kInt));  // [runs, long runs]
  const IsRunStart<K> is_start{reinterpret_cast<const K*>(sorted_keys.data_ptr())};
  run_cub(weights, [&](void* tmp, size_t& bytes) {
    return cub::DeviceSelect::If(tmp, bytes, thrust::counting_iterator<int32_t>(0), starts.data_ptr<int32_t>(),
                                 counts.data_ptr<int32_t>(), n, is_start, stream);
  });
  // the long runs (at most n / threshold of them), and their segments
  const int32_t threshold = out.runs.max_segment_length_per_warp;
  out.max_long_runs = b.N / threshold + 1;
  at::Tensor long_ids = at::empty({out.max_long_runs}, opts.dtype(at::kInt));
  const IsLongRun is_long{starts.data_ptr<int32_t>(), counts.data_ptr<int32_t>(), n, threshold};
  run_cub(weights, [&](void* tmp, size_t& bytes) {
    return cub::DeviceSelect::If(tmp, bytes, thrust::counting_iterator<int32_t>(0), long_ids.data_ptr<int32_t>(),
                                 counts.data_ptr<int32_t>() + 1, n, is_long, stream);
  });
  at::Tensor segments = at::empty({(out.max_long_runs + 1) * 2}, opts.dtype(at::kInt));
  const SegmentsOfLongRun per_run{starts.data_ptr<int32_t>(), counts.data_ptr<int32_t>(), long_ids.data_ptr<int32_t>(), n};
  auto segment_counts = thrust::make_transform_iterator(thrust::counting_iterator<int32_t>(0), per_run);
  int2* segments_ptr = reinterpret_cast<int2*>(segments.data_ptr<int32_t>());
  run_cub(weights, [&](void* tmp, size_t& bytes) {
    return cub::DeviceScan::ExclusiveScan(tmp, bytes, segment_counts, segments_ptr, SumInt2{}, make_int2(0, 0),
                                          int(out.max_long_runs + 1), stream);
  });
  // each long run has at most len / kSegmentLength + 1 segments; runs of several segments
  // (len > kSegmentLength) at most 2 len / kSegmentLength partial sums
  out.max_segments = b.N / kSegmentLength + out.max_long_runs;
  out.max_partials = 2 * (b.N / kSegmentLength) + 1;

  // 3b. each occurrence's bag and scale in sorted order, when the values were positions
  at::Tensor sorted_bag = values_are_bags ? sorted_values : at::empty({b.N}, opts.dtype(at::kInt));
  at::Tensor sorted_scale = scaled ? at::empty({b.N}, opts.dtype(at::kFloat)) : at::Tensor();
  if (!values_are_bags) {
    gather_occurrences_kernel<<<grid_for(b.N / kWarpSize + 1), kThreads, 0, stream>>>(
        b.N, sorted_values.data_ptr<int32_t>(), bag_of.data_ptr<int32_t>(),
        scaled ? scale_of.data_ptr<float>() : nullptr, sorted_bag.data_ptr<int32_t>(),
        scaled ? sorted_scale.data_ptr<float>() : nullptr);
    TBEGEN_CUDA_CHECK(cudaGetLastError());
  }

  out.runs.keys = sorted_keys.data_ptr();
  out.runs.wide_keys = sizeof(K) == 8;
  out.runs.starts = starts.data_ptr<int32_t>();
  out.runs.counts = counts.data_ptr<int32_t>();
  out.runs.long_ids = long_ids.data_ptr<int32_t>();
  out.runs.segments = segments_ptr;
  out.runs.n = n;
  out.occurrences.position = sorted_values.data_ptr<int32_t>();  // (read for pooling none only)
  out.occurrences.bag = sorted_bag.data_ptr<int32_t>();
  out.occurrences.scale = scaled ? sorted_scale.data_ptr<float>() : nullptr;
  out.storage = {sorted_keys, sorted_values, starts, counts, long_ids, segments, sorted_bag, sorted_scale};
}

PreparedBackward prepare_backward(const Batch& b, const at::Tensor& grad_output, const at::Tensor& weights,
                                  const at::Tensor& features, int64_t total_hash_size, const at::Tensor& indices,
                                  const at::Tensor& offsets, const c10::optional<at::Tensor>& per_sample_weights,
                                  int64_t max_segment_length_per_warp, const at::Tensor& error, bool check_finite) {
  const auto stream = at::cuda::getCurrentCUDAStream();
  PreparedBackward out;
  out.runs.max_segment_length_per_warp = int32_t(std::min<int64_t>(max_segment_length_per_warp, INT32_MAX));
  out.runs.skipped_key = total_hash_size;

  // The finite check of grad_output reads it once, on a side stream, while the batch is sorted.
  const at::cuda::CUDAStream side = at::cuda::getStreamFromPool(false, weights.device().index());
  at::cuda::CUDAEvent forked, checked;
  if (check_finite && grad_output.numel() > 0) {
    forked.record(stream);
    forked.block(side);
    const int64_t n4 = grad_output.numel() / 4 + 1;
    const int blocks = int(std::min<int64_t>((n4 + kThreads - 1) / kThreads,
                                             int64_t(at::cuda::getCurrentDeviceProperties()->multiProcessorCount) * 8));
    check_finite_kernel<<<blocks, kThreads, 0, side.stream()>>>(grad_output.numel(), grad_output.data_ptr<float>(),
                                                                error.data_ptr<int64_t>());
    TBEGEN_CUDA_CHECK(cudaGetLastError());
    checked.record(side);
  }

  const bool scaled = b.weighted || b.pooling == kPoolMean;
  // sum/mean pooling without per-sample weights needs only each occurrence's bag
  const bool values_are_bags = !scaled && b.pooling != kPoolNone;
  const ForwardArgs fa = forward_args(b, features, weights, per_sample_weights, nullptr, error);
  if (total_hash_size + 1 <= int64_t(INT32_MAX)) {
    linearize_and_sort<int32_t>(b, fa, weights, indices, offsets, total_hash_size, check_finite, values_are_bags,
                                scaled, stream, out);
  } else {
    linearize_and_sort<int64_t>(b, fa, weights, indices, offsets, total_hash_size, check_finite, values_are_bags,
                                scaled, stream, out);
  }
  if (check_finite && grad_output.numel() > 0) checked.block(stream);
  return out;
}

}  // namespace cuda
}  // namespace tbegen
