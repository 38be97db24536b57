// Forward kernel experiment (H200): the shipped 4-wide forward kernel beside candidate variants, on
// the benchmark's C1 (uniform) and C2 (Zipf) batches: T=32 tables of 1,000,000 x 128 fp32 rows,
// B=16384, L=20, sum pooling, int64 indices. Each variant's output is compared bitwise with the
// shipped kernel's (same order of additions), then timed with CUDA events (median of 20).
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

// A lane checks its index and returns the row within the table (tables have < 2^31 rows), or -1.
__device__ __forceinline__ int32_t checked_row(int64_t idx, int64_t rows, int64_t base, int D, int64_t numel,
                                               int64_t i, int64_t* error) {
  if (idx < 0 || idx >= rows) {
    record_error(error, kErrIndexOutOfRange, i, idx);
    return -1;
  }
  if (base + idx * D + D > numel) {
    record_error(error, kErrRowOutsideWeights, i, idx);
    return -1;
  }
  return int32_t(idx);
}

// "lean": one warp per bag as shipped, but the lanes shuffle a 32-bit row number (not a 64-bit
// offset) and, unweighted, no scale; kUnroll rows in flight; kMinBlocks as a launch bound.
template <typename W, typename I, bool kWeighted, int kUnroll, int kMinBlocks>
__global__ void __launch_bounds__(256, kMinBlocks) lean_kernel(ForwardArgs a, const W* __restrict__ weights,
                                                                const I* __restrict__ indices,
                                                                const I* __restrict__ offsets) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t nbags = a.F * a.B;
  const int64_t warps = int64_t(gridDim.x) * blockDim.x / kWarpSize;
  for (int64_t bag = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / kWarpSize; bag < nbags; bag += warps) {
    int64_t start, end;
    const bool bounds_ok = bag_bounds(offsets, bag, nbags, a.N, a.error, &start, &end);
    if (!bounds_ok) start = end = 0;
    const int64_t f = bag / a.B, b = bag % a.B;
    const int64_t* ft = a.feat + f * kFeatColumns;
    const int D = int(ft[kFeatDim]);
    const int64_t rows = ft[kFeatRows], base = ft[kFeatWeightsOffset];
    const W* table = weights + base;
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    const int d = 4 * lane;
    for (int64_t i0 = start; i0 < end; i0 += kWarpSize) {
      const int64_t my_i = i0 + lane;
      int32_t my_row = -1;
      float my_scale = 0.0f;
      if (my_i < end) {
        my_row = checked_row(int64_t(indices[my_i]), rows, base, D, a.weights_numel, my_i, a.error);
        if (kWeighted) my_scale = a.psw[my_i];
      }
      const int n = end - i0 < kWarpSize ? int(end - i0) : kWarpSize;
#pragma unroll kUnroll
      for (int j = 0; j < n; ++j) {
        const int32_t r = __shfl_sync(kFullMask, my_row, j);
        float s = 1.0f;
        if (kWeighted) s = __shfl_sync(kFullMask, my_scale, j);
        if (r < 0) continue;
        if (d < D) {
          float x[4];
          load_weights4(table + int64_t(r) * D + d, x);
#pragma unroll
          for (int c = 0; c < 4; ++c) acc[c] = kWeighted ? acc[c] + s * x[c] : acc[c] + x[c];
        }
      }
    }
    const float scale = (a.pooling == kPoolMean && end > start) ? 1.0f / float(end - start) : 1.0f;
    float* o = a.out + b * a.total_D + ft[kFeatOutOffset];
    if (d < D) {
      float x[4];
#pragma unroll
      for (int c = 0; c < 4; ++c) x[c] = acc[c] * scale;
      store4(o + d, x);
    }
  }
}

