// What the wgmma attention kernels share (attention_wgmma.cu, attention_wgmma_backward.cu): blocks
// of two warpgroups, tiles in shared memory as wgmma's core matrices (wgmma.cuh), filled by
// cp.async.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "attention/attention_device.cuh"
#include "wgmma.cuh"

namespace pimhbm::attention::hopper {

constexpr int kGroups = 2;  // warpgroups a block
constexpr int kThreads = 128 * kGroups;
constexpr int kQRows = 64 * kGroups;  // a block's query rows

// Rows [row0, row0 + ROWS) of the matrix at `base` (row stride `row_stride` elements, D wide)
// into `tile` as core matrices [D / 8][ROWS][8]; rows at or past `seq` are zero-filled. Eight
// threads in a row fill one core matrix (128 contiguous bytes: no bank conflict); a warp reads
// 64 contiguous bytes of each of 8 rows.
template <int D, int ROWS>
__device__ __forceinline__ void load_core_tile(uint16_t* tile, const uint16_t* base, int row0,
                                               int seq, int64_t row_stride) {
  constexpr int kPieces = D / 8;  // 16 bytes each
  static_assert(ROWS % 8 == 0 && (ROWS * kPieces) % kThreads == 0, "whole core matrices");
#pragma unroll
  for (int it = 0; it < ROWS * kPieces / kThreads; ++it) {
    const int i = threadIdx.x + it * kThreads;
    const int r = (i / (8 * kPieces)) * 8 + i % 8, c = (i / 8) % kPieces;
    const bool inside = row0 + r < seq;
    const uint16_t* src = inside ? base + (row0 + r) * row_stride + c * 8 : base;
    device::cp_async16(tile + (c * ROWS + r) * 8, src, inside);
  }
}

// Every thread's copies so far, seen by every thread and by the tensor cores.
__device__ __forceinline__ void publish_copies() {
  device::cp_async_wait<0>();
  wgmma::fence_shared_for_async();
  __syncthreads();
}

// cudaErrorNotSupported unless the current device is sm_90 (the wgmma kernels are sm_90a code).
inline cudaError_t check_sm90() {
  int device = 0, major = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) {
    err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  }
  if (err != cudaSuccess) return err;
  return major == 9 ? cudaSuccess : cudaErrorNotSupported;
}

}  // namespace pimhbm::attention::hopper
