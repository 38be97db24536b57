// tbegen runtime: whole-table stages (a spec's `table:`), shared by the CPU and CUDA kernels.
//
// A whole-table stage is element code run over every element of every row of every table of the
// module, at the steps where its guard holds, before that step's forward (docs/spec-language.md,
// "Whole-table stages"). The work is split into units: one element, or, when a stage reads
// `partner(...)`, the pair of columns (j, j + D/2) of a row, so that one thread owns both
// elements of a pair and the stage needs no communication between threads. A stage reads its own
// element's current values and its partner's values from the start of the stage (a snapshot), so
// the result does not depend on the order in which the two elements of a pair, or rows, or
// threads run: it is deterministic and the same on every device.
//
// Reduce stages (a spec's `table:` items with `reduce:`) run after the element stages of the same
// step: each sets a per-table state to the max (or min) over the rows of each table, or of all
// tables, of a row expression. Max and min are exact whatever the order of the rows, threads or
// tables, so the CPU loop and the CUDA kernels (atomics on order-preserving integer images of the
// floats) give the same value, bit for bit (up to the sign of a zero).
#pragma once

#include <cstring>

#include "tbegen/common.h"

namespace tbegen {

// One table as the whole-table stages see it (deduplicated from the features: several features
// may read one table, which is still updated once).
struct TableExtent {
  int64_t weights_offset;  // where the table starts in the flat weights (and per-element states)
  int64_t rows;
  int64_t dim;
  int64_t key_base;        // the linear key of its row 0 (per-row states)
  int64_t table;           // the module's table index (its per-table states' entry), -1 if not given
};

// What a reduce stage is (the generated Opt::table_reduction).
struct TableReductionInfo {
  bool max;    // max (else min)
  bool all;    // one value over all tables, stored in every table's entry (else one per table)
  int state;   // the per-table state it sets
};

// A float as an int32 whose order is the float's (for non-NaN values); its own inverse. The
// sentinels kReduceNone(max/min) are images of NaNs, which reductions skip, so they mean "no
// value yet".
TBEGEN_HD TBEGEN_INLINE int32_t ordered_image(int32_t bits) { return bits >= 0 ? bits : bits ^ 0x7fffffff; }
TBEGEN_HD TBEGEN_INLINE int32_t float_to_ordered(float x) {
  int32_t bits;
  memcpy(&bits, &x, sizeof(bits));
  return ordered_image(bits);
}
TBEGEN_HD TBEGEN_INLINE float ordered_to_float(int32_t image) {
  const int32_t bits = ordered_image(image);
  float x;
  memcpy(&x, &bits, sizeof(x));
  return x;
}
TBEGEN_HD TBEGEN_INLINE int32_t reduce_none(bool max) { return max ? INT32_MIN : INT32_MAX; }

// What a reduce stage's `of:` sees of one row (the generated Opt::table_reduction_value): its
// per-row states (read-only), the per-table states of its table, its width.
template <class Opt>
struct TableRowValues {
  const typename Opt::Params* p;
  int64_t key;
  int64_t table;
  int dim_;

  TBEGEN_HD TBEGEN_INLINE int dim() const { return dim_; }
  TBEGEN_HD TBEGEN_INLINE float row_state(int k) const { return load_state(p->row_states[k], p->row_state_dtypes[k], key); }
  TBEGEN_HD TBEGEN_INLINE int64_t int_row_state(int k) const { return p->int_row_states[k][key]; }
  TBEGEN_HD TBEGEN_INLINE float table_state(int k) const {
    if constexpr (Opt::kTableStates > 0) {
      return p->table_states[k][table];
    } else {
      return 0.0f;
    }
  }
};

// The image of reduce stage r's value for row `row` of table t, or reduce_none when it is NaN.
template <class Opt>
TBEGEN_HD TBEGEN_INLINE int32_t table_reduction_image(const typename Opt::Params& p, int r, bool max,
                                                      const TableExtent& t, int64_t row, int64_t step) {
  const TableRowValues<Opt> v{&p, t.key_base + row, t.table, static_cast<int>(t.dim)};
  const float x = Opt::table_reduction_value(r, v, p, step);
  return x == x ? float_to_ordered(x) : reduce_none(max);
}

TBEGEN_HD TBEGEN_INLINE int32_t reduce_combine(bool max, int32_t a, int32_t b) {
  return max ? (a > b ? a : b) : (a < b ? a : b);
}

// The seed of the whole-table stages' stochastic rounding: the call's seed moved, so that the bits
// differ from those of the same step's fused backward.
TBEGEN_HD TBEGEN_INLINE int64_t table_stage_seed(int64_t seed) {
  return static_cast<int64_t>(static_cast<uint64_t>(seed) ^ 0xA24BAED4963EE407ull);
}

// Units per row: the row's elements, or its column pairs.
template <class Opt>
TBEGEN_HD TBEGEN_INLINE int64_t table_units_per_row(int64_t dim) {
  return Opt::kTablePairs ? dim / 2 : dim;
}

// The values of one unit, in float, as the generated Opt::table_unit reads and writes them.
template <class Opt>
struct TableUnit {
  static constexpr int kN = Opt::kTablePairs ? 2 : 1;
  static constexpr int kSlots = Opt::kElementStates > 0 ? Opt::kElementStates : 1;
  static constexpr int kRows = Opt::kRowStates > 0 ? Opt::kRowStates : 1;
  static constexpr int kIntRows = Opt::kIntRowStates > 0 ? Opt::kIntRowStates : 1;

