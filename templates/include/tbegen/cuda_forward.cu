// tbegen runtime: the translation unit of the CUDA forward and per-sample-weight gradient
// operators (cuda_forward_ops.cuh), of the first half of the backward (prepare_backward:
// linearise, sort, segment; cuda_backward_prep_impl.cuh), of the host side of the fused backward
// (backward_cuda, cuda_ops.cuh), of the managed-memory operators (managed_memory_impl.cuh) and of
// the VBE plan (vbe_plan_cuda.cuh), the same for every optimizer: the build compiles it once and
// links the object into every optimizer's CUDA extension (see cuda_forward.h, cuda_backward.h and
// managed_memory.h). It also holds the device and stream choice of the whole-table stages'
// launch (cuda_table_stage.h).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "tbegen/cuda_backward_prep_impl.cuh"
#include "tbegen/cuda_forward.h"
#include "tbegen/cuda_forward_ops.cuh"
#include "tbegen/cuda_table_stage.h"
#include "tbegen/managed_memory_impl.cuh"
#include "tbegen/vbe_plan_cuda.cuh"

namespace tbegen {
namespace cuda {

void register_forward_cuda(torch::Library& m) {
  m.impl("forward", &forward_cuda);
  m.impl("grad_per_sample_weights", &grad_per_sample_weights_cuda);
  m.impl("vbe_plan", &vbe_plan_cuda);
  m.impl("vbe_plan_tensor", &vbe_plan_tensor_cuda);
  m.impl("vbe_plan_padded", &vbe_plan_padded_cuda);
}

int launch_table_stages_on(int64_t device_index, TableLaunch launch, TableLaunchFn fn) {
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_index));
  launch.stream = at::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device_index)).stream();
  return fn(launch);
}

}  // namespace cuda
}  // namespace tbegen
