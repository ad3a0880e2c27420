// The fused guarded AdamW kernel alone, on the GPU: its launch variants (groups of four elements
// in flight per thread; the device copy's passes) side by side with plain streaming kernels that
// move the same bytes with trivial arithmetic (the practical ceiling for this read/write mix),
// in one run. The streaming kernels also separate the access pattern: writing aside (another
// buffer, as the guarded update does) or in place (as XLA's fused optax update does), with
// evict-first or plain loads.
//
// usage: adamw_kernel_bench [parameters, default 268435456]
// Prints ms per step (median of 7 x 20, CUDA events) and effective TB/s over the bytes a
// parameter moves: fp32 28 (p, mu, nu read + written, g read); bf16 + master 26 (the master
// stored as the bf16 p and a 16-bit remainder: p, remainder, mu, nu read + written, bf16 g
// read); plus 12 with the device copy.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "scan/scan.h"
#include "update/adamw.h"

using namespace pimhbm;

#define CHECK(expr)                                                                               \
  do {                                                                                            \
    cudaError_t e_ = (expr);                                                                      \
    if (e_ != cudaSuccess) {                                                                      \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #expr, cudaGetErrorString(e_)); \
      std::exit(1);                                                                               \
    }                                                                                             \
  } while (0)

namespace {

constexpr int64_t kChunk = 16384;     // the update's default chunk
constexpr int64_t kCopyChunk = 4096;  // with the device copy

__global__ void fill(float* x, int64_t n, uint32_t seed, float scale, bool positive) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    const float u = (h >> 8) * (1.0f / 16777216.0f) - 0.5f;
    x[i] = positive ? scale * u * u : scale * u;
  }
}

// fp32 master weights into their stored form: the bf16 parameter and the remainder.
__global__ void to_split(const float* w, uint16_t* p, uint16_t* r, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const SplitMaster s = split_master(w[i]);
    p[i] = s.p, r[i] = s.r;
  }
}

__global__ void to_bf16(const float* x, uint16_t* y, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    y[i] = float_to_bf16(x[i]);
  }
}

template <bool kEvictFirst>
__device__ __forceinline__ float4 load(const float4* p) {
  if constexpr (kEvictFirst) return __ldcs(p);
  return *p;  // plain load: the destination may be this very buffer (no read-only path)
}

// Same traffic as the update, trivial arithmetic: fp32 p, mu, nu, g in; p, mu, nu out (and
// a copy of them when `copy` is set).
template <bool kEvictFirst>
__global__ void stream_fp32(const float4* p, const float4* mu, const float4* nu, const float4* g,
                            float4* po, float4* muo, float4* nuo, float4* pc, float4* muc,
                            float4* nuc, int64_t n4) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n4;
       i += int64_t{gridDim.x} * blockDim.x) {
    const float4 a = load<kEvictFirst>(p + i), m = load<kEvictFirst>(mu + i),
                 v = load<kEvictFirst>(nu + i), d = load<kEvictFirst>(g + i);
    const float4 a2 = make_float4(a.x + d.x, a.y + d.y, a.z + d.z, a.w + d.w);
    const float4 m2 = make_float4(m.x + d.x, m.y + d.y, m.z + d.z, m.w + d.w);
    const float4 v2 = make_float4(v.x + d.x, v.y + d.y, v.z + d.z, v.w + d.w);
    po[i] = a2, muo[i] = m2, nuo[i] = v2;
    if (pc != nullptr) pc[i] = a2, muc[i] = m2, nuc[i] = v2;
  }
}

// The same fp32 traffic in the shape of an elementwise loop fusion: no grid-stride loop, a
// grid that covers the tensor once, each thread kUnroll float4 of every tensor (kUnroll apart
// by the block's width, so a warp's loads stay contiguous), all loads before any store.
template <int kUnroll>
__global__ void flat_fp32(const float4* __restrict__ p, const float4* __restrict__ mu,
                          const float4* __restrict__ nu, const float4* __restrict__ g,
                          float4* __restrict__ po, float4* __restrict__ muo,
                          float4* __restrict__ nuo, int64_t n4) {
  const int64_t base = static_cast<int64_t>(blockIdx.x) * blockDim.x * kUnroll + threadIdx.x;
  float4 a[kUnroll], m[kUnroll], v[kUnroll], d[kUnroll];
#pragma unroll
  for (int k = 0; k < kUnroll; ++k) {
    const int64_t i = base + static_cast<int64_t>(k) * blockDim.x;
    if (i < n4) a[k] = p[i], m[k] = mu[i], v[k] = nu[i], d[k] = g[i];
  }
#pragma unroll
  for (int k = 0; k < kUnroll; ++k) {
    const int64_t i = base + static_cast<int64_t>(k) * blockDim.x;
    if (i < n4) {
      po[i] = make_float4(a[k].x + d[k].x, a[k].y + d[k].y, a[k].z + d[k].z, a[k].w + d[k].w);
      muo[i] = make_float4(m[k].x + d[k].x, m[k].y + d[k].y, m[k].z + d[k].z, m[k].w + d[k].w);
      nuo[i] = make_float4(v[k].x + d[k].x, v[k].y + d[k].y, v[k].z + d[k].z, v[k].w + d[k].w);
    }
  }
}

