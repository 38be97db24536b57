// tbegen runtime: the radix sort of the backward's (key, value) pairs (cuda_backward_prep_impl.cuh).
//
// CUB's onesweep sort takes 8 bits of the key per pass over the data, so keys of 25 to 27 bits
// (32 tables of a million rows: 25) take four passes. With 9-bit digits they take three; a pass
// over 10 million pairs costs about 80 us on the H200, of which the wider digits give back about
// half (measured: C1's backward 25 us faster, benchmarks/NOTES-gpu.md, run Y).
// SortDigitHub<K, 9> is CUB's own sm_90 policy with that one change; sort_pairs picks 9
// bits only where it saves a pass, so the bits per pass never change the result: a stable sort of
// the same pairs is the same sequence however it is computed.
#pragma once

#include <cub/device/dispatch/dispatch_radix_sort.cuh>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace tbegen {
namespace cuda {

// CUB's radix-sort policies for (K, int32 value) pairs with `kBits`-bit onesweep digits: the
// onesweep, histogram and exclusive-sum policies are rebuilt with kBits; the rest (used only by
// architectures before sm_70, but needed to compile) are CUB's own. Used on sm_90 and later; older
// devices take CUB's sm_80 policy.
template <typename K, int kBits>
struct SortDigitHub {
  using Cub = cub::detail::radix::policy_hub<K, int32_t, uint32_t>;
  using Base = typename Cub::Policy900;

