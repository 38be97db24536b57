// tbegen runtime: CPU kernels (forward pooled lookup, per-sample-weight gradient, and the backward
// pass with a fused optimizer). The optimizer is a template parameter generated from its spec;
// see the header of any generated optimizer.h for the interface it provides.
//
// The backward follows the CUDA algorithm (docs/algorithm.md): linearise (table, row) pairs into
// keys, sort them stably, and for every unique key sum the gradient of its occurrences in index
// order, then update the row once. Rows are independent, so they are processed in parallel and
// the result does not depend on the number of threads.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "tbegen/common.h"
#include "tbegen/cpu_simd.h"
#include "tbegen/host.h"

namespace tbegen {
namespace cpu {

// A row seen by the optimizer on the CPU: the whole row, with each per-element value in a
// contiguous float array and each per-row state referenced in place.
template <int kElementSlots, int kRowSlots, int kIntRowSlots = 0, int kTableSlots = 0>
struct CpuRow : TableSlots<kTableSlots> {  // (the per-table states of the row's table, if any)
  int D;
  // How the CUDA kernels would split this call's rows over a warp (host.h, vector_layout): in
  // 4-wide slices (true) or column by column (the any-width kernels). Only the lane-split mode
  // below reads it.
  bool vector_split;
  float* g_;
  float* w_;
  float* element_[kElementSlots > 0 ? kElementSlots : 1];
  float* row_[kRowSlots > 0 ? kRowSlots : 1];
  int64_t* int_row_[kIntRowSlots > 0 ? kIntRowSlots : 1];  // int per-row states, in place