// bf16 + master: p and the master's remainder (bf16 / uint16), mu, nu (fp32) and g (bf16) in;
// p, remainder, mu, nu out.
__global__ void stream_master(const uint2* p, const uint2* r, const float4* mu, const float4* nu,
                              const uint2* g, uint2* po, uint2* ro, float4* muo, float4* nuo,
                              int64_t n4) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n4;
       i += int64_t{gridDim.x} * blockDim.x) {
    const float4 m = __ldcs(mu + i), v = __ldcs(nu + i);
    const uint2 a = __ldcs(p + i), b = __ldcs(r + i), d = __ldcs(g + i);
    const float s = __uint_as_float(d.x << 16);
    muo[i] = make_float4(m.x + s, m.y, m.z, m.w);
    nuo[i] = make_float4(v.x + s, v.y, v.z, v.w);
    po[i] = make_uint2(a.x ^ d.x, a.y);
    ro[i] = make_uint2(b.x ^ d.y, b.y);
  }
}

template <typename T>
T* alloc(int64_t count) {
  void* p = nullptr;
  CHECK(cudaMalloc(&p, std::max<int64_t>(count, 1) * sizeof(T)));
  return static_cast<T*>(p);
}

struct Side {  // one copy of the state
  void* p;
  uint16_t* master;  // the master weights' remainders
  float *mu, *nu;
  uint32_t *d_p, *d_master, *d_mu, *d_nu;
};

struct Case {
  bool bf16;
  int64_t n, chunk, nchunks;
  Side side[3];  // two slots and the device copy
  void* g;
  int32_t *faults, *bad;
  float* step;
};

void table(const void* x, int64_t n, int size, int64_t chunk, uint32_t* out) {
  const int64_t nc = (n + chunk - 1) / chunk;
  int32_t* nf = alloc<int32_t>(nc);
  float* mx = alloc<float>(nc);
  CHECK(scan::scan_cuda(x, n * size, Elem::kRaw, chunk * size, out, nf, mx, nullptr));
  CHECK(cudaDeviceSynchronize());
  CHECK(cudaFree(nf));
  CHECK(cudaFree(mx));
}

Case make_case(bool bf16, int64_t n, int64_t chunk) {
  Case c{bf16, n, chunk, (n + chunk - 1) / chunk, {}, nullptr, nullptr, nullptr, nullptr};
  float* tmp = alloc<float>(n);
  for (Side& s : c.side) {
    s.mu = alloc<float>(n);
    s.nu = alloc<float>(n);
    s.master = bf16 ? alloc<uint16_t>(n) : nullptr;
    s.p = bf16 ? static_cast<void*>(alloc<uint16_t>(n)) : static_cast<void*>(alloc<float>(n));
    s.d_p = alloc<uint32_t>(2 * c.nchunks);
    s.d_mu = alloc<uint32_t>(2 * c.nchunks);
    s.d_nu = alloc<uint32_t>(2 * c.nchunks);
    s.d_master = bf16 ? alloc<uint32_t>(2 * c.nchunks) : nullptr;
  }
  Side& a = c.side[0];
  fill<<<1024, 256>>>(a.mu, n, 1, 1e-3f, false);
  fill<<<1024, 256>>>(a.nu, n, 2, 1e-6f, true);
  if (bf16) {
    fill<<<1024, 256>>>(tmp, n, 3, 0.04f, false);
    to_split<<<1024, 256>>>(tmp, static_cast<uint16_t*>(a.p), a.master, n);
    fill<<<1024, 256>>>(tmp, n, 4, 1e-2f, false);
    c.g = alloc<uint16_t>(n);
    to_bf16<<<1024, 256>>>(tmp, static_cast<uint16_t*>(c.g), n);
  } else {
    fill<<<1024, 256>>>(static_cast<float*>(a.p), n, 3, 0.04f, false);
    c.g = alloc<float>(n);
    fill<<<1024, 256>>>(static_cast<float*>(c.g), n, 4, 1e-2f, false);
  }
  CHECK(cudaGetLastError());
  CHECK(cudaDeviceSynchronize());
  table(a.p, n, bf16 ? 2 : 4, chunk, a.d_p);
  table(a.mu, n, 4, chunk, a.d_mu);
  table(a.nu, n, 4, chunk, a.d_nu);
  if (bf16) table(a.master, n, 2, chunk, a.d_master);
  c.faults = alloc<int32_t>(c.nchunks);
  c.bad = alloc<int32_t>(c.nchunks);
  c.step = alloc<float>(3);
  const float step[3] = {1e-4f, 0.1f, 0.001f};
  CHECK(cudaMemcpy(c.step, step, sizeof(step), cudaMemcpyHostToDevice));
  CHECK(cudaFree(tmp));
  return c;
}