  struct Policy900 : cub::ChainedPolicy<900, Policy900, typename Cub::Policy800> {
    static constexpr bool ONESWEEP = true;
    static constexpr int ONESWEEP_RADIX_BITS = kBits;
    using HistogramPolicy = cub::AgentRadixSortHistogramPolicy<128, 16, 1, K, kBits>;
    using ExclusiveSumPolicy = cub::AgentRadixSortExclusiveSumPolicy<256, kBits>;
    // CUB's sm_90 tile for these pairs (384 threads; 23 items for 32-bit keys, 30 for 64-bit)
    using OnesweepPolicy = cub::AgentRadixSortOnesweepPolicy<
        384, sizeof(K) == 4 ? 23 : 30, K, 1, cub::RADIX_RANK_MATCH_EARLY_COUNTS_ANY, cub::BLOCK_SCAN_RAKING_MEMOIZE,
        cub::RADIX_SORT_STORE_DIRECT, kBits>;
    using ScanPolicy = typename Base::ScanPolicy;
    using DownsweepPolicy = typename Base::DownsweepPolicy;
    using AltDownsweepPolicy = typename Base::AltDownsweepPolicy;
    using UpsweepPolicy = typename Base::UpsweepPolicy;
    using AltUpsweepPolicy = typename Base::AltUpsweepPolicy;
    using SingleTilePolicy = typename Base::SingleTilePolicy;
    using SegmentedPolicy = typename Base::SegmentedPolicy;
    using AltSegmentedPolicy = typename Base::AltSegmentedPolicy;
  };
  using MaxPolicy = Policy900;
};

// The digit width of the sort of keys of `key_bits` bits: 9 where that takes fewer passes than 8
// (25-27 bits: three passes, not four), else CUB's 8. TBEGEN_SORT_DIGIT_BITS=8 keeps 8 always
// (read at every call, so that a benchmark can time both in one process).
inline int sort_digit_bits(int key_bits) {
  const char* v = std::getenv("TBEGEN_SORT_DIGIT_BITS");
  if (v != nullptr && std::strcmp(v, "8") == 0) return 8;
  return (key_bits + 8) / 9 < (key_bits + 7) / 8 ? 9 : 8;
}

// Stable ascending sort of n (key, value) pairs on key bits [0, end_bit), as
// cub::DeviceRadixSort::SortPairs (the inputs are not changed), with `digit_bits` (8 or 9) bits
// per pass. With tmp == nullptr, writes the scratch bytes it needs to `bytes`.
template <typename K>
cudaError_t sort_pairs(void* tmp, size_t& bytes, const K* keys_in, K* keys_out, const int32_t* values_in,
                       int32_t* values_out, int n, int end_bit, int digit_bits, cudaStream_t stream) {
  cub::DoubleBuffer<K> keys(const_cast<K*>(keys_in), keys_out);
  cub::DoubleBuffer<int32_t> values(const_cast<int32_t*>(values_in), values_out);
  constexpr bool kOverwriteOkay = false;  // (the inputs stay as they are; CUB's scratch holds the passes)
  if (digit_bits == 9) {
    return cub::DispatchRadixSort<cub::SortOrder::Ascending, K, int32_t, uint32_t, cub::detail::identity_decomposer_t,
                                  SortDigitHub<K, 9>>::Dispatch(tmp, bytes, keys, values, uint32_t(n), 0, end_bit,
                                                                kOverwriteOkay, stream);
  }
  return cub::DispatchRadixSort<cub::SortOrder::Ascending, K, int32_t, uint32_t>::Dispatch(
      tmp, bytes, keys, values, uint32_t(n), 0, end_bit, kOverwriteOkay, stream);
}

// ---- the same sort with its counters zeroed by the caller (TBEGEN_SORT_NO_MEMSETS=1) -------------
//
// CUB's onesweep dispatch (DispatchRadixSort::InvokeOnesweep) issues 2 + passes cudaMemsetAsync
// calls per sort: its tile counters, its digit histograms, and before each pass the look-back
// flags of that pass (one area reused by every pass). On the host each is a runtime call of ~4 us,
// a step's largest group of memsets (issue 29: 5 of the 6 in a 3-pass step). OnesweepSort runs the
// same CUB kernels (histogram, exclusive sum, one onesweep kernel per pass: the same kernels, grids,
// arguments and order as CUB's dispatch, so the same sorted sequence) on a scratch whose counters,
// histograms and a look-back area per pass (not one reused) lie in one region at its start, which
// the caller zeroes before the sort on the same stream (prepare_backward: in its linearize kernel,
// so no memset at all). It takes only what CUB's dispatch would sort by onesweep in one portion:
// a policy with ONESWEEP, more pairs than one tile of the single-tile kernel, at most one portion
// (2^28 pairs); `taken` false otherwise, and the caller sorts with sort_pairs (CUB's dispatch).
//
// Used as CUB's dispatch is: PolicyHub::MaxPolicy::Invoke(ptx_version, sort) calls Invoke<Policy>
// with the policy of the device's PTX version; `run` false sizes the scratch (bytes, zero_bytes),
// true launches. Written against CCCL 3.0 (CUDA 13.0: the kernels' signatures in
// cub/device/dispatch/kernels/radix_sort.cuh); another CCCL takes sort_pairs (onesweep_sort_available).
#if defined(CCCL_MAJOR_VERSION) && CCCL_MAJOR_VERSION == 3 && CCCL_MINOR_VERSION == 0
constexpr bool kOnesweepSortAvailable = true;
#else
constexpr bool kOnesweepSortAvailable = false;
#endif

template <typename K, typename PolicyHub>
struct OnesweepSort {
  using OffsetT = uint32_t;       // (sort_pairs' offset type)
  using AtomicOffsetT = int32_t;  // (CUB's onesweep: PortionOffsetT = AtomicOffsetT = int)
  const K* keys_in;
  K* keys_out;
  const int32_t* values_in;
  int32_t* values_out;
  int n;
  int end_bit;
  cudaStream_t stream;
  int sms;            // the device's multiprocessors (the histogram kernel's grid)
  bool run = false;   // false: size only
  void* tmp = nullptr;
  // results
  bool taken = false;
  size_t bytes = 0;       // the scratch
  size_t zero_bytes = 0;  // its first zero_bytes bytes must be zero when the sort starts

  static size_t aligned(size_t b) { return (b + 255) / 256 * 256; }

