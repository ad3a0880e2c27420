// Repair and the device copy's restore on the GPU: one block per listed (or selected) chunk.
#include <cuda_runtime.h>

#include <algorithm>

#include "pimhbm/block_digest.cuh"
#include "pimhbm/cuda_check.h"
#include "repair/repair.h"

namespace pimhbm::repair {
namespace {

constexpr int kThreads = 256;

// Chunk c's bytes at `data` (len of them) against the digest row `row`.
__device__ __forceinline__ bool block_verifies(const uint8_t* data, int64_t len,
                                               const uint32_t* row, int64_t c, uint64_t* scratch) {
  const uint64_t d = block_chunk_digest(data, len, static_cast<uint64_t>(c), scratch);
  return d == digest_join(row[0], row[1]);
}

__global__ void __launch_bounds__(kThreads)
    repair_kernel(const int32_t* __restrict__ chunks, int64_t nlisted, Sources sources,
                  MutableChunkedTensor dst, int32_t* __restrict__ status) {
  __shared__ uint64_t scratch[32];
  const int64_t n = num_chunks(dst.nbytes, dst.chunk_bytes);
  for (int64_t k = blockIdx.x; k < nlisted; k += gridDim.x) {
    const int64_t c = chunks[k];  // block-uniform
    const int s = sources.which ? sources.which[k] : 0;
    int32_t result;
    if (c < 0 || s == sources.self) {
      result = kNotListed;
    } else if (c >= n || s < 0 || s >= sources.count) {
      result = kOutOfRange;
    } else {
      const ChunkedTensor& src = sources.tensor[s];
      const int64_t at = sources.packed ? k : c;  // where the source holds it (block-uniform)
      const uint8_t* from = src.data + at * src.chunk_bytes;
      const uint32_t* row = src.table + 2 * at;
      const int64_t len = chunk_length(dst.nbytes, dst.chunk_bytes, c);
      if (!block_verifies(from, len, row, c, scratch)) {
        result = kSourceDamaged;
      } else {
        uint8_t* to = dst.data + c * dst.chunk_bytes;
        block_copy(from, to, len);
        if (threadIdx.x == 0) {
          dst.table[2 * c] = row[0];
          dst.table[2 * c + 1] = row[1];
        }
        __syncthreads();
        result = block_verifies(to, len, dst.table + 2 * c, c, scratch) ? kRepaired : kStillDamaged;
      }
    }
    if (threadIdx.x == 0) status[k] = result;
  }
}

struct CleanList {
  CleanPair pair[kMaxCleanPairs];
  int count;
};

__global__ void __launch_bounds__(kThreads)
    restore_clean_kernel(const int32_t* __restrict__ commit, const __grid_constant__ CleanList L) {
  if (*commit != 0) return;  // uniform: the common case ends here
  for (int k = 0; k < L.count; ++k) {
    const CleanPair& p = L.pair[k];
    const int64_t n = num_chunks(p.dst.nbytes, p.dst.chunk_bytes);
    for (int64_t c = blockIdx.x; c < n; c += gridDim.x) {
      if (p.faults[c] != 0) continue;  // block-uniform
      block_copy(p.src.data + c * p.src.chunk_bytes, p.dst.data + c * p.dst.chunk_bytes,
                 chunk_length(p.dst.nbytes, p.dst.chunk_bytes, c));
      if (threadIdx.x == 0) {
        p.dst.table[2 * c] = p.src.table[2 * c];
        p.dst.table[2 * c + 1] = p.src.table[2 * c + 1];
      }
    }
  }
}

}  // namespace

cudaError_t repair_from_cuda(const int32_t* chunks, int64_t nlisted, const Sources& sources,
                             const MutableChunkedTensor& dst, int32_t* status,
                             cudaStream_t stream) {
  if (nlisted == 0) return cudaSuccess;
  const int blocks = static_cast<int>(std::min<int64_t>(nlisted, 4096));
  repair_kernel<<<blocks, kThreads, 0, stream>>>(chunks, nlisted, sources, dst, status);
  PIMHBM_CUDA_RETURN_LAUNCH_ERROR();
  return cudaSuccess;
}

cudaError_t repair_cuda(const int32_t* chunks, int64_t nlisted, const ChunkedTensor& src,
                        const MutableChunkedTensor& dst, int32_t* status, cudaStream_t stream) {
  Sources one{};
  one.tensor[0] = src;
  one.count = 1;
  one.which = nullptr;
  one.self = -1;
  return repair_from_cuda(chunks, nlisted, one, dst, status, stream);
}

cudaError_t restore_clean_cuda(const int32_t* commit, const CleanPair* pairs, size_t count,
                               cudaStream_t stream) {
  // One launch per kMaxCleanPairs tensors; each block walks every tensor's chunks. The common
  // case (the step committed) costs one launch that returns at once.
  for (size_t start = 0; start < count; start += kMaxCleanPairs) {
    CleanList list{};
    list.count = static_cast<int>(std::min<size_t>(kMaxCleanPairs, count - start));
    int64_t most = 0;
    for (int k = 0; k < list.count; ++k) {
      list.pair[k] = pairs[start + k];
      most = std::max(most, num_chunks(list.pair[k].dst.nbytes, list.pair[k].dst.chunk_bytes));
    }
    if (most == 0) continue;
    const int blocks = static_cast<int>(std::min<int64_t>(most, 1024));
    restore_clean_kernel<<<blocks, kThreads, 0, stream>>>(commit, list);
    PIMHBM_CUDA_RETURN_LAUNCH_ERROR();
  }
  return cudaSuccess;
}

cudaError_t restore_clean_cuda(const int32_t* commit, const int32_t* faults,
                               const ChunkedTensor& src, const MutableChunkedTensor& dst,
                               cudaStream_t stream) {
  const CleanPair one{faults, src, dst};
  return restore_clean_cuda(commit, &one, 1, stream);
}

}  // namespace pimhbm::repair
