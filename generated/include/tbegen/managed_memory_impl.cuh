// tbegen runtime: the managed-memory operators declared (and documented) in managed_memory.h.
// Host code only (the row cache's copy kernel is row_copy_cuda.cuh's); included once, by the runtime translation unit cuda_forward.cu. Messages are
// built with TBEGEN_CHECK / tbegen::message (host.h), never c10::str: formatting an integer through
// an ostream in this nvcc-compiled object crashed the process on the GPU machine (run K).
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <cstdint>
#include <functional>
#include <limits>
#include <string>

#include "tbegen/host.h"
#include "tbegen/managed_memory.h"
#include "tbegen/row_copy_cuda.cuh"

namespace tbegen {
namespace cuda {
namespace managed {

// CUDA 13 replaced the device-ordinal argument of cudaMemAdvise and cudaMemPrefetchAsync by a
// cudaMemLocation; older toolkits take the ordinal (cudaCpuDeviceId for host memory).
inline cudaError_t advise(const void* ptr, size_t bytes, cudaMemoryAdvise advice, int device) {
#if CUDART_VERSION >= 13000
  cudaMemLocation location{};
  location.type = device == cudaCpuDeviceId ? cudaMemLocationTypeHost : cudaMemLocationTypeDevice;
  location.id = device == cudaCpuDeviceId ? 0 : device;
  return cudaMemAdvise(ptr, bytes, advice, location);
#else
  return cudaMemAdvise(ptr, bytes, advice, device);
#endif
}

inline cudaError_t prefetch(const void* ptr, size_t bytes, int device, cudaStream_t stream) {
#if CUDART_VERSION >= 13000
  cudaMemLocation location{};
  location.type = device == cudaCpuDeviceId ? cudaMemLocationTypeHost : cudaMemLocationTypeDevice;
  location.id = device == cudaCpuDeviceId ? 0 : device;
  return cudaMemPrefetchAsync(ptr, bytes, location, 0, stream);
#else
  return cudaMemPrefetchAsync(ptr, bytes, device, stream);
#endif
}

inline std::string memory_kind(const at::Tensor& tensor) {
  const void* ptr = tensor.data_ptr();
  if (ptr == nullptr) {
    return "unallocated";
  }
  cudaPointerAttributes attributes{};
  C10_CUDA_CHECK(cudaPointerGetAttributes(&attributes, ptr));
  switch (attributes.type) {
    case cudaMemoryTypeManaged:
      return "managed";
    case cudaMemoryTypeDevice:
      return "device";
    case cudaMemoryTypeHost:
      return "host";
    default:
      return "unregistered";
  }
}

// The byte count of `numel` elements of `dtype` for an allocation on `device`, checked.
inline size_t checked_bytes(const char* op, int64_t numel, c10::ScalarType dtype, c10::Device device) {
  TBEGEN_CHECK(device.is_cuda(), "tbegen: ", op, ": device must be a CUDA device, got ", device);
  TBEGEN_CHECK(numel >= 0, "tbegen: ", op, ": numel must be >= 0, got ", numel);
  const int64_t item = static_cast<int64_t>(c10::elementSize(dtype));
  TBEGEN_CHECK(numel <= std::numeric_limits<int64_t>::max() / item, "tbegen: ", op, ": ", numel,
               " elements of ", dtype, " overflow the byte count");
  return static_cast<size_t>(numel * item);
}

// Frees what managed_empty or host_empty allocated, when the tensor's last reference goes. cudaFree
// and cudaFreeHost wait for the device, so no kernel still reads the memory when it goes. At
// process exit the runtime may be unloaded before the last tensor: nothing to free then.
inline void release(void* p, cudaError_t (*free_fn)(void*), const char* what) {
  if (p == nullptr) {
    return;
  }
  const cudaError_t err = free_fn(p);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    if (err != cudaErrorCudartUnloading) {
      TORCH_WARN(::tbegen::message("tbegen: ", what, " of a table buffer failed: ", cudaGetErrorString(err)));
    }
  }
}

// A 1-D CUDA tensor over memory allocated here, freed by `deleter`.
inline at::Tensor wrap(void* ptr, int64_t numel, c10::ScalarType dtype, c10::Device target,
                       std::function<void(void*)> deleter) {
  return at::for_blob(ptr, {numel})
      .options(at::TensorOptions().dtype(dtype).device(target))
      .target_device(target)
      .deleter(std::move(deleter))
      .make_tensor();
}

// Page-locked host memory mapped into the GPU's address space (cudaHostAlloc, mapped and
// portable): the kernels read and write it in place over the interconnect; the pages never move.
inline at::Tensor host_empty(int64_t numel, c10::ScalarType dtype, c10::Device device) {
  const size_t bytes = checked_bytes("host_empty", numel, dtype, device);
  const c10::Device target(c10::kCUDA, device.has_index() ? device.index() : c10::cuda::current_device());
  const c10::cuda::CUDAGuard guard(target);
  void* ptr = nullptr;
  void* device_ptr = nullptr;
  if (bytes > 0) {
    cudaError_t err = cudaHostAlloc(&ptr, bytes, cudaHostAllocMapped | cudaHostAllocPortable);
    if (err == cudaSuccess) {
      err = cudaHostGetDevicePointer(&device_ptr, ptr, 0);
      if (err != cudaSuccess) cudaFreeHost(ptr);
    }
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      TBEGEN_CHECK(false, "tbegen: cudaHostAlloc of ", bytes, " bytes (", numel, " x ", dtype,
                   ") of mapped page-locked host memory failed: ", cudaGetErrorString(err));
    }
  }
  return wrap(device_ptr, numel, dtype, target, [ptr](void*) { release(ptr, cudaFreeHost, "cudaFreeHost"); });
}

inline at::Tensor managed_empty(int64_t numel, c10::ScalarType dtype, c10::Device device) {
  const size_t bytes = checked_bytes("managed_empty", numel, dtype, device);
  const c10::Device target(c10::kCUDA, device.has_index() ? device.index() : c10::cuda::current_device());
  const c10::cuda::CUDAGuard guard(target);
  void* ptr = nullptr;
  if (bytes > 0) {
    const cudaError_t err = cudaMallocManaged(&ptr, bytes, cudaMemAttachGlobal);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();  // not sticky: clear it, and say what was asked for
      TBEGEN_CHECK(false, "tbegen: cudaMallocManaged of ", bytes, " bytes (", numel, " x ", dtype,
                   ") failed: ", cudaGetErrorString(err));
    }
  }
  return wrap(ptr, numel, dtype, target, [](void* p) { release(p, cudaFree, "cudaFree"); });
}

