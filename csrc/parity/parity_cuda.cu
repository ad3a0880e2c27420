// Parity rows and rebuilds on the GPU: rows a thread per 16-byte column (aligned data) or a
// block per group (a view at an odd offset), rebuilds a block per listed chunk, threads over the
// row's 32-bit words. A chunk's bytes past the tensor's end read as zero and are never loaded:
// the word that holds the end is read byte by byte.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "parity/parity.h"
#include "pimhbm/block_digest.cuh"
#include "pimhbm/cuda_check.h"
#include "repair/repair.h"

namespace pimhbm::parity {
namespace {

constexpr int kThreads = 256;

// Word w (bytes 4w .. 4w + 3) of the bytes [0, len) at p, zero past len. p is 4-byte aligned
// (chunks are multiples of 16 bytes into an XLA buffer).
__device__ __forceinline__ uint32_t word_at(const uint8_t* p, int64_t len, int64_t w) {
  const int64_t b = 4 * w;
  if (b + 4 <= len) return reinterpret_cast<const uint32_t*>(p)[w];
  uint32_t v = 0;
  for (int64_t i = b; i < len; ++i) v |= static_cast<uint32_t>(p[i]) << (8 * (i - b));
  return v;
}

__device__ __forceinline__ void store_word(uint8_t* p, int64_t len, int64_t w, uint32_t v) {
  const int64_t b = 4 * w;
  if (b + 4 <= len) {
    reinterpret_cast<uint32_t*>(p)[w] = v;
    return;
  }
  for (int64_t i = b; i < len; ++i) p[i] = static_cast<uint8_t>(v >> (8 * (i - b)));
}

__device__ __forceinline__ int64_t chunk_len(int64_t nbytes, int64_t chunk_bytes, int64_t c) {
  return min(chunk_bytes, nbytes - c * chunk_bytes);
}

__global__ void __launch_bounds__(kThreads)
    parity_kernel(const uint8_t* __restrict__ data, int64_t nbytes, int64_t chunk_bytes,
                  int64_t group, int64_t groups, uint32_t* __restrict__ rows) {
  const int64_t chunks = (nbytes + chunk_bytes - 1) / chunk_bytes;
  const int64_t words = chunk_bytes / 4;
  for (int64_t g = blockIdx.x; g < groups; g += gridDim.x) {
    const GroupSpan span = group_span(chunks, group, g);
    for (int64_t w = threadIdx.x; w < words; w += blockDim.x) {
      uint32_t acc = 0;
      for (uint32_t m = 0; m < span.count; ++m) {
        const int64_t c = span.chunk(m);
        acc ^= word_at(data + c * chunk_bytes, chunk_len(nbytes, chunk_bytes, c), w);
      }
      rows[g * words + w] = acc;
    }
  }
}

__device__ __forceinline__ uint4 xor4(uint4 a, uint4 b) {
  return make_uint4(a.x ^ b.x, a.y ^ b.y, a.z ^ b.z, a.w ^ b.w);
}

// The same rows from 16-byte-aligned data, a thread per 16-byte column of a row: a whole
// group's loads are issued before their XORs, so that a thread keeps several 16-byte loads in
// flight where parity_kernel keeps one 4-byte load (it read at ~1 TB/s: bench/NOTES.md).
__global__ void __launch_bounds__(kThreads)
    parity_columns_kernel(const uint8_t* __restrict__ data, int64_t nbytes, int64_t chunk_bytes,
                          int64_t group, int64_t groups, uint4* __restrict__ rows) {
  const int64_t cols = chunk_bytes / 16;
  const int64_t chunks = (nbytes + chunk_bytes - 1) / chunk_bytes;
  const int64_t whole = nbytes / chunk_bytes;  // chunks that hold chunk_bytes
  const uint4* columns = reinterpret_cast<const uint4*>(data);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < groups * cols;
       i += stride) {
    const int64_t g = i / cols, col = i % cols;
    const GroupSpan span = group_span(chunks, group, g);
    const int64_t last = span.chunk(span.count - 1);  // its highest chunk
    uint4 acc = make_uint4(0, 0, 0, 0);
    if (last < whole) {
#pragma unroll 8
      for (uint32_t m = 0; m < span.count; ++m) {
        acc = xor4(acc, __ldg(columns + span.chunk(m) * cols + col));
      }
    } else {
      uint32_t w[4] = {0, 0, 0, 0};
      for (uint32_t m = 0; m < span.count; ++m) {
        const int64_t c = span.chunk(m);
        const int64_t len = chunk_len(nbytes, chunk_bytes, c);
        for (int k = 0; k < 4; ++k) w[k] ^= word_at(data + c * chunk_bytes, len, 4 * col + k);
      }
      acc = make_uint4(w[0], w[1], w[2], w[3]);
    }
    rows[i] = acc;
  }
}

__global__ void __launch_bounds__(kThreads)
    rebuild_kernel(Grouped t, const uint32_t* __restrict__ rows, const int32_t* __restrict__ list,
                   int64_t count, int32_t* __restrict__ status) {
  __shared__ uint64_t scratch[32];
  const int64_t chunks = (t.nbytes + t.chunk_bytes - 1) / t.chunk_bytes;
  const int64_t words = t.chunk_bytes / 4;
  for (int64_t k = blockIdx.x; k < count; k += gridDim.x) {
    const int64_t c = list[k];  // block-uniform
    const int64_t g = c >= 0 && c < chunks ? group_of(chunks, t.group, c) : -1;
    bool conflict = false;
    for (int64_t j = 0; j < count && g >= 0; ++j) {
      conflict |=
          j != k && list[j] >= 0 && list[j] < chunks && group_of(chunks, t.group, list[j]) == g;
    }
    int32_t result;
    if (c < 0) {
      result = repair::kNotListed;
    } else if (c >= chunks) {
      result = repair::kOutOfRange;
    } else if (conflict) {
      result = kGroupConflict;
    } else {
      const GroupSpan span = group_span(chunks, t.group, g);
      const int64_t len = chunk_len(t.nbytes, t.chunk_bytes, c);
      uint8_t* to = t.data + c * t.chunk_bytes;
      for (int64_t w = threadIdx.x; w < words; w += blockDim.x) {
        uint32_t acc = rows[g * words + w];
        for (uint32_t m = 0; m < span.count; ++m) {
          const int64_t j = span.chunk(m);
          if (j != c)
            acc ^= word_at(t.data + j * t.chunk_bytes, chunk_len(t.nbytes, t.chunk_bytes, j), w);
        }
        store_word(to, len, w, acc);
      }
      __syncthreads();
      const uint64_t d =
          block_chunk_digest(to, len, static_cast<uint64_t>(grouped_base(t) + c), scratch);
      result = d == digest_join(t.table[2 * c], t.table[2 * c + 1]) ? repair::kRepaired
                                                                    : repair::kStillDamaged;
    }
    if (threadIdx.x == 0) status[k] = result;
  }
}

int grid_for(int64_t work) { return static_cast<int>(std::min<int64_t>(work, 65535)); }

}  // namespace

