// tbegen runtime: the host side of the whole-table stages (a spec's `table:`; table_stage.h):
// the checks of an operator call, the tables to run over, and the CPU loop. The CUDA launch is in
// cuda_table_stage.cuh.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <vector>

#include "tbegen/host.h"
#include "tbegen/table_stage.h"

namespace tbegen {

// The tables of a layout, each once (features that share a table have its key base), sorted by
// key base, checked against the weights and the number of linear keys. `pairs`: a stage reads
// partner(...), which pairs column j with j + D/2 and needs even widths.
inline std::vector<TableExtent> table_extents(const at::Tensor& weights, const at::Tensor& features,
                                              int64_t total_hash_size, bool pairs, const char* optimizer) {
  TBEGEN_CHECK(weights.dim() == 1 && weights.is_contiguous(), "tbegen: weights must be a contiguous 1-D buffer");
  const auto wt = weights.scalar_type();
  TBEGEN_CHECK(wt == at::kFloat || wt == at::kHalf || wt == at::kBFloat16,
              "tbegen: weights must be float32, float16 or bfloat16, got ", dtype_name(wt));
  TBEGEN_CHECK(features.scalar_type() == at::kLong && features.dim() == 2 && features.size(1) == kFeatColumns,
              "tbegen: features must be an int64 tensor of shape [F, ", int64_t(kFeatColumns), "], got ",
              dtype_name(features.scalar_type()), " ", features.sizes());
  TBEGEN_CHECK(features.device() == weights.device(), "tbegen: features is on ", features.device(),
              " but the weights are on ", weights.device());
  const at::Tensor host = features.cpu().contiguous();  // [F, 5]: a copy only for CUDA
  const int64_t* feat = host.data_ptr<int64_t>();
  std::vector<TableExtent> tables;
  for (int64_t f = 0; f < host.size(0); ++f) {
    const int64_t* ft = feat + f * kFeatColumns;
    const TableExtent t{ft[kFeatWeightsOffset], ft[kFeatRows], ft[kFeatDim], ft[kFeatKeyBase]};
    TBEGEN_CHECK(t.dim >= 1 && t.dim <= kMaxD, "tbegen: feature ", f, " has D = ", t.dim,
                "; embedding dims must be from 1 to ", kMaxD);
    TBEGEN_CHECK(t.rows >= 0 && t.weights_offset >= 0 && t.weights_offset + t.rows * t.dim <= weights.numel(),
                "tbegen: feature ", f, "'s table (", t.rows, " x ", t.dim, " at offset ", t.weights_offset,
                ") does not fit in the weights buffer of ", weights.numel(), " elements");
    TBEGEN_CHECK(t.key_base >= 0 && t.key_base + t.rows <= total_hash_size, "tbegen: feature ", f,
                "'s rows (keys ", t.key_base, " to ", t.key_base + t.rows, ") exceed total_hash_size = ",
                total_hash_size);
    TBEGEN_CHECK(!pairs || t.dim % 2 == 0, "tbegen: ", optimizer, ": feature ", f, "'s table has the odd width ",
                t.dim, "; the spec's whole-table stage pairs column j with column j + D/2 (partner) and needs "
                "even widths");
    bool seen = false;
    for (const TableExtent& other : tables) {
      if (other.key_base == t.key_base) {
        TBEGEN_CHECK(other.weights_offset == t.weights_offset && other.rows == t.rows && other.dim == t.dim,
                    "tbegen: features with the key base ", t.key_base, " describe different tables");
        seen = true;
      }
    }
    if (!seen) tables.push_back(t);
  }
  std::sort(tables.begin(), tables.end(),
            [](const TableExtent& a, const TableExtent& b) { return a.key_base < b.key_base; });
  return tables;
}

namespace cpu {

// Runs optimizer Opt's whole-table stages over every row of `tables` (rows in parallel: each
// unit is independent of every other, so the result does not depend on the threads).
template <class Opt, typename W>
void table_stages_cpu(const typename Opt::Params& p, W* weights, const std::vector<TableExtent>& tables,
                      const RowUpdateContext& ctx) {
  for (const TableExtent& t : tables) {
    const int64_t units = table_units_per_row<Opt>(t.dim);
    const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, t.dim));
    at::parallel_for(0, t.rows, grain, [&](int64_t begin, int64_t end) {
      for (int64_t row = begin; row < end; ++row) {
        for (int64_t u = 0; u < units; ++u) run_table_unit<Opt, W>(p, weights, t, row, u, ctx);
      }
    });
  }
}

// The CPU operator's body: false (and nothing read or touched) when no stage's guard holds at
// ctx.step.
template <class Opt>
bool table_update_cpu(const at::Tensor& weights, const at::Tensor& features, int64_t total_hash_size,
                      const typename Opt::Params& p, RowUpdateContext ctx, const char* optimizer) {
  TBEGEN_CHECK(weights.is_cpu(), "tbegen: weights must be on the CPU for the CPU operator");
  // (the guard first, as on CUDA, where the tables are read from the device only when a stage runs)
  if (!Opt::table_runs(p, ctx.step)) return false;
  const std::vector<TableExtent> tables = table_extents(weights, features, total_hash_size, Opt::kTablePairs,
                                                        optimizer);
  ctx.seed = table_stage_seed(ctx.seed);
  const auto wt = weights.scalar_type();
  if (wt == at::kFloat) {
    table_stages_cpu<Opt>(p, weights.data_ptr<float>(), tables, ctx);
  } else if (wt == at::kHalf) {
    table_stages_cpu<Opt>(p, weights.data_ptr<c10::Half>(), tables, ctx);
  } else {
    table_stages_cpu<Opt>(p, weights.data_ptr<c10::BFloat16>(), tables, ctx);
  }
  return true;
}

}  // namespace cpu
}  // namespace tbegen
