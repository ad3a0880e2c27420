// Hopper's warpgroup products (wgmma) on the layouts the attention kernels would give them,
// checked exactly against a CPU product: the groundwork for attention on wgmma (bench/NOTES.md,
// "What is left to 1.10x"). Not used by the library yet.
//
// One warpgroup (128 threads) computes D (64 x 64, fp32) = A (64 x 64) * B (64 x 64) in four
// k-steps of m64n64k16, bf16 operands holding small integers so that every sum is exact:
//   - S = Q K^T's shape: A and B both K-major in shared memory, no swizzle, as core matrices
//     (8 rows x 16 bytes, 128 contiguous bytes each) laid out [k / 8][row][8];
//   - O = P V's shape: A from registers (mma.sync's A fragments, a warp's 16 rows each), B = V
//     stored [key][column] row-major, i.e. MN-major, read transposed, laid out
//     [column / 8][key][8].
// A descriptor carries two strides between core matrices -- the leading (LBO) and the stride
// (SBO) byte offsets -- whose roles the PTX manual defines per major-ness; each test runs the
// assignment this file believes and, when that fails, says whether the swapped one would pass.
// Built for sm_90a alone (wgmma is architecture-specific); skipped without an sm_90 GPU.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cuda_test_util.h"

namespace {

using pimhbm::testing::DeviceBuffer;

constexpr int kN = 64;  // M = N = K = 64: four k-steps of 16

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define PIMHBM_WGMMA 1
#endif

__device__ __forceinline__ uint64_t descriptor(const void* smem, int lbo, int sbo) {
  const uint64_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  return ((addr >> 4) & 0x3FFF) | (static_cast<uint64_t>((lbo >> 4) & 0x3FFF) << 16) |
         (static_cast<uint64_t>((sbo >> 4) & 0x3FFF) << 32);  // swizzle 0 (bits 62-63)
}

// The m64n64k16 accumulator: d[4 n + e] is row 16 warp + lane / 4 + 8 (e / 2), column
// 8 n + 2 (lane % 4) + e % 2.
struct Acc {
  float d[32];
};

#define PIMHBM_D32                                                                         \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, " \
  "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define PIMHBM_D32_OUT(x)                                                                         \
  "+f"(x[0]), "+f"(x[1]), "+f"(x[2]), "+f"(x[3]), "+f"(x[4]), "+f"(x[5]), "+f"(x[6]), "+f"(x[7]), \
      "+f"(x[8]), "+f"(x[9]), "+f"(x[10]), "+f"(x[11]), "+f"(x[12]), "+f"(x[13]), "+f"(x[14]),    \
      "+f"(x[15]), "+f"(x[16]), "+f"(x[17]), "+f"(x[18]), "+f"(x[19]), "+f"(x[20]), "+f"(x[21]),  \
      "+f"(x[22]), "+f"(x[23]), "+f"(x[24]), "+f"(x[25]), "+f"(x[26]), "+f"(x[27]), "+f"(x[28]),  \
      "+f"(x[29]), "+f"(x[30]), "+f"(x[31])

// d (+)= A B, A and B from shared memory, both K-major.
__device__ __forceinline__ void wgmma_ss(Acc& acc, uint64_t a, uint64_t b, int accumulate) {
#if defined(PIMHBM_WGMMA)
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " PIMHBM_D32
      ", %32, %33, p, 1, 1, 0, 0;\n}\n"
      : PIMHBM_D32_OUT(acc.d)
      : "l"(a), "l"(b), "r"(accumulate));
#endif
}

// d (+)= A B, A from registers (a warp's mma.sync A fragment), B from shared memory,
// MN-major (transposed on the way in).
__device__ __forceinline__ void wgmma_rs(Acc& acc, const uint32_t (&a)[4], uint64_t b,
                                         int accumulate) {
#if defined(PIMHBM_WGMMA)
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " PIMHBM_D32
      ", {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
      : PIMHBM_D32_OUT(acc.d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));
#endif
}

__device__ __forceinline__ void wgmma_begin() {
#if defined(PIMHBM_WGMMA)
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void wgmma_end() {
#if defined(PIMHBM_WGMMA)
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
#endif
}

// Shared-memory writes become visible to the tensor cores' (async proxy) reads.
__device__ __forceinline__ void publish_smem() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();
}

__device__ void store(const Acc& acc, float* d) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int i = 0; i < 32; ++i) {
    const int n = i / 4, e = i % 4;
    d[(16 * warp + lane / 4 + 8 * (e / 2)) * kN + 8 * n + 2 * (lane % 4) + e % 2] = acc.d[i];
  }
}

// Element (r, c) of a row-major [64][64] matrix at its place in [c / 8][r][8].
__device__ __forceinline__ int core_major(int r, int c) { return ((c / 8) * kN + r) * 8 + c % 8; }

// S's shape: d = a b^T, a and b row-major [64][64] (b's rows are B's columns: K-major).
__global__ void k_major_kernel(const uint16_t* a, const uint16_t* b, float* d, int lbo, int sbo) {
  __shared__ __align__(128) uint16_t sa[kN * kN], sb[kN * kN];
  for (int i = threadIdx.x; i < kN * kN; i += blockDim.x) {
    sa[core_major(i / kN, i % kN)] = a[i];
    sb[core_major(i / kN, i % kN)] = b[i];
  }
  publish_smem();
  Acc acc{};
  wgmma_begin();
  for (int ks = 0; ks < kN / 16; ++ks) {  // 16 k = two chunks of 8: 2 x 64 rows x 16 bytes
    wgmma_ss(acc, descriptor(sa + ks * 2 * kN * 8, lbo, sbo),
             descriptor(sb + ks * 2 * kN * 8, lbo, sbo), ks > 0);
  }
  wgmma_end();
  store(acc, d);
}

