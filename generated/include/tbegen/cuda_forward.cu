// tbegen runtime: the translation unit of the CUDA forward and per-sample-weight gradient
// operators (cuda_forward_ops.cuh) and of the first half of the backward (prepare_backward:
// linearise, sort, segment; cuda_backward_prep_impl.cuh), the same for every optimizer, and of the
// managed-memory operators (managed_memory_impl.cuh): the build compiles it once and links the
// object into every optimizer's CUDA extension (see cuda_forward.h and managed_memory.h).
#include <torch/library.h>

#include "tbegen/cuda_backward_prep_impl.cuh"
#include "tbegen/cuda_forward.h"
#include "tbegen/cuda_forward_ops.cuh"
#include "tbegen/managed_memory_impl.cuh"

namespace tbegen {
namespace cuda {

void register_forward_cuda(torch::Library& m) {
  m.impl("forward", &forward_cuda);
  m.impl("grad_per_sample_weights", &grad_per_sample_weights_cuda);
}

}  // namespace cuda
}  // namespace tbegen