// "lean32": lean with 32-bit bag and index counters (batches of < 2^31 indices), fewer registers.
template <typename W, typename I, int kUnroll>
__global__ void __launch_bounds__(256) lean32_kernel(ForwardArgs a, const W* __restrict__ weights,
                                                     const I* __restrict__ indices,
                                                     const I* __restrict__ offsets) {
  const int lane = threadIdx.x % kWarpSize;
  const int nbags = int(a.F * a.B);
  const int warps = int(gridDim.x) * blockDim.x / kWarpSize;
  for (int bag = (int(blockIdx.x) * blockDim.x + threadIdx.x) / kWarpSize; bag < nbags; bag += warps) {
    int64_t start64, end64;
    const bool bounds_ok = bag_bounds(offsets, bag, nbags, a.N, a.error, &start64, &end64);
    const int start = bounds_ok ? int(start64) : 0, end = bounds_ok ? int(end64) : 0;
    const int f = bag / int(a.B), b = bag - f * int(a.B);
    const int64_t* ft = a.feat + f * kFeatColumns;
    const int D = int(ft[kFeatDim]);
    const int64_t rows = ft[kFeatRows], base = ft[kFeatWeightsOffset];
    const W* table = weights + base;
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    const int d = 4 * lane;
    for (int i0 = start; i0 < end; i0 += kWarpSize) {
      const int my_i = i0 + lane;
      int32_t my_row = -1;
      if (my_i < end) my_row = checked_row(int64_t(indices[my_i]), rows, base, D, a.weights_numel, my_i, a.error);
      const int n = end - i0 < kWarpSize ? end - i0 : kWarpSize;
#pragma unroll kUnroll
      for (int j = 0; j < n; ++j) {
        const int32_t r = __shfl_sync(kFullMask, my_row, j);
        if (r >= 0 && d < D) {
          float x[4];
          load_weights4(table + r * int64_t(D) + d, x);
#pragma unroll
          for (int c = 0; c < 4; ++c) acc[c] += x[c];
        }
      }
    }
    const float scale = (a.pooling == kPoolMean && end > start) ? 1.0f / float(end - start) : 1.0f;
    float* o = a.out + int64_t(b) * a.total_D + ft[kFeatOutOffset];
    if (d < D) {
      float x[4];
#pragma unroll
      for (int c = 0; c < 4; ++c) x[c] = acc[c] * scale;
      store4(o + d, x);
    }
  }
}

// "pair": a warp takes two bags at once (consecutive bags of one feature when they are), their
// rows interleaved so that both bags' loads are in flight together; the same order of additions
// within each bag.
template <typename W, typename I, int kUnroll>
__global__ void __launch_bounds__(256) pair_kernel(ForwardArgs a, const W* __restrict__ weights,
                                                   const I* __restrict__ indices, const I* __restrict__ offsets) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t nbags = a.F * a.B;
  const int64_t npairs = (nbags + 1) / 2;
  const int64_t warps = int64_t(gridDim.x) * blockDim.x / kWarpSize;
  for (int64_t pair = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / kWarpSize; pair < npairs; pair += warps) {
    int64_t st[2], en[2], bagv[2];
    const W* table[2];
    int Dv[2];
    int64_t rows[2], base[2];
    const int64_t* ftv[2];
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const int64_t bag = 2 * pair + k;
      bagv[k] = bag;
      if (bag < nbags) {
        if (!bag_bounds(offsets, bag, nbags, a.N, a.error, &st[k], &en[k])) st[k] = en[k] = 0;
      } else {
        st[k] = en[k] = 0;
      }
      const int64_t f = (bag < nbags ? bag : 0) / a.B;
      ftv[k] = a.feat + f * kFeatColumns;
      Dv[k] = int(ftv[k][kFeatDim]);
      rows[k] = ftv[k][kFeatRows];
      base[k] = ftv[k][kFeatWeightsOffset];
      table[k] = weights + base[k];
    }
    float acc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
    const int d = 4 * lane;
    const int64_t len0 = en[0] - st[0], len1 = en[1] - st[1];
    const int64_t len = len0 > len1 ? len0 : len1;
    for (int64_t k0 = 0; k0 < len; k0 += kWarpSize) {
      int32_t my_row[2] = {-1, -1};
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        const int64_t i = st[k] + k0 + lane;
        if (i < en[k]) my_row[k] = checked_row(int64_t(indices[i]), rows[k], base[k], Dv[k], a.weights_numel, i, a.error);
      }
      const int n = len - k0 < kWarpSize ? int(len - k0) : kWarpSize;
