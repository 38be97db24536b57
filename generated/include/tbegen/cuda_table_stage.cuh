// tbegen runtime: the CUDA kernel of the whole-table stages (a spec's `table:`; table_stage.h).
//
// One thread per unit (an element, or a pair of columns j, j + D/2 when a stage reads
// partner(...)), a grid-stride loop over the rows x units of one table, one launch per table on
// the current stream. Each unit is independent of every other (a stage writes only its own
// elements and reads its partner's values from before the stage, both held by the same thread),
// so the result is deterministic and equal to the CPU's up to the rounding of the math functions.
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

// Launches optimizer Opt's whole-table stages (every table, in order); returns the first launch error.
template <class Opt>
cudaError_t launch_table_stages(const TableLaunch& l) {
  if (l.weights_dtype == 0) return launch_table_stages_typed<Opt, float>(l);
  if (l.weights_dtype == 1) return launch_table_stages_typed<Opt, c10::Half>(l);
  return launch_table_stages_typed<Opt, c10::BFloat16>(l);
}

}  // namespace cuda
}  // namespace tbegen
