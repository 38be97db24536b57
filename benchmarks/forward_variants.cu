// Forward kernel experiment (H200): the shipped 4-wide forward kernel beside candidate variants, on
// the benchmark's C1 (uniform) and C2 (Zipf) batches: T=32 tables of 1,000,000 x 128 fp32 rows,
// B=16384, L=20, sum pooling, int64 indices. Each variant's output is compared bitwise with the
// shipped kernel's (same order of additions), then timed with CUDA events (median of 20), warm
// (one batch again and again) and cold (4 batches in turn, L2 flushed before each). (Run M's
// outputs, docs/gpu-runs/2026-12-03-m/forward_variants_*.txt, also timed the kernel shipped
// before it, since removed from this file.)
//
//   nvcc -O3 -std=c++17 -arch=sm_90 --expt-relaxed-constexpr -I templates/include \
//        -I $(python3 -c 'import torch,os;print(os.path.dirname(torch.__file__))')/include \
//        benchmarks/forward_variants.cu -o /tmp/fv && /tmp/fv [profile]
//
// `profile` launches each variant once per batch (for ncu). Results: benchmarks/NOTES-gpu.md.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "tbegen/cuda_kernels.cuh"

using namespace tbegen;
using namespace tbegen::cuda;

#define CK(x)                                                                                   \
  do {                                                                                          \
    cudaError_t e_ = (x);                                                                       \
    if (e_ != cudaSuccess) {                                                                    \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                             \
    }                                                                                           \
  } while (0)

// ---- candidates ---------------------------------------------------------------------------------

// "cand": the shipped kernel's loop (groups of lanes per row, one bag per warp, a warp for every
// bag) with its tunables exposed: rows in flight (kUnroll), block size, a minimum of resident
// blocks (caps registers), and plain (L1-allocating, coherent) loads instead of the read-only path.
template <int kUnroll, int kBlock, int kMinBlocks, bool kPlainLoad>
__global__ void __launch_bounds__(kBlock, kMinBlocks) cand_kernel(ForwardArgs a, const float* __restrict__ weights,
                                                                   const int64_t* __restrict__ indices,
                                                                   const int64_t* __restrict__ offsets) {
  const int lane = threadIdx.x % kWarpSize;
  const int nbags = int(a.F * a.B);
  const int bag = int((int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / kWarpSize);
  if (bag >= nbags) return;
  int64_t start64, end64;
  const bool bounds_ok = bag_bounds(offsets, bag, nbags, a.N, a.error, &start64, &end64);
  const int start = bounds_ok ? int(start64) : 0, end = bounds_ok ? int(end64) : 0;
  const int B = int(a.B);
  const int f = bag / B, b = bag - f * B;
  const int64_t* ft = a.feat + f * kFeatColumns;
  const int D = int(ft[kFeatDim]);
  const int64_t rows = ft[kFeatRows], base = ft[kFeatWeightsOffset];
  const float* table = weights + base;
  const int group_lanes = lanes_for_row(D);
  const int groups = kWarpSize / group_lanes;
  const int group = lane / group_lanes;
  const int d0 = 4 * (lane % group_lanes);
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  for (int i0 = start; i0 < end; i0 += kWarpSize) {
    const int my_i = i0 + lane;
    int32_t my_row = -1;
    if (my_i < end) my_row = checked_row(int64_t(indices[my_i]), rows, base, D, a.weights_numel, my_i, a.error);
    const int n = end - i0 < kWarpSize ? end - i0 : kWarpSize;
    const int rounds = (n + groups - 1) / groups;
#pragma unroll kUnroll
    for (int k = 0; k < rounds; ++k) {
      const int j = k * groups + group;
      const int32_t r = __shfl_sync(kFullMask, my_row, j < n ? j : 0);
      if (j < n && r >= 0 && d0 < D) {
        const float* p = table + int64_t(r) * D + d0;
        float4 x;
        if (kPlainLoad) {
          asm volatile("ld.global.v4.f32 {%0,%1,%2,%3}, [%4];" : "=f"(x.x), "=f"(x.y), "=f"(x.z), "=f"(x.w) : "l"(p));
        } else {
          x = *reinterpret_cast<const float4*>(p);
        }
        acc[0] += x.x; acc[1] += x.y; acc[2] += x.z; acc[3] += x.w;
      }
    }
  }
  for (int o = group_lanes; o < kWarpSize; o <<= 1) {
#pragma unroll
    for (int c = 0; c < 4; ++c) acc[c] += __shfl_xor_sync(kFullMask, acc[c], o);
  }
  const float scale = (a.pooling == kPoolMean && end > start) ? 1.0f / float(end - start) : 1.0f;
  float* o = a.out + int64_t(b) * a.total_D + ft[kFeatOutOffset];
  if (group == 0 && d0 < D) {
    float x[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) x[c] = acc[c] * scale;
    store4(o + d0, x);
  }
}

// "bare": no checks at all (what the checks cost; not a candidate).
template <typename W, typename I>
__global__ void __launch_bounds__(256) bare_kernel(ForwardArgs a, const W* __restrict__ weights,
                                                   const I* __restrict__ indices, const I* __restrict__ offsets) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t nbags = a.F * a.B;
  const int64_t warps = int64_t(gridDim.x) * blockDim.x / kWarpSize;
  for (int64_t bag = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / kWarpSize; bag < nbags; bag += warps) {
    const int64_t start = offsets[bag], end = offsets[bag + 1];
    const int64_t f = bag / a.B, b = bag % a.B;
    const int64_t* ft = a.feat + f * kFeatColumns;
    const int D = int(ft[kFeatDim]);
    const W* table = weights + ft[kFeatWeightsOffset];
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    const int d = 4 * lane;
    for (int64_t i0 = start; i0 < end; i0 += kWarpSize) {
      const int64_t my_i = i0 + lane;
      const int64_t my_off = my_i < end ? int64_t(indices[my_i]) * D : 0;
      const int n = end - i0 < kWarpSize ? int(end - i0) : kWarpSize;
      for (int j = 0; j < n; ++j) {
        const int64_t off = __shfl_sync(kFullMask, my_off, j);
        float x[4];
        load_weights4(table + off + d, x);
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[c] += x[c];
      }
    }
    float* o = a.out + b * a.total_D + ft[kFeatOutOffset];
    store4(o + d, acc);
  }
}

