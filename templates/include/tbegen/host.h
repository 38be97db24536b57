// tbegen runtime: argument checks shared by the CPU and CUDA host wrappers.
//
// Every operator validates its tensors here before any kernel runs, so that bad input is an
// error naming the problem and never a crash or a silent wrong answer. Checks that need the data
// (index ranges, offsets) run on the host for CPU tensors; for CUDA tensors the kernels check them
// and report through a small error tensor (see raise_kernel_error), before anything is written.
#pragma once

// The tensor type and the few ATen functions the operators call, rather than all of ATen/ATen.h:
// the headers are most of what compiling an extension costs (benchmarks/NOTES-ci.md).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>

#include <atomic>
#include <cmath>
#include <string>
#include <type_traits>
#include <vector>

#include "tbegen/common.h"

namespace tbegen {

// ---- error messages ------------------------------------------------------------------------------
//
// TBEGEN_CHECK(cond, parts...) raises a c10::Error (a RuntimeError in Python) whose message is the
// parts joined. Numbers are formatted with std::to_string rather than through an ostream, so the
// message does not depend on the iostream facets of whichever C++ runtime the process loaded
// first (on a machine whose torch was built with another toolchain, formatting an integer through
// c10::str crashed the process instead of raising).
namespace detail {
inline void append(std::string& s, const char* x) { s += x; }
inline void append(std::string& s, const std::string& x) { s += x; }
inline void append(std::string& s, at::ScalarType t) { s += c10::toString(t); }
inline void append(std::string& s, const c10::Device& d) { s += d.str(); }
inline void append(std::string& s, c10::IntArrayRef sizes) {
  s += "[";
  for (size_t i = 0; i < sizes.size(); ++i) s += (i ? ", " : "") + std::to_string(sizes[i]);
  s += "]";
}
template <typename T, std::enable_if_t<std::is_arithmetic_v<T>, int> = 0>
inline void append(std::string& s, T x) {
  s += std::to_string(x);
}
}  // namespace detail

template <typename... Parts>
std::string message(const Parts&... parts) {
  std::string s;
  (detail::append(s, parts), ...);
  return s;
}

[[noreturn]] inline void fail(const std::string& what) { TORCH_CHECK(false, what); }

#define TBEGEN_CHECK(cond, ...)                               \
  do {                                                        \
    if (C10_UNLIKELY(!(cond))) ::tbegen::fail(::tbegen::message(__VA_ARGS__)); \
  } while (0)

// Shapes of one call, derived from the arguments once they have been checked.
struct Batch {
  int64_t F = 0;             // features
  int64_t B = 0;             // batch size
  int64_t N = 0;             // number of indices
  int64_t total_D = 0;       // width of the pooled output
  int64_t max_D = 0;         // widest row (the width of the output for pooling none)
  int64_t pooling = kPoolSum;
  bool weighted = false;
  // a VBE batch read through its plan's padding index (bag_pad: check_batch): padded bag i's
  // bounds are offsets[pad[i]] and offsets[pad[i + 1]], the offsets the VBE batch's own (`offsets`
  // entries, pad values in [0, offsets)); nullptr: the offsets are the padded batch's
  const int64_t* pad = nullptr;
  int64_t offsets_count = 0;
};

inline const char* dtype_name(at::ScalarType t) { return c10::toString(t); }

inline void check_tensor(const at::Tensor& t, const char* name, const at::Tensor& like) {
  TBEGEN_CHECK(t.device() == like.device(), "tbegen: ", name, " is on ", t.device(),
              " but the weights are on ", like.device());
  TBEGEN_CHECK(t.is_contiguous(), "tbegen: ", name, " must be contiguous");
}

// Checks the features table (a host pointer, b.F rows) against the call's shapes.
inline void check_features(const Batch& b, const int64_t* feat, const at::Tensor& weights) {
  const int64_t max_D = b.max_D, total_D = b.total_D, pooling = b.pooling;
  for (int64_t f = 0; f < b.F; ++f) {
    const int64_t* ft = feat + f * kFeatColumns;
    const int64_t rows = ft[kFeatRows], D = ft[kFeatDim];
    TBEGEN_CHECK(D >= 1 && D <= kMaxD, "tbegen: feature ", f, " has D = ", D,
                "; embedding dims must be from 1 to ", kMaxD);
    TBEGEN_CHECK(D <= max_D, "tbegen: feature ", f, " has D = ", D, " > max_D = ", max_D);
    TBEGEN_CHECK(pooling != kPoolNone || D == max_D, "tbegen: pooling none needs every table to "
                "have the same D, but feature ", f, " has D = ", D, " and max_D = ", max_D);
    // (an int8 table's rows also hold their qparams: its last row ends kInt8QparamBytes per row
    // of it and of every earlier table further on, common.h weights_row_start)
    const int64_t qparams = weights.scalar_type() == at::kByte ? kInt8QparamBytes * (ft[kFeatKeyBase] + rows) : 0;
    TBEGEN_CHECK(rows >= 0 && ft[kFeatWeightsOffset] >= 0 && ft[kFeatKeyBase] >= 0 &&
                    ft[kFeatWeightsOffset] + rows * D + qparams <= weights.numel(),
                "tbegen: feature ", f, "'s table (", rows, " x ", D, " at offset ",
                ft[kFeatWeightsOffset], ") does not fit in the weights buffer of ",
                weights.numel(), " elements", qparams ? " (int8 rows: D code bytes + 8 bytes of scale and bias each)" : "");
    TBEGEN_CHECK(pooling == kPoolNone || (ft[kFeatOutOffset] >= 0 &&
                                         ft[kFeatOutOffset] + D <= total_D),
                "tbegen: feature ", f, "'s output columns do not fit in total_D = ", total_D);
  }
}

// The weights dtypes the kernels take: float32, float16, bfloat16, and uint8 for int8 rows.
inline void check_weights_dtype(const at::Tensor& weights) {
  const auto wt = weights.scalar_type();
  TBEGEN_CHECK(wt == at::kFloat || wt == at::kHalf || wt == at::kBFloat16 || wt == at::kByte,
              "tbegen: weights must be float32, float16, bfloat16 or uint8 (int8 rows), got ", dtype_name(wt));
}

// Checks everything that can be checked without reading device memory, and returns the shapes.
// With `bag_pad` (a VBE batch's padding index, vbe.h's `pad`: F * B + 1 int64 entries on the
// weights' device) the offsets are the VBE batch's own, read through it (Batch::pad), and B follows
// from the index instead of the offsets.
inline Batch check_batch(const at::Tensor& weights, const at::Tensor& features, int64_t total_D,
                         int64_t max_D, const at::Tensor& indices, const at::Tensor& offsets,
                         const c10::optional<at::Tensor>& per_sample_weights, int64_t pooling,
                         const c10::optional<at::Tensor>& bag_pad = c10::nullopt) {
  TBEGEN_CHECK(weights.dim() == 1, "tbegen: weights must be a flat 1-D buffer, got ", weights.dim(),
              " dimensions");
  check_weights_dtype(weights);
  TBEGEN_CHECK(weights.is_contiguous(), "tbegen: weights must be contiguous");
  check_tensor(features, "features", weights);
  TBEGEN_CHECK(features.scalar_type() == at::kLong && features.dim() == 2 &&
                  features.size(1) == kFeatColumns,
              "tbegen: features must be an int64 tensor of shape [F, ", int64_t(kFeatColumns),
              "], got ", dtype_name(features.scalar_type()), " ", features.sizes());
  check_tensor(indices, "indices", weights);
  check_tensor(offsets, "offsets", weights);
  const auto it = indices.scalar_type();
  TBEGEN_CHECK(it == at::kInt || it == at::kLong, "tbegen: indices must be int32 or int64, got ",
              dtype_name(it));
  TBEGEN_CHECK(offsets.scalar_type() == it, "tbegen: offsets must have the dtype of indices (",
              dtype_name(it), "), got ", dtype_name(offsets.scalar_type()));
  TBEGEN_CHECK(indices.dim() == 1 && offsets.dim() == 1, "tbegen: indices and offsets must be 1-D");
  TBEGEN_CHECK(pooling == kPoolSum || pooling == kPoolMean || pooling == kPoolNone,
              "tbegen: pooling must be 0 (sum), 1 (mean) or 2 (none), got ", pooling);
  Batch b;
  b.F = features.size(0);
  TBEGEN_CHECK(b.F >= 1, "tbegen: at least one feature is needed");
  if (bag_pad.has_value()) {
    const at::Tensor& pad = *bag_pad;
    check_tensor(pad, "bag_pad", weights);
    TBEGEN_CHECK(pad.scalar_type() == at::kLong && pad.dim() == 1 && pad.numel() >= 1 && (pad.numel() - 1) % b.F == 0,
                "tbegen: bag_pad must be int64 with F * B + 1 entries for F = ", b.F, " features, got ",
                dtype_name(pad.scalar_type()), " of shape ", pad.sizes());
    TBEGEN_CHECK(offsets.numel() >= 1, "tbegen: offsets must have at least one entry");
    TBEGEN_CHECK(pooling != kPoolNone, "tbegen: bag_pad (a variable-batch padding index) needs pooling sum or mean");
    b.B = (pad.numel() - 1) / b.F;
    b.pad = pad.data_ptr<int64_t>();
    b.offsets_count = offsets.numel();
  } else {
    TBEGEN_CHECK(offsets.numel() >= 1 && (offsets.numel() - 1) % b.F == 0,
                "tbegen: offsets must have F * B + 1 entries for F = ", b.F, " features, got ",
                offsets.numel());
    b.B = (offsets.numel() - 1) / b.F;
  }
  b.N = indices.numel();
  TBEGEN_CHECK(b.N < (int64_t(1) << 31), "tbegen: at most 2^31 - 1 indices per batch, got ", b.N);
  TBEGEN_CHECK(b.F * b.B < (int64_t(1) << 31), "tbegen: at most 2^31 - 1 bags (features x batch size) per "
              "batch, got ", b.F, " x ", b.B);
  TBEGEN_CHECK(max_D >= 1 && max_D <= kMaxD, "tbegen: embedding dims must be from 1 to ", kMaxD,
              ", got max_D = ", max_D);
  TBEGEN_CHECK(total_D >= 0, "tbegen: total_D must not be negative, got ", total_D);
  b.total_D = total_D;
  b.max_D = max_D;
  b.pooling = pooling;
  if (per_sample_weights.has_value()) {
    const at::Tensor& psw = *per_sample_weights;
    check_tensor(psw, "per_sample_weights", weights);
    TBEGEN_CHECK(psw.scalar_type() == at::kFloat, "tbegen: per_sample_weights must be float32, got ",
                dtype_name(psw.scalar_type()));
    TBEGEN_CHECK(psw.dim() == 1 && psw.numel() == b.N, "tbegen: per_sample_weights must have one "
                "entry per index (", b.N, "), got shape ", psw.sizes());
    b.weighted = true;
  }
  // The per-feature table is small: on the CPU check it in full here (the CUDA operators check
  // their host copy of it, cuda_ops.cuh's host_features, and the kernels guard every row access).
  if (features.is_cpu()) check_features(b, features.data_ptr<int64_t>(), weights);
  return b;
}

// Whether a layout suits the CUDA 4-wide kernels (cuda_kernels.cuh): every feature's width, table
// offset and output column a multiple of 4, no row wider than `max_width` (kVectorMaxD, except
// for the pooled forward, which walks wider rows in chunks), every table of fewer than 2^31 rows
// (the forward passes 32-bit row numbers between lanes), and (as row strides of the output)
// total_D and max_D multiples of 4. Other layouts take the any-width kernels (cuda_any_width.cuh).
// `feat` is the features table on the host.
inline bool vector_layout(const int64_t* feat, int64_t F, int64_t total_D, int64_t max_D,
                          int64_t max_width = kVectorMaxD) {
  if (total_D % 4 != 0 || max_D % 4 != 0 || max_D > max_width) return false;
  for (int64_t f = 0; f < F; ++f) {
    const int64_t* ft = feat + f * kFeatColumns;
    if (ft[kFeatDim] % 4 != 0 || ft[kFeatDim] > max_width || ft[kFeatWeightsOffset] % 4 != 0 ||
        ft[kFeatOutOffset] % 4 != 0 || ft[kFeatRows] >= (int64_t(1) << 31)) {
      return false;
    }
  }
  return true;
}

inline void check_grad_output(const Batch& b, const at::Tensor& grad_output, const at::Tensor& weights) {
  check_tensor(grad_output, "grad_output", weights);
  TBEGEN_CHECK(grad_output.scalar_type() == at::kFloat, "tbegen: grad_output must be float32, got ",
              dtype_name(grad_output.scalar_type()));
  const int64_t rows = b.pooling == kPoolNone ? b.N : b.B;
  const int64_t cols = b.pooling == kPoolNone ? b.max_D : b.total_D;
  TBEGEN_CHECK(grad_output.dim() == 2 && grad_output.size(0) == rows && grad_output.size(1) == cols,
              "tbegen: grad_output must have shape [", rows, ", ", cols, "], got ", grad_output.sizes());
}

// The padded batch's offsets on the host (CPU tensors): `offsets` itself, or for a batch read
// through a padding index (Batch::pad) offsets[pad[i]] for each of its F * B + 1 entries, written
// into `storage` (a plain buffer: no operator, no tensor), each pad value checked first.
template <typename I>
const I* padded_offsets_host(const Batch& b, const I* offsets, std::vector<I>& storage) {
  if (b.pad == nullptr) return offsets;
  const int64_t n = b.F * b.B + 1;
  storage.resize(size_t(n));
  for (int64_t i = 0; i < n; ++i) {
    const int64_t p = b.pad[i];
    TBEGEN_CHECK(p >= 0 && p < b.offsets_count, "tbegen: bag_pad[", i, "] = ", p, " is not an entry of the ",
                b.offsets_count, " offsets");
    storage[size_t(i)] = offsets[p];
  }
  return storage.data();
}

// Checks index ranges and offsets on the host (CPU tensors only). Malformed offsets always raise;
// an out-of-range index raises unless `skip_bad_indices`, when the first one is written to
// `record` (if given) and the positions of all of them are returned (the caller skips them).
template <typename I>
std::vector<int64_t> check_indices_host(const Batch& b, const int64_t* feat, const I* indices, const I* offsets,
                                        bool skip_bad_indices = false, int64_t* record = nullptr) {
  std::vector<int64_t> bad;
  TBEGEN_CHECK(offsets[0] == 0, "tbegen: offsets[0] must be 0, got ", int64_t(offsets[0]));
  const int64_t nbags = b.F * b.B;
  TBEGEN_CHECK(int64_t(offsets[nbags]) == b.N, "tbegen: offsets[-1] must equal the number of "
              "indices (", b.N, "), got ", int64_t(offsets[nbags]));
  // A first pass in parallel only asks whether anything is wrong (it is a serial pass over every
  // index on the caller's thread otherwise, twice a step: a few percent of a small CPU step); a
  // batch where something is takes the ordered pass below, which names the first problem.
  std::atomic<bool> clean{true};
  at::parallel_for(0, nbags, 2048, [&](int64_t bag0, int64_t bag1) {
    bool ok = true;
    for (int64_t bag = bag0; bag < bag1 && ok; ++bag) {
      const int64_t start = offsets[bag], end = offsets[bag + 1];
      ok = start <= end && end <= b.N;
      const int64_t rows = feat[(bag / b.B) * kFeatColumns + kFeatRows];
      for (int64_t i = start; ok && i < end; ++i) ok = indices[i] >= 0 && int64_t(indices[i]) < rows;
    }
    if (!ok) clean.store(false, std::memory_order_relaxed);
  });
  if (clean.load()) return bad;
  for (int64_t bag = 0; bag < nbags; ++bag) {
    const int64_t start = offsets[bag], end = offsets[bag + 1];
    TBEGEN_CHECK(start <= end, "tbegen: offsets must be non-decreasing, but offsets[", bag, "] = ",
                start, " > offsets[", bag + 1, "] = ", end);
    // (offsets[-1] is the number of indices, so a bag ending past it has a later bag ending before it)
    TBEGEN_CHECK(end <= b.N, "tbegen: offsets must be non-decreasing, but offsets[", bag + 1, "] = ", end,
                " > offsets[-1] = ", b.N);
    const int64_t f = bag / b.B;
    const int64_t rows = feat[f * kFeatColumns + kFeatRows];
    for (int64_t i = start; i < end; ++i) {
      const int64_t idx = indices[i];
      if (C10_LIKELY(idx >= 0 && idx < rows)) continue;
      TBEGEN_CHECK(skip_bad_indices, "tbegen: indices[", i, "] = ", idx,
                  " is out of range for feature ", f, ", whose table has ", rows, " rows");
      if (record != nullptr && record[kErrIndexSlot] == kErrNone) {
        record[kErrIndexSlot] = kErrIndexOutOfRange;
        record[kErrIndexSlot + 1] = i;
        record[kErrIndexSlot + 2] = idx;
      }
      bad.push_back(i);
    }
  }
  return bad;
}

// ---- error records ------------------------------------------------------------------------------

// What one slot of an error record ([code, position, value] at `r`) says, or "" when it is empty.
inline std::string describe_error_slot(const int64_t* r) {
  switch (r[0]) {
    case kErrNone:
      return "";
    case kErrIndexOutOfRange:
      return message("tbegen: indices[", r[1], "] = ", r[2], " is out of range for its table");
    case kErrRowOutsideWeights:
      return message("tbegen: the features table places row ", r[2], " (indices[", r[1],
                     "]) outside the weights buffer, or its offsets are inconsistent");
    case kErrBadOffsets:
      return message("tbegen: malformed offsets (offsets must start at 0, be non-decreasing and end at "
                     "the number of indices); first bad bag ", r[1]);
    case kErrNonFinitePerSampleWeight:
      return message("tbegen: per_sample_weights[", r[1], "] is not finite (NaN or Inf)");
    case kErrNonFiniteGradient:
      return message("tbegen: the gradient of the output is not finite (NaN or Inf) at flat position ", r[1]);
    default:
      return message("tbegen: unknown error code ", r[0], " in the error record");
  }
}

// The message of an error record (a CPU int64 tensor of kErrRecordSize entries): its fatal error
// if it has one, else its bad index (only when `with_index_errors`), else "".
inline std::string describe_error_record(const at::Tensor& record, bool with_index_errors) {
  TBEGEN_CHECK(record.is_cpu() && record.scalar_type() == at::kLong && record.numel() == kErrRecordSize &&
                  record.is_contiguous(),
              "tbegen: an error record is a contiguous int64 CPU tensor of ", int64_t(kErrRecordSize), " entries");
  const int64_t* r = record.data_ptr<int64_t>();
  std::string fatal = describe_error_slot(r + kErrFatalSlot);
  if (!fatal.empty()) return fatal;
  return with_index_errors ? describe_error_slot(r + kErrIndexSlot) : std::string();
}

// Turns the error record CUDA kernels left into an exception, waiting for them (the operators
// do this only when the caller passed no record of its own to read later).
inline void raise_kernel_error(const at::Tensor& error_record, bool with_index_errors) {
  const std::string what = describe_error_record(error_record.to(at::kCPU), with_index_errors);
  TBEGEN_CHECK(what.empty(), what, " (nothing was updated)");
}

// Checks an error record passed in by the caller (the module keeps one per device).
inline void check_error_record(const c10::optional<at::Tensor>& record, const at::Tensor& weights) {
  if (!record.has_value()) return;
  TBEGEN_CHECK(record->scalar_type() == at::kLong && record->numel() == kErrRecordSize &&
                  record->is_contiguous() && record->device() == weights.device(),
              "tbegen: error_record must be a contiguous int64 tensor of ", int64_t(kErrRecordSize),
              " entries on the weights' device");
}

// Non-finite values raise before anything is written (CPU tensors: checked on the host).
inline void check_finite_host(const float* x, int64_t n, int code) {
  // the first non-finite value, found in parallel (each task finds its first; the smallest wins)
  std::atomic<int64_t> first{n};
  at::parallel_for(0, n, 1 << 15, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      if (C10_UNLIKELY(!std::isfinite(x[i]))) {
        int64_t seen = first.load(std::memory_order_relaxed);
        while (i < seen && !first.compare_exchange_weak(seen, i, std::memory_order_relaxed)) {
        }
        return;
      }
    }
  });
  if (first.load() < n) {
    const int64_t r[3] = {code, first.load(), 0};
    fail(describe_error_slot(r) + " (nothing was updated)");
  }
}

