// tbegen runtime: `_copy_rows`, the row copy of the row cache (tbegen/cache.py) on CUDA, declared
// and documented in managed_memory.h. Included once, by the runtime translation unit
// cuda_forward.cu.
//
// Why an operator of its own: a cache miss loads a row from host memory into its slot while an
// evicted row is written from its slot back to host memory, the two crossing the host link in
// opposite directions. torch's index_select / index_copy_ launch one block per few hundred bytes,
// so whichever copy is launched first holds every SM until it is done and the other, on its side
// stream, waits: the two directions take turns instead of sharing the link (the profile of cache
// run 2, benchmarks/NOTES-gpu.md). Here the caller bounds the grid (`max_blocks`), so that two
// copies on two streams run at once, each with enough rows in flight to fill its direction.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "tbegen/host.h"

namespace tbegen {
namespace cuda {
namespace row_copy {

constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / 32;
constexpr int kRowsAtOnce = 4;  // rows a warp has in flight at once (their loads issued together)

// Row i of the copy: dst row dst_rows[i] (or i) <- src row src_rows[i] (or i); rows of `vecs`
// elements of type V, `dst_stride` / `src_stride` elements apart, `dst_count` / `src_count` rows
// in all. A warp copies kRowsAtOnce rows at a time, lane j taking elements j, j + 32, ... of each:
// every load of the group is issued before the first store, so a warp waits on one round trip
// over the link per group, not one per row. A row number outside its tensor is skipped (nothing
// is read or written out of bounds; the cache's own row numbers never are).
template <typename V>
__global__ void copy_rows_kernel(V* __restrict__ dst, const int64_t* __restrict__ dst_rows, int64_t dst_stride,
                                 int64_t dst_count, const V* __restrict__ src, const int64_t* __restrict__ src_rows,
                                 int64_t src_stride, int64_t src_count, int64_t n, int64_t vecs) {
  const int lane = threadIdx.x & 31;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  for (int64_t first = warp * kRowsAtOnce; first < n; first += warps * kRowsAtOnce) {
    const V* from[kRowsAtOnce];
    V* to[kRowsAtOnce];
    unsigned ok = 0;  // (bit r: row first + r is copied)
#pragma unroll
    for (int r = 0; r < kRowsAtOnce; ++r) {
      const int64_t i = first + r < n ? first + r : first;
      const int64_t s = src_rows != nullptr ? src_rows[i] : i;
      const int64_t d = dst_rows != nullptr ? dst_rows[i] : i;
      if (first + r < n && s >= 0 && s < src_count && d >= 0 && d < dst_count) ok |= 1u << r;
      from[r] = src + s * src_stride;
      to[r] = dst + d * dst_stride;
    }
    for (int64_t j = lane; j < vecs; j += 32) {
      V v[kRowsAtOnce];
#pragma unroll
      for (int r = 0; r < kRowsAtOnce; ++r) {
        if ((ok >> r) & 1u) v[r] = from[r][j];
      }
#pragma unroll
      for (int r = 0; r < kRowsAtOnce; ++r) {
        if ((ok >> r) & 1u) to[r][j] = v[r];
      }
    }
  }
}

// The same copy for rows of a single element (vecs == 1: rows of 4, 8 or 16 bytes, the per-row
// states of the cache, viewed as (N, 1)). The kernel above would leave 31 of a warp's 32 lanes
// idle on them; here each lane takes rows of its own, first + lane + 32 r for r < kRowsAtOnce, so
// a warp has 32 kRowsAtOnce rows in flight: the row numbers of all of them are read, then every
// row loaded, then every row stored. The same rows are copied and skipped as above (a row number
// outside its tensor is skipped), bit for bit.
template <typename V>
__global__ void copy_narrow_rows_kernel(V* __restrict__ dst, const int64_t* __restrict__ dst_rows, int64_t dst_stride,
                                        int64_t dst_count, const V* __restrict__ src,
                                        const int64_t* __restrict__ src_rows, int64_t src_stride, int64_t src_count,
                                        int64_t n) {
  constexpr int64_t kWarpRows = 32 * kRowsAtOnce;
  const int lane = threadIdx.x & 31;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  for (int64_t first = warp * kWarpRows; first < n; first += warps * kWarpRows) {
    int64_t s[kRowsAtOnce];
    int64_t d[kRowsAtOnce];
#pragma unroll
    for (int r = 0; r < kRowsAtOnce; ++r) {
      const int64_t i = first + lane + 32 * r;
      s[r] = -1;
      d[r] = -1;
      if (i < n) {
        s[r] = src_rows != nullptr ? src_rows[i] : i;
        d[r] = dst_rows != nullptr ? dst_rows[i] : i;
      }
    }
    unsigned ok = 0;  // (bit r: row first + lane + 32 r is copied)
    V v[kRowsAtOnce];
#pragma unroll
    for (int r = 0; r < kRowsAtOnce; ++r) {
      if (s[r] >= 0 && s[r] < src_count && d[r] >= 0 && d[r] < dst_count) {
        ok |= 1u << r;
        v[r] = src[s[r] * src_stride];
      }
    }
#pragma unroll
    for (int r = 0; r < kRowsAtOnce; ++r) {
      if ((ok >> r) & 1u) dst[d[r] * dst_stride] = v[r];
    }
  }
}

// ---- the exchange: an evicted row written back and a missed row loaded, by the same warp ----
//
// The cache's fill (tbegen/cache.py, RowCache._fill) empties each victim slot and loads a missed
// row into it. With two copies (the evicted rows gathered out of their slots, then written back
// on a side stream, while the loads run on this one) the two directions of the host link are
// shared only if the two kernels really run at once. Here one kernel does both for each victim:
// the slot's old row and the arriving row are loaded together, then the old row is stored to its
// backing row (a write across the link, which the warp does not wait for) and the arriving row to
// the slot. No staging copy, no side stream: every warp keeps both directions busy.
//
// Entry i: slot row slot_rows[i]; its old row goes to out_rows[i] (skipped where out_rows is
// missing or out_rows[i] is not a row of the tensor: an empty slot, or a clean one that need not be
// written); then in_rows[i] arrives in the slot (skipped where it is not a row of the tensor). An
// entry whose slot is not a row of the tensor is skipped whole. The caller's rows never overlap:
// slots are distinct, and no slot, backing row written or backing row read is another entry's
// (tbegen/cache.py: an evicted row is resident, a loaded one is not).
// One warp's share of exchange_rows_kernel: the rows of entries first .. first + kRowsAtOnce - 1,
// lane `lane` on their elements lane, lane + 32, ... (all loads of a round before its stores).
template <typename V>
__device__ __forceinline__ void exchange_row_group(V* __restrict__ rows, int64_t stride, int64_t count,
                                                   const int64_t* __restrict__ slot_rows,
                                                   const int64_t* __restrict__ out_rows,
                                                   const int64_t* __restrict__ in_rows, int64_t n, int64_t vecs,
                                                   int64_t first, int lane) {
  V* slot[kRowsAtOnce];
  V* out[kRowsAtOnce];
  const V* in[kRowsAtOnce];
  unsigned leaves = 0, arrives = 0;  // (bit r: entry first + r writes its old row back / loads a row)
#pragma unroll
  for (int r = 0; r < kRowsAtOnce; ++r) {
    const int64_t i = first + r < n ? first + r : first;
    const int64_t s = slot_rows[i];
    const int64_t o = out_rows != nullptr ? out_rows[i] : -1;
    const int64_t a = in_rows[i];
    const bool entry = first + r < n && s >= 0 && s < count;
    if (entry && o >= 0 && o < count) leaves |= 1u << r;
    if (entry && a >= 0 && a < count) arrives |= 1u << r;
    slot[r] = rows + s * stride;
    out[r] = rows + o * stride;
    in[r] = rows + a * stride;
  }
  for (int64_t j = lane; j < vecs; j += 32) {
    V old[kRowsAtOnce], arriving[kRowsAtOnce];
#pragma unroll
    for (int r = 0; r < kRowsAtOnce; ++r) {
      if ((leaves >> r) & 1u) old[r] = slot[r][j];
      if ((arrives >> r) & 1u) arriving[r] = in[r][j];
    }
#pragma unroll
    for (int r = 0; r < kRowsAtOnce; ++r) {
      if ((leaves >> r) & 1u) out[r][j] = old[r];
      if ((arrives >> r) & 1u) slot[r][j] = arriving[r];
    }
  }
}

template <typename V>
__global__ void exchange_rows_kernel(V* __restrict__ rows, int64_t stride, int64_t count,
                                     const int64_t* __restrict__ slot_rows, const int64_t* __restrict__ out_rows,
                                     const int64_t* __restrict__ in_rows, int64_t n, int64_t vecs) {
  const int lane = threadIdx.x & 31;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  for (int64_t first = warp * kRowsAtOnce; first < n; first += warps * kRowsAtOnce) {
    exchange_row_group(rows, stride, count, slot_rows, out_rows, in_rows, n, vecs, first, lane);
  }
}

// One lane's entries of an exchange of rows of a single unit (exchange_narrow_rows_kernel and its
// states variant): entries first + lane + 32 r for r < kRowsAtOnce, their slot, write-back and
// arriving rows; load() reads the old and the arriving units, store() writes them.
template <typename V>
struct NarrowExchange {
  int64_t s[kRowsAtOnce], o[kRowsAtOnce], a[kRowsAtOnce];
  V old[kRowsAtOnce], arriving[kRowsAtOnce];
  unsigned leaves = 0, arrives = 0;  // (bit r: entry r writes its old row back / loads a row)

