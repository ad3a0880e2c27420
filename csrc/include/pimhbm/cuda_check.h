// Checking every CUDA call in the kernels' launchers: they return the first cudaError_t they
// meet; FFI handlers turn it into an ffi::Error of their op (ffi_error.h, cuda_status).
#pragma once

#include <cuda_runtime_api.h>

#define PIMHBM_CUDA_RETURN_IF_ERROR(expr) \
  do {                                    \
    cudaError_t pimhbm_err_ = (expr);     \
    if (pimhbm_err_ != cudaSuccess) {     \
      return pimhbm_err_;                 \
    }                                     \
  } while (0)

// After a kernel launch: configuration errors surface here, not at the launch itself. Taken
// (cudaGetLastError), not peeked: a launch refused for its configuration is reported by its own
// op, not again by every later op of the process.
#define PIMHBM_CUDA_RETURN_LAUNCH_ERROR() PIMHBM_CUDA_RETURN_IF_ERROR(cudaGetLastError())
