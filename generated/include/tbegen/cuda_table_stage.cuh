// tbegen runtime: the CUDA kernel of the whole-table stages (a spec's `table:`; table_stage.h).
//
// One thread per unit (an element, or a pair of columns j, j + D/2 when a stage reads
// partner(...)), a grid-stride loop over the rows x units of one table, one launch per table on
// the current stream. Each unit is independent of every other (a stage writes only its own
// elements and reads its partner's values from before the stage, both held by the same thread),
// so the result is deterministic and equal to the CPU's up to the rounding of the math functions.
// int8 rows take their own kernel (a warp per row, below): a row is quantized as a whole.
#pragma once

#include <cuda_runtime.h>

#include "tbegen/cuda_table_stage.h"
#include "tbegen/table_stage.h"

namespace tbegen {
namespace cuda {

template <class Opt, typename W>
__global__ void table_stage_kernel(const typename Opt::Params p, W* weights, const TableExtent t,
                                   const RowUpdateContext ctx) {
  const int64_t units = table_units_per_row<Opt>(t.dim);
  const int64_t total = t.rows * units;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    run_table_unit<Opt, W>(p, weights, t, i / units, i % units, ctx);
  }
}

// int8 rows (table_stage.h, "int8 rows"): a warp per row, the row's float copy in this warp's
// part of the block's shared memory (dim floats per warp). The lanes dequantize the row's
// columns lane, lane + 32, ..., run its units u = lane, lane + 32, ... on the copy (a unit reads
// and writes its own columns only), then take the copy's min and max over the warp (exact, as on
// the CPU) and, if any value changed, quantize the row again; lane 0 stores the new qparams after
// every lane has read the old ones.
template <class Opt>
__global__ void table_stage_int8_kernel(const typename Opt::Params p, uint8_t* weights, const TableExtent t,
                                        const RowUpdateContext ctx) {
  extern __shared__ float table_int8_rows[];
  const int lane = threadIdx.x & 31;
  const int warps = blockDim.x >> 5;
  const int D = static_cast<int>(t.dim);
  float* mine = table_int8_rows + (threadIdx.x >> 5) * D;
  const TableWeightsFloatRow io{mine};
  const int64_t units = table_units_per_row<Opt>(t.dim);
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * warps + (threadIdx.x >> 5); row < t.rows;
       row += static_cast<int64_t>(gridDim.x) * warps) {
    uint8_t* wrow = table_int8_row(weights, t, row);
    const Int8QParams q = load_qparams(wrow, D);
    for (int d = lane; d < D; d += 32) mine[d] = load_weight(wrow[d], q);
    __syncwarp();
    for (int64_t u = lane; u < units; u += 32) run_table_unit_with<Opt>(p, io, t, row, u, ctx);
    __syncwarp();
    float lo = INFINITY, hi = -INFINITY;
    bool changed = false;
    for (int d = lane; d < D; d += 32) {
      lo = fminf(lo, mine[d]);
      hi = fmaxf(hi, mine[d]);
      changed = changed || !same_as_code(mine[d], wrow[d], q);
    }
    for (int o = 16; o > 0; o >>= 1) {
      lo = fminf(lo, __shfl_xor_sync(0xffffffffu, lo, o));
      hi = fmaxf(hi, __shfl_xor_sync(0xffffffffu, hi, o));
    }
    if (__any_sync(0xffffffffu, changed)) {
      const Int8QParams fresh = int8_qparams(lo, hi);
      for (int d = lane; d < D; d += 32) wrow[d] = quantize(mine[d], fresh);
      __syncwarp();
      if (lane == 0) store_qparams(wrow, D, fresh);
    }
    __syncwarp();  // (the copy is read by every lane before the next row overwrites it)
  }
}

// Shared memory per block for the int8 kernel: within the 48 KiB that needs no opt-in, so a
// block has from 3 warps (D = 4096) to 8.
constexpr int64_t kTableInt8SharedFloats = 12288;
static_assert(kMaxD <= kTableInt8SharedFloats, "a block of the int8 table-stage kernel holds at least one row");

// ---- reduce stages (table_stage.h): one value per table in `slots`, as order-preserving int32
// images combined with atomicMax / atomicMin (exact in any order), then stored by one thread ----

template <class Opt>
__global__ void table_reduce_init_kernel(int32_t* slots, int64_t n, int32_t none) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    slots[i] = none;
  }
}

template <class Opt>
__global__ void table_reduce_kernel(const typename Opt::Params p, int r, bool max, const TableExtent t, int64_t step,
                                    int32_t* slots) {
  int32_t acc = reduce_none(max);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; row < t.rows; row += stride) {
    acc = reduce_combine(max, acc, table_reduction_image<Opt>(p, r, max, t, row, step));
  }
  // (the warp's lanes first: one atomic per warp; blocks are whole warps)
  for (int o = 16; o > 0; o >>= 1) acc = reduce_combine(max, acc, __shfl_xor_sync(0xffffffffu, acc, o));
  if ((threadIdx.x & 31) == 0 && acc != reduce_none(max)) {
    if (max) {
      atomicMax(slots + t.table, acc);
    } else {
      atomicMin(slots + t.table, acc);
    }
  }
}

