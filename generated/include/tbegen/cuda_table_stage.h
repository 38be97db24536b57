// tbegen runtime: the CUDA launch of the whole-table stages (a spec's `table:`), as the host side
// (NAME/ops_cuda.cpp, compiled by the C++ compiler without the CUDA runtime's headers) calls the
// kernels (NAME/kernels_cuda.cu, compiled by nvcc without torch's headers: cuda_table_stage.cuh),
// through launch_table_stages_on (compiled once, in cuda_forward.cu), which chooses the device and
// torch's current stream.
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
  int weights_dtype;         // 0 float, 1 c10::Half, 2 c10::BFloat16, 3 uint8_t (int8 rows)
  const TableExtent* tables; // host array of n_tables
  int64_t n_tables;
  RowUpdateContext ctx;      // ctx.seed already table_stage_seed(seed)
  void* stream;              // cudaStream_t (set by launch_table_stages_on)
  bool elements = true;      // whether the element stages run (their guard held)
  uint32_t reductions = 0;   // bit r: reduce stage r runs (its guard held), after the element stages
  int32_t* slots = nullptr;  // device scratch of num_tables int32 for the reduce stages
  int64_t num_tables = 0;    // entries of each per-table state
};

// An optimizer's launch of its whole-table stages (NAME/kernels_cuda.cu); returns a cudaError_t.
using TableLaunchFn = int (*)(const TableLaunch&);

// Calls `fn` with `launch` on device `device_index` and that device's current torch stream;
// returns what `fn` returns (cuda_forward.cu).
__attribute__((visibility("hidden"))) int launch_table_stages_on(int64_t device_index, TableLaunch launch,
                                                                 TableLaunchFn fn);

}  // namespace cuda
}  // namespace tbegen
