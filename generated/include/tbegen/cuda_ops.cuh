// tbegen runtime: host side of the CUDA operators, shared by every optimizer: argument checks
// (host.h), launches of the kernels (cuda_kernels.cuh) on the current stream, and the errors the
// kernels recorded. The host side of the fused backward is here; forward and the per-sample-weight
// gradient are in cuda_forward_ops.cuh. All of it is compiled once, in cuda_forward.cu, for every
// optimizer: an optimizer's own CUDA code is only its update kernels (cuda_backward_kernels.cuh),
// which backward_cuda launches through the table the optimizer's extension passes in.
#pragma once

#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <cub/cub.cuh>
#include <thrust/iterator/counting_iterator.h>

#include <array>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#include "tbegen/cuda_any_width.cuh"
#include "tbegen/cuda_backward.h"
#include "tbegen/cuda_backward_kernels.cuh"
#include "tbegen/cuda_backward_prep.cuh"
#include "tbegen/cuda_kernels.cuh"
#include "tbegen/host.h"
#include "tbegen/vbe.h"

namespace tbegen {
namespace cuda {

#define TBEGEN_CUDA_CHECK(expr)                                                             \
  do {                                                                                      \
    const cudaError_t tbegen_err = (expr);                                                  \
    TBEGEN_CHECK(tbegen_err == cudaSuccess, "tbegen: CUDA error ", cudaGetErrorString(tbegen_err), \
                " at " __FILE__ ":", __LINE__);                                            \
  } while (0)

// ---- events between the streams of one call ------------------------------------------------
//
// A call forks work onto side streams and joins it back with events (recorded on one stream,
// waited for on another). at::cuda::CUDAEvent creates its CUDA event at its first record and
// destroys it with the object: two driver calls more per event and call, five events per
// backward. These are created once per thread and device and reused by every call. That is safe:
// cudaStreamWaitEvent waits for the event's last record made before the wait (a later record does
// not change what an earlier wait waits for), every wait below follows its record in the same
// call, and the events are per thread, so two threads' calls never share one. Inside a CUDA graph
// capture the record and the wait become a dependency of the graph, as with at::cuda::CUDAEvent.
enum CallEvent { kEventPrepFork, kEventPrepChecked, kEventFork, kEventJoin, kEventNarrowJoin, kCallEvents };

class CallEvents {
 public:
  ~CallEvents() {
    // (at thread or process exit; an error here, e.g. the runtime already unloaded, is ignored)
    for (auto& per_device : events_) {
      for (cudaEvent_t e : per_device) {
        if (e != nullptr && cudaEventDestroy(e) != cudaSuccess) (void)cudaGetLastError();
      }
    }
  }
  cudaEvent_t get(CallEvent which, c10::DeviceIndex device) {
    TBEGEN_CHECK(device >= 0, "tbegen: a CUDA event needs a device index");
    if (size_t(device) >= events_.size()) events_.resize(size_t(device) + 1);  // (new entries: nullptr)
    cudaEvent_t& e = events_[size_t(device)][which];
    if (e == nullptr) {
      const c10::cuda::CUDAGuard guard(device);
      TBEGEN_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    }
    return e;
  }

 private:
  std::vector<std::array<cudaEvent_t, kCallEvents>> events_;
};

// This thread's event `which` on `device` (created at its first use).
inline cudaEvent_t call_event(CallEvent which, c10::DeviceIndex device) {
  thread_local CallEvents events;
  return events.get(which, device);
}
inline void record_event(cudaEvent_t event, const at::cuda::CUDAStream& on) {
  TBEGEN_CUDA_CHECK(cudaEventRecord(event, on.stream()));
}
inline void wait_event(cudaEvent_t event, const at::cuda::CUDAStream& on) {
  TBEGEN_CUDA_CHECK(cudaStreamWaitEvent(on.stream(), event, 0));
}
// Work queued on `to` from now on runs after the work queued on `from` so far: `event` recorded
// on `from`, waited for on `to` (a fork when `from` is the caller's stream, a join when `to` is).
inline void order_after(cudaEvent_t event, const at::cuda::CUDAStream& from, const at::cuda::CUDAStream& to) {
  record_event(event, from);
  wait_event(event, to);
}

// kVecs = 4-wide slices per lane: the smallest of 1, 2, 4, 8 that covers max_D columns.
template <typename Body>
void dispatch_vecs(int64_t max_D, Body&& body) {
  if (max_D <= 128) {
    body(std::integral_constant<int, 1>{});
  } else if (max_D <= 256) {
    body(std::integral_constant<int, 2>{});
  } else if (max_D <= 512) {
    body(std::integral_constant<int, 4>{});
  } else {
    body(std::integral_constant<int, 8>{});
  }
}

// The width class of a row of D columns: log2 of the kVecs dispatch_vecs gives it (0 to 3).
inline int width_class(int64_t D) { return D <= 128 ? 0 : D <= 256 ? 1 : D <= 512 ? 2 : 3; }

// The narrowest feature width of each width class in a call (0: no feature of that class).
struct WidthClasses {
  int64_t narrowest[4] = {0, 0, 0, 0};

