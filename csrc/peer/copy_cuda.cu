// One launch copies every segment: blockIdx.y is the peer, the x blocks stride over its bytes.
// Peers' buffers are read directly over NVLink/PCIe (peer access enabled by the caller).
#include <cuda_runtime.h>

#include <algorithm>

#include "peer/copy.h"
#include "pimhbm/cuda_check.h"

namespace pimhbm::peer {
namespace {

constexpr int kThreads = 512;

__global__ void __launch_bounds__(kThreads) copy_kernel(Segments segments, uint8_t* out) {
  const int p = blockIdx.y;
  const uint8_t* src = segments.src[p];
  uint8_t* dst = out + p * segments.bytes;
  const int64_t n = segments.bytes;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  // 16-byte words where both ends are 16-byte aligned (XLA's buffers are; a segment offset
  // may not be), bytes for the rest and for the tail.
  const bool wide =
      ((reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst)) & 15) == 0;
  int64_t done = 0;
  if (wide) {
    const int64_t words = n / 16;
    const uint4* s4 = reinterpret_cast<const uint4*>(src);
    uint4* d4 = reinterpret_cast<uint4*>(dst);
    for (int64_t i = first; i < words; i += stride) d4[i] = s4[i];
    done = words * 16;
  }
  for (int64_t i = done + first; i < n; i += stride) dst[i] = src[i];
}

}  // namespace

cudaError_t copy_segments_cuda(const Segments& segments, uint8_t* out, cudaStream_t stream) {
  if (segments.bytes == 0 || segments.count == 0) return cudaSuccess;
  const int64_t words = std::max<int64_t>(segments.bytes / 16, 1);
  // Enough blocks to keep every SM's loads in flight across the link; no more than the data.
  const int blocks = static_cast<int>(std::min<int64_t>((words + kThreads - 1) / kThreads, 264));
  copy_kernel<<<dim3(blocks, segments.count), kThreads, 0, stream>>>(segments, out);
  PIMHBM_CUDA_RETURN_LAUNCH_ERROR();
  return cudaSuccess;
}

}  // namespace pimhbm::peer