void free_case(Case& c) {
  for (Side& s : c.side) {
    for (void* p :
         {s.p, static_cast<void*>(s.master), static_cast<void*>(s.mu), static_cast<void*>(s.nu),
          static_cast<void*>(s.d_p), static_cast<void*>(s.d_master), static_cast<void*>(s.d_mu),
          static_cast<void*>(s.d_nu)}) {
      CHECK(cudaFree(p));
    }
  }
  for (void* p :
       {c.g, static_cast<void*>(c.faults), static_cast<void*>(c.bad), static_cast<void*>(c.step)}) {
    CHECK(cudaFree(p));
  }
}

// The update from slot `from` into the other one (and into the device copy, side 2).
update::AdamWLeaf leaf(const Case& c, int from, bool mirror) {
  const Side &r = c.side[from], &w = c.side[1 - from], &m = c.side[2];
  update::AdamWLeaf L;
  L.n = c.n, L.chunk_elems = c.chunk, L.param_bf16 = c.bf16, L.has_master = c.bf16;
  L.p = r.p, L.master = r.master, L.mu = r.mu, L.nu = r.nu, L.g = c.g;
  L.d_p = r.d_p, L.d_master = r.d_master, L.d_mu = r.d_mu, L.d_nu = r.d_nu;
  L.p_out = w.p, L.master_out = w.master, L.mu_out = w.mu, L.nu_out = w.nu;
  L.dn_p = w.d_p, L.dn_master = w.d_master, L.dn_mu = w.d_mu, L.dn_nu = w.d_nu;
  L.faults = c.faults, L.grad_nonfinite = c.bad;
  if (mirror) {
    L.has_mirror = true;
    L.p_mirror = m.p, L.master_mirror = m.master, L.mu_mirror = m.mu, L.nu_mirror = m.nu;
    L.dm_p = m.d_p, L.dm_master = m.d_master, L.dm_mu = m.d_mu, L.dm_nu = m.d_nu;
  }
  return L;
}

template <typename F>
float median_ms(F&& run) {
  for (int i = 0; i < 3; ++i) run(i);
  CHECK(cudaDeviceSynchronize());
  std::vector<float> samples;
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  for (int rep = 0; rep < 7; ++rep) {
    CHECK(cudaEventRecord(a));
    for (int i = 0; i < 20; ++i) run(i);
    CHECK(cudaEventRecord(b));
    CHECK(cudaEventSynchronize(b));
    float ms;
    CHECK(cudaEventElapsedTime(&ms, a, b));
    samples.push_back(ms / 20);
  }
  std::sort(samples.begin(), samples.end());
  return samples[samples.size() / 2];
}

void row(const char* kind, const std::string& what, float ms, double bytes_per_param, int64_t n,
         const char* note = "") {
  std::printf("%-12s %-46s %9.3f %9.2f%s\n", kind, what.c_str(), ms,
              bytes_per_param * n / (ms * 1e-3) / 1e12, note);
}

