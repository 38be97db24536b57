// tbegen runtime: `_sort_keys`, the row cache's sort of a batch's row keys on CUDA (tbegen/cache.py,
// RowCache.prepare), declared and documented in managed_memory.h. Included once, by the runtime
// translation unit cuda_forward.cu (through managed_memory_impl.cuh).
//
// The cache sorts one key per index of a batch (the row's key, or one of three keys past every
// row's for an index it does not look up) to find the batch's distinct rows. torch.sort(stable=True)
// sorts all 32 (or 64) bits of the keys and pairs each with an int64 position; here the sort takes
// only the bits a key can have (C2's 32 tables of a million rows: 25 bits, three passes of 9-bit
// digits instead of four of 8: cuda_sort.cuh) and int32 positions (8 bytes a pair instead of 12).
// A stable sort of the same keys is the same sequence however it is computed: the same sorted keys
// and the same permutation as torch.sort(keys, stable=True), the permutation as int32.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <tuple>

#include "tbegen/cuda_ops.cuh"  // (TBEGEN_CUDA_CHECK)
#include "tbegen/cuda_sort.cuh"
#include "tbegen/host.h"

namespace tbegen {
namespace cuda {
namespace cache_sort {

// (the keys sorted ascending, stably; each sorted key's position in `keys`, int32): `keys` a
// contiguous 1-D int32 or int64 CUDA tensor of fewer than 2^31 - 1 entries whose values are in
// [0, 2^end_bit) (the caller's own keys: the sort reads bits [0, end_bit) only, so a key outside
// that range would be sorted by its low bits).
inline std::tuple<at::Tensor, at::Tensor> sort_keys(const at::Tensor& keys, int64_t end_bit) {
  TBEGEN_CHECK(keys.is_cuda(), "tbegen: _sort_keys: keys must be on a CUDA device, got ", keys.device());
  TBEGEN_CHECK(keys.dim() == 1 && keys.is_contiguous() &&
                   (keys.scalar_type() == at::kInt || keys.scalar_type() == at::kLong),
               "tbegen: _sort_keys: keys must be a contiguous 1-D int32 or int64 tensor, got ",
               dtype_name(keys.scalar_type()), " of shape ", keys.sizes());
  TBEGEN_CHECK(keys.numel() < int64_t(std::numeric_limits<int32_t>::max()), "tbegen: _sort_keys: ", keys.numel(),
               " keys (int32 positions: fewer than 2^31 - 1)");
  const int64_t key_bits = 8 * keys.element_size();
  TBEGEN_CHECK(end_bit >= 1 && end_bit <= key_bits - 1, "tbegen: _sort_keys: end_bit must be in [1, ", key_bits - 1,
               "] for ", dtype_name(keys.scalar_type()), " keys, got ", end_bit);
  const c10::cuda::CUDAGuard guard(keys.device());
  const int n = int(keys.numel());
  at::Tensor sorted = at::empty_like(keys);
  at::Tensor perm = at::empty({n}, keys.options().dtype(at::kInt));
  if (n == 0) return {sorted, perm};
  const at::Tensor positions = at::arange(n, keys.options().dtype(at::kInt));
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream(keys.get_device()).stream();
  const int digit_bits = sort_digit_bits(int(end_bit));
  auto sort = [&](auto zero) {
    using K = decltype(zero);
    size_t bytes = 0;
    TBEGEN_CUDA_CHECK(sort_pairs<K>(nullptr, bytes, keys.data_ptr<K>(), sorted.data_ptr<K>(),
                                    positions.data_ptr<int32_t>(), perm.data_ptr<int32_t>(), n, int(end_bit),
                                    digit_bits, stream));
    const at::Tensor scratch = at::empty({int64_t(std::max<size_t>(bytes, 1))}, keys.options().dtype(at::kByte));
    TBEGEN_CUDA_CHECK(sort_pairs<K>(scratch.data_ptr(), bytes, keys.data_ptr<K>(), sorted.data_ptr<K>(),
                                    positions.data_ptr<int32_t>(), perm.data_ptr<int32_t>(), n, int(end_bit),
                                    digit_bits, stream));
  };
  if (keys.scalar_type() == at::kInt) {
    sort(int32_t{});
  } else {
    sort(int64_t{});
  }
  return {sorted, perm};
}

}  // namespace cache_sort
}  // namespace cuda
}  // namespace tbegen