// The number of weight elements (the columns of all rows) in a weights buffer: its numel, less the
// qparams of int8 rows (kInt8QparamBytes for each of the total_hash_size rows). Per-element states
// have this many elements.
// (The weights' dtype is checked first: the per-element states' sizes, checked against this
// count, would otherwise be what a wrong dtype is reported as.)
inline int64_t weight_elements(const at::Tensor& weights, int64_t total_hash_size) {
  check_weights_dtype(weights);
  return weights.scalar_type() == at::kByte ? weights.numel() - kInt8QparamBytes * total_hash_size : weights.numel();
}

// Checks a state tensor and returns its storage, setting *dtype (float32, float16 or bfloat16
// storage; common.h, StateDtype). A narrow state's pointer is only read through load_state /
// store_state, which reinterpret it.
inline float* state_data(const at::Tensor& state, const char* optimizer, const char* name,
                         const at::Tensor& weights, int64_t expected_numel, const char* layout, int32_t* dtype) {
  const auto type = state.scalar_type();
  TBEGEN_CHECK(type == at::kFloat || type == at::kHalf || type == at::kBFloat16, "tbegen: ", optimizer,
               ": state '", name, "' must be float32, float16 or bfloat16, got ", dtype_name(type));
  TBEGEN_CHECK(state.device() == weights.device(), "tbegen: ", optimizer, ": state '", name,
              "' is on ", state.device(), " but the weights are on ", weights.device());
  TBEGEN_CHECK(state.is_contiguous(), "tbegen: ", optimizer, ": state '", name, "' must be contiguous");
  TBEGEN_CHECK(state.numel() == expected_numel, "tbegen: ", optimizer, ": state '", name, "' must have ",
              expected_numel, " elements (", layout, "), got ", state.numel());
  *dtype = type == at::kFloat ? kStateFloat32 : type == at::kHalf ? kStateFloat16 : kStateBFloat16;
  return static_cast<float*>(state.data_ptr());
}

