// tbegen runtime: host side of the CUDA operators, shared by every optimizer: argument checks
// (host.h), launches of the kernels (cuda_kernels.cuh) on the current stream, and the errors the
// kernels recorded. The fused backward is here; forward and the per-sample-weight gradient are in
// cuda_forward_ops.cuh, compiled in their own translation unit so the two build in parallel.
#pragma once

#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <cub/cub.cuh>
#include <thrust/iterator/counting_iterator.h>

#include "tbegen/cuda_kernels.cuh"
#include "tbegen/host.h"

namespace tbegen {
namespace cuda {

#define TBEGEN_CUDA_CHECK(expr)                                                             \
  do {                                                                                      \
    const cudaError_t tbegen_err = (expr);                                                  \
    TBEGEN_CHECK(tbegen_err == cudaSuccess, "tbegen: CUDA error ", cudaGetErrorString(tbegen_err), \
                " at " __FILE__ ":", __LINE__);                                            \
  } while (0)

// kVecs = 4-wide slices per lane: the smallest of 1, 2, 4, 8 that covers max_D columns.
template <typename Body>
void dispatch_vecs(int64_t max_D, Body&& body) {
  if (max_D <= 128) {
    body(std::integral_constant<int, 1>{});
  } else if (max_D <= 256) {
    body(std::integral_constant<int, 2>{});
  } else if (max_D <= 512) {
    body(std::integral_constant<int, 4>{});
  } else {
    body(std::integral_constant<int, 8>{});
  }
}

template <typename Body>
void dispatch_weights(const at::Tensor& weights, Body&& body) {
  switch (weights.scalar_type()) {
    case at::kFloat: body(float{}); break;
    case at::kHalf: body(c10::Half{}); break;
    case at::kBFloat16: body(c10::BFloat16{}); break;
    default: TBEGEN_CHECK(false, "tbegen: unsupported weights dtype ", weights.scalar_type());
  }
}

template <typename Body>
void dispatch_index(const at::Tensor& indices, Body&& body) {
  if (indices.scalar_type() == at::kInt) {
    body(int32_t{});
  } else {
    body(int64_t{});
  }
}

constexpr int kThreads = 256;

inline int grid_for(int64_t warps_of_work) {
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t blocks = (warps_of_work + kThreads / kWarpSize - 1) / (kThreads / kWarpSize);
  return int(std::max<int64_t>(1, std::min<int64_t>(blocks, int64_t(sms) * 32)));
}

inline ForwardArgs forward_args(const Batch& b, const at::Tensor& features, const at::Tensor& weights,
                                const c10::optional<at::Tensor>& psw, float* out, const at::Tensor& error) {
  ForwardArgs a;
  a.feat = features.data_ptr<int64_t>();
  a.F = b.F;
  a.B = b.B;
  a.N = b.N;
  a.total_D = b.total_D;
  a.max_D = b.max_D;
  a.weights_numel = weights.numel();
  a.psw = psw.has_value() ? psw->data_ptr<float>() : nullptr;
  a.pooling = b.pooling;
  a.out = out;
  a.error = error.data_ptr<int64_t>();
  return a;
}

inline at::Tensor new_error_record(const at::Tensor& like) {
  return at::zeros({3}, like.options().dtype(at::kLong));
}

// Runs a CUB algorithm twice: once to size its scratch space, once with scratch from torch's
// caching allocator.
template <typename Algorithm>
void run_cub(const at::Tensor& like, Algorithm&& algorithm) {
  size_t bytes = 0;
  TBEGEN_CUDA_CHECK(algorithm(nullptr, bytes));
  at::Tensor scratch = at::empty({int64_t(std::max<size_t>(bytes, 1))}, like.options().dtype(at::kByte));
  TBEGEN_CUDA_CHECK(algorithm(scratch.data_ptr(), bytes));
}

// The backward pass with the optimizer `Opt` fused in (docs/algorithm.md):
// linearise -> radix sort on the key bits -> run-length encode -> update each unique row once,
// by a warp (short runs) or a whole block (runs of at least max_segment_length_per_warp).
template <class Opt>
void backward_cuda(const at::Tensor& grad_output, const at::Tensor& weights, const at::Tensor& features,
                   int64_t total_D, int64_t max_D, int64_t total_hash_size, const at::Tensor& indices,
                   const at::Tensor& offsets, const c10::optional<at::Tensor>& per_sample_weights,
                   int64_t pooling, int64_t max_segment_length_per_warp, const typename Opt::Params& params,
                   const RowUpdateContext& ctx) {
  const Batch b = check_batch(weights, features, total_D, max_D, indices, offsets, per_sample_weights, pooling);
  const c10::cuda::CUDAGuard guard(weights.device());
  check_grad_output(b, grad_output, weights);
  TBEGEN_CHECK(total_hash_size >= 1, "tbegen: total_hash_size must be positive, got ", total_hash_size);
  TBEGEN_CHECK(max_segment_length_per_warp >= 1, "tbegen: max_segment_length_per_warp must be >= 1");
  if (b.N == 0) return;
  const auto stream = at::cuda::getCurrentCUDAStream();
  const auto opts = weights.options();
  const int n = int(b.N);
  const at::Tensor error = new_error_record(weights);

  // 1. linearise
  at::Tensor keys = at::empty({b.N}, opts.dtype(at::kLong));
  at::Tensor positions = at::empty({b.N}, opts.dtype(at::kInt));
  at::Tensor bag_of = at::empty({b.N}, opts.dtype(at::kInt));
  const bool scaled = b.weighted || pooling == kPoolMean;
  at::Tensor scale_of = scaled ? at::empty({b.N}, opts.dtype(at::kFloat)) : at::Tensor();
  const ForwardArgs fa = forward_args(b, features, weights, per_sample_weights, nullptr, error);
  dispatch_index(indices, [&](auto i) {
    using I = decltype(i);
    linearize_kernel<I><<<grid_for(b.F * b.B), kThreads, 0, stream>>>(
        fa, indices.data_ptr<I>(), offsets.data_ptr<I>(), total_hash_size, keys.data_ptr<int64_t>(),
        positions.data_ptr<int32_t>(), bag_of.data_ptr<int32_t>(),
        scaled ? scale_of.data_ptr<float>() : nullptr);
    TBEGEN_CUDA_CHECK(cudaGetLastError());
  });

  // 2. sort (key, position) pairs on the bits a key can use; the sort is stable, so occurrences
  //    of a row stay in index order and the gradient sums are deterministic
  at::Tensor sorted_keys = at::empty_like(keys);
  at::Tensor sorted_positions = at::empty_like(positions);
  const int end_bit = bits_for(total_hash_size);
  run_cub(weights, [&](void* tmp, size_t& bytes) {
    return cub::DeviceRadixSort::SortPairs(tmp, bytes, keys.data_ptr<int64_t>(), sorted_keys.data_ptr<int64_t>(),
                                           positions.data_ptr<int32_t>(), sorted_positions.data_ptr<int32_t>(),
                                           n, 0, end_bit, stream);
  });

  // 3. run-length encode: one run per unique row
  at::Tensor unique_keys = at::empty_like(keys);
  at::Tensor lengths = at::zeros({b.N}, opts.dtype(at::kInt));
  at::Tensor starts = at::empty({b.N}, opts.dtype(at::kInt));
  at::Tensor counters = at::zeros({2}, opts.dtype(at::kInt));  // [num_runs, num_long]
  int32_t* num_runs = counters.data_ptr<int32_t>();
  int32_t* num_long = num_runs + 1;
  run_cub(weights, [&](void* tmp, size_t& bytes) {
    return cub::DeviceRunLengthEncode::Encode(tmp, bytes, sorted_keys.data_ptr<int64_t>(),
                                              unique_keys.data_ptr<int64_t>(), lengths.data_ptr<int32_t>(),
                                              num_runs, n, stream);
  });
  run_cub(weights, [&](void* tmp, size_t& bytes) {
    return cub::DeviceScan::ExclusiveSum(tmp, bytes, lengths.data_ptr<int32_t>(), starts.data_ptr<int32_t>(), n,
                                         stream);
  });
  // hot rows go to the block kernel
  const int32_t threshold = int32_t(std::min<int64_t>(max_segment_length_per_warp, INT32_MAX));
  at::Tensor long_ids = at::empty({b.N}, opts.dtype(at::kInt));
  const IsLongRun is_long{lengths.data_ptr<int32_t>(), num_runs, threshold};
  run_cub(weights, [&](void* tmp, size_t& bytes) {
    return cub::DeviceSelect::If(tmp, bytes, thrust::counting_iterator<int32_t>(0), long_ids.data_ptr<int32_t>(),
                                 num_long, n, is_long, stream);
  });

  // 3b. each occurrence's bag and scale, in sorted order
  at::Tensor sorted_bag = at::empty({b.N}, opts.dtype(at::kInt));
  at::Tensor sorted_scale = scaled ? at::empty({b.N}, opts.dtype(at::kFloat)) : at::Tensor();
  gather_occurrences_kernel<<<grid_for(b.N / kWarpSize + 1), kThreads, 0, stream>>>(
      b.N, sorted_positions.data_ptr<int32_t>(), bag_of.data_ptr<int32_t>(),
      scaled ? scale_of.data_ptr<float>() : nullptr, sorted_bag.data_ptr<int32_t>(),
      scaled ? sorted_scale.data_ptr<float>() : nullptr);
  TBEGEN_CUDA_CHECK(cudaGetLastError());

  // 4. sum each unique row's gradient and update it
  BackwardArgs a;
  a.feat = features.data_ptr<int64_t>();
  a.B = b.B;
  a.total_D = b.total_D;
  a.max_D = b.max_D;
  a.pooling = pooling;
  a.grad_output = grad_output.data_ptr<float>();
  a.error = error.data_ptr<int64_t>();
  Runs r;
  r.keys = unique_keys.data_ptr<int64_t>();
  r.starts = starts.data_ptr<int32_t>();
  r.lengths = lengths.data_ptr<int32_t>();
  r.num_runs = num_runs;
  r.long_ids = long_ids.data_ptr<int32_t>();
  r.num_long = num_long;
  r.max_segment_length_per_warp = threshold;
  Occurrences o;
  o.position = sorted_positions.data_ptr<int32_t>();
  o.bag = sorted_bag.data_ptr<int32_t>();
  o.scale = scaled ? sorted_scale.data_ptr<float>() : nullptr;

  // The two update kernels touch disjoint rows, so they run concurrently: the hot rows' block
  // kernel on a side stream, forked after step 3b and joined back before anything else runs on
  // the caller's stream (so neither kernel's tail waits for the other, and the scratch tensors
  // freed at the end of this function are not reused before both are done).
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const at::cuda::CUDAStream side = at::cuda::getStreamFromPool(false, weights.device().index());
  at::cuda::CUDAEvent forked, joined;
  forked.record(stream);
  forked.block(side);
  dispatch_weights(weights, [&](auto w) {
    using W = decltype(w);
    W* wptr = weights.data_ptr<W>();
    dispatch_vecs(b.max_D, [&](auto vecs) {
      constexpr int kVecs = decltype(vecs)::value;
      constexpr int kBlockThreads = block_kernel_warps<kVecs>() * kWarpSize;
      const int long_blocks = int(std::min<int64_t>(b.N / threshold + 1, int64_t(sms) * 4));
      const size_t smem = size_t(kBlockThreads / kWarpSize) * kVecs * 128 * sizeof(float);
      backward_block_kernel<Opt, W, kVecs><<<long_blocks, kBlockThreads, smem, side.stream()>>>(a, r, o, params, ctx, wptr);
      TBEGEN_CUDA_CHECK(cudaGetLastError());
      backward_warp_kernel<Opt, W, kVecs><<<grid_for(b.N / kWarpSize + 1), kThreads, 0, stream>>>(a, r, o, params, ctx, wptr);
      TBEGEN_CUDA_CHECK(cudaGetLastError());
    });
  });
  joined.record(side);
  joined.block(stream);
  raise_kernel_error(error);
}

}  // namespace cuda
}  // namespace tbegen
