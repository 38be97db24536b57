// tbegen runtime: the optimizer-independent first half of the CUDA backward (docs/algorithm.md):
// linearise the batch into (key, value) pairs, sort them, find the runs (one per unique row) and
// the long runs, and cut the long runs into segments. The second half, the optimizer's update
// kernels, is launched by backward_cuda (cuda_ops.cuh) over what this returns.
//
// prepare_backward is compiled once for every optimizer, in cuda_forward.cu with the forward (it
// does not depend on the optimizer), as is backward_cuda, its caller.
#pragma once

#include <ATen/ATen.h>

#include "tbegen/cuda_kernels.cuh"
#include "tbegen/host.h"

namespace tbegen {
namespace cuda {

// Everything the update kernels read, on the device, in the caller's stream order.
struct PreparedBackward {
  Runs runs;
  Occurrences occurrences;
  int64_t max_long_runs = 0;  // bounds, for the launch sizes: long runs,
  int64_t max_segments = 0;   // segments of long runs,
  int64_t max_partials = 0;   // and partial sums of runs of several segments
  // with_tickets: the 4-wide kernels' 5 ticket counters (backward_cuda), zeroed by the linearize
  // kernel on the caller's stream (no memset of their own); else nullptr
  int32_t* tickets = nullptr;
  // Occurrences::position holds each occurrence's output-gradient offset (vbe_grad_offsets given:
  // the update kernels then read the batch as pooling none with row stride 1, BackwardArgs::pooling)
  bool grad_offsets = false;
  // work_items given: the short runs and the long runs' segments as one list (WorkItems)
  WorkItems items;
  // partial_row_floats > 0: the update kernels' partial sums, max(max_partials, 1) rows of that
  // many floats (carved from the runs' allocation: one aten::empty fewer per backward); else nullptr
  float* partial = nullptr;
  // the storage behind the pointers above (a few allocations, each carved into several arrays;
  // freed when this goes)
  std::vector<at::Tensor> storage;
};

// Linearises, sorts and segments the batch on the current stream; errors go to `error` (a
// kErrRecordSize int64 device tensor). With check_finite, NaN/Inf in grad_output or the
// per-sample weights is recorded as a fatal error (that check runs on a side stream, joined
// before this returns). With with_tickets, `tickets` points to 5 int32 counters zeroed on the
// current stream (by the linearize kernel). With vbe_grad_offsets (a VBE batch's bag_output_offsets, on the device, when
// TBEGEN_VBE_GRAD_OFFSETS=1: vbe_grad_offsets_enabled), the occurrences' positions are their
// output-gradient row offsets instead (PreparedBackward::grad_offsets; with TBEGEN_VBE_FUSED_GATHER=1
// written by the kernel that gathers the bags, where the sorted values are positions). Long runs are cut into
// segments of `segment_length` occurrences (Runs::segment_length; the bounds above follow it).
// With work_items, also the any-width update's single work list (PreparedBackward::items). With
// partial_row_floats > 0, the update kernels' partial sums (PreparedBackward::partial).
__attribute__((visibility("hidden"))) PreparedBackward prepare_backward(
    const Batch& b, const at::Tensor& grad_output, const at::Tensor& weights, const at::Tensor& features,
    int64_t total_hash_size, const at::Tensor& indices, const at::Tensor& offsets,
    const c10::optional<at::Tensor>& per_sample_weights, int64_t max_segment_length_per_warp,
    const at::Tensor& error, bool check_finite, bool with_tickets, const int64_t* vbe_grad_offsets = nullptr,
    int32_t segment_length = kSegmentLength, bool work_items = false, int64_t partial_row_floats = 0);

}  // namespace cuda
}  // namespace tbegen
