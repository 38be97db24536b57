// tbegen runtime: the CUDA forward pooled lookup and per-sample-weight gradient operators. They do
// not depend on the optimizer: cuda_forward.cu compiles them once for all optimizers.
#pragma once

#include "tbegen/cuda_ops.cuh"

namespace tbegen {
namespace cuda {

// Whether the pooled forward of rows at most 64 columns wide takes forward_bag_groups_kernel (a
// bag per group of lanes), unless TBEGEN_FORWARD_BAG_GROUPS=0, which keeps forward_kernel (a warp
// per bag; results agree to rounding). Read at every call, so that a benchmark can time both.
inline bool forward_bag_groups_enabled() { return !env_is_zero("TBEGEN_FORWARD_BAG_GROUPS"); }

inline at::Tensor forward_cuda(const at::Tensor& weights, const at::Tensor& features, int64_t total_D,
                               int64_t max_D, const at::Tensor& indices, const at::Tensor& offsets,
                               const c10::optional<at::Tensor>& per_sample_weights, int64_t pooling,
                               const c10::optional<at::Tensor>& error_record, bool skip_bad_indices,
                               const c10::optional<at::Tensor>& bag_output_offsets, int64_t output_size,
                               const c10::optional<at::Tensor>& bag_pad) {
  // (bag_pad: the offsets are the VBE batch's, read through the plan's padding index by the
  // kernels, ForwardArgs::pad, which forward_args takes from b: no gather of the offsets first)
  const Batch b =
      check_batch(weights, features, total_D, max_D, indices, offsets, per_sample_weights, pooling, bag_pad);
  const c10::cuda::CUDAGuard guard(weights.device());
  check_error_record(error_record, weights);
  const bool vbe = bag_output_offsets.has_value();
  if (vbe) {
    check_bag_output_offsets(b, *bag_output_offsets, weights);
    TBEGEN_CHECK(output_size >= 0, "tbegen: with bag_output_offsets, output_size (the numel of the variable-batch "
                "output) must be given, got ", output_size);
  }
  // Sum/mean: the kernel writes every bag's columns (zeros for a bag with bad offsets); pooling
  // none leaves the row of a bad index or bag zero. A VBE output (vbe.h) starts zeroed: the real
  // bags cover it, and its padding bags write nothing; unless its table is one vbe_plan made,
  // unchanged, for this output and these widths (VbePlanTables: its real bags' rows tile it, so
  // every element is written; no memset launch).
  const bool tiles = vbe && VbePlanTables::instance().tiles(*bag_output_offsets, output_size,
                                                            host_features_cache().get(features)->data(), b.F);
  at::Tensor out = vbe ? (tiles ? at::empty({output_size}, weights.options().dtype(at::kFloat))
                                : at::zeros({output_size}, weights.options().dtype(at::kFloat)))
                   : pooling == kPoolNone ? at::zeros({b.N, b.max_D}, weights.options().dtype(at::kFloat))
                                          : at::empty({b.B, b.total_D}, weights.options().dtype(at::kFloat));
  const at::Tensor error = error_record_for(error_record, weights);
  ForwardArgs a = forward_args(b, features, weights, per_sample_weights, out.data_ptr<float>(), error);
  if (vbe) a.bag_out = bag_output_offsets->data_ptr<int64_t>();
  WidthClasses classes;
  // (the pooled forward kernel walks rows wider than kVectorMaxD in chunks of 1024 columns; the
  // unpooled one holds a row in registers, up to kVectorMaxD)
  const int64_t max_width = pooling == kPoolNone ? kVectorMaxD : kPooledForwardMaxD;
  const bool vector_path = check_layout_and_choose(b, features, weights, {out.data_ptr()}, &classes, max_width);
  const auto stream = at::cuda::getCurrentCUDAStream();
  if (b.F * b.B > 0 && !vector_path) {
    dispatch_any_width_weights(weights, [&](auto w) {
      using W = decltype(w);
      dispatch_index(indices, [&](auto i) {
        using I = decltype(i);
        dispatch_pad(b, [&](auto pad) {
          any_width::forward_kernel<W, I, decltype(pad)::value><<<grid_for(b.F * b.B), kThreads, 0, stream>>>(
              a, weights.data_ptr<W>(), indices.data_ptr<I>(), offsets.data_ptr<I>());
        });
        TBEGEN_CUDA_CHECK(cudaGetLastError());
      });
    });
  } else if (b.F * b.B > 0 && pooling == kPoolNone) {
    dispatch_weights(weights, [&](auto w) {
      using W = decltype(w);
      dispatch_index(indices, [&](auto i) {
        using I = decltype(i);
        dispatch_vecs(b.max_D, [&](auto vecs) {
          forward_rows_kernel<W, I, decltype(vecs)::value><<<grid_for(b.F * b.B), kThreads, 0, stream>>>(
              a, weights.data_ptr<W>(), indices.data_ptr<I>(), offsets.data_ptr<I>());
          TBEGEN_CUDA_CHECK(cudaGetLastError());
        });
      });
    });
  } else if (b.F * b.B > 0 && b.max_D <= 64 && forward_bag_groups_enabled()) {
    // narrow rows: a bag per group of lanes_for_row(max_D) lanes (forward_bag_groups_kernel)
    const int lanes = lanes_for_row(int(b.max_D));
    const int64_t bags_per_block = (kThreads / kWarpSize) * (kWarpSize / lanes);
    const int64_t blocks = (b.F * b.B + bags_per_block - 1) / bags_per_block;
    dispatch_weights(weights, [&](auto w) {
      using W = decltype(w);
      dispatch_index(indices, [&](auto i) {
        using I = decltype(i);
        auto launch = [&](auto weighted) {
          dispatch_pad(b, [&](auto pad) {
            forward_bag_groups_kernel<W, I, decltype(weighted)::value, decltype(pad)::value>
                <<<int(blocks), kThreads, 0, stream>>>(a, weights.data_ptr<W>(), indices.data_ptr<I>(),
                                                       offsets.data_ptr<I>(), lanes);
          });
        };
        b.weighted ? launch(std::true_type{}) : launch(std::false_type{});
        TBEGEN_CUDA_CHECK(cudaGetLastError());
      });
    });
  } else if (b.F * b.B > 0) {
    // a warp for every bag (forward_kernel has no grid-stride loop)
    const int64_t blocks = (b.F * b.B + kThreads / kWarpSize - 1) / (kThreads / kWarpSize);
    dispatch_weights(weights, [&](auto w) {
      using W = decltype(w);
      dispatch_index(indices, [&](auto i) {
        using I = decltype(i);
        dispatch_vecs(b.max_D, [&](auto vecs) {
          constexpr int kVecs = decltype(vecs)::value;
          auto launch = [&](auto lane_groups, auto weighted) {
            constexpr bool kLG = decltype(lane_groups)::value, kW = decltype(weighted)::value;
            dispatch_pad(b, [&](auto pad) {
              constexpr bool kPad = decltype(pad)::value;
              if constexpr (kVecs == 8) {
                if (b.max_D > kVectorMaxD) {  // (rows wider than 1024 columns: pooled in chunks)
                  forward_kernel<W, I, kVecs, kLG, kW, true, kPad><<<int(blocks), kThreads, 0, stream>>>(
                      a, weights.data_ptr<W>(), indices.data_ptr<I>(), offsets.data_ptr<I>());
                  return;
                }
              }
              forward_kernel<W, I, kVecs, kLG, kW, false, kPad><<<int(blocks), kThreads, 0, stream>>>(
                  a, weights.data_ptr<W>(), indices.data_ptr<I>(), offsets.data_ptr<I>());
            });
          };
          auto launch_weighted_or_not = [&](auto lane_groups) {
            b.weighted ? launch(lane_groups, std::true_type{}) : launch(lane_groups, std::false_type{});
          };
          // (with kVecs > 1 the lane-group loop always exists, for the narrow tables among wide
          // ones: the variants without it are not even instantiated)
          if (kVecs > 1 || classes.narrowest_of_all() <= 64) {
            launch_weighted_or_not(std::true_type{});
          } else if constexpr (kVecs == 1) {
            launch_weighted_or_not(std::false_type{});
          }
          TBEGEN_CUDA_CHECK(cudaGetLastError());
        });
      });
    });
  }
  if (!error_record.has_value()) raise_kernel_error(error, !skip_bad_indices);
  return out;
}

inline at::Tensor grad_per_sample_weights_cuda(const at::Tensor& grad_output, const at::Tensor& weights,
                                               const at::Tensor& features, int64_t total_D, int64_t max_D,
                                               const at::Tensor& indices, const at::Tensor& offsets,
                                               int64_t pooling, const c10::optional<at::Tensor>& error_record,
                                               bool skip_bad_indices,
                                               const c10::optional<at::Tensor>& bag_output_offsets,
                                               const c10::optional<at::Tensor>& bag_pad) {
  const Batch b = check_batch(weights, features, total_D, max_D, indices, offsets, c10::nullopt, pooling, bag_pad);
  const c10::cuda::CUDAGuard guard(weights.device());
  const int64_t* bag_out = check_grad_output_of(b, grad_output, weights, bag_output_offsets);  // (vbe.h)
  check_error_record(error_record, weights);
  at::Tensor grad = at::zeros({b.N}, weights.options().dtype(at::kFloat));
  const at::Tensor error = error_record_for(error_record, weights);
  ForwardArgs a = forward_args(b, features, weights, c10::nullopt, nullptr, error);
  a.bag_out = bag_out;
  const bool vector_path = check_layout_and_choose(b, features, weights, {grad_output.data_ptr()});
  const auto stream = at::cuda::getCurrentCUDAStream();
  if (b.F * b.B > 0 && !vector_path) {
    dispatch_any_width_weights(weights, [&](auto w) {
      using W = decltype(w);
      dispatch_index(indices, [&](auto i) {
        using I = decltype(i);
        dispatch_pad(b, [&](auto pad) {
          any_width::grad_psw_kernel<W, I, decltype(pad)::value><<<grid_for(b.F * b.B), kThreads, 0, stream>>>(
              a, grad_output.data_ptr<float>(), weights.data_ptr<W>(), indices.data_ptr<I>(), offsets.data_ptr<I>(),
              grad.data_ptr<float>());
        });
        TBEGEN_CUDA_CHECK(cudaGetLastError());
      });
    });
  } else if (b.F * b.B > 0) {
    dispatch_weights(weights, [&](auto w) {
      using W = decltype(w);
      dispatch_index(indices, [&](auto i) {
        using I = decltype(i);
        dispatch_vecs(b.max_D, [&](auto vecs) {
          dispatch_pad(b, [&](auto pad) {
            grad_psw_kernel<W, I, decltype(vecs)::value, decltype(pad)::value>
                <<<grid_for(b.F * b.B), kThreads, 0, stream>>>(a, grad_output.data_ptr<float>(), weights.data_ptr<W>(),
                                                               indices.data_ptr<I>(), offsets.data_ptr<I>(),
                                                               grad.data_ptr<float>());
          });
          TBEGEN_CUDA_CHECK(cudaGetLastError());
        });
      });
    });
  }
  if (!error_record.has_value()) raise_kernel_error(error, !skip_bad_indices);
  return grad;
}

}  // namespace cuda
}  // namespace tbegen