  int extent() const { return D; }
  bool valid(int) const { return true; }
  int dim() const { return D; }
  float g(int i) const { return g_[i]; }
  float& w(int i) { return w_[i]; }
  float& element(int k, int i) { return element_[k][i]; }
  float& row_state(int k) { return *row_[k]; }
  int64_t& int_row_state(int k) { return *int_row_[k]; }
  // The loop already covered the whole row, so a reduction across "lanes" is the identity.
  static float all_sum(float x) { return x; }
  static float all_max(float x) { return x; }
  static float all_min(float x) { return x; }
};

// Asks the memory system for a row ahead of its use: rows are scattered over tables far larger
// than the caches, so each one is a trip to DRAM that is best overlapped with the work before it.
// Every cache line of [p, p + bytes) is asked for (a row that starts inside a line spans one more).
inline void prefetch_bytes(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  const char* line = c - (reinterpret_cast<uintptr_t>(c) & 63);
  for (; line < c + bytes; line += 64) __builtin_prefetch(line);
}

// Where row `idx` of feature table `ft` starts in the weights buffer (an int8 row starts 8 bytes
// further on for every row before it, and its qparams follow its D codes: common.h).
template <typename W>
TBEGEN_INLINE const W* weights_row(const W* weights, const int64_t* ft, int64_t idx) {
  return weights + weights_row_start<W>(ft[kFeatWeightsOffset] + idx * ft[kFeatDim], ft[kFeatKeyBase] + idx);
}
// The qparams of an int8 row (for float weights nothing: load_weight ignores them).
template <typename W>
TBEGEN_INLINE Int8QParams row_qparams(const W* row, int64_t D) {
  if constexpr (std::is_same_v<W, uint8_t>) {
    return load_qparams(row, D);
  } else {
    return Int8QParams{0.0f, 0.0f};
  }
}

// Pooled bags go to out + bag * total_D + the feature's column, or, with `bag_out` (a VBE batch,
// vbe.h), to out + bag_out[bag] (padding bags, -1, are skipped: they have no lookups).
template <typename W, typename I>
void forward(const Batch& b, const int64_t* feat, const W* weights, const I* indices,
             const I* offsets, const float* psw, float* out, const int64_t* bag_out = nullptr) {
  if (b.pooling == kPoolNone) {
    at::parallel_for(0, b.F * b.B, 64, [&](int64_t begin, int64_t end) {
      for (int64_t bag = begin; bag < end; ++bag) {
        const int64_t* ft = feat + (bag / b.B) * kFeatColumns;
        const int64_t D = ft[kFeatDim];
        for (int64_t i = offsets[bag]; i < offsets[bag + 1]; ++i) {
          const W* row = weights_row(weights, ft, int64_t(indices[i]));
          const Int8QParams q = row_qparams(row, D);
          const float s = psw ? psw[i] : 1.0f;
          float* o = out + i * b.max_D;
          for (int64_t d = 0; d < D; ++d) o[d] = s * load_weight(row[d], q);
        }
      }
    });
    return;
  }
  // Each task pools bags [begin, end) of every feature, one feature at a time: those bags' indices
  // are contiguous, so rows are prefetched kAhead indices ahead across bag boundaries.
  at::parallel_for(0, b.B, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(b.max_D);
    constexpr int64_t kAhead = 16;  // rows prefetched ahead
    for (int64_t f = 0; f < b.F; ++f) {
      const int64_t* ft = feat + f * kFeatColumns;
      const int64_t D = ft[kFeatDim];
      const W* table = weights + ft[kFeatWeightsOffset];
      const I* bag_offsets = offsets + f * b.B;
      const int64_t limit = bag_offsets[end];
      auto prefetch_row = [&](int64_t i) TBEGEN_INLINE_LAMBDA {
        if (i < limit) prefetch_bytes(weights_row(weights, ft, int64_t(indices[i])), D * int64_t(sizeof(W)) + row_extra_bytes<W>());
      };
      for (int64_t i = bag_offsets[begin]; i < bag_offsets[begin] + kAhead; ++i) prefetch_row(i);
      for (int64_t bi = begin; bi < end; ++bi) {
        const int64_t start = bag_offsets[bi], stop = bag_offsets[bi + 1];
        const float scale = (b.pooling == kPoolMean && stop > start) ? 1.0f / float(stop - start) : 1.0f;
        float* o;
        if (bag_out == nullptr) {
          o = out + bi * b.total_D + ft[kFeatOutOffset];
        } else {
          const int64_t at = bag_out[f * b.B + bi];
          if (at < 0) continue;  // a padding bag (empty)
          o = out + at;
        }
        if constexpr (simd::kVectorElement<W>) {  // float, fp16, bf16 (int8 rows: the plain loop)
          if (simd::vector_width(D)) {
            auto row = [&](int64_t k) TBEGEN_INLINE_LAMBDA { return table + int64_t(indices[start + k]) * D; };
            auto weight = [&](int64_t k) TBEGEN_INLINE_LAMBDA { return psw[start + k]; };
            auto before = [&](int64_t k) TBEGEN_INLINE_LAMBDA { prefetch_row(start + k + kAhead); };
            if (psw) {
              simd::sum_rows<true>(stop - start, D, row, weight, before, scale, o);
            } else {
              simd::sum_rows<false>(stop - start, D, row, weight, before, scale, o);
            }
            continue;
          }
        }
        std::fill(acc.begin(), acc.begin() + D, 0.0f);
        for (int64_t i = start; i < stop; ++i) {
          prefetch_row(i + kAhead);
          const W* row = weights_row(weights, ft, int64_t(indices[i]));
          const Int8QParams q = row_qparams(row, D);
          const float s = psw ? psw[i] : 1.0f;
          for (int64_t d = 0; d < D; ++d) acc[d] += s * load_weight(row[d], q);
        }
        for (int64_t d = 0; d < D; ++d) o[d] = acc[d] * scale;
      }
    }
  });
}

// d loss / d per_sample_weights[i] = <grad of i's output, weight row of i> (/ L for mean).
// (with `bag_out`, bag b's output-gradient row is at grad_output + bag_out[b]: see forward)
template <typename W, typename I>
void grad_per_sample_weights(const Batch& b, const int64_t* feat, const float* grad_output,
                             const W* weights, const I* indices, const I* offsets, float* grad,
                             const int64_t* bag_out = nullptr) {
  at::parallel_for(0, b.F * b.B, 64, [&](int64_t begin, int64_t end) {
    for (int64_t bag = begin; bag < end; ++bag) {
      const int64_t f = bag / b.B, bi = bag % b.B;
      const int64_t* ft = feat + f * kFeatColumns;
      const int64_t D = ft[kFeatDim];
      const int64_t start = offsets[bag], stop = offsets[bag + 1];
      const float scale = b.pooling == kPoolMean ? 1.0f / float(std::max<int64_t>(stop - start, 1)) : 1.0f;
      // (a padding bag of a VBE batch is empty: its -1 is never used)
      const float* bag_go = bag_out != nullptr ? grad_output + bag_out[bag] : grad_output + bi * b.total_D + ft[kFeatOutOffset];
      for (int64_t i = start; i < stop; ++i) {
        const W* row = weights_row(weights, ft, int64_t(indices[i]));
        const Int8QParams q = row_qparams(row, D);
        const float* go = b.pooling == kPoolNone ? grad_output + i * b.max_D : bag_go;
        float dot = 0.0f;
        for (int64_t d = 0; d < D; ++d) dot += go[d] * load_weight(row[d], q);
        grad[i] = dot * scale;
      }
    }
  });
}

// An array that outlives a call, one per calling thread, grown to the largest size asked for and
// kept (never shrunk, never zeroed): the CPU backward's per-index arrays (20 bytes an index),
// allocated afresh each step, cost the calling thread page faults and page clearing while the
// other threads waited, about a tenth of a small step (benchmarks/NOTES-cpu.md, "CPU backward").
template <typename T, int kSlot>
T* scratch_array(int64_t n) {
  static thread_local std::unique_ptr<T[]> data;
  static thread_local int64_t size = 0;
  if (n > size) {
    data.reset();  // (the old one first: never both at once)
    data.reset(new T[n]);
    size = n;
  }
  return data.get();
}

// Stable LSD radix sort of the n 64-bit items at `items` on bits [shift, shift + bits), in as
// few passes of at most 11 bits as cover them, with `tmp` (n items) as the other buffer; returns
// the one of the two that holds the sorted items. Stability keeps the items of a key in their
// original order, so the result is the one sorted order whatever the thread count. Each pass is
// parallel: the items are cut into contiguous chunks (one per thread, at least kMinChunk items
// each), each chunk counts its digits, and each scatters its items in order to where the
// digit-major, chunk-minor scan of the counts puts them (chunk c's items of a digit after chunk
// c - 1's).
inline uint64_t* radix_sort_bits(uint64_t* items, uint64_t* tmp, int64_t n, int shift, int bits) {
  constexpr int64_t kMinChunk = 1 << 13;  // (1 << 16 had a batch of 82k indices sorted on one thread)
  const int passes = (bits + 10) / 11;
  const int digit_bits = (bits + passes - 1) / passes;
  const uint64_t mask = (uint64_t(1) << digit_bits) - 1;
  const int64_t buckets = int64_t(1) << digit_bits;
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n / kMinChunk));
  auto chunk_begin = [&](int64_t c) { return n * c / chunks; };
  std::vector<int64_t> count(chunks * buckets);  // [chunk][digit]
  for (int p = 0; p < passes; ++p, shift += digit_bits) {
    const uint64_t* in = items;
    uint64_t* out = tmp;
    at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
      for (int64_t c = c0; c < c1; ++c) {
        int64_t* mine = count.data() + c * buckets;
        std::fill(mine, mine + buckets, 0);
        for (int64_t i = chunk_begin(c); i < chunk_begin(c + 1); ++i) ++mine[(in[i] >> shift) & mask];
      }
    });
    int64_t sum = 0;
    for (int64_t d = 0; d < buckets; ++d) {
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t here = count[c * buckets + d];
        count[c * buckets + d] = sum;
        sum += here;
      }
    }
    at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
      for (int64_t c = c0; c < c1; ++c) {
        int64_t* next = count.data() + c * buckets;
        for (int64_t i = chunk_begin(c); i < chunk_begin(c + 1); ++i) out[next[(in[i] >> shift) & mask]++] = in[i];
      }
    });
    std::swap(items, tmp);
  }
  return items;
}

