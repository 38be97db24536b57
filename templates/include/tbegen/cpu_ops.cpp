// tbegen runtime: the translation unit of the CPU operators that do not depend on the optimizer
// (forward, grad_per_sample_weights, describe_error, vbe_plan, vbe_plan_tensor; declared in cpu_ops.h), the same
// for every optimizer: the build compiles it once per set of runtime headers and links the object into
// every optimizer's extension, CPU and CPU + CUDA alike (tbegen/build.py, RUNTIME_CPU_SOURCE).
#include "tbegen/cpu_ops.h"

namespace tbegen {
namespace cpu {

namespace {

// The stand-ins the forward kernels get for skipped bad indices (cpu_kernels.h's backward skips
// them itself): row 0 with per-sample weight 0. Built only when a batch has bad indices.
template <typename I>
struct SkippedIndices {
  at::Tensor indices;  // the batch's indices, each bad one replaced by 0
  at::Tensor weights;  // the per-sample weights (1 where none were given), 0 at each bad index
  SkippedIndices(const std::vector<int64_t>& bad, const at::Tensor& given,
                 const c10::optional<at::Tensor>& per_sample_weights) {
    if (bad.empty()) return;
    indices = given.clone();
    weights = per_sample_weights.has_value() ? per_sample_weights->clone() : at::ones({given.numel()}, given.options().dtype(at::kFloat));
    I* ind = indices.data_ptr<I>();
    float* w = weights.data_ptr<float>();
    for (const int64_t i : bad) {
      ind[i] = 0;
      w[i] = 0.0f;
    }
  }
};

}  // namespace

std::string describe_error(const at::Tensor& record, bool with_index_errors) {
  return describe_error_record(record, with_index_errors);
}

namespace {

// vbe_plan_cpu's tables, and with `offsets` (1-D, contiguous, total_bags + 1 of them) the padded
// batch's offsets in the same pass: padded[i] = offsets[pad[i]] (vbe.h, vbe_plan_padded).
template <typename I>
std::tuple<at::Tensor, at::Tensor, std::vector<int64_t>, at::Tensor> vbe_plan_on_cpu(
    at::IntArrayRef sizes, int64_t num_ranks, at::IntArrayRef dims, const at::Tensor& device_of,
    const at::Tensor* offsets) {
  check_vbe_plan_inputs(sizes, num_ranks, dims);
  TBEGEN_CHECK(device_of.device().is_cpu(), "tbegen: vbe_plan: the CPU operator got a tensor on ", device_of.device());
  const int64_t F = int64_t(dims.size()), R = num_ranks;
  std::vector<int64_t> header(size_t(vbe_plan_header_size(F, R)));
  const VbeTotals t = vbe_plan_header(sizes, num_ranks, dims, header.data());
  const int64_t bags = F * t.max_B;
  VbePlanOffsets given_offsets;  // (vbe.h: checked, and the padded offsets allocated, where given)
  given_offsets.offsets = offsets;
  given_offsets.prepare(t, bags);
  const at::Tensor& given = given_offsets.given;
  const at::Tensor& padded = given_offsets.padded;
  const auto [pad, bag_out] = vbe_plan_tables(bags, at::TensorOptions().dtype(at::kLong));  // (vbe.h)
  int64_t* p = pad.data_ptr<int64_t>();
  int64_t* o = bag_out.data_ptr<int64_t>();
  const I* off = given.defined() ? given.data_ptr<I>() : nullptr;
  I* pd = given.defined() ? padded.data_ptr<I>() : nullptr;
  at::parallel_for(0, bags, 16384, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      vbe_plan_entry(header.data(), F, R, t.max_B, i, p, o);
      if (pd != nullptr) pd[i] = off[p[i]];
    }
  });
  p[bags] = t.total_bags;
  if (pd != nullptr) pd[bags] = off[t.total_bags];
  VbePlanTables::instance().remember(bag_out, t.numel, dims);  // (it tiles its output: the forward trusts it)
  return {pad, bag_out, {t.total_bags, t.max_B, t.numel}, padded};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, std::vector<int64_t>> vbe_plan_cpu(at::IntArrayRef sizes, int64_t num_ranks,
                                                                      at::IntArrayRef dims, const at::Tensor& device_of) {
  auto [pad, bag_out, totals, padded] = vbe_plan_on_cpu<int64_t>(sizes, num_ranks, dims, device_of, nullptr);
  return {pad, bag_out, totals};
}

std::tuple<at::Tensor, at::Tensor, std::vector<int64_t>> vbe_plan_tensor_cpu(const at::Tensor& sizes, int64_t num_ranks,
                                                                             at::IntArrayRef dims,
                                                                             const at::Tensor& device_of) {
  return vbe_plan_cpu(vbe_sizes_of(sizes), num_ranks, dims, device_of);
}

std::tuple<at::Tensor, at::Tensor, std::vector<int64_t>, at::Tensor> vbe_plan_padded_cpu(
    const at::Tensor& sizes, int64_t num_ranks, at::IntArrayRef dims, const at::Tensor& offsets) {
  const at::IntArrayRef B = vbe_sizes_of(sizes);
  if (offsets.scalar_type() == at::kInt) {
    return vbe_plan_on_cpu<int32_t>(B, num_ranks, dims, offsets, &offsets);
  }
  return vbe_plan_on_cpu<int64_t>(B, num_ranks, dims, offsets, &offsets);
}

// Checks the batch's indices and offsets (host.h, check_indices_host) and returns the positions of
// the bad indices to skip (empty unless skip_bad_indices; otherwise a bad index raises).
template <typename I>
std::vector<int64_t> bad_indices(const Batch& b, const at::Tensor& features, const at::Tensor& indices,
                                 const I* offsets, const c10::optional<at::Tensor>& error_record,
                                 bool skip_bad_indices) {
  return check_indices_host<I>(b, features.data_ptr<int64_t>(), indices.data_ptr<I>(), offsets, skip_bad_indices,
                               record_data(error_record));
}

at::Tensor forward_cpu(const at::Tensor& weights, const at::Tensor& features, int64_t total_D, int64_t max_D,
                       const at::Tensor& indices, const at::Tensor& offsets,
                       const c10::optional<at::Tensor>& per_sample_weights, int64_t pooling,
                       const c10::optional<at::Tensor>& error_record, bool skip_bad_indices,
                       const c10::optional<at::Tensor>& bag_output_offsets, int64_t output_size,
                       const c10::optional<at::Tensor>& bag_pad) {
  const Batch b =
      check_batch(weights, features, total_D, max_D, indices, offsets, per_sample_weights, pooling, bag_pad);
  check_error_record(error_record, weights);
  const bool vbe = bag_output_offsets.has_value();
  if (vbe) {
    check_bag_output_offsets(b, *bag_output_offsets, weights);
    TBEGEN_CHECK(output_size >= 0, "tbegen: with bag_output_offsets, output_size (the numel of the variable-batch "
                "output) must be given, got ", output_size);
  }
  const int64_t* bag_out = vbe ? bag_output_offsets->data_ptr<int64_t>() : nullptr;
  // (a VBE output is not zeroed: its real bags' rows tile it, which check_bag_output_values_host
  // checks before the kernel writes them, unless the table is one vbe_plan made, unchanged, for
  // this output and these widths: VbePlanTables)
  const bool tiles = vbe && VbePlanTables::instance().tiles(*bag_output_offsets, output_size,
                                                            features.data_ptr<int64_t>(), b.F);
  at::Tensor out = vbe ? at::empty({output_size}, weights.options().dtype(at::kFloat))
                   : pooling == kPoolNone ? at::empty({b.N, b.max_D}, weights.options().dtype(at::kFloat))
                                          : at::empty({b.B, b.total_D}, weights.options().dtype(at::kFloat));
  dispatch_types(weights, indices, [&](auto w, auto i) {
    using W = decltype(w);
    using I = decltype(i);
    // (bag_pad: the padded batch's offsets read through it into a buffer, host.h)
    std::vector<I> padded;
    const I* off = padded_offsets_host<I>(b, offsets.data_ptr<I>(), padded);
    const std::vector<int64_t> bad = bad_indices<I>(b, features, indices, off, error_record, skip_bad_indices);
    if (vbe) {
      check_bag_output_values_host<I>(b, features.data_ptr<int64_t>(), bag_out, off, output_size,
                                      /*tiling=*/!tiles);
    }
    if (bad.empty()) {
      forward<W, I>(b, features.data_ptr<int64_t>(), weights.data_ptr<W>(), indices.data_ptr<I>(), off,
                    optional_data(per_sample_weights), out.data_ptr<float>(), bag_out);
      return;
    }
    // Skipped bad indices: each looks up row 0 with weight 0 (so it adds nothing, and a mean still
    // divides by the bag's full length, as on CUDA); for pooling none its row is zeroed after.
    const SkippedIndices<I> skip(bad, indices, per_sample_weights);
    forward<W, I>(b, features.data_ptr<int64_t>(), weights.data_ptr<W>(), skip.indices.template data_ptr<I>(), off,
                  skip.weights.template data_ptr<float>(), out.data_ptr<float>(), bag_out);
    if (pooling == kPoolNone) {
      for (const int64_t i : bad) out[i].zero_();
    }
  });
  return out;
}

at::Tensor grad_per_sample_weights_cpu(const at::Tensor& grad_output, const at::Tensor& weights,
                                       const at::Tensor& features, int64_t total_D, int64_t max_D,
                                       const at::Tensor& indices, const at::Tensor& offsets, int64_t pooling,
                                       const c10::optional<at::Tensor>& error_record, bool skip_bad_indices,
                                       const c10::optional<at::Tensor>& bag_output_offsets,
                                       const c10::optional<at::Tensor>& bag_pad) {
  const Batch b = check_batch(weights, features, total_D, max_D, indices, offsets, c10::nullopt, pooling, bag_pad);
  const int64_t* bag_out = check_grad_output_of(b, grad_output, weights, bag_output_offsets);
  check_error_record(error_record, weights);
  at::Tensor grad = at::empty({b.N}, weights.options().dtype(at::kFloat));
  dispatch_types(weights, indices, [&](auto w, auto i) {
    using W = decltype(w);
    using I = decltype(i);
    std::vector<I> padded;
    const I* off = padded_offsets_host<I>(b, offsets.data_ptr<I>(), padded);
    const std::vector<int64_t> bad = bad_indices<I>(b, features, indices, off, error_record, skip_bad_indices);
    if (bag_out != nullptr) {
      check_bag_output_values_host<I>(b, features.data_ptr<int64_t>(), bag_out, off, grad_output.numel());
    }
    const SkippedIndices<I> skip(bad, indices, c10::nullopt);
    grad_per_sample_weights<W, I>(b, features.data_ptr<int64_t>(), grad_output.data_ptr<float>(),
                                  weights.data_ptr<W>(), (bad.empty() ? indices : skip.indices).template data_ptr<I>(),
                                  off, grad.data_ptr<float>(), bag_out);
    float* g = grad.data_ptr<float>();
    for (const int64_t i : bad) g[i] = 0.0f;  // a skipped index's weight gets no gradient
  });
  return grad;
}

}  // namespace cpu
}  // namespace tbegen