  __device__ __forceinline__ void load(const V* __restrict__ rows, int64_t stride, int64_t count,
                                       const int64_t* __restrict__ slot_rows, const int64_t* __restrict__ out_rows,
                                       const int64_t* __restrict__ in_rows, int64_t n, int64_t first, int lane) {
#pragma unroll
    for (int r = 0; r < kRowsAtOnce; ++r) {
      const int64_t i = first + lane + 32 * r;
      s[r] = o[r] = a[r] = -1;
      if (i < n) {
        s[r] = slot_rows[i];
        o[r] = out_rows != nullptr ? out_rows[i] : -1;
        a[r] = in_rows[i];
      }
    }
#pragma unroll
    for (int r = 0; r < kRowsAtOnce; ++r) {
      const bool entry = s[r] >= 0 && s[r] < count;
      if (entry && o[r] >= 0 && o[r] < count) {
        leaves |= 1u << r;
        old[r] = rows[s[r] * stride];
      }
      if (entry && a[r] >= 0 && a[r] < count) {
        arrives |= 1u << r;
        arriving[r] = rows[a[r] * stride];
      }
    }
  }

  __device__ __forceinline__ void store(V* __restrict__ rows, int64_t stride) const {
#pragma unroll
    for (int r = 0; r < kRowsAtOnce; ++r) {
      if ((leaves >> r) & 1u) rows[o[r] * stride] = old[r];
      if ((arrives >> r) & 1u) rows[s[r] * stride] = arriving[r];
    }
  }
};

// The same for rows of a single element (vecs == 1: the per-row states, viewed as (N, 1)): each
// lane takes entries of its own, first + lane + 32 r for r < kRowsAtOnce, as copy_narrow_rows_kernel.
template <typename V>
__global__ void exchange_narrow_rows_kernel(V* __restrict__ rows, int64_t stride, int64_t count,
                                            const int64_t* __restrict__ slot_rows,
                                            const int64_t* __restrict__ out_rows,
                                            const int64_t* __restrict__ in_rows, int64_t n) {
  constexpr int64_t kWarpRows = 32 * kRowsAtOnce;
  const int lane = threadIdx.x & 31;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  for (int64_t first = warp * kWarpRows; first < n; first += warps * kWarpRows) {
    NarrowExchange<V> x;
    x.load(rows, stride, count, slot_rows, out_rows, in_rows, n, first, lane);
    x.store(rows, stride);
  }
}

// The widest element (16, 8, 4, 2 or 1 bytes) that divides the row's bytes, both strides in bytes
// and both base addresses.
inline int copy_unit(int64_t row_bytes, int64_t dst_stride_bytes, int64_t src_stride_bytes, const void* dst,
                     const void* src) {
  const uint64_t bits = static_cast<uint64_t>(row_bytes) | static_cast<uint64_t>(dst_stride_bytes) |
                        static_cast<uint64_t>(src_stride_bytes) | reinterpret_cast<uintptr_t>(dst) |
                        reinterpret_cast<uintptr_t>(src);
  for (int unit = 16; unit > 1; unit /= 2) {
    if (bits % static_cast<uint64_t>(unit) == 0) return unit;
  }
  return 1;
}

// The grid of a row kernel over n entries of rows of `vecs` units: a warp per kRowsAtOnce entries
// (rows of one unit: a lane per entry, 32 kRowsAtOnce entries a warp), at most `max_blocks` blocks
// (0: no bound) and 65535.
inline int64_t row_grid(int64_t n, int64_t vecs, int64_t max_blocks) {
  const int64_t warp_rows = vecs == 1 ? 32 * kRowsAtOnce : kRowsAtOnce;
  const int64_t groups = (n + warp_rows - 1) / warp_rows;
  int64_t blocks = (groups + kWarpsPerBlock - 1) / kWarpsPerBlock;
  if (max_blocks > 0) blocks = std::min(blocks, max_blocks);
  return std::min<int64_t>(blocks, 65535);
}

// launch(V{}) with V the element type of `unit` bytes (copy_unit's 16, 8, 4, 2 or 1).
template <typename Launch>
void with_unit_type(int unit, Launch&& launch) {
  switch (unit) {
    case 16: launch(uint4{}); break;
    case 8: launch(uint2{}); break;
    case 4: launch(uint32_t{}); break;
    case 2: launch(uint16_t{}); break;
    default: launch(uint8_t{}); break;
  }
}

// An index tensor `name` of operator `op`: int64, 1-D, contiguous, on the rows' device, and (n >= 0)
// of n entries.
inline void check_rows(const c10::optional<at::Tensor>& rows, const char* name, const at::Tensor& like,
                       const char* op = "_copy_rows", int64_t n = -1) {
  if (!rows.has_value()) return;
  TBEGEN_CHECK(rows->scalar_type() == at::kLong && rows->dim() == 1 && rows->is_contiguous(), "tbegen: ", op, ": ",
               name, " must be a contiguous 1-D int64 tensor, got ", dtype_name(rows->scalar_type()), " of shape ",
               rows->sizes());
  TBEGEN_CHECK(rows->device() == like.device(), "tbegen: ", op, ": ", name, " is on ", rows->device(),
               ", the rows on ", like.device());
  TBEGEN_CHECK(n < 0 || rows->numel() == n, "tbegen: ", op, ": ", n, " slot_rows but ", rows->numel(), " ", name);
}

// A 2-D tensor of rows as the exchange kernels see it: in units of the widest element that divides
// its rows, its stride and its base (copy_unit), and the three index tensors' data.
struct ExchangeView {
  char* base;
  int unit;
  int64_t vecs, stride;  // (the row and the stride, in units)
  const int64_t *slot, *out, *in;

