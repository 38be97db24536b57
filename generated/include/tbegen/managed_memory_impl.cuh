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
#include <cuda.h>  // the driver API's types only: its functions are found at run time (split_empty)
#include <cuda_runtime.h>
#include <sys/mman.h>
#include <torch/library.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "tbegen/host.h"
#include "tbegen/managed_memory.h"
#include "tbegen/cache_sort_cuda.cuh"
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

// The allocations made here whose kind cudaPointerGetAttributes cannot tell (host_empty_huge's
// registered mappings read as "host", split_empty's virtual ranges as "device"): their device
// address ranges, with the kind memory_kind reports for a pointer inside one.
struct Registered {
  size_t bytes;
  const char* kind;
};

inline std::mutex& registry_mutex() {
  static std::mutex m;
  return m;
}

inline std::map<uintptr_t, Registered>& registry() {
  static auto* r = new std::map<uintptr_t, Registered>();  // (never destroyed: deleters may run at exit)
  return *r;
}

inline void register_range(const void* ptr, size_t bytes, const char* kind) {
  const std::lock_guard<std::mutex> lock(registry_mutex());
  registry()[reinterpret_cast<uintptr_t>(ptr)] = Registered{bytes, kind};
}

inline void unregister_range(const void* ptr) {
  const std::lock_guard<std::mutex> lock(registry_mutex());
  registry().erase(reinterpret_cast<uintptr_t>(ptr));
}

inline const char* registered_kind(const void* ptr) {
  const auto p = reinterpret_cast<uintptr_t>(ptr);
  const std::lock_guard<std::mutex> lock(registry_mutex());
  auto& r = registry();
  auto it = r.upper_bound(p);
  if (it == r.begin()) {
    return nullptr;
  }
  --it;
  return p - it->first < it->second.bytes ? it->second.kind : nullptr;
}