// ---- harness ------------------------------------------------------------------------------------

struct Batch {
  std::vector<int64_t> indices, offsets;
};

static Batch make_batch(bool zipf, int T, int64_t E, int B, int L, uint64_t seed) {
  std::mt19937_64 rng(seed);
  Batch bt;
  bt.indices.resize(size_t(T) * B * L);
  bt.offsets.resize(size_t(T) * B + 1);
  for (size_t i = 0; i <= size_t(T) * B; ++i) bt.offsets[i] = int64_t(i) * L;
  std::vector<double> cdf;
  if (zipf) {
    cdf.resize(E);
    double s = 0;
    for (int64_t k = 0; k < E; ++k) cdf[k] = (s += std::pow(double(k + 1), -1.1));
    for (auto& c : cdf) c /= s;
  }
  std::uniform_real_distribution<double> u01(0.0, 1.0);
  std::uniform_int_distribution<int64_t> uni(0, E - 1);
  for (int t = 0; t < T; ++t) {
    std::vector<int64_t> perm(E);
    for (int64_t k = 0; k < E; ++k) perm[k] = k;
    std::shuffle(perm.begin(), perm.end(), rng);
    for (size_t i = size_t(t) * B * L; i < size_t(t + 1) * B * L; ++i) {
      if (zipf) {
        const int64_t rank = std::lower_bound(cdf.begin(), cdf.end(), u01(rng)) - cdf.begin();
        bt.indices[i] = perm[std::min<int64_t>(rank, E - 1)];
      } else {
        bt.indices[i] = uni(rng);
      }
    }
  }
  return bt;
}

