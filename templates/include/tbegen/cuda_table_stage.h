// tbegen runtime: the CUDA launch of the whole-table stages (a spec's `table:`), as the host side
// (NAME/ops_cuda.cpp, compiled by the C++ compiler) calls the kernels (NAME/kernels_cuda.cu,
// compiled by nvcc without torch's headers: cuda_table_stage.cuh).
#pragma once

#include <cstdint>

#include "tbegen/common.h"
#include "tbegen/table_stage.h"

namespace tbegen {
namespace cuda {

// One call of the whole-table stages over every table of a layout.
struct TableLaunch {
  const void* params;        // the optimizer's Params
  void* weights;             // W*, W given by weights_dtype
  int weights_dtype;         // 0 float, 1 c10::Half, 2 c10::BFloat16
  const TableExtent* tables; // host array of n_tables
  int64_t n_tables;
  RowUpdateContext ctx;      // ctx.seed already table_stage_seed(seed)
  void* stream;              // cudaStream_t
};

}  // namespace cuda
}  // namespace tbegen