inline std::string memory_kind(const at::Tensor& tensor) {
  const void* ptr = tensor.data_ptr();
  if (ptr == nullptr) {
    return "unallocated";
  }
  if (const char* kind = registered_kind(ptr)) {
    return kind;
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

// ---- host_empty_huge: page-locked host memory in 2 MB pages where Linux gives them ----------------

constexpr size_t kHugePage = size_t(2) << 20;
constexpr size_t kSmallPage = 4096;

inline size_t round_up(size_t bytes, size_t unit) { return (bytes + unit - 1) / unit * unit; }

// An anonymous private mapping of `bytes` (a multiple of kHugePage) starting on a 2 MB boundary:
// a larger mapping with its unaligned head and tail unmapped. nullptr where mmap fails.
inline void* map_aligned(size_t bytes) {
  void* raw = mmap(nullptr, bytes + kHugePage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) {
    return nullptr;
  }
  const auto start = reinterpret_cast<uintptr_t>(raw);
  const uintptr_t aligned = round_up(start, kHugePage);
  if (aligned > start) {
    munmap(raw, aligned - start);
  }
  const uintptr_t end = start + bytes + kHugePage;
  if (end > aligned + bytes) {
    munmap(reinterpret_cast<void*>(aligned + bytes), end - aligned - bytes);
  }
  return reinterpret_cast<void*>(aligned);
}

// Frees what host_empty_huge allocated, once the device is done with it (kernels queued before
// the last reference went may still read it: cudaFreeHost would wait for them, so this waits for
// `device` too), by cudaHostUnregister, then munmap. If the wait or the unregistration fails the
// mapping is kept (leaked): its pages may still be mapped for the GPU, and a new mapping at the
// same address could not be registered. At process exit (the runtime unloading) nothing is freed.
inline void release_huge(void* host, void* device_ptr, size_t bytes, c10::DeviceIndex device) {
  unregister_range(device_ptr);
  const c10::cuda::CUDAGuard guard(device);
  cudaError_t err = cudaDeviceSynchronize();
  if (err == cudaSuccess) {
    err = cudaHostUnregister(host);
  }
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    if (err != cudaErrorCudartUnloading) {
      TORCH_WARN(::tbegen::message("tbegen: freeing a table buffer of page-locked host memory (", bytes,
                                   " bytes) failed: ", cudaGetErrorString(err), "; its memory is not freed"));
    }
    return;
  }
  munmap(host, bytes);
}

// The same as host_empty (page-locked host memory, mapped for the GPU and portable: kind "host"),
// from an anonymous mapping of whole 2 MB pages, 2 MB-aligned and advised MADV_HUGEPAGE before its
// first touch, so that where Linux's transparent huge pages are "madvise" or "always" (and free
// 2 MB pages exist) it is made of 2 MB pages; then registered with CUDA. Whether the pages came
// out huge is for /proc/self/smaps to tell (tbegen.placement.huge_page_share); the contents
// (zeros) and every result are the same either way. memory_kind reports "host-huge".
inline at::Tensor host_empty_huge(int64_t numel, c10::ScalarType dtype, c10::Device device) {
  const size_t bytes = checked_bytes("host_empty_huge", numel, dtype, device);
  const c10::Device target(c10::kCUDA, device.has_index() ? device.index() : c10::cuda::current_device());
  const c10::cuda::CUDAGuard guard(target);
  if (bytes == 0) {
    return wrap(nullptr, numel, dtype, target, [](void*) {});
  }
  TBEGEN_CHECK(bytes <= std::numeric_limits<size_t>::max() - 2 * kHugePage, "tbegen: host_empty_huge: ", bytes,
               " bytes is too large to map");
  const size_t mapped = round_up(bytes, kHugePage);
  void* host = map_aligned(mapped);
  TBEGEN_CHECK(host != nullptr, "tbegen: host_empty_huge: mmap of ", mapped, " bytes (", numel, " x ", dtype,
               ") of anonymous host memory failed (errno ", errno, ")");
  // Not inherited by a forked child (a DataLoader worker, say). The mapping is private and
  // anonymous, and the driver pins its pages (pin_user_pages in current drivers). A fork then
  // copies every pinned page into the child at once (Linux's early copy-on-write for pinned
  // pages), and with an older driver's get_user_pages the parent's next CPU write would move
  // its page away from the one the GPU reads. cudaHostAlloc's memory is the driver's own
  // mapping and is not copied either.
  if (madvise(host, mapped, MADV_DONTFORK) != 0) {
    const int err = errno;
    munmap(host, mapped);
    TBEGEN_CHECK(false, "tbegen: host_empty_huge: madvise(MADV_DONTFORK) of ", mapped, " bytes failed (errno ", err,
                 ")");
  }
  // (a refusal, e.g. a kernel without transparent huge pages, leaves 4 KB pages: not an error)
  (void)madvise(host, mapped, MADV_HUGEPAGE);
  // First touch: one write per 4 KB page faults the mapping in now, in huge pages where the
  // advice took (the first write to each 2 MB range zero-fills a whole huge page).
  volatile char* bytes_of = static_cast<volatile char*>(host);
  for (size_t off = 0; off < mapped; off += kSmallPage) {
    bytes_of[off] = 0;
  }
  cudaError_t err = cudaHostRegister(host, mapped, cudaHostRegisterMapped | cudaHostRegisterPortable);
  void* device_ptr = nullptr;
  if (err == cudaSuccess) {
    err = cudaHostGetDevicePointer(&device_ptr, host, 0);
    if (err != cudaSuccess) {
      (void)cudaHostUnregister(host);
    }
  }
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    munmap(host, mapped);
    TBEGEN_CHECK(false, "tbegen: host_empty_huge: cudaHostRegister of ", mapped, " bytes (", numel, " x ", dtype,
                 ") of host memory failed: ", cudaGetErrorString(err));
  }
  register_range(device_ptr, mapped, "host-huge");
  return wrap(device_ptr, numel, dtype, target,
              [host, device_ptr, mapped, index = target.index()](void*) { release_huge(host, device_ptr, mapped, index); });
}

