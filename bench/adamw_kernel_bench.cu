// The fused guarded AdamW kernel alone, on the GPU: its launch variants (groups of four elements
// in flight per thread) side by side with a plain streaming kernel that moves the same bytes
// with trivial arithmetic (the practical ceiling for this read/write mix), in one run.
//
// usage: adamw_kernel_bench [parameters, default 268435456]
// Prints ms per step (median of 7 x 20, CUDA events) and effective TB/s over 28 bytes per
// parameter (fp32: p, mu, nu read + written, g read; bf16 + master: master, mu, nu read +
// written, bf16 g read, bf16 p written).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "scan/scan.h"
#include "update/adamw.h"

using namespace pimhbm;

#define CHECK(expr)                                                                   \
  do {                                                                                \
    cudaError_t e_ = (expr);                                                          \
    if (e_ != cudaSuccess) {                                                          \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #expr,             \
                   cudaGetErrorString(e_));                                           \
      std::exit(1);                                                                   \
    }                                                                                 \
  } while (0)

namespace {

constexpr int64_t kChunk = 16384;

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

__global__ void to_bf16(const float* x, uint16_t* y, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    y[i] = float_to_bf16(x[i]);
  }
}

// Same traffic as the update, trivial arithmetic: fp32 p, mu, nu, g in; p, mu, nu out.
__global__ void stream_fp32(const float4* p, const float4* mu, const float4* nu, const float4* g,
                            float4* po, float4* muo, float4* nuo, int64_t n4) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n4;
       i += int64_t{gridDim.x} * blockDim.x) {
    const float4 a = __ldcs(p + i), m = __ldcs(mu + i), v = __ldcs(nu + i), d = __ldcs(g + i);
    po[i] = make_float4(a.x + d.x, a.y + d.y, a.z + d.z, a.w + d.w);
    muo[i] = make_float4(m.x + d.x, m.y + d.y, m.z + d.z, m.w + d.w);
    nuo[i] = make_float4(v.x + d.x, v.y + d.y, v.z + d.z, v.w + d.w);
  }
}

// bf16 + master: master, mu, nu (fp32) and g (bf16) in; master, mu, nu, p (bf16) out.
__global__ void stream_master(const float4* w, const float4* mu, const float4* nu, const uint2* g,
                              float4* wo, float4* muo, float4* nuo, uint2* po, int64_t n4) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n4;
       i += int64_t{gridDim.x} * blockDim.x) {
    const float4 a = __ldcs(w + i), m = __ldcs(mu + i), v = __ldcs(nu + i);
    const uint2 d = __ldcs(g + i);
    const float s = __uint_as_float(d.x << 16);
    wo[i] = make_float4(a.x + s, a.y + s, a.z + s, a.w + s);
    muo[i] = make_float4(m.x + s, m.y, m.z, m.w);
    nuo[i] = make_float4(v.x + s, v.y, v.z, v.w);
    po[i] = make_uint2(d.x ^ d.y, d.y);
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
  float *master, *mu, *nu;
  uint32_t *d_p, *d_master, *d_mu, *d_nu;
};

struct Case {
  bool bf16;
  int64_t n, nchunks;
  Side side[2];
  void* g;
  int32_t *faults, *bad;
  float* step;
};

void table(const void* x, int64_t n, int size, uint32_t* out) {
  const int64_t nc = (n + kChunk - 1) / kChunk;
  int32_t* nf = alloc<int32_t>(nc);
  float* mx = alloc<float>(nc);
  CHECK(scan::scan_cuda(x, n * size, Elem::kRaw, kChunk * size, out, nf, mx, nullptr));
  CHECK(cudaDeviceSynchronize());
  CHECK(cudaFree(nf));
  CHECK(cudaFree(mx));
}