// Checks an int (int64, per-row) state tensor and returns its data.
inline int64_t* int_state_data(const at::Tensor& state, const char* optimizer, const char* name,
                               const at::Tensor& weights, int64_t expected_numel, const char* layout) {
  TBEGEN_CHECK(state.scalar_type() == at::kLong, "tbegen: ", optimizer, ": int state '", name,
               "' must be int64, got ", dtype_name(state.scalar_type()));
  TBEGEN_CHECK(state.device() == weights.device(), "tbegen: ", optimizer, ": state '", name,
              "' is on ", state.device(), " but the weights are on ", weights.device());
  TBEGEN_CHECK(state.is_contiguous(), "tbegen: ", optimizer, ": state '", name, "' must be contiguous");
  TBEGEN_CHECK(state.numel() == expected_numel, "tbegen: ", optimizer, ": state '", name, "' must have ",
              expected_numel, " elements (", layout, "), got ", state.numel());
  return state.data_ptr<int64_t>();
}

// A per-table state (a spec's `per: table`): float32, 1-D, contiguous, on the weights' device, one
// entry per table of the module. The first one checked sets *num_tables (-1: not yet), the others
// must agree with it.
inline float* table_state_data(const at::Tensor& state, const char* optimizer, const char* name,
                               const at::Tensor& weights, int64_t* num_tables) {
  TBEGEN_CHECK(state.scalar_type() == at::kFloat, "tbegen: ", optimizer, ": per-table state '", name,
               "' must be float32, got ", dtype_name(state.scalar_type()));
  TBEGEN_CHECK(state.device() == weights.device(), "tbegen: ", optimizer, ": state '", name,
              "' is on ", state.device(), " but the weights are on ", weights.device());
  TBEGEN_CHECK(state.dim() == 1 && state.is_contiguous() && state.numel() >= 1, "tbegen: ", optimizer,
              ": per-table state '", name, "' must be a contiguous 1-D tensor with one entry per table, got shape ",
              state.sizes());
  TBEGEN_CHECK(*num_tables < 0 || state.numel() == *num_tables, "tbegen: ", optimizer, ": per-table state '", name,
              "' has ", state.numel(), " entries, the one before it ", *num_tables, " (one per table)");
  *num_tables = state.numel();
  return state.data_ptr<float>();
}

