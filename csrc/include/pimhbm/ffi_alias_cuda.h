// The CUDA side of ffi_alias.h: the operand copied into a result XLA did not alias with it,
// on the op's stream (so before the op's kernels), device to device.
#pragma once

#include <cuda_runtime_api.h>

#include <vector>

#include "pimhbm/ffi_alias.h"

namespace pimhbm::ffi_util {

inline cudaError_t copy_unaliased_cuda(const std::vector<Unaliased>& copies, cudaStream_t stream) {
  for (const Unaliased& c : copies) {
    cudaError_t err = cudaMemcpyAsync(c.to, c.from, c.bytes, cudaMemcpyDeviceToDevice, stream);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace pimhbm::ffi_util
