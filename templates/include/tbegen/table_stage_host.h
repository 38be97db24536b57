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
// partner(...), which pairs column j with j + D/2 and needs even widths. `feature_table` (specs
// with per-table states; else an undefined tensor): the module's table of each feature, which
// becomes each extent's `table` (checked against `num_tables`).
inline std::vector<TableExtent> table_extents(const at::Tensor& weights, const at::Tensor& features,
                                              int64_t total_hash_size, bool pairs, const char* optimizer,
                                              const at::Tensor& feature_table = at::Tensor(),
                                              int64_t num_tables = 0) {
  TBEGEN_CHECK(weights.dim() == 1 && weights.is_contiguous(), "tbegen: weights must be a contiguous 1-D buffer");
  check_weights_dtype(weights);
  const auto wt = weights.scalar_type();
  // (int8 rows: a byte buffer in which every row also carries its 8 bytes of qparams)
  const int64_t extra = wt == at::kByte ? kInt8QparamBytes : 0;
  TBEGEN_CHECK(features.scalar_type() == at::kLong && features.dim() == 2 && features.size(1) == kFeatColumns,
              "tbegen: features must be an int64 tensor of shape [F, ", int64_t(kFeatColumns), "], got ",
              dtype_name(features.scalar_type()), " ", features.sizes());
  TBEGEN_CHECK(features.device() == weights.device(), "tbegen: features is on ", features.device(),
              " but the weights are on ", weights.device());
  const at::Tensor host = features.cpu().contiguous();  // [F, 5]: a copy only for CUDA
  const int64_t* feat = host.data_ptr<int64_t>();
  at::Tensor table_host;
  const int64_t* table_of = nullptr;
  if (feature_table.defined()) {
    table_host = feature_table.cpu().contiguous();  // (checked by make_params: int64 [F])
    table_of = table_host.data_ptr<int64_t>();
  }
  std::vector<TableExtent> tables;
  for (int64_t f = 0; f < host.size(0); ++f) {
    const int64_t* ft = feat + f * kFeatColumns;
    const TableExtent t{ft[kFeatWeightsOffset], ft[kFeatRows], ft[kFeatDim], ft[kFeatKeyBase],
                        table_of ? table_of[f] : -1};
    TBEGEN_CHECK(!table_of || (t.table >= 0 && t.table < num_tables), "tbegen: ", optimizer, ": feature_table[", f,
                "] = ", t.table, " is not a table (the per-table states have ", num_tables, " entries)");
    TBEGEN_CHECK(t.dim >= 1 && t.dim <= kMaxD, "tbegen: feature ", f, " has D = ", t.dim,
                "; embedding dims must be from 1 to ", kMaxD);
    TBEGEN_CHECK(t.rows >= 0 && t.weights_offset >= 0 && t.key_base >= 0 &&
                    t.weights_offset + t.rows * t.dim + extra * (t.key_base + t.rows) <= weights.numel(),
                "tbegen: feature ", f, "'s table (", t.rows, " x ", t.dim, " at offset ", t.weights_offset,
                ") does not fit in the weights buffer of ", weights.numel(), " elements",
                extra ? " (int8 rows: D + 8 bytes per row)" : "");
    TBEGEN_CHECK(t.key_base >= 0 && t.key_base + t.rows <= total_hash_size, "tbegen: feature ", f,
                "'s rows (keys ", t.key_base, " to ", t.key_base + t.rows, ") exceed total_hash_size = ",
                total_hash_size);
    TBEGEN_CHECK(!pairs || t.dim % 2 == 0, "tbegen: ", optimizer, ": feature ", f, "'s table has the odd width ",
                t.dim, "; the spec's whole-table stage pairs column j with column j + D/2 (partner) and needs "
                "even widths");
    bool seen = false;
    for (const TableExtent& other : tables) {
      if (other.key_base == t.key_base) {
        TBEGEN_CHECK(other.weights_offset == t.weights_offset && other.rows == t.rows && other.dim == t.dim &&
                        other.table == t.table,
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

// The same over int8 rows (table_stage.h: each row through a float copy, then quantized again).
template <class Opt>
void table_stages_int8_cpu(const typename Opt::Params& p, uint8_t* weights, const std::vector<TableExtent>& tables,
                           const RowUpdateContext& ctx) {
  for (const TableExtent& t : tables) {
    const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, t.dim));
    at::parallel_for(0, t.rows, grain, [&](int64_t begin, int64_t end) {
      std::vector<float> scratch(t.dim);
      for (int64_t row = begin; row < end; ++row) run_table_row_int8<Opt>(p, weights, t, row, ctx, scratch.data());
    });
  }
}

// Reduce stage r over `tables` (each table's rows in parallel; max and min do not depend on the
// order), then stored: per table into its entry, or (over all tables) into every entry.
template <class Opt>
void table_reduce_cpu(const typename Opt::Params& p, int r, const std::vector<TableExtent>& tables, int64_t step) {
  if constexpr (Opt::kTableStates > 0) {
    const TableReductionInfo info = Opt::table_reduction(r);
    const int32_t none = reduce_none(info.max);
    std::vector<int32_t> per_table(tables.size(), none);
    for (size_t k = 0; k < tables.size(); ++k) {
      const TableExtent& t = tables[k];
      per_table[k] = at::parallel_reduce(
          int64_t(0), t.rows, int64_t(4096), none,
          [&](int64_t begin, int64_t end, int32_t acc) {
            for (int64_t row = begin; row < end; ++row) {
              acc = reduce_combine(info.max, acc, table_reduction_image<Opt>(p, r, info.max, t, row, step));
            }
            return acc;
          },
          [&](int32_t a, int32_t b) { return reduce_combine(info.max, a, b); });
    }
    // (stored after every table was read: `of:` sees the values from before the stage)
    float* out = p.table_states[info.state];
    if (info.all) {
      int32_t all = none;
      for (int32_t v : per_table) all = reduce_combine(info.max, all, v);
      if (all != none) {
        for (int64_t i = 0; i < p.num_tables; ++i) out[i] = ordered_to_float(all);
      }
    } else {
      for (size_t k = 0; k < tables.size(); ++k) {
        if (per_table[k] != none) out[tables[k].table] = ordered_to_float(per_table[k]);
      }
    }
  } else {
    (void)p, (void)r, (void)tables, (void)step;
  }
}

// Whether any of Opt's whole-table stages (element or reduce) runs at `step` (on the host).
template <class Opt>
bool any_table_stage_runs(const typename Opt::Params& p, int64_t step) {
  if (Opt::table_runs(p, step)) return true;
  for (int r = 0; r < Opt::kTableReductions; ++r) {
    if (Opt::table_reduction_runs(r, p, step)) return true;
  }
  return false;
}

// The CPU operator's body: false (and nothing read or touched) when no stage's guard holds at
// ctx.step. The element stages run first, then the reduce stages, in order.
template <class Opt>
bool table_update_cpu(const at::Tensor& weights, const at::Tensor& features, int64_t total_hash_size,
                      const typename Opt::Params& p, RowUpdateContext ctx, const char* optimizer,
                      const at::Tensor& feature_table = at::Tensor()) {
  TBEGEN_CHECK(weights.is_cpu(), "tbegen: weights must be on the CPU for the CPU operator");
  // (the guard first, as on CUDA, where the tables are read from the device only when a stage runs)
  if (!any_table_stage_runs<Opt>(p, ctx.step)) return false;
  int64_t num_tables = 0;
  if constexpr (Opt::kTableStates > 0) num_tables = p.num_tables;
  const std::vector<TableExtent> tables = table_extents(weights, features, total_hash_size, Opt::kTablePairs,
                                                        optimizer, feature_table, num_tables);
  if constexpr (Opt::kTableElementStages) {
    if (Opt::table_runs(p, ctx.step)) {
      RowUpdateContext unit_ctx = ctx;
      unit_ctx.seed = table_stage_seed(ctx.seed);
      const auto wt = weights.scalar_type();
      if (wt == at::kFloat) {
        table_stages_cpu<Opt>(p, weights.data_ptr<float>(), tables, unit_ctx);
      } else if (wt == at::kHalf) {
        table_stages_cpu<Opt>(p, weights.data_ptr<c10::Half>(), tables, unit_ctx);
      } else if (wt == at::kByte) {
        table_stages_int8_cpu<Opt>(p, weights.data_ptr<uint8_t>(), tables, unit_ctx);
      } else {
        table_stages_cpu<Opt>(p, weights.data_ptr<c10::BFloat16>(), tables, unit_ctx);
      }
    }
  }
  for (int r = 0; r < Opt::kTableReductions; ++r) {
    if (Opt::table_reduction_runs(r, p, ctx.step)) table_reduce_cpu<Opt>(p, r, tables, ctx.step);
  }
  return true;
}

}  // namespace cpu
}  // namespace tbegen
