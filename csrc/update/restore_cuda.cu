// Predicated copy of a list of buffers: every block reads the commit flag first.
#include <cuda_runtime.h>

#include <algorithm>

#include "pimhbm/cuda_check.h"
#include "update/restore.h"

namespace pimhbm::update {
namespace {

constexpr int kMaxPairs = 64;  // per launch: the list travels in the kernel's parameters
constexpr int kThreads = 256;
constexpr int kBlocks = 264;  // enough to stream a copy on any current GPU

struct CopyList {
  const uint8_t* src[kMaxPairs];
  uint8_t* dst[kMaxPairs];
  int64_t bytes[kMaxPairs];
  int n;
};

__global__ void __launch_bounds__(kThreads) restore_kernel(const int32_t* commit, CopyList list) {
  if (*commit != 0) return;  // uniform: the common case ends here
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int k = 0; k < list.n; ++k) {
    const uint8_t* src = list.src[k];
    uint8_t* dst = list.dst[k];
    const int64_t bytes = list.bytes[k];
    const bool vec =
        (reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst)) % 16 == 0;
    const int64_t nvec = vec ? bytes / 16 : 0;
    for (int64_t i = tid; i < nvec; i += stride) {
      reinterpret_cast<uint4*>(dst)[i] = reinterpret_cast<const uint4*>(src)[i];
    }
    for (int64_t i = 16 * nvec + tid; i < bytes; i += stride) dst[i] = src[i];
  }
}

}  // namespace

cudaError_t restore_cuda(const int32_t* commit, const std::vector<CopyPair>& pairs,
                         cudaStream_t stream) {
  for (size_t start = 0; start < pairs.size(); start += kMaxPairs) {
    CopyList list{};
    list.n = static_cast<int>(std::min<size_t>(kMaxPairs, pairs.size() - start));
    for (int k = 0; k < list.n; ++k) {
      list.src[k] = static_cast<const uint8_t*>(pairs[start + k].src);
      list.dst[k] = static_cast<uint8_t*>(pairs[start + k].dst);
      list.bytes[k] = pairs[start + k].src == pairs[start + k].dst ? 0 : pairs[start + k].bytes;
    }
    restore_kernel<<<kBlocks, kThreads, 0, stream>>>(commit, list);
    PIMHBM_CUDA_RETURN_LAUNCH_ERROR();
  }
  return cudaSuccess;
}

}  // namespace pimhbm::update