  ExchangeView(const at::Tensor& rows, const at::Tensor& slot_rows, const c10::optional<at::Tensor>& out_rows,
               const at::Tensor& in_rows) {
    base = static_cast<char*>(rows.data_ptr());
    const int64_t row_bytes = rows.size(1) * rows.element_size();
    const int64_t stride_bytes = rows.stride(0) * rows.element_size();
    unit = copy_unit(row_bytes, stride_bytes, stride_bytes, base, base);
    vecs = row_bytes / unit;
    stride = stride_bytes / unit;
    slot = slot_rows.data_ptr<int64_t>();
    out = out_rows.has_value() ? out_rows->data_ptr<int64_t>() : nullptr;
    in = in_rows.data_ptr<int64_t>();
  }
};

// dst[dst_rows[i]] = src[src_rows[i]] for every i (a missing index tensor: i itself), bit for bit,
// with at most `max_blocks` blocks (0: as many as the rows need) on the current stream. Row
// numbers are the caller's (tbegen/cache.py computes them from its own tables): checking them on
// the host would wait for the device, so the kernel skips one outside its tensor instead (no
// error is raised for it). dst and src may be the same tensor; the rows written must not be
// rows read.
inline void copy_rows(const at::Tensor& dst, const c10::optional<at::Tensor>& dst_rows, const at::Tensor& src,
                      const c10::optional<at::Tensor>& src_rows, int64_t max_blocks) {
  TBEGEN_CHECK(dst.is_cuda() && src.is_cuda() && dst.device() == src.device(), "tbegen: _copy_rows: dst and src must be on "
               "one CUDA device, got ", dst.device(), " and ", src.device());
  TBEGEN_CHECK(dst.dim() == 2 && src.dim() == 2 && dst.stride(1) == 1 && src.stride(1) == 1, "tbegen: _copy_rows: dst "
               "and src must be 2-D with contiguous rows, got shapes ", dst.sizes(), " and ", src.sizes());
  const int64_t row_bytes = dst.size(1) * dst.element_size();
  TBEGEN_CHECK(row_bytes == src.size(1) * src.element_size(), "tbegen: _copy_rows: dst rows have ", row_bytes,
               " bytes, src rows ", src.size(1) * src.element_size());
  TBEGEN_CHECK(max_blocks >= 0, "tbegen: _copy_rows: max_blocks must be >= 0, got ", max_blocks);
  check_rows(dst_rows, "dst_rows", dst);
  check_rows(src_rows, "src_rows", src);
  const int64_t n = dst_rows.has_value() ? dst_rows->numel() : src_rows.has_value() ? src_rows->numel() : src.size(0);
  TBEGEN_CHECK(!dst_rows.has_value() || !src_rows.has_value() || src_rows->numel() == n, "tbegen: _copy_rows: ",
               n, " dst_rows but ", src_rows->numel(), " src_rows");
  TBEGEN_CHECK(dst_rows.has_value() || n <= dst.size(0), "tbegen: _copy_rows: ", n, " rows into dst's ", dst.size(0));
  TBEGEN_CHECK(src_rows.has_value() || n <= src.size(0), "tbegen: _copy_rows: ", n, " rows from src's ", src.size(0));
  if (n == 0 || row_bytes == 0) return;
  const c10::cuda::CUDAGuard guard(dst.device());
  auto* d = static_cast<char*>(dst.data_ptr());
  const auto* s = static_cast<const char*>(src.data_ptr());
  const int64_t dst_stride_bytes = dst.stride(0) * dst.element_size();
  const int64_t src_stride_bytes = src.stride(0) * src.element_size();
  const int unit = copy_unit(row_bytes, dst_stride_bytes, src_stride_bytes, d, s);
  const int64_t vecs = row_bytes / unit;
  const int64_t blocks = row_grid(n, vecs, max_blocks);
  const int64_t* dr = dst_rows.has_value() ? dst_rows->data_ptr<int64_t>() : nullptr;
  const int64_t* sr = src_rows.has_value() ? src_rows->data_ptr<int64_t>() : nullptr;
  const auto stream = at::cuda::getCurrentCUDAStream(dst.get_device());
  auto launch = [&](auto zero) {
    using V = decltype(zero);
    if (vecs == 1) {
      copy_narrow_rows_kernel<V><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
          reinterpret_cast<V*>(d), dr, dst_stride_bytes / unit, dst.size(0), reinterpret_cast<const V*>(s), sr,
          src_stride_bytes / unit, src.size(0), n);
    } else {
      copy_rows_kernel<V><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
          reinterpret_cast<V*>(d), dr, dst_stride_bytes / unit, dst.size(0), reinterpret_cast<const V*>(s), sr,
          src_stride_bytes / unit, src.size(0), n, vecs);
    }
  };
  with_unit_type(unit, launch);
  C10_CUDA_CHECK(cudaGetLastError());
}

// For every entry i: rows[out_rows[i]] = rows[slot_rows[i]] (the slot's old row written back;
// no out_rows: none is), then rows[slot_rows[i]] = rows[in_rows[i]] (a missed row loaded), bit for
// bit, on the current stream with at most `max_blocks` blocks (0: as many as the entries need).
// `rows`: 2-D with contiguous rows, on a CUDA device (the cache's flat buffer seen as rows of a
// unit: backing rows and slots in one tensor). Row numbers outside the tensor are skipped on the
// device, as copy_rows does (see exchange_rows_kernel); the caller's rows must not overlap.
inline void exchange_rows(const at::Tensor& rows, const at::Tensor& slot_rows, const c10::optional<at::Tensor>& out_rows,
                          const at::Tensor& in_rows, int64_t max_blocks) {
  TBEGEN_CHECK(rows.is_cuda(), "tbegen: _exchange_rows: rows must be on a CUDA device, got ", rows.device());
  TBEGEN_CHECK(rows.dim() == 2 && rows.stride(1) == 1, "tbegen: _exchange_rows: rows must be 2-D with contiguous rows, "
               "got shape ", rows.sizes(), " and strides ", rows.strides());
  TBEGEN_CHECK(max_blocks >= 0, "tbegen: _exchange_rows: max_blocks must be >= 0, got ", max_blocks);
  check_rows(slot_rows, "slot_rows", rows);
  check_rows(out_rows, "out_rows", rows);
  check_rows(in_rows, "in_rows", rows);
  const int64_t n = slot_rows.numel();
  TBEGEN_CHECK(in_rows.numel() == n && (!out_rows.has_value() || out_rows->numel() == n), "tbegen: _exchange_rows: ",
               n, " slot_rows but ", in_rows.numel(), " in_rows and ", out_rows.has_value() ? out_rows->numel() : n,
               " out_rows");
  const int64_t row_bytes = rows.size(1) * rows.element_size();
  if (n == 0 || row_bytes == 0) return;
  const c10::cuda::CUDAGuard guard(rows.device());
  const ExchangeView v(rows, slot_rows, out_rows, in_rows);
  const int64_t blocks = row_grid(n, v.vecs, max_blocks);
  const auto stream = at::cuda::getCurrentCUDAStream(rows.get_device());
  auto launch = [&](auto zero) {
    using V = decltype(zero);
    if (v.vecs == 1) {
      exchange_narrow_rows_kernel<V><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
          reinterpret_cast<V*>(v.base), v.stride, rows.size(0), v.slot, v.out, v.in, n);
    } else {
      exchange_rows_kernel<V><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
          reinterpret_cast<V*>(v.base), v.stride, rows.size(0), v.slot, v.out, v.in, n, v.vecs);
    }
  };
  with_unit_type(v.unit, launch);
  C10_CUDA_CHECK(cudaGetLastError());
}


