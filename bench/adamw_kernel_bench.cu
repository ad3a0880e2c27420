// The fused guarded AdamW kernel alone, on the GPU: the library's launch and the variants that
// lost to it (adamw_variants.cuh: groups of four elements in flight per thread, L2 prefetch, a
// shared-memory pipeline, the device copy's passes), each checked to give the library's bits,
// side by side with plain streaming kernels that move the same bytes with trivial arithmetic
// (the practical ceiling for this read/write mix), in one run. The streaming kernels also
// separate the access pattern: writing aside (another buffer, as the guarded update does) or in
// place (as XLA's fused optax update does), with evict-first or plain loads.
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

#include "adamw_variants.cuh"
#include "scan/scan.h"
#include "update/adamw.h"

using namespace pimhbm;
using bench::AdamWVariant;
using bench::CopyPass;

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
update::AdamWLeaf leaf(const Case& c, int from, bool with_copy) {
  const Side &r = c.side[from], &w = c.side[1 - from], &m = c.side[2];
  update::AdamWLeaf L;
  L.n = c.n, L.chunk_elems = c.chunk, L.param_bf16 = c.bf16, L.has_master = c.bf16;
  L.p = r.p, L.master = r.master, L.mu = r.mu, L.nu = r.nu, L.g = c.g;
  L.d_p = r.d_p, L.d_master = r.d_master, L.d_mu = r.d_mu, L.d_nu = r.d_nu;
  L.p_out = w.p, L.master_out = w.master, L.mu_out = w.mu, L.nu_out = w.nu;
  L.dn_p = w.d_p, L.dn_master = w.d_master, L.dn_mu = w.d_mu, L.dn_nu = w.d_nu;
  L.faults = c.faults, L.grad_nonfinite = c.bad;
  if (with_copy) {
    L.has_copy = true;
    L.p_copy = m.p, L.master_copy = m.master, L.mu_copy = m.mu, L.nu_copy = m.nu;
    L.dc_p = m.d_p, L.dc_master = m.d_master, L.dc_mu = m.d_mu, L.dc_nu = m.d_nu;
  }
  return L;
}

const AdamWHyper kHyper{0.9f, 0.999f, 0.1f, 0.001f, 1e-8f, 0.0f, 1e-4f};

// One update through the variant, or through the library's launch when `v` is null.
cudaError_t update_once(const update::AdamWLeaf& L, const Case& c, const AdamWVariant* v) {
  return v ? bench::adamw_variant(L, kHyper, c.step, nullptr, *v)
           : update::adamw_cuda(L, kHyper, c.step, nullptr);
}

__global__ void count_diff(const uint8_t* a, const uint8_t* b, int64_t n, unsigned long long* out) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    if (a[i] != b[i]) atomicAdd(out, 1ull);
  }
}

// The buffers an update writes: the write side's (slot 1, from slot 0), the reports, and the
// device copy's; as (pointer, bytes).
std::vector<std::pair<void*, int64_t>> written(const Case& c, bool with_copy) {
  const int64_t n = c.n, t = 8 * c.nchunks, ps = c.bf16 ? 2 : 4;
  std::vector<std::pair<void*, int64_t>> out{{c.faults, 4 * c.nchunks}, {c.bad, 4 * c.nchunks}};
  for (int s : {1, 2}) {
    if (s == 2 && !with_copy) break;
    const Side& w = c.side[s];
    out.insert(out.end(),
               {{w.p, ps * n}, {w.mu, 4 * n}, {w.nu, 4 * n}, {w.d_p, t}, {w.d_mu, t}, {w.d_nu, t}});
    if (c.bf16) out.insert(out.end(), {{w.master, 2 * n}, {w.d_master, t}});
  }
  return out;
}