  void add(int64_t D) {
    int64_t& n = narrowest[width_class(D)];
    if (n == 0 || D < n) n = D;
  }
  int count() const { return (narrowest[0] > 0) + (narrowest[1] > 0) + (narrowest[2] > 0) + (narrowest[3] > 0); }
  // the narrowest feature of the call (its first class present)
  int64_t narrowest_of_all() const {
    for (int64_t n : narrowest) {
      if (n > 0) return n;
    }
    return 0;
  }
};

template <typename Body>
void dispatch_weights(const at::Tensor& weights, Body&& body) {
  switch (weights.scalar_type()) {
    case at::kFloat: body(float{}); break;
    case at::kHalf: body(c10::Half{}); break;
    case at::kBFloat16: body(c10::BFloat16{}); break;
    default: TBEGEN_CHECK(false, "tbegen: unsupported weights dtype ", weights.scalar_type());
  }
}

// The weight dtypes of the any-width kernels: those of dispatch_weights and uint8 (int8 rows,
// common.h), which only the any-width kernels take (check_layout_and_choose), so that the 4-wide
// kernels are never instantiated for them.
template <typename Body>
void dispatch_any_width_weights(const at::Tensor& weights, Body&& body) {
  if (weights.scalar_type() == at::kByte) {
    body(uint8_t{});
  } else {
    dispatch_weights(weights, body);
  }
}

template <typename Body>
void dispatch_index(const at::Tensor& indices, Body&& body) {
  if (indices.scalar_type() == at::kInt) {
    body(int32_t{});
  } else {
    body(int64_t{});
  }
}

constexpr int kThreads = 256;

inline int grid_for(int64_t warps_of_work) {
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t blocks = (warps_of_work + kThreads / kWarpSize - 1) / (kThreads / kWarpSize);
  return int(std::max<int64_t>(1, std::min<int64_t>(blocks, int64_t(sms) * 32)));
}

inline ForwardArgs forward_args(const Batch& b, const at::Tensor& features, const at::Tensor& weights,
                                const c10::optional<at::Tensor>& psw, float* out, const at::Tensor& error) {
  ForwardArgs a;
  a.feat = features.data_ptr<int64_t>();
  a.F = b.F;
  a.B = b.B;
  a.N = b.N;
  a.total_D = b.total_D;
  a.max_D = b.max_D;
  a.weights_numel = weights.numel();
  a.psw = psw.has_value() ? psw->data_ptr<float>() : nullptr;
  a.pooling = b.pooling;
  a.out = out;
  a.error = error.data_ptr<int64_t>();
  a.pad = b.pad;
  a.pad_limit = b.offsets_count;
  return a;
}

// Calls f(std::true_type) for a batch read through a VBE padding index (Batch::pad: the kernels'
// kPad instantiations, bag_bounds<true>), else f(std::false_type).
template <typename Fn>
inline void dispatch_pad(const Batch& b, Fn&& f) {
  if (b.pad != nullptr) {
    f(std::true_type{});
  } else {
    f(std::false_type{});
  }
}

// ---- the layout on the host, and which kernels a call takes --------------------------------------
//
// The features table lives on the GPU, but the host needs it: to check it (host.h,
// check_features) and to choose between the 4-wide kernels (cuda_kernels.cuh), which take layouts
// whose widths and column offsets are multiples of 4 (host.h, vector_layout), and the any-width
// kernels (cuda_any_width.cuh), which take the rest, and also every module with a float16 or
// bfloat16 optimizer state (BackwardKernels::vector_states_fit). Reading it costs a wait for the stream, so it
// is read once per features tensor and the host copy kept, keyed by the tensor (a weak reference,
// so that a new tensor at the same address is not mistaken for it), its data pointer and its
// version counter (bumped by every in-place change made through torch). A module builds its
// features once, so only its first call waits.
class HostFeaturesCache {
 public:
  using Copy = std::shared_ptr<const std::vector<int64_t>>;

  Copy get(const at::Tensor& features) {
    // (an inference tensor has no version counter to key on: it is read on every call)
    if (features.is_inference()) return read(features);
    const std::lock_guard<std::mutex> lock(mutex_);
    for (const Entry& e : entries_) {
      if (!e.impl.expired() && e.impl._unsafe_get_target() == features.unsafeGetTensorImpl() &&
          e.data == features.data_ptr() && e.version == features._version() && e.numel == features.numel()) {
        return e.copy;
      }
    }
    Copy copy = read(features);
    // forget tensors that are gone, and the oldest entry when the cache is full
    std::vector<Entry> kept;
    for (Entry& old : entries_) {
      if (!old.impl.expired()) kept.push_back(std::move(old));
    }
    if (kept.size() >= kCapacity) kept.erase(kept.begin());
    kept.push_back(Entry{c10::weak_intrusive_ptr<c10::TensorImpl>(features.getIntrusivePtr()), features.data_ptr(),
                         features._version(), features.numel(), copy});
    entries_.swap(kept);
    return copy;
  }

