// tbegen runtime: the CUDA operator vbe_plan, the plan of a variable-batch (VBE) batch (vbe.h):
// the host sums the small [F, R] batch sizes into the plan's header and one kernel writes every
// padded bag's `pad` and `bag_out` entries from it, into one allocation (vbe.h, vbe_plan_tables).
// The header reaches the kernel as its argument where it fits (CUDA 13: up to 4000 values; F = 32
// features of R = 16 ranks take 1120): no staging buffer, no copy, no device allocation for it; a
// larger header is copied (pinned, without waiting). Nothing waits for the GPU: the totals the
// module needs come from the host's sums. Compiled once for all optimizers, in cuda_forward.cu.
#pragma once

#include "tbegen/cuda_ops.cuh"
#include "tbegen/vbe.h"

namespace tbegen {
namespace cuda {

// Entries [0, bags] of `pad` (the last one the VBE bag count) and [0, bags) of `bag_out`; with
// `offsets` (vbe_plan_padded) also entries [0, bags] of `padded`, offsets[pad[i]].
template <typename I>
__device__ __forceinline__ void vbe_plan_entries(const int64_t* header, int64_t F, int64_t R, int64_t max_B,
                                                 int64_t total_bags, int64_t* pad, int64_t* bag_out,
                                                 const I* offsets, I* padded) {
  const int64_t bags = F * max_B;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i <= bags; i += int64_t(gridDim.x) * blockDim.x) {
    int64_t from = total_bags;
    if (i == bags) {
      pad[bags] = total_bags;
    } else {
      vbe_plan_entry(header, F, R, max_B, i, pad, bag_out);
      from = pad[i];
    }
    if (padded != nullptr) padded[i] = offsets[from];
  }
}

// The header in device memory (a copy of the host's).
template <typename I>
__global__ void vbe_plan_kernel(const int64_t* header, int64_t F, int64_t R, int64_t max_B, int64_t total_bags,
                                int64_t* pad, int64_t* bag_out, const I* offsets, I* padded) {
  vbe_plan_entries<I>(header, F, R, max_B, total_bags, pad, bag_out, offsets, padded);
}

// The header as the kernel's argument (its first vbe_plan_header_size(F, R) values written; the
// rest unread). Kernel arguments may take up to 32764 bytes from CUDA 12.1 on, for every
// architecture from Volta on, which is every one nvcc 13 compiles for; older toolkits keep 4096
// bytes and the copy. __grid_constant__: the kernel reads the argument where the launch put it
// (the constant bank), not a per-thread copy of it. Four sizes, so that a small header does not
// ship 32 KB with every launch (the launch copies the whole argument).
#if defined(__CUDACC_VER_MAJOR__) && __CUDACC_VER_MAJOR__ >= 13
#define TBEGEN_VBE_HEADER_ARGUMENT 1
constexpr int64_t kVbeHeaderArgumentValues[] = {128, 512, 2048, 4000};
#else
#define TBEGEN_VBE_HEADER_ARGUMENT 0
#endif

template <int64_t kValues>
struct VbeHeaderArgument {
  int64_t values[kValues];
};

#if TBEGEN_VBE_HEADER_ARGUMENT
template <int64_t kValues, typename I>
__global__ void vbe_plan_argument_kernel(const __grid_constant__ VbeHeaderArgument<kValues> header, int64_t F,
                                         int64_t R, int64_t max_B, int64_t total_bags, int64_t* pad,
                                         int64_t* bag_out, const I* offsets, I* padded) {
  vbe_plan_entries<I>(header.values, F, R, max_B, total_bags, pad, bag_out, offsets, padded);
}
#endif

// Launches `launch` with the offsets' element type and pointers (int64_t and nullptrs without them).
template <typename Launch>
inline void with_plan_offsets(const VbePlanOffsets& o, Launch&& launch) {
  if (!o.given.defined()) {
    launch(static_cast<const int64_t*>(nullptr), static_cast<int64_t*>(nullptr));
  } else if (o.given.scalar_type() == at::kInt) {
    launch(o.given.data_ptr<int32_t>(), o.padded.data_ptr<int32_t>());
  } else {
    launch(o.given.data_ptr<int64_t>(), o.padded.data_ptr<int64_t>());
  }
}

inline void launch_vbe_plan(const int64_t* header, int64_t F, int64_t R, const VbeTotals& t, at::Tensor& pad,
                            at::Tensor& bag_out, const VbePlanOffsets& o) {
  const int64_t bags = F * t.max_B;
  with_plan_offsets(o, [&](auto offsets, auto padded) {
    vbe_plan_kernel<<<grid_for((bags + kWarpSize) / kWarpSize), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
        header, F, R, t.max_B, t.total_bags, pad.data_ptr<int64_t>(), bag_out.data_ptr<int64_t>(), offsets, padded);
  });
  TBEGEN_CUDA_CHECK(cudaGetLastError());
}