// Whether the variant writes the library's bits (from slot 0, which always verifies: every
// update rewrites the slot it writes whole, digests included).
bool same_as_library(const Case& c, bool with_copy, const AdamWVariant& v) {
  const auto bufs = written(c, with_copy);
  std::vector<uint8_t*> ref;
  CHECK(update_once(leaf(c, 0, with_copy), c, nullptr));
  for (auto [p, bytes] : bufs) {
    ref.push_back(alloc<uint8_t>(bytes));
    CHECK(cudaMemcpy(ref.back(), p, bytes, cudaMemcpyDeviceToDevice));
  }
  CHECK(update_once(leaf(c, 0, with_copy), c, &v));
  auto* diff = alloc<unsigned long long>(1);
  CHECK(cudaMemset(diff, 0, sizeof(unsigned long long)));
  for (size_t k = 0; k < bufs.size(); ++k) {
    count_diff<<<1024, 256>>>(static_cast<const uint8_t*>(bufs[k].first), ref[k], bufs[k].second,
                              diff);
    CHECK(cudaGetLastError());
  }
  unsigned long long differ = 0;
  CHECK(cudaMemcpy(&differ, diff, sizeof(differ), cudaMemcpyDeviceToHost));
  for (uint8_t* p : ref) CHECK(cudaFree(p));
  CHECK(cudaFree(diff));
  return differ == 0;
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
  std::printf("%-12s %-56s %9.3f %9.2f%s\n", kind, what.c_str(), ms,
              bytes_per_param * n / (ms * 1e-3) / 1e12, note);
}

