// tbegen runtime: tensors in CUDA managed (unified) memory, for tables placed "managed"
// (docs/placements.md). The GPU kernels read and write such a tensor like any device tensor; the
// driver keeps its pages where the hints set here prefer them, so a table can exceed GPU memory.
//
// Compiled once, in the runtime translation unit (cuda_forward.cu), and linked into every
// optimizer's CUDA extension; each extension's ops_cuda.cpp defines these operators in its own
// namespace with this call (they take no optimizer-specific argument):
//
//   managed_empty(int numel, ScalarType dtype, Device device) -> Tensor
//       a 1-D tensor of `numel` elements on `device` (a CUDA device), backed by cudaMallocManaged;
//       freed with cudaFree when the last reference goes. Contents uninitialised.
//   host_empty(int numel, ScalarType dtype, Device device) -> Tensor
//       the same in page-locked host memory mapped for the GPU (cudaHostAlloc, mapped and
//       portable), for modules whose tables are all placed "host"; freed with cudaFreeHost.
//   host_empty_huge(int numel, ScalarType dtype, Device device) -> Tensor
//       the same as host_empty (page-locked, mapped, portable), from an anonymous mapping of whole
//       2 MB pages, 2 MB-aligned, advised MADV_HUGEPAGE before its first touch (so made of 2 MB
//       pages where Linux's transparent huge pages allow it), touched (zeros), then registered
//       (cudaHostRegister); freed by cudaHostUnregister + munmap. For modules whose tables are all
//       "host", with TBEGEN_CACHE_BACKING=host-huge (tbegen/placement.py). Fewer, larger host
//       pages for the GPU to translate when it reads scattered rows (issue 27).
//   split_empty(int numel, ScalarType dtype, Device device, int[] device_ranges) -> Tensor
//       one virtual address range (CUDA's virtual memory API: cuMemAddressReserve, cuMemCreate,
//       cuMemMap) whose 2 MB chunks touched by the element ranges `device_ranges` ((start, count)
//       pairs, flattened) are GPU memory and every other chunk page-locked host memory (the GPU's
//       host NUMA node) read and written in place by the GPU; only the GPU maps it. For modules
//       with managed_caching tables and TBEGEN_CACHE_BACKING=host-huge: the backing rows in host
//       memory, the cache region in GPU memory, one pointer. Contents uninitialised.
//   managed_advise(Tensor tensor, int start, int count, str location) -> ()
//       hints for elements [start, start + count) of a managed tensor: "host" (preferred location
//       host memory, mapped for the GPU: the GPU reads and writes the pages there, without moving
//       them) or "device" (preferred location the tensor's GPU, mapped there too), then prefetches
//       the range to that location. The driver applies hints to whole pages (rounded outward), so
//       a page shared by two ranges follows the later call.
//   memory_kind(Tensor tensor) -> str
//       what backs the tensor's data pointer: "host-huge" (host_empty_huge) or "split"
//       (split_empty) for those allocations, else by cudaPointerGetAttributes: "managed",
//       "device", "host" (page-locked host memory registered with CUDA) or "unregistered"
//       (pageable host).
//   managed_preferred_location(Tensor tensor, int start, int count) -> int
//       the preferred location shared by every page of that element range of a managed tensor:
//       the device ordinal, -1 (host), or -2 (none, or the pages disagree).
//   _copy_rows(Tensor(a!) dst, Tensor? dst_rows, Tensor src, Tensor? src_rows, int max_blocks) -> ()
//       dst[dst_rows[i]] = src[src_rows[i]] for every i, bit for bit (a missing index tensor: i
//       itself), on the current stream with at most max_blocks blocks (0: no bound); dst and src
//       2-D with contiguous rows of the same byte width, on one CUDA device, possibly the same
//       tensor (the rows written must not be rows read). For the row cache (tbegen/cache.py),
//       whose own tables give the row numbers: a row number outside its tensor is skipped on the
//       device, without an error. A bounded grid lets two copies run at once on two streams
//       (row_copy_cuda.cuh says why).
//   _exchange_rows(Tensor(a!) rows, Tensor slot_rows, Tensor? out_rows, Tensor in_rows, int max_blocks) -> ()
//       the row cache's fill in one kernel (TBEGEN_CACHE_EXCHANGE=1): for every entry i,
//       rows[out_rows[i]] = rows[slot_rows[i]] (the slot's old row written back; no out_rows, or a
//       row number outside the tensor: nothing written), then rows[slot_rows[i]] = rows[in_rows[i]]
//       (a row outside the tensor: nothing loaded), bit for bit, by the same warp; an entry whose
//       slot is outside the tensor is skipped. `rows` 2-D with contiguous rows on a CUDA device
//       (backing rows and slots in one tensor); the three index tensors int64, one entry each per
//       victim; the caller's rows never overlap. At most max_blocks blocks (0: no bound).
//   _exchange_rows_with_states(Tensor(a!) rows, Tensor slot_rows, Tensor? out_rows, Tensor in_rows,
//                              Tensor(b!)[] states, Tensor state_slot_rows, Tensor? state_out_rows,
//                              Tensor state_in_rows, int max_blocks) -> ()
//       _exchange_rows of `rows` together with the rows' per-row states (TBEGEN_CACHE_EXCHANGE_STATES=1):
//       for every entry i, the row exchange above, and in each of `states` (at most 4, each 1-D
//       contiguous with elements of 1, 2, 4 or 8 bytes, on the rows' device) the same exchange of
//       entry state_slot_rows[i] / state_out_rows[i] / state_in_rows[i] (the states' own row
//       numbers, a row outside that state skipped as above), by the warp that moves row i: the
//       states' loads in flight with the row's. `rows` may overlap itself (stride(0) smaller than
//       a row: runs of several units from any unit). Bit for bit the same as _exchange_rows on the
//       rows and then on each state viewed as rows of one element.
//   _sort_keys(Tensor keys, int end_bit) -> (Tensor, Tensor)
//       the row cache's sort of a batch's keys (cache_sort_cuda.cuh): the keys (contiguous 1-D
//       int32 or int64, each in [0, 2^end_bit)) sorted ascending and stably on their bits
//       [0, end_bit), and each sorted key's position in `keys` as int32: the same sequence and
//       permutation as torch.sort(keys, stable=True), with fewer passes and half-size positions.
#pragma once

namespace torch {
class Library;
}  // namespace torch

namespace tbegen {
namespace cuda {

// m.def(...) of the eleven operators above, with their (device-independent) implementations, in a
// TORCH_LIBRARY_FRAGMENT(ns, m) block.
void define_managed_memory_ops(torch::Library& m);

}  // namespace cuda
}  // namespace tbegen