// Stable LSD radix sort of the n items at `items` (one thread) whose keys, (item >> shift) - base,
// lie in [0, 2^bits), in `passes` passes of equal digits (at least enough passes to cover `bits` at
// 11 bits a pass; 0-bit digits just copy), with `tmp` (n items) as the other buffer; the sorted
// items end in `items` if `passes` is even, else in `tmp`. The digit counts of every pass are
// taken in one read of the items. Used on one feature's items, which fit a core's L2 cache where
// the whole batch does not.
inline void radix_sort_range(uint64_t* items, uint64_t* tmp, int64_t n, int shift, uint64_t base, int bits,
                             int passes) {
  const int digit_bits = (bits + passes - 1) / passes;
  const uint64_t mask = (uint64_t(1) << digit_bits) - 1;
  const int64_t buckets = int64_t(1) << digit_bits;
  std::vector<int64_t> count(int64_t(passes) * buckets, 0);  // [pass][digit]
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t key = (items[i] >> shift) - base;
    for (int p = 0; p < passes; ++p) ++count[p * buckets + ((key >> (p * digit_bits)) & mask)];
  }
  for (int p = 0; p < passes; ++p) {
    int64_t* next = count.data() + p * buckets;
    int64_t sum = 0;
    for (int64_t d = 0; d < buckets; ++d) {
      const int64_t here = next[d];
      next[d] = sum;
      sum += here;
    }
    const int digit_shift = p * digit_bits;
    for (int64_t i = 0; i < n; ++i) {
      const uint64_t item = items[i];
      tmp[next[(((item >> shift) - base) >> digit_shift) & mask]++] = item;
    }
    std::swap(items, tmp);
  }
}