 private:
  static Copy read(const at::Tensor& features) {
    const at::Tensor host = features.to(at::kCPU).contiguous();
    const int64_t* p = host.data_ptr<int64_t>();
    return std::make_shared<const std::vector<int64_t>>(p, p + host.numel());
  }

  static constexpr size_t kCapacity = 32;
  struct Entry {
    c10::weak_intrusive_ptr<c10::TensorImpl> impl;
    const void* data;
    int64_t version;
    int64_t numel;
    Copy copy;
  };
  std::mutex mutex_;
  std::vector<Entry> entries_;
};

inline bool aligned_to(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// Checks the call's features table and says whether the call takes the 4-wide kernels: a vector
// layout, with the buffers they load 4 at a time aligned for it (a weights tensor that is a view at
// an odd offset takes the any-width kernels). `classes`, if given, receives the narrowest feature
// width of each width class (the forward picks its loop by the narrowest of all, the backward its
// launches by the classes).
// (one host copy per features tensor for the whole library: check_layout_and_choose, and the VBE
// forward's widths)
inline HostFeaturesCache& host_features_cache() {
  static HostFeaturesCache cache;
  return cache;
}

inline bool check_layout_and_choose(const Batch& b, const at::Tensor& features, const at::Tensor& weights,
                                    std::initializer_list<const void*> float_buffers,
                                    WidthClasses* classes = nullptr, int64_t max_width = kVectorMaxD,
                                    bool* float_rows_4wide = nullptr) {
  const HostFeaturesCache::Copy feat = host_features_cache().get(features);
  check_features(b, feat->data(), weights);
  if (classes != nullptr) {
    for (int64_t f = 0; f < b.F; ++f) classes->add((*feat)[f * kFeatColumns + kFeatDim]);
  }
  if (float_rows_4wide != nullptr) {
    // whether the float buffers' rows (the output gradient's, and scratch rows of max_D floats)
    // can be read 4 at a time whatever the widths (BackwardArgs::float_rows_4wide)
    *float_rows_4wide = vector_layout(feat->data(), b.F, b.total_D, b.max_D, kMaxD);
    for (const void* p : float_buffers) *float_rows_4wide = *float_rows_4wide && (p == nullptr || aligned_to(p, 16));
  }
  if (!vector_layout(feat->data(), b.F, b.total_D, b.max_D, max_width)) return false;
  // int8 rows (uint8 weights) always take the any-width kernels, which dequantize and quantize
  // a row column by column; the 4-wide kernels have no int8 code (and no run-time dtype branch)
  if (weights.scalar_type() == at::kByte) return false;
  if (!aligned_to(weights.data_ptr(), 4 * weights.element_size())) return false;
  for (const void* p : float_buffers) {
    if (p != nullptr && !aligned_to(p, 16)) return false;
  }
  return true;
}

// Warps of an any-width kernel: at most `wanted`, and no more than keep the scratch area (slots
// rows of max_D floats per warp) within kAnyWidthScratchBytes.
constexpr int64_t kAnyWidthScratchBytes = int64_t(64) << 20;
inline int64_t any_width_blocks(int64_t wanted_blocks, int64_t slots, int64_t max_D) {
  const int64_t per_block = int64_t(kThreads / kWarpSize) * slots * max_D * int64_t(sizeof(float));
  const int64_t cap = std::max<int64_t>(1, kAnyWidthScratchBytes / std::max<int64_t>(per_block, 1));
  return std::max<int64_t>(1, std::min(wanted_blocks, cap));
}

// The error record a call writes to: the caller's, or a fresh one that the call reads back itself
// before returning (raising what it says).
inline at::Tensor error_record_for(const c10::optional<at::Tensor>& given, const at::Tensor& like) {
  return given.has_value() ? *given : at::zeros({kErrRecordSize}, like.options().dtype(at::kLong));
}

// Runs a CUB algorithm twice: once to size its scratch space, once with scratch from torch's
// caching allocator.
template <typename Algorithm>
void run_cub(const at::Tensor& like, Algorithm&& algorithm) {
  size_t bytes = 0;
  TBEGEN_CUDA_CHECK(algorithm(nullptr, bytes));
  at::Tensor scratch = at::empty({int64_t(std::max<size_t>(bytes, 1))}, like.options().dtype(at::kByte));
  TBEGEN_CUDA_CHECK(algorithm(scratch.data_ptr(), bytes));
}

// The update kernels of the backward for layouts the 4-wide kernels do not take (any-width
// path): the same three kernels, on the same streams, over the same prepared batch, launched
// through the optimizer's table (cuda_backward_kernels.cuh: AnyWidthLaunch).
inline void backward_any_width(const Batch& b, const BackwardArgs& a, const PreparedBackward& prep, const at::Tensor& weights,
                               const void* params, const BackwardKernels& kernels, const RowUpdateContext& ctx,
                               const at::cuda::CUDAStream& stream, const at::cuda::CUDAStream& side,
                               cudaEvent_t joined, int sms) {
  dispatch_any_width_weights(weights, [&](auto w) {
    using W = decltype(w);
    const AnyWidthKernels& k = kernels.any_width_for<W>();
    // (the narrow element states' float copies count: computed from the Params' state dtypes)
    const int64_t slots = k.scratch_slots(params);
    const auto floats = weights.options().dtype(at::kFloat);
    // (the partial sums, max_D floats each: prep.partial, carved by prepare_backward)
    // the long runs' kernels (on the side stream, one after the other) share a scratch area
    const int64_t segment_blocks = any_width_blocks(
        std::min<int64_t>(prep.max_segments / (kThreads / kWarpSize) + 1, int64_t(sms) * 8), slots, b.max_D);
    const int64_t finish_blocks = any_width_blocks(
        std::min<int64_t>(prep.max_long_runs / (kThreads / kWarpSize) + 1, int64_t(sms) * 4), slots, b.max_D);
    at::Tensor side_scratch = at::empty({std::max(segment_blocks, finish_blocks) * kThreads / kWarpSize * slots * b.max_D}, floats);
    // one warp per run (there are at most N of them)
    const int64_t warp_blocks = any_width_blocks(grid_for(b.N), slots, b.max_D);
    at::Tensor scratch = at::empty({warp_blocks * kThreads / kWarpSize * slots * b.max_D}, floats);
    AnyWidthLaunch l{a, prep.runs, prep.occurrences, params, ctx, weights.data_ptr<W>(), prep.partial,
                     side_scratch.data_ptr<float>(), scratch.data_ptr<float>()};
    l.segment_blocks = int(segment_blocks);
    l.finish_blocks = int(finish_blocks);
    l.warp_blocks = int(warp_blocks);
    l.threads = kThreads;
    l.side = side.stream();
    l.stream = stream.stream();
    l.items = prep.items;
    TBEGEN_CUDA_CHECK(k.launch(l));
    // joined before the scratch tensors go back to the caching allocator (as in backward_cuda)
    order_after(joined, side, stream);
  });
}

// Whether the environment variable `name` is set to "0" (or, env_is_one, to "1").
inline bool env_is_zero(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && std::strcmp(v, "0") == 0;
}
inline bool env_is_one(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && std::strcmp(v, "1") == 0;
}

// An opt-in switch `name`: unset, empty or "0" off, "1" on, anything else refused (a typo must not
// time one path under the other's name). Read at every call.
inline bool opt_in_switch(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0' || std::strcmp(v, "0") == 0) return false;
  TBEGEN_CHECK(std::strcmp(v, "1") == 0, "tbegen: ", name, " must be 0 or 1 (or unset), got '", v, "'");
  return true;
}
// A switch whose unset (or empty) value is `unset`: "0" off, "1" on, anything else refused (as
// opt_in_switch). For the variants made the default once a GPU measured them faster.
inline bool switch_or(const char* name, bool unset) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return unset;
  return opt_in_switch(name);
}

// The widest row the backward's 4-wide kernels take: 512 columns by default, or what the
// environment sets in TBEGEN_BACKWARD_4WIDE_MAX_D (up to kVectorMaxD; read at every call, so that
// a benchmark can time both in one process). A batch with a wider row takes the any-width kernels,
// whose results agree to rounding. The default: on the H200, 1024-wide fp32 rows updated 20%
// faster on the any-width path (sgd 9.51 -> 7.62 ms, rowwise_adagrad 9.83 -> 7.76, adagrad 10.88
// -> 10.16, adam 12.62 -> 12.50; docs/gpu-runs/2026-12-04-probe6), whose 4-wide occurrence sums
// keep fewer registers live than the 4-wide kernel's eight 128-column slices per lane.
constexpr int64_t kBackward4WideDefaultMaxD = 512;
inline int64_t backward_4wide_max_d() {
  const char* v = std::getenv("TBEGEN_BACKWARD_4WIDE_MAX_D");
  if (v == nullptr || *v == '\0') return kBackward4WideDefaultMaxD;
  char* end = nullptr;
  const long long d = std::strtoll(v, &end, 10);
  TBEGEN_CHECK(end != v && *end == '\0' && d >= 0, "tbegen: TBEGEN_BACKWARD_4WIDE_MAX_D must be a column count, got '", v, "'");
  return std::min<int64_t>(d, kVectorMaxD);
}

// Whether the backward may take the lane-group kernel (backward_group_kernel) for tables of at
// most 64 columns: yes unless the environment sets TBEGEN_LANE_GROUPS=0, which launches the
// whole-warp kernel instead (the same bits, tests/test_cuda.py; benchmarks time the two in one
// process). Read at every call, so that a test or benchmark can switch it between calls.
inline bool lane_groups_enabled() { return !env_is_zero("TBEGEN_LANE_GROUPS"); }

// Whether a batch whose rows fall in several width classes has its short runs updated by one
// launch per class (each at its own kVecs: a 128-column row then takes the registers and lanes of
// a 128-column kernel, not those of the widest row's), unless TBEGEN_WIDTH_CLASSES=0, which keeps
// one launch at the widest row's kVecs (the same bits either way; read at every call).
inline bool width_classes_enabled() { return !env_is_zero("TBEGEN_WIDTH_CLASSES"); }

// Whether the width classes narrower than the widest are launched on a stream of their own, beside
// the widest's launch (backward_cuda), or after it on the caller's stream (TBEGEN_CLASS_STREAMS=0;
// the same bits: the launches update different tables' rows). Read at every call.
inline bool class_streams_enabled() { return !env_is_zero("TBEGEN_CLASS_STREAMS"); }

// Whether the long runs' kernels (segment, then finish) run on a side stream beside the short
// runs' kernel (the default), or before it on the caller's stream (TBEGEN_LONG_RUNS_BESIDE=0: the
// order FBGEMM's backward takes, hot rows first, then the rest). In series the resident warps read
// one band of the sorted batch, so the output-gradient rows of one table at a time stay in L2
// (at D = 1024, B = 8192 a table's rows are 32 MB of the H100's and H200's 50 MB); side by side,
// two bands in two tables compete for it (the hypothesis of benchmarks/NOTES-gpu.md, "D = 1024
// fp32 backward", cause 2). Opt-in for an A/B: unset, empty or "1" beside, "0" in series; anything
// else is refused. The same bits either way (the kernels update disjoint rows). Read at every call.
inline bool long_runs_beside() { return switch_or("TBEGEN_LONG_RUNS_BESIDE", true); }

// How many resident waves the short runs' kernels get (BackwardLaunch::short_run_waves,
// short_run_grid): 1, or TBEGEN_SHORT_RUN_WAVES=n (n >= 1), or with TBEGEN_SHORT_RUN_WAVES=0 the
// grid sized by the bound on the runs. Read at every call; any value gives the same bits (each row
// is updated by one warp, its occurrences summed in sorted order, whichever warp it is).
inline int short_run_waves() {
  const char* v = std::getenv("TBEGEN_SHORT_RUN_WAVES");
  if (v == nullptr || *v == '\0') return 1;
  const int n = std::atoi(v);
  return n > 0 ? std::min(n, 64) : 0;
}

// Whether a VBE batch's backward gathers each occurrence's output-gradient row offset once after
// the sort (prepare_backward's step 3c; BackwardArgs::pooling) instead of the update kernels reading
// the plan's bag_out table per occurrence, between the occurrence's bag and its row (issue 25: on
// the H200 the kernel-bound VBE step, bench_vbe.py mild-large, was 1.04-1.05x the padded step, the
// backward ~0.15 ms longer). TBEGEN_VBE_GRAD_OFFSETS: unset, empty or "1" on (the default since
// docs/gpu-runs/2026-12-05-landing11: on the H100 the kept-plan VBE step over the padded step went
// 1.043 -> 1.014 (mild sgd), 1.045 -> 1.026 (mild rowwise_adagrad), 1.038 -> 1.020 (mild-large
// rowwise_adagrad), 1.021 -> 1.026 (mild-large sgd)), "0" off; anything else is refused (a typo
// must not time one path under the other's name). Read at every call; the same bits either way
// (the same rows summed in the same order). Outputs of more than INT32_MAX elements read bag_out
// (the offsets are int32).
inline bool vbe_grad_offsets_enabled() { return switch_or("TBEGEN_VBE_GRAD_OFFSETS", true); }

// Whether a batch's rows are wide fp16 rows: half weights wider than 512 columns, on the any-width
// path. By default (issue 29) they take the prefetching any-width kernels (launch_any_width), with
// the single work list (any_width_items) and 64-occurrence segments (segment_length): measured on
// the H200 (docs/gpu-runs/2026-12-05-landing10, fp16 D=2048, T=32 E=8192 B=8192 L=20 Zipf 1.1, the
// three together beside FBGEMM) the backward 17.6-29.0 -> 12.7-20.1 ms for sgd, rowwise_adagrad,
// adagrad and adam (0.65-0.97x FBGEMM's -> 1.17-1.34x); 64-occurrence segments alone, without the
// prefetching kernels, made the same cells 19-48% slower. TBEGEN_ANY_WIDTH_PREFETCH=0 keeps such
// rows on the default kernels, and then the list and the segment length default as for any other.
inline bool wide_half_rows(const at::Tensor& weights, int64_t max_D, bool vector_path) {
  return weights.scalar_type() == at::kHalf && !vector_path && max_D > any_width::kPrefetchAutoMinD &&
         any_width::prefetch_mode_from_env() != any_width::PrefetchMode::kOff;
}

// How many occurrences one warp sums in a long run's segment (Runs::segment_length): by default
// kSegmentLength (256), and kShortSegmentLength (64) for the batches where 64 was measured faster
// (issue 29, docs/gpu-runs/2026-12-05-landing10, H200, beside FBGEMM): wide fp16 rows
// (wide_half_rows), and float rows of 385-512 columns on the 4-wide kernels (D=512, T=32 E=32768
// B=8192 L=20 Zipf 1.1: the backward 9-14% faster for sgd, rowwise_adagrad, adagrad and adam,
// 1.14-1.21x FBGEMM's -> 1.26-1.41x; at D=1024 and D=128 64 was 1-5% slower, so they keep 256; the
// widest row of the batch decides, so a mixed batch whose widest table has 512 columns takes 64
// for all of its tables): `measured_shorter` (short_segments_measured_faster). TBEGEN_SEGMENT_LENGTH=n,
// 16 <= n <= 65536, sets it for every batch
// (anything else is refused: a typo must not time one length under another's name). Read at every
// call. Shorter segments narrow the band of sorted occurrences the resident warps read at once, so
// that the output-gradient rows of the tables being summed stay in L2 (benchmarks/tools/l2_model.py:
// at D = 1024, B = 8192 the band of 2112 warps x 256 occurrences spans ~3 tables' 32 MB of gradient
// rows), at the cost of more partial sums (each a max_D-float row written by the segment kernel and
// read by the finish kernel). Any length is deterministic; lengths differ in the order of a long
// run's float sum (segments are summed, then their sums in segment order), so their bits differ by
// rounding.
constexpr int32_t kShortSegmentLength = 64;
inline bool short_segments_measured_faster(const at::Tensor& weights, int64_t max_D, bool vector_path,
                                           bool wide_half) {
  return wide_half || (weights.scalar_type() == at::kFloat && vector_path && max_D > 384 && max_D <= 512);
}
inline int32_t segment_length(bool measured_shorter) {
  const char* v = std::getenv("TBEGEN_SEGMENT_LENGTH");
  if (v == nullptr || *v == '\0') return measured_shorter ? kShortSegmentLength : kSegmentLength;
  char* end = nullptr;
  const long long n = std::strtoll(v, &end, 10);
  // (digits only: strtoll alone would also take leading spaces and a sign)
  TBEGEN_CHECK(*v >= '0' && *v <= '9' && end != v && *end == '\0' && n >= 16 && n <= 65536,
               "tbegen: TBEGEN_SEGMENT_LENGTH must be an occurrence count from 16 to 65536 (or unset), got '", v, "'");
  return int32_t(n);
}

// Whether the 4-wide long runs' kernels sum rows of at most 32 columns with all four groups of 8
// lanes loading (BackwardArgs::segment_lane_groups: add_chunk_batched_narrow, add_partials_narrow;
// 32 rows in flight per warp instead of 8, for D=20/32 and skewed narrow tables, whose segment
// kernel took 167 us against FBGEMM's 132 on the H200, landing8). TBEGEN_SEGMENT_LANE_GROUPS:
// unset, empty or "0" off (the default), "1" on; anything else is refused. The same bits either
// way (the same sums in the same order). Read at every call.
inline bool segment_lane_groups_enabled() { return opt_in_switch("TBEGEN_SEGMENT_LANE_GROUPS"); }

// Whether the 4-wide long runs' segment kernel for rows of at most 128 columns (kVecs = 1) is its
// occupancy variant (backward_segment_kernel at kSegmentOccupancyMinBlocks: 64 registers, 4 blocks
// of 256 threads per multiprocessor instead of 3; issue 29's "random 3" cell, whose segment kernel
// ncu found latency-bound at 31.7% achieved occupancy). TBEGEN_SEGMENT_OCCUPANCY: unset, empty or
// "0" off (the default), "1" on; anything else is refused. The same bits either way (the same
// code). Read at every call.
inline bool segment_occupancy_enabled() { return opt_in_switch("TBEGEN_SEGMENT_OCCUPANCY"); }

// Whether the any-width update takes its work from one list in key order (prepare_backward's
// WorkItems; any_width::backward_items_kernel on the caller's stream, then the finish kernel)
// instead of the segment kernel on a side stream beside the warp kernel: the two kernels' warps sum
// two bands of the sorted batch, often in different tables, whose output-gradient rows then compete
// for L2 (benchmarks/tools/l2_model.py --unified). TBEGEN_ANY_WIDTH_ITEMS: unset or empty, on for
// wide fp16 rows (wide_half_rows: measured there with the prefetching kernels and 64-occurrence
// segments) and off elsewhere (fp32 D=1024, landing10: -4 to +3%, mixed); "0" off, "1" on; anything
// else is refused. Only the prefetching variant has the items kernel (TBEGEN_ANY_WIDTH_PREFETCH: by
// default float rows and fp16 rows wider than 512 columns); elsewhere the list is made and not
// used. The same bits either way (the same sums in the same order). Read (and a bad value refused)
// at every call, whichever kernels the batch takes.
inline bool any_width_items_enabled(bool wide_half) { return switch_or("TBEGEN_ANY_WIDTH_ITEMS", wide_half); }

// The backward pass with an optimizer fused in (docs/algorithm.md): prepare_backward sorts and
// segments the batch, then the optimizer's update kernels (`kernels`, launched with its `params`:
// see cuda_backward.h) sum each unique row's gradient and update it once: one warp per short
// run, and for long runs (hot rows) one warp per segment followed by one warp per run of several
// segments. Nothing here waits for the GPU when the caller passes an error record.
// (Defined here, not inline: this header is compiled in cuda_forward.cu only.)
__attribute__((visibility("hidden"))) void backward_cuda(
    const at::Tensor& grad_output, const at::Tensor& weights, const at::Tensor& features, int64_t total_D,
    int64_t max_D, int64_t total_hash_size, const at::Tensor& indices, const at::Tensor& offsets,
    const c10::optional<at::Tensor>& per_sample_weights, int64_t pooling, int64_t max_segment_length_per_warp,
    const void* params, const BackwardKernels& kernels, const RowUpdateContext& ctx,
    const c10::optional<at::Tensor>& error_record, bool skip_bad_indices, bool check_finite,
    const c10::optional<at::Tensor>& bag_output_offsets, const c10::optional<at::Tensor>& bag_pad) {
  // (bag_pad: the offsets are the VBE batch's, read through the plan's padding index by the
  // linearize kernel, ForwardArgs::pad, which prepare_backward's forward_args takes from b)
  const Batch b =
      check_batch(weights, features, total_D, max_D, indices, offsets, per_sample_weights, pooling, bag_pad);
  const c10::cuda::CUDAGuard guard(weights.device());
  // a VBE batch: the 1-D output's gradient, read where bag_output_offsets says (vbe.h; its values
  // are the module's, built on the device, and not read back here)
  const int64_t* bag_out = check_grad_output_of(b, grad_output, weights, bag_output_offsets);
  check_error_record(error_record, weights);
  TBEGEN_CHECK(total_hash_size >= 1, "tbegen: total_hash_size must be positive, got ", total_hash_size);
  TBEGEN_CHECK(max_segment_length_per_warp >= 1, "tbegen: max_segment_length_per_warp must be >= 1");
  // the 4-wide kernels, or the any-width ones (above)
  WidthClasses classes;
  bool float_rows_4wide = false;
  bool vector_path = check_layout_and_choose(b, features, weights, {grad_output.data_ptr()}, &classes,
                                             kVectorMaxD, &float_rows_4wide);
  vector_path = vector_path && kernels.vector_states_fit(params) && b.max_D <= backward_4wide_max_d();
  if (b.N == 0) return;
  const auto stream = at::cuda::getCurrentCUDAStream();
  const at::Tensor error = error_record_for(error_record, weights);

  // (with the 4-wide kernels' ticket counters, zeroed: PreparedBackward::tickets; for a VBE batch
  // with TBEGEN_VBE_GRAD_OFFSETS=1, each occurrence's output-gradient offset)
  // (the wide fp16 rows' choices, made once: the work list and the segment length follow it)
  const bool wide_half = wide_half_rows(weights, b.max_D, vector_path);
  const bool grad_offsets = bag_out != nullptr && b.pooling != kPoolNone && vbe_grad_offsets_enabled() &&
                            grad_output.numel() <= int64_t(INT32_MAX);
  const PreparedBackward prep = prepare_backward(b, grad_output, weights, features, total_hash_size, indices, offsets,
                                                 per_sample_weights, max_segment_length_per_warp, error, check_finite,
                                                 vector_path, grad_offsets ? bag_out : nullptr,
                                                 segment_length(short_segments_measured_faster(weights, b.max_D,
                                                                                               vector_path, wide_half)),
                                                 any_width_items_enabled(wide_half) && !vector_path,
                                                 // (the partial sums' rows: kVecs * 128 floats on the
                                                 // 4-wide kernels, dispatch_vecs; max_D on the others)
                                                 vector_path ? int64_t(128) << width_class(b.max_D) : b.max_D);

  BackwardArgs a;
  a.feat = features.data_ptr<int64_t>();
  a.B = b.B;
  a.by_B = FastDivisor::of(b.B);
  a.total_D = b.total_D;
  a.max_D = b.max_D;
  // (a VBE batch with gathered offsets: each occurrence's row at grad_output + position, read as
  // pooling none with stride 1: BackwardArgs::pooling)
  a.pooling = prep.grad_offsets ? kPoolNone : pooling;
  a.position_stride = prep.grad_offsets ? 1 : b.max_D;
  a.grad_output = grad_output.data_ptr<float>();
  a.bag_out = bag_out;
  a.error = error.data_ptr<int64_t>();
  a.skip_bad_indices = skip_bad_indices;
  a.long_run_l2_hint = env_is_one("TBEGEN_LONG_RUN_L2_HINT");
  a.segment_lane_groups = segment_lane_groups_enabled();
  const bool segment_occupancy = segment_occupancy_enabled();  // (read, and checked, whichever kernels run)
  a.float_rows_4wide = float_rows_4wide;

  // The long runs' kernels run on a side stream, concurrently with the short runs' kernel (they
  // touch disjoint rows), forked here and joined back before anything else runs on the caller's
  // stream (so neither kernel's tail waits for the other, and the scratch tensors freed at the end
  // of this function are not reused before both are done).
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const c10::DeviceIndex device = weights.device().index();
  // (TBEGEN_LONG_RUNS_BESIDE=0: the caller's stream, so the long runs' kernels run first, in series)
  const at::cuda::CUDAStream side = long_runs_beside() ? at::cuda::getStreamFromPool(false, device) : stream;
  // the 4-wide kernels' ticket counters (prep.tickets): [0, 4) the short-run launch of each width
  // class (BackwardArgs::ticket), [4] the long runs' segments (segment_ticket); zeroed on `stream`
  // by prepare_backward's linearize kernel, before the fork below, so that the launch on every
  // stream finds its counter at zero
  const cudaEvent_t forked = call_event(kEventFork, device), joined = call_event(kEventJoin, device);
  order_after(forked, stream, side);
  if (!vector_path) {
    backward_any_width(b, a, prep, weights, params, kernels, ctx, stream, side, joined, sms);
    if (!error_record.has_value()) raise_kernel_error(error, !skip_bad_indices);
    return;
  }
  dispatch_weights(weights, [&](auto w) {
    using W = decltype(w);
    W* wptr = weights.data_ptr<W>();
    dispatch_vecs(b.max_D, [&](auto vecs) {
      constexpr int kVecs = decltype(vecs)::value;
      // (the partial sums, kVecs * 128 floats each: prep.partial, carved by prepare_backward)
      BackwardLaunch l{a, prep.runs, prep.occurrences, params, ctx, wptr, prep.partial};
      // (grids sized by bounds: the real counts are on the device, and idle warps exit at once)
      l.segment_blocks = int(std::min<int64_t>(prep.max_segments / (kThreads / kWarpSize) + 1, int64_t(sms) * 8));
      l.finish_blocks = int(std::min<int64_t>(prep.max_long_runs / (kThreads / kWarpSize) + 1, int64_t(sms) * 4));
      l.warp_blocks = grid_for(b.N / kWarpSize + 1);
      l.threads = kThreads;
      l.sms = sms;
      l.short_run_waves = short_run_waves();
      l.segment_occupancy = segment_occupancy;
      l.side = side.stream();
      l.stream = stream.stream();
      // the segment and finish kernels on `side`, the warp (or group) kernel on `stream`; with
      // several width classes, one short-run launch per class, the widest first (it also launches
      // the long runs' kernels, at the widest kVecs), each taking its class's rows only. The
      // narrower classes' launches go to a third stream, beside the widest's: they update other
      // tables' rows, and each launch walks every run, so one waiting for the other only adds
      // its tail and its skipped runs to the step (TBEGEN_CLASS_STREAMS=0: all on `stream`).
      const int top = width_class(b.max_D);
      const bool split = classes.count() > 1 && width_classes_enabled();
      const bool groups = lane_groups_enabled();
      l.element_lane_groups = !env_is_zero("TBEGEN_ELEMENT_LANE_GROUPS");
      const bool class_streams = split && class_streams_enabled();
      const at::cuda::CUDAStream narrow = class_streams ? at::cuda::getStreamFromPool(false, device) : stream;
      if (class_streams) wait_event(forked, narrow);
      for (int c = top; c >= (split ? 0 : top); --c) {
        if (split && classes.narrowest[c] == 0) continue;
        BackwardLaunch lc = l;
        lc.a.split_widths = split;
        lc.a.short_min_D = split && c > 0 ? int32_t(64) << c : 0;
        lc.long_runs = c == top;
        lc.a.ticket = prep.tickets + c;
        lc.a.segment_ticket = prep.tickets + 4;
        lc.lane_groups = groups && (split ? classes.narrowest[c] : classes.narrowest_of_all()) <= 64;
        if (c != top) lc.stream = narrow.stream();
        TBEGEN_CUDA_CHECK(kernels.get<W>(c)(lc));
      }
      order_after(joined, side, stream);
      if (class_streams) {
        const cudaEvent_t narrow_joined = call_event(kEventNarrowJoin, device);
        order_after(narrow_joined, narrow, stream);
      }
    });
  });
  if (!error_record.has_value()) raise_kernel_error(error, !skip_bad_indices);
}

}  // namespace cuda
}  // namespace tbegen
