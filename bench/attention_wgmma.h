// pimhbm.attention on Hopper's warpgroup products: candidates beside the library's mma.sync
// kernels (csrc/attention), checked against the CPU reference by attention_wgmma_test and timed
// against the library's kernels by attention_wgmma_bench. They keep forward_cuda's and
// backward_cuda's contracts (attention.h): the same layouts and outputs, every sum in a fixed
// order, two calls bitwise equal. They move into the library once they win there.
#pragma once

#include <cuda_runtime_api.h>

#include "attention/attention.h"

namespace pimhbm::attention {

// The head dims the candidate is built for.
inline bool wgmma_head_dim(int64_t d) { return d == 64 || d == 128; }

// Whether the wgmma kernels take a call of head dim `d` on the current device (an sm_90 device
// and a head dim they are built for), in *takes; the error of asking the device, if any.
cudaError_t wgmma_takes(int64_t d, bool* takes);

// Variants of the key loop, measured side by side.
enum class WgmmaSchedule {
  // Each warpgroup in turn: S = Q K^T, its softmax, O += P V, waiting for each product.
  kSerial,
  // The next tile's S = Q K^T is issued before this tile's O += P V and runs while the softmax
  // waits for nothing (FlashAttention-3's overlap within a warpgroup).
  kScoresAhead,
};

// How the tiles sit in shared memory for the products to read them, measured side by side.
enum class WgmmaLayout {
  // wgmma's core matrices (8 rows x 16 bytes, 128 contiguous bytes each) as [D / 8][rows][8],
  // no swizzle.
  kCoreMatrices,
  // Rows of 128 bytes as [D / 64][rows][64], the 16-byte pieces of each row permuted by the
  // row's place in its group of 8 (piece c at c ^ (row % 8)): the 128-byte swizzle of TMA and
  // CUTLASS, read by the products in whole 128-byte rows.
  kSwizzled,
};

// cudaErrorInvalidValue for a head dim the candidate is not built for, cudaErrorNotSupported on
// a device that is not sm_90.
cudaError_t forward_wgmma(const Forward& call, WgmmaSchedule schedule, WgmmaLayout layout,
                          cudaStream_t stream);

// The backward pass (delta by the library's kernel, then dK/dV and dQ on wgmma): backward_cuda's
// contract. The same errors as forward_wgmma.
cudaError_t backward_wgmma(const Backward& call, WgmmaLayout layout, cudaStream_t stream);

}  // namespace pimhbm::attention
