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

// The table's values, on the host (CPU tensors): each bag's D_f values lie inside the output of
// `numel` elements, and a padding bag (-1) is empty. Nothing is written before this passes.
template <typename I>
inline void check_bag_output_values_host(const Batch& b, const int64_t* feat, const int64_t* table, const I* offsets,
                                         int64_t numel) {
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
  const int64_t bag = first_bad.load();
  if (bag == b.F * b.B) return;
  const int64_t D = feat[(bag / b.B) * kFeatColumns + kFeatDim];
  TBEGEN_CHECK(table[bag] != -1, "tbegen: bag_output_offsets marks bag ", bag, " (feature ", bag / b.B,
              ") as padding (-1), but it has ", int64_t(offsets[bag + 1] - offsets[bag]), " indices");
  TBEGEN_CHECK(false, "tbegen: bag_output_offsets[", bag, "] = ", table[bag], " puts feature ", bag / b.B,
              "'s ", D, " values outside the variable-batch output of ", numel, " elements");
}

}  // namespace tbegen
