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

}  // namespace cuda
}  // namespace tbegen