// ---- the exchange with the rows' per-row states, by the same warps ----
//
// A cached row of an optimizer with per-row states (rowwise_adagrad's momentum: one float a row)
// moves with them: each a separate buffer, one entry a row. Exchanged by kernels of their own
// after the rows' (exchange_narrow_rows_kernel), the states' small host reads and writes wait,
// latency-bound, behind every row. Here the warp that exchanges victim i's row also exchanges
// victim i's states: their loads are issued before the row's first store, so that they are in
// flight together with the row's loads, and stored after the row.
//
// Up to kMaxStates state buffers, each 1-D with elements of 1, 2, 4 or 8 bytes (moved as bits);
// the states' entry i is exchanged exactly as _exchange_rows exchanges a buffer seen as rows of one
// element, with the states' own row numbers (state_slot_rows[i], state_out_rows[i],
// state_in_rows[i]: the per-row states are numbered by row key, the rows by unit), each state's
// entry skipped where its own slot is outside it, and its write-back or load where that row is.
constexpr int kMaxStates = 4;
static_assert(kRowsAtOnce * kMaxStates <= 32, "a lane per state entry of a warp's entries");

struct RowStates {
  char* data[kMaxStates];
  int64_t count[kMaxStates];  // (entries)
  int bytes[kMaxStates];      // (bytes an entry: 1, 2, 4 or 8)
  int n;                      // (state buffers, at most kMaxStates)
};