  int dim_;
  int cols_[kN];
  float w_[kN];
  float el_[kSlots][kN];
  // the values at the start of the current stage (partner reads)
  float old_w_[kN];
  float old_el_[kSlots][kN];
  float row_[kRows];
  int64_t int_row_[kIntRows];

  TBEGEN_HD TBEGEN_INLINE int count() const { return kN; }
  TBEGEN_HD TBEGEN_INLINE int dim() const { return dim_; }
  TBEGEN_HD TBEGEN_INLINE int col(int e) const { return cols_[e]; }
  TBEGEN_HD TBEGEN_INLINE float& w(int e) { return w_[e]; }
  TBEGEN_HD TBEGEN_INLINE float& element(int k, int e) { return el_[k][e]; }
  // The partner's value as it was when the stage started (element e's partner is the other one).
  TBEGEN_HD TBEGEN_INLINE float partner_w(int e) const { return old_w_[kN - 1 - e]; }
  TBEGEN_HD TBEGEN_INLINE float partner_element(int k, int e) const { return old_el_[k][kN - 1 - e]; }
  TBEGEN_HD TBEGEN_INLINE float row_state(int k) const { return row_[k]; }
  TBEGEN_HD TBEGEN_INLINE int64_t int_row_state(int k) const { return int_row_[k]; }
  // Called at the start of each stage that reads partner(...).
  TBEGEN_HD TBEGEN_INLINE void snapshot() {
    for (int e = 0; e < kN; ++e) {
      old_w_[e] = w_[e];
      for (int k = 0; k < Opt::kElementStates; ++k) old_el_[k][e] = el_[k][e];
    }
  }
};

// Where a whole-table stage reads and writes a unit's weights: in the weights buffer itself
// (float, fp16, bf16), each element rounded back once at the end, as the backward rounds
// (stochastically when asked).
template <typename W>
struct TableWeightsInPlace {
  W* weights;
  int64_t base;  // the row's first element

  TBEGEN_HD TBEGEN_INLINE float load(int32_t col) const { return WeightTraits<W>::load(weights[base + col]); }
  TBEGEN_HD TBEGEN_INLINE void store(int32_t col, float x, const RowUpdateContext& ctx, int64_t key) const {
    weights[base + col] = WeightTraits<W>::round(x, random_bits(ctx.seed, ctx.step, key, col), ctx.stochastic_rounding);
  }
};

// ... or in a float copy of the row (int8 rows: the row is dequantized into it before its units
// run and quantized from it afterwards, run_table_row_int8).
struct TableWeightsFloatRow {
  float* row;

