// The CUDA side of ffi_alias.h: the operand copied into a result XLA did not alias with it,
// on the op's stream (so before the op's kernels), device to device.
#pragma once

#include <cuda_runtime_api.h>

#include <vector>

#include "pimhbm/ffi_alias.h"

namespace pimhbm::ffi_util {

inline cudaError_t copy_unaliased_cuda(const std::vector<Unaliased>& copies, cudaStream_t stream) {
  if (!copies.empty()) {
    // Recorded into a command buffer, the copies run on every replay of it: say so in the tally.
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    cudaError_t err = cudaStreamIsCapturing(stream, &capture);
    if (err != cudaSuccess) return err;
    if (capture == cudaStreamCaptureStatusActive) {
      std::lock_guard<std::mutex> lock(unaliased_mutex);
      for (const Unaliased& c : copies) unaliased_by_op[c.op].in_command_buffer += 1;
    }
  }
  for (const Unaliased& c : copies) {
    cudaError_t err = cudaMemcpyAsync(c.to, c.from, c.bytes, cudaMemcpyDeviceToDevice, stream);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace pimhbm::ffi_util