// The backward pass with the optimizer `Opt` fused in: updates weights and states in place.
// grad_output is [B, total_D] (pooling sum/mean) or [N, max_D] (pooling none), float32; with
// `bag_out` (a VBE batch, vbe.h) the 1-D VBE output's gradient, bag b's row at bag_out[b].
template <class Opt, typename W, typename I>
void backward(const Batch& b, const int64_t* feat, int64_t total_hash_size, const float* grad_output,
              W* weights, const I* indices, const I* offsets, const float* psw,
              const typename Opt::Params& params, const RowUpdateContext& ctx,
              const int64_t* bag_out = nullptr) {
  const int64_t nbags = b.F * b.B;
  // 1. Linearise: each index i becomes the item (key << pos_bits) | i, where key = the table's
  // first key + row; remember each index's bag. Unweighted pooled bags need the bag of an
  // occurrence, not its position: their items carry the bag instead, (key << pos_bits) | bag (the
  // bags grow with the positions, so the stable sort orders them the same way), and the bag of
  // each sorted occurrence is read from the item itself, with no per-index array of bags (it cost
  // a write per index and a random read per index to gather).
  const bool carry_bag = psw == nullptr && b.pooling != kPoolNone;
  const int pos_bits = bits_for(carry_bag ? std::max(b.N, nbags) : b.N);
  const int key_bits = bits_for(total_hash_size + 1);  // (+1: skipped bad indices, see below)
  TBEGEN_CHECK(pos_bits + key_bits <= 64, "tbegen: the CPU backward sorts 64-bit (key, position) items, "
              "but ", total_hash_size, " rows in all and ", b.N, " indices need ", key_bits + pos_bits, " bits");
  uint64_t* items = scratch_array<uint64_t, 0>(b.N);
  int32_t* const bag_of = carry_bag ? nullptr : scratch_array<int32_t, 1>(b.N);
  // (in parallel over bags: each writes its own slice, the offsets having been checked)
  std::atomic<int64_t> bad_items{0};
  at::parallel_for(0, nbags, 256, [&](int64_t begin, int64_t end) {
    int64_t bad_here = 0;
    for (int64_t bag = begin; bag < end; ++bag) {
      const int64_t* ft = feat + (bag / b.B) * kFeatColumns;
      const int64_t key_base = ft[kFeatKeyBase];
      for (int64_t i = offsets[bag]; i < offsets[bag + 1]; ++i) {
        // a bad index (present only when the caller asked to skip them) gets the key past the
        // last row: its run sorts last and is left out below
        const int64_t idx = indices[i];
        const bool good = idx >= 0 && idx < ft[kFeatRows];
        bad_here += !good;
        const int64_t key = good ? key_base + idx : total_hash_size;
        if (carry_bag) {
          items[i] = (uint64_t(key) << pos_bits) | uint64_t(bag);
        } else {
          items[i] = (uint64_t(key) << pos_bits) | uint64_t(i);
          bag_of[i] = int32_t(bag);
        }
      }
    }
    if (bad_here) bad_items += bad_here;
  });
  // 2. Sort by key, keeping index order within a key: the occurrences of a row form a run.
  uint64_t* const sort_tmp = scratch_array<uint64_t, 2>(b.N);
  // Feature by feature where that gives the same order: when every feature's keys lie above the
  // previous feature's (each feature its own table, tables in feature order: the common case) and
  // no index is bad (their key, total_hash_size, sorts after every feature's), the whole sort is
  // the features' items (contiguous, in feature order) each sorted on its own. A feature's items
  // then fit a core's L2 cache and need only its table's key bits (100,000 rows: 17 bits, two
  // passes of 9 bits, against the whole batch's 2.6 MB of items scattered over 1,024 buckets in
  // each of two passes: a third of a narrow-row step's backward; benchmarks/NOTES-cpu.md).
  bool by_feature = bad_items.load() == 0 && b.F >= at::get_num_threads() && b.F > 1;
  int seg_passes = 1;
  for (int64_t f = 0; f < b.F && by_feature; ++f) {
    const int64_t* ft = feat + f * kFeatColumns;
    if (f > 0) by_feature = ft[kFeatKeyBase] >= feat[(f - 1) * kFeatColumns + kFeatKeyBase] + feat[(f - 1) * kFeatColumns + kFeatRows];
    seg_passes = std::max(seg_passes, (bits_for(ft[kFeatRows]) + 10) / 11);
  }
  if (by_feature) {
    at::parallel_for(0, b.F, 1, [&](int64_t f0, int64_t f1) {
      for (int64_t f = f0; f < f1; ++f) {
        const int64_t* ft = feat + f * kFeatColumns;
        const int64_t start = offsets[f * b.B], stop = offsets[(f + 1) * b.B];
        radix_sort_range(items + start, sort_tmp + start, stop - start, pos_bits, uint64_t(ft[kFeatKeyBase]),
                         bits_for(ft[kFeatRows]), seg_passes);
      }
    });
    if (seg_passes % 2) items = sort_tmp;
  } else {
    items = radix_sort_bits(items, sort_tmp, b.N, pos_bits, key_bits);
  }
  const uint64_t pos_mask = (uint64_t(1) << pos_bits) - 1;
  auto key_at = [&](int64_t j) { return int64_t(items[j] >> pos_bits); };
  auto pos_at = [&](int64_t j) { return int64_t(items[j] & pos_mask); };
  // the sorted positions of real rows: [0, n_rows)
  int64_t n_rows = b.N;
  while (n_rows > 0 && key_at(n_rows - 1) == total_hash_size) --n_rows;
  // The bag of each sorted position (items that carry it: the item's low bits), else gathered in
  // one parallel pass: the update loop below then reads it in order (it found each occurrence's
  // bag through bag_of[position], a random read that missed the caches and stalled the loop
  // behind it, once per occurrence and once per row).
  int32_t* const sorted_bag = carry_bag ? nullptr : scratch_array<int32_t, 3>(n_rows);
  if (!carry_bag) {
    at::parallel_for(0, n_rows, 4096, [&](int64_t begin, int64_t end) {
      for (int64_t j = begin; j < end; ++j) sorted_bag[j] = bag_of[pos_at(j)];
    });
  }
  auto bag_at = [&](int64_t j) TBEGEN_INLINE_LAMBDA {
    return carry_bag ? int32_t(items[j] & pos_mask) : sorted_bag[j];
  };

  // 3. Sum each unique row's gradient and apply the optimizer to it.
  constexpr int kElementSlots = Opt::kElementStates + Opt::kTemporaries;
  using Row = CpuRow<kElementSlots, Opt::kRowStates, Opt::kIntRowStates, Opt::kTableStates>;
  // Where the row at sorted position j lives: its key (per-row states) and its offset in the
  // weights buffer (element states share the offsets).
  const FastDivisor by_B = FastDivisor::of(b.B);  // bag -> feature without a division
  auto row_at = [&](int64_t j, int64_t* key, int* D) TBEGEN_INLINE_LAMBDA {
    *key = key_at(j);
    const int64_t* ft = feat + by_B.quotient(bag_at(j)) * kFeatColumns;
    *D = int(ft[kFeatDim]);
    return ft[kFeatWeightsOffset] + (*key - ft[kFeatKeyBase]) * *D;
  };
  // The output-gradient row of the occurrence at sorted position j, and the factor its forward
  // applied to the weight row. Features that share a table share its keys, but each has its own
  // output columns.
  auto grad_row_at = [&](int64_t j) TBEGEN_INLINE_LAMBDA {
    if (b.pooling == kPoolNone) return grad_output + pos_at(j) * b.max_D;
    const int32_t bag = bag_at(j);
    if (bag_out != nullptr) return grad_output + bag_out[bag];  // (a VBE batch: a bag with lookups is no padding)
    const int32_t f = by_B.quotient(bag);
    return grad_output + int64_t(bag - f * int32_t(b.B)) * b.total_D + feat[f * kFeatColumns + kFeatOutOffset];
  };
  auto scale_at = [&](int64_t j) TBEGEN_INLINE_LAMBDA {
    const int64_t bag = bag_at(j);
    float scale = psw ? psw[pos_at(j)] : 1.0f;
    if (b.pooling == kPoolMean) scale /= float(offsets[bag + 1] - offsets[bag]);
    return scale;
  };
  // (the output-gradient rows kAheadGrad sorted positions on are asked for from memory while
  // this one is summed: they are scattered over grad_output, one cache miss each otherwise)
  constexpr int64_t kAheadGrad = 12;
  auto prefetch_grad = [&](int64_t j) TBEGEN_INLINE_LAMBDA {
    if (j < n_rows) {
      const int64_t D_j = b.pooling == kPoolNone ? b.max_D : feat[by_B.quotient(bag_at(j)) * kFeatColumns + kFeatDim];
      prefetch_bytes(grad_row_at(j), D_j * int64_t(sizeof(float)));
    }
  };
  const bool vector_split = vector_layout(feat, b.F, b.total_D, b.max_D);
  // float weights are updated in place; the others (fp16, bf16, int8 rows) through a float copy of the row.
  constexpr bool kInPlace = std::is_same_v<W, float>;
  // the values of the update that depend on the step only (Optimizer::StepValues), once per call
  const typename Opt::StepValues step_values = Opt::step_values(params, ctx.step);
  // Each task updates the rows whose runs start at the sorted positions [begin, end): a run is
  // never split, so every row is summed and updated by one thread, in the same order whatever
  // the number of threads.
  // Runs are taken in blocks of up to kBlockRows: first every run's gradient is summed (into
  // `gblock`, a row each), then the block's rows are updated one after another. The update of a
  // row is a chain of dependent operations (the reduction's fused multiply-adds lane by lane, the
  // lanes' sum, the divisions and square root of a rowwise optimizer) that the core overlaps with
  // the next row's only if that row's instructions follow closely: with the run scan, the prefetch
  // cursor and the gradient sum between two updates they did not, and each unique row paid its
  // whole chain (uniform indices, mostly runs of one: CPU-1 rowwise_adagrad at one thread
  // 37 ns a unique row in the update loop). Each row is still summed and updated alone, with the
  // same operations: the results are unchanged.
  constexpr int64_t kBlockRows = 64;
  const int64_t block_rows = std::max<int64_t>(4, std::min<int64_t>(kBlockRows, 4096 / std::max<int64_t>(b.max_D, 1)));
  at::parallel_for(0, n_rows, 1024, [&](int64_t begin, int64_t end) {
    // (unused: g is in gblock), a float copy of the weights, the temporaries, then float copies of
    // narrow element states
    std::vector<float> buf((2 + Opt::kTemporaries + Opt::kElementStates) * b.max_D);
    std::vector<float> gblock(block_rows * b.max_D);  // the block's summed gradients, a row each
    struct Pending {
      int64_t woff, key, first;
      int D;
    };
    Pending pending[kBlockRows];
    // The rows of the next runs are asked for from memory ahead of their update, about
    // kLinesAhead cache lines ahead (weights, element states and per-row states: 16 rows of 16
    // floats, 6 of 64), counted in runs: a cursor walks the sorted keys ahead of the loop and
    // prefetches each run's row once. (It was 8 sorted positions ahead: on Zipf batches, where
    // most positions are in a few long runs, that was often no row ahead at all, and narrow rows
    // stalled on their first load; D=16 rowwise_adagrad: -24% backward CPU time. 16 to 64 lines
    // measured alike.)
    constexpr int64_t kLinesAhead = 32;
    int64_t pf = -1;        // the next run start the cursor prefetches
    int64_t runs_ahead = 0;  // runs prefetched beyond the current one
    int64_t first = begin;
    while (first < end && first > 0 && key_at(first) == key_at(first - 1)) ++first;  // an earlier task's run
    if (first < end) {
      pf = first;
      while (pf < n_rows && key_at(pf) == key_at(first)) ++pf;
    }
    while (first < end) {
      int np = 0;  // runs summed in this block
      for (; first < end && np < block_rows; ++np) {
        int64_t key;
        int D;
        const int64_t woff = row_at(first, &key, &D);
        int64_t last = first + 1;
        while (last < n_rows && key_at(last) == key) ++last;
        if (runs_ahead > 0) --runs_ahead;  // this run was prefetched
        const int64_t row_lines = (D * int64_t(sizeof(W)) + row_extra_bytes<W>() + 63) / 64 + Opt::kRowStates +
                                  Opt::kElementStates * ((D * 4 + 63) / 64);
        const int64_t rows_ahead = std::max<int64_t>(2, kLinesAhead / row_lines);
        while (pf < n_rows && runs_ahead < rows_ahead) {
          int Dn;
          int64_t key_n;
          const int64_t off = row_at(pf, &key_n, &Dn);
          prefetch_bytes(weights + weights_row_start<W>(off, key_n), Dn * int64_t(sizeof(W)) + row_extra_bytes<W>());
          for (int k = 0; k < Opt::kElementStates; ++k) {
            const int size = state_element_size(params.element_state_dtypes[k]);
            prefetch_bytes(reinterpret_cast<const char*>(params.element_states[k]) + off * size, Dn * size);
          }
          for (int k = 0; k < Opt::kRowStates; ++k) __builtin_prefetch(params.row_states[k] + key_n);
          ++pf;
          while (pf < n_rows && key_at(pf) == key_n) ++pf;
          ++runs_ahead;
        }

        // g = the sum over the run's occurrences, in index order, of scale * output-gradient row.
        float* const g = gblock.data() + np * b.max_D;
        if (simd::vector_width(D)) {
          auto grad_row = [&](int64_t k) TBEGEN_INLINE_LAMBDA { return grad_row_at(first + k); };
          auto scale = [&](int64_t k) TBEGEN_INLINE_LAMBDA { return scale_at(first + k); };
          auto ahead = [&](int64_t k) TBEGEN_INLINE_LAMBDA { prefetch_grad(first + k + kAheadGrad); };
          // (runs of one or two occurrences, most runs of a uniform batch, unweighted: summed
          // inline, the same additions as sum_rows without its call and chunk dispatch; CPU-1
          // rowwise_adagrad backward -10%)
          const bool unit_scale = !(psw || b.pooling == kPoolMean);
          if (unit_scale && last - first == 1) {
            prefetch_grad(first + kAheadGrad);
            simd::sum_of_one(grad_row_at(first), D, g);
          } else if (unit_scale && last - first == 2) {
            prefetch_grad(first + kAheadGrad);
            prefetch_grad(first + 1 + kAheadGrad);
            simd::sum_of_two(grad_row_at(first), grad_row_at(first + 1), D, g);
          } else if (psw || b.pooling == kPoolMean) {
            simd::sum_rows<true>(last - first, D, grad_row, scale, ahead, 1.0f, g);
          } else {
            simd::sum_rows<false>(last - first, D, grad_row, scale, ahead, 1.0f, g);
          }
        } else {
          std::fill(g, g + D, 0.0f);
          for (int64_t j = first; j < last; ++j) {
            prefetch_grad(j + kAheadGrad);
            const float scale = scale_at(j);
            const float* go = grad_row_at(j);
            for (int d = 0; d < D; ++d) g[d] += scale * go[d];
          }
        }
        pending[np] = Pending{woff, key, first, D};
        first = last;
      }
      for (int k = 0; k < np; ++k) {
        const int64_t woff = pending[k].woff, key = pending[k].key;
        const int D = pending[k].D;
        Row row;
        row.D = D;
        row.vector_split = vector_split;
        row.g_ = gblock.data() + k * b.max_D;
        W* wrow = weights + weights_row_start<W>(woff, key);
        if constexpr (kInPlace) {
          row.w_ = wrow;
        } else {
          row.w_ = buf.data() + b.max_D;
          if constexpr (simd::kVectorElement<W>) {
            simd::to_floats(wrow, D, row.w_);  // fp16, bf16: widened in vectors (exact)
          } else {
            const Int8QParams q = row_qparams(wrow, D);
            for (int d = 0; d < D; ++d) row.w_[d] = load_weight(wrow[d], q);
          }
        }
        // float32 states are updated in place; narrow (fp16/bf16) ones through a float copy
        float row_copy[Opt::kRowStates > 0 ? Opt::kRowStates : 1];
        for (int k = 0; k < Opt::kElementStates; ++k) {
          const int32_t dtype = params.element_state_dtypes[k];
          if (dtype == kStateFloat32) {
            row.element_[k] = params.element_states[k] + woff;
          } else {
            row.element_[k] = buf.data() + (2 + Opt::kTemporaries + k) * b.max_D;
            for (int d = 0; d < D; ++d) row.element_[k][d] = load_state(params.element_states[k], dtype, woff + d);
          }
        }
        for (int k = 0; k < Opt::kTemporaries; ++k) row.element_[Opt::kElementStates + k] = buf.data() + (2 + k) * b.max_D;
        for (int k = 0; k < Opt::kIntRowStates; ++k) row.int_row_[k] = params.int_row_states[k] + key;
        for (int k = 0; k < Opt::kRowStates; ++k) {
          const int32_t dtype = params.row_state_dtypes[k];
          if (dtype == kStateFloat32) {
            row.row_[k] = params.row_states[k] + key;
          } else {
            row_copy[k] = load_state(params.row_states[k], dtype, key);
            row.row_[k] = &row_copy[k];
          }
        }

        load_table_states<Opt>(row, params, bag_at(pending[k].first), b.B);
        Opt::update_row(row, params, step_values);

        for (int k = 0; k < Opt::kElementStates; ++k) {
          const int32_t dtype = params.element_state_dtypes[k];
          if (dtype == kStateFloat32) continue;
          for (int d = 0; d < D; ++d) store_state(params.element_states[k], dtype, woff + d, row.element_[k][d], ctx, k, key, d);
        }
        for (int k = 0; k < Opt::kRowStates; ++k) {
          const int32_t dtype = params.row_state_dtypes[k];
          if (dtype != kStateFloat32) store_state(params.row_states[k], dtype, key, row_copy[k], ctx, Opt::kElementStates + k, key, 0);
        }

        if constexpr (std::is_same_v<W, uint8_t>) {
          // int8 rows: quantized again with the updated row's min and max (common.h)
          quantize_row_int8(wrow, row.w_, D);
        } else if constexpr (!kInPlace) {
          if (!ctx.stochastic_rounding) {
            simd::from_floats_nearest(row.w_, D, wrow);  // fp16, bf16: WeightTraits<W>::round's nearest, in vectors
          } else {
            // stochastic: in vectors of 16 (cpu_simd.h), the columns past them here
            auto rest = [&](int64_t d0) {
              for (int d = int(d0); d < D; ++d) {
                const uint32_t bits = random_bits(ctx.seed, ctx.step, key, d);
                wrow[d] = WeightTraits<W>::round(row.w_[d], bits, true);
              }
            };
            simd::from_floats_stochastic(row.w_, D, random_row_bits(ctx.seed, ctx.step, key), wrow, rest);
          }
        }
      }
    }
  });
}

