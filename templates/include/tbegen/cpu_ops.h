// tbegen runtime: CPU implementations of the operators, shared by every optimizer. They check the
// arguments (host.h), dispatch on weight and index dtypes, and call the kernels (cpu_kernels.h).
// The optimizer's backward is a template here, instantiated by each optimizer's ops.cpp; the
// operators that do not depend on the optimizer are only declared (defined in cpu_ops.cpp).
#pragma once

#include "tbegen/cpu_kernels.h"
#include "tbegen/host.h"
#include "tbegen/vbe.h"

namespace tbegen {
namespace cpu {

// Runs `body.template operator()<W, I>()` for the weight dtype and index dtype of a call.
template <typename Body>
void dispatch_types(const at::Tensor& weights, const at::Tensor& indices, Body&& body) {
  auto with_index = [&](auto w_tag) {
    using W = decltype(w_tag);
    if (indices.scalar_type() == at::kInt) {
      body(W{}, int32_t{});
    } else {
      body(W{}, int64_t{});
    }
  };
  switch (weights.scalar_type()) {
    case at::kFloat: with_index(float{}); break;
#ifndef TBEGEN_CPU_FP32_WEIGHTS_ONLY  // (defined for the library of `tbegen test --quick`: tbegen/build.py)
    case at::kHalf: with_index(c10::Half{}); break;
    case at::kBFloat16: with_index(c10::BFloat16{}); break;
    case at::kByte: with_index(uint8_t{}); break;  // int8 rows (common.h)
#else
    case at::kHalf: case at::kBFloat16: case at::kByte:
      TBEGEN_CHECK(false, "tbegen: this library was built for float32 weights only (by tbegen test --quick), got ",
                   weights.scalar_type(), " weights");
      break;
#endif
    default: TBEGEN_CHECK(false, "tbegen: unsupported weights dtype ", weights.scalar_type());
  }
}

inline const float* optional_data(const c10::optional<at::Tensor>& t) {
  return t.has_value() ? t->data_ptr<float>() : nullptr;
}

inline int64_t* record_data(const c10::optional<at::Tensor>& record) {
  return record.has_value() ? record->data_ptr<int64_t>() : nullptr;
}

// The operators that do not depend on the optimizer: defined in cpu_ops.cpp, which the build
// compiles once per set of runtime headers and links into every optimizer's extension (hidden:
// each extension calls its own copy, whatever other extensions a process has loaded).
[[gnu::visibility("hidden")]] at::Tensor forward_cpu(const at::Tensor& weights, const at::Tensor& features,
                                                     int64_t total_D, int64_t max_D, const at::Tensor& indices,
                                                     const at::Tensor& offsets,
                                                     const c10::optional<at::Tensor>& per_sample_weights,
                                                     int64_t pooling, const c10::optional<at::Tensor>& error_record,
                                                     bool skip_bad_indices,
                                                     const c10::optional<at::Tensor>& bag_output_offsets,
                                                     int64_t output_size, const c10::optional<at::Tensor>& bag_pad);
[[gnu::visibility("hidden")]] at::Tensor grad_per_sample_weights_cpu(
    const at::Tensor& grad_output, const at::Tensor& weights, const at::Tensor& features, int64_t total_D,
    int64_t max_D, const at::Tensor& indices, const at::Tensor& offsets, int64_t pooling,
    const c10::optional<at::Tensor>& error_record, bool skip_bad_indices,
    const c10::optional<at::Tensor>& bag_output_offsets, const c10::optional<at::Tensor>& bag_pad);
// The message of an error record (see host.h), for callers that keep their own record.
[[gnu::visibility("hidden")]] std::string describe_error(const at::Tensor& record, bool with_index_errors);
// The plan of a VBE batch (vbe.h): (pad, bag_out, [total bags, max_B, output numel]), on the CPU.
[[gnu::visibility("hidden")]] std::tuple<at::Tensor, at::Tensor, std::vector<int64_t>> vbe_plan_cpu(
    at::IntArrayRef sizes, int64_t num_ranks, at::IntArrayRef dims, const at::Tensor& device_of);
// The same with the sizes in an int64 CPU tensor (vbe.h, vbe_sizes_of).
[[gnu::visibility("hidden")]] std::tuple<at::Tensor, at::Tensor, std::vector<int64_t>> vbe_plan_tensor_cpu(
    const at::Tensor& sizes, int64_t num_ranks, at::IntArrayRef dims, const at::Tensor& device_of);

// The plan of a new VBE batch with its padded offsets, in one call: (pad, bag_out, totals as
// vbe_plan's, offsets[pad]: the offsets of the padded batch, offsets' dtype; empty where offsets do
// not hold total_bags + 1 entries). The module's forward makes a new plan with it (module.py).
[[gnu::visibility("hidden")]] std::tuple<at::Tensor, at::Tensor, std::vector<int64_t>, at::Tensor>
vbe_plan_padded_cpu(const at::Tensor& sizes, int64_t num_ranks, at::IntArrayRef dims, const at::Tensor& offsets);

template <class Opt>
void backward_cpu(const at::Tensor& grad_output, const at::Tensor& weights, const at::Tensor& features,
                  int64_t total_D, int64_t max_D, int64_t total_hash_size, const at::Tensor& indices,
                  const at::Tensor& offsets, const c10::optional<at::Tensor>& per_sample_weights,
                  int64_t pooling, const typename Opt::Params& params, const RowUpdateContext& ctx,
                  const c10::optional<at::Tensor>& error_record, bool skip_bad_indices, bool check_finite,
                  const c10::optional<at::Tensor>& bag_output_offsets, const c10::optional<at::Tensor>& bag_pad) {
  const Batch b =
      check_batch(weights, features, total_D, max_D, indices, offsets, per_sample_weights, pooling, bag_pad);
  const int64_t* bag_out = check_grad_output_of(b, grad_output, weights, bag_output_offsets);
  check_error_record(error_record, weights);
  if (check_finite) {
    if (per_sample_weights.has_value()) {
      check_finite_host(per_sample_weights->data_ptr<float>(), b.N, kErrNonFinitePerSampleWeight);
    }
    check_finite_host(grad_output.data_ptr<float>(), grad_output.numel(), kErrNonFiniteGradient);
  }
  const int64_t* feat = features.data_ptr<int64_t>();
  for (int64_t f = 0; f < b.F; ++f) {
    const int64_t* ft = feat + f * kFeatColumns;
    TBEGEN_CHECK(ft[kFeatKeyBase] >= 0 && ft[kFeatKeyBase] + ft[kFeatRows] <= total_hash_size,
                "tbegen: feature ", f, "'s keys exceed total_hash_size = ", total_hash_size);
  }
  dispatch_types(weights, indices, [&](auto w, auto i) {
    using W = decltype(w);
    using I = decltype(i);
    // (bag_pad: the padded batch's offsets read through it into a buffer, host.h)
    std::vector<I> padded;
    const I* off = padded_offsets_host<I>(b, offsets.data_ptr<I>(), padded);
    // All checks happen before the first write: bad input leaves weights and states untouched.
    check_indices_host<I>(b, feat, indices.data_ptr<I>(), off, skip_bad_indices, record_data(error_record));
    if (bag_out != nullptr) check_bag_output_values_host<I>(b, feat, bag_out, off, grad_output.numel());
    backward<Opt, W, I>(b, feat, total_hash_size, grad_output.data_ptr<float>(), weights.data_ptr<W>(),
                        indices.data_ptr<I>(), off, optional_data(per_sample_weights), params, ctx, bag_out);
  });
}

}  // namespace cpu

}  // namespace tbegen
