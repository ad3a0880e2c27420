// What the wgmma attention kernels share (attention_wgmma_fwd.cu, attention_wgmma_bwd.cu): blocks
// of two warpgroups, tiles in shared memory in wgmma's 128-byte swizzle (wgmma.cuh), filled by
// cp.async.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "attention/attention_device.cuh"
#include "attention/wgmma.cuh"

namespace pimhbm::attention::hopper {

constexpr int kGroups = 2;  // warpgroups a block
constexpr int kThreads = 128 * kGroups;
constexpr int kQRows = 64 * kGroups;  // a block's query rows

// Tiles sit in shared memory as rows of 128 bytes, [D / 64][rows][64], the 16-byte pieces of
// each row permuted by the row's place in its group of 8 (piece c at c ^ (row % 8)): the
// 128-byte swizzle of TMA and CUTLASS, which the products read in whole rows. Each group of 8
// rows (1024 bytes) is 1024-byte aligned.

// Rows [row0, row0 + ROWS) of the matrix at `base` (row stride `row_stride` elements, D wide)
// into `tile`; rows at or past `seq` are zero-filled. A warp reads whole rows (two 256-byte rows
// at head dim 128) and writes whole 128-byte rows of shared memory, each piece of a row to a
// bank group of its own.
template <int D, int ROWS>
__device__ __forceinline__ void load_tile(uint16_t* tile, const uint16_t* base, int row0, int seq,
                                          int64_t row_stride) {
  constexpr int kPieces = D / 8;  // 16 bytes each
  static_assert(ROWS % 8 == 0 && (ROWS * kPieces) % kThreads == 0, "whole groups of 8 rows");
#pragma unroll
  for (int it = 0; it < ROWS * kPieces / kThreads; ++it) {
    const int i = threadIdx.x + it * kThreads;
    const int r = i / kPieces, c = i % kPieces;
    const bool inside = row0 + r < seq;
    const uint16_t* src = inside ? base + (row0 + r) * row_stride + c * 8 : base;
    device::cp_async16(tile + ((c / 8) * ROWS * 8 + r * 8 + ((c % 8) ^ (r % 8))) * 8, src, inside);
  }
}

// The descriptor of a K-major operand: rows [row, row + 64 or N) of a tile of ROWS rows,
// columns [16 ks, 16 ks + 16).
template <int ROWS>
__device__ __forceinline__ uint64_t k_major(const uint16_t* tile, int row, int ks) {
  return wgmma::descriptor_swizzled(tile + (ks / 4) * ROWS * 64 + row * 64 + (ks % 4) * 16, 16,
                                    1024);
}

// The descriptor of an MN-major operand: rows [16 ks, 16 ks + 16) of a tile of ROWS rows (its
// K), all its columns (its N).
template <int ROWS>
__device__ __forceinline__ uint64_t mn_major(const uint16_t* tile, int ks) {
  return wgmma::descriptor_swizzled(tile + ks * 16 * 64, ROWS * 128, 1024);
}

// Where a block's tiles start in dynamic shared memory: the first 1024-byte boundary (every
// kernel's shared-memory size counts kSmemSlack bytes for it).
constexpr int kSmemSlack = 1024;

__device__ __forceinline__ uint16_t* tiles_base(uint16_t* smem) {
  const unsigned at = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  return smem + ((1024 - at % 1024) % 1024) / 2;
}

// Every thread's copies so far, seen by every thread and by the tensor cores.
__device__ __forceinline__ void publish_copies() {
  device::cp_async_wait<0>();
  wgmma::fence_shared_for_async();
  __syncthreads();
}

// cudaErrorNotSupported unless the current device is sm_90 (the wgmma kernels are sm_90a code).
inline cudaError_t check_sm90() {
  int device = 0, major = 0, minor = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) {
    err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  }
  if (err == cudaSuccess) {
    err = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
  }
  if (err != cudaSuccess) return err;
  return major == 9 && minor == 0 ? cudaSuccess : cudaErrorNotSupported;
}

}  // namespace pimhbm::attention::hopper
