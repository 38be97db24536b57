// tbegen runtime: the variable-batch (VBE) output of the pooled operators, shared by the CPU and
// CUDA host wrappers.
//
// A VBE batch reaches the operators as a fixed batch of F x B bags (every feature padded to the
// largest batch with empty bags, feature-major as always) plus `bag_output_offsets`: for each bag
// the element offset of its D_f pooled values in FBGEMM's 1-D, rank-major VBE output, or -1 for a
// padding bag (it has no lookups: the forward writes nothing for it, the backward reads no
// gradient for it). The forward then writes bag b's row at out + bag_output_offsets[b] instead of
// out + b * total_D + column_f, the backward and the per-sample-weight gradient read it there.
// Without the table (None) the operators are exactly the fixed-batch ones.
#pragma once

#include <numeric>

#include "tbegen/host.h"

namespace tbegen {

// Checks the table's shape and dtype against the batch (every operator, CPU and CUDA) and, for the
// forward, the output size. Pooling none has no bags in its output: the table is refused there.
inline void check_bag_output_offsets(const Batch& b, const at::Tensor& table, const at::Tensor& weights) {
  check_tensor(table, "bag_output_offsets", weights);
  TBEGEN_CHECK(b.pooling != kPoolNone, "tbegen: bag_output_offsets (a variable-batch output) needs pooling sum "
              "or mean; pooling none has one output row per index");
  TBEGEN_CHECK(table.scalar_type() == at::kLong, "tbegen: bag_output_offsets must be int64, got ",
              dtype_name(table.scalar_type()));
  TBEGEN_CHECK(table.dim() == 1 && table.numel() == b.F * b.B, "tbegen: bag_output_offsets must be 1-D with one "
              "entry per bag (F * B = ", b.F, " x ", b.B, " = ", b.F * b.B, "), got shape ", table.sizes());
}

// The gradient of a VBE output: 1-D float32, as long as that output.
inline void check_vbe_grad_output(const at::Tensor& grad_output, const at::Tensor& weights) {
  check_tensor(grad_output, "grad_output", weights);
  TBEGEN_CHECK(grad_output.scalar_type() == at::kFloat, "tbegen: grad_output must be float32, got ",
              dtype_name(grad_output.scalar_type()));
  TBEGEN_CHECK(grad_output.dim() == 1, "tbegen: with bag_output_offsets, grad_output must be the 1-D gradient "
              "of the variable-batch output, got shape ", grad_output.sizes());
}

// The output gradient the backward and the per-sample-weight gradient read, checked: with a VBE
// table (itself checked here), the 1-D gradient of the variable-batch output; else the [B, total_D]
// gradient of the fixed batch. Returns the table's data, or nullptr without one.
inline const int64_t* check_grad_output_of(const Batch& b, const at::Tensor& grad_output, const at::Tensor& weights,
                                           const c10::optional<at::Tensor>& bag_output_offsets) {
  if (!bag_output_offsets.has_value()) {
    check_grad_output(b, grad_output, weights);
    return nullptr;
  }
  check_bag_output_offsets(b, *bag_output_offsets, weights);
  check_vbe_grad_output(grad_output, weights);
  return bag_output_offsets->data_ptr<int64_t>();
}

// The table's values, on the host (CPU tensors): each bag's D_f values lie inside the output of
// `numel` elements, and a padding bag (-1) is empty. With `tiling` (the forward, whose output is
// not zeroed first) also: the real bags' rows tile the output exactly, none overlapping another
// and no element left unwritten; checked on a map of the output in steps of the widths' greatest
// common divisor (every offset a multiple of it), one byte a step. Nothing is written before this
// passes.
template <typename I>
inline void check_bag_output_values_host(const Batch& b, const int64_t* feat, const int64_t* table, const I* offsets,
                                         int64_t numel, bool tiling = false) {
  std::atomic<int64_t> first_bad{b.F * b.B};
  at::parallel_for(0, b.F * b.B, 4096, [&](int64_t begin, int64_t end) {
    for (int64_t bag = begin; bag < end; ++bag) {
      const int64_t at_ = table[bag];
      const int64_t D = feat[(bag / b.B) * kFeatColumns + kFeatDim];
      const bool ok = at_ == -1 ? offsets[bag + 1] == offsets[bag] : (at_ >= 0 && at_ <= numel - D);
      if (!ok) {
        int64_t seen = first_bad.load();
        while (bag < seen && !first_bad.compare_exchange_weak(seen, bag)) {
        }
        return;
      }
    }
  });
  const int64_t bad = first_bad.load();
  if (bad != b.F * b.B) {
    const int64_t D = feat[(bad / b.B) * kFeatColumns + kFeatDim];
    TBEGEN_CHECK(table[bad] != -1, "tbegen: bag_output_offsets marks bag ", bad, " (feature ", bad / b.B,
                ") as padding (-1), but it has ", int64_t(offsets[bad + 1] - offsets[bad]), " indices");
    TBEGEN_CHECK(false, "tbegen: bag_output_offsets[", bad, "] = ", table[bad], " puts feature ", bad / b.B,
                "'s ", D, " values outside the variable-batch output of ", numel, " elements");
  }
  if (!tiling) return;
  int64_t g = 0;
  for (int64_t f = 0; f < b.F; ++f) g = std::gcd(g, feat[f * kFeatColumns + kFeatDim]);
  if (g == 0) g = 1;
  TBEGEN_CHECK(numel % g == 0, "tbegen: the variable-batch output's ", numel, " elements are not rows of the "
              "features' widths");
  std::vector<uint8_t> written(size_t(numel / g), 0);
  int64_t covered = 0;
  for (int64_t bag = 0; bag < b.F * b.B; ++bag) {
    const int64_t at_ = table[bag];
    if (at_ < 0) continue;
    const int64_t D = feat[(bag / b.B) * kFeatColumns + kFeatDim];
    TBEGEN_CHECK(at_ % g == 0, "tbegen: bag_output_offsets[", bag, "] = ", at_, " does not start a row (every "
                "offset of a variable-batch output is a multiple of ", g, ")");
    for (int64_t k = at_ / g; k < (at_ + D) / g; ++k) {
      TBEGEN_CHECK(!written[size_t(k)], "tbegen: bag_output_offsets[", bag, "] = ", at_, " overlaps an earlier "
                  "bag's row in the variable-batch output");
      written[size_t(k)] = 1;
    }
    covered += D;
  }
  TBEGEN_CHECK(covered == numel, "tbegen: bag_output_offsets leaves ", numel - covered, " of the variable-batch "
              "output's ", numel, " elements unwritten");
}

}  // namespace tbegen
