// Commit or skip, decided on the device: after a guarded update has written the new state to
// the write side, `restore` copies the read side back over the write side when the step must
// not commit (*commit == 0), and does nothing otherwise. Either way the write side then holds
// the state to continue from, with no host synchronisation and no conditional in the program.
#pragma once

#include <cstdint>
#include <vector>

#if defined(PIMHBM_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace pimhbm::update {

struct CopyPair {
  const void* src;
  void* dst;
  int64_t bytes;
};

void restore_cpu(const int32_t* commit, const std::vector<CopyPair>& pairs);

#if defined(PIMHBM_WITH_CUDA)
// `commit` is in device memory; every block reads it first and returns at once when it is
// non-zero, so the common (commit) case costs one small launch per 64 pairs.
cudaError_t restore_cuda(const int32_t* commit, const std::vector<CopyPair>& pairs,
                         cudaStream_t stream);
#endif

}  // namespace pimhbm::update