// The guarded kernel through a variant (or the library's launch when `v` is null), timed; false
// if a fault was reported (the state must keep verifying step after step) or a variant's bits
// differ from the library's.
bool time_update(const char* kind, const std::string& what, const Case& c, bool with_copy,
                 const AdamWVariant* v, double bytes_per_param) {
  const float ms = median_ms([&](int i) { CHECK(update_once(leaf(c, i % 2, with_copy), c, v)); });
  std::vector<int32_t> faults(c.nchunks);
  CHECK(cudaMemcpy(faults.data(), c.faults, c.nchunks * 4, cudaMemcpyDeviceToHost));
  const int64_t bad = std::count_if(faults.begin(), faults.end(), [](int32_t f) { return f; });
  const bool same = v == nullptr || same_as_library(c, with_copy, *v);
  row(kind, what, ms, bytes_per_param, c.n,
      bad    ? "  FAULTS REPORTED"
      : same ? ""
             : "  NOT THE LIBRARY'S BITS");
  return bad == 0 && same;
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

// What the update of one kind of state moves, and what the rows call it.
struct Kind {
  bool bf16;
  const char* name;
  double bytes;  // per parameter
};
constexpr double kCopyBytes = 12.0;  // the device copy's writes per parameter

std::string blocks_note(const Kind& k, const AdamWVariant& v) {
  int blocks = 0;
  CHECK(bench::variant_blocks_per_sm(k.bf16, k.bf16, v, &blocks));
  return " (" + std::to_string(blocks) + " blocks/SM)";
}

// The update without the device copy in the default chunks: the library's launch, then every
// variant.
bool bench_no_copy(const Kind& k, const Case& c) {
  bool ok = time_update(
      k.name, "guarded adamw, library (plain loads)" + blocks_note(k, bench::library_launch()), c,
      false, nullptr, k.bytes);
  std::vector<AdamWVariant> variants = {AdamWVariant{1}, AdamWVariant{2}};
  variants.push_back(AdamWVariant{1, CopyPass::kDefault, 0, 0, 4});
  for (int ahead : {2, 4}) variants.push_back(AdamWVariant{1, CopyPass::kDefault, ahead});
  for (int stages : {2, 3, 4}) variants.push_back(AdamWVariant{1, CopyPass::kDefault, 0, stages});
  for (const AdamWVariant& v : variants) {
    const bool occupancy = v.groups_in_flight == 1 && v.prefetch == 0;
    ok = ok && time_update(k.name,
                           "guarded adamw, " + bench::describe(v) +
                               (occupancy ? blocks_note(k, v) : std::string()),
                           c, false, &v, k.bytes);
  }
  return ok;
}

// Plain streams of the same bytes: the ceiling the update is measured against.
void bench_streams(const Kind& k, const Case& c) {
  if (k.bf16) {
    const float ms = median_ms([&](int i) {
      const Side &r = c.side[i % 2], &w = c.side[1 - i % 2];
      stream_master<<<132 * 8, 256>>>(
          static_cast<const uint2*>(r.p), reinterpret_cast<const uint2*>(r.master),
          reinterpret_cast<const float4*>(r.mu), reinterpret_cast<const float4*>(r.nu),
          static_cast<const uint2*>(c.g), static_cast<uint2*>(w.p),
          reinterpret_cast<uint2*>(w.master), reinterpret_cast<float4*>(w.mu),
          reinterpret_cast<float4*>(w.nu), c.n / 4);
      CHECK(cudaGetLastError());
    });
    row(k.name, "plain stream, same bytes (ceiling)", ms, k.bytes, c.n);
    return;
  }
  for (bool in_place : {false, true}) {
    for (bool evict_first : {true, false}) {
      const std::string what = std::string("plain stream, same bytes, ") +
                               (in_place ? "in place" : "aside") +
                               (evict_first ? ", evict-first" : ", plain loads");
      row(k.name, what, time_stream(c, in_place, evict_first, false), 28.0, c.n);
    }
  }
  for (bool in_place : {false, true}) {
    for (auto [threads, unroll] : {std::pair{128, 1}, std::pair{256, 1}, std::pair{256, 2},
                                   std::pair{256, 4}, std::pair{512, 2}}) {
      const std::string what = "flat stream, " + std::to_string(threads) + " x " +
                               std::to_string(unroll) + (in_place ? ", in place" : ", aside");
      row(k.name, what, time_flat(c, in_place, threads, unroll), 28.0, c.n);
    }
  }
}

// The device copy kept current, in chunks of `c`: the update without the copy in the same
// chunks for the difference (evict-first and the library's plain loads), then the library's
// copy pass and each pass of the variants.
bool bench_copy(const Kind& k, const Case& c) {
  const std::string chunks = std::to_string(c.chunk) + "-element chunks";
  const AdamWVariant evict_first{1};
  bool ok = time_update(k.name, "guarded adamw, " + chunks + ", no copy", c, false, &evict_first,
                        k.bytes);
  ok = ok && time_update(k.name, "guarded adamw, " + chunks + ", library (plain loads)", c, false,
                         nullptr, k.bytes);
  ok = ok && time_update(k.name, "+ device copy, " + chunks + ": library", c, true, nullptr,
                         k.bytes + kCopyBytes);
  for (CopyPass pass : {CopyPass::kRegisters, CopyPass::kTwoReads, CopyPass::kTwoReadsKeep}) {
    const AdamWVariant v{1, pass};
    ok = ok && time_update(k.name, "+ device copy, " + chunks + ": " + bench::describe(v), c, true,
                           &v, k.bytes + kCopyBytes);
  }
  if (ok && !k.bf16 && c.chunk == kCopyChunk) {
    row(k.name, "plain stream + copy, same bytes (ceiling)", time_stream(c, false, true, true),
        k.bytes + kCopyBytes, c.n);
  }
  return ok;
}

// Every row of one kind of state: the default chunks, the device copy's (4096 elements), and
// chunks of 1024 elements (one group of four per thread, no loop: the shape of the fastest
// plain stream, above).
bool bench_kind(const Kind& k, int64_t n) {
  Case c = make_case(k.bf16, n, kChunk);
  bool ok = bench_no_copy(k, c);
  if (ok) bench_streams(k, c);
  free_case(c);
  for (int64_t chunk : {kCopyChunk, int64_t{1024}}) {
    if (!ok) break;
    c = make_case(k.bf16, n, chunk);
    ok = bench_copy(k, c);
    free_case(c);
  }
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t n = argc > 1 ? std::atoll(argv[1]) : 268435456;
  std::printf("%-12s %-56s %9s %9s\n", "state", "kernel", "ms", "eff. TB/s");
  for (const Kind& k : {Kind{false, "fp32", 28.0}, Kind{true, "bf16+master", 26.0}}) {
    if (!bench_kind(k, n)) return 1;
  }
  return 0;
}