int main(int argc, char** argv) {
  const bool profile = argc > 1 && std::strcmp(argv[1], "profile") == 0;
  const int T = 32, D = 128, B = 16384, L = 20;
  const int64_t E = 1000000;
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int64_t numel = int64_t(T) * E * D;
  float* w;
  CK(cudaMalloc(&w, numel * sizeof(float)));
  {
    // deterministic, varied values (a pattern the sum cannot reorder invisibly)
    std::vector<float> chunk(size_t(E) * D);
    std::mt19937 g(7);
    std::uniform_real_distribution<float> dist(-1.f, 1.f);
    for (auto& x : chunk) x = dist(g);
    for (int t = 0; t < T; ++t) CK(cudaMemcpy(w + size_t(t) * E * D, chunk.data(), chunk.size() * 4, cudaMemcpyHostToDevice));
  }
  std::vector<int64_t> feat(size_t(T) * kFeatColumns);
  for (int t = 0; t < T; ++t) {
    feat[t * kFeatColumns + kFeatWeightsOffset] = int64_t(t) * E * D;
    feat[t * kFeatColumns + kFeatRows] = E;
    feat[t * kFeatColumns + kFeatDim] = D;
    feat[t * kFeatColumns + kFeatOutOffset] = int64_t(t) * D;
    feat[t * kFeatColumns + kFeatKeyBase] = int64_t(t) * E;
  }
  int64_t *dfeat, *derr;
  CK(cudaMalloc(&dfeat, feat.size() * 8));
  CK(cudaMemcpy(dfeat, feat.data(), feat.size() * 8, cudaMemcpyHostToDevice));
  CK(cudaMalloc(&derr, 64 * 8));
  CK(cudaMemset(derr, 0, 64 * 8));
  const int64_t nbags = int64_t(T) * B, N = nbags * L;
  float *out, *ref;
  CK(cudaMalloc(&out, size_t(B) * T * D * 4));
  CK(cudaMalloc(&ref, size_t(B) * T * D * 4));
  int64_t *dind, *doff;
  CK(cudaMalloc(&dind, N * 8));
  CK(cudaMalloc(&doff, (nbags + 1) * 8));

  ForwardArgs a{};
  a.feat = dfeat;
  a.F = T;
  a.B = B;
  a.N = N;
  a.total_D = int64_t(T) * D;
  a.max_D = D;
  a.weights_numel = numel;
  a.psw = nullptr;
  a.pooling = kPoolSum;
  a.error = derr;

  auto grid_capped = [&](int64_t warps_of_work) {
    const int64_t blocks = (warps_of_work + 7) / 8;
    return int(std::max<int64_t>(1, std::min<int64_t>(blocks, int64_t(sms) * 32)));
  };

  struct Variant {
    const char* name;
    std::function<void(float*)> run;
  };
  auto full = [&](int per_block) { return int((nbags + per_block - 1) / per_block); };
  std::vector<Variant> variants = {
      {"shipped: plain loop (every D > 64)",
       [&](float* o) { a.out = o; forward_kernel<float, int64_t, 1, false, false><<<full(8), 256>>>(a, w, dind, doff); }},
      {"shipped: lane-group loop (some D <= 64)",
       [&](float* o) { a.out = o; forward_kernel<float, int64_t, 1, true, false><<<full(8), 256>>>(a, w, dind, doff); }},
      {"cand unroll 4, 256",
       [&](float* o) { a.out = o; cand_kernel<4, 256, 1, false><<<full(8), 256>>>(a, w, dind, doff); }},
      {"cand unroll 2, 256",
       [&](float* o) { a.out = o; cand_kernel<2, 256, 1, false><<<full(8), 256>>>(a, w, dind, doff); }},
      {"cand unroll 8, 256",
       [&](float* o) { a.out = o; cand_kernel<8, 256, 1, false><<<full(8), 256>>>(a, w, dind, doff); }},
      {"cand unroll 4, 512",
       [&](float* o) { a.out = o; cand_kernel<4, 512, 1, false><<<full(16), 512>>>(a, w, dind, doff); }},
      {"cand unroll 4, 128",
       [&](float* o) { a.out = o; cand_kernel<4, 128, 1, false><<<full(4), 128>>>(a, w, dind, doff); }},
      {"cand unroll 4, 256, 8 blocks/SM",
       [&](float* o) { a.out = o; cand_kernel<4, 256, 8, false><<<full(8), 256>>>(a, w, dind, doff); }},
      {"cand unroll 2, 256, 8 blocks/SM",
       [&](float* o) { a.out = o; cand_kernel<2, 256, 8, false><<<full(8), 256>>>(a, w, dind, doff); }},
      {"cand unroll 4, 256, plain loads",
       [&](float* o) { a.out = o; cand_kernel<4, 256, 1, true><<<full(8), 256>>>(a, w, dind, doff); }},
      {"cand unroll 4, 512, plain loads",
       [&](float* o) { a.out = o; cand_kernel<4, 512, 1, true><<<full(16), 512>>>(a, w, dind, doff); }},
      {"bare (no checks; bound)", [&](float* o) { a.out = o; bare_kernel<float, int64_t><<<grid_capped(nbags), 256>>>(a, w, dind, doff); }},
  };


  float* ones = nullptr;  // per-sample weights of 1 for the weighted-path variant
  CK(cudaMalloc(&ones, N * 4));
  {
    std::vector<float> h(N, 1.0f);
    CK(cudaMemcpy(ones, h.data(), N * 4, cudaMemcpyHostToDevice));
  }

  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  // an L2 flush between cold timings (the H200's L2 is 50 MB)
  const size_t flush_bytes = size_t(256) << 20;
  void* flush;
  CK(cudaMalloc(&flush, flush_bytes));
  const int kSets = 4;
  int64_t* dinds[kSets];
  for (int k = 0; k < kSets; ++k) CK(cudaMalloc(&dinds[k], N * 8));
  for (int cfg = 0; cfg < 2; ++cfg) {
    const bool zipf = cfg == 1;
    for (int k = 0; k < kSets; ++k) {
      Batch bt = make_batch(zipf, T, E, B, L, 1234 + 10 * cfg + k);
      CK(cudaMemcpy(dinds[k], bt.indices.data(), N * 8, cudaMemcpyHostToDevice));
      if (k == 0) CK(cudaMemcpy(doff, bt.offsets.data(), (nbags + 1) * 8, cudaMemcpyHostToDevice));
    }
    std::printf("== %s (T=%d E=%lld D=%d B=%d L=%d fp32 int64 sum); warm: one batch again and again; "
                "cold: %d batches in turn, L2 flushed before each\n", zipf ? "C2 Zipf" : "C1 uniform", T,
                (long long)E, D, B, L, kSets);
    dind = dinds[0];
    variants[0].run(ref);
    CK(cudaDeviceSynchronize());
    for (auto& v : variants) {
      dind = dinds[0];
      CK(cudaMemset(out, 0xff, size_t(B) * T * D * 4));
      v.run(out);
      CK(cudaGetLastError());
      CK(cudaDeviceSynchronize());
      const bool same = [&] {
        std::vector<float> x(size_t(B) * T * D), y(size_t(B) * T * D);
        CK(cudaMemcpy(x.data(), out, x.size() * 4, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(y.data(), ref, y.size() * 4, cudaMemcpyDeviceToHost));
        return std::memcmp(x.data(), y.data(), x.size() * 4) == 0;
      }();
      if (profile) {
        std::printf("%-40s %s\n", v.name, same ? "bitwise equal" : "DIFFERS");
        continue;
      }
      double med[2];
      for (int cold = 0; cold < 2; ++cold) {
        std::vector<float> ms;
        for (int r = 0; r < 25; ++r) {
          dind = cold ? dinds[r % kSets] : dinds[0];
          if (cold) CK(cudaMemsetAsync(flush, r & 0xff, flush_bytes));
          CK(cudaEventRecord(e0));
          v.run(out);
          CK(cudaEventRecord(e1));
          CK(cudaEventSynchronize(e1));
          float t;
          CK(cudaEventElapsedTime(&t, e0, e1));
          if (r >= 5) ms.push_back(t);
        }
        std::sort(ms.begin(), ms.end());
        med[cold] = 1000.0 * ms[ms.size() / 2];
      }
      std::printf("%-40s warm %7.1f us  cold %7.1f us  %s\n", v.name, med[0], med[1], same ? "bitwise equal" : "DIFFERS");
    }
    int64_t err[64];
    CK(cudaMemcpy(err, derr, sizeof(err), cudaMemcpyDeviceToHost));
    std::printf("error record: %lld %lld\n", (long long)err[0], (long long)err[3]);
  }
  return 0;
}