// ---- split_empty: host and device memory in one virtual range (CUDA's virtual memory API) --------

// The driver functions split_empty calls, found through the runtime (the extension does not link
// libcuda itself).
struct Driver {
  CUresult (*get_error_string)(CUresult, const char**);
  CUresult (*device_get_attribute)(int*, CUdevice_attribute, CUdevice);
  CUresult (*granularity)(size_t*, const CUmemAllocationProp*, CUmemAllocationGranularity_flags);
  CUresult (*reserve)(CUdeviceptr*, size_t, size_t, CUdeviceptr, unsigned long long);
  CUresult (*address_free)(CUdeviceptr, size_t);
  CUresult (*create)(CUmemGenericAllocationHandle*, size_t, const CUmemAllocationProp*, unsigned long long);
  CUresult (*release)(CUmemGenericAllocationHandle);
  CUresult (*map)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
  CUresult (*unmap)(CUdeviceptr, size_t);
  CUresult (*set_access)(CUdeviceptr, size_t, const CUmemAccessDesc*, size_t);
};

inline void* driver_entry(const char* name) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
  const cudaError_t err = cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &found);
#else
  const cudaError_t err = cudaGetDriverEntryPoint(name, &fn, cudaEnableDefault, &found);
#endif
  if (err != cudaSuccess || found != cudaDriverEntryPointSuccess || fn == nullptr) {
    (void)cudaGetLastError();
    TBEGEN_CHECK(false, "tbegen: split_empty: the CUDA driver has no ", name, " (",
                 err != cudaSuccess ? cudaGetErrorString(err) : "symbol not found", ")");
  }
  return fn;
}

inline const Driver& driver() {
  static const Driver d = [] {
    Driver x{};
    x.get_error_string = reinterpret_cast<decltype(x.get_error_string)>(driver_entry("cuGetErrorString"));
    x.device_get_attribute = reinterpret_cast<decltype(x.device_get_attribute)>(driver_entry("cuDeviceGetAttribute"));
    x.granularity = reinterpret_cast<decltype(x.granularity)>(driver_entry("cuMemGetAllocationGranularity"));
    x.reserve = reinterpret_cast<decltype(x.reserve)>(driver_entry("cuMemAddressReserve"));
    x.address_free = reinterpret_cast<decltype(x.address_free)>(driver_entry("cuMemAddressFree"));
    x.create = reinterpret_cast<decltype(x.create)>(driver_entry("cuMemCreate"));
    x.release = reinterpret_cast<decltype(x.release)>(driver_entry("cuMemRelease"));
    x.map = reinterpret_cast<decltype(x.map)>(driver_entry("cuMemMap"));
    x.unmap = reinterpret_cast<decltype(x.unmap)>(driver_entry("cuMemUnmap"));
    x.set_access = reinterpret_cast<decltype(x.set_access)>(driver_entry("cuMemSetAccess"));
    return x;
  }();
  return d;
}

inline std::string driver_error(CUresult r) {
  const char* s = nullptr;
  if (driver().get_error_string(r, &s) != CUDA_SUCCESS || s == nullptr) {
    return "CUDA driver error " + std::to_string(static_cast<int>(r));
  }
  return s;
}

// One split_empty allocation: its virtual range and the physical pieces mapped into it.
struct SplitRange {
  CUdeviceptr base = 0;
  size_t bytes = 0;  // reserved (a multiple of the granularity)
  int device = 0;
  std::vector<std::pair<size_t, size_t>> mapped;  // (offset, bytes) of each piece, in order
  std::vector<CUmemGenericAllocationHandle> handles;
};