__device__ __forceinline__ uint64_t load_state(const char* p, int bytes) {
  switch (bytes) {
    case 8: return *reinterpret_cast<const uint64_t*>(p);
    case 4: return *reinterpret_cast<const uint32_t*>(p);
    case 2: return *reinterpret_cast<const uint16_t*>(p);
    default: return *reinterpret_cast<const uint8_t*>(p);
  }
}

__device__ __forceinline__ void store_state(char* p, int bytes, uint64_t v) {
  switch (bytes) {
    case 8: *reinterpret_cast<uint64_t*>(p) = v; break;
    case 4: *reinterpret_cast<uint32_t*>(p) = static_cast<uint32_t>(v); break;
    case 2: *reinterpret_cast<uint16_t*>(p) = static_cast<uint16_t>(v); break;
    default: *reinterpret_cast<uint8_t*>(p) = static_cast<uint8_t>(v); break;
  }
}

// One state entry's exchange, split around the rows': begin() reads the row numbers and issues the
// loads, end() stores (after the rows' loads were issued; nothing waits for a load before then).
struct StateMove {
  char* slot;
  char* out;
  uint64_t old, arriving;
  int bytes;
  bool leaves, arrives;

  __device__ __forceinline__ void begin(const RowStates& st, int k, int64_t i, const int64_t* __restrict__ slot_rows,
                                        const int64_t* __restrict__ out_rows, const int64_t* __restrict__ in_rows) {
    // (state k's fields picked by value: indexing the kernel's parameter by a runtime k would copy
    // it to a stack frame)
    char* data = st.data[0];
    int64_t count = st.count[0];
    bytes = st.bytes[0];
#pragma unroll
    for (int j = 1; j < kMaxStates; ++j) {
      if (k == j) {
        data = st.data[j];
        count = st.count[j];
        bytes = st.bytes[j];
      }
    }
    const int64_t s = slot_rows[i];
    const int64_t o = out_rows != nullptr ? out_rows[i] : -1;
    const int64_t a = in_rows[i];
    const bool entry = s >= 0 && s < count;
    leaves = entry && o >= 0 && o < count;
    arrives = entry && a >= 0 && a < count;
    slot = data + s * bytes;
    out = data + o * bytes;
    old = leaves ? load_state(slot, bytes) : 0;
    arriving = arrives ? load_state(data + a * bytes, bytes) : 0;
  }

