// tbegen runtime: the CUDA fused backward as an optimizer's extension calls it.
//
// The host side of the backward (argument checks, the sort and segmentation, the launch sizes and
// streams; cuda_ops.cuh) does not depend on the optimizer: it is compiled once, in cuda_forward.cu,
// and linked into every optimizer's CUDA extension. What does depend on it is compiled per
// optimizer: its update kernels (NAME/kernels_cuda.cu, compiled by nvcc without torch's headers:
// see cuda_backward_kernels.cuh) and its operator (NAME/ops_cuda.cpp, compiled by the C++
// compiler), which builds the optimizer's Params and calls backward_cuda below with them and with
// the table of its kernels.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include "tbegen/common.h"

namespace tbegen {
namespace cuda {

// One optimizer's update kernels, for each weight dtype and row width (cuda_backward_kernels.cuh).
struct BackwardKernels;

// The fused backward (cuda_ops.cuh). `params` points to the optimizer's Params, read by `kernels`
// (which must be the same optimizer's: NAME/ops_cuda.cpp passes both).
__attribute__((visibility("hidden"))) void backward_cuda(
    const at::Tensor& grad_output, const at::Tensor& weights, const at::Tensor& features, int64_t total_D,
    int64_t max_D, int64_t total_hash_size, const at::Tensor& indices, const at::Tensor& offsets,
    const c10::optional<at::Tensor>& per_sample_weights, int64_t pooling, int64_t max_segment_length_per_warp,
    const void* params, const BackwardKernels& kernels, const RowUpdateContext& ctx,
    const c10::optional<at::Tensor>& error_record, bool skip_bad_indices, bool check_finite,
    const c10::optional<at::Tensor>& bag_output_offsets = c10::nullopt,
    const c10::optional<at::Tensor>& bag_pad = c10::nullopt);

}  // namespace cuda
}  // namespace tbegen