// Unmaps and releases what `range` holds, then frees its addresses. Best effort (every step is
// tried); returns the first failure, CUDA_SUCCESS if none.
inline CUresult undo_split(const SplitRange& range) {
  const Driver& d = driver();
  CUresult first = CUDA_SUCCESS;
  auto keep = [&first](CUresult r) {
    if (first == CUDA_SUCCESS && r != CUDA_SUCCESS) first = r;
  };
  for (const auto& [offset, bytes] : range.mapped) keep(d.unmap(range.base + offset, bytes));
  for (const auto handle : range.handles) keep(d.release(handle));
  if (range.base != 0) keep(d.address_free(range.base, range.bytes));
  return first;
}

inline void release_split(const SplitRange& range) {
  unregister_range(reinterpret_cast<void*>(range.base));
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(range.device));
  // (cuMemUnmap does not wait for kernels that may still read the range; cudaFree would)
  const cudaError_t sync = cudaDeviceSynchronize();
  if (sync != cudaSuccess) {
    (void)cudaGetLastError();
    if (sync != cudaErrorCudartUnloading) {
      TORCH_WARN(::tbegen::message("tbegen: a split table buffer (", range.bytes, " bytes) is not freed: waiting for the device failed: ",
                                   cudaGetErrorString(sync)));
    }
    return;
  }
  const CUresult r = undo_split(range);
  if (r != CUDA_SUCCESS && r != CUDA_ERROR_DEINITIALIZED) {
    TORCH_WARN(::tbegen::message("tbegen: freeing a split table buffer (", range.bytes, " bytes) failed: ", driver_error(r)));
  }
}

// The 2 MB-aligned chunks of a split buffer and where each goes: a chunk that any byte of a
// device range falls in is device memory, every other chunk host memory (as managed_advise's
// hints, applied to whole pages, let a device table win a shared page). `ranges` are element
// (start, count) pairs, flattened. Returns (first chunk, chunk count, on device) runs, in order.
inline void check_split_ranges(c10::IntArrayRef ranges, int64_t numel) {
  TBEGEN_CHECK(ranges.size() % 2 == 0, "tbegen: split_empty: device_ranges must be (start, count) pairs, got ",
               ranges.size(), " numbers");
  for (size_t i = 0; i < ranges.size(); i += 2) {
    const int64_t start = ranges[i], count = ranges[i + 1];
    TBEGEN_CHECK(start >= 0 && count >= 0 && start <= numel && count <= numel - start, "tbegen: split_empty: device range [",
                 start, ", ", start + count, ") is not inside the ", numel, " elements");
  }
}

inline std::vector<std::tuple<size_t, size_t, bool>> split_plan(size_t chunks, size_t chunk, int64_t item,
                                                                 c10::IntArrayRef ranges, int64_t numel) {
  check_split_ranges(ranges, numel);
  std::vector<bool> on_device(chunks, false);
  for (size_t i = 0; i < ranges.size(); i += 2) {
    const int64_t start = ranges[i], count = ranges[i + 1];
    if (count == 0) continue;
    const size_t first = static_cast<size_t>(start * item) / chunk;
    const size_t last = static_cast<size_t>((start + count) * item - 1) / chunk;
    for (size_t c = first; c <= last; ++c) on_device[c] = true;
  }
  std::vector<std::tuple<size_t, size_t, bool>> runs;
  for (size_t c = 0; c < chunks; ++c) {
    if (!runs.empty() && std::get<2>(runs.back()) == on_device[c]) {
      ++std::get<1>(runs.back());
    } else {
      runs.emplace_back(c, 1, on_device[c]);
    }
  }
  return runs;
}

