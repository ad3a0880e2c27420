// What the wgmma attention kernels share (attention_wgmma.cu, attention_wgmma_backward.cu): blocks
// of two warpgroups, tiles in shared memory in one of two layouts (WgmmaLayout) for wgmma to
// read (wgmma.cuh), filled by cp.async.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "attention/attention_device.cuh"
#include "attention_wgmma.h"
#include "wgmma.cuh"

namespace pimhbm::attention::hopper {

constexpr int kGroups = 2;  // warpgroups a block
constexpr int kThreads = 128 * kGroups;
constexpr int kQRows = 64 * kGroups;  // a block's query rows

// Rows [row0, row0 + ROWS) of the matrix at `base` (row stride `row_stride` elements, D wide)
// into `tile` in layout L; rows at or past `seq` are zero-filled. Core matrices: eight threads
// in a row fill one core matrix (128 contiguous bytes: no bank conflict), a warp reads 64
// contiguous bytes of each of 8 rows. Swizzled: a warp reads two whole rows (256 contiguous
// bytes at head dim 128) and writes eight 128-byte rows of shared memory, each piece of a row
// to a bank group of its own.
template <WgmmaLayout L, int D, int ROWS>
__device__ __forceinline__ void load_tile(uint16_t* tile, const uint16_t* base, int row0, int seq,
                                          int64_t row_stride) {
  constexpr int kPieces = D / 8;  // 16 bytes each
  static_assert(ROWS % 8 == 0 && (ROWS * kPieces) % kThreads == 0, "whole core matrices");
#pragma unroll
  for (int it = 0; it < ROWS * kPieces / kThreads; ++it) {
    const int i = threadIdx.x + it * kThreads;
    int r, c, at;  // the piece's row and column piece, and its place in pieces
    if constexpr (L == WgmmaLayout::kCoreMatrices) {
      r = (i / (8 * kPieces)) * 8 + i % 8, c = (i / 8) % kPieces;
      at = c * ROWS + r;
    } else {
      r = i / kPieces, c = i % kPieces;
      at = (c / 8) * ROWS * 8 + r * 8 + ((c % 8) ^ (r % 8));
    }
    const bool inside = row0 + r < seq;
    const uint16_t* src = inside ? base + (row0 + r) * row_stride + c * 8 : base;
    device::cp_async16(tile + at * 8, src, inside);
  }
}

// The descriptor of a K-major operand: rows [row, row + 64 or N) of a tile of ROWS rows in
// layout L, columns [16 ks, 16 ks + 16).
template <WgmmaLayout L, int ROWS>
__device__ __forceinline__ uint64_t k_major(const uint16_t* tile, int row, int ks) {
  if constexpr (L == WgmmaLayout::kCoreMatrices) {
    return wgmma::descriptor(tile + (ks * 2 * ROWS + row) * 8, ROWS * 16, 128);
  } else {
    return wgmma::descriptor_swizzled(tile + (ks / 4) * ROWS * 64 + row * 64 + (ks % 4) * 16, 16,
                                      1024);
  }
}

// The descriptor of an MN-major operand: rows [16 ks, 16 ks + 16) of a tile of ROWS rows in
// layout L (its K), all its columns (its N).
template <WgmmaLayout L, int ROWS>
__device__ __forceinline__ uint64_t mn_major(const uint16_t* tile, int ks) {
  if constexpr (L == WgmmaLayout::kCoreMatrices) {
    return wgmma::descriptor(tile + ks * 16 * 8, 128, ROWS * 16);
  } else {
    return wgmma::descriptor_swizzled(tile + ks * 16 * 64, ROWS * 128, 1024);
  }
}

// Where a block's tiles start in dynamic shared memory: 1024-byte aligned for the swizzle (the
// launch asks for kSmemSlack bytes more), as declared otherwise.
template <WgmmaLayout L>
constexpr int kSmemSlack = L == WgmmaLayout::kSwizzled ? 1024 : 0;

template <WgmmaLayout L>
__device__ __forceinline__ uint16_t* tiles_base(uint16_t* smem) {
  if constexpr (L == WgmmaLayout::kCoreMatrices) return smem;
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
  int device = 0, major = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) {
    err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  }
  if (err != cudaSuccess) return err;
  return major == 9 ? cudaSuccess : cudaErrorNotSupported;
}

}  // namespace pimhbm::attention::hopper