Case make_case(bool bf16, int64_t n) {
  Case c{bf16, n, (n + kChunk - 1) / kChunk, {}, nullptr, nullptr, nullptr, nullptr};
  float* tmp = alloc<float>(n);
  for (Side& s : c.side) {
    s.mu = alloc<float>(n);
    s.nu = alloc<float>(n);
    s.master = bf16 ? alloc<float>(n) : nullptr;
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
    fill<<<1024, 256>>>(a.master, n, 3, 0.04f, false);
    to_bf16<<<1024, 256>>>(a.master, static_cast<uint16_t*>(a.p), n);
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
  table(a.p, n, bf16 ? 2 : 4, a.d_p);
  table(a.mu, n, 4, a.d_mu);
  table(a.nu, n, 4, a.d_nu);
  if (bf16) table(a.master, n, 4, a.d_master);
  c.faults = alloc<int32_t>(c.nchunks);
  c.bad = alloc<int32_t>(c.nchunks);
  c.step = alloc<float>(3);
  const float step[3] = {1e-4f, 0.1f, 0.001f};
  CHECK(cudaMemcpy(c.step, step, sizeof(step), cudaMemcpyHostToDevice));
  CHECK(cudaFree(tmp));
  return c;
}

update::AdamWLeaf leaf(const Case& c, int from) {
  const Side &r = c.side[from], &w = c.side[1 - from];
  update::AdamWLeaf L;
  L.n = c.n, L.chunk_elems = kChunk, L.param_bf16 = c.bf16, L.has_master = c.bf16;
  L.p = r.p, L.master = r.master, L.mu = r.mu, L.nu = r.nu, L.g = c.g;
  L.d_p = r.d_p, L.d_master = r.d_master, L.d_mu = r.d_mu, L.d_nu = r.d_nu;
  L.p_out = w.p, L.master_out = w.master, L.mu_out = w.mu, L.nu_out = w.nu;
  L.dn_p = w.d_p, L.dn_master = w.d_master, L.dn_mu = w.d_mu, L.dn_nu = w.d_nu;
  L.faults = c.faults, L.grad_nonfinite = c.bad;
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

}  // namespace

int main(int argc, char** argv) {
  const int64_t n = argc > 1 ? std::atoll(argv[1]) : 268435456;
  const AdamWHyper hyper{0.9f, 0.999f, 0.1f, 0.001f, 1e-8f, 0.0f, 1e-4f};
  std::printf("%-14s %-34s %10s %14s\n", "state", "kernel", "ms", "effective TB/s");
  for (bool bf16 : {false, true}) {
    Case c = make_case(bf16, n);
    const char* kind = bf16 ? "bf16+master" : "fp32";
    for (int in_flight : {1, 2}) {
      const float ms = median_ms([&](int i) {
        CHECK(update::adamw_cuda(leaf(c, i % 2), hyper, c.step, nullptr, {in_flight}));
      });
      // The state must still verify: no fault was reported by the last step.
      std::vector<int32_t> faults(c.nchunks);
      CHECK(cudaMemcpy(faults.data(), c.faults, c.nchunks * 4, cudaMemcpyDeviceToHost));
      const int64_t bad = std::count_if(faults.begin(), faults.end(), [](int32_t f) { return f; });
      std::printf("%-14s %-34s %10.3f %14.2f%s\n", kind,
                  ("guarded adamw, " + std::to_string(in_flight) + " group(s) in flight").c_str(),
                  ms, 28.0 * n / (ms * 1e-3) / 1e12, bad ? "  FAULTS REPORTED" : "");
      if (bad) return 1;
    }
    const float ms = median_ms([&](int i) {
      const Side &r = c.side[i % 2], &w = c.side[1 - i % 2];
      if (bf16) {
        stream_master<<<132 * 8, 256>>>(reinterpret_cast<const float4*>(r.master),
                                        reinterpret_cast<const float4*>(r.mu),
                                        reinterpret_cast<const float4*>(r.nu),
                                        static_cast<const uint2*>(c.g),
                                        reinterpret_cast<float4*>(w.master),
                                        reinterpret_cast<float4*>(w.mu),
                                        reinterpret_cast<float4*>(w.nu),
                                        static_cast<uint2*>(w.p), n / 4);
      } else {
        stream_fp32<<<132 * 8, 256>>>(static_cast<const float4*>(r.p),
                                      reinterpret_cast<const float4*>(r.mu),
                                      reinterpret_cast<const float4*>(r.nu),
                                      static_cast<const float4*>(c.g), static_cast<float4*>(w.p),
                                      reinterpret_cast<float4*>(w.mu),
                                      reinterpret_cast<float4*>(w.nu), n / 4);
      }
      CHECK(cudaGetLastError());
    });
    std::printf("%-14s %-34s %10.3f %14.2f\n", kind, "plain stream, same bytes (ceiling)", ms,
                28.0 * n / (ms * 1e-3) / 1e12);
  }
  return 0;
}