// ---- lane-split mode: the CUDA kernel's division of a row, reproduced on the CPU ---------------
//
// The CUDA kernel (cuda_kernels.cuh, WarpRow) gives each of a warp's 32 lanes its own slices of a
// row (lane l owns columns v * 128 + 4 * l .. + 3; in the any-width kernels, cuda_any_width.cuh,
// columns l, l + 32, ...) and its own register copy of every per-row state; reductions are butterfly shuffles, and lane 0's copies of the per-row states are written
// back. A spec whose result depends on that split (say, an element stage that accumulates into a
// per-row state) trains differently on the GPU than in the CPU loop above. `LaneSplit<Opt>` is an
// optimizer that runs `Opt`'s update the GPU's way, so that the CPU harness can compare the two
// (tbegen/harness.py, `run_lane_split_case`; the `backward_lane_split` operator).
//
// The lanes run one after another. A reduction needs every lane's partial value, so the update
// is replayed: each pass runs all 32 lanes from the row's original values; a lane's reductions
// whose results are known return them, the first unknown one records the lane's partial value,
// and later ones return a placeholder (the rest of that pass is discarded). After the pass the
// recorded partials are combined as the GPU's butterfly combines them, and the next pass knows
// one more result. The pass in which no lane meets an unknown reduction is the final one.