// feature_table (specs with per-table states): int64 [F], the table each feature reads, on the
// weights' device. Its values index the per-table states: checked here for tensors on the CPU;
// on CUDA they are not read back (the module builds them from its layout).
inline const int64_t* feature_table_data(const at::Tensor& feature_table, const at::Tensor& features,
                                         const char* optimizer, const at::Tensor& weights, int64_t num_tables) {
  TBEGEN_CHECK(feature_table.scalar_type() == at::kLong && feature_table.dim() == 1 && feature_table.is_contiguous(),
              "tbegen: ", optimizer, ": feature_table must be a contiguous int64 1-D tensor, got ",
              dtype_name(feature_table.scalar_type()), " ", feature_table.sizes());
  TBEGEN_CHECK(feature_table.device() == weights.device(), "tbegen: ", optimizer, ": feature_table is on ",
              feature_table.device(), " but the weights are on ", weights.device());
  TBEGEN_CHECK(features.dim() == 2 && feature_table.numel() == features.size(0), "tbegen: ", optimizer,
              ": feature_table must have one entry per feature (", features.dim() == 2 ? features.size(0) : -1,
              "), got ", feature_table.numel());
  const int64_t* t = feature_table.data_ptr<int64_t>();
  if (feature_table.is_cpu()) {
    for (int64_t f = 0; f < feature_table.numel(); ++f) {
      TBEGEN_CHECK(t[f] >= 0 && t[f] < num_tables, "tbegen: ", optimizer, ": feature_table[", f, "] = ", t[f],
                  " is not a table (the per-table states have ", num_tables, " entries)");
    }
  }
  return t;
}

}  // namespace tbegen