// O's shape: d = a v, a row-major [64][64] as register fragments, v row-major [key][column].
__global__ void mn_major_kernel(const uint16_t* a, const uint16_t* v, float* d, int lbo, int sbo) {
  __shared__ __align__(128) uint16_t sv[kN * kN];
  for (int i = threadIdx.x; i < kN * kN; i += blockDim.x) {
    sv[core_major(i / kN, i % kN)] = v[i];  // [column / 8][key][8]
  }
  publish_smem();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row = 16 * warp + lane / 4, col = 2 * (lane % 4);
  auto pair = [&](int r, int c) {
    return static_cast<uint32_t>(a[r * kN + c]) | static_cast<uint32_t>(a[r * kN + c + 1]) << 16;
  };
  Acc acc{};
  wgmma_begin();
  for (int ks = 0; ks < kN / 16; ++ks) {  // 16 keys: two core matrices along K, 128 bytes apart
    const int k = 16 * ks + col;
    const uint32_t frag[4] = {pair(row, k), pair(row + 8, k), pair(row, k + 8),
                              pair(row + 8, k + 8)};
    wgmma_rs(acc, frag, descriptor(sv + ks * 16 * 8, lbo, sbo), ks > 0);
  }
  wgmma_end();
  store(acc, d);
}

uint16_t small_bf16(int value) {  // integers up to 2^8 are exact in bf16
  const float f = static_cast<float>(value);
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  return static_cast<uint16_t>(bits >> 16);
}

struct Inputs {
  std::vector<int> a, b;  // row-major [64][64]
  std::vector<uint16_t> a16, b16;
};

Inputs random_inputs() {
  std::mt19937 gen(std::random_device{}());
  std::uniform_int_distribution<int> pick(-4, 4);
  Inputs in;
  for (int i = 0; i < kN * kN; ++i) {
    in.a.push_back(pick(gen));
    in.b.push_back(pick(gen));
    in.a16.push_back(small_bf16(in.a.back()));
    in.b16.push_back(small_bf16(in.b.back()));
  }
  return in;
}

using Kernel = void (*)(const uint16_t*, const uint16_t*, float*, int, int);

// How many of the 64 x 64 results differ from `want` with these strides (-1: a CUDA error).
int mismatches(Kernel kernel, const Inputs& in, const std::vector<float>& want, int lbo, int sbo,
               std::string* err) {
  DeviceBuffer<uint16_t> a(kN * kN), b(kN * kN);
  DeviceBuffer<float> d(kN * kN);
  cudaError_t e = a.upload(in.a16);
  if (e == cudaSuccess) e = b.upload(in.b16);
  if (e == cudaSuccess) e = d.poison();
  if (e == cudaSuccess) {
    kernel<<<1, 128>>>(a.get(), b.get(), d.get(), lbo, sbo);
    e = cudaGetLastError();
  }
  if (e == cudaSuccess) e = cudaDeviceSynchronize();
  std::vector<float> got;
  if (e == cudaSuccess) got = d.download(&e);
  if (e != cudaSuccess) {
    *err = cudaGetErrorString(e);
    return -1;
  }
  int bad = 0;
  for (int i = 0; i < kN * kN; ++i) bad += got[i] != want[i];
  return bad;
}

void expect_exact(Kernel kernel, const Inputs& in, const std::vector<float>& want, int lbo,
                  int sbo) {
  std::string err;
  const int bad = mismatches(kernel, in, want, lbo, sbo, &err);
  ASSERT_GE(bad, 0) << err;
  if (bad == 0) return;
  const int swapped = mismatches(kernel, in, want, sbo, lbo, &err);
  ADD_FAILURE() << bad << " of 4096 results differ with LBO " << lbo << ", SBO " << sbo
                << "; with the two swapped: " << swapped;
}

bool has_sm90() {
  int count = 0, major = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    cudaGetLastError();  // no device: not an error of a later call
    return false;
  }
  return cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0) == cudaSuccess &&
         major == 9;
}

TEST(Wgmma, KMajorOperandsFromSharedMemory) {
  if (!has_sm90()) GTEST_SKIP() << "needs an sm_90 GPU";
  const Inputs in = random_inputs();
  std::vector<float> want(kN * kN, 0.0f);  // a b^T
  for (int m = 0; m < kN; ++m)
    for (int n = 0; n < kN; ++n)
      for (int k = 0; k < kN; ++k) want[m * kN + n] += in.a[m * kN + k] * in.b[n * kN + k];
  // Core matrices next along K (8 columns on) are 64 rows x 16 bytes on; along M or N, 128.
  expect_exact(k_major_kernel, in, want, /*lbo=*/kN * 16, /*sbo=*/128);
}

TEST(Wgmma, RegisterAAndTransposedBFromSharedMemory) {
  if (!has_sm90()) GTEST_SKIP() << "needs an sm_90 GPU";
  const Inputs in = random_inputs();
  std::vector<float> want(kN * kN, 0.0f);  // a v
  for (int m = 0; m < kN; ++m)
    for (int n = 0; n < kN; ++n)
      for (int k = 0; k < kN; ++k) want[m * kN + n] += in.a[m * kN + k] * in.b[k * kN + n];
  // V laid out [column / 8][key][8]: core matrices next along N are 64 keys x 16 bytes on,
  // along K (8 keys on) 128. An MN-major operand takes them the other way round from a
  // K-major one: LBO the step along K, SBO the step along N (measured on the H200: the
  // K-major assignment gets 4073 of 4096 results wrong).
  expect_exact(mn_major_kernel, in, want, /*lbo=*/128, /*sbo=*/kN * 16);
}

}  // namespace