// The guarded kernel in one launch configuration, timed; false if a fault was reported (the
// state must keep verifying step after step).
bool time_update(const char* kind, const std::string& what, const Case& c, bool mirror,
                 update::AdamWLaunch launch, double bytes_per_param) {
  const AdamWHyper hyper{0.9f, 0.999f, 0.1f, 0.001f, 1e-8f, 0.0f, 1e-4f};
  const float ms = median_ms([&](int i) {
    CHECK(update::adamw_cuda(leaf(c, i % 2, mirror), hyper, c.step, nullptr, launch));
  });
  std::vector<int32_t> faults(c.nchunks);
  CHECK(cudaMemcpy(faults.data(), c.faults, c.nchunks * 4, cudaMemcpyDeviceToHost));
  const int64_t bad = std::count_if(faults.begin(), faults.end(), [](int32_t f) { return f; });
  row(kind, what, ms, bytes_per_param, c.n, bad ? "  FAULTS REPORTED" : "");
  return bad == 0;
}

// The loop-fusion shape, aside or in place: `threads` per block, `unroll` float4 per thread.
float time_flat(const Case& c, bool in_place, int threads, int unroll) {
  return median_ms([&](int i) {
    const Side &r = c.side[i % 2], &w = in_place ? r : c.side[1 - i % 2];
    auto f4 = [](const void* q) { return static_cast<const float4*>(q); };
    auto o4 = [](void* q) { return static_cast<float4*>(q); };
    const int64_t n4 = c.n / 4;
    const int blocks =
        static_cast<int>((n4 + int64_t{threads} * unroll - 1) / (int64_t{threads} * unroll));
    auto kernel = unroll == 1 ? flat_fp32<1> : unroll == 2 ? flat_fp32<2> : flat_fp32<4>;
    kernel<<<blocks, threads>>>(f4(r.p), f4(r.mu), f4(r.nu), f4(c.g), o4(w.p), o4(w.mu), o4(w.nu),
                                n4);
    CHECK(cudaGetLastError());
  });
}