  template <typename ActivePolicyT>
  cudaError_t Invoke() {
    if constexpr (!kOnesweepSortAvailable || !ActivePolicyT::ONESWEEP) {
      taken = false;
      return cudaSuccess;
    } else {
      using SingleTile = typename ActivePolicyT::SingleTilePolicy;
      using Onesweep = typename ActivePolicyT::OnesweepPolicy;
      using MaxPolicy = typename PolicyHub::MaxPolicy;
      constexpr int kBits = ActivePolicyT::ONESWEEP_RADIX_BITS;
      constexpr int kDigits = 1 << kBits;
      constexpr int kTile = Onesweep::ITEMS_PER_THREAD * Onesweep::BLOCK_THREADS;
      constexpr int kPortion = ((1 << 28) - 1) / kTile * kTile;  // (CUB's PORTION_SIZE)
      if (n <= SingleTile::BLOCK_THREADS * SingleTile::ITEMS_PER_THREAD || n > kPortion || end_bit <= 0) {
        taken = false;  // (CUB's single-tile kernel, or several portions: its dispatch as it is)
        return cudaSuccess;
      }
      taken = true;
      const int passes = (end_bit + kBits - 1) / kBits;
      const int blocks = (n + kTile - 1) / kTile;
      // [histograms | tile counters | look-back of pass 0 | ... | of the last pass] then, for
      // more than one pass, the pairs' extra buffers (kOverwriteOkay false, as sort_pairs)
      const size_t bins_bytes = aligned(size_t(passes) * kDigits * sizeof(OffsetT));
      const size_t ctrs_bytes = aligned(size_t(passes) * sizeof(AtomicOffsetT));
      const size_t lookback_pass = size_t(blocks) * kDigits * sizeof(AtomicOffsetT);
      zero_bytes = bins_bytes + ctrs_bytes + aligned(size_t(passes) * lookback_pass);
      const size_t keys_bytes = passes > 1 ? aligned(size_t(n) * sizeof(K)) : 0;
      const size_t values_bytes = passes > 1 ? aligned(size_t(n) * sizeof(int32_t)) : 0;
      bytes = zero_bytes + keys_bytes + values_bytes;
      if (!run) return cudaSuccess;

      uint8_t* base = static_cast<uint8_t*>(tmp);
      OffsetT* bins = reinterpret_cast<OffsetT*>(base);
      AtomicOffsetT* ctrs = reinterpret_cast<AtomicOffsetT*>(base + bins_bytes);
      uint8_t* lookback = base + bins_bytes + ctrs_bytes;
      K* keys_tmp2 = reinterpret_cast<K*>(base + zero_bytes);
      int32_t* values_tmp2 = reinterpret_cast<int32_t*>(base + zero_bytes + keys_bytes);

      // every pass's histogram at once (bins zeroed by the caller), then their exclusive sums
      using Decomposer = cub::detail::identity_decomposer_t;
      constexpr auto kOrder = cub::SortOrder::Ascending;
      auto* const histogram =
          &cub::detail::radix_sort::DeviceRadixSortHistogramKernel<MaxPolicy, kOrder, K, OffsetT, Decomposer>;
      constexpr int kHistogramThreads = ActivePolicyT::HistogramPolicy::BLOCK_THREADS;
      static const int histogram_per_sm = [&] {
        int blocks_per_sm = 1;
        if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks_per_sm, histogram, kHistogramThreads, 0) !=
            cudaSuccess) {
          (void)cudaGetLastError();
          blocks_per_sm = 1;
        }
        return blocks_per_sm;
      }();
      histogram<<<histogram_per_sm * sms, kHistogramThreads, 0, stream>>>(bins, keys_in, OffsetT(n), 0, end_bit,
                                                                          Decomposer{});
      cudaError_t err = cudaGetLastError();
      if (err != cudaSuccess) return err;
      cub::detail::radix_sort::DeviceRadixSortExclusiveSumKernel<MaxPolicy, OffsetT>
          <<<passes, ActivePolicyT::ExclusiveSumPolicy::BLOCK_THREADS, 0, stream>>>(bins);
      err = cudaGetLastError();
      if (err != cudaSuccess) return err;

