// A CUDA driver API function through the runtime's driver entry point, so that nothing links
// libcuda: a binary must still start (and say what it cannot do) on a machine without a driver.
#pragma once

#include <cuda_runtime_api.h>

namespace pimhbm {

// `name` as the driver's function of type Fn (for example decltype(&cuMemMap)), or nullptr when
// the driver has none.
template <class Fn>
Fn cuda_driver_fn(const char* name) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult found{};
#if CUDART_VERSION >= 12050
  const cudaError_t err =
      cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &found);
#else
  const cudaError_t err = cudaGetDriverEntryPoint(name, &p, cudaEnableDefault, &found);
#endif
  if (err != cudaSuccess || found != cudaDriverEntryPointSuccess || p == nullptr) {
    cudaGetLastError();  // not sticky, but leave no error behind for the caller's next check
    return nullptr;
  }
  return reinterpret_cast<Fn>(p);
}

}  // namespace pimhbm