  __device__ __forceinline__ void end() const {
    if (leaves) store_state(out, bytes, old);
    if (arrives) store_state(slot, bytes, arriving);
  }
};

// exchange_rows_kernel's rows (a warp per kRowsAtOnce entries, lane j on elements j, j + 32, ...),
// and their states: lane r + kRowsAtOnce k (k < the states' count) takes state k of entry first + r,
// its loads issued before the rows' loop and its stores after it.
template <typename V>
__global__ void exchange_rows_states_kernel(V* __restrict__ rows, int64_t stride, int64_t count,
                                            const int64_t* __restrict__ slot_rows,
                                            const int64_t* __restrict__ out_rows,
                                            const int64_t* __restrict__ in_rows, int64_t n, int64_t vecs,
                                            const RowStates states, const int64_t* __restrict__ state_slot_rows,
                                            const int64_t* __restrict__ state_out_rows,
                                            const int64_t* __restrict__ state_in_rows) {
  const int lane = threadIdx.x & 31;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  const int k = lane / kRowsAtOnce;  // (this lane's state, of entry first + lane % kRowsAtOnce)
  for (int64_t first = warp * kRowsAtOnce; first < n; first += warps * kRowsAtOnce) {
    StateMove state;
    const int64_t mine = first + lane % kRowsAtOnce;
    const bool moves_state = k < states.n && mine < n;
    if (moves_state) state.begin(states, k, mine, state_slot_rows, state_out_rows, state_in_rows);
    exchange_row_group(rows, stride, count, slot_rows, out_rows, in_rows, n, vecs, first, lane);
    if (moves_state) state.end();
  }
}