#pragma unroll kUnroll
      for (int j = 0; j < n; ++j) {
#pragma unroll
        for (int k = 0; k < 2; ++k) {
          const int32_t r = __shfl_sync(kFullMask, my_row[k], j);
          if (r >= 0 && d < Dv[k]) {
            float x[4];
            load_weights4(table[k] + int64_t(r) * Dv[k] + d, x);
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[k][c] += x[c];
          }
        }
      }
    }
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      if (bagv[k] >= nbags) continue;
      const int64_t b = bagv[k] % a.B;
      const float scale = (a.pooling == kPoolMean && en[k] > st[k]) ? 1.0f / float(en[k] - st[k]) : 1.0f;
      float* o = a.out + b * a.total_D + ftv[k][kFeatOutOffset];
      if (d < Dv[k]) {
        float x[4];
#pragma unroll
        for (int c = 0; c < 4; ++c) x[c] = acc[k][c] * scale;
        store4(o + d, x);
      }
    }
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
  auto grid_full = [&](int64_t warps_of_work) { return int((warps_of_work + 7) / 8); };

  struct Variant {
    const char* name;
    std::function<void(float*)> run;
  };
  std::vector<Variant> variants = {
      {"shipped (grid capped 32/SM)",
       [&](float* o) { a.out = o; forward_kernel<float, int64_t, 1><<<grid_capped(nbags), 256>>>(a, w, dind, doff); }},
      {"shipped, one bag per warp (full grid)",
       [&](float* o) { a.out = o; forward_kernel<float, int64_t, 1><<<grid_full(nbags), 256>>>(a, w, dind, doff); }},
      {"lean unroll 8", [&](float* o) { a.out = o; lean_kernel<float, int64_t, false, 8, 1><<<grid_capped(nbags), 256>>>(a, w, dind, doff); }},
      {"lean unroll 4", [&](float* o) { a.out = o; lean_kernel<float, int64_t, false, 4, 1><<<grid_capped(nbags), 256>>>(a, w, dind, doff); }},
      {"lean unroll 8, full grid", [&](float* o) { a.out = o; lean_kernel<float, int64_t, false, 8, 1><<<grid_full(nbags), 256>>>(a, w, dind, doff); }},
      {"lean unroll 8, >=6 blocks/SM", [&](float* o) { a.out = o; lean_kernel<float, int64_t, false, 8, 6><<<grid_capped(nbags), 256>>>(a, w, dind, doff); }},
      {"lean unroll 4, 8 blocks/SM", [&](float* o) { a.out = o; lean_kernel<float, int64_t, false, 4, 8><<<grid_capped(nbags), 256>>>(a, w, dind, doff); }},
      {"lean weighted-path (scale 1) unroll 8", [&](float* o) { a.out = o; lean_kernel<float, int64_t, true, 8, 1><<<grid_capped(nbags), 256>>>(a, w, dind, doff); }},
      {"lean32 unroll 8", [&](float* o) { a.out = o; lean32_kernel<float, int64_t, 8><<<grid_capped(nbags), 256>>>(a, w, dind, doff); }},
      {"lean32 unroll 4", [&](float* o) { a.out = o; lean32_kernel<float, int64_t, 4><<<grid_capped(nbags), 256>>>(a, w, dind, doff); }},
      {"lean32 unroll 2", [&](float* o) { a.out = o; lean32_kernel<float, int64_t, 2><<<grid_capped(nbags), 256>>>(a, w, dind, doff); }},
      {"lean32 unroll 4, full grid", [&](float* o) { a.out = o; lean32_kernel<float, int64_t, 4><<<grid_full(nbags), 256>>>(a, w, dind, doff); }},
      {"pair unroll 4", [&](float* o) { a.out = o; pair_kernel<float, int64_t, 4><<<grid_capped((nbags + 1) / 2), 256>>>(a, w, dind, doff); }},
      {"pair unroll 2", [&](float* o) { a.out = o; pair_kernel<float, int64_t, 2><<<grid_capped((nbags + 1) / 2), 256>>>(a, w, dind, doff); }},
      {"pair unroll 4, full grid", [&](float* o) { a.out = o; pair_kernel<float, int64_t, 4><<<grid_full((nbags + 1) / 2), 256>>>(a, w, dind, doff); }},
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
  for (int cfg = 0; cfg < 2; ++cfg) {
    const bool zipf = cfg == 1;
    Batch bt = make_batch(zipf, T, E, B, L, 1234 + cfg);
    CK(cudaMemcpy(dind, bt.indices.data(), N * 8, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(doff, bt.offsets.data(), (nbags + 1) * 8, cudaMemcpyHostToDevice));
    std::printf("== %s (T=%d E=%lld D=%d B=%d L=%d fp32 int64 sum)\n", zipf ? "C2 Zipf" : "C1 uniform", T,
                (long long)E, D, B, L);
    variants[0].run(ref);
    CK(cudaDeviceSynchronize());
    for (auto& v : variants) {
      const bool weighted = std::strstr(v.name, "weighted") != nullptr;
      a.psw = weighted ? ones : nullptr;
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
        a.psw = nullptr;
        continue;
      }
      std::vector<float> ms;
      for (int r = 0; r < 25; ++r) {
        CK(cudaEventRecord(e0));
        v.run(out);
        CK(cudaEventRecord(e1));
        CK(cudaEventSynchronize(e1));
        float t;
        CK(cudaEventElapsedTime(&t, e0, e1));
        if (r >= 5) ms.push_back(t);
      }
      std::sort(ms.begin(), ms.end());
      std::printf("%-40s %8.1f us  %s\n", v.name, 1000.0 * ms[ms.size() / 2], same ? "bitwise equal" : "DIFFERS");
      a.psw = nullptr;
    }
    int64_t err[64];
    CK(cudaMemcpy(err, derr, sizeof(err), cudaMemcpyDeviceToHost));
    std::printf("error record: %lld %lld\n", (long long)err[0], (long long)err[3]);
  }
  return 0;
}
