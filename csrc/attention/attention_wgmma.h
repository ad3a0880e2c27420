// pimhbm.attention on Hopper's warpgroup products (wgmma, sm_90a code): what the FFI handlers
// take on an sm_90 device at head dims 64 and 128; the mma.sync kernels (attention_cuda.cu)
// serve every other device and head dim. They keep forward_cuda's and backward_cuda's contracts
// (attention.h): the same layouts and outputs, every sum in a fixed order, two calls bitwise
// equal. The backward pass sums in the mma.sync kernels' order (bench/NOTES.md: its outputs
// were bitwise theirs at 4k and 16k, run 148); the forward pass rescales at key tiles of 128,
// not 64.
#pragma once

#include <cuda_runtime_api.h>

#include "attention/attention.h"

namespace pimhbm::attention {

// The head dims the wgmma kernels are built for.
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

// cudaErrorInvalidValue for a head dim they are not built for, cudaErrorNotSupported on a
// device that is not sm_90.
cudaError_t forward_wgmma(const Forward& call, WgmmaSchedule schedule, cudaStream_t stream);

// The backward pass (delta by the mma.sync kernels' delta_cuda, then dK/dV and dQ on wgmma):
// backward_cuda's contract. The same errors as forward_wgmma.
cudaError_t backward_wgmma(const Backward& call, cudaStream_t stream);

}  // namespace pimhbm::attention
