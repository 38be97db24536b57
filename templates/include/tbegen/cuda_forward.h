// tbegen runtime: the CUDA forward and per-sample-weight gradient operators do not depend on the
// optimizer, so their translation unit (cuda_forward.cu) is compiled once per build cache and
// linked into every optimizer's CUDA extension. Each extension's ops_cuda.cpp registers them under
// its own operator namespace with this call.
#pragma once

namespace torch {
class Library;
}  // namespace torch

namespace tbegen {
namespace cuda {

// m.impl("forward", ...), m.impl("grad_per_sample_weights", ...) and m.impl("vbe_plan", ...) in a
// TORCH_LIBRARY_IMPL(ns, CUDA, m) block.
void register_forward_cuda(torch::Library& m);

}  // namespace cuda
}  // namespace tbegen