inline void managed_advise(const at::Tensor& tensor, int64_t start, int64_t count, c10::string_view location) {
  const std::string where(location.data(), location.size());
  TBEGEN_CHECK(where == "host" || where == "device", "tbegen: managed_advise: location must be 'host' or 'device', got '",
               where, "'");
  TBEGEN_CHECK(tensor.is_cuda() && tensor.is_contiguous(), "tbegen: managed_advise: the tensor must be a contiguous CUDA tensor");
  TBEGEN_CHECK(start >= 0 && count >= 0 && start + count <= tensor.numel(), "tbegen: managed_advise: elements [", start,
               ", ", start + count, ") are not inside the tensor's ", tensor.numel());
  if (count == 0) {
    return;
  }
  const c10::cuda::CUDAGuard guard(tensor.device());
  TBEGEN_CHECK(memory_kind(tensor) == "managed", "tbegen: managed_advise: the tensor is not in managed memory (it is ",
               memory_kind(tensor), ")");
  const int device = tensor.get_device();
  int concurrent = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&concurrent, cudaDevAttrConcurrentManagedAccess, device));
  if (!concurrent) {
    // (Windows, some virtualised GPUs): managed memory works, migrating on demand; hints do not.
    TORCH_WARN_ONCE(::tbegen::message("tbegen: GPU ", device, " has no concurrent managed access; managed tables get no placement hints"));
    return;
  }
  const auto* ptr = static_cast<const char*>(tensor.data_ptr()) + start * tensor.element_size();
  const size_t bytes = static_cast<size_t>(count * tensor.element_size());
  const int preferred = where == "host" ? cudaCpuDeviceId : device;
  C10_CUDA_CHECK(advise(ptr, bytes, cudaMemAdviseSetPreferredLocation, preferred));
  // The GPU maps the pages wherever they are: host-preferred pages are read over the interconnect
  // instead of migrating on every fault.
  C10_CUDA_CHECK(advise(ptr, bytes, cudaMemAdviseSetAccessedBy, device));
  C10_CUDA_CHECK(prefetch(ptr, bytes, preferred, c10::cuda::getCurrentCUDAStream(device).stream()));
}

inline int64_t managed_preferred_location(const at::Tensor& tensor, int64_t start, int64_t count) {
  TBEGEN_CHECK(tensor.is_cuda(), "tbegen: managed_preferred_location: the tensor must be a CUDA tensor");
  TBEGEN_CHECK(start >= 0 && count > 0 && start + count <= tensor.numel(), "tbegen: managed_preferred_location: elements [",
               start, ", ", start + count, ") are not a non-empty range inside the tensor's ", tensor.numel());
  const c10::cuda::CUDAGuard guard(tensor.device());
  TBEGEN_CHECK(memory_kind(tensor) == "managed", "tbegen: managed_preferred_location: the tensor is not in managed memory");
  int location = cudaInvalidDeviceId;
  const auto* ptr = static_cast<const char*>(tensor.data_ptr()) + start * tensor.element_size();
  C10_CUDA_CHECK(cudaMemRangeGetAttribute(&location, sizeof(location), cudaMemRangeAttributePreferredLocation, ptr,
                                          static_cast<size_t>(count * tensor.element_size())));
  return location;
}

}  // namespace managed

void define_managed_memory_ops(torch::Library& m) {
  // Catch-all kernels: managed_empty and host_empty have no tensor argument to dispatch on, and the others check
  // their tensor themselves.
  m.def("managed_empty(int numel, ScalarType dtype, Device device) -> Tensor", &managed::managed_empty);
  m.def("host_empty(int numel, ScalarType dtype, Device device) -> Tensor", &managed::host_empty);
  m.def("managed_advise(Tensor tensor, int start, int count, str location) -> ()", &managed::managed_advise);
  m.def("memory_kind(Tensor tensor) -> str", &managed::memory_kind);
  m.def("managed_preferred_location(Tensor tensor, int start, int count) -> int", &managed::managed_preferred_location);
  m.def("_copy_rows(Tensor(a!) dst, Tensor? dst_rows, Tensor src, Tensor? src_rows, int max_blocks) -> ()",
        &row_copy::copy_rows);
}

}  // namespace cuda
}  // namespace tbegen