// A 1-D tensor of `numel` elements in one virtual address range of `device`, mapped piece by piece
// (cuMemCreate + cuMemMap) from page-locked host memory (the host NUMA node nearest the GPU) and
// GPU memory: the 2 MB chunks that `device_ranges` (element (start, count) pairs) touch are GPU
// memory, every other chunk host memory that the GPU reads and writes in place over the
// interconnect. For a module whose flat buffers hold host-resident tables and a device-resident
// cache region (placement managed_caching with TBEGEN_CACHE_BACKING=host-huge, tbegen/placement.py):
// the kernels see one pointer, as with managed memory, but no page ever migrates and the host part
// is mapped in chunks of at least 2 MB. Only the GPU maps it (the CPU reaches it through copies).
// memory_kind reports "split". Contents uninitialised.
inline at::Tensor split_empty(int64_t numel, c10::ScalarType dtype, c10::Device device, c10::IntArrayRef device_ranges) {
  const size_t bytes = checked_bytes("split_empty", numel, dtype, device);
  check_split_ranges(device_ranges, numel);
  const c10::Device target(c10::kCUDA, device.has_index() ? device.index() : c10::cuda::current_device());
  const c10::cuda::CUDAGuard guard(target);
  if (bytes == 0) {
    return wrap(nullptr, numel, dtype, target, [](void*) {});
  }
  C10_CUDA_CHECK(cudaFree(nullptr));  // (the primary context current: the driver calls use it)
  const Driver& d = driver();
  const int dev = target.index();
  // (a driver older than the headers refuses an attribute it does not know: CUDA 12.x runtimes run
  // on drivers from 12.0, and the host NUMA attributes are 12.2's)
  auto attribute = [&](CUdevice_attribute a, const char* name) {
    int v = 0;
    const CUresult r = d.device_get_attribute(&v, a, dev);
    if (r != CUDA_SUCCESS) {
      int version = 0;
      (void)cudaDriverGetVersion(&version);
      TBEGEN_CHECK(false, "tbegen: split_empty: the CUDA driver (", version / 1000, ".", version % 1000 / 10,
                   ") does not report ", name, " for GPU ", dev, " (", driver_error(r), "); host memory through "
                   "CUDA's virtual memory API needs a driver of CUDA 12.2 or later (or leave TBEGEN_CACHE_BACKING unset)");
    }
    return v;
  };
  TBEGEN_CHECK(attribute(CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, "VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED"),
               "tbegen: split_empty: GPU ", dev, " does not support CUDA's virtual memory management");
  CUmemAllocationProp on_gpu{};
  on_gpu.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  on_gpu.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  on_gpu.location.id = dev;
  CUmemAllocationProp on_host{};
  on_host.type = CU_MEM_ALLOCATION_TYPE_PINNED;
#if CUDA_VERSION >= 12020
  const int numa = attribute(CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID, "HOST_NUMA_ID");
  const bool numa_vmm = attribute(CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                                  "HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED") != 0;
  if (numa >= 0 && numa_vmm) {
    on_host.location.type = CU_MEM_LOCATION_TYPE_HOST_NUMA;
    on_host.location.id = numa;
  } else {
#if CUDA_VERSION >= 13000
    TBEGEN_CHECK(attribute(CU_DEVICE_ATTRIBUTE_HOST_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                           "HOST_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED"),
                 "tbegen: split_empty: GPU ", dev, " cannot map host memory through CUDA's virtual memory management");
    on_host.location.type = CU_MEM_LOCATION_TYPE_HOST;
    on_host.location.id = 0;
#else
    // (HOST_NUMA_ID -1: a system without NUMA, where cuMemCreate wants node 0, as its documentation says)
    TBEGEN_CHECK(numa_vmm, "tbegen: split_empty: GPU ", dev,
                 " cannot map host NUMA memory through CUDA's virtual memory management");
    on_host.location.type = CU_MEM_LOCATION_TYPE_HOST_NUMA;
    on_host.location.id = 0;
#endif
  }
#else
  TBEGEN_CHECK(false, "tbegen: split_empty needs CUDA 12.2 or later (host memory through the virtual memory API)");
#endif
  size_t chunk = kHugePage;
  for (const CUmemAllocationProp* prop : {&on_gpu, &on_host}) {
    size_t g = 0;
    const CUresult r = d.granularity(&g, prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
    TBEGEN_CHECK(r == CUDA_SUCCESS && g > 0, "tbegen: split_empty: cuMemGetAllocationGranularity failed: ", driver_error(r));
    chunk = std::max(chunk, g);
  }
  TBEGEN_CHECK(bytes <= std::numeric_limits<size_t>::max() - chunk, "tbegen: split_empty: ", bytes, " bytes is too large");
  const int64_t item = static_cast<int64_t>(c10::elementSize(dtype));
  SplitRange range;
  range.device = dev;
  range.bytes = round_up(bytes, chunk);
  const auto runs = split_plan(range.bytes / chunk, chunk, item, device_ranges, numel);
  auto fail = [&](const char* what, CUresult r, size_t piece, bool gpu) {
    (void)undo_split(range);
    TBEGEN_CHECK(false, "tbegen: split_empty: ", what, " of ", piece, " bytes of ", gpu ? "GPU" : "host",
                 " memory (a buffer of ", bytes, " bytes, ", numel, " x ", dtype, ") failed: ", driver_error(r));
  };
  CUresult r = d.reserve(&range.base, range.bytes, chunk, 0, 0);
  if (r != CUDA_SUCCESS) {
    range.base = 0;
    fail("cuMemAddressReserve", r, range.bytes, false);
  }
  for (const auto& [first, count, gpu] : runs) {
    const size_t offset = first * chunk, piece = count * chunk;
    CUmemGenericAllocationHandle handle{};
    r = d.create(&handle, piece, gpu ? &on_gpu : &on_host, 0);
    if (r != CUDA_SUCCESS) fail("cuMemCreate", r, piece, gpu);
    range.handles.push_back(handle);
    r = d.map(range.base + offset, piece, 0, handle, 0);
    if (r != CUDA_SUCCESS) fail("cuMemMap", r, piece, gpu);
    range.mapped.emplace_back(offset, piece);
  }
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = dev;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  r = d.set_access(range.base, range.bytes, &access, 1);
  if (r != CUDA_SUCCESS) fail("cuMemSetAccess", r, range.bytes, false);
  void* ptr = reinterpret_cast<void*>(range.base);
  register_range(ptr, range.bytes, "split");
  return wrap(ptr, numel, dtype, target, [range](void*) { release_split(range); });
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
  // Catch-all kernels: the allocators (managed_empty, host_empty...) have no tensor argument to dispatch on, and the others check
  // their tensor themselves.
  m.def("managed_empty(int numel, ScalarType dtype, Device device) -> Tensor", &managed::managed_empty);
  m.def("host_empty(int numel, ScalarType dtype, Device device) -> Tensor", &managed::host_empty);
  m.def("host_empty_huge(int numel, ScalarType dtype, Device device) -> Tensor", &managed::host_empty_huge);
  m.def("split_empty(int numel, ScalarType dtype, Device device, int[] device_ranges) -> Tensor", &managed::split_empty);
  m.def("managed_advise(Tensor tensor, int start, int count, str location) -> ()", &managed::managed_advise);
  m.def("memory_kind(Tensor tensor) -> str", &managed::memory_kind);
  m.def("managed_preferred_location(Tensor tensor, int start, int count) -> int", &managed::managed_preferred_location);
  m.def("_copy_rows(Tensor(a!) dst, Tensor? dst_rows, Tensor src, Tensor? src_rows, int max_blocks) -> ()",
        &row_copy::copy_rows);
  m.def("_exchange_rows(Tensor(a!) rows, Tensor slot_rows, Tensor? out_rows, Tensor in_rows, int max_blocks) -> ()",
        &row_copy::exchange_rows);
  m.def("_exchange_rows_with_states(Tensor(a!) rows, Tensor slot_rows, Tensor? out_rows, Tensor in_rows, "
        "Tensor(b!)[] states, Tensor state_slot_rows, Tensor? state_out_rows, Tensor state_in_rows, int max_blocks) -> ()",
        &row_copy::exchange_rows_with_states);
  m.def("_sort_keys(Tensor keys, int end_bit) -> (Tensor, Tensor)", &cache_sort::sort_keys);
}

}  // namespace cuda
}  // namespace tbegen