// Stores reduce stage r's values (one thread: num_tables entries), after every table was read.
template <class Opt>
__global__ void table_reduce_finish_kernel(const typename Opt::Params p, int r, const int32_t* slots, int64_t n) {
  if constexpr (Opt::kTableStates > 0) {
    const TableReductionInfo info = Opt::table_reduction(r);
    const int32_t none = reduce_none(info.max);
    float* out = p.table_states[info.state];
    if (info.all) {
      int32_t all = none;
      for (int64_t i = 0; i < n; ++i) all = reduce_combine(info.max, all, slots[i]);
      if (all != none) {
        for (int64_t i = 0; i < n; ++i) out[i] = ordered_to_float(all);
      }
    } else {
      for (int64_t i = 0; i < n; ++i) {
        if (slots[i] != none) out[i] = ordered_to_float(slots[i]);
      }
    }
  }
}

template <class Opt>
cudaError_t launch_table_reductions(const TableLaunch& l) {
  const typename Opt::Params& p = *static_cast<const typename Opt::Params*>(l.params);
  cudaStream_t stream = static_cast<cudaStream_t>(l.stream);
  constexpr int kThreads = 256;
  for (int r = 0; r < Opt::kTableReductions; ++r) {
    if (!((l.reductions >> r) & 1u)) continue;
    const TableReductionInfo info = Opt::table_reduction(r);
    table_reduce_init_kernel<Opt><<<1, kThreads, 0, stream>>>(l.slots, l.num_tables, reduce_none(info.max));
    for (int64_t k = 0; k < l.n_tables; ++k) {
      const TableExtent& t = l.tables[k];
      if (t.rows == 0) continue;
      const int64_t blocks = (t.rows + kThreads - 1) / kThreads;
      const int grid = static_cast<int>(blocks < 4096 ? blocks : 4096);
      table_reduce_kernel<Opt><<<grid, kThreads, 0, stream>>>(p, r, info.max, t, l.ctx.step, l.slots);
    }
    table_reduce_finish_kernel<Opt><<<1, 1, 0, stream>>>(p, r, l.slots, l.num_tables);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

template <class Opt, typename W>
cudaError_t launch_table_stages_typed(const TableLaunch& l) {
  const typename Opt::Params& p = *static_cast<const typename Opt::Params*>(l.params);
  W* weights = static_cast<W*>(l.weights);
  cudaStream_t stream = static_cast<cudaStream_t>(l.stream);
  constexpr int kThreads = 256;
  for (int64_t k = 0; k < l.n_tables; ++k) {
    const TableExtent& t = l.tables[k];
    const int64_t total = t.rows * table_units_per_row<Opt>(t.dim);
    if (total == 0) continue;
    const int64_t blocks = (total + kThreads - 1) / kThreads;
    const int grid = static_cast<int>(blocks < 65536 ? blocks : 65536);  // (a grid-stride loop covers the rest)
    table_stage_kernel<Opt, W><<<grid, kThreads, 0, stream>>>(p, weights, t, l.ctx);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

template <class Opt>
cudaError_t launch_table_stages_int8(const TableLaunch& l) {
  const typename Opt::Params& p = *static_cast<const typename Opt::Params*>(l.params);
  uint8_t* weights = static_cast<uint8_t*>(l.weights);
  cudaStream_t stream = static_cast<cudaStream_t>(l.stream);
  for (int64_t k = 0; k < l.n_tables; ++k) {
    const TableExtent& t = l.tables[k];
    if (t.rows == 0) continue;
    const int64_t fit = kTableInt8SharedFloats / t.dim;  // (t.dim <= kMaxD = 4096: at least 3)
    const int warps = static_cast<int>(fit < 8 ? fit : 8);
    const int64_t blocks = (t.rows + warps - 1) / warps;
    const int grid = static_cast<int>(blocks < 65536 ? blocks : 65536);  // (a grid-stride loop covers the rest)
    const size_t shared = static_cast<size_t>(warps) * t.dim * sizeof(float);
    table_stage_int8_kernel<Opt><<<grid, warps * 32, shared, stream>>>(p, weights, t, l.ctx);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

// Launches optimizer Opt's whole-table stages (every table, in order: the element stages, then
// the reduce stages); returns the first launch error.
template <class Opt>
cudaError_t launch_table_stages(const TableLaunch& l) {
  if constexpr (Opt::kTableElementStages) {
    if (l.elements) {
      cudaError_t err;
      if (l.weights_dtype == 0) {
        err = launch_table_stages_typed<Opt, float>(l);
      } else if (l.weights_dtype == 1) {
        err = launch_table_stages_typed<Opt, c10::Half>(l);
      } else if (l.weights_dtype == 3) {
        err = launch_table_stages_int8<Opt>(l);
      } else {
        err = launch_table_stages_typed<Opt, c10::BFloat16>(l);
      }
      if (err != cudaSuccess) return err;
    }
  }
  if constexpr (Opt::kTableStates > 0) {
    return launch_table_reductions<Opt>(l);
  }
  return cudaSuccess;
}

}  // namespace cuda
}  // namespace tbegen