// The same for rows of a single unit (vecs == 1), as exchange_narrow_rows_kernel: each lane takes
// entries first + lane + 32 r for r < kRowsAtOnce, their rows and every state of them; the rows'
// loads and the first state's are issued before the first store.
template <typename V>
__global__ void exchange_narrow_rows_states_kernel(V* __restrict__ rows, int64_t stride, int64_t count,
                                                   const int64_t* __restrict__ slot_rows,
                                                   const int64_t* __restrict__ out_rows,
                                                   const int64_t* __restrict__ in_rows, int64_t n,
                                                   const RowStates states,
                                                   const int64_t* __restrict__ state_slot_rows,
                                                   const int64_t* __restrict__ state_out_rows,
                                                   const int64_t* __restrict__ state_in_rows) {
  constexpr int64_t kWarpRows = 32 * kRowsAtOnce;
  const int lane = threadIdx.x & 31;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  for (int64_t first = warp * kWarpRows; first < n; first += warps * kWarpRows) {
    NarrowExchange<V> x;
    x.load(rows, stride, count, slot_rows, out_rows, in_rows, n, first, lane);
    // (the first state's loads issued with the rows', the others' after them: kRowsAtOnce moves
    // live at a time, not kRowsAtOnce kMaxStates, which would not fit in registers)
    StateMove state[kRowsAtOnce];
#pragma unroll
    for (int r = 0; r < kRowsAtOnce; ++r) {
      const int64_t i = first + lane + 32 * r;
      if (states.n > 0 && i < n) state[r].begin(states, 0, i, state_slot_rows, state_out_rows, state_in_rows);
    }
    x.store(rows, stride);
    for (int k = 0; k < states.n; ++k) {
      if (k > 0) {
#pragma unroll
        for (int r = 0; r < kRowsAtOnce; ++r) {
          const int64_t i = first + lane + 32 * r;
          if (i < n) state[r].begin(states, k, i, state_slot_rows, state_out_rows, state_in_rows);
        }
      }
#pragma unroll
      for (int r = 0; r < kRowsAtOnce; ++r) {
        if (first + lane + 32 * r < n) state[r].end();
      }
    }
  }
}

