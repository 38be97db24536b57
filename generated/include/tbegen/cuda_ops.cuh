// tbegen runtime: host side of the CUDA operators, shared by every optimizer: argument checks
// (host.h), launches of the kernels (cuda_kernels.cuh) on the current stream, and the errors the
// kernels recorded. The host side of the fused backward is here; forward and the per-sample-weight
// gradient are in cuda_forward_ops.cuh. All of it is compiled once, in cuda_forward.cu, for every
// optimizer: an optimizer's own CUDA code is only its update kernels (cuda_backward_kernels.cuh),
// which backward_cuda launches through the table the optimizer's extension passes in.
#pragma once

#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <cub/cub.cuh>
#include <thrust/iterator/counting_iterator.h>

#include "tbegen/cuda_backward.h"
#include "tbegen/cuda_backward_kernels.cuh"
#include "tbegen/cuda_backward_prep.cuh"
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

// The error record a call writes to: the caller's, or a fresh one that the call reads back itself
// before returning (raising what it says).
inline at::Tensor error_record_for(const c10::optional<at::Tensor>& given, const at::Tensor& like) {
  return given.has_value() ? *given : at::zeros({kErrRecordSize}, like.options().dtype(at::kLong));
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

// The backward pass with an optimizer fused in (docs/algorithm.md): prepare_backward sorts and
// segments the batch, then the optimizer's update kernels (`kernels`, launched with its `params`:
// see cuda_backward.h) sum each unique row's gradient and update it once: one warp per short
// run, and for long runs (hot rows) one warp per segment followed by one warp per run of several
// segments. Nothing here waits for the GPU when the caller passes an error record.
// (Defined here, not inline: this header is compiled in cuda_forward.cu only.)
__attribute__((visibility("hidden"))) void backward_cuda(
    const at::Tensor& grad_output, const at::Tensor& weights, const at::Tensor& features, int64_t total_D,
    int64_t max_D, int64_t total_hash_size, const at::Tensor& indices, const at::Tensor& offsets,
    const c10::optional<at::Tensor>& per_sample_weights, int64_t pooling, int64_t max_segment_length_per_warp,
    const void* params, const BackwardKernels& kernels, const RowUpdateContext& ctx,
    const c10::optional<at::Tensor>& error_record, bool skip_bad_indices, bool check_finite) {
  const Batch b = check_batch(weights, features, total_D, max_D, indices, offsets, per_sample_weights, pooling);
  const c10::cuda::CUDAGuard guard(weights.device());
  check_grad_output(b, grad_output, weights);
  check_error_record(error_record, weights);
  TBEGEN_CHECK(total_hash_size >= 1, "tbegen: total_hash_size must be positive, got ", total_hash_size);
  TBEGEN_CHECK(max_segment_length_per_warp >= 1, "tbegen: max_segment_length_per_warp must be >= 1");
  if (b.N == 0) return;
  const auto stream = at::cuda::getCurrentCUDAStream();
  const at::Tensor error = error_record_for(error_record, weights);

  const PreparedBackward prep = prepare_backward(b, grad_output, weights, features, total_hash_size, indices, offsets,
                                                 per_sample_weights, max_segment_length_per_warp, error, check_finite);

  BackwardArgs a;
  a.feat = features.data_ptr<int64_t>();
  a.B = b.B;
  a.total_D = b.total_D;
  a.max_D = b.max_D;
  a.pooling = pooling;
  a.grad_output = grad_output.data_ptr<float>();
  a.error = error.data_ptr<int64_t>();
  a.skip_bad_indices = skip_bad_indices;

  // The long runs' kernels run on a side stream, concurrently with the short runs' kernel (they
  // touch disjoint rows), forked here and joined back before anything else runs on the caller's
  // stream (so neither kernel's tail waits for the other, and the scratch tensors freed at the end
  // of this function are not reused before both are done).
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
      at::Tensor partial = at::empty({std::max<int64_t>(prep.max_partials, 1) * kVecs * 128}, weights.options().dtype(at::kFloat));
      BackwardLaunch l{a, prep.runs, prep.occurrences, params, ctx, wptr, partial.data_ptr<float>()};
      // (grids sized by bounds: the real counts are on the device, and idle warps exit at once)
      l.segment_blocks = int(std::min<int64_t>(prep.max_segments / (kThreads / kWarpSize) + 1, int64_t(sms) * 8));
      l.finish_blocks = int(std::min<int64_t>(prep.max_long_runs / (kThreads / kWarpSize) + 1, int64_t(sms) * 4));
      l.warp_blocks = grid_for(b.N / kWarpSize + 1);
      l.threads = kThreads;
      l.side = side.stream();
      l.stream = stream.stream();
      // the segment and finish kernels on `side`, the warp kernel on `stream`, as launched before
      // the update kernels moved to the optimizer's own translation unit (cuda_backward_kernels.cuh)
      const BackwardLaunchFn launch = kernels.get<W, kVecs>();
      TBEGEN_CUDA_CHECK(launch(l));
      joined.record(side);
      joined.block(stream);
    });
  });
  if (!error_record.has_value()) raise_kernel_error(error, !skip_bad_indices);
}

}  // namespace cuda
}  // namespace tbegen