      // the passes, through the same buffers as CUB's dispatch with is_overwrite_okay false: the
      // result ends in keys_out / values_out for any number of passes
      const K* k_in = keys_in;
      const int32_t* v_in = values_in;
      auto* const onesweep =
          &cub::detail::radix_sort::DeviceRadixSortOnesweepKernel<MaxPolicy, kOrder, K, int32_t, OffsetT, int,
                                                                   AtomicOffsetT, Decomposer>;
      for (int pass = 0; pass < passes; ++pass) {
        const int bit = pass * kBits;
        // (the last pass writes the output; an even number of passes starts in the extra buffers)
        const bool to_out = (passes - 1 - pass) % 2 == 0;
        K* k_out = to_out ? keys_out : keys_tmp2;
        int32_t* v_out = to_out ? values_out : values_tmp2;
        onesweep<<<blocks, Onesweep::BLOCK_THREADS, 0, stream>>>(
            reinterpret_cast<AtomicOffsetT*>(lookback + size_t(pass) * lookback_pass), ctrs + pass, nullptr,
            bins + size_t(pass) * kDigits, k_out, k_in, v_out, v_in, n, bit, std::min(end_bit - bit, kBits),
            Decomposer{});
        err = cudaGetLastError();
        if (err != cudaSuccess) return err;
        k_in = k_out;
        v_in = v_out;
      }
      return cudaSuccess;
    }
  }
};

template <typename K, typename PolicyHub>
cudaError_t invoke_onesweep_sort(OnesweepSort<K, PolicyHub>& sort) {
  int ptx_version = 0;
  const cudaError_t err = cub::PtxVersion(ptx_version);
  if (err != cudaSuccess) return err;
  return PolicyHub::MaxPolicy::Invoke(ptx_version, sort);
}

// sort_pairs' sort (the same pairs, bits and digit width: 8 bits through CUB's own policies, 9
// through SortDigitHub) by OnesweepSort: size() says whether it takes the sort and how much scratch
// it needs (no device work, no pointer read), of which the first zero_bytes() must be zero (on the
// sort's stream) before run() sorts the pairs.
template <typename K>
struct PrezeroedSort {
  OnesweepSort<K, cub::detail::radix::policy_hub<K, int32_t, uint32_t>> eight;
  OnesweepSort<K, SortDigitHub<K, 9>> nine;
  int digit_bits;

  PrezeroedSort(int n, int end_bit, int digit_bits, int sms, cudaStream_t stream)
      : eight{nullptr, nullptr, nullptr, nullptr, n, end_bit, stream, sms},
        nine{nullptr, nullptr, nullptr, nullptr, n, end_bit, stream, sms},
        digit_bits(digit_bits) {}
  // sizes the scratch (no device work); false: sort with sort_pairs instead
  cudaError_t size(bool* taken) {
    const cudaError_t err = digit_bits == 9 ? invoke_onesweep_sort(nine) : invoke_onesweep_sort(eight);
    *taken = err == cudaSuccess && (digit_bits == 9 ? nine.taken : eight.taken);
    return err;
  }
  size_t bytes() const { return digit_bits == 9 ? nine.bytes : eight.bytes; }
  size_t zero_bytes() const { return digit_bits == 9 ? nine.zero_bytes : eight.zero_bytes; }
  // launches the sort (after size() said it takes it) on `tmp`, bytes() bytes whose first
  // zero_bytes() are zero by the time the sort runs
  cudaError_t run(void* tmp, const K* keys_in, K* keys_out, const int32_t* values_in, int32_t* values_out) {
    eight.keys_in = nine.keys_in = keys_in;
    eight.keys_out = nine.keys_out = keys_out;
    eight.values_in = nine.values_in = values_in;
    eight.values_out = nine.values_out = values_out;
    eight.run = nine.run = true;
    eight.tmp = nine.tmp = tmp;
    return digit_bits == 9 ? invoke_onesweep_sort(nine) : invoke_onesweep_sort(eight);
  }
};

}  // namespace cuda
}  // namespace tbegen