  TBEGEN_HD TBEGEN_INLINE float load(int32_t col) const { return row[col]; }
  TBEGEN_HD TBEGEN_INLINE void store(int32_t col, float x, const RowUpdateContext&, int64_t) const { row[col] = x; }
};

// Runs the whole-table stages on unit `u` of row `row` of table `t`: loads the unit's weights
// (through `io`) and states, calls the generated Opt::table_unit, and stores them back (narrow
// states rounded stochastically, always: common.h). `ctx.seed` is already table_stage_seed(seed).
template <class Opt, class WeightsIO>
TBEGEN_HD TBEGEN_INLINE void run_table_unit_with(const typename Opt::Params& p, const WeightsIO& io,
                                                 const TableExtent& t, int64_t row, int64_t u,
                                                 const RowUpdateContext& ctx) {
  TableUnit<Opt> unit;
  const int64_t D = t.dim;
  unit.dim_ = static_cast<int>(D);
  unit.cols_[0] = static_cast<int>(u);
  if (TableUnit<Opt>::kN == 2) unit.cols_[TableUnit<Opt>::kN - 1] = static_cast<int>(u + D / 2);
  const int64_t base = t.weights_offset + row * D;  // (per-element states: the element layout)
  const int64_t key = t.key_base + row;
  for (int e = 0; e < TableUnit<Opt>::kN; ++e) {
    const int64_t i = base + unit.cols_[e];
    unit.w_[e] = io.load(unit.cols_[e]);
    for (int k = 0; k < Opt::kElementStates; ++k) {
      unit.el_[k][e] = load_state(p.element_states[k], p.element_state_dtypes[k], i);
    }
  }
  for (int k = 0; k < Opt::kRowStates; ++k) unit.row_[k] = load_state(p.row_states[k], p.row_state_dtypes[k], key);
  for (int k = 0; k < Opt::kIntRowStates; ++k) unit.int_row_[k] = p.int_row_states[k][key];
  Opt::table_unit(unit, p, ctx.step);
  for (int e = 0; e < TableUnit<Opt>::kN; ++e) {
    const int32_t d = unit.cols_[e];
    const int64_t i = base + d;
    io.store(d, unit.w_[e], ctx, key);
    for (int k = 0; k < Opt::kElementStates; ++k) {
      store_state(p.element_states[k], p.element_state_dtypes[k], i, unit.el_[k][e], ctx, k, key, d);
    }
  }
}

// The whole-table stages on one unit of float, fp16 or bf16 weights, in place.
template <class Opt, typename W>
TBEGEN_HD TBEGEN_INLINE void run_table_unit(const typename Opt::Params& p, W* weights, const TableExtent& t,
                                            int64_t row, int64_t u, const RowUpdateContext& ctx) {
  const TableWeightsInPlace<W> io{weights, t.weights_offset + row * t.dim};
  run_table_unit_with<Opt>(p, io, t, row, u, ctx);
}

// ---- int8 rows (uint8 weights, common.h) ----
//
// A stage cannot update an int8 row element by element: the row is dequantized into a float copy
// (`w = fmaf(scale, q, bias)`, as every kernel reads it), every unit of the row runs on the copy,
// and the row is quantized again from the copy with fresh qparams from its min and max, as the
// fused update quantizes (quantize_row_int8, common.h). A row whose values the stages left
// bitwise unchanged (say, a stage that writes only an element state, or the first half of an
// emainplace row moving towards itself) keeps its bytes: re-quantizing an unchanged row could
// move its qparams by float32 rounding, step after step, without any update.

// Where int8 row `row` of table `t` starts in the byte buffer (its codes, then its qparams).
TBEGEN_HD TBEGEN_INLINE uint8_t* table_int8_row(uint8_t* weights, const TableExtent& t, int64_t row) {
  return weights + weights_row_start<uint8_t>(t.weights_offset + row * t.dim, t.key_base + row);
}

// Whether the float value `x` is, bit for bit, the dequantized code `code`.
TBEGEN_HD TBEGEN_INLINE bool same_as_code(float x, uint8_t code, const Int8QParams& q) {
  const float old = load_weight(code, q);
  uint32_t a, b;
  memcpy(&a, &x, sizeof(a));
  memcpy(&b, &old, sizeof(b));
  return a == b;
}

// One int8 row's whole-table stages, by one thread (the CPU loop), through `scratch` (dim floats).
template <class Opt>
TBEGEN_HD TBEGEN_INLINE void run_table_row_int8(const typename Opt::Params& p, uint8_t* weights, const TableExtent& t,
                                                int64_t row, const RowUpdateContext& ctx, float* scratch) {
  const int D = static_cast<int>(t.dim);
  uint8_t* wrow = table_int8_row(weights, t, row);
  const Int8QParams q = load_qparams(wrow, D);
  for (int d = 0; d < D; ++d) scratch[d] = load_weight(wrow[d], q);
  const TableWeightsFloatRow io{scratch};
  const int64_t units = table_units_per_row<Opt>(t.dim);
  for (int64_t u = 0; u < units; ++u) run_table_unit_with<Opt>(p, io, t, row, u, ctx);
  bool changed = false;
  for (int d = 0; d < D; ++d) changed = changed || !same_as_code(scratch[d], wrow[d], q);
  if (changed) quantize_row_int8(wrow, scratch, D);
}

}  // namespace tbegen