cudaError_t parity_cuda(const uint8_t* data, int64_t nbytes, int64_t chunk_bytes, int64_t group,
                        uint32_t* rows, cudaStream_t stream) {
  const int64_t groups = num_groups(nbytes, chunk_bytes, group);
  if (groups == 0) return cudaSuccess;
  const bool aligned =
      (reinterpret_cast<uintptr_t>(data) | reinterpret_cast<uintptr_t>(rows)) % 16 == 0;
  if (aligned) {
    const int64_t threads = groups * (chunk_bytes / 16);
    const int64_t blocks = std::min<int64_t>((threads + kThreads - 1) / kThreads, 1 << 20);
    parity_columns_kernel<<<static_cast<int>(blocks), kThreads, 0, stream>>>(
        data, nbytes, chunk_bytes, group, groups, reinterpret_cast<uint4*>(rows));
  } else {  // a view at an odd offset (XLA's own buffers are aligned): a word a thread
    parity_kernel<<<grid_for(groups), kThreads, 0, stream>>>(data, nbytes, chunk_bytes, group,
                                                             groups, rows);
  }
  PIMHBM_CUDA_RETURN_LAUNCH_ERROR();
  return cudaSuccess;
}

cudaError_t rebuild_cuda(const Grouped& t, const uint32_t* rows, const int32_t* list, int64_t count,
                         int32_t* status, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  rebuild_kernel<<<grid_for(count), kThreads, 0, stream>>>(t, rows, list, count, status);
  PIMHBM_CUDA_RETURN_LAUNCH_ERROR();
  return cudaSuccess;
}

}  // namespace pimhbm::parity