constexpr int kLanes = 32;
constexpr int kLaneMaxVecs = 8;  // 8 slices of 128 columns: kVectorMaxD, the widest row of the 4-wide kernels
// Values one lane holds: 8 slices of 4 (4-wide split), or kMaxD / 32 columns (column split).
constexpr int kLaneMaxValues = kMaxD / kLanes > kLaneMaxVecs * 4 ? kMaxD / kLanes : kLaneMaxVecs * 4;
constexpr int kLaneMaxReductions = 256;

// The reductions of one row's replay (see above).
struct LaneReductions {
  enum Kind : int { kSum = 0, kMax = 1, kMin = 2 };
  int known = 0;                        // results [0, known) are final
  int kind[kLaneMaxReductions];         // what each reduction combines with
  float result[kLaneMaxReductions];
  float partial[kLanes];                // the lanes' values for reduction `known`
  int reached = 0;                      // lanes that reached reduction `known` in this pass
  bool disagree = false;                // lanes called different reductions at one position

  float call(int lane, int& calls, int k, float x) {
    const int c = calls++;
    if (c < known) {
      disagree |= kind[c] != k;
      return result[c];
    }
    if (c == known && c < kLaneMaxReductions) {
      if (reached > 0) disagree |= kind[c] != k;
      kind[c] = k;
      partial[lane] = x;
      ++reached;
    }
    return 0.0f;  // a placeholder: this pass is replayed
  }

