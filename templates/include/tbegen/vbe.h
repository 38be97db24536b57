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

#include <algorithm>
#include <atomic>
#include <mutex>
#include <numeric>
#include <tuple>
#include <utility>
#include <vector>

#include "tbegen/host.h"

namespace tbegen {

// Bags up to which check_bag_output_values_host's first pass runs on the calling thread (and the
// chunk of its parallel loop beyond).
constexpr int64_t kVbeSerialBags = 16384;

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
// passes. Both passes walk the bags feature by feature (bag f * B + j has feature f's width: no
// division per bag, which was most of a small VBE call's cost here); the first, in parallel chunks
// for large batches, finds the first bag out of place, so that its message comes first.
template <typename I>
inline void check_bag_output_values_host(const Batch& b, const int64_t* feat, const int64_t* table, const I* offsets,
                                         int64_t numel, bool tiling = false) {
  const int64_t bags = b.F * b.B;
  // the first bag in [begin, end) out of place, or `bags`
  auto first_bad_in = [&](int64_t begin, int64_t end) -> int64_t {
    for (int64_t f = begin / std::max<int64_t>(b.B, 1); f < b.F && f * b.B < end; ++f) {
      const int64_t D = feat[f * kFeatColumns + kFeatDim];
      const int64_t last = numel - D;
      for (int64_t bag = std::max(begin, f * b.B); bag < std::min(end, (f + 1) * b.B); ++bag) {
        const int64_t at_ = table[bag];
        if (at_ == -1 ? offsets[bag + 1] != offsets[bag] : (at_ < 0 || at_ > last)) return bag;
      }
    }
    return bags;
  };
  int64_t bad = bags;
  if (bags <= kVbeSerialBags) {
    bad = first_bad_in(0, bags);
  } else {
    std::atomic<int64_t> first_bad{bags};
    at::parallel_for(0, bags, kVbeSerialBags, [&](int64_t begin, int64_t end) {
      const int64_t found = first_bad_in(begin, end);
      int64_t seen = first_bad.load();
      while (found < seen && !first_bad.compare_exchange_weak(seen, found)) {
      }
    });
    bad = first_bad.load();
  }
  if (bad != bags) {
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
  for (int64_t f = 0; f < b.F; ++f) {
    const int64_t D = feat[f * kFeatColumns + kFeatDim];
    const int64_t steps = D / g;
    for (int64_t bag = f * b.B; bag < (f + 1) * b.B; ++bag) {
      const int64_t at_ = table[bag];
      if (at_ < 0) continue;
      TBEGEN_CHECK(at_ % g == 0, "tbegen: bag_output_offsets[", bag, "] = ", at_, " does not start a row (every "
                  "offset of a variable-batch output is a multiple of ", g, ")");
      uint8_t* row = written.data() + at_ / g;
      for (int64_t k = 0; k < steps; ++k) {
        TBEGEN_CHECK(!row[k], "tbegen: bag_output_offsets[", bag, "] = ", at_, " overlaps an earlier bag's row in "
                    "the variable-batch output");
        row[k] = 1;
      }
      covered += D;
    }
  }
  TBEGEN_CHECK(covered == numel, "tbegen: bag_output_offsets leaves ", numel - covered, " of the variable-batch "
              "output's ", numel, " elements unwritten");
}

// ---- the tables the plan operator made ----
//
// A `bag_out` table made by vbe_plan (below) tiles the output of its plan's numel with the widths
// it was made for, by construction. The forward otherwise makes sure of that itself (CPU: the
// tiling pass of check_bag_output_values_host; CUDA, which cannot read the table on the host:
// it zeroes the output first); for such a table, unchanged, it skips both. Unchanged: the same
// tensor (its TensorImpl, held weakly so that its address is not reused while remembered, and
// its data), its version counter as it was (every in-place change made through torch bumps it),
// and the forward's output size and features' widths those of the plan. The last
// kVbePlanTablesKept tables made are remembered (the module keeps 64 plans).
class VbePlanTables {
 public:
  static VbePlanTables& instance() {
    static VbePlanTables tables;
    return tables;
  }

  void remember(const at::Tensor& table, int64_t numel, at::IntArrayRef dims) {
    if (table.is_inference()) return;  // (no version counter to key on)
    const std::lock_guard<std::mutex> lock(mutex_);
    Entry& e = entries_[next_];
    next_ = (next_ + 1) % kVbePlanTablesKept;
    e = Entry{c10::weak_intrusive_ptr<c10::TensorImpl>(table.getIntrusivePtr()), table.data_ptr(), table._version(),
              numel, std::vector<int64_t>(dims.begin(), dims.end())};
  }

  // Whether `table` is one remembered, unchanged, and `numel` and the F features' widths (`feat`,
  // the features table's rows, host) are its plan's.
  bool tiles(const at::Tensor& table, int64_t numel, const int64_t* feat, int64_t F) {
    if (table.is_inference()) return false;
    const std::lock_guard<std::mutex> lock(mutex_);
    for (size_t k = 1; k <= kVbePlanTablesKept; ++k) {  // (the latest first)
      const Entry& e = entries_[(next_ + kVbePlanTablesKept - k) % kVbePlanTablesKept];
      if (e.impl._unsafe_get_target() != table.unsafeGetTensorImpl() || e.impl.expired()) continue;
      if (e.data != table.data_ptr() || e.version != table._version() || e.numel != numel ||
          int64_t(e.dims.size()) != F) {
        return false;
      }
      for (int64_t f = 0; f < F; ++f) {
        if (feat[f * kFeatColumns + kFeatDim] != e.dims[size_t(f)]) return false;
      }
      return true;
    }
    return false;
  }

 private:
  static constexpr size_t kVbePlanTablesKept = 64;
  struct Entry {
    c10::weak_intrusive_ptr<c10::TensorImpl> impl{c10::intrusive_ptr<c10::TensorImpl>()};
    const void* data = nullptr;
    int64_t version = 0;
    int64_t numel = 0;
    std::vector<int64_t> dims;
  };
  std::mutex mutex_;
  Entry entries_[kVbePlanTablesKept];
  size_t next_ = 0;
};

// ---- the plan of a VBE batch (module.py _vbe_plan; the operator vbe_plan) ----
//
// From the batch sizes B[f][r] (F features, R ranks; host int64) and the features' widths D_f, the
// two tables the operators need: `pad` (F * max_B + 1 entries: padded bag (f, b) starts where VBE
// bag first_f + min(b, B_f) starts, the last entry the VBE bag count; offsets[pad] are the padded
// batch's offsets) and `bag_out` (F * max_B entries: bag_output_offsets above). The host sums the
// small [F, R] sizes into a header; each padded bag's two entries then follow from it alone
// (vbe_plan_entry), on the host for the CPU and in one kernel for CUDA, which takes the header as its
// argument (vbe_plan_cuda.cuh).

// The header's layout: per feature f, at f * kVbeFeatureColumns, its first bag in the VBE order
// (features, then ranks, then samples), its bag count B_f and its width D_f; then, from
// F * kVbeFeatureColumns, per (f, r) at 2 * (f * R + r): the end of rank r's bags among f's (the
// inclusive prefix sum of B[f][0..r]) and the first element of segment (r, f) in the rank-major
// output (for each rank, for each feature, B[f][r] rows of D_f values).
constexpr int64_t kVbeFeatureColumns = 3;

inline int64_t vbe_plan_header_size(int64_t F, int64_t R) { return F * kVbeFeatureColumns + 2 * F * R; }

struct VbeTotals {
  int64_t total_bags = 0;  // sum of all B[f][r]
  int64_t max_B = 0;       // the largest B_f: the padded batch
  int64_t numel = 0;       // elements of the 1-D output: sum of B[f][r] * D_f
};

// The operator's inputs: `sizes` the F x R batch sizes, feature-major (B[f][r] at f * R + r), R =
// num_ranks >= 1, and `dims` the F features' widths.
inline void check_vbe_plan_inputs(at::IntArrayRef sizes, int64_t num_ranks, at::IntArrayRef dims) {
  const int64_t F = int64_t(dims.size());
  TBEGEN_CHECK(F >= 1 && num_ranks >= 1 && int64_t(sizes.size()) / num_ranks == F &&
                  int64_t(sizes.size()) % num_ranks == 0,
              "tbegen: vbe_plan: sizes must hold F x R batch sizes (F = ", F, " features, the length of dims; R = ",
              num_ranks, " ranks, at least 1), got ", sizes.size());
}

// The operator vbe_plan_tensor's sizes (a 1-D contiguous int64 CPU tensor, the same F x R batch
// sizes as vbe_plan's int list; the module packs them into one buffer, which costs less than the
// conversion of a long Python list to int[]), as the array the plan reads.
inline at::IntArrayRef vbe_sizes_of(const at::Tensor& sizes) {
  TBEGEN_CHECK(sizes.device().is_cpu() && sizes.scalar_type() == at::kLong && sizes.dim() == 1 &&
                  sizes.is_contiguous(),
              "tbegen: vbe_plan_tensor: sizes must be a 1-D contiguous int64 CPU tensor, got ",
              dtype_name(sizes.scalar_type()), " of shape ", sizes.sizes(), " on ", sizes.device());
  return at::IntArrayRef(sizes.data_ptr<int64_t>(), size_t(sizes.numel()));
}

// vbe_plan_padded's offsets (the VBE batch's, per feature, per rank, per sample; total_bags + 1 of
// them where they fit the sizes): 1-D int32 or int64 on the plan's device. Returns whether their
// count fits the sizes; where it does not, the operator returns no padded offsets (an empty tensor)
// and the module gathers and refuses them with its own message (module.py, _vbe_pad).
inline bool check_vbe_plan_offsets(const at::Tensor& offsets, const VbeTotals& t) {
  TBEGEN_CHECK(offsets.dim() == 1 && (offsets.scalar_type() == at::kLong || offsets.scalar_type() == at::kInt),
              "tbegen: vbe_plan_padded: offsets must be a 1-D int32 or int64 tensor, got ",
              dtype_name(offsets.scalar_type()), " of shape ", offsets.sizes());
  return offsets.numel() == t.total_bags + 1;
}

// vbe_plan_padded's offsets and the padded offsets it writes (`given` undefined: vbe_plan's call, or
// offsets that do not fit the sizes, whose `padded` is then empty): the CPU and CUDA operators'.
struct VbePlanOffsets {
  const at::Tensor* offsets = nullptr;  // (the operator's argument; nullptr for vbe_plan)
  at::Tensor given;                     // (contiguous)
  at::Tensor padded;

  // Checks the offsets against the totals and allocates the padded offsets where they fit.
  void prepare(const VbeTotals& t, int64_t bags) {
    if (offsets == nullptr) return;
    if (check_vbe_plan_offsets(*offsets, t)) {
      given = offsets->contiguous();
      padded = at::empty({bags + 1}, given.options());
    } else {
      padded = at::empty({0}, offsets->options());  // (they do not fit: the module's message)
    }
  }
};

// Writes the header (vbe_plan_header_size(F, R) values) of checked inputs at `header`, checking
// the values; returns the totals.
inline VbeTotals vbe_plan_header(at::IntArrayRef sizes, int64_t num_ranks, at::IntArrayRef dims, int64_t* header) {
  const int64_t F = int64_t(dims.size()), R = num_ranks;
  const int64_t* B = sizes.data();
  const int64_t* D = dims.data();
  VbeTotals t;
  int64_t* ranks = header + F * kVbeFeatureColumns;
  for (int64_t f = 0; f < F; ++f) {
    TBEGEN_CHECK(D[f] >= 1, "tbegen: vbe_plan: dims[", f, "] must be positive, got ", D[f]);
    int64_t end = 0;
    for (int64_t r = 0; r < R; ++r) {
      const int64_t n = B[f * R + r];
      TBEGEN_CHECK(n >= 0, "tbegen: batch_size_per_feature_per_rank[", f, "][", r, "] must be a non-negative int, "
                  "got ", n);
      TBEGEN_CHECK(!__builtin_add_overflow(end, n, &end), "tbegen: batch_size_per_feature_per_rank: feature ", f,
                  "'s batch sizes overflow int64");
      ranks[2 * (f * R + r)] = end;
    }
    header[f * kVbeFeatureColumns + 0] = t.total_bags;
    header[f * kVbeFeatureColumns + 1] = end;
    header[f * kVbeFeatureColumns + 2] = D[f];
    TBEGEN_CHECK(!__builtin_add_overflow(t.total_bags, end, &t.total_bags),
                "tbegen: batch_size_per_feature_per_rank: the batch sizes overflow int64");
    t.max_B = std::max(t.max_B, end);
  }
  for (int64_t r = 0; r < R; ++r) {  // rank-major segments
    for (int64_t f = 0; f < F; ++f) {
      ranks[2 * (f * R + r) + 1] = t.numel;
      int64_t seg = 0;
      TBEGEN_CHECK(!__builtin_mul_overflow(B[f * R + r], D[f], &seg) &&
                      !__builtin_add_overflow(t.numel, seg, &t.numel),
                  "tbegen: batch_size_per_feature_per_rank: the variable-batch output's size overflows int64");
    }
  }
  int64_t padded = 0;
  TBEGEN_CHECK(!__builtin_mul_overflow(F, t.max_B, &padded) && padded < (int64_t(1) << 62),
              "tbegen: batch_size_per_feature_per_rank: the padded batch of ", F, " x ", t.max_B, " bags is too large");
  return t;
}

// The plan's two tables in one allocation: `bag_out` (bags = F * max_B entries) at its start,
// `pad` (bags + 1) after it; returns {pad, bag_out}. Each is a tensor of its own on the shared
// storage, made without the dispatcher (narrow would dispatch narrow, slice and as_strided for
// each: more host time than the allocation it saves); each has its own version counter, which
// VbePlanTables reads (nothing writes the tables after the plan operator).
inline std::pair<at::Tensor, at::Tensor> vbe_plan_tables(int64_t bags, const at::TensorOptions& options) {
  const at::Tensor both = at::empty({2 * bags + 1}, options);
  auto table = [&](int64_t offset, int64_t n) {
    auto impl = c10::make_intrusive<c10::TensorImpl>(c10::Storage(both.storage()), both.key_set(), both.dtype());
    const int64_t size[1] = {n}, stride[1] = {1};
    impl->set_sizes_and_strides(at::IntArrayRef(size), at::IntArrayRef(stride), offset);
    return at::Tensor(std::move(impl));
  };
  return {table(bags, bags + 1), table(0, bags)};
}

// Padded bag i = f * max_B + b (i < F * max_B): its `pad` entry, and its `bag_out` entry (-1 for
// a padding bag, b >= B_f). Rank r of bag b is the first whose end exceeds b (a zero-size rank's
// end equals the one before it, so it is passed over); the bag is sample b - (the end before r)
// of that rank, at segment (r, f)'s first element plus that many rows of D_f.
TBEGEN_HD inline void vbe_plan_entry(const int64_t* header, int64_t F, int64_t R, int64_t max_B, int64_t i,
                                     int64_t* pad, int64_t* bag_out) {
  const int64_t f = i / max_B, b = i - f * max_B;
  const int64_t* feat = header + f * kVbeFeatureColumns;
  const int64_t first = feat[0], B_f = feat[1], D = feat[2];
  if (b >= B_f) {
    pad[i] = first + B_f;
    bag_out[i] = -1;
    return;
  }
  pad[i] = first + b;
  const int64_t* ranks = header + F * kVbeFeatureColumns + 2 * f * R;
  int64_t lo = 0, hi = R - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (ranks[2 * mid] > b) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  const int64_t before = lo == 0 ? 0 : ranks[2 * (lo - 1)];
  bag_out[i] = ranks[2 * lo + 1] + (b - before) * D;
}

}  // namespace tbegen
