// Hopper's warpgroup products (wgmma.cuh's wrappers) on the operand shapes of attention, checked
// exactly against a CPU product, with tiles as unswizzled core matrices: the groundwork that
// fixed the descriptors' strides (bench/NOTES.md, "wgmma groundwork"). The attention kernels
// keep their tiles in the 128-byte swizzle; attention_wgmma_test checks those.
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

#include "attention/wgmma.cuh"
#include "cuda_test_util.h"

namespace {

namespace wgmma = pimhbm::wgmma;
using pimhbm::testing::DeviceBuffer;

constexpr int kN = 64;  // M = N = K = 64: four k-steps of 16

using Acc = float[kN / 8][4];  // the m64n64 accumulator (wgmma.cuh)

// Shared-memory writes become visible to the tensor cores' reads, for every thread.
__device__ __forceinline__ void publish_smem() {
  wgmma::fence_shared_for_async();
  __syncthreads();
}

__device__ void store(const Acc& acc, float* d) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int n = 0; n < kN / 8; ++n) {
    for (int e = 0; e < 4; ++e) {
      d[(16 * warp + lane / 4 + 8 * (e / 2)) * kN + 8 * n + 2 * (lane % 4) + e % 2] = acc[n][e];
    }
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
  Acc acc = {};
  wgmma::begin();
  for (int ks = 0; ks < kN / 16; ++ks) {  // 16 k = two chunks of 8: 2 x 64 rows x 16 bytes
    wgmma::mma_ss<kN>(acc, wgmma::descriptor(sa + ks * 2 * kN * 8, lbo, sbo),
                      wgmma::descriptor(sb + ks * 2 * kN * 8, lbo, sbo), ks > 0);
  }
  wgmma::commit();
  wgmma::wait<0>();
  wgmma::fence_operand<kN>(acc);
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
  Acc acc = {};
  wgmma::begin();
  for (int ks = 0; ks < kN / 16; ++ks) {  // 16 keys: two core matrices along K, 128 bytes apart
    const int k = 16 * ks + col;
    const uint32_t frag[4] = {pair(row, k), pair(row + 8, k), pair(row, k + 8),
                              pair(row + 8, k + 8)};
    wgmma::mma_rs<kN>(acc, frag, wgmma::descriptor(sv + ks * 16 * 8, lbo, sbo), ks > 0);
  }
  wgmma::commit();
  wgmma::wait<0>();
  wgmma::fence_operand<kN>(acc);
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

TEST(Wgmma, KMajorOperandsFromSharedMemory) {
  PIMHBM_SKIP_WITHOUT_SM90();
  const Inputs in = random_inputs();
  std::vector<float> want(kN * kN, 0.0f);  // a b^T
  for (int m = 0; m < kN; ++m)
    for (int n = 0; n < kN; ++n)
      for (int k = 0; k < kN; ++k) want[m * kN + n] += in.a[m * kN + k] * in.b[n * kN + k];
  // Core matrices next along K (8 columns on) are 64 rows x 16 bytes on; along M or N, 128.
  expect_exact(k_major_kernel, in, want, /*lbo=*/kN * 16, /*sbo=*/128);
}

TEST(Wgmma, RegisterAAndTransposedBFromSharedMemory) {
  PIMHBM_SKIP_WITHOUT_SM90();
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