  // The partial values combined as WarpRow's xor-butterfly does (every lane gets the same value).
  void combine() {
    float x[kLanes];
    std::copy(partial, partial + kLanes, x);
    for (int o = kLanes / 2; o > 0; o >>= 1) {
      float y[kLanes];
      for (int l = 0; l < kLanes; ++l) {
        const float a = x[l], b = x[l ^ o];
        y[l] = kind[known] == kSum ? a + b : kind[known] == kMax ? fmaxf(a, b) : fminf(a, b);
      }
      std::copy(y, y + kLanes, x);
    }
    result[known++] = x[0];
  }
};

// One emulated lane's share of a row, with the same interface and semantics as WarpRow (or, for
// the column split, any_width::ColumnRow): this lane's slices of the weights, element states and
// temporaries, a private copy of each per-row state (float and int), and reductions across the
// 32 lanes.
template <int kElementSlots, int kRowSlots, int kIntRowSlots, int kTableSlots = 0>
struct LaneSplitRow : TableSlots<kTableSlots> {
  static constexpr int kN = kLaneMaxValues;
  int D;
  int lane;
  bool vector_split;  // 4-wide slices, or columns lane, lane + 32, ...
  int vecs;           // slices of 128 columns that the row spans (4-wide split)
  const float* g_;   // the whole row's gradient (read only)
  float w_[kN];
  float element_[kElementSlots > 0 ? kElementSlots : 1][kN];
  float row_[kRowSlots > 0 ? kRowSlots : 1];
  int64_t int_row_[kIntRowSlots > 0 ? kIntRowSlots : 1];
  LaneReductions* reductions;
  int calls;         // reductions called in this pass

