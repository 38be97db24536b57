// tbegen runtime: the CUDA operator vbe_plan, the plan of a variable-batch (VBE) batch (vbe.h):
// the host sums the small [F, R] batch sizes into the plan's header, copies it to the device
// (pinned, without waiting), and one kernel writes every padded bag's `pad` and `bag_out` entries
// from it. Nothing waits for the GPU: the totals the module needs come from the host's sums.
// Compiled once for all optimizers, in cuda_forward.cu.
#pragma once

#include "tbegen/cuda_ops.cuh"
#include "tbegen/vbe.h"

namespace tbegen {
namespace cuda {

// Entries [0, bags] of `pad` (the last one the VBE bag count) and [0, bags) of `bag_out`.
__global__ void vbe_plan_kernel(const int64_t* header, int64_t F, int64_t R, int64_t max_B, int64_t total_bags,
                                int64_t* pad, int64_t* bag_out) {
  const int64_t bags = F * max_B;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i <= bags; i += int64_t(gridDim.x) * blockDim.x) {
    if (i == bags) {
      pad[bags] = total_bags;
    } else {
      vbe_plan_entry(header, F, R, max_B, i, pad, bag_out);
    }
  }
}

inline std::tuple<at::Tensor, at::Tensor, std::vector<int64_t>> vbe_plan_cuda(at::IntArrayRef sizes,
                                                                              int64_t num_ranks,
                                                                              at::IntArrayRef dims,
                                                                              const at::Tensor& device_of) {
  check_vbe_plan_inputs(sizes, num_ranks, dims);
  TBEGEN_CHECK(device_of.is_cuda(), "tbegen: vbe_plan: the CUDA operator got a tensor on ", device_of.device());
  const c10::cuda::CUDAGuard guard(device_of.device());
  const int64_t F = int64_t(dims.size()), R = num_ranks;
  // (pinned, so that the copy below does not wait for the stream; the caching host allocator
  // keeps the block until the copy has run)
  at::Tensor host = at::empty({vbe_plan_header_size(F, R)}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  const VbeTotals t = vbe_plan_header(sizes, num_ranks, dims, host.data_ptr<int64_t>());
  const auto on_device = at::TensorOptions().dtype(at::kLong).device(device_of.device());
  const at::Tensor header = host.to(on_device, /*non_blocking=*/true);
  const int64_t bags = F * t.max_B;
  at::Tensor pad = at::empty({bags + 1}, on_device);
  at::Tensor bag_out = at::empty({bags}, on_device);
  vbe_plan_kernel<<<grid_for((bags + kWarpSize) / kWarpSize), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      header.data_ptr<int64_t>(), F, R, t.max_B, t.total_bags, pad.data_ptr<int64_t>(), bag_out.data_ptr<int64_t>());
  TBEGEN_CUDA_CHECK(cudaGetLastError());
  VbePlanTables::instance().remember(bag_out, t.numel, dims);  // (it tiles its output: the forward trusts it)
  return {pad, bag_out, {t.total_bags, t.max_B, t.numel}};
}

// The same with the sizes in an int64 CPU tensor (vbe.h, vbe_sizes_of; read on the host).
inline std::tuple<at::Tensor, at::Tensor, std::vector<int64_t>> vbe_plan_tensor_cuda(const at::Tensor& sizes,
                                                                                     int64_t num_ranks,
                                                                                     at::IntArrayRef dims,
                                                                                     const at::Tensor& device_of) {
  return vbe_plan_cuda(vbe_sizes_of(sizes), num_ranks, dims, device_of);
}

}  // namespace cuda
}  // namespace tbegen