// Plain fp32 streams: aside or in place, evict-first or plain loads, with or without a copy.
float time_stream(const Case& c, bool in_place, bool evict_first, bool copy) {
  return median_ms([&](int i) {
    const Side &r = c.side[i % 2], &w = in_place ? r : c.side[1 - i % 2], &m = c.side[2];
    auto f4 = [](const void* p) { return static_cast<const float4*>(p); };
    auto o4 = [](void* p) { return static_cast<float4*>(p); };
    auto kernel = evict_first ? stream_fp32<true> : stream_fp32<false>;
    kernel<<<132 * 8, 256>>>(f4(r.p), f4(r.mu), f4(r.nu), f4(c.g), o4(w.p), o4(w.mu), o4(w.nu),
                             copy ? o4(m.p) : nullptr, copy ? o4(m.mu) : nullptr,
                             copy ? o4(m.nu) : nullptr, c.n / 4);
    CHECK(cudaGetLastError());
  });
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t n = argc > 1 ? std::atoll(argv[1]) : 268435456;
  using update::AdamWLaunch;
  using update::MirrorPass;
  std::printf("%-12s %-46s %9s %9s\n", "state", "kernel", "ms", "eff. TB/s");
  for (bool bf16 : {false, true}) {
    const char* kind = bf16 ? "bf16+master" : "fp32";
    const double bytes = bf16 ? 26.0 : 28.0;  // what the update moves per parameter
    const double copy_bytes = 12.0;           // the device copy's writes per parameter
    Case c = make_case(bf16, n, kChunk);
    int base_blocks = 0;
    CHECK(update::adamw_blocks_per_sm(bf16, bf16, 0, &base_blocks));
    for (int in_flight : {1, 2}) {
      const std::string occupancy =
          in_flight == 1 ? " (" + std::to_string(base_blocks) + " blocks/SM)" : "";
      if (!time_update(
              kind,
              "guarded adamw, " + std::to_string(in_flight) + " group(s) in flight" + occupancy, c,
              false, AdamWLaunch{in_flight}, bytes)) {
        return 1;
      }
    }
    {  // v10: the default kernel with plain loads instead of evict-first ones
      AdamWLaunch plain;
      plain.plain_loads = true;
      if (!time_update(kind, "guarded adamw, plain loads", c, false, plain, bytes)) return 1;
    }
    {
      int blocks = 0;
      CHECK(update::adamw_blocks_per_sm(bf16, bf16, 0, &blocks, 4));
      if (!time_update(
              kind,
              "guarded adamw, compiled for 4 blocks/SM (" + std::to_string(blocks) + " resident)",
              c, false, AdamWLaunch{1, MirrorPass::kDefault, 0, 0, 4}, bytes)) {
        return 1;
      }
    }
    for (int ahead : {2, 4}) {
      if (!time_update(kind, "guarded adamw, L2 prefetch " + std::to_string(ahead) + " ahead", c,
                       false, AdamWLaunch{1, MirrorPass::kDefault, ahead}, bytes)) {
        return 1;
      }
    }
    for (int stages : {2, 3, 4}) {
      int blocks = 0;
      CHECK(update::adamw_blocks_per_sm(bf16, bf16, stages, &blocks));
      if (!time_update(kind,
                       "guarded adamw, " + std::to_string(stages) + " stages in smem (" +
                           std::to_string(blocks) + " blocks/SM)",
                       c, false, AdamWLaunch{1, MirrorPass::kDefault, 0, stages}, bytes)) {
        return 1;
      }
    }
    if (bf16) {
      const float ms = median_ms([&](int i) {
        const Side &r = c.side[i % 2], &w = c.side[1 - i % 2];
        stream_master<<<132 * 8, 256>>>(
            static_cast<const uint2*>(r.p), reinterpret_cast<const uint2*>(r.master),
            reinterpret_cast<const float4*>(r.mu), reinterpret_cast<const float4*>(r.nu),
            static_cast<const uint2*>(c.g), static_cast<uint2*>(w.p),
            reinterpret_cast<uint2*>(w.master), reinterpret_cast<float4*>(w.mu),
            reinterpret_cast<float4*>(w.nu), n / 4);
        CHECK(cudaGetLastError());
      });
      row(kind, "plain stream, same bytes (ceiling)", ms, bytes, n);
    } else {
      for (bool in_place : {false, true}) {
        for (bool evict_first : {true, false}) {
          const std::string what = std::string("plain stream, same bytes, ") +
                                   (in_place ? "in place" : "aside") +
                                   (evict_first ? ", evict-first" : ", plain loads");
          row(kind, what, time_stream(c, in_place, evict_first, false), 28.0, n);
        }
      }
      for (bool in_place : {false, true}) {
        for (auto [threads, unroll] : {std::pair{128, 1}, std::pair{256, 1}, std::pair{256, 2},
                                       std::pair{256, 4}, std::pair{512, 2}}) {
          const std::string what = "flat stream, " + std::to_string(threads) + " x " +
                                   std::to_string(unroll) + (in_place ? ", in place" : ", aside");
          row(kind, what, time_flat(c, in_place, threads, unroll), 28.0, n);
        }
      }
    }
    free_case(c);

    // The device copy kept current, in its chunks (4096 elements): each pass, and the update
    // without the copy in the same chunks for the difference.
    c = make_case(bf16, n, kCopyChunk);
    bool ok = time_update(kind, "guarded adamw, 4096-element chunks, no copy", c, false,
                          AdamWLaunch{1}, bytes);
    AdamWLaunch plain;
    plain.plain_loads = true;
    ok = ok && time_update(kind, "guarded adamw, 4096-element chunks, plain loads", c, false, plain,
                           bytes);
    const struct {
      MirrorPass pass;
      const char* name;
    } passes[] = {{MirrorPass::kRegisters, "registers (one read)"},
                  {MirrorPass::kTwoReads, "two reads, evict-first"},
                  {MirrorPass::kTwoReadsKeep, "two reads, first kept in L2"}};
    for (const auto& p : passes) {
      ok = ok && time_update(kind, std::string("+ device copy: ") + p.name, c, true,
                             AdamWLaunch{1, p.pass}, bytes + copy_bytes);
    }
    if (!ok) return 1;
    if (!bf16) {
      row(kind, "plain stream + copy, same bytes (ceiling)", time_stream(c, false, true, true),
          bytes + copy_bytes, n);
    }
    free_case(c);

    // Chunks of 1024 elements: one group of four per thread, no loop -- the shape of the
    // fastest plain stream (flat, above).
    c = make_case(bf16, n, 1024);
    ok = time_update(kind, "guarded adamw, 1024-element chunks, no copy", c, false, AdamWLaunch{1},
                     bytes);
    for (const auto& p : passes) {
      ok = ok && time_update(kind, std::string("+ device copy, 1024: ") + p.name, c, true,
                             AdamWLaunch{1, p.pass}, bytes + copy_bytes);
    }
    if (!ok) return 1;
    free_case(c);
  }
  return 0;
}