  int column(int i) const { return vector_split ? (i >> 2) * 128 + 4 * lane + (i & 3) : i * kLanes + lane; }
  int extent() const { return vector_split ? vecs * 4 : (D + kLanes - 1) / kLanes; }
  // (the 4-wide split treats a slice as a whole, as WarpRow does: D is a multiple of 4 there)
  bool valid(int i) const { return vector_split ? (i >> 2) * 128 + 4 * lane < D : column(i) < D; }
  int dim() const { return D; }
  float g(int i) const { return g_[column(i)]; }
  float& w(int i) { return w_[i]; }
  float& element(int k, int i) { return element_[k][i]; }
  float& row_state(int k) { return row_[k]; }
  int64_t& int_row_state(int k) { return int_row_[k]; }
  float all_sum(float x) { return reductions->call(lane, calls, LaneReductions::kSum, x); }
  float all_max(float x) { return reductions->call(lane, calls, LaneReductions::kMax, x); }
  float all_min(float x) { return reductions->call(lane, calls, LaneReductions::kMin, x); }
};

// `Opt` run as the CUDA kernel runs it (see above); an optimizer for `backward` like any other.
template <class Opt>
struct LaneSplit {
  using Params = typename Opt::Params;
  static constexpr int kElementStates = Opt::kElementStates;
  static constexpr int kRowStates = Opt::kRowStates;
  static constexpr int kTemporaries = Opt::kTemporaries;
  static constexpr int kIntRowStates = Opt::kIntRowStates;
  static constexpr int kTableStates = Opt::kTableStates;
  using StepValues = typename Opt::StepValues;

  static StepValues step_values(const Params& params, int64_t step) { return Opt::step_values(params, step); }

  template <class Row>
  static void update_row(Row& row, const Params& params, const StepValues& step) {
    constexpr int kSlots = kElementStates + kTemporaries;
    using Lane = LaneSplitRow<kSlots, kRowStates, kIntRowStates, kTableStates>;
    TBEGEN_CHECK(row.vector_split ? row.D <= kLaneMaxVecs * 128 : row.D <= kLanes * kLaneMaxValues,
                 "tbegen: lane-split mode: row width ", row.D, " is wider than the emulated split covers");
    std::vector<Lane> lanes(kLanes);
    LaneReductions reductions;
    for (;;) {
      reductions.reached = 0;
      for (int l = 0; l < kLanes; ++l) {
        Lane& lane = lanes[l];
        lane.D = row.D;
        lane.lane = l;
        lane.vector_split = row.vector_split;
        lane.vecs = (row.D + 127) / 128;
        lane.g_ = row.g_;
        lane.reductions = &reductions;
        lane.calls = 0;
        for (int i = 0; i < lane.extent(); ++i) {
          if (!lane.valid(i)) continue;
          lane.w_[i] = row.w_[lane.column(i)];
          // element states from memory; temporaries start at 0, as the CUDA kernel's do
          for (int k = 0; k < kSlots; ++k) lane.element_[k][i] = k < kElementStates ? row.element_[k][lane.column(i)] : 0.0f;
        }
        for (int k = 0; k < kRowStates; ++k) lane.row_[k] = *row.row_[k];
        for (int k = 0; k < kIntRowStates; ++k) lane.int_row_[k] = *row.int_row_[k];
        if constexpr (kTableStates > 0) {
          for (int k = 0; k < kTableStates; ++k) lane.table_[k] = row.table_[k];
        }
        Opt::update_row(lane, params, step);
      }
      bool final_pass = reductions.reached == 0;
      for (int l = 0; l < kLanes; ++l) final_pass = final_pass && lanes[l].calls == reductions.known;
      TBEGEN_CHECK(!reductions.disagree && (final_pass || reductions.reached == kLanes),
                   "tbegen: lane-split mode: the lanes of a row call different row reductions (the "
                   "spec's control flow depends on how the row is split over lanes)");
      if (final_pass) break;
      TBEGEN_CHECK(reductions.known < kLaneMaxReductions, "tbegen: lane-split mode: more than ",
                   kLaneMaxReductions, " row reductions in one update");
      reductions.combine();
    }
    for (const Lane& lane : lanes) {
      for (int i = 0; i < lane.extent(); ++i) {
        if (!lane.valid(i)) continue;
        row.w_[lane.column(i)] = lane.w_[i];
        for (int k = 0; k < kSlots; ++k) row.element_[k][lane.column(i)] = lane.element_[k][i];
      }
    }
    // The GPU keeps lane 0's copy of each per-row state; where the lanes' copies differ, the
    // result depends on the split, which is what this mode exists to catch.
    for (int k = 0; k < kRowStates; ++k) {
      for (int l = 1; l < kLanes; ++l) {
        TBEGEN_CHECK(std::memcmp(&lanes[l].row_[k], &lanes[0].row_[k], sizeof(float)) == 0,
                     "tbegen: lane-split mode: the 32 lanes of a row end with different values of per-row "
                     "state ", k, " (lane 0: ", lanes[0].row_[k], ", lane ", l, ": ", lanes[l].row_[k],
                     "); the GPU keeps lane 0's: the spec's result depends on how a row is split over lanes");
      }
      *row.row_[k] = lanes[0].row_[k];
    }
    for (int k = 0; k < kIntRowStates; ++k) {
      for (int l = 1; l < kLanes; ++l) {
        TBEGEN_CHECK(lanes[l].int_row_[k] == lanes[0].int_row_[k],
                     "tbegen: lane-split mode: the 32 lanes of a row end with different values of int per-row "
                     "state ", k, " (lane 0: ", lanes[0].int_row_[k], ", lane ", l, ": ", lanes[l].int_row_[k],
                     "); the GPU keeps lane 0's: the spec's result depends on how a row is split over lanes");
      }
      *row.int_row_[k] = lanes[0].int_row_[k];
    }
  }
};

}  // namespace cpu
}  // namespace tbegen