// exchange_rows(rows, slot_rows, out_rows, in_rows), and for each state buffer s of `states`:
// exchange_rows(s seen as rows of one element, state_slot_rows, state_out_rows, state_in_rows), in
// one kernel (entry i's row and states by the same warp), on the current stream with at most
// `max_blocks` blocks (0: as many as the entries need). `rows` may be a view whose rows overlap
// (stride(0) smaller than a row: rows of several units starting at any unit, as the cache places
// them); the caller's rows never overlap. Up to kMaxStates states, 1-D contiguous, of 1, 2, 4 or
// 8 bytes an element, on the rows' device; the six index tensors int64, one entry each per entry.
inline void exchange_rows_with_states(const at::Tensor& rows, const at::Tensor& slot_rows,
                                      const c10::optional<at::Tensor>& out_rows, const at::Tensor& in_rows,
                                      at::TensorList states, const at::Tensor& state_slot_rows,
                                      const c10::optional<at::Tensor>& state_out_rows,
                                      const at::Tensor& state_in_rows, int64_t max_blocks) {
  constexpr const char* kOp = "_exchange_rows_with_states";
  TBEGEN_CHECK(rows.is_cuda(), "tbegen: _exchange_rows_with_states: rows must be on a CUDA device, got ", rows.device());
  TBEGEN_CHECK(rows.dim() == 2 && rows.stride(1) == 1 && rows.stride(0) > 0,
               "tbegen: _exchange_rows_with_states: rows must be 2-D with contiguous rows, got shape ", rows.sizes(),
               " and strides ", rows.strides());
  TBEGEN_CHECK(max_blocks >= 0, "tbegen: _exchange_rows_with_states: max_blocks must be >= 0, got ", max_blocks);
  const int64_t n = slot_rows.numel();
  check_rows(slot_rows, "slot_rows", rows, kOp, n);
  check_rows(out_rows, "out_rows", rows, kOp, n);
  check_rows(in_rows, "in_rows", rows, kOp, n);
  check_rows(state_slot_rows, "state_slot_rows", rows, kOp, n);
  check_rows(state_out_rows, "state_out_rows", rows, kOp, n);
  check_rows(state_in_rows, "state_in_rows", rows, kOp, n);
  TBEGEN_CHECK(static_cast<int64_t>(states.size()) <= kMaxStates, "tbegen: _exchange_rows_with_states: at most ",
               kMaxStates, " state buffers, got ", states.size());
  RowStates st{};
  st.n = static_cast<int>(states.size());
  for (int k = 0; k < st.n; ++k) {
    const at::Tensor& s = states[k];
    TBEGEN_CHECK(s.device() == rows.device(), "tbegen: _exchange_rows_with_states: states[", k, "] is on ", s.device(),
                 ", the rows on ", rows.device());
    const int64_t bytes = s.element_size();
    TBEGEN_CHECK(s.dim() == 1 && s.is_contiguous() && (bytes == 1 || bytes == 2 || bytes == 4 || bytes == 8),
                 "tbegen: _exchange_rows_with_states: states[", k, "] must be a contiguous 1-D tensor of 1, 2, 4 or ",
                 "8-byte elements, got ", dtype_name(s.scalar_type()), " of shape ", s.sizes(), " and strides ",
                 s.strides());
    st.data[k] = static_cast<char*>(s.data_ptr());
    st.count[k] = s.numel();
    st.bytes[k] = static_cast<int>(bytes);
  }
  const int64_t row_bytes = rows.size(1) * rows.element_size();
  if (n == 0) return;
  if (row_bytes == 0 && st.n == 0) return;
  const c10::cuda::CUDAGuard guard(rows.device());
  const ExchangeView v(rows, slot_rows, out_rows, in_rows);
  const int64_t blocks = row_grid(n, std::max<int64_t>(v.vecs, 1), max_blocks);
  const int64_t* ssr = state_slot_rows.data_ptr<int64_t>();
  const int64_t* sor = state_out_rows.has_value() ? state_out_rows->data_ptr<int64_t>() : nullptr;
  const int64_t* sir = state_in_rows.data_ptr<int64_t>();
  const auto stream = at::cuda::getCurrentCUDAStream(rows.get_device());
  auto launch = [&](auto zero) {
    using V = decltype(zero);
    if (v.vecs == 1) {
      exchange_narrow_rows_states_kernel<V><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
          reinterpret_cast<V*>(v.base), v.stride, rows.size(0), v.slot, v.out, v.in, n, st, ssr, sor, sir);
    } else {
      exchange_rows_states_kernel<V><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
          reinterpret_cast<V*>(v.base), v.stride, rows.size(0), v.slot, v.out, v.in, n, v.vecs, st, ssr, sor, sir);
    }
  };
  with_unit_type(v.unit, launch);
  C10_CUDA_CHECK(cudaGetLastError());
}


}  // namespace row_copy
}  // namespace cuda
}  // namespace tbegen