#if TBEGEN_VBE_HEADER_ARGUMENT
// The plan with the header as the kernel's argument, for headers of at most kValues values.
template <int64_t kValues>
inline VbeTotals vbe_plan_by_argument(at::IntArrayRef sizes, int64_t num_ranks, at::IntArrayRef dims,
                                      const at::TensorOptions& on_device, at::Tensor& pad, at::Tensor& bag_out,
                                      VbePlanOffsets& o) {
  const int64_t F = int64_t(dims.size()), R = num_ranks;
  VbeHeaderArgument<kValues> header;  // (at most 32000 bytes, on the host's stack)
  const VbeTotals t = vbe_plan_header(sizes, num_ranks, dims, header.values);
  const int64_t bags = F * t.max_B;
  o.prepare(t, bags);
  std::tie(pad, bag_out) = vbe_plan_tables(bags, on_device);
  with_plan_offsets(o, [&](auto offsets, auto padded) {
    using I = std::remove_const_t<std::remove_pointer_t<decltype(offsets)>>;
    vbe_plan_argument_kernel<kValues, I><<<grid_for((bags + kWarpSize) / kWarpSize), kThreads, 0,
                                           at::cuda::getCurrentCUDAStream()>>>(
        header, F, R, t.max_B, t.total_bags, pad.data_ptr<int64_t>(), bag_out.data_ptr<int64_t>(), offsets, padded);
  });
  TBEGEN_CUDA_CHECK(cudaGetLastError());
  return t;
}
#endif

// vbe_plan_cuda's work, with vbe_plan_padded's offsets in `o` (o.offsets nullptr: none).
inline std::tuple<at::Tensor, at::Tensor, std::vector<int64_t>> vbe_plan_on_cuda(at::IntArrayRef sizes,
                                                                                 int64_t num_ranks,
                                                                                 at::IntArrayRef dims,
                                                                                 const at::Tensor& device_of,
                                                                                 VbePlanOffsets& o) {
  check_vbe_plan_inputs(sizes, num_ranks, dims);
  TBEGEN_CHECK(device_of.is_cuda(), "tbegen: vbe_plan: the CUDA operator got a tensor on ", device_of.device());
  const c10::cuda::CUDAGuard guard(device_of.device());
  const int64_t F = int64_t(dims.size()), R = num_ranks;
  const int64_t n = vbe_plan_header_size(F, R);
  const auto on_device = at::TensorOptions().dtype(at::kLong).device(device_of.device());
  at::Tensor pad, bag_out;
  VbeTotals t;
#if TBEGEN_VBE_HEADER_ARGUMENT
  if (n <= kVbeHeaderArgumentValues[0]) {
    t = vbe_plan_by_argument<kVbeHeaderArgumentValues[0]>(sizes, num_ranks, dims, on_device, pad, bag_out, o);
  } else if (n <= kVbeHeaderArgumentValues[1]) {
    t = vbe_plan_by_argument<kVbeHeaderArgumentValues[1]>(sizes, num_ranks, dims, on_device, pad, bag_out, o);
  } else if (n <= kVbeHeaderArgumentValues[2]) {
    t = vbe_plan_by_argument<kVbeHeaderArgumentValues[2]>(sizes, num_ranks, dims, on_device, pad, bag_out, o);
  } else if (n <= kVbeHeaderArgumentValues[3]) {
    t = vbe_plan_by_argument<kVbeHeaderArgumentValues[3]>(sizes, num_ranks, dims, on_device, pad, bag_out, o);
  } else
#endif
  {
    // (pinned, so that the copy below does not wait for the stream; the caching host allocator
    // keeps the block until the copy has run)
    at::Tensor host = at::empty({n}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
    t = vbe_plan_header(sizes, num_ranks, dims, host.data_ptr<int64_t>());
    const at::Tensor header = host.to(on_device, /*non_blocking=*/true);
    o.prepare(t, F * t.max_B);
    std::tie(pad, bag_out) = vbe_plan_tables(F * t.max_B, on_device);
    launch_vbe_plan(header.data_ptr<int64_t>(), F, R, t, pad, bag_out, o);
  }
  VbePlanTables::instance().remember(bag_out, t.numel, dims);  // (it tiles its output: the forward trusts it)
  return {pad, bag_out, {t.total_bags, t.max_B, t.numel}};
}

inline std::tuple<at::Tensor, at::Tensor, std::vector<int64_t>> vbe_plan_cuda(at::IntArrayRef sizes,
                                                                              int64_t num_ranks,
                                                                              at::IntArrayRef dims,
                                                                              const at::Tensor& device_of) {
  VbePlanOffsets none;
  return vbe_plan_on_cuda(sizes, num_ranks, dims, device_of, none);
}

// The same with the sizes in an int64 CPU tensor (vbe.h, vbe_sizes_of; read on the host).
inline std::tuple<at::Tensor, at::Tensor, std::vector<int64_t>> vbe_plan_tensor_cuda(const at::Tensor& sizes,
                                                                                     int64_t num_ranks,
                                                                                     at::IntArrayRef dims,
                                                                                     const at::Tensor& device_of) {
  return vbe_plan_cuda(vbe_sizes_of(sizes), num_ranks, dims, device_of);
}

// A new plan with its padded offsets (vbe.h, check_vbe_plan_offsets): the kernel that writes the
// tables also writes offsets[pad[i]], so the module's forward needs no gather of its own (one
// launch, one allocation and aten::index_select's operators fewer a new-plan step). `offsets`: on
// the plan's device.
inline std::tuple<at::Tensor, at::Tensor, std::vector<int64_t>, at::Tensor> vbe_plan_padded_cuda(
    const at::Tensor& sizes, int64_t num_ranks, at::IntArrayRef dims, const at::Tensor& offsets) {
  VbePlanOffsets o;
  o.offsets = &offsets;
  auto [pad, bag_out, totals] = vbe_plan_on_cuda(vbe_sizes_of(sizes), num_ranks, dims, offsets, o);
  return {pad, bag_out, totals, o.padded};
}

}  // namespace cuda
}  // namespace tbegen
